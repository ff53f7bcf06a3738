"""Smoke test of benchmarks/tools/block_programs.py --small (in this process): both program sizes
of the stochastic block kernel give the same bits, the times read "not measured" off a GPU,
and bad counts are refused."""

import jax
import pytest
from _bench import load_benchmark

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_block_programs_small(capsys):
  mod = load_benchmark("block_programs")
  assert mod.main(["--small", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  rows = [ln for ln in out.splitlines() if ln.startswith("| ") and " | 4096 | " in ln]
  assert len(rows) == 3 and all(ln.endswith("| yes |") for ln in rows), out
  assert "| hbfp(8,24) tiles | 16384 | 16 |" in out and "| hbfp(8,24) tiles | 4096 | 4 |" in out
  if jax.default_backend() != "gpu":
    assert out.count("| not measured | not measured |") == 6


@pytest.mark.parametrize("args,needle", [(["--repeats", "0"], "--repeats must be >= 1"),
                                         (["--n", "0"], "--n must be >= 1")])
def test_block_programs_refuses_bad_counts(args, needle, capsys):
  mod = load_benchmark("block_programs")
  with pytest.raises(SystemExit) as e:
    mod.main(args)
  assert e.value.code == 2 and needle in capsys.readouterr().err
