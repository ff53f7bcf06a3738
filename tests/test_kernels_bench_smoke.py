"""Smoke tests: benchmarks/kernels.py runs on CPU (--small), and its --check (kernels in the
Pallas interpreter against the spec on the CPU device) passes and can fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]


#: The two --small runs of kernels.py and the ptx_per_mac --small run, in ONE Python process,
#: one after the other (each script as its own ``__main__``, as ``python SCRIPT ARGS`` runs
#: it; the outputs and exit statuses kept apart): one interpreter start and one import of JAX
#: and jaxlp instead of three. The perturbed kernel of test_check_reports_a_mismatch keeps a
#: process of its own.
RUNS = {
    "small": ("kernels.py", "--small", "--iters", "1"),
    "check": ("kernels.py", "--small", "--check", "--interpret", "--iters", "1", "--only",
              "mx(E2M1FN)"),
    "ptx": ("tools/ptx_per_mac.py", "--small"),
}
_RUN_ALL = r"""
import contextlib, io, json, runpy, sys
root, runs, res = sys.argv[1], json.loads(sys.argv[2]), {}
for key, (script, *args) in runs.items():
  out, err, code = io.StringIO(), io.StringIO(), 0
  sys.argv = [script, *args]
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      runpy.run_path(f"{root}/benchmarks/{script}", run_name="__main__")
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  res[key] = (code, out.getvalue(), err.getvalue())
print(json.dumps(res))
"""
# one worker runs the shared process (pytest-xdist --dist loadgroup)
_GROUP = pytest.mark.xdist_group("kernels_bench_runs")


@pytest.fixture(scope="module")
def runs():
  """{key of RUNS: (exit status, stdout, stderr)}."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **FAST_COMPILE)
  proc = subprocess.run([sys.executable, "-c", _RUN_ALL, str(ROOT), json.dumps(RUNS)],
                        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return {k: tuple(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


@_GROUP
def test_kernels_benchmark_small_runs(runs):
  code, out, err = runs["small"]
  assert code == 0, err[-3000:]
  assert "## quantize" in out and "## GEMM" in out
  assert "copy (XLA negate" in out and "XLA fp32 matmul" in out
  assert out.count("XLA-fused spec") == 8 and out.count("jaxlp.quantize (dispatch)") == 8
  assert out.count("jnp reference") == 5


@_GROUP
def test_kernels_check_interpreted_is_bit_exact(runs):
  """The quantize kernel of every rounding of MXFP4 (and rand_bits) has the spec's bits; the
  GEMM kernel's check is in test_check_reports_a_mismatch's run (its kernel is not
  perturbed)."""
  code, out, err = runs["check"]
  assert code == 0, out[-3000:] + err[-3000:]
  assert out.count("kernel: BIT-EXACT") == 7  # 6 roundings + rand_bits
  assert "# check: all BIT-EXACT" in out


def test_check_reports_a_mismatch():
  """The check compares with the CPU spec, not with the kernel itself: a perturbed quantize
  kernel's output is reported (exit status 1), while in the same run the Kahan GEMM kernel
  (``--only cpd_float(5,2)`` selects both) is bit-exact against the reference on this device
  and on the CPU."""
  code = (
      "import sys, runpy, importlib\n"
      "PQ = importlib.import_module('jaxlp.pallas._quantize')\n"
      "real = PQ.quantize\n"
      "PQ.quantize = lambda *a, **k: real(*a, **k) * 1.0000001\n"
      f"sys.argv = ['kernels.py', '--small', '--check', '--interpret', '--iters', '1',"
      f" '--only', 'cpd_float(5,2)']\n"
      f"runpy.run_path({str(ROOT / 'benchmarks' / 'kernels.py')!r}, run_name='__main__')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **FAST_COMPILE)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=600, env=env, cwd=ROOT)
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "kernel: " in proc.stdout and " DIFFER" in proc.stdout.split("## GEMM bit-exactness")[0]
  gemm = [ln for ln in proc.stdout.splitlines() if ln.startswith("  kahan, mul=acc=cpd_float")]
  assert gemm[-1].endswith("vs same-device reference: BIT-EXACT; vs CPU: BIT-EXACT"), gemm


@_GROUP
def test_ptx_per_mac_benchmark_runs(runs):
  code, out, err = runs["ptx"]
  assert code == 0, err[-3000:]
  gemm, block = out.split("# exact block GEMM")
  rows = [line for line in gemm.splitlines() if line.startswith("  ") and "MAC" not in line]
  assert len(rows) == 5, out
  per_mac = [float(r.split()[-1]) for r in rows]
  assert all(5 < v < 1000 for v in per_mac), out
  # the bf16 route: one FMA per output per K-block plus the loop's loads and wgmma
  rows = [line.split() for line in block.splitlines() if line.startswith("  g = ")]
  assert [r[2] for r in rows] == ["24", "32", "9", "1"], out
  assert all(1 <= float(r[4]) < 4 for r in rows), out
