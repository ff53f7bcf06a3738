"""Smoke test: benchmarks/kernels.py runs on CPU (--small, reference path)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_benchmark_small_runs():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--small",
                         "--iters", "1"], capture_output=True, text=True, timeout=120, env=env,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "## quantize" in out and "## GEMM" in out
  assert "copy (XLA negate" in out and "XLA fp32 matmul" in out
  assert out.count("GB/s") >= 7 and out.count("TFLOP/s") >= 4
