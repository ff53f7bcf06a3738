"""Bit-level helpers on the float32 pattern: the one rounding primitive every format uses.

Everything here is elementwise and written with integer ops on ``uint32`` bit patterns
(plus ``where``), so that

* float32 subnormal inputs are handled exactly (XLA on CPU flushes subnormals in float
  arithmetic, never in integer arithmetic);
* XLA cannot simplify a "round to a narrower type and back" pair away;
* the same functions can be called inside a Pallas kernel body, so kernel == reference
  bit for bit by construction.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import tree_map

U32 = jnp.uint32
I32 = jnp.int32

SIGN_MASK = 0x80000000
ABS_MASK = 0x7FFFFFFF
EXP_MASK = 0x7F800000
FRAC_MASK = 0x007FFFFF
INF_BITS = 0x7F800000
QNAN_BITS = 0x7FC00000

# Rounding modes understood by :func:`round_to_quantum`.
ROUNDINGS = ("nearest", "nearest_away", "toward_zero", "up", "down", "stochastic")
# Internal-only mode: ties toward +inf (QPyTorch's block rebase trick).
_HALF_UP = "nearest_half_up"


def u32(v):
  return jnp.asarray(v, U32)


def high_mask(n: int):
  """uint32 literal with every bit set except the ``n`` (static) lowest.

  Built in Python: inside a Pallas kernel, ``~`` of a constant array fails the Triton
  lowering like a constant bitcast does (see :func:`f32_bits`).
  """
  return u32(0xFFFFFFFF ^ ((1 << n) - 1))


def to_bits(x: jnp.ndarray) -> jnp.ndarray:
  """float32 -> uint32 bit pattern (exact) of a traced array.

  For a constant use :func:`f32_bits`: inside a Pallas kernel the Triton lowering cannot
  bitcast a trace-time constant.
  """
  return lax.bitcast_convert_type(x, U32)


def f32_bits(v) -> int:
  """Bit pattern (a Python int) of the float32 nearest to the constant ``v``.

  Computed with numpy at trace time, so kernels see an integer literal: the Pallas->Triton
  lowering fails on ``bitcast_convert_type`` of a constant ("'TypedNdArray' object has no
  attribute 'type'", measured on jax 0.10-0.11).
  """
  with np.errstate(over="ignore"):  # beyond float32's range: the bits of +-inf
    return int(np.asarray(v, np.float32).view(np.uint32))


def from_bits(b: jnp.ndarray) -> jnp.ndarray:
  """uint32 bit pattern -> float32 (exact)."""
  return lax.bitcast_convert_type(b, jnp.float32)


def split(bits):
  """Split float32 bits into (sign bit as bool, magnitude bits, biased exponent field)."""
  sign = (bits & u32(SIGN_MASK)) != 0
  mag = bits & u32(ABS_MASK)
  field = (mag >> 23).astype(I32)
  return sign, mag, field


def is_finite_mag(mag):
  return mag < u32(INF_BITS)


def is_nan_mag(mag):
  return mag > u32(INF_BITS)


def top_bit(n, *, max_bits: int = 32):
  """Index of the highest set bit of uint32 ``n`` (= floor(log2 n)), exact; -1 where n == 0.

  Read off the exponent field of the float32 conversion of ``n`` (exact for integers below
  2**24; wider values are split into 16-bit halves), not with ``lax.clz``: Triton's NVIDIA
  backend cannot legalize the ``math.ctlz`` that ``clz`` lowers to. ``max_bits`` (static)
  bounds the width of ``n``; <= 24 needs a single conversion.
  """
  n = jnp.asarray(n, U32)

  def exact(v):  # v < 2**24: the conversion is exact, so the field is floor(log2 v) + 127
    return (to_bits(v.astype(jnp.float32)) >> u32(23)).astype(I32) - 127

  if max_bits <= 24:
    e = exact(n)
  else:
    hi = n >> u32(16)
    e = jnp.where(hi != 0, exact(hi) + 16, exact(n & u32(0xFFFF)))
  return jnp.where(n == 0, -1, e)


def floor_log2(mag):
  """floor(log2 |x|) of finite, nonzero float32 magnitude bits, exact (subnormals too).

  Zero gives -150 (below every representable exponent).
  """
  field = (mag >> 23).astype(I32)
  frac = mag & u32(FRAC_MASK)
  # Subnormal: frac = 2^p * (1.xxx) with p its top set bit => value = 2^(p - 149).
  sub_e = top_bit(frac, max_bits=23) - 149
  return jnp.where(field > 0, field - 127, jnp.where(frac == 0, -150, sub_e))


def ceil_log2(mag):
  """ceil(log2 |x|) of finite nonzero float32 magnitude bits, exact. Zero gives -150."""
  fl = floor_log2(mag)
  field = (mag >> 23).astype(I32)
  frac = mag & u32(FRAC_MASK)
  is_pow2 = jnp.where(field > 0, frac == 0, (frac & (frac - u32(1))) == 0)
  return jnp.where((mag == 0) | is_pow2, fl, fl + 1)


def pow2_bits(e):
  """Bits of 2^e for integer e in [-149, 128] (128 gives +inf's bits)."""
  e = jnp.asarray(e, I32)
  normal = (jnp.clip(e, -126, 128) + 127).astype(U32) << 23
  sub = u32(1) << jnp.clip(e + 149, 0, 22).astype(U32)
  return jnp.where(e >= -126, normal, sub)


def round_to_quantum(mag, qe, rounding: str, *, negative=None, rand=None, rand_bits=None):
  """Round a finite float32 magnitude to an integer multiple of 2^qe.

  Args:
    mag: uint32 magnitude bits (sign cleared) of finite values.
    qe: int32 quantum exponent per element (any int; values below -149 mean "no rounding",
      since every float32 is a multiple of 2^-149).
    rounding: one of :data:`ROUNDINGS` (or the internal ties-toward-+inf mode).
    negative: bool array, the sign of the value (needed by "up"/"down"/half-up).
    rand: uint32 uniform random words (needed by "stochastic").
    rand_bits: if set, only this many random bits are used (limited-precision stochastic
      rounding: P(round up) = floor(frac * 2^rand_bits) / 2^rand_bits).

  Returns:
    uint32 magnitude bits of the rounded value k * 2^qe. A carry past the float32 range
    gives the bits of +inf (0x7F800000).

  The rounding is exact: the kept integer k = floor(|x| / 2^qe) and the remainder are read
  off the significand with shifts, and the increment is decided with integer compares.
  """
  field = (mag >> 23).astype(I32)
  qe = jnp.asarray(qe, I32)
  d = qe - (jnp.maximum(field, 1) - 150)  # qe minus the exponent of the significand's lsb
  big = pow2_bits(jnp.clip(qe, -149, 128))
  return round_dropped_bits(mag, d, rounding, big=big, negative=negative, rand=rand,
                            rand_bits=rand_bits)


def round_dropped_bits(mag, d, rounding: str, *, big, negative=None, rand=None, rand_bits=None,
                       d_range=(None, None)):
  """:func:`round_to_quantum` given the number ``d`` of low significand bits to drop.

  Args:
    mag: uint32 magnitude bits of finite values.
    d: int32, ``qe - (max(field, 1) - 150)`` where 2^qe is the quantum.
    rounding, negative, rand, rand_bits: as in :func:`round_to_quantum`.
    big: uint32 bits of 2^qe (broadcastable); used only where ``d >= 24`` (there the value
      is below 2^qe, so the result is 0 or 2^qe).
    d_range: static (lo, hi) bounds on ``d`` over the finite elements (``None``: unbounded).
      Branches that cannot occur are left out of the traced computation; the bits are the
      same as without bounds.

  Returns:
    uint32 magnitude bits of the rounded value (as :func:`round_to_quantum`).
  """
  lo, hi = d_range
  lo = -(1 << 30) if lo is None else lo
  hi = (1 << 30) if hi is None else hi
  d = jnp.asarray(d, I32)
  # Shift amount, clipped to [0, 31] only where d can leave that range (no over-shifts, so
  # this is also valid inside Pallas kernels).
  dc = d if lo >= 0 else jnp.maximum(d, 0)
  dc = (dc if hi <= 31 else jnp.minimum(dc, 31)).astype(U32)
  low_mask = (u32(1) << dc) - u32(1)
  has_small = lo <= 23
  has_big = hi >= 24
  if has_big or (rounding == "nearest" and hi >= 23):
    field = mag >> 23
    frac = mag & u32(FRAC_MASK)
    sig = jnp.where(field > 0, frac | u32(0x800000), frac)
  else:
    sig = mag & u32(FRAC_MASK)  # equal to the significand's bits below bit d (d <= 22)
  # Remainder: the dropped bits (for d >= 24 the whole significand; dc >= 24 keeps it all).
  rem = (sig if has_big else mag) & low_mask
  half = (u32(1) << dc) >> u32(1)  # 2^(d-1) (0 where d <= 0, which never increments)

  small = bigv = None
  if rounding == "nearest":
    # Ties to even on k = sig >> d: adding half - 1 + (k & 1) carries exactly when
    # rem > half or (rem == half and k odd); the carry ripples into the exponent field.
    if has_small:
      kodd = (sig >> dc) & u32(1)
      small = (mag + (half - u32(1)) + kodd) & ~low_mask
    if has_big:  # d >= 24: k = 0 (even), so round up iff sig > half (only possible at d = 24)
      bigv = jnp.where(sig > half, big, u32(0))
  else:
    if rounding == "nearest_away":
      inc = rem >= half
    elif rounding == _HALF_UP:
      inc = (rem > half) | ((rem == half) & ~negative)
    elif rounding == "toward_zero":
      inc = None
    elif rounding == "up":
      inc = (rem != 0) & ~negative
    elif rounding == "down":
      inc = (rem != 0) & negative
    elif rounding == "stochastic":
      # P(inc) = rem / 2^d exactly for d <= 32 (threshold T / 2^32 with T = rem * 2^(32-d)).
      # rem = 0 where d <= 0, so no increment there; for d >= 56 the right shift by >= 24
      # clears the (24-bit) remainder.
      if lo >= 32:
        thr = rem >> jnp.minimum(d - 32, 31).astype(U32)
      else:
        thr = rem << jnp.clip(32 - d, 0, 31).astype(U32)
        if hi > 32:
          thr = jnp.where(d <= 32, thr, rem >> jnp.clip(d - 32, 0, 31).astype(U32))
      if rand_bits is not None and rand_bits < 32:
        thr = thr & high_mask(32 - rand_bits)
      inc = rand < thr
    else:  # pragma: no cover - validated by callers
      raise ValueError(f"unknown rounding {rounding!r}")
    if inc is not None and rounding != "stochastic" and lo <= 0:
      inc = inc & (d > 0)
    if has_small:
      # d <= 23: clear the dropped bits of the pattern and add the increment; a carry
      # ripples into the exponent field exactly as the value demands.
      small = mag & ~low_mask
      if inc is not None:
        small = small + (inc.astype(U32) << dc)
    if has_big:
      bigv = u32(0) if inc is None else jnp.where(inc, big, u32(0))
      bigv = jnp.broadcast_to(bigv, mag.shape)

  if small is None:
    out = bigv
  elif bigv is None:
    out = small
  else:
    out = jnp.where(d <= 23, small, bigv)
  if lo <= 0:
    out = jnp.where(d <= 0, mag, out)
  return out


_SH13, _SH16 = np.uint32(13), np.uint32(16)
_FMIX_M1, _FMIX_M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def fmix32(h):
  """MurmurHash3 finaliser: a bijection on uint32 with full avalanche.

  ``h`` is a uint32 array. Written with ``lax`` ops: the same jaxpr as the ``jnp`` operators,
  about half the tracing time (it runs thousands of times in a hashed or cycle-walked
  program)."""
  h = lax.bitwise_xor(h, lax.shift_right_logical(h, _SH16))
  h = lax.mul(h, _FMIX_M1)
  h = lax.bitwise_xor(h, lax.shift_right_logical(h, _SH13))
  h = lax.mul(h, _FMIX_M2)
  return lax.bitwise_xor(h, lax.shift_right_logical(h, _SH16))


def hash_bits(k0, k1, index):
  """Counter-based random word for element ``index`` under key words (k0, k1).

  For a fixed key this is a bijection of the 32-bit index (no two elements of one array
  share a noise word). It depends only on (key, index), never on sharding or backend.

  References:
    Austin Appleby, MurmurHash3 (public domain) — the ``fmix32`` finaliser constants.
  """
  h = index * u32(0x9E3779B9) ^ k0
  h = fmix32(h)
  h = fmix32(h ^ k1)
  return h


def ldexp_bits(mag, s):
  """Bits of |x| * 2^s for finite float32 magnitude bits ``mag`` and int32 ``s``.

  Exact whenever the result is representable (no rounding is done: dropped bits of a
  subnormal result are truncated, so callers use it only where the result is on the
  float32 grid). Results beyond float32 give +inf's bits; zero stays zero.
  """
  s = jnp.asarray(s, I32)
  field = (mag >> 23).astype(I32)
  frac = mag & u32(FRAC_MASK)
  sig = jnp.where(field > 0, frac | u32(0x800000), frac)
  e = floor_log2(mag)
  new_e = e + s
  # For normal inputs the fraction is unchanged; for subnormal inputs normalise explicitly.
  top = top_bit(jnp.maximum(sig, u32(1)), max_bits=24)  # index of the top set bit
  norm_frac = jnp.where(top <= 23, sig << jnp.clip(23 - top, 0, 31).astype(U32),
                        sig >> jnp.clip(top - 23, 0, 31).astype(U32)) & u32(FRAC_MASK)
  normal = (((jnp.clip(new_e, -126, 128) + 127).astype(U32)) << 23) | norm_frac
  normal = jnp.where(new_e >= 128, u32(INF_BITS), normal)
  # Subnormal result: value = sig * 2^(e_lsb + s) with e_lsb = max(field,1) - 150.
  sh = jnp.maximum(field, 1) - 150 + s + 149
  sub = jnp.where(sh >= 0, sig << jnp.clip(sh, 0, 31).astype(U32),
                  sig >> jnp.clip(-sh, 0, 31).astype(U32))
  sub = jnp.where(sh <= -32, u32(0), sub)
  out = jnp.where(new_e >= -126, normal, sub)
  return jnp.where(mag == 0, u32(0), out)


def fma_guard(x):
  """``x`` (float32) unchanged, but opaque to FMA contraction with a following add.

  XORs the bit pattern with ``fmix32(b) == fmix32(b ^ 1)``, which is always 0 (fmix32 is a
  bijection) but which no compiler can prove to be 0. An ``optimization_barrier`` is not
  enough: XLA:CPU/LLVM still contract ``s + a*b`` into an FMA in small unrolled loops and in
  some fusions (measured).
  """
  b = to_bits(x)
  return from_bits(b ^ (fmix32(b) == fmix32(b ^ u32(1))).astype(U32))


def fence(tree, word):
  """``tree`` (integer and bool arrays) unchanged, but computed by XLA once, in a fusion of
  its own, instead of inside every consumer.

  XLA fuses cheap elementwise producers into their consumers, also across a broadcast and
  into several consumers at once: a per-block value (a block scale) read by every element of
  its block is then recomputed for each element, and a value read by several fusions is
  recomputed in each, which multiplies the run time and the size of the compiled program
  (measured: a transformer step with NVFP4 quantization compiled for minutes). XLA keeps an
  integer division by a divisor that is not a compile-time constant out of consumers that
  reuse its elements ("expensive"), so each array is divided by ``1 + (fmix32(w) ==
  fmix32(w ^ 1))``, with ``w`` a uint32 scalar from the data: always 1 (``fmix32`` is a
  bijection), which no compiler can prove. ``lax.optimization_barrier`` does not do this
  (XLA:CPU removes it before fusion). For the XLA path only; a Pallas kernel needs none.
  """
  w = jnp.asarray(word, U32).reshape(())
  one = u32(1) + (fmix32(w) == fmix32(w ^ u32(1))).astype(U32)

  def f(a):
    a = jnp.asarray(a)
    if a.dtype == jnp.bool_:
      return lax.div(a.astype(U32), one) != u32(0)
    return lax.div(a, one.astype(a.dtype))

  return tree_map(f, tree)
