"""Two-level block-scaled formats: NVFP4 and its general form :class:`ScaledBlockFormat`.

Elements of a small float format (E2M1 for NVFP4) in blocks of 16 that share a block scale
stored in a narrow format (UE4M3: an unsigned E4M3FN), times one float32 scale per tensor
derived from the tensor's largest magnitude. Every step of the scale chain is a float32
operation with IEEE rounding, computed exactly with integer ops (``_fparith.py``), so the bits
are those of the published reference formulas on every backend (XLA on CPU flushes float32
subnormals; Triton divides approximately) and in the Pallas kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp._util import cdiv
from jaxlp.formats import _bits as B
from jaxlp.formats._args import element_index, prepare_array
from jaxlp.formats._float_format import FloatFormat
from jaxlp.formats._fparith import (
    div_mag,
    div_narrow,
    mul_mag,
    mul_narrow,
    mul_sig,
    narrow_bits,
    normalize,
)
from jaxlp.formats._presets import E2M1FN, E4M3FN

#: Block-scale formats: ``"ue4m3"`` (E4M3FN values used as unsigned scales, NVFP4),
#: ``"e8m0"`` (powers of two, as OCP MX) and ``"fp32"`` (no rounding of the scale).
SCALE_FORMATS = ("ue4m3", "e8m0", "fp32")
#: UE4M3 scales are clamped to [smallest normal E4M3FN, largest E4M3FN] before rounding.
UE4M3_MIN = 2.0**-6
UE4M3_MAX = 448.0
#: The smallest per-tensor scale jaxlp uses (see :class:`ScaledBlockFormat`, step 1): with a
#: smaller one the reference's ``(1 / g) / s`` overflows float32 for blocks whose UE4M3 scale
#: is 2**-6, and the reference formulas return inf or NaN.
TENSOR_SCALE_MIN = 2.0**-121
_FLT_MAX_BITS = 0x7F7FFFFF
_ONE_BITS = 0x3F800000


def _same(t):
  return t


def _is_int(v):
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _div_const(a, c: float):
  """``fl(a / c)`` for a float32 constant ``c``: one integer division where ``c``'s
  significand is narrow (6, 2688 = 21 * 2**7, ...), else long division."""
  k = narrow_bits(c)
  return div_mag(a, B.u32(_bits_of(c))) if k is None else div_narrow(a, c, k)


def _bits_of(v: float) -> int:
  b = B.f32_bits(v)
  if float(np.asarray(b, np.uint32).view(np.float32)) != v:
    raise ValueError(f"{v!r} is not a float32 value")
  return b


@dataclasses.dataclass(frozen=True)
class ScaledBlockFormat:
  """Block-scaled elements with an optional per-tensor scale (NVFP4 and relatives).

  Elements of format ``elem`` share a block scale stored in ``scale_fmt``; with
  ``tensor_scale=True`` a float32 per-tensor scale ``g`` from the tensor's largest magnitude
  sits above the block scales (two-level scaling). Blocks are ``block_size`` consecutive
  elements along ``axis`` (1-D, the default), or ``tile=(tr, tc)`` tiles of the last two axes
  (2-D; an array with fewer than two axes is seen as one row, leading axes are batch axes).
  The last block or tile of an axis may be partial; zero padding never raises a block max.

  The arithmetic, with ``fl(.)`` a float32 operation rounded to nearest-even with gradual
  underflow, ``E = elem.max_normal`` (6 for E2M1), ``S = 448`` (UE4M3's largest value),
  ``amax`` the largest ``|x|`` of the tensor and ``amax_b`` that of a block:

  1. Tensor scale (``tensor_scale=True``): ``g = max(fl(amax / (E * S)), 2**-121)``; without
     one, ``g = 1``. (``E * S = 2688`` for NVFP4 is exact in float32.)
  2. Block scale, unrounded: ``s = fl(fl(amax_b / E) / g)``.
  3. Block scale in ``scale_fmt`` (always rounded to nearest, saturating):
     ``"ue4m3"``: ``sb = E4M3FN(clamp(s, 2**-6, 448))`` (ties to even);
     ``"e8m0"``: ``sb = 2**clamp(ceil(log2 s), -127, 127)`` (rounded up, so that no element
     saturates; ``s = 0`` gives ``2**-127``);
     ``"fp32"``: ``sb = clamp(s, 2**-126, FLT_MAX)``.
  4. Encode: ``r = fl(fl(1 / g) / sb)``; each element ``y = fl(x * r)`` is rounded to
     ``elem`` with the requested rounding, saturating at ``±E``: ``q = elem(clamp(y, -E, E))``
     (``"stochastic"`` noise as in :func:`jaxlp.formats.quantize`; the scales are always
     rounded to nearest).
  5. Decode (the value :func:`jaxlp.formats.quantize` returns): ``fl(q * fl(g * sb))``,
     saturating at ``FLT_MAX`` (the roundings of ``g`` and ``g * sb`` could otherwise push
     ``6 * t`` one ulp past it for ``|x|`` within an ulp of ``FLT_MAX``).

  Steps 1-5 are the operations of torchao's ``NVFP4Tensor`` (``per_tensor_amax_to_scale``,
  ``nvfp4_quantize``, ``dequantize``), float32 op for float32 op, including its clamp of the
  UE4M3 scale to ``[2**-6, 448]``. jaxlp departs from it only where those formulas give inf
  or NaN from finite input: the lower bound ``2**-121`` on ``g`` (torchao divides by 0 for an
  all-zero tensor and overflows ``1/g`` for tensors whose ``amax`` is below about
  ``8e-36``; jaxlp gives zeros and finite values; the bound changes ``g`` only where
  ``amax < 2688 * 2**-121``, about ``1.0e-33``), and non-finite input: a tensor holding
  ``±inf`` or NaN has no tensor scale and becomes all NaN (with ``tensor_scale=False``: only
  the blocks holding one, as in OCP MX). Since ``g >= 2**-121`` and ``sb >= 2**-6``,
  ``r <= 2**127``: with nearest rounding ``|x| <= 2**-129`` always quantizes to zero.
  TransformerEngine's reference computes the scales with the reciprocal ``448 * 6 / amax``
  (its "global encode scale") and without the lower clamp of the UE4M3 scale, so it can
  differ in the last bit of ``g`` and, rarely, in the elements; jaxlp follows torchao.

  float16/bfloat16 inputs are widened exactly, quantized in float32 and the decoded result
  is rounded (nearest-even) to the input dtype. For bfloat16 this is what torchao does (its
  ``nvfp4_quantize`` widens to float32, ``dequantize`` casts the float32 product), so the
  bits agree; torchao refuses float16 input, and jaxlp applies the same widening to it.

  Args:
    elem: element format (a :class:`FloatFormat`; ``E2M1FN`` for NVFP4).
    block_size: elements per 1-D block (16 for NVFP4).
    axis: the axis 1-D blocks run along (``jaxlp.dot_general`` replaces it by each operand's
      contraction axis, as for ``mx``).
    tile: ``(tr, tc)`` (or an int for square tiles) for 2-D tiles of the last two axes
      instead of 1-D blocks; ``axis`` and ``block_size`` are then ``None``.
    scale_fmt: ``"ue4m3"``, ``"e8m0"`` or ``"fp32"`` (see step 3).
    tensor_scale: use a per-tensor scale (two-level scaling; needs ``scale_fmt="ue4m3"``,
      the only block-scale format whose range needs one).

  Raises:
    ValueError: ``elem`` not a :class:`FloatFormat`; a bad ``block_size``, ``axis`` or
      ``tile``; both ``tile`` and a non-default ``axis``/``block_size``; an unknown
      ``scale_fmt``; ``tensor_scale=True`` with a scale format other than ``"ue4m3"`` or with
      an element format whose ``max_normal * 448`` is not a float32 value.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> fmt = F.ScaledBlockFormat(F.E2M1FN, block_size=4, tensor_scale=False)
    >>> # block 1: amax 3 -> s = 3 / 6 = 0.5 (a UE4M3 value); x / 0.5 = [2, 0.6, -5, 6]
    >>> # rounds on E2M1's grid to [2, 0.5, -4, 6] (-5 is a tie: to even). Block 2: amax 0.7
    >>> # -> s = 0.11666667 rounds to the UE4M3 value 0.1171875
    >>> F.quantize(jnp.array([1.0, 0.3, -2.5, 3.0, 0.7, 0.1, 0.2, -0.05]), fmt)
    Array([ 1.        ,  0.25      , -2.        ,  3.        ,  0.703125  ,
            0.1171875 ,  0.17578125, -0.05859375], dtype=float32)

  References:
    NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149, 2025 (§2:
    E2M1 elements, 16-element blocks with E4M3 scales, an FP32 tensor scale; 16x16 weight
    tiles). NVIDIA Technical Blog, "Introducing NVFP4 for Efficient and Accurate
    Low-Precision Inference", 2025. pytorch/ao 0.18.0,
    ``torchao/prototype/mx_formats/nvfp4_tensor.py`` (the float32 operations of steps 1-5).
    NVIDIA/TransformerEngine, ``transformer_engine/pytorch/experimental/
    quantization_nvfp4.py`` (``_quantize_blockwise_reference``: 1x16 and 16x16 tiles,
    power-of-two scales rounded up).
  """

  elem: FloatFormat = E2M1FN
  block_size: int | None = 16
  axis: int | None = -1
  tile: tuple | None = None
  scale_fmt: str = "ue4m3"
  tensor_scale: bool = True

  def __post_init__(self):
    if not isinstance(self.elem, FloatFormat):
      raise ValueError(f"ScaledBlockFormat: elem must be a FloatFormat (E2M1FN for NVFP4), "
                       f"got {self.elem!r}")
    if self.tile is not None:
      t = (self.tile, self.tile) if _is_int(self.tile) else self.tile
      if not (isinstance(t, tuple) and len(t) == 2 and all(_is_int(v) and v >= 1 for v in t)):
        raise ValueError(f"ScaledBlockFormat: tile must be a positive int or a pair of them, "
                         f"got {self.tile!r}")
      if self.axis not in (-1, None) or self.block_size not in (16, None):
        raise ValueError("ScaledBlockFormat: give either tile=... (2-D tiles of the last two "
                         "axes) or axis=/block_size= (1-D blocks), not both")
      object.__setattr__(self, "tile", tuple(int(v) for v in t))
      object.__setattr__(self, "axis", None)
      object.__setattr__(self, "block_size", None)
    else:
      if not _is_int(self.block_size) or self.block_size < 1:
        raise ValueError(f"ScaledBlockFormat: block_size must be a positive int, got "
                         f"{self.block_size!r}")
      if not _is_int(self.axis):
        raise ValueError(f"ScaledBlockFormat: axis must be an int, got {self.axis!r}")
    if self.scale_fmt not in SCALE_FORMATS:
      raise ValueError(f"ScaledBlockFormat: scale_fmt must be one of {SCALE_FORMATS}, got "
                       f"{self.scale_fmt!r}")
    if not isinstance(self.tensor_scale, bool):
      raise ValueError(f"ScaledBlockFormat: tensor_scale must be a bool, got "
                       f"{self.tensor_scale!r}")
    if self.tensor_scale and self.scale_fmt != "ue4m3":
      raise ValueError(
          f"ScaledBlockFormat: tensor_scale=True needs scale_fmt='ue4m3' (the two-level "
          f"recipe: a per-tensor scale keeps the block scales inside UE4M3's range); "
          f"{self.scale_fmt!r} block scales need none: pass tensor_scale=False")
    if self.tensor_scale:
      try:
        _bits_of(self.elem.max_normal * UE4M3_MAX)
      except ValueError:
        raise ValueError(
            f"ScaledBlockFormat: the tensor scale divides by elem.max_normal * 448, which is "
            f"not a float32 value for elem={self.elem!r}; use a narrower element format or "
            f"tensor_scale=False") from None

  supported_roundings = B.ROUNDINGS

  @property
  def block_axis(self) -> int | None:
    """The axis 1-D blocks run along (None for 2-D tiles): the axis-blocking protocol that
    ``jaxlp.dot_general`` uses (:func:`jaxlp.formats._block.is_axis_blocked`)."""
    return self.axis

  def __repr__(self):
    geo = f"tile={self.tile}" if self.tile is not None else (
        f"block_size={self.block_size}, axis={self.axis}")
    return (f"ScaledBlockFormat(elem={self.elem!r}, {geo}, scale_fmt={self.scale_fmt!r}, "
            f"tensor_scale={self.tensor_scale})")

  # -- block layout -----------------------------------------------------------------------
  def check_shape(self, shape) -> None:
    """ValueError unless 1-D blocks' ``axis`` is valid for an array of ``shape``."""
    if self.axis is None:
      return
    nd = len(shape)
    if not -max(nd, 1) <= self.axis < max(nd, 1):
      raise ValueError(f"{self!r}: block axis {self.axis} is out of range for an array of "
                       f"shape {tuple(shape)} ({nd} dimension(s))")

  def _tile_view(self, shape):
    """(L, R, C): the (batch, rows, cols) view that 2-D tiles cut."""
    if len(shape) == 0:
      return 1, 1, 1
    if len(shape) == 1:
      return 1, 1, shape[0]
    return math.prod(shape[:-2]), shape[-2], shape[-1]

  def to_blocks(self, a, shape):
    """``a`` (of ``shape``) as ``(..., nblocks..., B)``: one block per last-axis row."""
    if self.axis is None:
      ell, r, c = self._tile_view(shape)
      tr, tc = self.tile
      nr, nc = cdiv(r, tr), cdiv(c, tc)
      v = jnp.pad(a.reshape(ell, r, c), ((0, 0), (0, nr * tr - r), (0, nc * tc - c)))
      return v.reshape(ell, nr, tr, nc, tc).transpose(0, 1, 3, 2, 4).reshape(ell, nr, nc, -1)
    self.check_shape(shape)
    if len(shape) == 0:
      a, shape = a.reshape(1), (1,)
    m = jnp.moveaxis(a, self.axis % len(shape), -1)
    n = m.shape[-1]
    nb = cdiv(n, self.block_size)
    m = jnp.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, nb * self.block_size - n)])
    return m.reshape(m.shape[:-1] + (nb, self.block_size))

  def from_blocks(self, b, shape):
    """Inverse of :meth:`to_blocks` (drops the padding)."""
    if self.axis is None:
      ell, r, c = self._tile_view(shape)
      tr, tc = self.tile
      nr, nc = b.shape[1], b.shape[2]
      v = b.reshape(ell, nr, nc, tr, tc).transpose(0, 1, 3, 2, 4).reshape(ell, nr * tr, nc * tc)
      return v[:, :r, :c].reshape(shape)
    sh = (1,) if len(shape) == 0 else tuple(shape)
    ax = self.axis % len(sh)
    moved = sh[:ax] + sh[ax + 1:] + (sh[ax],)
    m = b.reshape(b.shape[:-2] + (-1,))[..., :sh[ax]].reshape(moved)
    return jnp.moveaxis(m, -1, ax).reshape(shape)

  def scales_shape(self, shape) -> tuple:
    """Shape of the block-scale array of an array of ``shape`` (:meth:`encode`)."""
    if self.axis is None:
      ell, r, c = self._tile_view(shape)
      lead = tuple(shape[:-2]) if len(shape) >= 2 else ()
      return lead + (cdiv(r, self.tile[0]), cdiv(c, self.tile[1]))
    self.check_shape(shape)
    sh = (1,) if len(shape) == 0 else tuple(shape)
    ax = self.axis % len(sh)
    return sh[:ax] + (cdiv(sh[ax], self.block_size),) + sh[ax + 1:]

  def _scales_to_blocks(self, s, shape):
    """Block scales (of :meth:`scales_shape`) laid out like :meth:`to_blocks`' blocks."""
    if self.axis is None:
      ell, _, _ = self._tile_view(shape)
      return s.reshape(ell, s.shape[-2], s.shape[-1], 1)
    sh = (1,) if len(shape) == 0 else tuple(shape)
    return jnp.moveaxis(s.reshape(self.scales_shape(shape)), self.axis % len(sh), -1)[..., None]

  def _blocks_to_scales(self, s, shape):
    """Inverse of :meth:`_scales_to_blocks`."""
    if self.axis is None:
      return s.reshape(self.scales_shape(shape))
    sh = (1,) if len(shape) == 0 else tuple(shape)
    return jnp.moveaxis(s[..., 0], -1, self.axis % len(sh)).reshape(self.scales_shape(shape))

  # -- the arithmetic (shared by the spec and the Pallas kernel) --------------------------
  def tensor_words(self, amax, *, fence=None):
    """uint32 ``[g, fl(1/g)]`` bits from the bits of the tensor's ``max |x|`` (step 1);
    ``g`` is NaN when ``amax`` is not finite. ``fence``: see :meth:`scale_chain`."""
    one = B.u32(_ONE_BITS)
    if not self.tensor_scale:
      return jnp.stack([one, one])
    g = _div_const(jnp.minimum(amax, B.u32(_FLT_MAX_BITS)), self.elem.max_normal * UE4M3_MAX)
    g = jnp.maximum(g, B.u32(_bits_of(TENSOR_SCALE_MIN)))
    if fence is not None:
      g = fence(g)
    inv = div_mag(one, g, fence=fence)
    g = jnp.where(B.is_finite_mag(amax), g, B.u32(B.QNAN_BITS))
    return jnp.stack([g, inv])

  def block_scale(self, mxb, g, *, fence=None):
    """Bits of the block scale ``sb`` (steps 2-3) from block-max bits ``mxb`` and ``g``
    (``fence``: see :meth:`scale_chain`)."""
    bs = _div_const(jnp.minimum(mxb, B.u32(_FLT_MAX_BITS)), self.elem.max_normal)
    if fence is not None:
      bs = fence(bs)
    s = div_mag(bs, g, fence=fence) if self.tensor_scale else bs
    if self.scale_fmt == "ue4m3":
      s = jnp.clip(s, B.u32(_bits_of(UE4M3_MIN)), B.u32(_bits_of(UE4M3_MAX)))
      return E4M3FN._round_bits(s, "nearest", None, None)
    if self.scale_fmt == "e8m0":
      return B.pow2_bits(jnp.clip(B.ceil_log2(s), -127, 127))
    return jnp.clip(s, B.u32(_bits_of(2.0**-126)), B.u32(_FLT_MAX_BITS))

  def scale_chain(self, mxb, tw, *, fence=None):
    """``(sb, r, t, ok)`` of every block (steps 2-5) from its block-max bits ``mxb`` and the
    :meth:`tensor_words` ``tw``: the block scale ``sb`` (uint32 bits), the encode factor
    ``r = fl(fl(1/g) / sb)`` and the decode scale ``t = fl(g * sb)`` (each
    :func:`~jaxlp.formats._fparith.normalize`'d: ``(sig, exp)``), and ``ok`` (False where the
    block or the tensor holds inf or NaN).

    ``fence`` (the spec's XLA path: :func:`jaxlp.formats._bits.fence`; None in kernels) is
    applied to the intermediate values that several later steps read, so that XLA computes
    each once per block instead of once per element and per consumer: the same bits, a
    fraction of the compiled program."""
    fence = fence or _same
    g = tw[0]
    g_nan = B.is_nan_mag(g)
    g = jnp.where(g_nan, B.u32(_ONE_BITS), g)
    sb = fence(self.block_scale(mxb, g, fence=fence))
    # UE4M3 scales have 4 significant bits, E8M0 scales 1: one integer division each
    k = {"ue4m3": E4M3FN.man_bits, "e8m0": 0}.get(self.scale_fmt)
    r = fence(div_mag(tw[1], sb, fence=fence) if k is None else
              div_narrow(tw[1], sb, k, fence=fence))
    t = fence(mul_mag(g, sb))
    r, t = fence((normalize(r), normalize(t)))
    return sb, r, t, fence(B.is_finite_mag(mxb) & ~g_nan)

  def round_elements(self, bits, r, rounding, rand, rand_bits):
    """Bits of the elements ``q`` (step 4) of float32 ``bits`` given the normalized encode
    factor ``r`` of their blocks (broadcastable)."""
    mag = bits & B.u32(B.ABS_MASK)
    y = mul_sig(*normalize(jnp.where(B.is_finite_mag(mag), mag, B.u32(0))), *r)
    y = y | (bits & B.u32(B.SIGN_MASK))
    return self.elem._round_bits(y, rounding, rand, rand_bits, saturate=True)

  def decode_elements(self, q, t):
    """Bits of ``fl(q * t)`` (step 5) for element bits ``q`` and normalized decode scales
    ``t`` (broadcastable)."""
    qm = q & B.u32(B.ABS_MASK)
    if self.elem.man_bits <= 6:  # q has at most man_bits + 1 significant bits
      out = mul_narrow(qm, self.elem.man_bits, *t)
    else:
      out = mul_sig(*normalize(qm), *t)
    out = jnp.minimum(out, B.u32(_FLT_MAX_BITS))  # no inf from finite input (step 5)
    return out | (q & B.u32(B.SIGN_MASK))

  def round_blocks(self, bits, mxb, tw, rounding, rand, rand_bits, *, fence=None):
    """Quantize float32 ``bits`` laid out as ``(..., B)`` blocks (steps 2-5).

    ``mxb``: ``(..., 1)`` block-max magnitude bits (NaN > inf > finite); ``tw``: the
    :meth:`tensor_words` of the tensor; ``rand``: noise words (broadcastable to ``bits``);
    ``fence``: see :meth:`scale_chain`.
    """
    _, r, t, ok = self.scale_chain(mxb, tw, fence=fence)
    out = self.decode_elements(self.round_elements(bits, r, rounding, rand, rand_bits), t)
    return jnp.where(ok, out, B.u32(B.QNAN_BITS))

  def _blocked(self, x, rand, *, hoist=False):
    """``(blocks, block maxima, tensor words, noise, fence)`` of a float32 array (the layout
    and the tensor-level step shared by :func:`jaxlp.formats.quantize` and :meth:`encode`).
    The tensor's ``max |x|`` is the largest block maximum (zero padding never raises it).
    ``fence``: with ``hoist``, the :func:`jaxlp.formats._bits.fence` for :meth:`scale_chain`
    (else None)."""
    shape = x.shape
    bits = B.to_bits(x)
    blk = self.to_blocks(bits, shape)
    mxb = jnp.max(blk & B.u32(B.ABS_MASK), axis=-1, keepdims=True, initial=B.u32(0))
    amax = jnp.max(mxb, initial=B.u32(0))
    fence = functools.partial(B.fence, word=amax) if hoist else None
    tw = self.tensor_words(amax, fence=fence)
    if fence is not None:
      tw = fence(tw)
    rb = self.to_blocks(jnp.broadcast_to(rand, shape), shape) if jnp.ndim(rand) else rand
    return blk, mxb, tw, rb, fence

  def _quantize_f32(self, x, rounding, rand, rand_bits):
    if x.size == 0:
      return x
    blk, mxb, tw, rb, fence = self._blocked(x, rand, hoist=True)
    out = self.round_blocks(blk, mxb, tw, rounding, rb, rand_bits, fence=fence)
    return B.from_bits(self.from_blocks(out, x.shape))

  # -- components ---------------------------------------------------------------------------
  def encode(self, x, rounding: str = "nearest", *, key=None, rand_bits: int | None = None):
    """The three parts of ``x`` in this format: ``(elements, block_scales, tensor_scale)``.

    ``elements`` (x's shape, float32) are the element values ``q`` of step 4 (on ``elem``'s
    grid, NaN in NaN blocks); ``block_scales`` (float32, :meth:`scales_shape`) the scales
    ``sb`` of step 3; ``tensor_scale`` (float32 scalar) ``g`` of step 1 (1.0 without a
    tensor scale, NaN for a tensor holding inf or NaN). :meth:`decode` of the three equals
    :func:`jaxlp.formats.quantize` bit for bit.

    Args:
      x: float32, float16 or bfloat16 array.
      rounding, key, rand_bits: as :func:`jaxlp.formats.quantize` (the element rounding).

    Returns:
      ``(elements, block_scales, tensor_scale)``.

    Raises:
      The errors of :func:`jaxlp.formats.quantize`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxlp import formats as F
      >>> q, s, g = F.nvfp4().encode(jnp.linspace(-1.0, 2.0, 16))
      >>> # g = 2 / 2688; block scale 2 / 6 / g = 448; r = 1 / g / 448 = 3: q = E2M1(3 x)
      >>> q[:4], s, g
      (Array([-3., -2., -2., -1.], dtype=float32), Array([448.], dtype=float32), \
Array(0.00074405, dtype=float32))
    """
    if rounding not in B.ROUNDINGS or rounding not in self.supported_roundings:
      raise ValueError(f"quantize: {type(self).__name__} supports rounding in "
                       f"{self.supported_roundings}, got rounding={rounding!r}")
    x, kw = prepare_array(x, rounding, key=key, rand_bits=rand_bits)
    self.check_shape(x.shape)
    if rounding == "stochastic":
      rand = B.hash_bits(kw[0], kw[1], element_index(x.shape))
    else:
      rand = jnp.zeros((), jnp.uint32)
    return _encode(x.astype(jnp.float32), rand, self, rounding, rand_bits)

  def decode(self, elements, block_scales, tensor_scale):
    """``fl(q * fl(g * sb))`` (step 5) of the parts :meth:`encode` returns (float32).

    Args:
      elements: element values ``q`` (float32 array).
      block_scales: block scales ``sb`` (:meth:`scales_shape` of ``elements.shape``).
      tensor_scale: ``g`` (float32 scalar).

    Returns:
      float32 array of ``elements``' shape (NaN where ``g`` or an element is NaN).

    Raises:
      ValueError: ``block_scales`` does not have the shape the geometry gives.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxlp import formats as F
      >>> fmt = F.nvfp4()
      >>> x = jnp.linspace(-1.0, 2.0, 32)
      >>> bool((fmt.decode(*fmt.encode(x)) == F.quantize(x, fmt)).all())
      True
    """
    q = jnp.asarray(elements, jnp.float32)
    s = jnp.asarray(block_scales, jnp.float32)
    want = self.scales_shape(q.shape)
    if s.shape != want:
      raise ValueError(f"{self!r}.decode: block_scales has shape {s.shape}, expected {want} "
                       f"for elements of shape {q.shape}")
    return _decode(q, s, jnp.asarray(tensor_scale, jnp.float32), self)


