"""Block floating point: BFP/HBFP, QPyTorch's block_quantize and OCP MX.

A block format shares one exponent among a block of elements. Blocks are described
geometrically and the shared exponent is computed from the block's largest magnitude,
read exactly from float32 bit patterns (never through a float ``log2``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp._deprecation import renamed_kwargs
from jaxlp._util import cdiv, round_up
from jaxlp.formats import _bits as B
from jaxlp.formats._float_format import FloatFormat
from jaxlp.formats._fparith import normalize
from jaxlp.formats._presets import E2M1FN, E2M3FN, E3M2FN, E4M3, E4M3FN, E5M2

EXPONENT_RULES = ("exact", "hbfp")


def _is_int(v):
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------
# Block geometry: reduce |x| over blocks, broadcast a per-block value back.
# ---------------------------------------------------------------------------------------
def _tile_view(shape, tile):
  """(rows, cols, tr, tc) of the (dim0, rest) view with tile sizes (None = whole extent)."""
  rows = shape[0] if len(shape) >= 1 else 1
  cols = math.prod(shape[1:]) if len(shape) >= 2 else 1
  tr = rows if tile[0] is None else tile[0]
  tc = cols if tile[1] is None else tile[1]
  return rows, cols, max(tr, 1), max(tc, 1)


def is_axis_blocked(fmt) -> bool:
  """True if ``fmt``'s blocks run along one axis, ``fmt.axis``.

  The protocol: such a format has a ``block_axis`` property (its ``axis`` field; None where
  its blocks are not 1-D, e.g. tiles) and can be rebuilt along another axis with
  ``dataclasses.replace(fmt, axis=a)``, which ``jaxlp.dot_general`` does to block each
  operand along its contraction axis. ``mx(...)``, ``BlockFormat(axis=...)`` and 1-D
  :class:`~jaxlp.formats.ScaledBlockFormat` (``nvfp4()``) take part.

  Example:
    >>> from jaxlp import formats as F
    >>> from jaxlp.formats._block import is_axis_blocked
    >>> [is_axis_blocked(f) for f in (F.mx(F.E4M3FN), F.nvfp4(), F.nvfp4(tile=16), F.hbfp(8))]
    [True, True, False, False]
  """
  return getattr(fmt, "block_axis", None) is not None


def check_block_axis(fmt, shape) -> None:
  """ValueError unless the block axis of ``fmt`` (``mx(...)``, ``BlockFormat(axis=...)``,
  ``nvfp4()``; other formats have none) is in ``-ndim..ndim-1`` for an array of ``shape``."""
  if not is_axis_blocked(fmt):
    return
  axis = fmt.block_axis
  nd = len(shape)
  if not -max(nd, 1) <= axis < max(nd, 1):  # a scalar is one block (axis 0 or -1)
    raise ValueError(f"{fmt!r}: block axis {axis} is out of range for an array of shape "
                     f"{tuple(shape)} ({nd} dimension(s))")


def block_max_bits(mag, *, tile=None, axis=None, block_size=None):
  """Per-element uint32 magnitude bits of its block's max |x| (NaN > inf > finite).

  Either ``tile=(tr, tc)`` — tiles of the (dim0, prod(rest)) view, ``None`` meaning the
  whole extent — or ``axis`` (+ optional ``block_size``, default the whole axis; an axis
  outside ``-ndim..ndim-1`` is a ValueError).
  """
  mx, expand = block_reduce_max(mag, tile=tile, axis=axis, block_size=block_size)
  return expand(mx)


def block_reduce_max(mag, *, tile=None, axis=None, block_size=None):
  """``(mx, expand)``: the blocks' max |x| bits, one per block, and the function that spreads
  a per-block array (of ``mx``'s shape) to the elements of ``mag``'s shape.

  ``mx`` keeps the blocked layout of :func:`block_max_bits` (the reduced axes kept with
  size 1), so that per-block quantities (a shared exponent, a scale) can be computed once
  per block before ``expand`` broadcasts them. Arguments as :func:`block_max_bits`.
  """
  shape = mag.shape
  if axis is not None:
    nd = max(len(shape), 1)
    if not -nd <= axis < nd:
      raise ValueError(f"block axis {axis} is out of range for an array of shape {shape} "
                       f"({len(shape)} dimension(s))")
    if not shape:  # a scalar is one block of one element
      mx, expand = block_reduce_max(mag.reshape(1), axis=0, block_size=block_size)
      return mx, lambda v: expand(v).reshape(())
    # Blocks cut along the axis where it is (no transpose to the last axis: on XLA:CPU
    # moving a leading axis last and back cost 4x the block max itself on (512, 128)).
    # A partial last block is reduced on its own slice instead of padding the array: XLA:CPU
    # fuses a pad into the reduction as a bounds check per element, which cost 5x the
    # unpadded reduction along a middle axis ((8, 63, 512), axis 1: 261 us against 48 us).
    ax = axis % nd
    n = shape[ax]
    bs = n if block_size is None else block_size
    nb = cdiv(n, bs) if n else 0
    nf, tail = (n // bs, n % bs) if n else (0, 0)
    pad = nb * bs - n
    bshape = shape[:ax] + (nb, bs) + shape[ax + 1:]

    def bmax(v, nblk, size):
      if ax == nd - 1 and size % 4 == 0 and size > 4:
        # Blocks along the last axis: the max over (size / 4, 4) sub-rows first, then over
        # the 4 (XLA:CPU reduces across rows with vector lanes, a row of 32 one lane at a
        # time: 3-4x faster measured on (504, 512) and (1024, 1024)).
        v = v.reshape(shape[:ax] + (nblk, size // 4, 4))
        v = jnp.max(v, axis=ax + 1, initial=B.u32(0))
        return jnp.max(v, axis=ax + 1, keepdims=True, initial=B.u32(0))
      v = v.reshape(shape[:ax] + (nblk, size) + shape[ax + 1:])
      return jnp.max(v, axis=ax + 1, keepdims=True, initial=B.u32(0))

    if not n:
      mx = bmax(mag, 0, bs)
    else:
      parts = []
      if nf:
        parts.append(bmax(lax.slice_in_dim(mag, 0, nf * bs, axis=ax) if tail else mag, nf, bs))
      if tail:
        parts.append(bmax(lax.slice_in_dim(mag, nf * bs, n, axis=ax), 1, tail))
      mx = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=ax)

    def expand(v):
      full = jnp.broadcast_to(v, bshape).reshape(shape[:ax] + (nb * bs,) + shape[ax + 1:])
      return lax.slice_in_dim(full, 0, n, axis=ax) if pad else full

    return mx, expand
  rows, cols, tr, tc = _tile_view(shape, tile)
  m2 = mag.reshape(rows, cols)
  R = round_up(rows, tr)
  C = round_up(cols, tc)
  mp = jnp.pad(m2, [(0, R - rows), (0, C - cols)])
  bshape = (R // tr, tr, C // tc, tc)
  mx = jnp.max(mp.reshape(bshape), axis=(1, 3), keepdims=True, initial=B.u32(0))

  def expand(v):
    full = jnp.broadcast_to(v, bshape).reshape(R, C)[:rows, :cols]
    return full.reshape(shape)

  return mx, expand


def _stack_words(arrays):
  """``(stacked, unstack)``: 32-bit int and bool arrays of one shape as one uint32 array
  (stacked on a new last axis), and the function that gives them back from it."""
  dtypes = [jnp.asarray(p).dtype for p in arrays]
  words = [p.astype(B.U32) if dt == jnp.bool_ else lax.bitcast_convert_type(p, B.U32)
           for p, dt in zip(arrays, dtypes, strict=True)]
  shape = jnp.broadcast_shapes(*(w.shape for w in words))
  stacked = jnp.stack([jnp.broadcast_to(w, shape) for w in words], axis=-1)

  def unstack(st):
    return tuple(st[..., i] != B.u32(0) if dt == jnp.bool_ else
                 lax.bitcast_convert_type(st[..., i], dt) for i, dt in enumerate(dtypes))

  return stacked, unstack


def _fenced_params(params, mx, expand, stack=False):
  """Per-block ``params`` computed once per block (:func:`jaxlp.formats._bits.fence`, keyed
  on a block maximum), then spread to the elements. ``stack``: the parameters (32-bit ints
  and bools of ``mx``'s shape) go through one fence as one stacked uint32 array: one small
  XLA fusion instead of one per parameter (MX's nearest paths)."""
  if not mx.size:
    return tuple(expand(p) for p in params)
  if not stack:
    return tuple(expand(p) for p in B.fence(params, mx.reshape(-1)[0]))
  stacked, unstack = _stack_words(params)
  return tuple(map(expand, unstack(B.fence(stacked, mx.reshape(-1)[0]))))


def _bfp_vmax(e, man_bits):
  """Bits of the largest value ``2^e - 2^(e-m)`` of a block with shared exponent ``e``."""
  qe = e - man_bits
  # vmax = 2^e - 2^(e-m): exponent e-1, top m-1 fraction bits set.
  frac = B.u32(((1 << 23) - 1) & ~((1 << max(24 - man_bits, 0)) - 1)) if man_bits <= 24 else 0
  vmax_normal = (((jnp.clip(e - 1, -126, 127) + 127).astype(B.U32)) << 23) | frac
  vmax_sub = B.u32((1 << man_bits) - 1) << jnp.clip(qe + 149, 0, 31).astype(B.U32)
  return jnp.where(e - 1 >= -126, vmax_normal,
                   jnp.where(qe >= -149, vmax_sub, B.u32(B.INF_BITS)))


def _bfp_round(bits, e, man_bits, rounding, rand, rand_bits):
  """Sign-magnitude grid k * 2^(e-m), |k| <= 2^m - 1, with per-element shared exponent e."""
  sign, mag, _ = B.split(bits)
  qe = e - man_bits
  r = B.round_to_quantum(mag, qe, rounding, negative=sign, rand=rand, rand_bits=rand_bits)
  r = jnp.minimum(r, _bfp_vmax(e, man_bits))
  return r | jnp.where(sign, B.u32(B.SIGN_MASK), B.u32(0))


@dataclasses.dataclass(frozen=True)
class BlockFormat:
  """Block floating point: one shared exponent per block, sign-magnitude mantissas.

  Each element is ``k * 2**(e - man_bits)`` with integer ``|k| <= 2**man_bits - 1``
  (``man_bits`` magnitude bits, no hidden bit; values saturate at ``2**e - 2**(e-m)``),
  where ``e`` is the block's shared exponent.

  Blocks (exactly one of the two ways):
    * ``tile=(tr, tc)``: tiles of the 2-D (dim0, prod(rest)) view of the array, ``None``
      meaning the whole extent: ``(None, None)`` = one exponent per tensor (the default),
      ``(1, None)`` = one per index of dim 0 (per sample), ``(24, 24)`` = HBFP's 24x24 tiles.
    * ``axis=a`` with optional ``block_size=b``: blocks of ``b`` consecutive elements along
      axis ``a`` (the last block may be partial; zero padding never raises a block max).

  Shared exponent rules (``exponent``):
    * ``"exact"``: the smallest ``e`` with ``max|x| < 2**e`` (= floor(log2 max) + 1).
    * ``"hbfp"``: HBFPEmulator's ``ceil(log2(max|x| + eps))`` with the add done in float32
      and the ``ceil(log2 .)`` computed exactly from the bits (HBFPEmulator uses torch's
      float32 ``log2``, which can differ by one at a few magnitudes just above a power of
      two, e.g. ``2**20 * (1 + 2**-23)``; jaxlp follows the exact value).

  A block containing inf or NaN becomes all NaN (as in HBFPEmulator). -0.0 is kept for
  negatives that round to zero.

  Raises:
    ValueError: ``man_bits`` not an int in 1..24, an unknown ``exponent`` rule, both
      ``tile`` and ``axis`` given, ``block_size`` without ``axis`` or not a positive int,
      a malformed ``tile``, a non-int ``axis``, or a negative or non-float ``eps``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # blocks of 4 along the last axis; 3 magnitude bits. Block 1: max 3.9 -> e = 2, step
    >>> # 2**(2-3) = 0.5, largest value 3.5 (3.9 saturates). Block 2: max 0.2 -> e = -2.
    >>> fmt = F.BlockFormat(3, axis=-1, block_size=4)
    >>> F.quantize(jnp.array([1.0, 0.3, -2.6, 3.9, 0.2, 0.1, 0.01, -0.05]), fmt)
    Array([ 1.     ,  0.5    , -2.5    ,  3.5    ,  0.1875 ,  0.09375,
            0.     , -0.0625 ], dtype=float32)
  """

  man_bits: int
  tile: tuple | None = (None, None)
  axis: int | None = None
  block_size: int | None = None
  exponent: str = "exact"
  eps: float = 1e-8

  def __post_init__(self):
    if not _is_int(self.man_bits) or not 1 <= self.man_bits <= 24:
      raise ValueError(f"BlockFormat: man_bits must be an int in 1..24, got {self.man_bits!r}")
    if self.exponent not in EXPONENT_RULES:
      raise ValueError(
          f"BlockFormat: exponent must be one of {EXPONENT_RULES}, got {self.exponent!r}")
    if self.axis is not None:
      if self.tile not in (None, (None, None)):
        raise ValueError("BlockFormat: give either tile=... or axis=..., not both")
      object.__setattr__(self, "tile", None)
      if not _is_int(self.axis):
        raise ValueError(f"BlockFormat: axis must be an int, got {self.axis!r}")
      if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 1):
        raise ValueError(f"BlockFormat: block_size must be a positive int, got {self.block_size!r}")
    else:
      if self.block_size is not None:
        raise ValueError("BlockFormat: block_size needs axis=...")
      t = self.tile
      if t is None:
        t = (None, None)
      if not isinstance(t, tuple) or len(t) != 2 or any(
          v is not None and (not _is_int(v) or v < 1) for v in t):
        raise ValueError(f"BlockFormat: tile must be a pair of positive ints or None, got {t!r}")
      object.__setattr__(self, "tile", t)
    if not (isinstance(self.eps, float) and self.eps >= 0):
      raise ValueError(f"BlockFormat: eps must be a non-negative float, got {self.eps!r}")

  supported_roundings = B.ROUNDINGS

  @property
  def block_axis(self) -> int | None:
    """The axis the blocks run along (None for tiles); see :func:`is_axis_blocked`."""
    return self.axis

  def _block_max(self, mag):
    return block_max_bits(mag, tile=self.tile, axis=self.axis, block_size=self.block_size)

  def shared_exponent(self, mx_bits):
    """Shared exponent (int32) from the block max magnitude bits."""
    if self.exponent == "hbfp":
      y = B.from_bits(mx_bits) + jnp.float32(self.eps)
      return B.ceil_log2(B.to_bits(y))
    return B.floor_log2(mx_bits) + 1

  def _block_params(self, mx):
    """``(qe, big, vmax, ok)`` of blocks with max magnitude bits ``mx`` (any shape): the
    quantum exponent ``e - man_bits``, the bits of ``2**qe`` (clipped to float32's range),
    the largest value ``2**e - 2**qe`` (:func:`_bfp_round`) and whether the block is
    finite."""
    e = self.shared_exponent(jnp.minimum(mx, B.u32(0x7F7FFFFF)))
    return (e - self.man_bits, B.pow2_bits(jnp.clip(e - self.man_bits, -149, 128)),
            _bfp_vmax(e, self.man_bits), B.is_finite_mag(mx))

  def _round_with_params(self, bits, params, rounding, rand, rand_bits):
    """:func:`_bfp_round` of float32 ``bits`` given their blocks' :meth:`_block_params`
    (broadcastable): the same bits, with the per-block work separable."""
    qe, big, vmax, ok = params
    sign = bits & B.u32(B.SIGN_MASK)
    mag = bits & B.u32(B.ABS_MASK)
    d = qe - (jnp.maximum((mag >> 23).astype(B.I32), 1) - 150)
    r = B.round_dropped_bits(mag, d, rounding, big=big, negative=sign != 0, rand=rand,
                             rand_bits=rand_bits)
    out = jnp.minimum(r, vmax) | sign
    return jnp.where(ok, out, B.u32(B.QNAN_BITS))

  def _round_with_block_max(self, bits, mx, rounding, rand, rand_bits):
    """Round float32 ``bits`` given each element's block-max magnitude bits ``mx``."""
    return self._round_with_params(bits, self._block_params(mx), rounding, rand, rand_bits)

  def _quantize_f32(self, x, rounding, rand, rand_bits):
    def blocks(x):
      return block_reduce_max(B.to_bits(x) & B.u32(B.ABS_MASK), tile=self.tile,
                              axis=self.axis, block_size=self.block_size)

    mx, expand = blocks(x)

    def general(x, mx, rand):
      params = _fenced_params(self._block_params(mx), mx, expand, stack=True)
      return B.from_bits(self._round_with_params(B.to_bits(x), params, rounding, rand,
                                                 rand_bits))

    if not mx.size:
      return general(x, mx, rand)
    # Each path is traced once and shared by the branches that run it (a nested jit is traced
    # once per input types; the compiled program is the same): the platform conditional below
    # traces every branch, and vmap and differentiation transform every branch again.
    general = jax.jit(general)
    block_max = jax.jit(lambda x: blocks(x)[0])

    def cpu(x, mx, rand):
      # As MX's (:meth:`MXFormat._quantize_f32`): the block max in a conditional of its own
      # (its predicate is always true, which no compiler can tell; the other branch is never
      # taken), so that it reads the operand from memory instead of recomputing its producers
      # (a GELU, a softmax gradient) in the reduction, and the elements in a second one, so
      # that the element loop is not fused into a consumer's transpose.
      w = B.to_bits(x.reshape(-1)[0])
      pred = B.fmix32(w) != B.fmix32(w ^ B.u32(1))
      # The untaken branches return values computed from the operand (the block max, the
      # operand itself), not constants: under shard_map a constant is not "varying" over the
      # mesh axes as the operand is, and cond wants both branches' types equal.
      mx = lax.cond(pred, block_max, block_max, x)
      return lax.cond(pred, general, lambda x, mx, rand: x, x, mx, rand)

    return lax.platform_dependent(x, mx, rand, cpu=cpu, default=general)


def hbfp(man_bits: int, tile: int = 0, *, eps: float = 1e-8) -> BlockFormat:
  """HBFPEmulator's ``float_to_bfp_tiled``: T x T tiles of the (dim0, rest) view.

  ``tile=0`` shares one exponent over the whole tensor.

  References:
    parsa-epfl/HBFPEmulator@b5cdb1d, ``bfp/bfp_ops.py`` (``_float_to_bfp``,
    ``float_to_bfp_tiled``); Drumond et al., "Training DNNs with Hybrid Block Floating
    Point", NeurIPS 2018.

  Args:
    man_bits: mantissa magnitude bits (sign excluded, no hidden bit), 1..24.
    tile: tile size T (T x T tiles of the (dim0, prod(rest)) view); 0 = whole tensor.
    eps: added to the block max before ``ceil(log2 .)`` (HBFPEmulator's rule).

  Returns:
    A :class:`BlockFormat` with ``exponent="hbfp"``.

  Raises:
    ValueError: ``tile`` is not a non-negative int, or :class:`BlockFormat` rejects
      ``man_bits`` / ``eps``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # 2 x 2 tiles, 2 bits. Left tile: max 1.0, and 1.0 + 1e-8 == 1.0 in float32, so
    >>> # e = ceil(log2 1.0) = 0: step 0.25, largest value 0.75 (1.0 saturates). Right tile:
    >>> # max 8 -> e = 3, step 2, largest 6; ties 5, 1, -3 go to even multiples of 2
    >>> x = jnp.array([[1.0, 0.3, 5.0, 8.0], [-0.7, 0.2, 1.0, -3.0]])
    >>> F.quantize(x, F.hbfp(2, tile=2))
    Array([[ 0.75,  0.25,  4.  ,  6.  ],
           [-0.75,  0.25,  0.  , -4.  ]], dtype=float32)
  """
  if not _is_int(tile) or tile < 0:
    raise ValueError(f"hbfp: tile must be a non-negative int, got tile={tile!r}")
  t = (None, None) if tile == 0 else (tile, tile)
  return BlockFormat(man_bits, tile=t, exponent="hbfp", eps=eps)


def hbfp_batched(man_bits: int, *, eps: float = 1e-8) -> BlockFormat:
  """HBFPEmulator's ``float_to_bfp_batched``: one exponent per index of dim 0.

  Args:
    man_bits: mantissa magnitude bits (sign excluded, no hidden bit), 1..24.
    eps: added to the block max before ``ceil(log2 .)`` (HBFPEmulator's rule).

  Returns:
    A :class:`BlockFormat` with ``tile=(1, None)`` and ``exponent="hbfp"``.

  Raises:
    ValueError: :class:`BlockFormat` rejects ``man_bits`` or ``eps``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # one exponent per row: the small row keeps its precision next to the large one
    >>> x = jnp.array([[100.0, 3.0, -7.0], [0.3, 0.11, -0.02]])
    >>> F.quantize(x, F.hbfp_batched(3))
    Array([[96.    ,  0.    , -0.    ],
           [ 0.3125,  0.125 , -0.    ]], dtype=float32)
  """
  return BlockFormat(man_bits, tile=(1, None), exponent="hbfp", eps=eps)


@dataclasses.dataclass(frozen=True)
class QPyTorchBlock:
  """QPyTorch's ``block_quantize(x, wl, dim)``.

  ``dim=-1``: one exponent for the whole tensor; ``dim=d >= 0``: one per index along axis
  ``d``. With block max ``Mx`` and ``E = floor(log2 Mx)``, an element is rebased
  ``v = fl32(x + 6*2**E)``, v's fraction rounded to ``wl`` bits (nearest: ties toward
  +inf in x; stochastic: unbiased), rebased back and clipped to
  ``±(2**(wl-1) - 1) * 2**(E+2-wl)``. The float32 pre-rounding of the rebase add is
  reproduced exactly with integer ops. A block whose max is a float32 subnormal has base 0
  in QPyTorch (degenerate); jaxlp reproduces that case too.

  The rule is the same for every block exponent E (the rebase constant is never formed in
  float32): scaling a block by a power of two scales its result. QPyTorch differs where the
  largest magnitude is >= 2**126: its ``6 * 2**E`` overflows float32 and every element comes
  out near -1.7e38 (E = 126) or -3.4e38 (E = 127). ``wl = 23`` drops no fraction bit of the
  rebased value (QPyTorch's wl = 23 shifts by -1, undefined behaviour).

  Raises:
    ValueError: ``wl`` not an int in 2..23 or ``dim`` not -1 or a non-negative int (and,
      from :func:`jaxlp.formats.quantize`, a ``dim`` out of range for the array).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # wl = 4, one block: max 3 -> E = 1, step 2**(E+2-wl) = 0.5, clip at 7 * 0.5 = 3.5;
    >>> # nearest rounds ties toward +inf (0.25 -> 0.5, -0.75 -> -0.5)
    >>> F.quantize(jnp.array([3.0, 0.25, -0.75, 1.1]), F.QPyTorchBlock(4))
    Array([ 3. ,  0.5, -0.5,  1. ], dtype=float32)

  References:
    Tiiiger/QPyTorch@f58bba7, ``qtorch/quant/quant_cpu/quant_cpu.cpp`` (``block_quantize``).
  """

  wl: int
  dim: int = -1

  def __post_init__(self):
    if not _is_int(self.wl) or not 2 <= self.wl <= 23:
      raise ValueError(f"qpytorch_block: wl must be an int in 2..23, got wl={self.wl!r}")
    if not _is_int(self.dim) or self.dim < -1:
      raise ValueError(f"qpytorch_block: dim must be -1 (whole tensor) or >= 0, got {self.dim!r}")

  supported_roundings = ("nearest", "stochastic")

  def _quantize_f32(self, x, rounding, rand, rand_bits):
    bits = B.to_bits(x)
    sign, mag, _ = B.split(bits)
    if self.dim == -1:
      mx = jnp.max(mag, initial=B.u32(0)) if mag.size else B.u32(0)
      mx = jnp.broadcast_to(mx, mag.shape)
    else:
      if self.dim >= x.ndim:
        raise ValueError(f"qpytorch_block: dim={self.dim} out of range for ndim={x.ndim}")
      axes = tuple(a for a in range(x.ndim) if a != self.dim)
      mx = jnp.broadcast_to(jnp.max(mag, axis=axes, keepdims=True, initial=B.u32(0)), mag.shape)
    mx_field = (mx >> 23).astype(B.I32)
    E = mx_field - 127
    wl = self.wl
    mode = "nearest_half_up" if rounding == "nearest" else "stochastic"
    # Rebase add v = fl32(x + 6*2^E) lands in [2^(E+2), 2^(E+3)): x rounded (RNE) to 2^(E-21).
    pre = B.round_to_quantum(mag, E - 21, "nearest", negative=sign)
    q = B.round_to_quantum(pre, E + 2 - wl, mode, negative=sign, rand=rand, rand_bits=rand_bits)
    clip = B.ldexp_bits(B.u32(B.f32_bits(2 ** (wl - 1) - 1)), E + 2 - wl)
    q = jnp.where(q >= B.pow2_bits(jnp.clip(E + 1, -149, 128)), clip, q)
    out = q | jnp.where(sign & (q != 0), B.u32(B.SIGN_MASK), B.u32(0))
    # Degenerate base 0 (block max is zero or a float32 subnormal): the wl-bit rounding is
    # applied to x's own pattern, and a carry into the exponent field clips (QPyTorch's clip
    # with a zero max exponent).
    rb = bits
    if wl == 23:  # no fraction bit dropped: nothing to round
      pass
    elif rounding == "nearest":
      rb = rb + B.u32(1 << (22 - wl))
    else:
      rb = rb + ((rand >> B.u32(32 - (23 - wl))) & B.u32((1 << (23 - wl)) - 1))
    rb = rb & B.high_mask(23 - wl)
    # clip: exponent field 0 | the top wl-2 fraction bits set, with the result's sign.
    clip0 = B.u32(((1 << (wl - 2)) - 1) << (25 - wl)) | (rb & B.u32(B.SIGN_MASK))
    rb = jnp.where((rb & B.u32(B.EXP_MASK)) != 0, clip0, rb)
    out = jnp.where(mx_field == 0, rb, out)
    # Non-finite inputs: QPyTorch's arithmetic turns them into NaN.
    out = jnp.where(B.is_finite_mag(mx), out, B.u32(B.QNAN_BITS))
    return B.from_bits(out)


def qpytorch_block(wl: int, dim: int = -1) -> QPyTorchBlock:
  """QPyTorch ``block_quantize`` format (see :class:`QPyTorchBlock`).

  Args:
    wl: word length (sign included), 2..23.
    dim: -1 for one exponent per tensor, else the axis whose indices get one each.

  Returns:
    The :class:`QPyTorchBlock` format.

  Raises:
    ValueError: ``wl`` or ``dim`` out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> x = jnp.array([[4.0, 0.3], [0.25, 0.1]])
    >>> F.quantize(x, F.qpytorch_block(4, dim=0))  # one exponent per row
    Array([[4.   , 0.   ],
           [0.25 , 0.125]], dtype=float32)
  """
  return QPyTorchBlock(wl, dim)


#: MX block-scale rules (:class:`MXFormat`).
SCALE_RULES = ("floor", "rceil", "even", "ceil")


#: The element types the OCP MX spec defines (plus ``"int8"``).
OCP_ELEMENTS = (E4M3FN, E5M2, E3M2FN, E2M3FN, E2M1FN)


@dataclasses.dataclass(frozen=True)
class MXFormat:
  """OCP Microscaling (MX v1.0): ``block_size`` elements along ``axis`` share an E8M0 scale.

  Each block gets a power-of-two scale ``X = 2**e`` with ``e`` from the block's largest
  magnitude ``amax`` by ``scale_rule`` (``emax`` and ``max`` are the element format's largest
  exponent and value, ``m`` its mantissa bits), clamped to E8M0's ``[-127, 127]``:

  * ``"floor"`` (default, OCP MX v1.0 §6.3): ``e = floor(log2 amax) - emax``. Elements above
    ``max * X`` saturate (e.g. amax = 500 with E4M3FN: X = 1, 500 -> 448).
  * ``"rceil"``: ``e = ceil(log2(amax / max))``, the smallest power of two with
    ``amax / X <= max`` (no element saturates): "quantize_round_up(amax / vmax)" of NVIDIA's
    cuDNN/cuBLAS block scaling and the MXFP8 pretraining recipe (arXiv:2506.08027, which
    reports that floor scaling can diverge and that rounding the scale up fixes it);
    torchao's ``ScaleCalculationMode.RCEIL``.
  * ``"ceil"``: ``e = ceil(log2 amax) - emax`` (torchao's ``ScaleCalculationMode.CEIL``).
  * ``"even"``: ``e = floor(log2 amax') - emax`` with ``amax'`` = ``amax`` rounded to ``m``
    mantissa bits, ties away from zero (torchao's ``ScaleCalculationMode.EVEN``, which adds
    ``2**(22 - m)`` to amax's float32 bit pattern and keeps the exponent).

  The rules are computed exactly from the float32 bits (never with a float ``log2``);
  ``amax / max`` in ``"rceil"`` is the exact quotient (torchao multiplies by a rounded
  ``1 / max``; on the power-of-two boundaries of every OCP element format both agree).
  Each element is ``elem``'s saturating cast of ``x / X``, computed exactly as a rounding of
  x onto elem's grid scaled by ``X``. An all-zero block gives zeros; a block containing inf
  or NaN gives NaN. No finite input gives an infinity: where ``max * X`` exceeds float32
  (a scale rounded up for ``amax`` near FLT_MAX), elements saturate at the largest float32
  on the scaled grid, ``(2 - 2**-m) * 2**127`` (torchao's dequantization gives inf there).

  ``elem`` is one of the element types the OCP spec defines: ``E4M3FN``, ``E5M2`` (MXFP8),
  ``E3M2FN``, ``E2M3FN`` (MXFP6), ``E2M1FN`` (MXFP4), or ``"int8"`` (MXINT8: two's
  complement with implied scale 2**-6, clamped to [-2, 127/64]; values that round to zero
  are +0, as INT8 has no -0; with ``X = 2**127`` the code -128 would be ``-2**128``, beyond
  float32, so negative elements saturate at ``-127 * 2**121``: no infinity from finite input).

  Raises:
    ValueError: ``elem`` is not an OCP MX element type (IEEE-style ``E4M3`` -- max 240, with
      infinities -- is refused with a pointer to ``E4M3FN``; so are ``BF16``, ``FP32``,
      ``E4M3FNUZ``...), ``block_size`` / ``axis`` is not a (positive) int, an unknown
      ``scale_rule``, or a rule other than ``"floor"`` for MXINT8.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> fmt = F.MXFormat(F.E4M3FN, block_size=2)  # = F.mx(F.E4M3FN, 2)
    >>> # block [1000, 1]: amax 1000 -> scale 2**(9 - emax 8) = 2; 1000 / 2 = 500 > 448
    >>> # saturates (MX casts saturate) to 448 * 2 = 896. Block [0.1, -0.1]: scale 2**-12,
    >>> # 0.1 / 2**-12 = 409.6 rounds to 416 (E4M3 spacing 32 there): 416 * 2**-12
    >>> F.quantize(jnp.array([1000.0, 1.0, 0.1, -0.1]), fmt)
    Array([ 8.960000e+02,  1.000000e+00,  1.015625e-01, -1.015625e-01], dtype=float32)
    >>> # rceil: 1000 / 448 = 2.23 -> scale 4; 1000 / 4 = 250 rounds to 256 (spacing 16)
    >>> F.quantize(jnp.array([1000.0, 1.0]), F.mx(F.E4M3FN, 2, scale_rule="rceil"))
    Array([1.024e+03, 1.000e+00], dtype=float32)

  References:
    OCP Microscaling Formats (MX) Specification v1.0, 2023, §5-6. Mishra et al., "Recipes
    for Pre-training LLMs with MXFP8", arXiv:2506.08027, 2025. NVIDIA cuDNN frontend,
    "Block Scaling" (block scale quantize: ``scale = quantize_round_up(amax / vmax)``).
    pytorch/ao 0.18.0, ``torchao/prototype/mx_formats/config.py``
    (``ScaleCalculationMode``) and ``mx_tensor.py`` (``to_mx``).
  """

  elem: object
  block_size: int = 32
  axis: int = -1
  scale_rule: str = "floor"

  def __post_init__(self):
    if isinstance(self.elem, FloatFormat):
      if self.elem not in OCP_ELEMENTS:
        if self.elem == E4M3:
          raise ValueError(
              "mx: elem=E4M3 is the IEEE-style E4M3 (max 240, with infinities); OCP MX's "
              "MXFP8 element is E4M3FN (max 448, no infinities): use jaxlp.formats.E4M3FN")
        raise ValueError(
            f"mx: elem={self.elem!r} is not an OCP MX element type; use one of E4M3FN, E5M2 "
            f"(MXFP8), E3M2FN, E2M3FN (MXFP6), E2M1FN (MXFP4) or 'int8' (MXINT8)")
    elif not (isinstance(self.elem, str) and self.elem == "int8"):
      raise ValueError(f"mx: elem must be an OCP MX element type (E4M3FN, E5M2, E3M2FN, "
                       f"E2M3FN, E2M1FN) or 'int8', got {self.elem!r}")
    if not _is_int(self.block_size) or self.block_size < 1:
      raise ValueError(f"mx: block_size must be a positive int, got {self.block_size!r}")
    if not _is_int(self.axis):
      raise ValueError(f"mx: axis must be an int, got {self.axis!r}")
    if self.scale_rule not in SCALE_RULES:
      raise ValueError(f"mx: scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")
    if self.elem == "int8" and self.scale_rule != "floor":
      raise ValueError(f"mx: scale_rule={self.scale_rule!r} is defined for floating-point "
                       "elements; MXINT8 uses the OCP rule 'floor'")

  supported_roundings = B.ROUNDINGS

  @property
  def block_axis(self) -> int:
    """The axis the blocks run along; see :func:`is_axis_blocked`."""
    return self.axis

  @property
  def elem_emax(self) -> int:
    return 0 if self.elem == "int8" else self.elem.emax

  def _quantize_f32(self, x, rounding, rand, rand_bits):
    def blocks(x):
      return block_reduce_max(B.to_bits(x) & B.u32(B.ABS_MASK), axis=self.axis,
                              block_size=self.block_size)

    mx, expand = blocks(x)
    if not (self._nearest_fast(rounding) and mx.size):
      bits = B.to_bits(x)
      params = _fenced_params(self._block_params(mx, rounding), mx, expand)
      return B.from_bits(self._round_with_params(bits, params, rounding, rand, rand_bits))

    # Each piece traced once, in a nested jit shared by the branches below (XLA inlines
    # them: the compiled program is the same): the platform conditional traces both of its
    # branches, the CPU one both paths, and vmap and differentiation transform every branch
    # again; the block parameters alone are ~180 equations, used by three branches.
    block_max = jax.jit(lambda x: blocks(x)[0])
    block_params = jax.jit(lambda mx: self._block_params(mx, rounding))
    fast_params = jax.jit(lambda mx: self._fast_params(mx, block_params(mx)))

    @jax.jit
    def exact(x, mx):
      params = _fenced_params(block_params(mx), mx, expand, stack=True)
      return B.from_bits(self._round_nearest(B.to_bits(x), params))

    def fast(x, mx):
      params = _fenced_params(fast_params(mx)[:-1], mx, expand, stack=True)
      return B.from_bits(self._round_nearest_float(B.to_bits(x), *params))

    def cpu(x, mx):
      # Conditionals on the whole array: the float path where every block allows it
      # (:meth:`_fast_params`), else the integer one; both give the same bits. They also
      # keep XLA:CPU from fusing the operand's producers into the block max and the element
      # loop (each recomputed them), and the element loop into a consumer's transpose (a
      # strided, scalar loop: 3-4x the loop itself, measured): the block max is taken in a
      # conditional of its own, whose predicate is always true (no compiler can tell), so
      # that it reads the operand from memory. Each path computes its own block parameters
      # (passing both paths' parameters into the conditional made its element loops 2x
      # slower, measured).
      w = B.to_bits(x.reshape(-1)[0])
      mx = lax.cond(B.fmix32(w) != B.fmix32(w ^ B.u32(1)), block_max, block_max, x)
      regular = fast_params(mx)[-1]
      return lax.cond(jnp.all(regular), fast, exact, x, mx)

    return lax.platform_dependent(x, mx, cpu=cpu, default=exact)

  def _fast_params(self, mx, params):
    """Per-block ``(lob, cb, vmax, ok, regular)`` of :meth:`_round_nearest_float` from the
    blocks' maxima ``mx`` and their :meth:`_block_params` (nearest form): the bits of
    ``2**lo``, of ``C = 2**(lo - m + 23)``, the saturation bits, finiteness, and whether the
    float path is exact for the block: ``lo - m >= -125`` (a float32 subnormal ``x`` is
    below half the block's quantum, so it rounds to 0 whether or not the CPU flushes it)
    and ``lo - m + 23 <= 127`` (``C`` is a float32), or the block is all zeros (then
    ``lo - m + 23 >= -126`` for every OCP element type) or not finite (all NaN)."""
    lp, _, _, vmax, ok = params
    qlo = lp - 150  # lo - m
    m = self.elem.man_bits
    lob = B.pow2_bits(qlo + m)
    cb = B.pow2_bits(jnp.clip(qlo + 23, -126, 127))
    regular = ~ok | (mx == 0) | ((qlo >= -125) & (qlo + 23 <= 127))
    return lob, cb, vmax, ok, regular

  def _round_nearest_float(self, bits, lob, cb, vmax, ok):
    """:meth:`_round_nearest` in fewer operations, where the block allows it
    (:meth:`_fast_params`; the same bits there).

    Above ``2**lo`` (``lo = emin + s``) the element keeps ``m`` fraction bits: the pattern is
    rounded with the constant shift ``23 - m`` (ties to even on the pattern: a carry
    ripples into the exponent field). Below it the quantum is the block's ``q = 2**(lo -
    m)``, and ``(|x| + C) - C`` with ``C = 2**23 * q`` rounds ``|x|`` to a multiple of ``q``,
    ties to even, in float32 round-to-nearest arithmetic: ``|x| + C`` lies in ``[C, 2C]``,
    whose spacing is ``q``, and the subtraction is exact (Sterbenz). ``q >= 2**-125`` makes
    both exact also where the CPU flushes float32 subnormals (a subnormal ``|x|`` is below
    ``q / 2``: 0 either way).

    References:
      The "add and subtract 1.5 * 2**52" rounding of a double to an integer (here with a
      power of two, on magnitudes): e.g. Muller et al., "Handbook of Floating-Point
      Arithmetic", 2nd ed., 2018, §5.3 (Sterbenz's lemma) and §11."""
    el = self.elem
    d0 = 23 - el.man_bits
    sign = bits & B.u32(B.SIGN_MASK)
    mag = bits & B.u32(B.ABS_MASK)
    hi = (mag + B.u32((1 << (d0 - 1)) - 1) + ((mag >> B.u32(d0)) & B.u32(1))) & B.high_mask(d0)
    c = B.from_bits(cb)
    lo = B.to_bits((B.from_bits(mag) + c) - c)
    r = jnp.where(mag < lob, lo, hi)
    out = jnp.minimum(r, vmax) | sign  # saturating: beyond vmax -> vmax
    if not el.has_negative_zero:
      out = jnp.where(r == 0, B.u32(0), out)
    return jnp.where(ok, out, B.u32(B.QNAN_BITS))

  def scale_exponent(self, mx):
    """The unclamped scale exponent ``e`` (int32) of ``scale_rule`` from the block-max
    magnitude bits ``mx`` (finite; 0 for an all-zero block, whose elements are 0 anyway)."""
    rule = self.scale_rule
    if rule == "floor":
      return B.floor_log2(mx) - self.elem_emax
    if rule == "ceil":
      return B.ceil_log2(mx) - self.elem_emax
    if rule == "even":
      # amax rounded to m mantissa bits, ties away: a carry out of the fraction bumps the
      # exponent (the exponent of the rounded pattern; float32 subnormal maxima clamp anyway)
      return B.floor_log2(mx + B.u32(1 << (22 - self.elem.man_bits))) - self.elem_emax
    # rceil: amax / max = (sa / sm) * 2**(ea - emax), sa, sm in [1, 2): the ceiling of its
    # log2 is ea - emax, plus one where sa > sm
    sig, ea = normalize(mx)
    sm = int(B.f32_bits(self.elem.max_normal) & B.FRAC_MASK) | (1 << 23)
    return ea - self.elem_emax + (sig > B.u32(sm)).astype(jnp.int32)

  def _nearest_fast(self, rounding) -> bool:
    """Whether ``rounding`` takes :meth:`_round_nearest` (static): ``"nearest"`` with float
    elements that have subnormals and whose grid's smallest half-quantum, with the smallest
    scale, is a float32 (every OCP element type)."""
    el = self.elem
    return (rounding == "nearest" and el != "int8" and el.subnormals
            and el.emin - 127 - el.man_bits - 1 >= -149)

  def _block_params(self, mx, rounding=None):
    """Per-block quantities of blocks with max magnitude bits ``mx`` (any shape): for float
    elements ``(lo, big, vmax, ok)``: the exponent ``emin + s`` below which the scaled grid
    is uniform (``s`` the clamped scale exponent), the bits of that grid's quantum there,
    the largest value ``max * 2**s`` (clipped to float32) and whether the block is finite;
    for ``"int8"`` ``(s, ok)``; for ``rounding="nearest"`` where :meth:`_nearest_fast`
    holds ``(lp, half, big, vmax, ok)``: ``lp = lo - m + 150`` (``m`` the element's
    mantissa bits) and ``half`` the bits of half of ``big``."""
    s = jnp.clip(self.scale_exponent(jnp.minimum(mx, B.u32(0x7F7FFFFF))), -127, 127)
    ok = B.is_finite_mag(mx)
    if self.elem == "int8":
      return s, ok
    el = self.elem
    lo = el.emin + s
    qlo = lo - el.man_bits if el.subnormals else lo
    top = B.f32_bits((2.0 - 2.0**-el.man_bits) * 2.0**127)
    vmax = jnp.minimum(B.ldexp_bits(B.u32(B.f32_bits(el.max_normal)), s), B.u32(top))
    big = B.pow2_bits(jnp.clip(qlo, -149, 128))
    if self._nearest_fast(rounding):
      return qlo + 150, B.pow2_bits(qlo - 1), big, vmax, ok
    return lo, big, vmax, ok

  def _round_with_params(self, bits, params, rounding, rand, rand_bits):
    """Round float32 ``bits`` given their blocks' :meth:`_block_params` (broadcastable).

    For float elements this is ``elem._round_bits(bits, scale_exp=s, saturate=True)`` with
    the per-block work taken out: the quantum exponent is ``max(floor_log2|x|, lo) - m``
    (``lo`` alone without subnormals, below it), and ``2**qe`` is only read where ``x`` is
    below ``2**lo``, where ``qe`` is the block's; a block holding inf or NaN is all NaN, so
    the element-level handling of non-finite inputs never shows."""
    if self.elem == "int8":
      s, ok = params
      return self._round_int8(bits, s, ok, rounding, rand, rand_bits)
    if self._nearest_fast(rounding):
      return self._round_nearest(bits, params)
    lo, big, vmax, ok = params
    el = self.elem
    m = el.man_bits
    sign = bits & B.u32(B.SIGN_MASK)
    mag = bits & B.u32(B.ABS_MASK)
    field = (mag >> 23).astype(B.I32)
    e = B.floor_log2(mag)
    if el.subnormals:
      qe = jnp.maximum(e, lo) - m
      # d >= 23 - m for normal x; a float32 subnormal x gives d >= lo - m + 149 (lo >= emin -
      # 127): positive for every OCP element
      d_range = (min(23 - m, el.emin + 22 - m), None)
    else:
      qe = jnp.where(e < lo, lo, e - m)
      d_range = (None, None)
    d = qe - (jnp.maximum(field, 1) - 150)
    r = B.round_dropped_bits(mag, d, rounding, big=big, negative=sign != 0, rand=rand,
                             rand_bits=rand_bits, d_range=d_range)
    out = jnp.minimum(r, vmax) | sign  # saturating: beyond vmax -> vmax
    if not el.has_negative_zero:
      out = jnp.where(r == 0, B.u32(0), out)
    return jnp.where(ok, out, B.u32(B.QNAN_BITS))

  def _round_nearest(self, bits, params):
    """:meth:`_round_with_params` for ``rounding="nearest"`` (ties to even) with fewer
    operations per element, the same bits.

    ``d``, the number of low significand bits dropped, is ``qe - (max(field, 1) - 150)``
    with ``qe = max(floor_log2|x|, lo) - m``: ``23 - m`` for a normal ``x`` above
    ``2**lo``, ``lp - max(field, 1)`` below it (``lp = lo - m + 150``), and for a float32
    subnormal ``x`` ``max(p - m, lp - 1)`` with ``p`` the top set bit of its fraction. All
    three are ``max(t - 127 - m, lp - max(field, 1))`` with ``t`` the exponent field of the
    float32 conversion of the integer ``min(|x| bits, 2**23)`` (exact below 2**24):
    ``23 + 127`` for a normal ``x``, ``p + 127`` for a subnormal one (no ``floor_log2``).
    Where ``d <= 23`` the pattern is rounded in place (``+ 2**(d-1) - 1 + k_odd``, then the
    dropped bits cleared: a carry ripples into the exponent field, as the value demands);
    ``k``'s parity is read from the significand (bit 23 is the implicit bit of a normal
    ``x``, not the exponent field's lowest bit). Where ``d >= 24`` (``x`` below the block's
    quantum ``2**(lo - m)``) the result is that quantum where ``x`` exceeds half of it, else
    0 (a tie goes to the even 0).
    ``tests/formats/test_mx_fast_path.py`` checks it against the general path."""
    lp, half, big, vmax, ok = params
    el = self.elem
    m = el.man_bits
    sign = bits & B.u32(B.SIGN_MASK)
    mag = bits & B.u32(B.ABS_MASK)
    field = (mag >> 23).astype(B.I32)
    low24 = jnp.minimum(mag, B.u32(0x800000))  # the significand's implicit bit, or |x|
    t = (B.to_bits(low24.astype(jnp.float32)) >> 23).astype(B.I32)
    d = jnp.maximum(t - (127 + m), lp - jnp.maximum(field, 1))
    dc = jnp.minimum(d, 23).astype(B.U32)
    low = (B.u32(1) << dc) - B.u32(1)
    kodd = ((mag | (low24 & B.u32(0x800000))) >> dc) & B.u32(1)
    small = (mag + (low >> B.u32(1)) + kodd) & ~low
    r = jnp.where(d <= 23, small, jnp.where(mag > half, big, B.u32(0)))
    out = jnp.minimum(r, vmax) | sign  # saturating: beyond vmax -> vmax
    if not el.has_negative_zero:
      out = jnp.where(r == 0, B.u32(0), out)
    return jnp.where(ok, out, B.u32(B.QNAN_BITS))

  def _round_with_block_max(self, bits, mx, rounding, rand, rand_bits):
    """Round float32 ``bits`` given each element's block-max magnitude bits ``mx``."""
    return self._round_with_params(bits, self._block_params(mx, rounding), rounding, rand,
                                   rand_bits)

  def _round_int8(self, bits, s, ok, rounding, rand, rand_bits):
    """MXINT8 elements of float32 ``bits`` with scale exponents ``s``, NaN where not ``ok``."""
    mag = bits & B.u32(B.ABS_MASK)
    sign = (bits & B.u32(B.SIGN_MASK)) != 0
    r = B.round_to_quantum(mag, s - 6, rounding, negative=sign, rand=rand, rand_bits=rand_bits)
    lim_pos = B.ldexp_bits(B.u32(B.f32_bits(127.0)), s - 6)
    # -128 * 2**(s - 6) is -2**128 (not a float32) where s = 127: saturate at -127 there
    lim_neg = jnp.where(s >= 127, lim_pos, B.ldexp_bits(B.u32(B.f32_bits(128.0)), s - 6))
    r = jnp.minimum(r, jnp.where(sign, lim_neg, lim_pos))
    out = r | jnp.where(sign & (r != 0), B.u32(B.SIGN_MASK), B.u32(0))  # INT8 has no -0
    return jnp.where(ok, out, B.u32(B.QNAN_BITS))


@renamed_kwargs(elem="fmt")
def mx(fmt, block_size: int = 32, axis: int = -1, scale_rule: str = "floor") -> MXFormat:
  """OCP MX format: ``block_size`` elements of format ``fmt`` share an E8M0 scale.

  Args:
    fmt: the element format, one of the OCP MX element types: ``E4M3FN`` or ``E5M2``
      (MXFP8), ``E3M2FN`` or ``E2M3FN`` (MXFP6), ``E2M1FN`` (MXFP4), or ``"int8"`` (MXINT8).
      Formerly ``elem`` (still accepted, deprecated).
    block_size: elements per block (32 in the OCP spec).
    axis: the axis the blocks run along.
    scale_rule: how the block scale is derived from the block's largest magnitude:
      ``"floor"`` (OCP MX, the default), ``"rceil"`` (round ``amax / max`` up to a power of
      two: cuBLAS/cuDNN and the MXFP8 pretraining recipe), ``"ceil"`` or ``"even"``
      (torchao's); defined in :class:`MXFormat`.

  Returns:
    The :class:`MXFormat` (its ``elem`` field holds ``fmt``).

  Raises:
    ValueError: an element format MX does not define (``E4M3``: use ``E4M3FN``), a bad
      block size or axis, an unknown ``scale_rule`` or a non-floor rule for ``"int8"``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # amax 3: scale 2**(1 - emax(E2M1) = 2) = 0.5; x / 0.5 = [2, 0.6, -5, 6] rounds on
    >>> # E2M1's grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} to [2, 0.5, -4, 6] (-5: tie, to even)
    >>> F.quantize(jnp.array([1.0, 0.3, -2.5, 3.0]), F.mx(F.E2M1FN, 4))
    Array([ 1.  ,  0.25, -2.  ,  3.  ], dtype=float32)
    >>> # amax 7: floor gives scale 1 and 7 saturates to 6; rceil: 7 / 6 -> scale 2
    >>> x = jnp.array([7.0, 1.2, 0.0, 0.0])
    >>> F.quantize(x, F.mx(F.E2M1FN, 4)), F.quantize(x, F.mx(F.E2M1FN, 4, scale_rule="rceil"))
    (Array([6., 1., 0., 0.], dtype=float32), Array([8., 1., 0., 0.], dtype=float32))
  """
  return MXFormat(fmt, block_size, axis, scale_rule)
