"""Counts PTX instructions per multiply-add in the GEMM kernels' k-loop (no GPU needed).

What it is for: a static proxy of the per-MAC GEMM kernels' speed (issue 48's per-MAC Kahan
goal) and of the block GEMM kernels' loops, checked on a CPU before a GPU run.

Usage:
  python benchmarks/tools/ptx_per_mac.py

A proxy for the per-MAC rounding cost, not a speed: each kernel is lowered for CUDA and
compiled for sm_90 with PyPI ``triton`` (tests/pallas/triton_compile.py); the instructions
of the innermost loop (one k step of a 64x64 output tile, 4 warps = 128 threads, so 32
outputs per thread) are counted and divided by 32. At H100 rates (~17-33 T integer/fp32
lane instructions per second) N instructions per MAC bound the kernel near 2 * 25e12 / N
FLOP/s.
"""

from __future__ import annotations

import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import importlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "pallas")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxlp import formats as F  # noqa: E402

PM = importlib.import_module("jaxlp.pallas._matmul")

CASES = [
    ("naive, acc=BF16", dict(acc=F.BF16)),
    ("naive, mul=acc=BF16", dict(mul=F.BF16, acc=F.BF16)),
    ("stochastic, acc=FP16", dict(acc=F.FP16, rounding="stochastic", key=jax.random.key(0))),
    ("kahan, acc=E5M2", dict(acc=F.E5M2, algorithm="kahan")),
    ("kahan, mul=acc=cpd_float(5,2)", dict(mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2),
                                          algorithm="kahan")),
]


def loop_instructions(ptx: str) -> list[int]:
  """Instruction count of each loop in a PTX listing (label with 'Loop Header' .. its bra)."""
  lines = ptx.splitlines()
  counts = []
  for i, line in enumerate(lines):
    m = re.match(r"^(\$L__BB\d+_\d+):.*Loop Header", line)
    if not m:
      continue
    end = next(j for j in range(i, len(lines)) if re.search(rf"bra(\.uni)?\s+{re.escape(m[1])};",
                                                            lines[j]))
    body = [s.strip() for s in lines[i + 1:end + 1]]
    counts.append(sum(1 for s in body if s and not s.startswith(("//", ".", "$"))))
  return counts


def main(argv=None):
  import argparse

  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true",
                 help="accepted, as by the other scripts, for a CI smoke run; no effect")
  p.parse_args(argv)
  import cuda_lowering as CL
  import triton_compile as TC

  if not TC.available():
    print("skipped: needs PyPI triton (pip install triton; in the test extras)")
    return 0
  s = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  print("# PTX instructions per MAC, GEMM kernels (sm_90, 64x64 tile, 4 warps)")
  print(f"  {'kernel':<34s} {'loop instrs':>12s} {'per MAC':>8s}")
  for name, kw in CASES:
    _, mods = CL.lower_for_cuda(lambda a, b, kw=kw: PM.matmul(a, b, **kw), s, s)
    ptx = TC.compile_ttir_sm90(mods[0], num_warps=4, num_stages=1)
    n = max(loop_instructions(ptx))
    print(f"  {name:<34s} {n:12d} {n / 32:8.1f}")
  # the exact block GEMM's bf16 route (jaxlp/pallas/_block_gemm.py): one K-block per loop
  # trip, 128 x 128 tile, 8 warps = 256 threads, so 64 outputs per thread
  PB = importlib.import_module("jaxlp.pallas._block_gemm")
  print("\n# exact block GEMM, bf16 route (sm_90, 128x128 tile, 8 warps, 3 stages): PTX "
        "instructions per K-block loop trip")
  print(f"  {'K-block':<34s} {'loop instrs':>12s} {'per output':>10s} {'per MAC':>8s}")
  for g in (24, 32, 9, 1):
    _, mods = CL.lower_for_cuda(lambda a, b, g=g: PB.block_gemm(a, b, g, 7, 7), s, s)
    (mod,) = [m for m in mods if "@jaxlp_block_gemm_bf16" in m]
    ptx = TC.compile_ttir_sm90(mod, num_warps=8, num_stages=3)
    n = max(loop_instructions(ptx))
    print(f"  {f'g = {g}':<34s} {n:12d} {n / 64:10.2f} {n / 64 / g:8.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
