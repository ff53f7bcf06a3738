"""Smoke test: benchmarks/torch_quantize.py --small runs and prints its table."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch benchmark needs torch")


def test_torch_bench_small():
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=str(root))
  r = subprocess.run([sys.executable, str(root / "benchmarks" / "torch_quantize.py"), "--small"],
                     capture_output=True, text=True, timeout=120, env=env, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "| float_quantize | nearest |" in r.stdout
  assert "zero-copy=True" in r.stdout
