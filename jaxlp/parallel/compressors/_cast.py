"""Cast compression (PyTorch ``fp16_compress_hook`` / ``bf16_compress_hook``, generalised to
every ml_dtypes type, to any jaxlp :class:`~jaxlp.formats.FloatFormat` and to block-scaled
formats such as NVFP4, :class:`~jaxlp.formats.ScaledBlockFormat`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jaxlp._util import cdiv
from jaxlp.formats import _bits as B
from jaxlp.formats._codes import from_codes, to_codes
from jaxlp.formats._float_format import FloatFormat
from jaxlp.formats._nvfp4 import ScaledBlockFormat
from jaxlp.formats._presets import E4M3FN, ML_DTYPES_NAMES, PRESETS
from jaxlp.formats._quantize import quantize as spec_quantize
from jaxlp.parallel._aggregate import CASTS
from jaxlp.parallel.compressors._base import numel, pack_bits, packed_nbytes, unpack_bits

_ALIASES = {"fp16": "float16", "float16": "float16", "half": "float16", "bf16": "bfloat16",
            "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
# ml_dtypes names of the presets (reverse of ML_DTYPES_NAMES)
_PRESET_OF_DTYPE = {v: k for k, v in ML_DTYPES_NAMES.items()}


def _np_dtype(name: str) -> np.dtype:
  return np.dtype(getattr(ml_dtypes, name, None) or name)


def _resolve(fmt) -> tuple[np.dtype | None, FloatFormat]:
  """``(native dtype or None, FloatFormat)`` of a cast target."""
  if isinstance(fmt, FloatFormat):
    for name, preset in PRESETS.items():
      if preset == fmt and name in ML_DTYPES_NAMES:
        return _np_dtype(ML_DTYPES_NAMES[name]), preset
    return None, fmt
  if isinstance(fmt, str):
    name = _ALIASES.get(fmt.lower(), fmt.lower())
    if name in _PRESET_OF_DTYPE:
      return _np_dtype(name), PRESETS[_PRESET_OF_DTYPE[name]]
    if fmt.upper() in PRESETS:
      return _resolve(PRESETS[fmt.upper()])
    raise ValueError(f"cast: unknown {fmt=}; give a FloatFormat, a preset name (e.g. 'E4M3FN') "
                     "or a dtype name ('bf16', 'fp16', 'float8_e5m2', ...)")
  try:
    dt = np.dtype(fmt)
  except TypeError:
    raise ValueError(f"cast: {fmt=} is not a FloatFormat, ScaledBlockFormat (nvfp4), preset "
                     "name or float dtype") from None
  return _resolve(dt.name)


@dataclasses.dataclass(frozen=True)
class Cast:
  """Cast the gradient to a narrower float format (round to nearest even), divide by W
  (PyTorch's cast-then-divide order) and sum.

  ``fmt`` is a dtype name (``"bf16"``, ``"fp16"``, ``"float8_e4m3fn"``), a preset name or any
  :class:`~jaxlp.formats.FloatFormat` -- also formats without an ml_dtypes twin (e.g.
  ``FloatFormat(3, 3)`` = 7 bits, or an 11-bit ``FloatFormat(5, 5)``).

  Wire format: fp16/bf16 and the 8-bit ml_dtypes types travel as that dtype; every other
  format travels as its ``bits``-bit storage codes (:func:`jaxlp.formats.to_codes`: sign,
  exponent field, fraction): ``bits // 8`` byte planes (``"bytes"``, uint8 ``(n, bits//8)``,
  low byte first) plus the remaining ``bits % 8`` bits of each code bit-packed LSB first
  (``"rest"``), so ``wire_bytes = n*(bits//8) + ceil(n*(bits%8)/8)``.
  The 16-bit types are summed in that dtype (rank order); the others are decoded and summed
  in float32 in rank order, then divided by W.
  """
  fmt: object = "bf16"
  kind = "cast"
  aggregation = CASTS
  elementwise_state = True

  def __post_init__(self):
    _resolve(self.fmt)  # validate early

  @property
  def format(self) -> FloatFormat:
    return _resolve(self.fmt)[1]

  @property
  def native_dtype(self) -> np.dtype | None:
    """The dtype the payload travels in, or None when it travels as packed codes."""
    dt, fmt = _resolve(self.fmt)
    return dt if dt is not None and fmt.bits in (8, 16, 32) else None

  @property
  def dtype(self) -> np.dtype | None:
    return self.native_dtype

  @property
  def bits(self) -> int:
    return self.format.bits

  def init(self, shape, dtype=jnp.float32, key=None):
    return ()

  def round(self, x):
    """float32 ``x`` rounded (nearest even) to the format, still float32.

    Rounded on the bit patterns (:func:`jaxlp.formats.quantize`), not with a dtype
    conversion: XLA:GPU treats a float32 -> bfloat16 -> float32 conversion pair as excess
    precision it may remove (measured on an H100: the rounding vanished and the sums changed).
    """
    return spec_quantize(jnp.asarray(x, jnp.float32), self.format)

  def cast(self, x):
    if self.native_dtype is None:
      raise ValueError(f"cast: {self.fmt!r} has no native dtype")
    return lax.convert_element_type(self.round(x), self.native_dtype)  # exact: on the grid

  def encode(self, g, state, key=None):
    x = jnp.ravel(g).astype(jnp.float32)
    if self.native_dtype is not None:
      return {"values": self.cast(x)}, state
    code = to_codes(x, self.format)
    nb, r = divmod(self.bits, 8)
    payload = {}
    if nb:
      shifts = jnp.arange(nb, dtype=jnp.uint32) * 8
      payload["bytes"] = ((code[:, None] >> shifts[None, :]) & 0xFF).astype(jnp.uint8)
    if r:
      payload["rest"] = pack_bits(code >> (8 * nb), r)
    return payload, state

  def decode(self, payload, shape):
    if self.native_dtype is not None:
      return payload["values"].astype(jnp.float32).reshape(shape)
    n = numel(shape)
    nb, r = divmod(self.bits, 8)
    code = jnp.zeros((n,), jnp.uint32)
    if nb:
      shifts = jnp.arange(nb, dtype=jnp.uint32) * 8
      planes = payload["bytes"].astype(jnp.uint32) << shifts[None, :]
      for j in range(nb):
        code = code | planes[:, j]
    if r:
      code = code | (unpack_bits(payload["rest"], r, n) << (8 * nb))
    return from_codes(code, self.format).reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    n = numel(shape)
    if self.native_dtype is not None:
      return n * self.native_dtype.itemsize
    nb, r = divmod(self.bits, 8)
    return n * nb + packed_nbytes(n, r)


@dataclasses.dataclass(frozen=True)
class ScaledCast:
  """Cast the gradient to a block-scaled format (NVFP4 and the other
  :class:`~jaxlp.formats.ScaledBlockFormat`), divide by W and sum (as :class:`Cast`: the
  decoded values of every worker are summed in float32 in rank order, then divided by W).

  The compressor sees the flattened (C order) leaf or fused bucket, so its blocks are
  ``fmt.block_size`` consecutive elements of that flat vector (the format's ``axis`` plays no
  role; 2-D ``tile`` formats are refused), and a two-level format has one tensor scale per
  leaf or bucket (per piece with ``plan`` partitions). ``decode(encode(x))`` equals
  ``jaxlp.formats.quantize(x, fmt)`` of the flat vector bit for bit.

  Wire format (``fmt.encode``'s three parts, each in its storage format):

  * ``"elements"``: the element codes (:func:`jaxlp.formats.to_codes` of ``fmt.elem``),
    ``elem.bits // 8`` byte planes and the remaining ``elem.bits % 8`` bits bit-packed LSB
    first, as :class:`Cast` sends a FloatFormat (NVFP4: 4 bits, two elements per byte);
  * ``"scales"``: one block scale per block, uint8 for ``"ue4m3"`` (the E4M3FN code, sign bit
    0) and ``"e8m0"`` (the biased exponent ``log2(sb) + 127``), float32 for ``"fp32"``; a
    block holding inf or NaN (``tensor_scale=False``) is sent as the scale format's NaN code
    (0x7F, 0xFF, NaN) and decodes to NaN;
  * ``"tensor_scale"`` (two-level formats only): the float32 ``g`` (NaN for a tensor holding
    inf or NaN, which then decodes to all NaN).

  So ``wire_bytes((n,)) = n*(b//8) + ceil(n*(b%8)/8) + nblocks*(1 or 4) + (4 if
  tensor_scale)`` with ``b = elem.bits`` and ``nblocks = ceil(n / block_size)``: NVFP4 sends
  4.5 bits per element plus 4 bytes.
  """
  fmt: ScaledBlockFormat
  kind = "cast"
  aggregation = CASTS
  elementwise_state = True
  native_dtype = None
  dtype = None

  def __post_init__(self):
    if not isinstance(self.fmt, ScaledBlockFormat):
      raise ValueError(f"cast: ScaledCast needs a ScaledBlockFormat, got {self.fmt!r}")
    if self.fmt.tile is not None:
      raise ValueError(
          f"cast: {self.fmt!r} has 2-D tiles, but a compressor sees the flattened gradient "
          f"(or bucket): use 1-D blocks, e.g. nvfp4() instead of nvfp4(tile=...)")

  @property
  def format(self) -> ScaledBlockFormat:
    """The format of the flat vectors the compressor encodes (blocks along axis -1)."""
    return dataclasses.replace(self.fmt, axis=-1)

  @property
  def bits(self) -> int:
    """Bits per element code (the block and tensor scales come on top, :meth:`wire_bytes`)."""
    return self.fmt.elem.bits

  def init(self, shape, dtype=jnp.float32, key=None):
    return ()

  def round(self, x):
    """float32 ``x`` quantized to the format as a flat vector (what ``decode(encode(x))``
    gives), in x's shape."""
    x = jnp.asarray(x, jnp.float32)
    return spec_quantize(jnp.ravel(x), self.format).reshape(x.shape)

  def _scale_codes(self, s, bad):
    kind = self.fmt.scale_fmt
    if kind == "fp32":
      return jnp.where(bad, jnp.float32(jnp.nan), s)
    if kind == "ue4m3":
      code = to_codes(s, E4M3FN)
      return jnp.where(bad, jnp.uint32(0x7F), code).astype(jnp.uint8)
    e = B.floor_log2(B.to_bits(s)) + 127  # e8m0: s = 2**(code - 127), code in 0..254
    return jnp.where(bad, 0xFF, e).astype(jnp.uint8)

  def _scale_values(self, c):
    kind = self.fmt.scale_fmt
    if kind == "fp32":
      return c
    if kind == "ue4m3":
      return from_codes(c.astype(jnp.uint32), E4M3FN)
    e = c.astype(jnp.int32)
    return jnp.where(e == 0xFF, jnp.float32(jnp.nan), B.from_bits(B.pow2_bits(e - 127)))

  def encode(self, g, state, key=None):
    fmt = self.format
    x = jnp.ravel(g).astype(jnp.float32)
    q, s, t = fmt.encode(x)
    bad = jnp.isnan(fmt.to_blocks(q, x.shape)).any(axis=-1)  # blocks holding inf or NaN
    elem = Cast(fmt.elem)
    payload = dict(elem.encode(jnp.where(jnp.isnan(q), 0.0, q), ())[0])
    payload = {"elements": payload, "scales": self._scale_codes(s, bad)}
    if fmt.tensor_scale:
      payload["tensor_scale"] = jnp.reshape(t, (1,))
    return payload, state

  def decode(self, payload, shape):
    fmt = self.format
    n = numel(shape)
    q = Cast(fmt.elem).decode(payload["elements"], (n,))
    s = self._scale_values(payload["scales"])
    bad = jnp.isnan(s)
    qb = jnp.where(bad[:, None], jnp.float32(jnp.nan), fmt.to_blocks(q, (n,)))
    q = fmt.from_blocks(qb, (n,))
    t = payload["tensor_scale"][0] if fmt.tensor_scale else jnp.float32(1.0)
    return fmt.decode(q, jnp.where(bad, jnp.float32(1.0), s), t).reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    n = numel(shape)
    nblocks = cdiv(n, self.fmt.block_size) if n else 0
    per_scale = 4 if self.fmt.scale_fmt == "fp32" else 1
    return (Cast(self.fmt.elem).wire_bytes((n,)) + nblocks * per_scale
            + (4 if self.fmt.tensor_scale else 0))


def cast(fmt="bf16") -> Cast | ScaledCast:
  """A :class:`Cast` compressor to ``fmt`` (dtype name, preset name or FloatFormat), or a
  :class:`ScaledCast` one to a block-scaled ``fmt`` (``jaxlp.formats.nvfp4()``, any
  1-D :class:`~jaxlp.formats.ScaledBlockFormat`).

  PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook`` generalised: round to nearest
  even, divide by W, sum (the full specification is the docstring of the returned object's
  class).

  Args:
    fmt: a dtype name (``"bf16"``, ``"fp16"``, ``"float8_e4m3fn"``, ...), a preset name
      (``"E4M3FN"``) or any :class:`~jaxlp.formats.FloatFormat`.

  Returns:
    The compressor (a frozen dataclass; pass it to :func:`jaxlp.parallel.reduce_gradients`
    or :func:`jaxlp.parallel.compressed_allreduce`).

  Raises:
    ValueError: ``fmt`` is not a FloatFormat, a ScaledBlockFormat with 1-D blocks, a known
      preset name or a float dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp.parallel import compressors
    >>> c = compressors.cast("bf16")
    >>> payload, _ = c.encode(jnp.array([1.0, 1.00390625, 3.14159]), ())
    >>> c.decode(payload, (3,))
    Array([1.      , 1.      , 3.140625], dtype=float32)
    >>> c.wire_bytes((1000,)), compressors.cast(F.FloatFormat(3, 3)).wire_bytes((1000,))
    (2000, 875)
    >>> # NVFP4: 500 bytes of E2M1 codes, 63 UE4M3 block scales, one float32 tensor scale
    >>> compressors.cast(F.nvfp4()).wire_bytes((1000,))
    567
  """
  if isinstance(fmt, ScaledBlockFormat):
    return ScaledCast(fmt)
  return Cast(fmt)
