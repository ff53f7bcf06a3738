"""Smoke test: benchmarks/fp4.py --small runs and prints its table (torchao rows where it is
installed, a line saying why not elsewhere)."""

import os
import pathlib
import subprocess
import sys

from _bench import FAST_COMPILE, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_fp4_benchmark_small():
  env = dict(os.environ, **FAST_COMPILE)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = xla_flags()
  r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp4.py"), "--small",
                      "--repeats", "1"], capture_output=True, text=True, timeout=600, env=env,
                     cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout
  for row in ("numpy copyto", "jaxlp NVFP4 nearest", "jaxlp NVFP4 16x16 tiles nearest",
              "jaxlp MXFP4 rceil nearest", "GPU: not measured"):
    assert row in out, out
  assert "torchao NVFP4" in out or "torchao unavailable" in out, out
  assert "DIFFERENT bits" not in out, out
