"""`dot_general(policy)`: a `lax.dot_general` whose forward and backward GEMMs follow a policy.

The engine (:func:`quantized_bilinear`) is shared with :func:`jaxlp.ops.conv_general_dilated`: a
``jax.custom_vjp`` whose forward pass quantizes the operands and runs the plain lax op, and
whose backward pass quantizes the output gradient (and, per the policy, re-quantizes or
reuses the operands) and runs the TRANSPOSE of the same plain lax op
(``jax.linear_transpose``), so every dimension-number / grouping / dilation case is exactly
what autodiff of the lax op would compute on the quantized operands.

The GEMM modes that replace the plain op (accumulator emulation, ``block_dot="exact"`` /
``"fp8"``) see every ``dot_general`` as a batch of 2-D GEMMs (:class:`DotDims`): each operand
is transposed to (batch..., rows..., contraction...) and flattened to ``(B, M, K)``, with the
contracting dimension pairs in ascending lhs-axis order (the K order), free dimensions in
ascending order and batch dimensions in the order given. Operands are quantized BEFORE this
canonicalisation, in their own layout (the stochastic-rounding noise index is the operand's
own flat index), so a ``(B, S, F) @ (F, N)`` dot has the bits of the 2-D GEMM on the
``(B * S, F)`` reshape, and a dot with batch dimensions the bits of one 2-D GEMM per batch
index (``jax.vmap`` of the 2-D GEMM).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp._util import cdiv
from jaxlp.formats import _bits as B
from jaxlp.formats._block import BlockFormat, MXFormat, block_max_bits, is_axis_blocked
from jaxlp.formats._block_dot import significand_spec
from jaxlp.formats._nvfp4 import ScaledBlockFormat
from jaxlp.formats._quantize import is_elementwise, join_key, prepare, split_key
from jaxlp.formats._quantize import quantize_words as spec_quantize_words
from jaxlp.ops import _block_dot as BD
from jaxlp.ops._policy import FWD, GRAD, Accum, DotPolicy, Quant
from jaxlp.ops._quantize import quantize  # kernel on a GPU where it is faster

SLOTS = ("lhs", "rhs", "grad", "dlhs_rhs", "drhs_lhs", "drhs_grad")
GEMMS = ("fwd", "dlhs", "drhs")
#: slots on the rhs side: a weight matrix in a ``dot_general`` without batch dimensions
WEIGHT_SLOTS = ("rhs", "dlhs_rhs")


class SlotGeometry(NamedTuple):
  """How an operand slot is blocked.

  ``perm``: transpose to the tiling view, quantized there (convolutions: NCHW / OIHW; None =
  as given). ``axis``: contraction axis for axis-blocked formats (None = the format's own).
  ``view``: ``(rows, cols)`` axes of the contraction layout (``dot_general``): tile formats
  take their tiles on the 2-D matrix ``transpose(x, rows + cols)`` reshaped to
  ``(prod(rows), prod(cols))``; block maxima there, rounding and noise in the operand's own
  layout. ``weight``: in that view keep the tile's row extent (a weight matrix); otherwise a
  tile never spans two rows (tokens). ``matrix_perm``: for 2-D tiles of a two-level format
  (``nvfp4(tile=16)``), the transpose that puts the weight's (contraction, free) axes of the
  GEMM last, tiled there (a conv kernel: (spatial..., in, out)); None = ``perm``.
  ``axis`` is also the axis a :class:`jaxlp.RHT` transforms."""

  perm: tuple[int, ...] | None = None
  axis: int | None = None
  view: tuple[tuple[int, ...], tuple[int, ...]] | None = None
  weight: bool = False
  matrix_perm: tuple[int, ...] | None = None


def _is_axis_blocked(fmt) -> bool:
  return is_axis_blocked(fmt)  # mx, BlockFormat(axis=...), 1-D nvfp4 (the formats' protocol)


def _is_tiled(fmt) -> bool:
  return isinstance(fmt, BlockFormat) and fmt.axis is None


def view_tile(fmt: BlockFormat, weight: bool) -> tuple:
  """The tile a tile format takes in the contraction layout: the format's own for a weight;
  for activations and gradients an integer row extent becomes 1 (a block never spans two
  rows: two tokens, samples or heads); ``None`` (the whole extent) is kept."""
  tr, tc = fmt.tile
  if weight or tr is None:
    return (tr, tc)
  return (1, tc)


@dataclasses.dataclass(frozen=True)
class _Viewed:
  """``fmt`` (a tile BlockFormat) whose tiles are taken on a transposed 2-D view of the array:
  the block maxima come from ``transpose(|x|, perm).reshape(rows, cols)``, the rounding (and
  its noise index) stays in the array's own layout. Private: built by
  :func:`quantize_operand`."""

  fmt: BlockFormat
  perm: tuple[int, ...]
  split: int

  @property
  def supported_roundings(self):
    return self.fmt.supported_roundings

  def _quantize_f32(self, x, rounding, rand, rand_bits):
    bits = B.to_bits(x)
    mag = jnp.transpose(bits & B.u32(B.ABS_MASK), self.perm)
    pshape = mag.shape
    R, C = math.prod(pshape[:self.split]), math.prod(pshape[self.split:])
    mx = block_max_bits(mag.reshape(R, C), tile=self.fmt.tile).reshape(pshape)
    mx = jnp.transpose(mx, tuple(int(i) for i in np.argsort(self.perm)))
    return B.from_bits(self.fmt._round_with_block_max(bits, mx, rounding, rand, rand_bits))


def _quantize_view(x, fmt: BlockFormat, rounding, key, geom: SlotGeometry):
  """Tile format ``fmt`` on the contraction view ``geom.view`` of ``x`` (see SlotGeometry)."""
  rows, cols = (tuple(a) for a in geom.view)
  tile = view_tile(fmt, geom.weight)
  tr, tc = tile
  R = math.prod(x.shape[a] for a in rows)
  C = math.prod(x.shape[a] for a in cols)

  def along(axis, block):  # one row per block: blocks of `block` along `axis`, in place
    return BlockFormat(fmt.man_bits, axis=axis, block_size=block, exponent=fmt.exponent,
                       eps=fmt.eps)

  # The same blocks without a transpose where possible (a reshape keeps every flat index,
  # and so the noise): blocks along the one contracting axis; the view as a reshape; the
  # view as the transpose of a reshape (then the transposed tile of the reshape).
  if tr == 1 and len(cols) == 1:
    return quantize(x, along(cols[0], tc), rounding, key=key)
  ident = tuple(range(x.ndim))
  for order, shape2, t in ((rows + cols, (R, C), (tr, tc)), (cols + rows, (C, R), (tc, tr))):
    if order == ident:
      f2 = (along(1, t[1]) if t[0] == 1 else along(0, t[0]) if t[1] == 1
            else dataclasses.replace(fmt, tile=t))
      return quantize(x.reshape(shape2), f2, rounding, key=key).reshape(x.shape)
  xv, kw = prepare(x, fmt, rounding, key=key)
  return spec_quantize_words(xv, kw, _Viewed(dataclasses.replace(fmt, tile=tile),
                                             rows + cols, len(rows)), rounding, None)


def quantize_operand(x, quant: Quant | None, key, slot: str, geom: SlotGeometry,
                     parts: bool = False):
  """Quantize one GEMM operand per its slot's :class:`Quant` and geometry (None: as is).
  ``parts``: a two-level format (``nvfp4()``) gives ``BD.Scaled(values, tensor scale)``, its
  exact parts for ``block_dot="exact"``, instead of the decoded values."""
  if quant is None:
    return x
  if parts and BD.is_two_level(quant.fmt):
    return BD.two_level_operand(x, quant.fmt, lambda f: quantize_operand(
        x.astype(jnp.float32), dataclasses.replace(quant, fmt=f), key, slot, geom))
  fmt = quant.fmt
  k = None
  if quant.stochastic:
    if key is None:
      raise ValueError(
          f"jaxlp: operand {slot!r} uses rounding='stochastic' but no key was given: pass "
          "key=jax.random.key(...) to jaxlp.dot_general / conv_general_dilated (a fresh one "
          "per step), or rngs={'quantize': key} to a model from jaxlp.flax.quantize_model")
    k = jax.random.fold_in(key, SLOTS.index(slot))
  if _is_axis_blocked(fmt):
    if geom.axis is not None:
      fmt = dataclasses.replace(fmt, axis=geom.axis)
    return quantize(x, fmt, quant.rounding, key=k)
  if is_elementwise(fmt):
    return quantize(x, fmt, quant.rounding, key=k)
  if geom.view is not None and _is_tiled(fmt):
    return _quantize_view(x, fmt, quant.rounding, k, geom)
  perm = geom.perm
  if geom.matrix_perm is not None and getattr(fmt, "tile", None) is not None and isinstance(
      fmt, ScaledBlockFormat):
    perm = geom.matrix_perm
  if perm is None or perm == tuple(range(x.ndim)):
    return quantize(x, fmt, quant.rounding, key=k)
  inv = tuple(int(i) for i in np.argsort(perm))
  q = quantize(jnp.transpose(x, perm), fmt, quant.rounding, key=k)
  return jnp.transpose(q, inv)


def quantized_bilinear(op, lhs, rhs, policy: DotPolicy, geometry: dict[str, SlotGeometry],
                       key=None, gemms: dict[str, Any] | None = None, parts: bool = False):
  """Apply the bilinear lax op ``op(lhs, rhs)`` with the policy's quantization (custom_vjp).

  Args:
    op: ``(lhs, rhs) -> out``, bilinear (a closed-over lax.dot_general / conv).
    lhs, rhs: operands.
    policy: the :class:`DotPolicy`.
    geometry: slot name -> :class:`SlotGeometry`.
    key: PRNG key for stochastic slots (slot i draws from ``fold_in(key, i)``).
    gemms: optional replacements of the three GEMMs, ``{"fwd": f(l, r, k), "dlhs": f(g, r,
      k), "drhs": f(l, g, k)}`` (accumulator emulation, block dots) on the quantized
      operands; ``k`` is the GEMM's PRNG key, ``fold_in(key, 6 + i)`` for GEMM i = 0, 1, 2
      (None without a key). Missing ones use ``op`` / its transpose.
    parts: operands of two-level formats reach ``gemms`` as ``Scaled(values, tensor
      scale)`` (``jaxlp/ops/_block_dot.py``; the exact block dots), not decoded.

  Returns:
    ``op`` of the quantized operands, with the policy's backward pass.

  Raises:
    ValueError: the policy is stochastic and ``key`` is None.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> from jaxlp.ops import quantized_bilinear
    >>> from jaxlp.ops._dot_general import SLOTS, SlotGeometry
    >>> geometry = {slot: SlotGeometry() for slot in SLOTS}  # elementwise: no blocking
    >>> policy = jaxlp.DotPolicy(lhs=F.E2M1FN, grad=F.E2M1FN)
    >>> f = lambda l, r: quantized_bilinear(jnp.multiply, l, r, policy, geometry)
    >>> f(jnp.array([1.3]), jnp.array([2.0]))  # lhs 1.3 -> 1.5
    Array([3.], dtype=float32)
    >>> # d/dr = Q(grad) * Q(l) = 1 * 1.5; d/dl = Q(grad) * r = 2
    >>> jax.grad(lambda l, r: f(l, r).sum(), argnums=(0, 1))(jnp.array([1.3]), jnp.array([2.0]))
    (Array([2.], dtype=float32), Array([1.5], dtype=float32))
  """
  gemms = gemms or {}
  if policy.block_dot is not None and len(gemms) != 3:
    raise NotImplementedError(
        f"jaxlp: block_dot={policy.block_dot!r} is implemented for jaxlp.dot_general and "
        "jaxlp.conv_general_dilated only, not for this op; use block_dot=None there")
  if policy.stochastic and key is None:
    raise ValueError(
        "jaxlp: the policy uses rounding='stochastic' but no key was given: pass "
        "key=jax.random.key(...) (a fresh one per step)")
  kdata, kimpl = split_key(key)
  out_aval = jax.eval_shape(op, lhs, rhs)
  lhs_aval = jax.ShapeDtypeStruct(lhs.shape, lhs.dtype)
  rhs_aval = jax.ShapeDtypeStruct(rhs.shape, rhs.dtype)

  rht_slots = set()
  if policy.rht is not None:
    ops = policy.gemm_operands()
    rht_slots = {slot for g in policy.rht.gemms for slot, _ in ops[g]}

  def q(x, slot, k):
    geom = geometry[slot]
    if slot in rht_slots and geom.axis is not None:  # RHT first, then quantize
      x = policy.rht.apply(x, geom.axis)
    return quantize_operand(x, getattr(policy, slot), k, slot, geom, parts)

  def gemm_key(k, name):
    return None if k is None else jax.random.fold_in(k, len(SLOTS) + GEMMS.index(name))

  def fwd(l, r, kd):
    k = join_key(kd, kimpl)
    lq, rq = q(l, "lhs", k), q(r, "rhs", k)
    out = gemms["fwd"](lq, rq, gemm_key(k, "fwd")) if "fwd" in gemms else op(lq, rq)
    out = out.astype(out_aval.dtype)
    res = (lq if policy.drhs_lhs == FWD else l, rq if policy.dlhs_rhs == FWD else r, kd)
    return out, res

  def bwd(res, g):
    l_res, r_res, kd = res
    k = join_key(kd, kimpl)
    r_dl = r_res if policy.dlhs_rhs == FWD else q(r_res, "dlhs_rhs", k)
    l_dr = l_res if policy.drhs_lhs == FWD else q(l_res, "drhs_lhs", k)
    g_dl = q(g, "grad", k)
    g_dr = g_dl if policy.drhs_grad == GRAD else q(g, "drhs_grad", k)
    if "dlhs" in gemms:
      dl = gemms["dlhs"](g_dl, r_dl, gemm_key(k, "dlhs"))
    else:
      (dl,) = jax.linear_transpose(lambda x: op(x, r_dl), lhs_aval)(g_dl)
    if "drhs" in gemms:
      dr = gemms["drhs"](l_dr, g_dr, gemm_key(k, "drhs"))
    else:
      (dr,) = jax.linear_transpose(lambda w: op(l_dr, w), rhs_aval)(g_dr)
    kd_ct = None
    return dl.astype(lhs.dtype), dr.astype(rhs.dtype), kd_ct

  @jax.custom_vjp
  def f(l, r, kd):
    return fwd(l, r, kd)[0]

  f.defvjp(fwd, bwd)
  return f(lhs, rhs, kdata)


# ---------------------------------------------------------------------------------------
# dot_general as a batch of 2-D GEMMs
# ---------------------------------------------------------------------------------------
class DotDims(NamedTuple):
  """The axes of a ``dot_general``: batch pairs (``lb``/``rb``, in the order given),
  contracting pairs (``lc``/``rc``) in ascending lhs-axis order (the K order), free axes
  (``lf``/``rf``) ascending; the output is ``(batch..., lf..., rf...)``."""

  lb: tuple[int, ...]
  rb: tuple[int, ...]
  lc: tuple[int, ...]
  rc: tuple[int, ...]
  lf: tuple[int, ...]
  rf: tuple[int, ...]

  @property
  def ob(self):
    return tuple(range(len(self.lb)))

  @property
  def olf(self):
    n = len(self.lb)
    return tuple(range(n, n + len(self.lf)))

  @property
  def orf(self):
    n = len(self.lb) + len(self.lf)
    return tuple(range(n, n + len(self.rf)))

  def slot_contraction(self, slot: str) -> tuple[int, ...]:
    """The contracting axes (K order) of ``slot``'s operand in the GEMM it is quantized
    for: lhs/rhs in fwd, grad/dlhs_rhs in dlhs, drhs_lhs/drhs_grad in drhs."""
    return {"lhs": self.lc, "rhs": self.rc, "grad": self.orf, "dlhs_rhs": self.rf,
            "drhs_lhs": self.lf, "drhs_grad": self.olf}[slot]

  def roles(self, gemm: str):
    """``((a_batch, a_rows, a_k), (b_batch, b_k, b_cols), (t_batch, t_rows, t_cols))``: the
    GEMM ``C[b] = A[b] (M, K) . B[b] (K, N)`` on the two operands (in their own layouts)
    and the axes of its result's layout that ``(B, M, N)`` maps to."""
    ob, olf, orf = self.ob, self.olf, self.orf
    if gemm == "fwd":
      return ((self.lb, self.lf, self.lc), (self.rb, self.rc, self.rf), (ob, olf, orf))
    if gemm == "dlhs":
      return ((ob, olf, orf), (self.rb, self.rf, self.rc), (self.lb, self.lf, self.lc))
    return ((self.lb, self.lc, self.lf), (ob, olf, orf), (self.rb, self.rc, self.rf))


def _axes(t, nd):
  return tuple(int(d) % max(nd, 1) for d in t)


def dot_dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> DotDims:
  """:class:`DotDims` of ``dimension_numbers`` for operands of these ranks."""
  (lc, rc), (lb, rb) = dimension_numbers
  lc, lb = _axes(lc, lhs_ndim), _axes(lb, lhs_ndim)
  rc, rb = _axes(rc, rhs_ndim), _axes(rb, rhs_ndim)
  if len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(f"jaxlp.dot_general: dimension_numbers={dimension_numbers} pair "
                     "different numbers of lhs and rhs dimensions")
  pairs = sorted(zip(lc, rc, strict=True))
  lc, rc = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
  lf = tuple(d for d in range(lhs_ndim) if d not in lc and d not in lb)
  rf = tuple(d for d in range(rhs_ndim) if d not in rc and d not in rb)
  return DotDims(lb, rb, lc, rc, lf, rf)


def resolve_layout(policy: DotPolicy, dims: DotDims, lhs_ndim: int, rhs_ndim: int) -> str:
  """``policy.layout`` with ``"auto"`` resolved: ``"hbfp"`` for a plain matrix product (2-D
  operands, one contracting dimension, no batch dimensions), ``"contraction"`` otherwise."""
  if policy.layout != "auto":
    return policy.layout
  plain = lhs_ndim == 2 and rhs_ndim == 2 and len(dims.lc) == 1 and not dims.lb
  return "hbfp" if plain else "contraction"


def dot_geometry(dims: DotDims, layout: str) -> dict[str, SlotGeometry]:
  """Slot -> :class:`SlotGeometry`: axis-blocked formats along the innermost contracting
  axis of the slot's GEMM (none: the format's own axis); tile formats on the contraction
  view in the ``"contraction"`` layout, the (dim0, rest) view of the operand as given in
  ``"hbfp"``."""
  nd = {"lhs": len(dims.lb) + len(dims.lc) + len(dims.lf),
        "rhs": len(dims.rb) + len(dims.rc) + len(dims.rf)}
  nd["grad"] = len(dims.lb) + len(dims.lf) + len(dims.rf)
  shape_of = {"lhs": "lhs", "rhs": "rhs", "grad": "grad", "dlhs_rhs": "rhs",
              "drhs_lhs": "lhs", "drhs_grad": "grad"}
  geo = {}
  # a weight's 2-D tiles (two-level formats) on its (innermost contraction, innermost free)
  # axes of the forward GEMM, in both weight slots: W and W^T tile alike
  mperm = None
  if dims.rc and dims.rf and not dims.lb:
    kr, fr = dims.rc[-1], dims.rf[-1]
    mperm = tuple(a for a in range(nd["rhs"]) if a not in (kr, fr)) + (kr, fr)
    mperm = None if mperm == tuple(range(nd["rhs"])) else mperm
  for slot in SLOTS:
    k = dims.slot_contraction(slot)
    axis = k[-1] if k else None
    view = None
    if layout == "contraction":
      n = nd[shape_of[slot]]
      view = (tuple(a for a in range(n) if a not in k), k)
    geo[slot] = SlotGeometry(axis=axis, view=view,
                             weight=slot in WEIGHT_SLOTS and not dims.lb,
                             matrix_perm=mperm if slot in WEIGHT_SLOTS else None)
  return geo


def _canon(x, batch, rows, cols):
  """``x`` transposed to (batch, rows, cols) and flattened to ``(B, R, C)``."""
  if isinstance(x, BD.Scaled):
    return BD.map_values(lambda v: _canon(v, batch, rows, cols), x)
  perm = tuple(batch) + tuple(rows) + tuple(cols)
  if perm != tuple(range(x.ndim)):
    x = jnp.transpose(x, perm)
  sh = x.shape
  nb, nr = len(batch), len(rows)
  return x.reshape(math.prod(sh[:nb]), math.prod(sh[nb:nb + nr]), math.prod(sh[nb + nr:]))


def _uncanon(y, shape, batch, rows, cols):
  """Inverse of :func:`_canon`: ``y`` (B, R, C) back to an array of ``shape`` whose
  (batch, rows, cols) axes it holds."""
  perm = tuple(batch) + tuple(rows) + tuple(cols)
  y = y.reshape(tuple(shape[a] for a in perm))
  if perm != tuple(range(len(shape))):
    y = jnp.transpose(y, tuple(int(i) for i in np.argsort(perm)))
  return y


def _batched(f, a, bt):
  """``f(a[i], bt[i])`` over the leading batch axis; without a batch (B = 1) one 2-D call."""
  if a.shape[0] == 1:
    return f(a[0], bt[0])[None]
  return jax.vmap(f)(a, bt)


def _gemm_fns(dims: DotDims, shapes: dict[str, tuple], core):
  """The three GEMM replacements: each canonicalises its operands to ``a`` (B, M, K) and
  ``bt`` (B, N, K), calls ``core(gemm, a, bt, key)`` -> (B, M, N) and maps the result back
  to the layout of the output / lhs / rhs."""

  def make(gemm):
    (ab, ar, ak), (bb, bk, bc), (tb, tr, tc) = dims.roles(gemm)
    target = {"fwd": "out", "dlhs": "lhs", "drhs": "rhs"}[gemm]

    def run(x, y, key):
      a = _canon(x, ab, ar, ak)
      bt = _canon(y, bb, bc, bk)
      return _uncanon(core(gemm, a, bt, key), shapes[target], tb, tr, tc)

    return run

  return {g: make(g) for g in GEMMS}


def _accum_core(policy: DotPolicy):
  accs = {"fwd": policy.fwd_acc, "dlhs": policy.dlhs_acc, "drhs": policy.drhs_acc}

  def core(gemm, a, bt, key):
    from jaxlp.ops._matmul import matmul  # noqa: PLC0415  (import cycle)
    acc: Accum = accs[gemm]
    k = key if acc.rounding == "stochastic" else None
    a, b = a.astype(jnp.float32), jnp.swapaxes(bt, 1, 2).astype(jnp.float32)
    mm = functools.partial(matmul, mul=acc.mul, acc=acc.acc, algorithm=acc.algorithm,
                           chunk=acc.chunk, rounding=acc.rounding, key=k)
    if a.shape[0] == 1:  # no batch dimensions: the 2-D GEMM (output index = flat index)
      return mm(a[0], b[0])[None]
    return mm(a, b)

  return core, accs


def _accum_gemms(policy: DotPolicy, dims: DotDims, shapes):
  """GEMM replacements routing accumulator-emulated GEMMs through ``jaxlp.ops.matmul``: the
  batched 2-D GEMM ``(B, M, K) @ (B, K, N)``, whose stochastic-rounding noise index is the
  flat index of the ``(B, M, N)`` result (``jaxlp.matmul``'s rule)."""
  core, accs = _accum_core(policy)
  if all(a is None for a in accs.values()):
    return {}
  fns = _gemm_fns(dims, shapes, core)
  return {g: fns[g] for g in GEMMS if accs[g] is not None}


# ---------------------------------------------------------------------------------------
# block_dot: K-blocks from the operands' quantization blocks
# ---------------------------------------------------------------------------------------
def block_geometry(quant: Quant | None, geom: SlotGeometry, ndim: int, mode: str):
  """The blocks of an operand quantized with ``quant`` as ``(rows, cols, (tr, tc))``: tiles
  ``(tr, tc)`` (None = the whole extent) of the 2-D matrix ``transpose(x, rows + cols)``, or
  None when the operand imposes no block structure on a GEMM (per-tensor scales of the fp8
  mode, unquantized operands)."""
  if quant is None:
    return None
  fmt = quant.fmt
  if mode == "fp8" and not isinstance(fmt, MXFormat):
    return None  # per-tensor scale
  if _is_axis_blocked(fmt):
    a = (fmt.axis if geom.axis is None else geom.axis) % max(ndim, 1)
    return (tuple(d for d in range(ndim) if d != a), (a,), (1, fmt.block_size))
  if isinstance(fmt, ScaledBlockFormat) and fmt.tile is not None:  # as quantize_operand tiles
    return BD.scaled_tile_blocks(fmt, getattr(geom, "matrix_perm", None) or geom.perm, ndim)
  if _is_tiled(fmt):
    if geom.view is not None:
      rows, cols = geom.view
      return (tuple(rows), tuple(cols), view_tile(fmt, geom.weight))
    return ((0,), tuple(range(1, ndim)), fmt.tile) if ndim else None
  return None


def k_changes(shape, blocks, kaxes) -> set[int]:
  """Positions ``k`` (1 <= k < K) of the flattened contraction (axes ``kaxes`` of an operand
  of ``shape``, C order) where, for some fixed index of the other axes, element k lies in
  another quantization block than element k - 1 (``blocks``: :func:`block_geometry`)."""
  K = math.prod(shape[a] for a in kaxes)
  if blocks is None or K <= 1:
    return set()
  rows, cols, tile = blocks
  idx, rem = {}, np.arange(K, dtype=np.int64)
  for a in reversed(kaxes):
    idx[a], rem = rem % shape[a], rem // shape[a]
  changed = np.zeros(K - 1, bool)
  for axes, t in zip((rows, cols), tile, strict=True):
    ext = math.prod(shape[a] for a in axes)
    if t is None or t >= ext:
      continue
    strides = {a: math.prod(shape[b] for b in axes[i + 1:]) for i, a in enumerate(axes)}
    pos = sum((idx[a] * strides[a] for a in axes if a in idx), np.zeros(K, np.int64))
    res = {0}  # residues modulo t of the other axes' offsets
    for a in axes:
      if a not in idx:
        step = [(i * strides[a]) % t for i in range(min(shape[a], t))]
        res = {(r + s) % t for r in res for s in step}
    blk = (np.array(sorted(res), np.int64)[:, None] + pos[None, :]) // t
    changed |= (blk[:, 1:] != blk[:, :-1]).any(axis=0)
  return set((np.nonzero(changed)[0] + 1).tolist())


def k_blocking(changes: set[int], K: int, inner: int) -> tuple[int, int]:
  """``(L, g)``: K runs in segments of L (the innermost contracting dimension, or L = K),
  each cut into K-blocks of g (the last one of a segment shorter), such that every position
  in ``changes`` is a K-block boundary; the largest g, ``L = K`` on a tie."""
  if K <= 1:
    return (max(K, 1), 1)
  gK = math.gcd(*changes) if changes else K
  if 1 < inner < K:
    within = [c % inner for c in changes if c % inner]
    gd = math.gcd(*within) if within else inner
    if gd > gK:
      return (inner, gd)
  return (K, gK)


def pad_segments(x, L: int, g: int):
  """``x`` (..., K) with each segment of L along the last axis zero-padded to a multiple of
  g, so that the K-blocks of g never cross a segment (zeros add nothing to a block dot).
  One segment (L = K) needs none: its last K-block is just shorter."""
  K = x.shape[-1]
  Lp = cdiv(L, g) * g if L else 0
  if Lp == L or L >= K:
    return x
  lead = x.shape[:-1]
  x = x.reshape(*lead, K // L, L)
  x = jnp.pad(x, [(0, 0)] * (len(lead) + 1) + [(0, Lp - L)])
  return x.reshape(*lead, (K // L) * Lp)


def block_plan(policy: DotPolicy, dims: DotDims, shapes, geo) -> dict[str, tuple[int, int]]:
  """GEMM -> its K-blocking ``(L, g)`` (:func:`k_blocking`) for ``policy.block_dot``: the
  coarsest one that every K-block of every row / column of both operands lies within one of
  that operand's quantization blocks."""
  mode = policy.block_dot
  side = {"lhs": "lhs", "drhs_lhs": "lhs", "rhs": "rhs", "dlhs_rhs": "rhs", "grad": "out",
          "drhs_grad": "out"}
  plan = {}
  for gemm, ((sa, qa), (sb, qb)) in policy.gemm_operands().items():
    (_, _, ak), (_, bk, _), _ = dims.roles(gemm)
    changes = set()
    for slot, qq, kaxes in ((sa, qa, ak), (sb, qb, bk)):
      shape = shapes[side[slot]]
      blocks = block_geometry(qq, geo[slot], len(shape), mode)
      for blk in blocks if isinstance(blocks, list) else [blocks]:
        changes |= k_changes(shape, blk, kaxes)
    shape_a = shapes[side[sa]]
    K = math.prod(shape_a[a] for a in ak)
    inner = next((shape_a[a] for a in reversed(ak) if shape_a[a] > 1), 1)
    L, g = k_blocking(changes, K, inner)
    if mode == "exact":
      BD.check_exact_operands(g, qa.fmt, qb.fmt, f"dot_general ({gemm} GEMM)")
    plan[gemm] = (L, g)
  return plan


def _block_gemms(policy: DotPolicy, dims: DotDims, shapes, geo):
  """GEMM replacements for ``policy.block_dot`` (``"exact"``: integer block dots with the
  bits of ``jaxlp/formats/_block_dot.py``; ``"fp8"``: the fp8 fast mode), one 2-D GEMM per
  batch index."""
  plan = block_plan(policy, dims, shapes, geo)
  fns = {}
  for gemm, ((_, qa), (_, qb)) in policy.gemm_operands().items():
    g = plan[gemm][1]
    if policy.block_dot == "exact":
      sa, sb = significand_spec(qa.fmt), significand_spec(qb.fmt)
      fns[gemm] = functools.partial(_exact_gemm, g=g, bits=(sa.bits, sb.bits), policy=policy,
                                    prec=(sa.prec, sb.prec))
    else:
      fns[gemm] = functools.partial(_fp8_gemm, g=g, fmts=(qa.fmt, qb.fmt), policy=policy)

  def core(gemm, a, bt, key):
    del key
    L, g = plan[gemm]
    (a, sa), (bt, sb) = BD.split_scaled(a), BD.split_scaled(bt)
    kw = {} if sa is None and sb is None else {"scales": (sa, sb)}  # two-level operands
    a, bt = pad_segments(a, L, g), pad_segments(bt, L, g)
    return _batched(lambda u, v: fns[gemm](u, v.T, **kw), a, bt)

  return _gemm_fns(dims, shapes, core)


def _exact_gemm(a, b, *, g, bits, policy, prec=None, scales=None):
  return BD.block_dot(a.astype(jnp.float32), b.astype(jnp.float32), g, *bits,
                      gpu_impl=policy.gpu_impl, gpu_route=policy.gpu_route, prec=prec,
                      scales=scales)


def _fp8_gemm(a, b, *, g, fmts, policy):
  return BD.fp8_dot(a, b, *fmts, g, gpu_impl=policy.fp8_gpu_impl)


def dot_general(policy: DotPolicy | None = None, *, key=None):
  """A ``lax.dot_general`` replacement that quantizes its GEMMs per ``policy``.

  The returned callable has ``lax.dot_general``'s signature
  ``(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None)``, accepts and
  ignores extra keywords (``out_sharding``, ...), and takes an optional keyword ``key`` that
  overrides the construction key. It plugs into ``flax.linen.Dense(dot_general=...)``,
  ``nnx.Linear(..., dot_general=...)`` and ``jnp.einsum(..., _dot_general=...)``.

  Any dimension numbers are supported, in every mode of the policy. Axis-blocked formats (MX)
  are blocked along each operand's contraction axis in each GEMM: forward lhs/rhs along the
  (paired) contracting dimension with the largest lhs index; in the dlhs GEMM the rhs and the
  gradient along the last rhs free dimension; in the drhs GEMM the lhs and the gradient along
  the last lhs free dimension. Tile-blocked formats see the operands in the policy's
  ``layout`` (:class:`jaxlp.DotPolicy`: HBFPEmulator's (dim0, rest) view for plain 2-D
  matrix products, the GEMM's matrix with one token per activation block otherwise).
  Operands are quantized in their own layout: the stochastic-rounding noise of an element
  comes from its flat index in the operand (``fold_in(key, slot)``).

  Accumulator emulation and ``block_dot`` run each GEMM as a batch of 2-D GEMMs
  ``C[b] = A[b] (M, K) . B[b] (K, N)``: b = the batch dimensions (in the order given), M / N
  = the lhs / rhs free dimensions (ascending) flattened, K = the contracting dimensions
  flattened with the pairs in ascending lhs-axis order (the dlhs GEMM contracts the rhs free
  dimensions, the drhs GEMM the lhs free dimensions, each ascending). So a ``(B, S, F) . (F,
  N)`` dot has the bits of the 2-D GEMM on the ``(B * S, F)`` reshape, and a dot with batch
  dimensions the bits of one 2-D GEMM per batch index. Accumulator emulation calls
  :func:`jaxlp.matmul` on ``(b, M, K) @ (b, K, N)`` (a stochastic accumulator's noise index
  is the flat index of that result; GEMM i = fwd, dlhs, drhs draws from ``fold_in(key, 6 +
  i)``). ``block_dot`` cuts K into K-blocks that are the operands' quantization blocks: the
  coarsest blocks such that every K-block of every row of A and column of B lies within one
  block of its operand's format, either blocks of g over the flattened K or, where that
  gives longer blocks (blocks along the innermost contracting dimension d with d not a
  multiple of the block length, e.g. MX blocks of 32 along a head dimension of 48), every
  run of d cut into blocks of g, each run zero-padded to a multiple of g (zeros change no
  exact dot). The K-blocks are summed in ascending order of the flattened K: ascending
  (h, d-block) for contracting dimensions (h, d). Operands whose blocks run across the
  contraction (e.g. per-token blocks in the weight-gradient GEMM, which contracts the
  tokens) get K-blocks of 1 (each product rounded once, summed in K order: valid, slow).

  ``DotPolicy()`` (or None) returns the plain ``lax.dot_general`` computation (backward =
  plain autodiff).

  Args:
    policy: a :class:`jaxlp.DotPolicy` (``hbfp_policy(...)``, ``mx_policy(...)``, ...).
    key: PRNG key for stochastic rounding (required if the policy is stochastic); use a
      fresh key per training step.

  Returns:
    The dot_general callable (its ``policy`` attribute holds the policy). Calling it raises
    ``ValueError`` if the policy is stochastic and no key was given, or, with
    ``block_dot="exact"``, if a K-block is too long for an exact int32 dot (the message
    names the GEMM).

  Raises:
    TypeError: ``policy`` is not a :class:`jaxlp.DotPolicy` (or None).

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> dot = jaxlp.dot_general(jaxlp.mx_policy(F.E2M1FN, block_size=2))
    >>> x = jnp.array([[1.0, 0.3]])  # one MXFP4 block: scale 2**(0 - 2), 0.3 -> 0.25
    >>> w = jnp.array([[1.0], [1.0]])
    >>> dot(x, w, (((1,), (0,)), ((), ())))
    Array([[1.25]], dtype=float32)
    >>> sr = jaxlp.dot_general(jaxlp.mx_policy(rounding="stochastic"), key=jax.random.key(0))
    >>> sr(x, w, (((1,), (0,)), ((), ()))).shape
    (1, 1)
  """
  policy = DotPolicy() if policy is None else policy
  if not isinstance(policy, DotPolicy):
    raise TypeError(f"jaxlp.dot_general: policy must be a DotPolicy, got {policy!r}")
  default_key = key

  def jaxlp_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, *, key=None, **unused):
    del unused
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)

    def op(l, r):
      return lax.dot_general(l, r, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type)

    if policy.is_identity:
      return op(lhs, rhs)
    dims = dot_dims(dimension_numbers, lhs.ndim, rhs.ndim)
    geo = dot_geometry(dims, resolve_layout(policy, dims, lhs.ndim, rhs.ndim))
    shapes = {"lhs": lhs.shape, "rhs": rhs.shape,
              "out": jax.eval_shape(op, lhs, rhs).shape}
    gemms = (_block_gemms(policy, dims, shapes, geo) if policy.block_dot
             else _accum_gemms(policy, dims, shapes))
    k = default_key if key is None else key
    return quantized_bilinear(op, lhs, rhs, policy, geo, key=k, gemms=gemms,
                              parts=policy.block_dot == "exact")

  jaxlp_dot_general.policy = policy
  return jaxlp_dot_general
