"""Exact float32 arithmetic that does not depend on the backend's subnormal handling.

XLA on CPU flushes float32 subnormals (inputs and results) in float arithmetic. The
low-precision sums here are specified as "IEEE float32 add (round to nearest even,
gradual underflow), then round to the format", so the adds go through :func:`add_f32`,
which equals an IEEE float32 add for every input (numpy's ``np.float32`` add is the
oracle), and power-of-two scalings go through :func:`scale_pow2` (IEEE-rounded
``x * 2**s`` for any int ``s``, computed on the bit pattern).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxlp.formats import _bits as B

_SMALL_BITS = 0x0D800000  # 2^-100
_LIFT = 64


def neg(x):
  """-x by flipping the sign bit (exact, subnormals included)."""
  return B.from_bits(B.to_bits(x) ^ B.u32(B.SIGN_MASK))


def _ldexp_signed(x, s):
  bits = B.to_bits(x)
  mag = bits & B.u32(B.ABS_MASK)
  return B.from_bits(B.ldexp_bits(mag, s) | (bits & B.u32(B.SIGN_MASK)))


def add_f32(a, b):
  """IEEE float32 ``a + b`` (nearest even, gradual underflow) on any backend.

  If ``max(|a|, |b|) >= 2**-100`` the hardware add is already exact IEEE even under
  flush-to-zero / denormals-are-zero: a nonzero result is >= 2**-124 (normal) and a
  subnormal operand is below a quarter ulp of the other, so treating it as 0 changes
  nothing. Otherwise both operands are lifted by 2**64 (exact, on the bits), added in the
  normal range, and lowered back (exact: a sum that lands in the subnormal range is
  exactly representable, and rounding in the normal range is scale invariant).
  """
  ab = B.to_bits(a) & B.u32(B.ABS_MASK)
  bb = B.to_bits(b) & B.u32(B.ABS_MASK)
  small = (ab < B.u32(_SMALL_BITS)) & (bb < B.u32(_SMALL_BITS))
  plain = a + b
  lifted = _ldexp_signed(_ldexp_signed(a, _LIFT) + _ldexp_signed(b, _LIFT), -_LIFT)
  return jnp.where(small, lifted, plain)


def sub_f32(a, b):
  return add_f32(a, neg(b))


def scale_pow2(x, s):
  """IEEE float32 ``x * 2**s`` (nearest even) for int32 ``s`` of any size, on the bits.

  Overflow gives ±inf, underflow rounds to the subnormal grid (ties to even); ±0, inf and
  NaN pass through.
  """
  bits = B.to_bits(x)
  sign = bits & B.u32(B.SIGN_MASK)
  mag = bits & B.u32(B.ABS_MASK)
  s = jnp.asarray(s, B.I32)
  finite = B.is_finite_mag(mag)
  fmag = jnp.where(finite, mag, B.u32(0))
  # Round to the float32 grid of the *scaled* value first (multiples of 2^(-149 - s)),
  # then move the exponent exactly.
  r = B.round_to_quantum(fmag, -149 - s, "nearest",
                         negative=sign != 0)
  out = B.ldexp_bits(r, s)
  out = jnp.where(finite, out, mag)
  return B.from_bits(out | sign)
