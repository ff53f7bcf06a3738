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
  reproduced exactly (drcut/CPD ``CPDtorch/quant/quant_function.py``):

  * the overflow test happens BEFORE rounding: an input whose exponent is above the top
    binade gives ±inf, while a top-binade value that rounds up gives the finite value
    ``2**(bias+1)`` (for exp=8 that is float32 inf);
  * in the subnormal range the significand is first shifted right with truncation (no
    sticky bit), then rounded to nearest-even on the retained bits; for man=23 this
    degenerates to pure truncation;
  * float32 subnormal inputs give +0.0 (sign dropped), even for (8, 23);
  * ±0, ±inf and NaN pass through unchanged; negatives that round to zero give -0.0.

  Only ``rounding="nearest"`` exists (CPD has no stochastic rounding).

  Raises:
    ValueError: ``exp_bits`` not an int in 1..8 or ``man_bits`` not an int in 0..23.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # (5, 2) has E5M2's grid (max 57344): 1.125 is a tie and goes to even (1.0); 61440
    >>> # rounds up out of the top binade to the finite 2**16 (E5M2 gives inf)
    >>> F.quantize(jnp.array([1.125, 61440.0, 1e6]), F.CPDFloat(5, 2))
    Array([1.0000e+00, 6.5536e+04,        inf], dtype=float32)
    >>> F.quantize(jnp.array([1.125, 61440.0, 1e6]), F.E5M2)
    Array([ 1., inf, inf], dtype=float32)

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
    """CPD's cast as one exact rounding of the fp32 pattern (few integer ops per element).

    With ``k = max(1 - ne, 0)`` (``ne`` = the target's biased exponent), CPD's truncating
    shift ``sig >> k`` followed by round-to-nearest-even of ``d0 = 23 - M`` retained bits is
    the same as clearing the ``k`` low bits of the pattern and rounding off ``d0 + k`` bits to
    nearest even: the tie is decided by the retained bits alone. The quantum is then
    ``2**(t - 23 + d0)`` for normal targets and the constant ``2**(1 - bias - M)`` for
    subnormal ones.
    """
    del rounding, rand, rand_bits
    E, M, bias = self.exp_bits, self.man_bits, self.bias
    sign, mag, field = B.split(bits)
    d0 = 23 - M
    ne = field - (127 - bias)
    k = jnp.maximum(1 - ne, 0)  # bits shifted out (truncated) for a subnormal target
    keep = ~((B.u32(1) << jnp.minimum(k, 31).astype(B.U32)) - B.u32(1))
    mag_t = jnp.where(k >= 24, B.u32(0), mag & keep)
    big = B.u32(B.f32_bits(2.0 ** (1 - bias - M)))  # the subnormal quantum (used for d >= 24)
    r = B.round_dropped_bits(mag_t, d0 + k, "nearest", big=big, d_range=(d0, None))
    # A carry out of the top binade gives 2**(bias + 1) (finite; inf bits for E = 8).
    r = jnp.where(ne >= 2**E - 1, B.u32(B.INF_BITS), r)  # overflow tested BEFORE rounding
    out = r | jnp.where(sign, B.u32(B.SIGN_MASK), B.u32(0))
    out = jnp.where(field == 0, B.u32(0), out)  # fp32 subnormal inputs give +0 (sign dropped)
    return jnp.where((field == 255) | (mag == 0), bits, out)


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
  man = 23 drops no fraction bit, so only the exponent range acts, as for every other man:
  overflow saturates to ``(2 - 2**-23) * 2**(2**(exp-1))``, values below ``2**min_exp``
  go to the subnormal grid ``2**(min_exp-23)`` (the rebase add rounds to nearest even);
  (8, 23) is float32 itself and returns the input unchanged. (QPyTorch's man = 23 is
  undefined behaviour, ``1 << -1``: its x86 CPU build flips the sign; not reproduced.)

  Raises:
    ValueError: ``exp_bits`` not an int in 1..8 or ``man_bits`` not an int in 0..23.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # ties go AWAY from zero (1.125 -> 1.25; FloatFormat's ties-to-even gives 1.0); the
    >>> # all-ones exponent is an ordinary binade, so the max is 114688 and 1e6 saturates
    >>> F.quantize(jnp.array([1.125, -1.125, 1e6]), F.QPyTorchFloat(5, 2))
    Array([ 1.25000e+00, -1.25000e+00,  1.14688e+05], dtype=float32)
    >>> # man = 23 keeps every fraction bit but still has exp = 5's range: 1e6 saturates
    >>> F.quantize(jnp.array([1.1, 1e6]), F.QPyTorchFloat(5, 23))
    Array([1.1000000e+00, 1.3107199e+05], dtype=float32)

  References:
    Tiiiger/QPyTorch@f58bba7, ``qtorch/quant/quant_cpu/quant_cpu.cpp``, ``bit_helper.cpp``.
  """

  exp_bits: int
  man_bits: int

  def __post_init__(self):
    _check_em("qpytorch_float", self.exp_bits, self.man_bits)

  supported_roundings = ("nearest", "stochastic")

  @property
  def _saturation_bits(self) -> int:
    """Bits of the largest value, ``(2 - 2**-man) * 2**(2**(exp-1))`` (+inf's for exp = 8)."""
    return B.f32_bits((2.0 - 2.0**-self.man_bits) * 2.0 ** (2 ** (self.exp_bits - 1)))

  @property
  def _rebase_bits(self) -> int:
    """Bits of ``2**min_exp``, the subnormal branch's rebase constant."""
    return B.f32_bits(2.0 ** (2 - 2 ** (self.exp_bits - 1)))

  def _round_bits(self, bits, rounding, rand, rand_bits):
    E, M = self.exp_bits, self.man_bits
    if (E, M) == (8, 23):
      return bits  # float32 itself
    min_exp = 2 - 2 ** (E - 1)
    max_exp = 2 ** (E - 1)
    drop = 23 - M
    mask = B.u32((1 << drop) - 1)
    keep = B.high_mask(drop)

    def round_pattern(b):
      if drop == 0:  # man = 23: no fraction bit is dropped (only the exponent range acts)
        return b
      if rounding == "nearest":
        add = B.u32(1 << (drop - 1))
      else:
        r = rand if rand_bits is None else rand & B.high_mask(32 - rand_bits)
        add = (r >> B.u32(32 - drop)) & mask
      return (b + add) & keep

    sign, mag, field = B.split(bits)
    t = field - 127
    # Normal branch.
    qn = round_pattern(bits)
    qfield = ((qn >> 23) & B.u32(0xFF)).astype(B.I32)
    sat = B.u32(self._saturation_bits) | (bits & B.u32(B.SIGN_MASK))
    qn = jnp.where((qn != 0) & (qfield > 127 + max_exp), sat, qn)

    # Subnormal branch: v = fl32(x + s); round v; q = fl32(v' - s), s = copysign(2^min_exp).
    s_mag = B.u32(self._rebase_bits)
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
  """CPD's customized-precision float cast ``Q_{exp,man}`` (see :class:`CPDFloat`).

  Args:
    exp: exponent bits, 1..8.
    man: fraction bits, 0..23.

  Returns:
    The :class:`CPDFloat` format.

  Raises:
    ValueError: ``exp`` or ``man`` is not an int in its range.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # a float32 subnormal input gives +0.0 (sign dropped); -1e-9 rounds to -0.0
    >>> F.quantize(jnp.array([-1e-40, -1e-9, 3.0]), F.cpd_float(4, 3))
    Array([ 0., -0.,  3.], dtype=float32)
  """
  return CPDFloat(exp, man)


def qpytorch_float(exp: int, man: int) -> QPyTorchFloat:
  """QPyTorch's ``float_quantize`` format (see :class:`QPyTorchFloat`).

  Args:
    exp: exponent bits, 1..8.
    man: fraction bits, 0..23.

  Returns:
    The :class:`QPyTorchFloat` format.

  Raises:
    ValueError: ``exp`` or ``man`` is not an int in its range.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> # no inf/NaN codes for exp < 8: inf and NaN saturate to the max (-0.0 gives +0.0)
    >>> F.quantize(jnp.array([jnp.inf, jnp.nan, -0.0]), F.qpytorch_float(4, 3))
    Array([480., 480.,   0.], dtype=float32)
  """
  return QPyTorchFloat(exp, man)
