"""Seconds to trace, lower and compile a compressed gradient reduction for a whole model.

What a compressed reduction costs before its first step: the seconds to trace, lower and
compile ``reduce_gradients(axis, compressor=...)``'s update for a whole model's gradients (and,
as a second baseline, the low-precision ``reduce_gradients(axis, fmt=E4M3, kahan=True,
aps=True)``, which sums every leaf in one bucket), with
W workers emulated by a named ``vmap`` (as ``jaxlp train --workers W`` runs them), per leaf
(the default) and with leaves fused into buckets (``bucket_mb``).

Usage: python benchmarks/engine_compile.py [--model resnet18|vgg19|small|tiny] [--workers W]
       [--only e4m3-psum,cgx4,qsgd7,topk,powersgd2] [--bucket-mb MB]

Each row is one program, traced, lowered and compiled once in this process (no persistent
compilation cache is read or written: JAX's own cache is switched off for the run), after the
fp32 row has warmed up JAX itself. JAX's in-memory caches do carry over between rows (e.g. the
traces of jaxlp's jitted helpers for a shape already seen), so a row can trace a little faster
than it would as the first program of a fresh process. The per-leaf program encodes every
compressed leaf on its own, so its size grows with the number of leaves; a bucket encodes a
fused vector once.
``--model small``: ResNet-18's leaves with the first two dimensions divided by 8, one of each
shape; ``--model tiny`` (three leaves) is the CI smoke run.
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
import importlib.util  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

#: name -> compressor factory (``jaxlp.parallel.compressors`` passed in)
COMPRESSORS = {
    "cgx4": lambda C: C.cgx(4, 512),
    "qsgd7": lambda C: C.qsgd(7, 512),
    "onebit": lambda C: C.onebit(),
    "topk": lambda C: C.topk(0.01),
    "dgc": lambda C: C.dgc(0.01),
    "powersgd2": lambda C: C.powersgd(2),
    "bf16": lambda C: C.cast("bf16"),
}
#: the low-precision psum's row (no compressor: ``reduce_gradients(fmt=E4M3, ...)``)
LP_PSUM = "e4m3-psum"
DEFAULT = f"{LP_PSUM},cgx4,qsgd7,topk,powersgd2"


def _shapes(model):
  spec = importlib.util.spec_from_file_location("_jaxlp_bench_compressors",
                                                _os.path.join(_here, "compressors.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  if model == "tiny":
    return [(64, 32, 3, 3), (64,), (100, 128)]
  if model == "vgg19":
    return mod.vgg19_shapes()
  s = mod.resnet18_shapes()
  return mod.small_shapes(s) if model == "small" else s


def stages(tx, shapes, w):
  """(trace, lower, compile) seconds of ``jit(vmap(tx.update))`` over ``w`` named workers."""
  import jax
  import jax.numpy as jnp

  params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  state = jax.eval_shape(jax.vmap(lambda _: tx.init(params)), jnp.arange(w))
  grads = [jax.ShapeDtypeStruct((w,) + s, jnp.float32) for s in shapes]
  f = jax.jit(jax.vmap(lambda g, s: tx.update(g, s), axis_name="i"))
  t0 = time.perf_counter()
  traced = f.trace(grads, state)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  return t1 - t0, t2 - t1, t3 - t2


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="resnet18", choices=["resnet18", "vgg19", "small", "tiny"])
  ap.add_argument("--workers", type=int, default=4, help="emulated workers W (>= 2)")
  ap.add_argument("--only", default=DEFAULT,
                  help=f"comma-separated rows of {LP_PSUM},{','.join(COMPRESSORS)}")
  ap.add_argument("--bucket-mb", type=float, default=25.0,
                  help="the bucketed rows' bucket_mb (> 0)")
  args = ap.parse_args(argv)
  if args.workers < 2:
    ap.error(f"--workers must be >= 2, got {args.workers}")
  if not args.bucket_mb > 0:
    ap.error(f"--bucket-mb must be > 0, got {args.bucket_mb}")
  names = [n for n in args.only.split(",") if n]
  unknown = [n for n in names if n not in COMPRESSORS and n != LP_PSUM]
  if unknown or not names:
    ap.error(f"--only: unknown compressor(s) {unknown or names}; choose from "
             f"{','.join([LP_PSUM, *COMPRESSORS])}")

  import jax

  import jaxlp.parallel as jp
  from jaxlp.parallel import compressors as C
  from jaxlp.parallel._compressed import _plan_buckets

  shapes = _shapes(args.model)
  w = args.workers
  print(f"# jaxlp engine_compile: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{platform.processor() or platform.machine()}, {_os.cpu_count()} cores, "
        f"jax {jax.__version__}, {datetime.date.today()}")
  print(f"# {args.model}: {len(shapes)} leaves, W = {w} (named vmap), default filters "
        "(min_size=1024, skip_vectors); seconds")
  print("| reduction | compressed leaves | buckets | trace | lower | compile | total |")
  print("|---|---|---|---|---|---|---|")
  from jaxlp import formats as F

  rows = [("fp32 psum (reduce_gradients without a compressor)", None, None)]
  if LP_PSUM in names:  # the low-precision psum: every leaf in one bucket
    rows.append(("E4M3 ring psum + Kahan + APS (reduce_gradients(fmt=E4M3))", LP_PSUM, None))
  for n in (n for n in names if n != LP_PSUM):
    rows += [(f"{n}, per leaf", COMPRESSORS[n](C), None),
             (f"{n}, bucket_mb={args.bucket_mb:g}", COMPRESSORS[n](C), args.bucket_mb)]
  with _no_persistent_cache(jax):
    for label, c, bmb in rows:
      if c is None:
        tx, leaves, nb = jp.reduce_gradients("i"), "-", "-"
      elif c == LP_PSUM:
        tx = jp.reduce_gradients("i", fmt=F.E4M3, order="ring", kahan=True, aps=True)
        leaves, nb = len(shapes), 1
      else:
        tx = jp.reduce_gradients("i", compressor=c, bucket_mb=bmb)
        # the engine's own filters and buckets (what the program encodes)
        _, buckets = _plan_buckets(c, c.aggregation, shapes, min_size=1024, skip_vectors=True,
                                   bucket_mb=bmb, plan=None)
        leaves, nb = sum(len(b.leaves) for b in buckets), len(buckets)
      tr, lo, co = stages(tx, shapes, w)
      print(f"| {label} | {leaves} | {nb} | {tr:.1f} | {lo:.1f} | {co:.1f} | "
            f"{tr + lo + co:.1f} |", flush=True)
  return 0


class _no_persistent_cache:
  """Switches JAX's persistent compilation cache off for the block (JAX's config option)."""

  def __init__(self, jax):
    self.jax = jax

  def __enter__(self):
    self.old = self.jax.config.jax_enable_compilation_cache
    self.jax.config.update("jax_enable_compilation_cache", False)

  def __exit__(self, *exc):
    self.jax.config.update("jax_enable_compilation_cache", self.old)


if __name__ == "__main__":
  raise SystemExit(main())
