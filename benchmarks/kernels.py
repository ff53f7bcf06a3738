"""Benchmark and validate jaxlp's Pallas kernels against the XLA-fused spec (GPU).

Usage:
  python benchmarks/kernels.py              # GPU: quantize 2**26 floats, GEMM 4096^3
  python benchmarks/kernels.py --check      # GPU: also bit-exactness (see below)
  python benchmarks/kernels.py --small      # any backend: small sizes (CPU: reference only)
  python benchmarks/kernels.py --small --check --interpret   # CPU: the check, kernels
                                                             # in the Pallas interpreter

Method: every timed function is jitted, run once to compile, then timed over ``--iters``
calls with ``block_until_ready``; the median is reported. Quantize moves 4 bytes read + 4
bytes written per float32 element (the kernel reads no noise tensor: stochastic noise is
hashed in-kernel), so GB/s = 8 * n / t. Baselines measured in the same run: an XLA
elementwise negation (same bytes; a plain copy may be elided by XLA) and, where torch with
CUDA is installed, torch ``x.clone()`` (the baseline of the speed goals). Each format is
timed three ways: the XLA-fused jnp spec, the Pallas kernel and ``jaxlp.quantize`` (what
the dispatch picks), and the faster of spec/kernel is printed per family next to the
dispatch table ``jaxlp.pallas._quantize.KERNEL_IS_FASTER``. A GEMM (M, K) @ (K, N) does
2*M*N*K flops; the baseline is XLA's fp32 matmul (``precision=HIGHEST``, no TF32).

``--check`` compares, NaN-aware (any NaN equals any NaN; every other bit pattern must be
equal), the kernels and ``jaxlp.quantize`` / ``jaxlp.matmul`` on the default device with
the spec computed ON THE CPU DEVICE (a different compiler, so the kernel is never compared
with itself):

* quantize: 2**26 elements (``--small``: 2**16) of crafted bit patterns — every exponent
  field x {0, 1, every tie 2^(d-1) and its neighbours, half-ulp fractions, all-ones} x both
  signs, ±0, ±inf, NaNs — then random bit patterns; every preset, cpd_float, qpytorch_float,
  FixedPoint, hbfp/BlockFormat/hbfp_batched, mx(...), each in every rounding it supports
  and with rand_bits;
* GEMM: the kernel against ``matmul_reference`` on the same device at 2048^3
  (``--small``: 64^3) and against ``matmul_reference`` on the CPU on the first 64 rows (the
  output rows are independent; stochastic rounding's noise depends on the full output
  size, so stochastic cases are compared on the CPU at 256^3 instead).
"""

from __future__ import annotations

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports (jax tries `compression.zstd`, for one).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxlp  # noqa: E402
from jaxlp import formats as F  # noqa: E402

PQ = importlib.import_module("jaxlp.pallas._quantize")
PM = importlib.import_module("jaxlp.pallas._matmul")
OM = importlib.import_module("jaxlp.ops._matmul")


_ONLY = None  # --only filter (set by main)


def _wanted(name):
  return _ONLY is None or _ONLY in name.lower()


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
  print(f"  {name:<56s} {t * 1e3:10.3f} ms {rate:10.4g} {unit:<8s} {ratio}")
  return rate


def _torch_clone_gbps(n, iters):
  """torch clone of n float32 on CUDA (GB/s, 8 B per element), or None without torch CUDA."""
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  t = torch.randn(n, device="cuda")
  t.clone()
  torch.cuda.synchronize()
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    t.clone()
    torch.cuda.synchronize()
    ts.append(time.perf_counter() - t0)
  return 8 * n / statistics.median(ts) / 1e9


QUANTIZE_CASES = [
    ("E4M3 nearest", F.E4M3, "nearest"), ("E4M3 stochastic", F.E4M3, "stochastic"),
    ("BF16 stochastic", F.BF16, "stochastic"), ("cpd_float(5,2) nearest", F.cpd_float(5, 2),
                                                "nearest"),
    ("MXFP8 (E4M3FN, 32) nearest", F.mx(F.E4M3FN, 32), "nearest"),
    ("MXFP4 (E2M1FN, 32) stochastic", F.mx(F.E2M1FN, 32), "stochastic"),
    ("hbfp(7, 16) nearest", F.hbfp(7, 16), "nearest"),
    ("BFP m=7, blocks of 16 nearest", F.BlockFormat(7, axis=-1, block_size=16), "nearest"),
]