def _encode_impl(x, rand, fmt, rounding, rand_bits):
  if x.size == 0:
    return x, jnp.zeros(fmt.scales_shape(x.shape), jnp.float32), jnp.float32(1.0)
  blk, mxb, tw, rb, fence = fmt._blocked(x, rand, hoist=True)
  sb, r, _, ok = fmt.scale_chain(mxb, tw, fence=fence)
  q = jnp.where(ok, fmt.round_elements(blk, r, rounding, rb, rand_bits), B.u32(B.QNAN_BITS))
  elements = B.from_bits(fmt.from_blocks(q, x.shape))
  return elements, B.from_bits(fmt._blocks_to_scales(sb, x.shape)), B.from_bits(tw[0])


_encode = jax.jit(_encode_impl, static_argnums=(2, 3, 4))


def _decode_impl(q, s, g, fmt):
  qb = fmt.to_blocks(B.to_bits(q), q.shape)
  sb = fmt._scales_to_blocks(B.to_bits(s), q.shape)
  gb = B.to_bits(g)
  t = normalize(mul_mag(gb & B.u32(B.ABS_MASK), sb & B.u32(B.ABS_MASK)))
  qm = qb & B.u32(B.ABS_MASK)
  out = mul_sig(*normalize(jnp.where(B.is_finite_mag(qm), qm, B.u32(0))), *t)
  out = out | (qb & B.u32(B.SIGN_MASK))
  bad = B.is_nan_mag(qb & B.u32(B.ABS_MASK)) | B.is_nan_mag(gb & B.u32(B.ABS_MASK))
  out = jnp.where(bad, B.u32(B.QNAN_BITS), out)
  return B.from_bits(fmt.from_blocks(out, q.shape))


