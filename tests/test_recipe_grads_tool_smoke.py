"""Smoke test of benchmarks/tools/recipe_grads.py: a row per policy (two for a stochastic one),
a cosine / norm ratio per kernel, BF16 within rounding of fp32; bad options are refused."""

import pytest
from _bench import load_benchmark

pytest.importorskip("optax", reason="the tool trains jaxlp.training's CNN (examples extra)")

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_recipe_grads_small(capsys):
  mod = load_benchmark("recipe_grads")
  assert mod.main(["--small"]) == 0
  rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
          if line.startswith("| bf16 |") or line.startswith("| nvfp4+sr |")]
  assert [(r[0].strip(), r[1].strip()) for r in rows] == [
      ("bf16", "nearest"), ("nvfp4+sr", "one key"), ("nvfp4+sr", "mean of 2 keys")]
  for r in rows:
    cells = [tuple(float(v) for v in c.split("/")) for c in r[2:]]
    assert len(cells) == 4 and all(0.5 < cos <= 1.0 and 0.5 < ratio < 2 for cos, ratio in cells)
  assert all(float(c.split("/")[0]) > 0.99 for c in rows[0][2:])  # bf16 ~ fp32


@pytest.mark.parametrize("argv", [["--policies", "fp4"], ["--keys", "0"],
                                  ["--policies", "nvfp4+tile"]])
def test_recipe_grads_refuses_bad_options(argv, capsys):
  mod = load_benchmark("recipe_grads")
  with pytest.raises(SystemExit):
    mod.main(argv)
  assert "error" in capsys.readouterr().err
