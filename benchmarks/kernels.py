"""Benchmark (and on GPU, validate) the Pallas kernels of jaxlp.

Usage:
  python benchmarks/kernels.py              # GPU: full sizes (quantize 2**26 floats, GEMM 4096^3)
  python benchmarks/kernels.py --check      # GPU: also bit-exactness on 64M elements / 2048^3
  python benchmarks/kernels.py --small      # any backend: small sizes, reference path only

Method: every timed function is jitted, run once to compile, then timed over ``--iters``
calls with ``block_until_ready``; the median is reported. Quantize moves 4 bytes read + 4
bytes written per float32 element (the kernel reads no noise tensor: stochastic noise is
hashed in-kernel), so GB/s = 8 * n / t. The "copy" baseline is an XLA elementwise negation
(read n, write n: the same bytes; a plain copy may be elided by XLA) measured in the same run.
A GEMM (M, K) @ (K, N) does 2*M*N*K flops; TFLOP/s = 2*M*N*K / t; the baseline is XLA's fp32
matmul (precision=HIGHEST, i.e. no TF32) in the same run.
"""

from __future__ import annotations

import os as _os
import sys as _sys

# This folder holds a script named like a module that jax's dependencies import
# ("compression"); keep it off sys.path so running any benchmark as a script is safe.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxlp import formats as F  # noqa: E402
from jaxlp.ops.matmul import matmul as ref_matmul  # noqa: E402
from jaxlp.pallas.matmul import matmul as pallas_matmul  # noqa: E402
from jaxlp.pallas.quantize import quantize as pallas_quantize  # noqa: E402


def _time(fn, *args, iters):
  out = fn(*args)
  jax.block_until_ready(out)
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def _row(name, t, work, unit, base=None):
  rate = work / t / 1e9 if unit == "GB/s" else work / t / 1e12
  ratio = "" if base is None else f"{rate / base:7.2f}x"
  print(f"  {name:<52s} {t * 1e3:10.3f} ms {rate:10.4g} {unit:<8s} {ratio}")
  return rate


def bench_quantize(n, iters, use_kernel):
  key = jax.random.key(0)
  x = jax.random.normal(key, (n,), jnp.float32) * 10
  nbytes = 8 * n
  print(f"\n## quantize: n = {n} float32 elements, bytes moved = 4 read + 4 written = "
        f"{nbytes / 1e6:.1f} MB per call")
  copy = _row("copy (XLA negate, same bytes)", _time(jax.jit(lambda x: -x), x, iters=iters),
              nbytes, "GB/s")
  cases = [("E4M3 nearest", F.E4M3, "nearest"), ("E4M3 stochastic", F.E4M3, "stochastic"),
           ("BF16 stochastic", F.BF16, "stochastic"),
           ("MXFP8 (E4M3FN, 32) nearest", F.mx(F.E4M3FN, 32), "nearest"),
           ("MXFP4 (E2M1FN, 32) stochastic", F.mx(F.E2M1FN, 32), "stochastic"),
           ("BFP m=7, blocks of 16 nearest", F.BlockFormat(7, axis=-1, block_size=16), "nearest")]
  arr = x.reshape(-1, 1024)
  for name, fmt, r in cases:
    spec = jax.jit(functools.partial(F.quantize, fmt=fmt, rounding=r, key=key))
    _row(f"{name} / XLA-fused jnp spec", _time(spec, arr, iters=iters), nbytes, "GB/s", copy)
    if use_kernel:
      kern = jax.jit(functools.partial(pallas_quantize, fmt=fmt, rounding=r, key=key))
      _row(f"{name} / Pallas kernel", _time(kern, arr, iters=iters), nbytes, "GB/s", copy)


