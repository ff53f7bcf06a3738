"""Smoke test of benchmarks/sequence.py --small: every matmul of the transformer step quantized
(matmul_report), the exact mode either timed or reported "not supported yet" with its reason,
the wire-bytes table of the language models; the opt-in NVFP4 recipe row and --no-wire, the
gradient check; bad --policies / --models refused."""

import json
import os
import subprocess
import sys

import pytest
from _bench import FAST_COMPILE, load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_sequence_benchmark_small(tmp_path):
  """As a command: the transformer's fp32 row and the HBFP8 exact row (``hbfp8_exact``: the
  ``hbfp8`` policy with ``block_dot="exact"``; the plain ``hbfp8`` row runs the same code with
  the other policy, and that policy's gradients are checked by
  test_sequence_benchmark_gradient_check), and the wire table."""
  out = tmp_path / "sequence.json"
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             **FAST_COMPILE)
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sequence.py"),
                      "--small", "--models", "transformer", "--policies", "fp32,hbfp8_exact",
                      "--json", str(out)],
                     capture_output=True, text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  data = json.loads(out.read_text())
  rows = {row["policy"]: row for row in data["steps"]}
  assert list(rows) == ["fp32", "hbfp8_exact"]
  assert rows["fp32"]["step_ms"] > 0 and rows["fp32"]["ratio"] == 1.0
  exact = rows["hbfp8_exact"]
  assert exact["status"] == "ok" or exact["status"].startswith("not supported yet: "), exact
  assert (exact["step_ms"] is not None) == (exact["status"] == "ok")
  if exact["status"] == "ok":
    assert exact["ratio"] > 0
    done, total = map(int, exact["matmuls"].split("/"))
    assert done == total > 20  # every matmul of the step, attention and tied logits included
  assert "| hbfp8_exact | " in r.stdout and "GPU rows: not measured" in r.stdout
  wire = data["wire"]
  cases = {(w["model"], w["vocab"]) for w in wire}
  assert cases == {(m, v) for m in ("lstm", "transformer", "bert") for v in (257, 10001)}
  for case in cases:
    mine = {w["config"]: w for w in wire if (w["model"], w["vocab"]) == case}
    assert mine["fp32 all-reduce (ring)"]["vs_fp32"] == 1.0
    assert 0 < mine["CGX 4-bit, bucket 1024"]["wire_bytes"] < mine["fp32 all-reduce (ring)"][
        "wire_bytes"]
    if case[1] == 10001:  # with words, the embedding is the largest leaf
      assert mine["onebit"]["largest_leaf"] == 10001 * 128


def test_sequence_benchmark_nvfp4_rows(tmp_path, capsys):
  """The opt-in ``nvfp4_recipe`` row (``--policies``; NVFP4 with 16x16 weight tiles,
  stochastic gradients and the RHT) runs, quantizes every matmul of the step and reports its
  compile time (the LSTM: seconds, not the transformer's minute); --no-wire leaves the wire
  table out. (The plain ``nvfp4`` row runs the same code with the same format and the recipe's
  pieces off -- tests/ops/test_recipes.py: ``recipe_policy("nvfp4")`` is ``nvfp4_recipe``
  without them --; every run of the script builds its policy.)"""
  out = tmp_path / "sequence.json"
  mod = load_benchmark("sequence")
  mod.main(["--small", "--models", "lstm", "--policies", "nvfp4_recipe", "--no-wire", "--json",
            str(out)])
  text = capsys.readouterr().out
  data = json.loads(out.read_text())
  (row,) = data["steps"]
  assert row["policy"] == "nvfp4_recipe" and row["ratio"] is None  # no fp32 row
  assert row["status"] == "ok" and row["step_ms"] > 0 and row["compile_s"] > 0, row
  done, total = map(int, row["matmuls"].split("/"))
  assert done == total > 0, row
  assert data["wire"] == [] and "| nvfp4_recipe | " in text and "| vocab |" not in text


def test_sequence_benchmark_gradient_check(capsys):
  """--grads: each 8-bit policy's gradient of one LSTM loss against fp32, leaf by leaf (HBFP8
  keeps every direction; MXFP8's floor-rule scales clip block maxima, so its gradients are
  shorter)."""
  mod = load_benchmark("sequence")
  rows = {r["policy"]: r for r in mod.main(["--grads", "--small", "--models", "lstm"])}
  assert list(rows) == ["hbfp8", "mxfp8", "e4m3", "e5m2"]
  assert rows["hbfp8"]["min_cos"] > 0.98 and rows["hbfp8"]["leaves"] == 26
  assert rows["hbfp8"]["cos_all"] >= rows["hbfp8"]["min_cos"] - 1e-9
  assert rows["mxfp8"]["median_norm_ratio"] < 0.95
  assert "| lstm | mxfp8 | 26 |" in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [(["--policies", "fp32,hbfp9"], "--policies"),
                                          (["--models", "gru"], "--models"),
                                          (["--steps", "0"], "--steps")])
def test_sequence_benchmark_refuses_bad_arguments(args, needle, capsys):
  mod = load_benchmark("sequence")
  with pytest.raises(SystemExit) as e:
    mod.main(["--small", *args])
  assert e.value.code == 2 and needle in capsys.readouterr().err
