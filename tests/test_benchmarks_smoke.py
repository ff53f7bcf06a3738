"""Smoke test: benchmarks/quantize.py --small runs and prints its table."""

import os
import pathlib
import subprocess
import sys

from _bench import FAST_COMPILE, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quantize_benchmark_small():
  env = dict(os.environ, **FAST_COMPILE)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = xla_flags()
  r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantize.py"), "--small",
                      "--repeats", "1"], capture_output=True, text=True, timeout=60, env=env,
                     cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "jaxlp E4M3 nearest" in r.stdout and "numpy copyto" in r.stdout, r.stdout
