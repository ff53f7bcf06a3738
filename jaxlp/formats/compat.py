"""Bit-compatible re-implementations of earlier tools' float casts (CPD, QPyTorch).

Each is a frozen, hashable format object usable wherever a jaxlp format is accepted
(``jaxlp.quantize(x, cpd_float(4, 3))``). Their quirks are reproduced on purpose; the
docstrings say which. Use :class:`jaxlp.FloatFormat` for clean IEEE-style semantics.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxlp.formats import _bits as B


def _check_em(cls, exp, man, man_min=0):
  if not isinstance(exp, int) or isinstance(exp, bool) or not 1 <= exp <= 8:
    raise ValueError(f"{cls}: exp must be an int in 1..8, got exp={exp!r}")
  if not isinstance(man, int) or isinstance(man, bool) or not man_min <= man <= 23:
    raise ValueError(f"{cls}: man must be an int in {man_min}..23, got man={man!r}")


@dataclasses.dataclass(frozen=True)
class CPDFloat:
  """CPD's ``float_quantize(x, exp, man)`` cast (drcut/CPD ``float_kernel_nearest``).

  Bias ``2**(exp-1)-1``; all-ones exponent field reserved; round-to-nearest-even. Quirks
  reproduced exactly (seeds-spec §1.1):

  * the overflow test happens BEFORE rounding: an input whose exponent is above the top
    binade gives ±inf, while a top-binade value that rounds up gives the finite value
    ``2**(bias+1)`` (for exp=8 that is float32 inf);
  * in the subnormal range the significand is first shifted right with truncation (no
    sticky bit), then rounded to nearest-even on the retained bits; for man=23 this
    degenerates to pure truncation;
  * float32 subnormal inputs give +0.0 (sign dropped), even for (8, 23);
  * ±0, ±inf and NaN pass through unchanged; negatives that round to zero give -0.0.

  Only ``rounding="nearest"`` exists (CPD has no stochastic rounding).

  References:
    drcut/CPD@ad66a44, ``CPDtorch/quant/quant_cuda/float_kernel.cu``.
  """

  exp_bits: int
  man_bits: int

  def __post_init__(self):
    _check_em("cpd_float", self.exp_bits, self.man_bits)

  supported_roundings = ("nearest",)

  @property
  def bias(self):
    return 2 ** (self.exp_bits - 1) - 1

  def _round_bits(self, bits, rounding, rand, rand_bits):
    del rounding, rand, rand_bits
    E, M = self.exp_bits, self.man_bits
    bias = self.bias
    sign, mag, field = B.split(bits)
    frac = mag & B.u32(B.FRAC_MASK)
    passthrough = (field == 255) | (mag == 0)
    fp32_sub = (field == 0) & (frac != 0)
    sig = frac | B.u32(0x800000)
    t = field - 127
    ne = t + bias
    overflow = ne >= 2**E - 1
    d = 23 - M

    def rne(s, drop):
      """Drop ``drop`` (static) low bits of integer s with round-to-nearest-even."""
      if drop == 0:
        return s
      half = B.u32(1 << (drop - 1))
      low = s & B.u32((1 << drop) - 1)
      kept = s >> drop
      up = (low > half) | ((low == half) & ((kept & B.u32(1)) == 1))
      return (kept + up.astype(B.U32)) << drop

    # Normal target: value = sig' * 2^(t-23); a carry gives 2^(t+1), still finite here.
    sig_n = rne(sig, d)
    carry = sig_n >> 24  # 0 or 1
    mant_n = jnp.where(carry == 1, B.u32(0), sig_n & B.u32(B.FRAC_MASK))
    exp_n = (field + carry.astype(B.I32)).astype(B.U32)
    normal_bits = jnp.where(exp_n >= 255, B.u32(B.INF_BITS), (exp_n << 23) | mant_n)

    # Subnormal target: truncating shift by k = 1 - ne, then RNE on the retained bits
    # (M = 23: the rounding constant is 1 << -1 == 0 on the GPU => pure truncation).
    k = jnp.clip(1 - ne, 0, 31).astype(B.U32)
    sig_t = jnp.where(1 - ne >= 32, B.u32(0), sig >> k)
    sig_s = sig_t if M == 23 else rne(sig_t, d)
    # value = sig_s * 2^(1-bias-23); build the float32 pattern exactly.
    sub_val_exp = 1 - bias - 23  # exponent of sig_s's LSB
    sub_bits = _int_times_pow2_bits(sig_s, sub_val_exp)

    mag_out = jnp.where(ne > 0, normal_bits, sub_bits)
    mag_out = jnp.where(overflow, B.u32(B.INF_BITS), mag_out)
    out = mag_out | jnp.where(sign, B.u32(B.SIGN_MASK), B.u32(0))
    out = jnp.where(fp32_sub, B.u32(0), out)
    return jnp.where(passthrough, bits, out)


def _int_times_pow2_bits(n, e: int):
  """Float32 bits of n * 2^e for uint32 n < 2^25 and static e, when the value is exact."""
  nf = n.astype(jnp.float32)  # exact: n < 2^24 (+ carry 2^24), no subnormals involved
  nb = B.to_bits(nf)
  # Multiply by 2^e by moving the exponent; the results here are normal float32 numbers or
  # exact subnormals, which we build with integer shifts to dodge flush-to-zero.
  fl = B.floor_log2(nb)  # floor(log2 n) (n > 0)
  res_e = fl + e
  # Normal result.
  normal = nb + (jnp.asarray(e, B.I32) << 23).astype(B.U32)
  # Subnormal result: n * 2^e = n * 2^(e+149) * 2^-149 -> bits = n << (e + 149) (e+149 >= 0)
  # or n >> -(e+149) (exact only when those bits are zero, which holds for CPD's grid).
  sh = e + 149
  if sh >= 0:
    sub = n << B.u32(min(sh, 31))
  else:
    sub = n >> B.u32(min(-sh, 31))
  out = jnp.where(res_e >= -126, normal, sub)
  return jnp.where(n == 0, B.u32(0), out)


@dataclasses.dataclass(frozen=True)
class QPyTorchFloat:
  """QPyTorch's ``float_quantize(x, exp, man, rounding)`` (CPU/CUDA kernels' bit logic).

  Normal exponents run from ``2 - 2**(exp-1)`` to ``2**(exp-1)`` (the all-ones field is an
  ordinary binade: no inf/NaN codes), subnormals via an FP32 add of ``2**min_exp``,
  saturating overflow for exp < 8. ``rounding="nearest"`` is round half AWAY from zero
  (QPyTorch's bit trick); ``"stochastic"`` adds random low bits then truncates (unbiased;
  the noise comes from jaxlp's counter-based hash, so the draws differ from QPyTorch's RNG
  while the distribution is the same). Quirks kept: NaN/inf -> ±max for exp < 8; for
  exp = 8 overflow gives ±inf and a NaN with man = 0 becomes -0.0; -0.0 -> +0.0.
  man = 23 is the identity (QPyTorch's intended semantics; its x86 CPU build flips the
  sign there, which is undefined behaviour and not reproduced).

  References:
    Tiiiger/QPyTorch@f58bba7, ``qtorch/quant/quant_cpu/quant_cpu.cpp``, ``bit_helper.cpp``.
  """

  exp_bits: int
  man_bits: int

  def __post_init__(self):
    _check_em("qpytorch_float", self.exp_bits, self.man_bits)

  supported_roundings = ("nearest", "stochastic")

  def _round_bits(self, bits, rounding, rand, rand_bits):
    E, M = self.exp_bits, self.man_bits
    if M == 23:
      return bits
    min_exp = 2 - 2 ** (E - 1)
    max_exp = 2 ** (E - 1)
    drop = 23 - M
    mask = B.u32((1 << drop) - 1)
    keep = B.u32(0xFFFFFFFF ^ ((1 << drop) - 1))  # literals: no op on constants in kernels

    def round_pattern(b):
      if rounding == "nearest":
        add = B.u32(1 << (drop - 1))
      else:
        r = rand if rand_bits is None else rand & B.u32(0xFFFFFFFF ^ ((1 << (32 - rand_bits)) - 1))
        add = (r >> B.u32(32 - drop)) & mask
      return (b + add) & keep

    sign, mag, field = B.split(bits)
    t = field - 127
    # Normal branch.
    qn = round_pattern(bits)
    qfield = ((qn >> 23) & B.u32(0xFF)).astype(B.I32)
    max_val = (2.0 - 2.0**-M) * 2.0**max_exp
    sat = B.u32(B.f32_bits(max_val)) | (bits & B.u32(B.SIGN_MASK))
    qn = jnp.where((qn != 0) & (qfield > 127 + max_exp), sat, qn)

    # Subnormal branch: v = fl32(x + s); round v; q = fl32(v' - s), s = copysign(2^min_exp).
    s_mag = B.u32(B.f32_bits(2.0**min_exp))
    s_bits = s_mag | (bits & B.u32(B.SIGN_MASK))
    if E == 8:
      # |x| < 2^-126 = s: same-sign add/sub of these patterns is exact integer arithmetic
      # (avoids the flush-to-zero of float32 subnormals on CPU).
      v = (s_mag + (mag & B.u32(B.FRAC_MASK))) | (bits & B.u32(B.SIGN_MASK))
      vq = round_pattern(v)
      diff = (vq & B.u32(B.ABS_MASK)) - s_mag
      qs = diff | (bits & B.u32(B.SIGN_MASK))
      qs = jnp.where(diff == 0, B.u32(0), qs)  # x - x = +0 in round-to-nearest
    else:
      xf = B.from_bits(bits)
      sf = B.from_bits(s_bits)
      v = B.to_bits(xf + sf)
      vq = round_pattern(v)
      qs = B.to_bits(B.from_bits(vq) - sf)
    return jnp.where(t < min_exp, qs, qn)


def cpd_float(exp: int, man: int) -> CPDFloat:
  """CPD's customized-precision float cast ``Q_{exp,man}`` (see :class:`CPDFloat`)."""
  return CPDFloat(exp, man)


def qpytorch_float(exp: int, man: int) -> QPyTorchFloat:
  """QPyTorch's ``float_quantize`` format (see :class:`QPyTorchFloat`)."""
  return QPyTorchFloat(exp, man)