def bench_gemm(m, iters, use_kernel, chunk):
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (m, m), jnp.float32)
  b = jax.random.normal(kb, (m, m), jnp.float32)
  flops = 2 * m**3
  print(f"\n## GEMM {m}^3: flops = 2*M*N*K = {flops / 1e9:.4g} GFLOP per call")
  xla = _row("XLA fp32 matmul (HIGHEST)",
             _time(jax.jit(lambda a, b: jnp.matmul(a, b, precision="highest")), a, b,
                   iters=iters), flops, "TFLOP/s")
  cases = [("naive, acc=BF16", dict(acc=F.BF16)),
           ("kahan, mul=acc=cpd_float(5,2)",
            dict(mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2), algorithm="kahan")),
           (f"chunked chunk={chunk}, acc=BF16", dict(acc=F.BF16, algorithm="chunked",
                                                     chunk=chunk))]
  for name, kw in cases:
    if use_kernel:
      fn = jax.jit(functools.partial(pallas_matmul, **kw))
      _row(f"{name} / Pallas kernel", _time(fn, a, b, iters=iters), flops, "TFLOP/s", xla)
    else:
      fn = jax.jit(functools.partial(ref_matmul, **kw))
      _row(f"{name} / jnp reference", _time(fn, a, b, iters=iters), flops, "TFLOP/s", xla)


def check_bits(n, m):
  """Kernel == reference on a real GPU (issue: >= 64M elements and 2048^3 GEMMs)."""
  key = jax.random.key(2)
  x = jax.random.normal(key, (n // 1024, 1024), jnp.float32) * 100
  for fmt, r in ((F.E4M3, "nearest"), (F.E4M3, "stochastic"), (F.cpd_float(5, 2), "nearest"),
                 (F.mx(F.E4M3FN, 32), "stochastic"), (F.hbfp(7, 16), "nearest")):
    got = jax.jit(functools.partial(pallas_quantize, fmt=fmt, rounding=r, key=key))(x)
    want = jax.jit(functools.partial(F.quantize, fmt=fmt, rounding=r, key=key))(x)
    same = bool(jnp.all(jax.lax.bitcast_convert_type(got, jnp.uint32)
                        == jax.lax.bitcast_convert_type(want, jnp.uint32)))
    print(f"  check quantize {fmt!r} {r} n={x.size}: {'BIT-EXACT' if same else 'MISMATCH'}")
  ka, kb = jax.random.split(key)
  a = jax.random.normal(ka, (m, m), jnp.float32)
  b = jax.random.normal(kb, (m, m), jnp.float32)
  for kw in (dict(), dict(acc=F.BF16, mul=F.BF16),
             dict(mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2), algorithm="kahan"),
             dict(acc=F.FP16, rounding="stochastic", key=key),
             dict(acc=F.BF16, algorithm="chunked", chunk=32)):
    got = jax.jit(functools.partial(pallas_matmul, **kw))(a, b)
    want = jax.jit(functools.partial(ref_matmul, **kw))(a, b)
    diff = int(jnp.sum(got != want))
    name = {k: v for k, v in kw.items() if k != "key"}
    print(f"  check matmul {m}^3 {name}: {'BIT-EXACT' if diff == 0 else f'{diff} differ'}"
          + (" (chunked: within-chunk order is Triton's vs XLA's)" if "chunk" in kw else ""))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true", help="small sizes, reference path (CPU)")
  p.add_argument("--check", action="store_true", help="GPU: bit-exactness at full size")
  p.add_argument("--iters", type=int, default=None)
  args = p.parse_args(argv)
  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  use_kernel = on_gpu and not args.small
  n, m, chunk = (1 << 26, 4096, 32) if not args.small else (1 << 18, 64, 16)
  iters = args.iters or (20 if not args.small else 3)
  print(f"# jaxlp kernels benchmark: backend={backend}, device={jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, path={'Pallas kernels' if use_kernel else 'jnp reference'}")
  if not on_gpu and not args.small:
    print("no GPU: running the --small reference path")
    n, m, chunk, iters = 1 << 18, 64, 16, 3
  bench_quantize(n, iters, use_kernel)
  bench_gemm(m, iters, use_kernel, chunk)
  if args.check and on_gpu:
    print("\n## bit-exactness, Pallas kernel vs jnp reference")
    check_bits(1 << 26, 2048)


if __name__ == "__main__":
  main()
