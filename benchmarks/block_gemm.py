"""Block formats on tensor cores: speed and bits of the block GEMM paths.

GEMM (M = N = K = ``--size``, jitted, median of ``--repeats`` after a compile call):

* HBFP8 (``hbfp(7, 24)``; N(0, 1) data, and an lhs whose K-blocks are scaled by
  ``2**U{-12..12}``) and MXINT8 (``mx("int8", 32)``)
  operands: today's emulation (fp32 ``dot`` of the quantized values, ``precision=HIGHEST``),
  the exact reference (``block_dot_reference``: int32 dot per K-block in a scan), the XLA
  int8 formulation (``block_dot_xla_int8``), with the ulp difference exact vs emulation;
* MXFP8 (``mx(E4M3FN, 32)``) and float E4M3 (per-tensor): the fp8 fast mode
  (``fp8_dot``) vs the emulation, with its error against the emulation.

Block-scaled formats (M = N = K = ``--scaled-size``, default 256: the Pallas kernel runs in
the interpreter on a CPU): NVFP4 (``nvfp4()``, two-level: the tensor scales' product inside
each K-block's rounding), MXFP4 (``mx(E2M1FN, 32)``) and MXFP8 (``mx(E4M3FN, 32)``, whose
18-bit significands take 2 x 2 limb dots per K-block): today's emulation (fp32 dot of the
decoded values), the exact reference and the Pallas kernel (``limb_gemm``; MXFP4: the int8 /
bf16 kernel ``block_gemm``), interpreted on a CPU (a correctness run, not a speed: the
interpreter executes the kernel program by program), compiled on a GPU.

Layers: the digits MLP of ``jaxlp.training`` (64-128-128-10, batch 128), HBFP8 tiled and
MXINT8 policies: ``block_dot="exact"`` vs the emulation, ulp differences of the logits and of
one training step's gradients (softmax cross-entropy).

Conv: one ResNet-18-style 3x3 conv (``--conv-size``: batch 8, 64 -> 64 channels, 16x16, NHWC,
SAME), forward + both gradients (``jax.vjp``), HBFP8 per-sample (``hbfp_policy(7, 24,
"per_sample", weight_man_bits=7)``), HBFP8 tiled and MXINT8 policies: ``block_dot="exact"``
(im2col GEMMs, ``jaxlp/ops/_conv.py``) vs the emulation, time and ulp differences.

GPU rows are printed as "not measured" unless the run is on a GPU (the Pallas kernel is timed
only there). Usage: python benchmarks/block_gemm.py [--small] [--size N] [--scaled-size N]
[--repeats R] [--skip-gemm] [--skip-layers] [--skip-conv] [--skip-scaled] [--conv-size B C HW R]
[--tiles BMxBNxWARPS ...] [--json F]

The Pallas kernel is timed on both routes (``route="int8"``, and ``"auto"``: bf16 tensor
cores on the tiles whose block exponents allow it), each checked bit for bit against the
reference; ``--tiles`` adds auto-route rows with other tiles (a GPU tuning sweep).
"""

from __future__ import annotations

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports (jax tries `compression.zstd`, for one).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import itertools
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxlp
from jaxlp import formats as F
from jaxlp.formats import _block_dot as BS
from jaxlp.ops import _block_dot as BD
from jaxlp.pallas import _block_gemm as PB
from jaxlp.pallas import _limb_gemm as PL


def ulps(x, y):
  """|x - y| in float32 ulps (distance of the ordered bit patterns); NaN pairs count 0."""
  def ordered(v):
    b = np.asarray(v, np.float32).view(np.int32).astype(np.int64)
    return np.where(b < 0, -(b & 0x7FFFFFFF), b)

  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  d = np.abs(ordered(x) - ordered(y))
  return np.where(np.isnan(x) & np.isnan(y), 0, d)


def _format_row(r):
  ms = "not measured" if r["ms"] is None else f"{r['ms']:.2f}"
  gf = "not measured" if r["gflops"] is None else f"{r['gflops']:.2f}"
  return f"| {r['case']} | {r['path']} | {ms} | {gf} | {r['bits']} |"


