"""Checks on a GPU the stochastic block quantize kernel's program size (4,096 vs 16,384 elements).

What it is for: the size was cut to 4,096 elements per program on the evidence of sm_90
compile times measured without a GPU; this tool measures, on a GPU, the first call (Triton's
compile) and the steady-state time at 4,096 elements per program (the default since
2026-11-28, ``MAX_PROGRAM_ELEMENTS_STOCHASTIC``) against 16,384 (the default before, still
the nearest-rounding default), and the bits of the two (the same: a program's size does not
enter the rounding).

Usage: python benchmarks/tools/block_programs.py [--small] [--repeats R] [--n N]

On a GPU the kernel is compiled by Triton and timed (median of R calls after the first).
Elsewhere it runs in Pallas's interpreter (``--small`` sizes; the CI smoke run): the bits are
checked and every time reads "not measured". References: the sm_90 compile times measured
without a GPU are in ``benchmarks/RESULTS.md`` (tools, block_programs).
"""

from __future__ import annotations

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports (jax tries `compression.zstd`, for one).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

#: (label, format factory): the layouts whose stochastic programs the cap made smaller
CASES = (("hbfp(8,24) tiles", lambda F: F.hbfp(8, 24)),
         ("hbfp(4,16) tiles", lambda F: F.hbfp(4, 16)),
         ("BFP m=7, blocks of 256 along the last axis",
          lambda F: F.BlockFormat(7, axis=-1, block_size=256)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="tiny arrays (the CI smoke run)")
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--n", type=int, default=4096, help="rows = columns of the input")
  args = ap.parse_args(argv)
  if args.repeats < 1:
    ap.error(f"--repeats must be >= 1, got {args.repeats}")
  if args.n < 1:
    ap.error(f"--n must be >= 1, got {args.n}")

  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxlp import formats as F
  from jaxlp.pallas import _quantize as PQ

  gpu = jax.default_backend() == "gpu"
  n = 96 if args.small or not gpu else args.n
  print(f"# jaxlp block_programs: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}, "
        f"{datetime.date.today()}; input ({n}, {n}) float32, stochastic rounding"
        + ("" if gpu else "; no GPU: the kernel runs interpreted, times not measured"))
  print("| format | elements per program | rows per program | first call (s) | "
        "median (ms) | same bits as 16,384 |")
  print("|---|---|---|---|---|---|")
  x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  key = jax.random.key(1)
  for label, make in CASES:
    fmt = make(F)
    outs = {}
    for elements in (PQ.MAX_PROGRAM_ELEMENTS, PQ.MAX_PROGRAM_ELEMENTS_STOCHASTIC):
      rows = PQ.program_rows(fmt, x.shape, elements)  # the kernel's rule with that cap
      fn = jax.jit(lambda x, k, rows=rows, fmt=fmt: PQ.quantize(
          x, fmt, "stochastic", key=k, block_size=rows, interpret=not gpu))
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(x, key))
      first = time.perf_counter() - t0
      ts = []
      for _ in range(args.repeats if gpu else 0):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, key))
        ts.append(time.perf_counter() - t0)
      outs[elements] = np.asarray(out).view(np.uint32)
      same = "-" if elements == PQ.MAX_PROGRAM_ELEMENTS else (
          "yes" if np.array_equal(outs[elements], outs[PQ.MAX_PROGRAM_ELEMENTS]) else "NO")
      first_s = f"{first:.2f}" if gpu else "not measured"
      med = f"{statistics.median(ts) * 1e3:.3f}" if ts else "not measured"
      print(f"| {label} | {elements} | {rows} | {first_s} | {med} | {same} |")
    if not np.array_equal(*outs.values()):
      print(f"# {label}: the two program sizes give DIFFERENT bits")
      return 1
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
