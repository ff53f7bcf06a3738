"""benchmarks/torch_quantize.py's timing options for loaded machines: ``--inner`` (calls per
repetition) and ``--stat minmed`` (the smallest median of groups of 5 repetitions)."""

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
  spec = importlib.util.spec_from_file_location(
      "_torch_quantize_bench", ROOT / "benchmarks" / "torch_quantize.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_min_of_medians_takes_the_quietest_group():
  f = _bench().STAT["minmed"]
  # groups (5, 1, 9, 9, 9) -> 9 and (2, 2, 8, 2, 7) -> 2; the short last group (1,) is ignored
  assert f([5, 1, 9, 9, 9, 2, 2, 8, 2, 7, 1]) == 2
  assert f([4, 3, 5]) == 4  # fewer than 5 repetitions: their median
  assert f([7.0] * 10) == 7.0


def test_inner_and_minmed_reach_the_table():
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  r = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "torch_quantize.py"), "--sizes", "100",
       "--shapes", "0", "--reps", "6", "--inner", "3", "--stat", "minmed", "--only",
       "fixed_point_quantize"], capture_output=True, text=True, timeout=300, env=env,
      check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "every time the min of medians of 5 of 6 repetitions" in r.stdout
  assert "each the mean of 3 calls" in r.stdout
  assert "| fixed_point_quantize | stochastic | 100 |" in r.stdout
