"""Exact float32 arithmetic that does not depend on the backend's subnormal handling.

XLA on CPU flushes float32 subnormals (inputs and results) in float arithmetic. The
low-precision sums here are specified as "IEEE float32 add (round to nearest even,
gradual underflow), then round to the format", so the adds go through :func:`add_f32`,
which equals an IEEE float32 add for every input (numpy's ``np.float32`` add is the
oracle), and power-of-two scalings go through :func:`scale_pow2` (IEEE-rounded
``x * 2**s`` for any int ``s``, computed on the bit pattern).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp.formats import _bits as B

_SMALL_BITS = 0x0D800000  # 2^-100
_LIFT = 64


def neg(x):
  """-x by flipping the sign bit (exact, subnormals included)."""
  return B.from_bits(B.to_bits(x) ^ B.u32(B.SIGN_MASK))


_LIFT_BITS = _LIFT << 23  # 2^64 on the exponent field


def _lift(bits):
  """|x| * 2**64 (float32, normal or 0) of magnitudes below 2**-100, exactly, on any backend:
  a normal one moves its exponent field, a subnormal one is its integer fraction (exact in
  float32) times 2**-85, a product of normal numbers; the sign is put back on the bits."""
  mag = bits & B.u32(B.ABS_MASK)
  sub = B.to_bits((mag & B.u32(B.FRAC_MASK)).astype(jnp.float32) * jnp.float32(2.0**-85))
  lifted = jnp.where((mag >> B.u32(23)) == 0, sub, mag + B.u32(_LIFT_BITS))
  return B.from_bits(lifted | (bits & B.u32(B.SIGN_MASK)))


def _unlift(s):
  """``s * 2**-64`` for a sum of :func:`_lift` values (a multiple of 2**-85 below 2**-35):
  a normal result moves its exponent field back; a subnormal one is the integer ``|s| *
  2**85`` (exact) as the bits."""
  bits = B.to_bits(s)
  mag = bits & B.u32(B.ABS_MASK)
  sub = (B.from_bits(mag) * jnp.float32(2.0**85)).astype(jnp.uint32)
  out = jnp.where((mag >> B.u32(23)) > 64, mag - B.u32(_LIFT_BITS), sub)
  return B.from_bits(out | (bits & B.u32(B.SIGN_MASK)))


def add_f32(a, b):
  """IEEE float32 ``a + b`` (nearest even, gradual underflow) on any backend.

  If ``max(|a|, |b|) >= 2**-100`` the hardware add is already exact IEEE even under
  flush-to-zero / denormals-are-zero: a nonzero result is >= 2**-124 (normal) and a
  subnormal operand is below a quarter ulp of the other, so treating it as 0 changes
  nothing. Otherwise both operands are lifted by 2**64 (:func:`_lift`: exact, no float
  operation on a subnormal), added in the normal range (rounding is scale invariant there)
  and lowered back (:func:`_unlift`: exact, a sum that lands in the subnormal range is on the
  2**-149 grid). The products by powers of two are exact, so an FMA contraction cannot
  change them.
  """
  ab, bb = B.to_bits(a), B.to_bits(b)
  small = ((ab & B.u32(B.ABS_MASK)) < B.u32(_SMALL_BITS)) & (
      (bb & B.u32(B.ABS_MASK)) < B.u32(_SMALL_BITS))
  return jnp.where(small, _unlift(_lift(ab) + _lift(bb)), a + b)


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


# ---------------------------------------------------------------------------------------------
# Division and square root, correctly rounded on every backend.
#
# XLA:GPU lowers float32 ``a / b`` and ``sqrt`` to approximate PTX (``div.full.f32``,
# ``sqrt.approx.f32``: up to a couple of ulp off), and XLA:CPU rewrites division by a broadcast
# scalar into a multiplication by its reciprocal; neither is the correctly rounded operation of
# IEEE 754-2019 (clause 5.4.1). Here the exact result is computed on the integer significands:
#
# 1. each operand's significand is normalised to 24 bits (subnormals too) with integer ops;
# 2. the hardware float32 ``/`` or ``sqrt`` of those significands -- normal numbers between
#    2^23 and 2^26, so no flush-to-zero is involved -- gives an ESTIMATE of the integer
#    quotient/root q; its only use is as a starting point, and all that is assumed of it is a
#    relative error below 2^-20 for division, 2^-19 for the square root (8 and 16 ulp).
#    XLA:CPU divides in IEEE or by a correctly rounded reciprocal; PTX ``div.full.f32`` has a
#    2 ulp bound (PTX ISA); measured on an H100, XLA:GPU's division was within 1.3 * 2^-23 and
#    its square root within 0.9 * 2^-23. The tests replace the estimates by ones that are off
#    by the full bounds;
# 3. the exact integer remainder (``a - q*b`` or ``N - q^2``) is computed in uint32 arithmetic
#    modulo 2^32, which is exact because the true remainder of an estimate that close is below
#    2^31 in magnitude; one Newton step in float32 plus two +-1 fix-ups make q exact (the
#    remainder's sign and size decide it, as in long division);
# 4. q carries 2 bits below the result's 24-bit significand and the remainder gives the sticky
#    bit, so the result is rounded once, to nearest even, at the quantum of its own exponent
#    (2^-149 for subnormal results: no double rounding), with integer ops.
#
# This is the classic "estimate, then correct with an exact remainder" scheme (e.g. Markstein,
# "IA-64 and Elementary Functions", 2000; Ercegovac & Lang, "Digital Arithmetic", 2004, ch. 5-6),
# with the exact remainder done in integers instead of with an FMA. A pure digit-by-digit
# (restoring) recurrence is also exact and needs no estimate, but takes ~26 dependent steps
# (~270 ops instead of ~110): measured on XLA:CPU it took about 3x longer to compile per
# call site and 3x longer to run.


def _significand(mag):
  """(sig, e) with |x| = sig * 2^(e - 23), sig in [2^23, 2^24), for finite nonzero ``mag``.

  The integer significand (below 2^24) is converted to float32 exactly; the conversion's
  exponent field is 127 + floor(log2 sig) and its fraction field is the significand normalised
  (subnormals included), so no count-leading-zeros is needed (``lax.clz`` does not compile
  under Triton). Zero gives sig = 2^23 (a harmless placeholder; callers mask zeros).
  """
  field = mag >> 23
  x = (mag & B.u32(B.FRAC_MASK)) | (jnp.minimum(field, B.u32(1)) << 23)
  fx = B.to_bits(x.astype(jnp.float32))
  sig = (fx & B.u32(B.FRAC_MASK)) | B.u32(0x800000)
  # Normal: field + 150 - 277 = field - 127. Subnormal with top bit t: 1 + (127 + t) - 277.
  e = (jnp.maximum(field, B.u32(1)) + (fx >> 23)).astype(B.I32) - 277
  return sig, e


def _i32(u):
  return lax.bitcast_convert_type(u, B.I32)


def _u32(i):
  return lax.bitcast_convert_type(i, B.U32)


def _round_pack(q, sticky, e):
  """float32 magnitude bits of ``(q + f) * 2^(e - 25)``, rounded to nearest even.

  ``q`` (uint32) is in [2^25, 2^26), ``0 <= f < 1`` and ``sticky`` (bool) is ``f != 0``. Results
  below 2^-126 are rounded once at the subnormal quantum 2^-149 (no double rounding); results
  beyond the float32 range give +inf's bits.
  """
  # The sticky bit becomes q's lowest bit (q2 = 2q + sticky), then s bits are dropped: 3 in the
  # normal range, more below it; 28 or more leave q2 < 2^27 <= half a quantum (rounds to 0), so
  # s is clipped there. Ties to even: adding half - 1 + (the kept lsb) carries exactly when the
  # dropped part is above half, or equal to it with an odd kept part.
  q2 = (q << 1) | sticky.astype(B.U32)
  s = jnp.clip(-123 - e, 3, 28).astype(B.U32)
  half = B.u32(1) << (s - B.u32(1))
  m = (q2 + (half - B.u32(1)) + ((q2 >> s) & B.u32(1))) >> s  # [2^23, 2^24] if normal
  # Normal: the implicit bit of m adds 1 to the field (e + 126) -> e + 127; a carry to 2^24
  # adds one more (at e = 127 that is +inf's pattern). Subnormal: m is the pattern itself (a
  # carry to 2^23 gives the smallest normal).
  expo = jnp.maximum(e + 126, 0).astype(B.U32) << 23
  return jnp.where(e > 127, B.u32(B.INF_BITS), expo + m)


def _div_estimate(fa, fb):
  """float32 estimate of ``fa / fb`` (relative error < 2^-20 suffices); a hook for tests."""
  return fa / fb


def _sqrt_estimate(fx):
  """float32 estimate of ``sqrt(fx)`` (relative error < 2^-19 suffices); a hook for tests."""
  return jnp.sqrt(fx)


def _sig_quotient(sa, sb):
  """(q, r) with q = floor(sa * 2^25 / sb), r = sa * 2^25 - q * sb (so 0 <= r < sb).

  ``sb`` in [2^23, 2^24), ``sa`` in [sb, 2 sb): q is in [2^25, 2^26).
  """
  fb = sb.astype(jnp.float32)  # exact: below 2^24
  # Estimate (exact inputs: sa < 2^25 is even when >= 2^24). With Q = sa * 2^25 / sb < 2^26,
  # |t - Q| < 2^26 * 2^-20 = 64, so q0 = trunc(t) is in (Q - 65, Q + 64).
  t = _div_estimate(sa.astype(jnp.float32), fb) * jnp.float32(2.0 ** 25)
  q0 = jnp.clip(t, 0.0, 2.0 ** 27).astype(B.I32)
  # Remainder modulo 2^32; its true value (Q - q0) * sb is below 65 * 2^24 < 2^31 in magnitude.
  r = _i32((sa << 25) - _u32(q0) * sb)
  # One correction step: x = r / sb = Q - q0 is in [-64, 65], its float estimate x' is within
  # 2^-13 of it, so c = floor(x') is floor(x) - 1, floor(x) or floor(x) + 1 and r - c * sb lies
  # in [-sb, 2 sb): the two fix-ups below bring it into [0, sb).
  x = _div_estimate(r.astype(jnp.float32), fb)
  c = jnp.floor(jnp.clip(x, -127.0, 127.0)).astype(B.I32)
  sbi = _i32(sb)
  q = q0 + c
  r = r - c * sbi
  neg = r < 0
  q = jnp.where(neg, q - 1, q)
  r = jnp.where(neg, r + sbi, r)
  big = r >= sbi
  q = jnp.where(big, q + 1, q)
  r = jnp.where(big, r - sbi, r)
  return _u32(q), r


def _sig_sqrt(s2):
  """(q, r) with q = floor(sqrt(N)), r = N - q^2 (0 <= r <= 2q), N = s2 * 2^26.

  ``s2`` in [2^24, 2^26) with at most 24 significant bits: q is in [2^25, 2^26).
  """
  fs = s2.astype(jnp.float32)  # exact: 24 significant bits
  # Stage 1: p = floor(P), P = sqrt(N') for N' = s2 * 2^22 (P in [2^23, 2^24)). The estimate t
  # is within P * 2^-19 < 32 of P, so |P - p0| < 33 and the remainder N' - p0^2 =
  # (P - p0)(P + p0) is below 33 * (2^25 + 32) < 2^31 in magnitude: exact modulo 2^32.
  t = _sqrt_estimate(fs) * jnp.float32(2.0 ** 11)
  p0 = jnp.clip(t, 2.0 ** 22, 2.0 ** 25).astype(B.I32)
  r = _i32((s2 << 22) - _u32(p0) * _u32(p0))
  # One Newton step x = r / (2 p0): it exceeds P - p0 by (P - p0)^2 / (2 p0) < 2^-13, and its
  # float estimate is within 2^-13 more, so p0 + floor(x') is floor(P) - 1, floor(P) or
  # floor(P) + 1; the fix-ups below make it floor(P) exactly.
  x = _div_estimate(r.astype(jnp.float32), p0.astype(jnp.float32) * jnp.float32(2.0))
  p = p0 + jnp.floor(jnp.clip(x, -127.0, 127.0)).astype(B.I32)
  r = _i32((s2 << 22) - _u32(p) * _u32(p))
  neg = r < 0  # p too big by one: N' - (p-1)^2 = r + 2p - 1
  r = jnp.where(neg, r + 2 * p - 1, r)
  p = jnp.where(neg, p - 1, p)
  big = r > 2 * p  # p too small by one: N' - (p+1)^2 = r - 2p - 1
  r = jnp.where(big, r - 2 * p - 1, r)
  p = jnp.where(big, p + 1, p)
  # Two more root bits, digit by digit (N's next bit pairs are zero); 0 <= r <= 2p < 2^25.
  for _ in range(2):
    r = r << 2
    t = (p << 2) | 1
    ge = r >= t
    r = jnp.where(ge, r - t, r)
    p = (p << 1) | ge.astype(B.I32)
  return _u32(p), r


def div_f32(a, b):
  """IEEE 754 float32 ``a / b`` (round to nearest even, gradual underflow) on any backend.

  The quotient of the 24-bit significands is made exact with integer remainders (see the
  comment above), so the result depends neither on the backend's division (approximate on
  XLA:GPU, a reciprocal multiply for broadcast divisors on XLA:CPU) nor on its subnormal
  flushing. Elementwise, so it fuses with its neighbours.

  Args:
    a: dividend, array or Python scalar (cast to float32).
    b: divisor, array or Python scalar (cast to float32); broadcast against ``a`` as
      ``jnp.divide`` does.

  Returns:
    float32 array of the broadcast shape: the correctly rounded quotient. IEEE specials: NaN
    operands, ``0/0`` and ``inf/inf`` give a (positive, quiet) NaN; ``x/0`` gives +-inf,
    ``0/x`` and ``x/inf`` +-0, ``inf/x`` +-inf, with the sign the xor of the operands' signs.

  Example:
    >>> import jax.numpy as jnp
    >>> div_f32(jnp.float32(1), jnp.float32(3))
    Array(0.33333334, dtype=float32)
    >>> div_f32(jnp.array([1.0, -6.0, 0.0], jnp.float32), 0)
    Array([ inf, -inf,  nan], dtype=float32)
  """
  return _div_f32(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))


# Jitted so that repeated call sites inside one program reuse the traced body (tracing ~130
# small ops costs more than compiling them); XLA inlines the call.
@jax.jit
def _div_f32(a, b):
  abits = B.to_bits(a)
  bbits = B.to_bits(b)
  sign = (abits ^ bbits) & B.u32(B.SIGN_MASK)
  ma = abits & B.u32(B.ABS_MASK)
  mb = bbits & B.u32(B.ABS_MASK)
  sa, ea = _significand(ma)
  sb, eb = _significand(mb)
  # Make sa / sb lie in [1, 2): then the quotient's leading bit is 2^0.
  low = sa < sb
  sa = jnp.where(low, sa << 1, sa)  # < 2^25
  e = ea - eb - low.astype(B.I32)
  q, r = _sig_quotient(sa, sb)
  out = _round_pack(q, r != 0, e)
  # Specials (IEEE 754-2019 clause 7.2 for the invalid cases).
  inf = (ma == B.u32(B.INF_BITS)) | (mb == 0)
  zero = (ma == 0) | (mb == B.u32(B.INF_BITS))
  nan = B.is_nan_mag(jnp.maximum(ma, mb)) | (inf & zero)  # inf & zero: 0/0 or inf/inf
  out = jnp.where(inf, B.u32(B.INF_BITS), out)
  out = jnp.where(zero, B.u32(0), out)
  out = jnp.where(nan, B.u32(B.QNAN_BITS), out | sign)
  return B.from_bits(out)


def sqrt_f32(x):
  """IEEE 754 float32 ``sqrt(x)`` (round to nearest even) on any backend.

  The root of the normalised significand is made exact with an integer remainder (see the
  comment above), so the result depends neither on the backend's ``sqrt`` (approximate on
  XLA:GPU) nor on its subnormal flushing (subnormal inputs are exact).

  Args:
    x: array or Python scalar (cast to float32).

  Returns:
    float32 array of ``x``'s shape: the correctly rounded square root; ``sqrt(-0) = -0``,
    ``sqrt(+inf) = +inf``, negative numbers and NaN give a (positive, quiet) NaN.

  Example:
    >>> import jax.numpy as jnp
    >>> sqrt_f32(jnp.float32(2))
    Array(1.4142135, dtype=float32)
    >>> sqrt_f32(jnp.array([-0.0, 4.0, -1.0], jnp.float32))
    Array([-0.,  2., nan], dtype=float32)
  """
  return _sqrt_f32(jnp.asarray(x, jnp.float32))


@jax.jit
def _sqrt_f32(x):
  bits = B.to_bits(x)
  mag = bits & B.u32(B.ABS_MASK)
  sig, e = _significand(mag)
  # |x| = sig * 2^(e - 23) = s2 * 2^(e - 24 - odd) with an even exponent e - odd - 24, so with
  # N = s2 * 2^26: |x| = N * 2^(e - odd - 50) and sqrt|x| = sqrt(N) * 2^((e - odd)/2 - 25).
  odd = e & 1
  s2 = sig << (odd + 1).astype(B.U32)  # in [2^24, 2^26)
  q, r = _sig_sqrt(s2)
  out = _round_pack(q, r != 0, (e - odd) >> 1)  # e - odd is even: the shift is exact
  neg = (bits & B.u32(B.SIGN_MASK)) != 0
  out = jnp.where(mag == B.u32(B.INF_BITS), mag, out)
  out = jnp.where(mag == 0, bits, out)  # +-0 keep their sign
  out = jnp.where(B.is_nan_mag(mag) | (neg & (mag != 0)), B.u32(B.QNAN_BITS), out)
  return B.from_bits(out)
