"""Smoke test: benchmarks/ddp_hooks.py runs PyTorch's and jaxlp's fp16 hook side by side in a
2-process gloo job and prints its table."""

import os
import pathlib
import subprocess
import sys

import pytest
from _bench import FAST_COMPILE

pytest.importorskip("torch", reason="the DDP hook benchmark needs torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ddp_hooks_bench_runs():
  env = dict(os.environ, PYTHONPATH=str(ROOT), **FAST_COMPILE)
  r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_hooks.py"), "--steps", "1",
                      "--batch", "2", "--methods", "fp16"], capture_output=True, text=True,
                     timeout=600, env=env, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "DDP hooks, 2 processes (gloo, CPU)" in r.stdout and "load average" in r.stdout
  row = next(line for line in r.stdout.splitlines() if line.startswith("fp16 "))
  assert row.count(" ms") >= 5 and "%" in row
