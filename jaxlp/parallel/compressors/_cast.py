"""Cast compression (PyTorch ``fp16_compress_hook`` / ``bf16_compress_hook``, generalised to
every ml_dtypes type and to any jaxlp :class:`~jaxlp.formats.FloatFormat`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jaxlp.formats._codes import from_codes, to_codes
from jaxlp.formats._float_format import FloatFormat
from jaxlp.formats._presets import ML_DTYPES_NAMES, PRESETS
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
    raise ValueError(f"cast: {fmt=} is not a FloatFormat, preset name or float dtype") from None
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


def cast(fmt="bf16") -> Cast:
  """A :class:`Cast` compressor to ``fmt`` (dtype name, preset name or FloatFormat).

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
    ValueError: ``fmt`` is not a FloatFormat, a known preset name or a float dtype.

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
  """
  return Cast(fmt)