def bench_quantize(n, iters, use_kernel, interpret):
  key = jax.random.key(0)
  x = (jax.random.normal(key, (n,), jnp.float32) * 10).reshape(-1, 1024)
  nbytes = 8 * n
  print(f"\n## quantize: n = {n} float32 elements, bytes moved = 4 read + 4 written = "
        f"{nbytes / 1e6:.1f} MB per call")
  copy = _row("copy (XLA negate, same bytes)", _time(jax.jit(lambda x: -x), x, iters=iters),
              nbytes, "GB/s")
  clone = _torch_clone_gbps(n, iters)
  if clone is not None:
    print(f"  {'torch clone (CUDA)':<56s} {'':13s} {clone:10.4g} GB/s")
  base = clone or copy
  print(f"  (ratios are x {'torch clone' if clone else 'XLA negate'})")
  best = {}
  for name, fmt, r in QUANTIZE_CASES:
    if not _wanted(name):
      continue
    fam = PQ.family(fmt, x.shape)
    spec = jax.jit(functools.partial(F.quantize, fmt=fmt, rounding=r, key=key))
    s = _row(f"{name} / XLA-fused spec", _time(spec, x, iters=iters), nbytes, "GB/s", base)
    if use_kernel:
      kern = jax.jit(functools.partial(PQ.quantize, fmt=fmt, rounding=r, key=key,
                                       interpret=interpret))
      k = _row(f"{name} / Pallas kernel", _time(kern, x, iters=iters), nbytes, "GB/s", base)
      best.setdefault(fam, []).append(k > s)
    disp = jax.jit(functools.partial(jaxlp.quantize, fmt=fmt, rounding=r, key=key))
    _row(f"{name} / jaxlp.quantize (dispatch)", _time(disp, x, iters=iters), nbytes, "GB/s",
         base)
  if best and not interpret:
    print("\n  family: kernel faster here? (KERNEL_IS_FASTER in jaxlp/pallas/_quantize.py)")
    for fam, v in best.items():
      print(f"    {fam:<12s} measured {all(v)!s:<5s} (per case {v}); table "
            f"{PQ.KERNEL_IS_FASTER[fam]}")


GEMM_CASES = [
    ("naive, acc=BF16", dict(acc=F.BF16)),
    ("naive, mul=acc=BF16", dict(mul=F.BF16, acc=F.BF16)),
    ("stochastic, acc=FP16", dict(acc=F.FP16, rounding="stochastic")),
    ("kahan, mul=acc=cpd_float(5,2)",
     dict(mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2), algorithm="kahan")),
    ("chunked chunk=32, acc=BF16", dict(acc=F.BF16, algorithm="chunked", chunk=32)),
]


def _gemm_kw(kw, key, chunk):
  kw = dict(kw)
  if kw.get("rounding") == "stochastic":
    kw["key"] = key
  if "chunk" in kw:
    kw["chunk"] = chunk
  return kw


def bench_gemm(m, iters, use_kernel, chunk, interpret):
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (m, m), jnp.float32)
  b = jax.random.normal(kb, (m, m), jnp.float32)
  flops = 2 * m**3
  print(f"\n## GEMM {m}^3: flops = 2*M*N*K = {flops / 1e9:.4g} GFLOP per call")
  xla = _row("XLA fp32 matmul (HIGHEST)",
             _time(jax.jit(lambda a, b: jnp.matmul(a, b, precision="highest")), a, b,
                   iters=iters), flops, "TFLOP/s")
  for name, kw in GEMM_CASES:
    if not _wanted(name):
      continue
    kw = _gemm_kw(kw, ka, chunk)
    ref = jax.jit(functools.partial(OM.matmul_reference, **kw))
    _row(f"{name} / jnp reference", _time(ref, a, b, iters=iters), flops, "TFLOP/s", xla)
    if use_kernel:
      fn = jax.jit(functools.partial(PM.matmul, interpret=interpret, **kw))
      _row(f"{name} / Pallas kernel", _time(fn, a, b, iters=iters), flops, "TFLOP/s", xla)