def timed(fn, *args, repeats=5):
  out = jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times), out


def emulation(a, b):
  return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


#: Largest (K-blocks, M, N) int32 intermediate of the XLA int8 route that is timed.
X8_MAX_GB = 4


def gemm_rows(size, repeats, on_gpu, tile_sweep=()):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(size, size)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(size, size)), jnp.float32)
  flops = 2 * size**3
  rows = []

  def row(case, path, seconds, bits_note):
    rows.append(dict(case=case, path=path, ms=None if seconds is None else seconds * 1e3,
                     gflops=None if seconds is None else flops / seconds / 1e9, bits=bits_note))
    print(_format_row(rows[-1]), flush=True)  # as it goes: a later row may run out of memory

  # wide range: every K-block of 24 columns scaled by 2**U{-12..12}, so that the block
  # exponents differ and sums crossing K-blocks round (on N(0, 1) data, and even with
  # per-element spreads, every partial sum fits in 24 bits: exact == emulation)
  spread = jnp.asarray(np.repeat(np.exp2(rng.integers(-12, 13, size=size // 24 + 1)), 24)[:size],
                       jnp.float32)
  emu = jax.jit(emulation)
  for case, fa, fb, g, bits, xx in (
      ("HBFP8 hbfp(7,24)", F.hbfp(7, 24), F.hbfp(7, 24), 24, 7, x),
      ("HBFP8 hbfp(7,24), K-blocks scaled 2^U{-12..12}", F.hbfp(7, 24), F.hbfp(7, 24), 24, 7,
       x * spread[None, :]),
      ("MXINT8 mx(int8,32)", F.mx("int8", 32, 1), F.mx("int8", 32, 0), 32, 7, x)):
    a, b = F.quantize(xx, fa), F.quantize(w, fb)
    t_emu, y_emu = timed(emu, a, b, repeats=repeats)
    ref = jax.jit(lambda a, b, g=g, bits=bits: BD.block_dot_reference(a, b, g, bits, bits))
    x8 = jax.jit(lambda a, b, g=g, bits=bits: BD.block_dot_xla_int8(a, b, g, bits, bits))
    t_ref, y_ref = timed(ref, a, b, repeats=repeats)
    u = ulps(y_ref, y_emu)
    row(case, "emulation (fp32 dot, HIGHEST)", t_emu,
        f"vs exact: max {u.max()} ulp, mean {u.mean():.3f} ulp, {np.mean(u > 0):.1%} differ")
    row(case, "exact: reference (int32 dot per K-block, scan)", t_ref, "defines the bits")
    x8_gb = -(-size // g) * size * size * 4 / 2**30  # its (nb, M, N) int32 intermediate
    if x8_gb <= X8_MAX_GB:
      t_x8, y_x8 = timed(x8, a, b, repeats=repeats)
      same = "same bits as reference" if np.array_equal(
          np.asarray(y_x8).view(np.uint32), np.asarray(y_ref).view(np.uint32)) else "DIFFERENT"
      row(case, "exact: XLA int8 dot (batched over K-blocks)", t_x8, same)
    else:
      row(case, "exact: XLA int8 dot (batched over K-blocks)", None,
          f"skipped: its (K-blocks, M, N) int32 product is {x8_gb:.0f} GiB")
    share = float(np.mean(np.asarray(PB.tile_routes(a, b, g, bits, bits))))
    for route, tiles in [("int8", (None, None, None)), ("auto", (None, None, None)),
                         *[("auto", t) for t in tile_sweep]]:
      path = (f"exact: Pallas kernel, route={route}" if tiles[0] is None else
              f"exact: Pallas kernel, route=auto, tiles {tiles[0]}x{tiles[1]}, {tiles[2]} warps")
      note = f"bf16 route on {share:.0%} of the tiles; " if route == "auto" else ""
      if not on_gpu:
        if tiles[0] is None:
          row(case, path + " (GPU)", None, note + "not measured (no GPU)")
        continue
      pk = jax.jit(lambda a, b, g=g, bits=bits, route=route, t=tiles: PB.block_gemm(
          a, b, g, bits, bits, route=route, block_m=t[0], block_n=t[1], num_warps=t[2]))
      t_pk, y_pk = timed(pk, a, b, repeats=repeats)
      same = "same bits as reference" if np.array_equal(
          np.asarray(y_pk).view(np.uint32), np.asarray(y_ref).view(np.uint32)) else "DIFFERENT"
      row(case, path, t_pk, note + same)

  for case, fa, fb, g in (
      ("MXFP8 mx(E4M3FN,32)", F.mx(F.E4M3FN, 32, 1), F.mx(F.E4M3FN, 32, 0), 32),
      ("float E4M3 (per-tensor)", F.E4M3, F.E4M3, None)):
    a, b = F.quantize(x, fa), F.quantize(w, fb)
    t_emu, y_emu = timed(emu, a, b, repeats=repeats)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    scale = np.abs(exact).max()

    def error(y, exact=exact, scale=scale):
      return np.abs(np.asarray(y, np.float64) - exact).max() / scale

    row(case, "emulation (fp32 dot, HIGHEST)", t_emu, f"max err / max abs(C) {error(y_emu):.2e}")
    fp8_gb = (1 if g is None else -(-size // g)) * size * size * 4 / 2**30
    # the batched XLA fp8 dot (its (K-blocks, M, N) product: the size check below); the
    # Pallas kernel is the next row
    fp8 = jax.jit(lambda a, b, fa=fa, fb=fb, g=g: BD.fp8_dot(a, b, fa, fb, g, gpu_impl="xla"))
    if fp8_gb > X8_MAX_GB:
      row(case, "fp8 fast mode (fp8 dot, fp32 out)", None,
          f"skipped: its (K-blocks, M, N) float32 product is {fp8_gb:.0f} GiB")
    else:
      t_8, y_8 = timed(fp8, a, b, repeats=repeats)
      u = ulps(y_8, y_emu)
      row(case, "fp8 fast mode (fp8 dot, fp32 out)", t_8,
          f"max err / max abs(C) {error(y_8):.2e}; vs emulation max {u.max()} ulp, "
          f"mean {u.mean():.2f}")
    if g is None:
      continue
    path = "fp8 fast mode, Pallas kernel (K-blocks summed in the kernel)"
    if not on_gpu:
      row(case, path + " (GPU)", None, "not measured (no GPU)")
      continue
    fp8_k = jax.jit(lambda a, b, fa=fa, fb=fb, g=g: BD.fp8_dot(a, b, fa, fb, g,
                                                                gpu_impl="pallas"))
    t_k, y_k = timed(fp8_k, a, b, repeats=repeats)
    row(case, path, t_k, f"max err / max abs(C) {error(y_k):.2e}")
  return rows


def _same_bits(x, y):
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  nan = np.isnan(x) & np.isnan(y)
  return np.array_equal(np.where(nan, 0, x.view(np.uint32)), np.where(nan, 0, y.view(np.uint32)))


def scaled_rows(size, repeats, on_gpu):
  """Exact GEMMs of block-scaled formats: emulation, reference, Pallas kernel (interpreted
  on a CPU, compiled on a GPU)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(size, size)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(size, size)), jnp.float32)
  flops = 2 * size**3
  rows = []

  def row(case, path, seconds, note):
    rows.append(dict(case=case, path=path, ms=None if seconds is None else seconds * 1e3,
                     gflops=None if seconds is None else flops / seconds / 1e9, bits=note))
    print(_format_row(rows[-1]), flush=True)

  emu = jax.jit(emulation)
  for case, fa, fb, g in (("NVFP4 nvfp4() (two-level)", F.nvfp4(axis=1), F.nvfp4(axis=0), 16),
                          ("MXFP4 mx(E2M1FN,32)", F.mx(F.E2M1FN, 32, 1), F.mx(F.E2M1FN, 32, 0),
                           32),
                          ("MXFP8 mx(E4M3FN,32)", F.mx(F.E4M3FN, 32, 1),
                           F.mx(F.E4M3FN, 32, 0), 32)):
    sa, sb = BS.significand_spec(fa), BS.significand_spec(fb)
    prec = (sa.prec, sb.prec)
    if sa.tensor_scale:  # the exact GEMM's operands: values without the tensor scale
      a, b = F.quantize(x, BS.two_level_values(fa)), F.quantize(w, BS.two_level_values(fb))
      scales = (BS.tensor_scale(x, fa), BS.tensor_scale(w, fb))
    else:
      a, b, scales = F.quantize(x, fa), F.quantize(w, fb), None
    t_emu, y_emu = timed(emu, F.quantize(x, fa), F.quantize(w, fb), repeats=repeats)
    ref = jax.jit(lambda a, b, s, g=g, sa=sa, sb=sb: BD.block_dot_reference(
        a, b, g, sa.bits, sb.bits, s))
    t_ref, y_ref = timed(ref, a, b, scales, repeats=repeats)
    u = ulps(y_ref, y_emu)
    row(case, "emulation (fp32 dot of the decoded values, HIGHEST)", t_emu,
        f"vs exact: max {u.max()} ulp, mean {u.mean():.3f} ulp, {np.mean(u > 0):.1%} differ")
    narrow = BD.narrow(g, sa.bits, sb.bits, scales)
    plan = "" if narrow else (
        "{} x {} limb dots per K-block; ".format(*PL.kernel_plan(g, sa.bits, sb.bits, prec)[1:3]))
    row(case, "exact: reference" + ("" if narrow and scales is None else " (limbs / digits)"),
        t_ref, "defines the bits")
    name = "Pallas kernel block_gemm" if narrow else "Pallas kernel limb_gemm"

    def kernel(a, b, s, interpret, g=g, sa=sa, sb=sb, narrow=narrow, prec=prec):
      if narrow:
        return PB.block_gemm(a, b, g, sa.bits, sb.bits, interpret=interpret)
      return PL.limb_gemm(a, b, g, sa.bits, sb.bits, s, prec=prec, interpret=interpret)

    if on_gpu:
      t_k, y_k = timed(jax.jit(lambda a, b, s: kernel(a, b, s, False)), a, b, scales,
                       repeats=repeats)
      row(case, f"exact: {name}", t_k,
          plan + ("same bits as reference" if _same_bits(y_k, y_ref) else "DIFFERENT"))
    else:
      t_k, y_k = timed(jax.jit(lambda a, b, s: kernel(a, b, s, True)), a, b, scales,
                       repeats=max(1, min(repeats, 3)))
      row(case, f"exact: {name}, interpret=True (CPU)", t_k,
          plan + ("same bits as reference" if _same_bits(y_k, y_ref) else "DIFFERENT"))
      row(case, f"exact: {name} (GPU)", None, "not measured (no GPU)")
  return rows


def layer_rows(batch):
  """The digits MLP: exact block dots vs emulation, logits and one step's gradients."""
  import optax

  from jaxlp.training import build_model, load_dataset

  d = load_dataset("digits")
  x = jnp.asarray(d.x_train[:batch], jnp.float32)
  y = jnp.asarray(d.y_train[:batch])
  out = []
  for name, policy in (("HBFP8 tiled hbfp(7,24)", jaxlp.hbfp_policy(7, 24, "tiled")),
                       ("MXINT8 mx(int8,32)", jaxlp.mx_policy("int8", 32))):
    params = build_model("mlp", 10).init(jax.random.key(0), x)
    res = {}
    for mode in (None, "exact"):
      p = jaxlp.ops.DotPolicy(**{**{k: getattr(policy, k) for k in (
          "lhs", "rhs", "grad", "dlhs_rhs", "drhs_lhs", "drhs_grad")}, "block_dot": mode})
      model = build_model("mlp", 10, dot_general=jaxlp.dot_general(p))

      def loss(params, model=model):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

      (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
      res[mode] = (logits, jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(grads)]))
    ul = ulps(res["exact"][0], res[None][0])
    ug = ulps(res["exact"][1], res[None][1])
    rel = float(jnp.max(jnp.abs(res["exact"][1] - res[None][1])) / jnp.max(jnp.abs(res[None][1])))
    def summary(u):
      return f"max {u.max()} ulp, mean {u.mean():.3f}, {np.mean(u > 0):.1%} differ"

    out.append(dict(case=f"digits MLP, {name}, batch {batch}", logits=summary(ul),
                    grads=f"{summary(ug)}, max abs diff / max abs grad {rel:.1e}"))
  return out


def conv_rows(batch, channels, hw, repeats, on_gpu, n_policies=3):
  """A 3x3 conv layer: exact block dots (im2col) vs the emulation, forward + vjp (the first
  ``n_policies`` policies; fewer than all: N(0, 1) inputs only)."""
  rng = np.random.default_rng(0)
  x0 = rng.normal(size=(batch, hw, hw, channels))
  w = jnp.asarray(rng.normal(size=(3, 3, channels, channels)) * 0.05, jnp.float32)
  g = jnp.asarray(rng.normal(size=(batch, hw, hw, channels)), jnp.float32)
  # N(0, 1) inputs, and inputs whose channels are scaled by 2**U{-8..8} (un-normalised
  # activations: block exponents differ, so sums that cross K-blocks round)
  spread = np.exp2(rng.integers(-8, 9, size=channels))
  xs = {"N(0,1)": jnp.asarray(x0, jnp.float32),
        "channels 2^U{-8..8}": jnp.asarray(x0 * spread[None, None, None, :], jnp.float32)}
  kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  flops = 3 * 2 * batch * hw * hw * channels * channels * 9
  out = []
  policies = (("HBFP8 per-sample, hbfp(7,24) weights",
               lambda m: jaxlp.hbfp_policy(7, 24, "per_sample", weight_man_bits=7, block_dot=m)),
              ("HBFP8 tiled hbfp(7,24)", lambda m: jaxlp.hbfp_policy(7, 24, "tiled", block_dot=m)),
              ("MXINT8 mx(int8,32)", lambda m: jaxlp.mx_policy("int8", 32, block_dot=m)))
  data_sets = list(xs.items())[:1] if n_policies < len(policies) else list(xs.items())
  for (name, pol), (data, x) in itertools.product(policies[:n_policies], data_sets):
    res = {}
    for mode in (None, "exact"):
      conv = jaxlp.conv_general_dilated(pol(mode))

      def step(x, w, g, conv=conv):
        y, pull = jax.vjp(lambda xx, ww: conv(xx, ww, precision=lax.Precision.HIGHEST, **kw),
                          x, w)
        return (y, *pull(g))

      res[mode] = timed(jax.jit(step), x, w, g, repeats=repeats)
    case = f"conv 3x3 {channels}->{channels}, {hw}x{hw}, batch {batch}, {name}, x {data}"
    diffs = []
    for part, a, b in zip(("y", "dx", "dw"), res["exact"][1], res[None][1], strict=True):
      u = ulps(a, b)
      diffs.append(f"{part}: max {u.max()} ulp, {np.mean(u > 0):.1%} differ")
    for path, (t, _) in (("emulation (fp32 conv, HIGHEST), fwd + vjp", res[None]),
                         ("exact: im2col block GEMMs (CPU: reference), fwd + vjp", res["exact"])):
      out.append(dict(case=case, path=path, ms=t * 1e3, gflops=flops / t / 1e9,
                      bits="; ".join(diffs) if path.startswith("exact") else "-"))
    if not on_gpu:
      out.append(dict(case=case, path="exact on GPU (int8 routes)", ms=None, gflops=None,
                      bits="not measured (no GPU)"))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true", help="tiny sizes (CI smoke test)")
  ap.add_argument("--size", type=int, default=None, help="GEMM size M = N = K (default 512)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--skip-layers", action="store_true")
  ap.add_argument("--skip-conv", action="store_true")
  ap.add_argument("--skip-gemm", action="store_true",
                  help="skip the HBFP8 / MXINT8 / fp8 GEMM rows (--size)")
  ap.add_argument("--skip-scaled", action="store_true",
                  help="skip the block-scaled (NVFP4, MXFP4, MXFP8) exact GEMM rows")
  ap.add_argument("--scaled-size", type=int, default=None,
                  help="M = N = K of the block-scaled rows (default 256; 32 with --small)")
  ap.add_argument("--conv-size", type=int, nargs=4, default=None,
                  metavar=("BATCH", "CHANNELS", "HW", "REPEATS"),
                  help="conv row: batch, channels, spatial size, repeats (default 8 64 16 3)")
  ap.add_argument("--tiles", action="append", default=[], metavar="BMxBNxWARPS",
                  help="GPU only: also time the Pallas kernel's auto route with these tiles "
                       "and warps (e.g. 128x64x4); repeatable")
  ap.add_argument("--json", default=None, help="write the rows to this file")
  args = ap.parse_args(argv)
  tile_sweep = []
  for t in args.tiles:
    try:
      bm, bn, w = (int(v) for v in t.lower().split("x"))
    except ValueError:
      ap.error(f"--tiles {t!r}: expected BMxBNxWARPS, e.g. 128x64x4")
    if min(bm, bn) < 16 or bm & (bm - 1) or bn & (bn - 1) or w not in (1, 2, 4, 8, 16):
      ap.error(f"--tiles {t!r}: tiles must be powers of two >= 16, warps 1/2/4/8/16")
    tile_sweep.append((bm, bn, w))
  size = args.size or (64 if args.small else 512)
  if size < 1 or args.repeats < 1:
    ap.error("--size and --repeats must be positive")
  on_gpu = jax.default_backend() == "gpu"
  dev = jax.devices()[0]
  print(f"# block GEMM paths: {platform.processor() or platform.machine()}, "
        f"{dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{size}^3, median of {args.repeats}")
  rows = []
  if not args.skip_gemm:
    print("\n| operands | path | ms | GFLOP/s | bits / error |\n|---|---|---|---|---|")
    rows = gemm_rows(size, args.repeats, on_gpu, tile_sweep)  # prints each row as measured
  scaled = []
  if not args.skip_scaled:
    ss = args.scaled_size or (32 if args.small else 256)
    if ss < 1:
      ap.error("--scaled-size must be positive")
    print(f"\n{ss}^3, block-scaled formats:\n\n| operands | path | ms | GFLOP/s | bits / error |"
          "\n|---|---|---|---|---|")
    scaled = scaled_rows(ss, args.repeats, on_gpu)
  layers = []
  if not args.skip_layers:
    layers = layer_rows(16 if args.small else 128)
    print("\n| layer | logits: exact vs emulation | grads: exact vs emulation |\n|---|---|---|")
    for r in layers:
      print(f"| {r['case']} | {r['logits']} | {r['grads']} |")
  convs = []
  if not args.skip_conv:
    b, c, hw, rep = args.conv_size or ((2, 8, 6, 1) if args.small else (8, 64, 16, 3))
    convs = conv_rows(b, c, hw, rep, on_gpu, 1 if args.small and not args.conv_size else 3)
    print("\n| conv layer | path | ms | GFLOP/s | bits vs emulation |\n|---|---|---|---|---|")
    for r in convs:
      ms = "not measured" if r["ms"] is None else f"{r['ms']:.2f}"
      gf = "not measured" if r["gflops"] is None else f"{r['gflops']:.2f}"
      print(f"| {r['case']} | {r['path']} | {ms} | {gf} | {r['bits']} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(size=size, gemm=rows, scaled=scaled, layers=layers, conv=convs), f,
                indent=1)


if __name__ == "__main__":
  main()
