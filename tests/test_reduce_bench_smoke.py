"""Smoke test: benchmarks/reduce.py --small runs and prints its table."""

import json
import os
import subprocess
import sys
from pathlib import Path

from _bench import FAST_COMPILE, xla_flags

ROOT = Path(__file__).parent.parent


def test_reduce_benchmark_small(tmp_path):
  env = dict(os.environ, **FAST_COMPILE)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = xla_flags()
  # reduce.py forces 8 host devices but only *defaults* JAX_PLATFORMS to cpu: under an
  # inherited JAX_PLATFORMS=cuda,cpu its 8-device mesh would be made of the single GPU
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reduce.py"), "--small",
                        "--reps", "1", "--json", str(tmp_path / "r.json")],
                       env=env, capture_output=True, text=True, timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "| elements | variant |" in out.stdout
  data = json.loads((tmp_path / "r.json").read_text())
  names = {r["variant"] for r in data["rows"]}
  assert {"lax.psum f32", "ring E4M3 packed", "chain E4M3", "tree E4M3"} <= names
  by = {r["variant"]: r["bytes_per_worker"] for r in data["rows"]}
  assert by["ring E4M3 packed"] * 4 == by["ring E4M3 f32 wire"]
  assert data["emulation"]["emulated_8_ms"] > 0
