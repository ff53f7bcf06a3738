"""Every example runs end-to-end with --smoke on built-in data."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples"))
                  if f.endswith(".py") and not f.startswith("_"))


def test_examples_are_listed():
  assert len(EXAMPLES) >= 7, EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_smoke(name, tmp_path):
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  env["JAX_PLATFORMS"] = "cpu"
  args = [sys.executable, os.path.join(ROOT, "examples", name), "--smoke"]
  r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(tmp_path),
                     timeout=600)
  assert r.returncode == 0, f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
