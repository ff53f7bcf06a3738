"""Smoke tests: benchmarks/kernels.py runs on CPU (--small), and its --check (kernels in the
Pallas interpreter against the spec on the CPU device) passes and can fail."""

import os
import subprocess
import sys
from pathlib import Path

from _bench import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **FAST_COMPILE)
  return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), *args],
                        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_kernels_benchmark_small_runs():
  proc = _run("--small", "--iters", "1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "## quantize" in out and "## GEMM" in out
  assert "copy (XLA negate" in out and "XLA fp32 matmul" in out
  assert out.count("XLA-fused spec") == 8 and out.count("jaxlp.quantize (dispatch)") == 8
  assert out.count("jnp reference") == 5


def test_kernels_check_interpreted_is_bit_exact():
  """The quantize kernel of every rounding of MXFP4 (and rand_bits) has the spec's bits; the
  GEMM kernel's check is in test_check_reports_a_mismatch's run (its kernel is not
  perturbed)."""
  proc = _run("--small", "--check", "--interpret", "--iters", "1", "--only", "mx(E2M1FN)")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert proc.stdout.count("kernel: BIT-EXACT") == 7  # 6 roundings + rand_bits
  assert "# check: all BIT-EXACT" in proc.stdout


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


def test_ptx_per_mac_benchmark_runs():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **FAST_COMPILE)
  script = ROOT / "benchmarks" / "tools" / "ptx_per_mac.py"
  proc = subprocess.run([sys.executable, str(script), "--small"], capture_output=True, text=True,
                        timeout=300, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  gemm, block = proc.stdout.split("# exact block GEMM")
  rows = [line for line in gemm.splitlines() if line.startswith("  ") and "MAC" not in line]
  assert len(rows) == 5, proc.stdout
  per_mac = [float(r.split()[-1]) for r in rows]
  assert all(5 < v < 1000 for v in per_mac), proc.stdout
  # the bf16 route: one FMA per output per K-block plus the loop's loads and wgmma
  rows = [line.split() for line in block.splitlines() if line.startswith("  g = ")]
  assert [r[2] for r in rows] == ["24", "32", "9", "1"], proc.stdout
  assert all(1 <= float(r[4]) < 4 for r in rows), proc.stdout
