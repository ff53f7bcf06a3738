"""benchmarks/ddp_hooks.py --pin: each worker bound to one CPU, the table printed and saying
so."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the DDP hook benchmark needs torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ddp_hooks_bench_pin_runs():
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_hooks.py"), "--steps", "1",
                      "--batch", "2", "--methods", "fp16", "--pin"], capture_output=True,
                     text=True, timeout=600, env=env, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "each process pinned to one CPU" in r.stdout
  row = next(line for line in r.stdout.splitlines() if line.startswith("fp16 "))
  assert row.count(" ms") >= 5 and "%" in row
