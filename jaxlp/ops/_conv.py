"""`conv_general_dilated(policy)`: a `lax.conv_general_dilated` with quantized GEMMs."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp.formats._block import BlockFormat, MXFormat
from jaxlp.formats._block_dot import contraction_blocks, significand_bits
from jaxlp.ops._block_dot import check_exact_operands
from jaxlp.ops._dot_general import (
  SlotGeometry,
  _exact_gemm,
  _fp8_gemm,
  _is_axis_blocked,
  pad_segments,
  quantized_bilinear,
)
from jaxlp.ops._policy import DotPolicy, Quant


def _conv_geometry(dn: lax.ConvDimensionNumbers) -> dict[str, SlotGeometry]:
  """Tiling views in channel-first layout (N, C, spatial) / (O, I, spatial), and the
  contraction axes: features in the forward pass, out-features in dlhs, batch in drhs
  (also the axes a :class:`jaxlp.RHT` transforms). Kernels in 2-D tiles of a two-level
  format (``nvfp4(tile=16)``) are tiled per tap on their (in, out) matrix."""
  ls, rs, os_ = (tuple(int(d) for d in t) for t in dn)
  kmat = rs[2:] + (rs[1], rs[0])  # 2-D tiles of two-level formats: per tap, (in, out)
  return {
      "lhs": SlotGeometry(ls, ls[1]),
      "rhs": SlotGeometry(rs, rs[1], matrix_perm=kmat),
      "grad": SlotGeometry(os_, os_[1]),
      "dlhs_rhs": SlotGeometry(rs, rs[0], matrix_perm=kmat),
      "drhs_lhs": SlotGeometry(ls, ls[0]),
      "drhs_grad": SlotGeometry(os_, os_[0]),
  }


def conv_general_dilated(policy: DotPolicy | None = None, *, key=None):
  """A ``lax.conv_general_dilated`` replacement that quantizes its GEMMs per ``policy``.

  The returned callable has ``lax.conv_general_dilated``'s signature ``(lhs, rhs,
  window_strides, padding, lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
  feature_group_count=1, batch_group_count=1, precision=None, preferred_element_type=None)``,
  accepts and ignores extra keywords (``out_sharding``), and takes an optional keyword
  ``key`` overriding the construction key. Plugs into ``flax.linen.Conv(conv_general_dilated=
  ...)`` and ``nnx.Conv(..., conv_general_dilated=...)``.

  The backward pass is the transpose of the same lax convolution applied to the quantized
  operands, so strides, padding, dilations, feature and batch groups are all exact.

  Blocking: tile-blocked formats (``hbfp``, ``hbfp_batched``) see activations and gradients
  as (N, C, spatial...) and kernels as (O, I, spatial...) — HBFPEmulator's NCHW/OIHW views:
  a Flax HWIO kernel is transposed to OIHW, tiled on the (O, I·kh·kw) view, and transposed
  back (``layout="auto"`` or ``"hbfp"``; with ``layout="contraction"`` the activations and
  gradients are blocked like axis-blocked formats, one pixel per block, ``tc`` of a
  ``(1, tc)`` tile long, and kernels keep their OIHW tiles). Axis-blocked formats (MX) are
  blocked along the contraction axis: input/kernel input
  features in the forward pass, gradient/kernel output features in the dlhs GEMM, and the
  batch axis of input and gradient in the drhs GEMM (1-D ``nvfp4()`` blocks too). Kernels in
  2-D tiles of a two-level format (``nvfp4(tile=16)``) are tiled per kernel tap on their
  (in, out) matrix, so the forward and the dlhs GEMM see the same kernel values. A
  :class:`jaxlp.RHT` transforms along the same contraction axes (features, out-features,
  batch), along which the convolution is a plain sum of products, so it cancels in every
  GEMM. Accumulator emulation is not supported
  for convolutions (NotImplementedError).

  ``block_dot="exact"`` / ``"fp8"`` (:class:`jaxlp.DotPolicy`): the three GEMMs run on im2col
  matrices of the quantized operands (built by padding, dilating and strided slicing: data
  movement only), in canonical layout x (N, C, S...), w (O, C, R...), y (N, O, So...), T =
  prod(R) kernel taps in row-major order, and computed by the exact block GEMM of
  ``jaxlp/ops/_block_dot.py`` (the same reference / XLA int8 / Pallas routes and dispatch as
  ``dot_general``):

  * **fwd**: ``y[(n, so), o] = sum_K P[(n, so), K] w[o, K]``, P the zero-padded patches of x;
    K order ``(c, t)`` (c-major: w's flattened (C, kh, kw) index, as its OIHW tiles run) or
    ``(t, c)`` (c-minor: MX blocks along C);
  * **dlhs** (the transposed conv): ``dx[(n, s), c] = sum_K G[(n, s), K] w[o, c, t]``, K =
    ``(t, o)`` (o-minor), ``G[n, s, t, o] = g[n, o, so]`` where ``so * stride + t * rhs_dil =
    s * lhs_dil + pad_lo`` has a solution ``0 <= so < So``, else 0;
  * **drhs** (the weight gradient): ``dw[o, (c, t)] = sum_K P[K, (c, t)] g[K, o]``, K =
    ``(so, n)`` (n-minor) or ``(n, so)`` (one sample per segment).

  K runs in segments of L elements (the innermost K dim: C, O, N or So, or L = K), each cut
  into K-blocks of g (the last one of a segment shorter; zero padding never changes a bit).
  g is the coarsest length that every operand's quantization blocks refine, so each K-block
  of each row/column lies in ONE block of its format (the emulation's blocks: HBFPEmulator's
  NCHW / OIHW tiles, per-sample exponents, MX blocks along the contraction axis); per
  K-block the integer dot is exact, rounded once to float32, and the K-blocks are summed in
  float32 in ascending K order. Among the candidate K orders of a GEMM the one with the
  largest g is used (the first listed on a tie). Resulting blocks: ``hbfp_policy(m, T,
  "per_sample", weight_man_bits=m)``: fwd (c, t) K-blocks of T; dlhs segments of O cut in
  T; drhs (n, so), one sample (So) per K-block. MX (``mx_policy("int8", B)``): fwd (t, c)
  segments of C cut in B; dlhs segments of O cut in B; drhs (so, n) segments of N cut in B.
  ``hbfp_policy(m, T, "tiled")`` (``jaxlp train --hbfp``): its NCHW activation / gradient
  tiles do not run along the fwd / dlhs contraction, so those GEMMs get K-blocks of 1 (each
  product exact, a sequential float32 sum in K order: valid, slow); drhs (so, n) segments of
  N cut in T. Measured against today's emulation (``benchmarks/block_gemm.py``, a 3x3 conv
  64 -> 64, 16x16, batch 8, forward + both gradients): on N(0, 1) inputs 0 ulp everywhere
  for all three policies (every sum fits float32's 24 bits); with input channels scaled by
  ``2**U{-8..8}``, per-sample HBFP8 and MXINT8 still 0 ulp, tiled HBFP8's forward output
  differs in 90% of the elements (by at most 6.0e-7 of max abs(y); up to 147456 ulp where sums
  cancel; against a float64 conv of the same operands the max error is 2.7e-4 exact, 2.4e-4
  emulation, max abs(y) = 459): the dlhs and drhs outputs are still bit-identical. Grouped
  convolutions (``feature_group_count`` or ``batch_group_count`` > 1) raise
  NotImplementedError; ``precision`` and ``preferred_element_type`` do not apply (float32
  out).

  Args:
    policy: a :class:`jaxlp.DotPolicy`; ``DotPolicy()`` / None = the plain lax convolution.
    key: PRNG key for stochastic rounding (fresh per step).

  Returns:
    The conv_general_dilated callable (its ``policy`` attribute holds the policy). Calling
    it raises ``ValueError`` if the policy is stochastic and no key was given.

  Raises:
    TypeError: ``policy`` is not a :class:`jaxlp.DotPolicy` (or None).
    NotImplementedError: the policy emulates accumulators (``fwd_acc``/``dlhs_acc``/
      ``drhs_acc``), or has ``layout="contraction"`` and an activation or gradient tile
      ``(None, tc)`` (rows spanning the whole tensor); calling it with ``block_dot`` and
      ``feature_group_count`` or ``batch_group_count`` > 1. Calling it raises ValueError when
      a K-block is too long for an exact int32 dot (``block_dot="exact"``).

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> conv = jaxlp.conv_general_dilated(jaxlp.float_policy(F.E2M1FN))
    >>> x = jnp.array([[[1.3, 2.6, 0.4, 5.0]]])  # (N=1, C=1, W=4)
    >>> w = jnp.array([[[1.0, 1.0]]])  # (O=1, I=1, W=2)
    >>> # x is rounded to E2M1 first: [1.5, 3, 0.5, 4] (5: a tie between 4 and 6, to even)
    >>> conv(x, w, (1,), "VALID")
    Array([[[4.5, 3.5, 4.5]]], dtype=float32)
  """
  policy = DotPolicy() if policy is None else policy
  if not isinstance(policy, DotPolicy):
    raise TypeError(f"jaxlp.conv_general_dilated: policy must be a DotPolicy, got {policy!r}")
  if any(a is not None for a in (policy.fwd_acc, policy.dlhs_acc, policy.drhs_acc)):
    raise NotImplementedError(
        "jaxlp.conv_general_dilated: accumulator emulation (fwd_acc/dlhs_acc/drhs_acc) is "
        "implemented for jaxlp.dot_general, not for convolutions; use a policy without "
        "accumulators for convs")
  default_key = key
  qpolicy = _contraction_policy(policy) if policy.layout == "contraction" else policy

  def jaxlp_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                                 rhs_dilation=None, dimension_numbers=None,
                                 feature_group_count=1, batch_group_count=1, precision=None,
                                 preferred_element_type=None, *, key=None, **unused):
    del unused
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)

    def op(l, r):
      return lax.conv_general_dilated(
          l, r, window_strides, padding, lhs_dilation=lhs_dilation,
          rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
          feature_group_count=feature_group_count, batch_group_count=batch_group_count,
          precision=precision, preferred_element_type=preferred_element_type)

    if policy.is_identity:
      return op(lhs, rhs)
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    gemms = None
    if policy.block_dot is not None:
      for name, v in (("feature_group_count", feature_group_count),
                      ("batch_group_count", batch_group_count)):
        if v != 1:
          raise NotImplementedError(
              f"jaxlp.conv_general_dilated: block_dot={policy.block_dot!r} supports only "
              f"{name}=1 (no grouped or depthwise convolutions), got {name}={v}")
      cv = _conv_shape(dn, lhs.shape, rhs.shape, window_strides, padding, lhs_dilation,
                       rhs_dilation)
      gemms = _block_conv_gemms(qpolicy, dn, cv)
    k = default_key if key is None else key
    return quantized_bilinear(op, lhs, rhs, qpolicy, _conv_geometry(dn), key=k, gemms=gemms)

  jaxlp_conv_general_dilated.policy = policy
  return jaxlp_conv_general_dilated


# ---------------------------------------------------------------------------------------
# block_dot="exact" / "fp8": the convolution's three GEMMs on im2col matrices
# ---------------------------------------------------------------------------------------
# Canonical layouts: x (N, C, *S), w (O, C, *R), y (N, O, *So); the T = prod(R) kernel taps
# run in row-major order over the spatial dims of R. Slot name -> the canonical axis an
# axis-blocked (MX) format is blocked along (``_conv_geometry``).
_SLOT_AXIS = {"lhs": 1, "rhs": 1, "grad": 1, "dlhs_rhs": 0, "drhs_lhs": 0, "drhs_grad": 0}


class _Conv(NamedTuple):
  N: int
  C: int
  O: int
  S: tuple[int, ...]
  R: tuple[int, ...]
  So: tuple[int, ...]
  strides: tuple[int, ...]
  pads: tuple[tuple[int, int], ...]
  ldil: tuple[int, ...]
  rdil: tuple[int, ...]


def _contraction_policy(policy: DotPolicy) -> DotPolicy:
  """``layout="contraction"`` for a convolution: tile formats of the activation and gradient
  slots become blocks along the slot's contraction axis (``_conv_geometry``: channels per
  pixel in the forward pass, output channels in the dlhs GEMM, the batch in the drhs GEMM),
  ``tc`` elements long (None: the whole axis); kernels keep HBFPEmulator's OIHW tiles (the
  (O, I*kh*kw) view: their contraction view)."""
  kw = {}
  for slot in ("lhs", "grad", "drhs_lhs", "drhs_grad"):
    q = getattr(policy, slot)
    if not isinstance(q, Quant) or not isinstance(q.fmt, BlockFormat) or q.fmt.axis is not None:
      continue
    tr, tc = q.fmt.tile
    if tr is None and tc is None:
      continue  # one exponent per tensor
    if tr is None:
      raise NotImplementedError(
          f"jaxlp.conv_general_dilated: layout='contraction' blocks the {slot!r} operand "
          f"along its contraction axis, one pixel per block; its format {q.fmt!r} has tiles "
          f"{q.fmt.tile} spanning every row: use layout='hbfp' or a tile (1, {tc})")
    fmt = BlockFormat(q.fmt.man_bits, axis=1, block_size=tc, exponent=q.fmt.exponent,
                      eps=q.fmt.eps)
    kw[slot] = Quant(fmt, q.rounding)
  return dataclasses.replace(policy, **kw)


def _conv_shape(dn, lhs_shape, rhs_shape, window_strides, padding, lhs_dilation,
                rhs_dilation) -> _Conv:
  ls, rs, _ = dn
  N, C, *S = (int(lhs_shape[d]) for d in ls)
  O, _, *R = (int(rhs_shape[d]) for d in rs)
  nd = len(S)
  strides = tuple(int(s) for s in window_strides)
  ldil = (1,) * nd if lhs_dilation is None else tuple(int(d) for d in lhs_dilation)
  rdil = (1,) * nd if rhs_dilation is None else tuple(int(d) for d in rhs_dilation)
  if isinstance(padding, str):  # as lax.conv_general_dilated: undilated lhs, dilated rhs
    pads = lax.padtype_to_pads(S, [(r - 1) * d + 1 for r, d in zip(R, rdil, strict=True)],
                               strides, padding)
  else:
    pads = padding
  pads = tuple((int(lo), int(hi)) for lo, hi in pads)
  So = tuple(max(0, ((s - 1) * ld + 1 + lo + hi - (r - 1) * rd - 1) // st + 1)
             for s, r, st, (lo, hi), ld, rd in zip(S, R, strides, pads, ldil, rdil, strict=True))
  return _Conv(N, C, O, tuple(S), tuple(R), So, strides, pads, ldil, rdil)


def _taps(R):
  return list(itertools.product(*(range(r) for r in R)))


def _im2col(x, cv: _Conv):
  """x (N, C, *S) -> (N, C, T, *So): ``[n, c, t, so] = xpd[n, c, so * stride + r_t * rdil]``
  where xpd is x dilated by ``lhs_dilation`` and padded (zeros; negative pads crop). Data
  movement only (pads and strided slices: no arithmetic)."""
  cfg = [(0, 0, 0), (0, 0, 0)] + [(lo, hi, ld - 1) for (lo, hi), ld in zip(cv.pads, cv.ldil)]
  xp = lax.pad(x, jnp.zeros((), x.dtype), cfg)
  cols = []
  for r in _taps(cv.R):
    start = (0, 0) + tuple(ri * d for ri, d in zip(r, cv.rdil))
    limit = x.shape[:2] + tuple(s0 + (so - 1) * st + 1 for s0, so, st in
                                zip(start[2:], cv.So, cv.strides))
    cols.append(lax.slice(xp, start, limit, (1, 1) + cv.strides))
  return jnp.stack(cols, axis=2)


def _grad_cols(g, cv: _Conv):
  """g (N, O, *So) -> (N, O, T, *S): the gradient element that tap t carries to input
  position s, ``[n, o, t, s] = g[n, o, so]`` where ``so * stride + r_t * rdil = s * ldil +
  pad_lo`` has an integer solution ``0 <= so < So``, else 0 (the dlhs GEMM's im2col)."""
  cfg = [(0, 0, 0), (0, 0, 0)]
  off = []
  for so, s, r, st, (lo, _), ld, rd in zip(cv.So, cv.S, cv.R, cv.strides, cv.pads, cv.ldil,
                                           cv.rdil, strict=True):
    n_up = (so - 1) * st + 1 if so else 0
    a = max(0, (r - 1) * rd - lo)
    b = max(0, lo + (s - 1) * ld - (n_up - 1))
    cfg.append((a, b, st - 1 if so else 0))
    off.append(lo + a)
  gp = lax.pad(g, jnp.zeros((), g.dtype), cfg)
  cols = []
  for r in _taps(cv.R):
    start = (0, 0) + tuple(o - ri * d for o, ri, d in zip(off, r, cv.rdil))
    limit = g.shape[:2] + tuple(s0 + (s - 1) * ld + 1 for s0, s, ld in
                                zip(start[2:], cv.S, cv.ldil))
    cols.append(lax.slice(gp, start, limit, (1, 1) + cv.ldil))
  return jnp.stack(cols, axis=2)


# the innermost contraction dim (segment) of each GEMM's K order, and the dim an axis-blocked
# format of each slot is blocked along (the conv geometry above)
_INNER = {("fwd", "cr"): None, ("fwd", "rc"): "C", ("dlhs", "to"): "O", ("drhs", "sn"): "N",
          ("drhs", "ns"): "So"}
_SLOT_DIM = {"lhs": "C", "rhs": "C", "grad": "O", "dlhs_rhs": "O", "drhs_lhs": "N",
             "drhs_grad": "N"}
ORDERS = {"fwd": ("cr", "rc"), "dlhs": ("to",), "drhs": ("sn", "ns")}


def _operand_blocks(mode, quant, slot, gemm, order, cv: _Conv):
  """One operand's K-blocking in one GEMM under one K order: None (its quantization block
  covers all of K for every output: imposes nothing), or ``(L, b)``: K runs in segments of
  L elements (the innermost contraction dim; L = K: one segment), each cut into blocks of b
  (the last one shorter); ``b = 1`` when its blocks do not run contiguously along K."""
  fmt = quant.fmt
  if mode == "fp8" and not isinstance(fmt, MXFormat):
    return None  # fp8 mode: per-tensor scale
  T, So = math.prod(cv.R), math.prod(cv.So)
  lengths = {"C": cv.C, "O": cv.O, "N": cv.N, "So": So}
  inner = _INNER[(gemm, order)]
  if _is_axis_blocked(fmt):
    if inner != _SLOT_DIM[slot]:
      return (1, 1)
    n = lengths[inner]
    return (n, n if fmt.block_size is None else min(fmt.block_size, n))
  # tile-blocked: (t0, t1) tiles of the (dim0, rest) view of the canonical layout
  is_w = slot in ("rhs", "dlhs_rhs")
  is_x = slot in ("lhs", "drhs_lhs")
  rows = cv.O if is_w else cv.N
  rest = cv.C * T if is_w else cv.C * math.prod(cv.S) if is_x else cv.O * So
  t0 = rows if fmt.tile[0] is None else min(fmt.tile[0], rows)
  t1 = rest if fmt.tile[1] is None else min(fmt.tile[1], rest)
  if t0 == rows and t1 == rest:
    return None  # one block per tensor
  if gemm == "fwd":
    # x: row (n, so) fixed, K (c, t) walks x's flattened (c, h, w) positions; w: column o
    # fixed, K in order (c, t) IS w's flattened (c, kh, kw) index
    if t1 == rest:
      return None
    return (cv.C * T, t1) if (is_w and order == "cr") else (1, 1)
  if gemm == "dlhs":
    # grad: row (n, s) fixed, K (t, o) walks its flattened (o, so) positions; w: column c,
    # at fixed tap t the K run over o is one column of w's tile view (rows o)
    if is_w:
      return (cv.O, t0)
    return None if t1 == rest else (1, 1)
  # drhs: x row (c, t) / grad column o fixed; K (so, n): at fixed so the run over n is one
  # column of the tile view; K (n, so): one row (sample) per segment
  if order == "sn":
    return (cv.N, t0)
  return (So, So) if t1 == rest else (1, 1)


def _combine(pa, pb, K: int):
  """The K-blocking both operands' blockings refine: ``(L, g)``."""
  if pa is None and pb is None:
    return (K, max(K, 1))
  if pa is None or pb is None:
    L, b = pa if pb is None else pb
    return (K, 1) if b == 1 else (L, b)
  (la, ba), (lb, bb) = pa, pb
  if ba == 1 or bb == 1 or la != lb:
    return (K, 1)
  return (la, contraction_blocks(ba, bb, la))


def _conv_plan(policy: DotPolicy, cv: _Conv):
  """GEMM -> (K order, segment length L, K-block g) for ``policy.block_dot``; the order of
  each GEMM is the candidate with the largest g (the first on a tie)."""
  T, So = math.prod(cv.R), math.prod(cv.So)
  Ks = {"fwd": cv.C * T, "dlhs": cv.O * T, "drhs": cv.N * So}
  plan = {}
  for gemm, ((sa, qa), (sb, qb)) in policy.gemm_operands().items():
    best = None
    for order in ORDERS[gemm]:
      L, g = _combine(_operand_blocks(policy.block_dot, qa, sa, gemm, order, cv),
                      _operand_blocks(policy.block_dot, qb, sb, gemm, order, cv), Ks[gemm])
      if best is None or g > best[2]:
        best = (order, L, g)
    if policy.block_dot == "exact":
      check_exact_operands(best[2], qa.fmt, qb.fmt, f"conv_general_dilated ({gemm} GEMM)",
                           two_level=False)
    plan[gemm] = best
  return plan


def _block_conv_gemms(policy: DotPolicy, dn, cv: _Conv):
  """The three GEMMs of the convolution for ``policy.block_dot`` on im2col matrices."""
  ls, rs, os_ = (tuple(int(d) for d in t) for t in dn)
  inv = lambda p: tuple(int(i) for i in np.argsort(p))
  plan = _conv_plan(policy, cv)
  ops = {}
  for gemm, ((_, qa), (_, qb)) in policy.gemm_operands().items():
    g = plan[gemm][2]
    if policy.block_dot == "exact":
      bits = (significand_bits(qa.fmt), significand_bits(qb.fmt))
      ops[gemm] = functools.partial(_exact_gemm, g=g, bits=bits, policy=policy)
    else:
      ops[gemm] = functools.partial(_fp8_gemm, g=g, fmts=(qa.fmt, qb.fmt), policy=policy)
  N, C, O, T = cv.N, cv.C, cv.O, math.prod(cv.R)
  nd = len(cv.S)

  def gemm(name, a, bt):
    """a (M, K) . bt (Ncol, K).T with the plan's segments padded."""
    _, L, g = plan[name]
    return ops[name](pad_segments(a, L, g), pad_segments(bt, L, g).T)

  def fwd(l, r, key):
    del key
    x, w = jnp.transpose(l, ls), jnp.transpose(r, rs)  # (N, C, *S), (O, C, *R)
    p = _im2col(x, cv)  # (N, C, T, *So)
    sp = tuple(range(3, 3 + nd))
    if plan["fwd"][0] == "cr":
      a = jnp.transpose(p, (0, *sp, 1, 2)).reshape(-1, C * T)
      bt = w.reshape(O, C * T)
    else:
      a = jnp.transpose(p, (0, *sp, 2, 1)).reshape(-1, C * T)
      bt = jnp.transpose(w.reshape(O, C, T), (0, 2, 1)).reshape(O, T * C)
    y = gemm("fwd", a, bt).reshape(N, *cv.So, O)
    y = jnp.transpose(y, (0, nd + 1, *range(1, nd + 1)))  # (N, O, *So)
    return jnp.transpose(y, inv(os_))

  def dlhs(gr, r, key):
    del key
    gc, w = jnp.transpose(gr, os_), jnp.transpose(r, rs)  # (N, O, *So), (O, C, *R)
    p = _grad_cols(gc, cv)  # (N, O, T, *S)
    sp = tuple(range(3, 3 + nd))
    a = jnp.transpose(p, (0, *sp, 2, 1)).reshape(-1, T * O)
    bt = jnp.transpose(w.reshape(O, C, T), (1, 2, 0)).reshape(C, T * O)
    dx = gemm("dlhs", a, bt).reshape(N, *cv.S, C)
    dx = jnp.transpose(dx, (0, nd + 1, *range(1, nd + 1)))  # (N, C, *S)
    return jnp.transpose(dx, inv(ls))

  def drhs(l, gr, key):
    del key
    x, gc = jnp.transpose(l, ls), jnp.transpose(gr, os_)  # (N, C, *S), (N, O, *So)
    p = _im2col(x, cv)  # (N, C, T, *So)
    sp = tuple(range(3, 3 + nd))
    gsp = tuple(range(2, 2 + nd))
    if plan["drhs"][0] == "sn":
      a = jnp.transpose(p, (1, 2, *sp, 0)).reshape(C * T, -1)
      bt = jnp.transpose(gc, (1, *gsp, 0)).reshape(O, -1)
    else:
      a = p.reshape(N, C * T, -1).transpose(1, 0, 2).reshape(C * T, -1)
      bt = jnp.transpose(gc, (1, 0, *gsp)).reshape(O, -1)
    dw = gemm("drhs", a, bt).reshape(C, T, O)
    dw = jnp.transpose(dw, (2, 0, 1)).reshape(O, C, *cv.R)
    return jnp.transpose(dw, inv(rs))

  return {"fwd": fwd, "dlhs": dlhs, "drhs": drhs}
