"""Storage codes of a :class:`~jaxlp.formats.FloatFormat`: value <-> ``bits``-bit integer.

The code of a format with ``e`` exponent and ``m`` fraction bits is
``sign << (e + m) | field << m | fraction`` -- the layout of IEEE 754 interchange formats and
of the OCP FP8/FP6/FP4 types (so for every preset with an ml_dtypes twin the code equals that
type's bit pattern). Special codes follow the format's ``specials``:

* ``"ieee"``: field all ones: fraction 0 is +-inf, others NaN (NaN encodes as the quiet NaN
  ``field=all ones, fraction=100..0``);
* ``"fn"``: the all-ones code (``s=0``) is NaN (with ``man_bits=0``: the whole top binade);
* ``"fnuz"``: the ``-0`` code (sign only) is NaN;
* ``"finite"``: no NaN code. NaN is encoded as the largest finite code (+max) -- the only
  information-losing case, documented rather than hidden; ``ieee`` with ``man_bits=0`` has
  no NaN code either, and NaN encodes as +inf.

Everything is integer arithmetic on float32 bit patterns (exact for subnormals on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxlp.formats import _bits as B
from jaxlp.formats._float_format import FloatFormat

U32 = jnp.uint32


def _check(fmt, what):
  if not isinstance(fmt, FloatFormat):
    raise TypeError(f"{what}: fmt must be a FloatFormat (the formats with storage codes), "
                    f"got {fmt!r}")


def _nan_code(fmt) -> int:
  e, m = fmt.exp_bits, fmt.man_bits
  top = (2 ** e - 1) << m
  if fmt.specials == "ieee":
    return top | (1 << (m - 1)) if m > 0 else top
  if fmt.specials == "fn":
    return top | (2 ** m - 1)
  if fmt.specials == "fnuz":
    return 1 << (e + m)
  return (fmt.emax_field << m) | fmt.max_man_code  # "finite": no NaN code


def to_codes(x, fmt):
  """Codes (uint32, low ``fmt.bits`` bits used) of ``x`` rounded to ``fmt`` (nearest-even).

  Values already on the format's grid are encoded exactly; anything else is rounded first
  with :func:`jaxlp.formats.quantize` semantics (``rounding="nearest"``).

  Args:
    x: array-like of values (converted to float32).
    fmt: a :class:`~jaxlp.formats.FloatFormat` (or a preset).

  Returns:
    uint32 array of x's shape: ``sign << (e + m) | field << m | fraction`` (see the module
    docstring for NaN and the special codes).

  Raises:
    TypeError: ``fmt`` is not a :class:`~jaxlp.formats.FloatFormat` (block, fixed-point,
      ``cpd_float`` and ``qpytorch_float`` formats have no storage codes here).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # E4M3FN: 1.0 = 0x38, -2.0 = 0xC0, 448 (max) = 0x7E, NaN = 0x7F, 2**-9 (subnormal) = 1
    >>> [hex(c) for c in F.to_codes(jnp.array([1.0, -2.0, 448.0, jnp.nan, 2.0**-9]), F.E4M3FN)]
    ['0x38', '0xc0', '0x7e', '0x7f', '0x1']
  """
  _check(fmt, "to_codes")
  return _to_codes(jnp.asarray(x, jnp.float32), fmt)


# One jitted program per format and shape (eager, every jnp op below was compiled on its
# own: the first call of the example above took 1.9 s on a 2-core CPU, jitted 0.2 s).
@functools.partial(jax.jit, static_argnums=1)
def _to_codes(x, fmt):
  from jaxlp.formats._quantize import quantize_f32

  q = quantize_f32(x, fmt, "nearest")
  bits = B.to_bits(q)
  e, m = fmt.exp_bits, fmt.man_bits
  sign, mag, _ = B.split(bits)
  lg = B.floor_log2(jnp.maximum(mag, B.u32(1)))
  normal = lg >= fmt.emin
  field = jnp.where(normal, lg + fmt.bias, 0).astype(U32)
  frac_n = (mag & B.u32(B.FRAC_MASK)) >> (23 - m)
  # subnormal in the format: fraction = |q| / 2**(emin - m), an integer < 2**m (exact)
  sub_val = B.from_bits(B.ldexp_bits(jnp.where(normal, B.u32(0), mag),
                                     jnp.int32(m - fmt.emin)))
  frac_s = sub_val.astype(U32)
  code = (field << m) | jnp.where(normal, frac_n, frac_s)
  code = jnp.where(mag == 0, B.u32(0), code)
  code = jnp.where(mag == B.u32(B.INF_BITS), B.u32((2 ** e - 1) << m), code)
  code = code | jnp.where(sign, B.u32(1 << (e + m)), B.u32(0))
  return jnp.where(B.is_nan_mag(mag), B.u32(_nan_code(fmt)), code)


def from_codes(codes, fmt):
  """float32 values of ``fmt.bits``-bit codes (higher bits ignored); NaN codes give NaN.

  The inverse of :func:`to_codes` (up to NaN payloads and, for ``specials="finite"``, the
  NaN that :func:`to_codes` encodes as +max).

  Args:
    codes: integer array-like of codes (converted to uint32).
    fmt: a :class:`~jaxlp.formats.FloatFormat` (or a preset).

  Returns:
    float32 array of the codes' shape.

  Raises:
    TypeError: ``fmt`` is not a :class:`~jaxlp.formats.FloatFormat`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # E2M1 (MX FP4): all 8 non-negative codes
    >>> F.from_codes(jnp.arange(8), F.E2M1FN)
    Array([0. , 0.5, 1. , 1.5, 2. , 3. , 4. , 6. ], dtype=float32)
    >>> F.from_codes(jnp.array([0x7E, 0xFE, 0x7F, 0x17E]), F.E4M3FN)  # bit 8 is ignored
    Array([ 448., -448.,   nan,  448.], dtype=float32)
  """
  _check(fmt, "from_codes")
  return _from_codes(jnp.asarray(codes), fmt)


@functools.partial(jax.jit, static_argnums=1)  # one program per format and shape
def _from_codes(codes, fmt):
  c = codes.astype(U32)
  e, m = fmt.exp_bits, fmt.man_bits
  sign = (c >> (e + m)) & 1
  field = ((c >> m) & (2 ** e - 1)).astype(jnp.int32)
  frac = c & B.u32(2 ** m - 1)
  normal = (((field - fmt.bias + 127).astype(U32)) << 23) | (frac << (23 - m))
  if fmt.subnormals:
    sub = B.ldexp_bits(B.to_bits(frac.astype(jnp.float32)), jnp.int32(fmt.emin - m))
  else:
    sub = B.u32(0)
  mag = jnp.where(field == 0, sub, normal)
  top = field == 2 ** e - 1
  if fmt.specials == "ieee":
    mag = jnp.where(top, jnp.where(frac == 0, B.u32(B.INF_BITS), B.u32(B.QNAN_BITS)), mag)
  elif fmt.specials == "fn":
    nan = top & ((frac == 2 ** m - 1) if m > 0 else True)
    mag = jnp.where(nan, B.u32(B.QNAN_BITS), mag)
  bits = mag | (sign << 31)
  if fmt.specials == "fnuz":
    bits = jnp.where((sign == 1) & (field == 0) & (frac == 0), B.u32(B.QNAN_BITS), bits)
  bits = jnp.where(B.is_nan_mag(bits & B.u32(B.ABS_MASK)), B.u32(B.QNAN_BITS), bits)
  return B.from_bits(bits)
