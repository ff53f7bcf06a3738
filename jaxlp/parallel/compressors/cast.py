"""Cast compression (PyTorch ``fp16_compress_hook`` / ``bf16_compress_hook``, any ml_dtypes
twin of a jaxlp format)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jaxlp.formats.float_format import FloatFormat
from jaxlp.formats.presets import ML_DTYPES_NAMES, PRESETS
from jaxlp.formats.quantize import quantize
from jaxlp.parallel.compressors._base import numel, pack_bits, packed_nbytes, unpack_bits

_ALIASES = {"fp16": "float16", "float16": "float16", "half": "float16", "bf16": "bfloat16",
            "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


def _resolve(fmt) -> np.dtype:
  if isinstance(fmt, FloatFormat):
    for name, preset in PRESETS.items():
      if preset == fmt and name in ML_DTYPES_NAMES:
        return np.dtype(getattr(ml_dtypes, ML_DTYPES_NAMES[name], None) or ML_DTYPES_NAMES[name])
    raise ValueError(f"cast: {fmt=} has no ml_dtypes twin; use a preset such as FP16, BF16, "
                     "E4M3FN, E5M2, E2M1FN")
  if isinstance(fmt, str):
    name = _ALIASES.get(fmt.lower(), fmt.lower())
    if name in ("float16", "float32"):
      return np.dtype(name)
    if hasattr(ml_dtypes, name):
      return np.dtype(getattr(ml_dtypes, name))
    if fmt.upper() in PRESETS:
      return _resolve(PRESETS[fmt.upper()])
    raise ValueError(f"cast: unknown {fmt=}")
  return np.dtype(fmt)


@dataclasses.dataclass(frozen=True)
class Cast:
  """Cast the gradient to a narrower float type (RNE), then divide by W in that type
  (PyTorch's cast-then-divide order), then sum. fp16/bf16 are summed by ``lax.psum`` in that
  dtype; narrower (fp8/fp6/fp4) payloads are all-gathered and summed in fp32 in rank order.
  Sub-byte types (fp6, fp4) are bit-packed on the wire.
  """
  fmt: object = "bf16"
  kind = "cast"
  elementwise_state = True

  @property
  def dtype(self) -> np.dtype:
    return _resolve(self.fmt)

  @property
  def bits(self) -> int:
    dt = self.dtype
    return int(getattr(ml_dtypes.finfo(dt), "bits", dt.itemsize * 8)) if dt.kind == "V" or \
        dt.itemsize == 1 else dt.itemsize * 8

  def init(self, shape, dtype=jnp.float32, key=None):
    return ()

  def _preset(self):
    name = self.dtype.name
    for key, mname in ML_DTYPES_NAMES.items():
      if mname == name:
        return PRESETS[key]
    raise ValueError(f"cast: no jaxlp preset for {name}")

  def _table(self):
    codes = np.arange(2 ** self.bits, dtype=np.uint8)
    return jnp.asarray(codes.view(self.dtype).astype(np.float32))

  def cast(self, x):
    return lax.convert_element_type(x, self.dtype)

  def encode(self, g, state, key=None):
    x = jnp.ravel(g).astype(jnp.float32)
    if self.bits < 8:
      # XLA:CPU cannot convert to 6-bit types; round with the jaxlp spec (same bits)
      c = quantize(x, self._preset())
      # sub-byte types: code = position of the value's fp32 bit pattern in the code table
      table = lax.bitcast_convert_type(self._table(), jnp.uint32)
      v = lax.bitcast_convert_type(c, jnp.uint32)
      code = jnp.argmax(v[:, None] == table[None, :], axis=1).astype(jnp.uint32)
      return {"codes": pack_bits(code, self.bits)}, state
    c = self.cast(x)
    return {"values": c}, state

  def decode(self, payload, shape):
    if self.bits < 8:
      code = unpack_bits(payload["codes"], self.bits, numel(shape))
      return self._table()[code].reshape(shape)
    else:
      c = payload["values"]
    return c.astype(jnp.float32).reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    n = numel(shape)
    return packed_nbytes(n, self.bits) if self.bits < 8 else n * self.dtype.itemsize


def cast(fmt="bf16") -> Cast:
  return Cast(fmt)