_decode = jax.jit(_decode_impl, static_argnums=3)


def nvfp4(*, axis: int = -1, tile=None, tensor_scale: bool = True,
          block_size: int = 16) -> ScaledBlockFormat:
  """NVIDIA's NVFP4: E2M1 elements, 16-element blocks with UE4M3 scales, a float32 tensor scale.

  The arithmetic is defined step by step in :class:`ScaledBlockFormat` (torchao's
  ``NVFP4Tensor`` formulas, bit for bit on finite tensors whose ``max |x|`` is at least
  ``1.1e-33``).

  Args:
    axis: the axis the 16-element blocks run along (``jaxlp.dot_general`` uses each
      operand's contraction axis instead).
    tile: ``16`` (or ``(16, 16)``) for 2-D tiles of the last two axes, as the NVFP4 recipe
      uses for weights (so that ``W`` and ``W.T`` quantize to the same values).
    tensor_scale: ``False`` for single-level scaling (UE4M3 block scales only).
    block_size: elements per 1-D block (16 in NVFP4).

  Returns:
    The :class:`ScaledBlockFormat`.

  Raises:
    ValueError: a bad ``axis``, ``tile`` or ``block_size``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> x = jnp.array([0.3, -1.7, 2.9, 12.0] + [0.0] * 12)
    >>> # g = 12 / 2688; block scale 12 / 6 / g = 448; elements x / (g * 448) = x / 2
    >>> # rounded on E2M1's grid: [0.15, -0.85, 1.45, 6] -> [0, -1, 1.5, 6]
    >>> F.quantize(x, F.nvfp4())[:4]
    Array([ 0., -2.,  3., 12.], dtype=float32)

  References:
    NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149, 2025.
    pytorch/ao 0.18.0, ``torchao/prototype/mx_formats/nvfp4_tensor.py``.
  """
  return ScaledBlockFormat(E2M1FN, block_size=block_size, axis=axis, tile=tile,
                           scale_fmt="ue4m3", tensor_scale=tensor_scale)
