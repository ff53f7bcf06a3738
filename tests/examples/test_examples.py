"""Every example runs end-to-end with --smoke on built-in data.

The JAX examples run in one subprocess, one after the other (``_one_process.py``: each as its
``__main__``, as ``python examples/NAME.py --smoke`` runs it), so that they pay for the imports
and the shared compiled programs once, not once each; the multi-process one
(``torch_mnist_ddp.py``: it spawns its DDP workers) runs as its command line. Each example
keeps its own test case. They compile with XLA's optimizations off (``tests/_bench.py``,
``FAST_COMPILE``, as the benchmark scripts' smoke runs): a smoke run checks that a script runs
end to end, and compares no bits with a program compiled normally (the DDP example's check
that the ranks' parameters are identical compares two ranks compiled alike).
"""

import json
import os
import subprocess
import sys

import pytest
from _bench import FAST_COMPILE, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples"))
                  if f.endswith(".py") and not f.startswith("_"))
#: run as their own command: they start processes of their own
OWN_PROCESS = ("torch_mnist_ddp.py",)
ONE_PROCESS = [n for n in EXAMPLES if n not in OWN_PROCESS]
_GROUP = pytest.mark.xdist_group("examples_one_process")  # one worker runs the shared process


def _env(**extra):
  env = dict(os.environ, **extra)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=4")
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.fixture(scope="module")
def one_process_results(tmp_path_factory):
  """{name: {"ok", "output", "error"}} of the ONE_PROCESS examples, run in one subprocess."""
  tmp = tmp_path_factory.mktemp("examples")
  results = tmp / "results.json"
  r = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "examples", "_one_process.py"), str(results),
       *ONE_PROCESS], capture_output=True, text=True, env=_env(**FAST_COMPILE), cwd=str(tmp),
      timeout=1200)
  got = json.loads(results.read_text()) if results.exists() else {}
  return got, f"exit code {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_examples_are_listed():
  assert len(EXAMPLES) >= 7, EXAMPLES
  assert set(OWN_PROCESS) <= set(EXAMPLES), OWN_PROCESS


@pytest.mark.parametrize("name", [pytest.param(n, marks=_GROUP) for n in ONE_PROCESS] +
                         list(OWN_PROCESS))
def test_example_smoke(name, tmp_path, request):
  if name in OWN_PROCESS:
    args = [sys.executable, os.path.join(ROOT, "examples", name), "--smoke"]
    r = subprocess.run(args, capture_output=True, text=True, env=_env(**FAST_COMPILE),
                       cwd=str(tmp_path), timeout=600)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return
  results, log = request.getfixturevalue("one_process_results")
  assert name in results, f"{name} did not run in the shared process:\n{log}"
  res = results[name]
  assert res["ok"], f"{name} failed:\n{res['output'][-3000:]}\n{res['error'][-3000:]}"