# ---------------------------------------------------------------------------------------
# --check
# ---------------------------------------------------------------------------------------
def crafted_bits(n, seed=0):
  """n float32 bit patterns: every exponent field x {0, 1, every tie 2^(d-1) and its
  neighbours, all-ones} fraction x both signs, then ±0, ±inf, NaNs, then random bits."""
  fracs = {0, 1, 0x7FFFFF, 0x400000}
  for d in range(1, 24):
    t = 1 << (d - 1)
    fracs |= {t, t - 1, t + 1, t | (1 << d), (t | (1 << d)) - 1, (t | (1 << d)) + 1}
  fracs = np.array(sorted(f & 0x7FFFFF for f in fracs), np.uint32)
  fields = np.arange(256, dtype=np.uint32)
  mags = ((fields[:, None] << 23) | fracs[None, :]).reshape(-1)
  crafted = np.concatenate([mags, mags | np.uint32(0x80000000),
                            np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                                      0xFFC00001, 0x7F800001], np.uint32)])
  rng = np.random.default_rng(seed)
  rand = rng.integers(0, 2**32, max(n - crafted.size, 0), dtype=np.uint64).astype(np.uint32)
  return np.concatenate([crafted, rand])[:n]


def check_formats():
  """(name, fmt, roundings) of every format family the kernels implement."""
  out = [(k, v) for k, v in vars(F).items() if isinstance(v, F.FloatFormat)]
  out += [("cpd_float(5,2)", F.cpd_float(5, 2)), ("cpd_float(8,23)", F.cpd_float(8, 23)),
          ("qpytorch_float(5,2)", F.qpytorch_float(5, 2)),
          ("qpytorch_float(8,7)", F.qpytorch_float(8, 7)),
          ("FixedPoint(8,4)", jaxlp.FixedPoint(8, 4)),
          ("FixedPoint(16,8,sym)", jaxlp.FixedPoint(16, 8, symmetric=True)),
          ("hbfp(8,24)", F.hbfp(8, 24)), ("hbfp(7,16)", F.hbfp(7, 16)),
          ("hbfp_batched(8)", F.hbfp_batched(8)),
          ("BlockFormat(7, blocks of 16)", jaxlp.BlockFormat(7, axis=-1, block_size=16)),
          ("mx(E4M3FN)", F.mx(F.E4M3FN, 32)), ("mx(E5M2)", F.mx(F.E5M2, 32)),
          ("mx(E2M1FN)", F.mx(F.E2M1FN, 32)), ("mx(E3M2FN)", F.mx(F.E3M2FN, 32)),
          ("mx(int8)", F.mx("int8", 32))]
  return out


def _same_bits(got, want):
  g = np.asarray(got).view(np.uint32)
  w = np.asarray(want).view(np.uint32)
  nan = (np.isnan(np.asarray(got)) & np.isnan(np.asarray(want)))
  return int(np.sum((g != w) & ~nan))


def check_quantize(n, interpret):
  cpu = jax.devices("cpu")[0]
  x_np = crafted_bits(n).view(np.float32).reshape(-1, 1024)
  x = jnp.asarray(x_np)
  x_cpu = jax.device_put(x_np, cpu)
  key = jax.random.key(2)
  key_cpu = jax.device_put(key, cpu)
  bad = 0
  print(f"\n## quantize bit-exactness: n = {x.size}, kernel / jaxlp.quantize on "
        f"{x.devices().pop().platform} vs spec on the CPU")
  for name, fmt in check_formats():
    if not _wanted(name):
      continue
    supported = PQ.supports(fmt, x.shape)
    for r in fmt.supported_roundings:
      for rb in ((None, 9) if r == "stochastic" else (None,)):
        k, kc = (key, key_cpu) if r == "stochastic" else (None, None)
        spec = functools.partial(F.quantize, fmt=fmt, rounding=r, rand_bits=rb)
        want = np.asarray(jax.jit(spec)(x_cpu, key=kc))
        diffs = {"jaxlp.quantize": _same_bits(
            jax.jit(functools.partial(jaxlp.quantize, fmt=fmt, rounding=r, rand_bits=rb))(
                x, key=k), want)}
        if supported:
          kern = functools.partial(PQ.quantize, fmt=fmt, rounding=r, rand_bits=rb,
                                   interpret=interpret)
          diffs["kernel"] = _same_bits(jax.jit(kern)(x, key=k), want)
        bad += sum(v != 0 for v in diffs.values())
        verdict = ", ".join(f"{w}: {'BIT-EXACT' if v == 0 else f'{v} DIFFER'}"
                            for w, v in diffs.items())
        print(f"  {name:<30s} {r:<13s} rand_bits={rb!s:<5s} {verdict}")
  return bad


def check_gemm(m, interpret):
  cpu = jax.devices("cpu")[0]
  key = jax.random.key(3)
  ka, kb = jax.random.split(key)
  a = jax.random.normal(ka, (m, m), jnp.float32)
  b = jax.random.normal(kb, (m, m), jnp.float32) * 4
  rows = min(64, m)
  small = min(256, m)
  bad = 0
  print(f"\n## GEMM bit-exactness: {m}^3, kernel vs matmul_reference (same device; CPU: "
        f"first {rows} rows, stochastic at {small}^3)")
  for name, kw in GEMM_CASES + [("naive fp32 (no formats)", {}),
                                ("kahan, acc=E5M2, mul=None", dict(acc=F.E5M2, algorithm="kahan")),
                                ("naive, acc=FixedPoint(24,12)",
                                 dict(acc=jaxlp.FixedPoint(24, 12)))]:
    if not _wanted(name):
      continue
    kw = _gemm_kw(kw, key, 32)
    kern = jax.jit(functools.partial(PM.matmul, interpret=interpret, **kw))
    got = np.asarray(kern(a, b))
    same_dev = _same_bits(got, jax.jit(functools.partial(OM.matmul_reference, **kw))(a, b))
    if kw.get("rounding") == "stochastic":
      a_c, b_c = (jax.device_put(np.asarray(v)[:small, :small], cpu) for v in (a, b))
      kw_c = dict(kw, key=jax.device_put(key, cpu))
      want = jax.jit(functools.partial(OM.matmul_reference, **kw_c))(a_c, b_c)
      got_s = kern(a[:small, :small], b[:small, :small])
      on_cpu = _same_bits(got_s, want)
    else:
      a_c, b_c = jax.device_put(np.asarray(a)[:rows], cpu), jax.device_put(np.asarray(b), cpu)
      want = jax.jit(functools.partial(OM.matmul_reference, **kw))(a_c, b_c)
      on_cpu = _same_bits(got[:rows], want)
    note = " (chunked: the GPU kernel sums within a chunk in the tensor core's order)" if (
        kw.get("algorithm") == "chunked") else ""
    if kw.get("algorithm") != "chunked":
      bad += (same_dev != 0) + (on_cpu != 0)
    print(f"  {name:<34s} vs same-device reference: "
          f"{'BIT-EXACT' if same_dev == 0 else f'{same_dev} DIFFER'}; vs CPU: "
          f"{'BIT-EXACT' if on_cpu == 0 else f'{on_cpu} DIFFER'}{note}")
  return bad


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true", help="small sizes (any backend)")
  p.add_argument("--check", action="store_true",
                 help="bit-exactness of kernels and dispatch against the spec on the CPU")
  p.add_argument("--interpret", action="store_true",
                 help="run the kernels in the Pallas interpreter (CPU; slow: use --small)")
  p.add_argument("--iters", type=int, default=None)
  p.add_argument("--only", default=None,
                 help="only cases whose name contains this text (case-insensitive)")
  args = p.parse_args(argv)
  global _ONLY
  _ONLY = args.only.lower() if args.only else None
  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  use_kernel = on_gpu or args.interpret
  if not on_gpu and not args.small:
    print("no GPU: running the --small sizes")
    args.small = True
  n, m, chunk = (1 << 26, 4096, 32) if not args.small else (1 << 16, 64, 16)
  iters = args.iters or (20 if not args.small else 3)
  print(f"# jaxlp kernels benchmark: backend={backend}, device={jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, kernels={'interpreted' if args.interpret else 'compiled'}"
        f"{'' if use_kernel else ' (not run: no GPU)'}")
  bench_quantize(n, iters, use_kernel, args.interpret)
  bench_gemm(m, max(1, iters // 5) if not args.small else iters, use_kernel, chunk,
             args.interpret)
  if args.check:
    if not use_kernel:
      print("\n--check needs a GPU (or --interpret)")
      return 2
    bad = check_quantize(1 << 26 if not args.small else 1 << 16, args.interpret)
    bad += check_gemm(2048 if not args.small else 64, args.interpret)
    print(f"\n# check: {'all BIT-EXACT' if bad == 0 else f'{bad} cases DIFFER'}")
    return 1 if bad else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
