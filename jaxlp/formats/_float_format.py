"""`FloatFormat`: any sign/exponent/mantissa float up to exp 8 / man 23, exactly rounded."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxlp.formats import _bits as B

SPECIALS = ("ieee", "fn", "fnuz", "finite")
OVERFLOWS = ("inf", "nan", "saturate")


@dataclasses.dataclass(frozen=True)
class FloatFormat:
  """A binary floating-point format: sign + ``exp_bits`` exponent + ``man_bits`` fraction.

  Args:
    exp_bits: exponent field width, 1..8.
    man_bits: stored fraction bits (hidden bit not counted), 0..23.
    bias: exponent bias; default ``2**(exp_bits - 1) - 1``.
    specials: which codes are special.
      ``"ieee"``: the all-ones exponent field holds ±inf (fraction 0) and NaN (others).
      ``"fn"``: no infinities; only the all-ones code (exponent and fraction) is NaN.
      ``"fnuz"``: no infinities and no negative zero; the ``-0`` code is the only NaN.
      ``"finite"``: every code is a finite number (no inf, no NaN).
    overflow: what a finite value that rounds beyond ``max_normal`` becomes:
      ``"inf"`` (needs ``specials="ieee"``), ``"nan"`` (needs a NaN code) or ``"saturate"``
      (±``max_normal``). Default: ``"inf"`` for ieee, ``"nan"`` for fn/fnuz, ``"saturate"``
      for finite. Under directed roundings an IEEE format overflows to inf only in the
      rounding direction (IEEE 754 §7.4): ``toward_zero`` gives ±max, ``up`` gives -max for
      negative overflow, ``down`` gives +max for positive overflow.
    subnormals: whether codes with a zero exponent field are subnormal numbers. If False,
      the only representable values below ``min_normal`` are ±0, and rounding is to the
      nearest representable value (so values in (0, min_normal) go to 0 or ``min_normal``).
    name: optional display name (presets set it); not part of equality.

  Input infinities stay infinite if the format has infinities, else follow ``overflow``.
  NaN inputs give NaN (in the float container) for every format.

  Raises:
    ValueError: a field out of range (``exp_bits`` not in 1..8, ``man_bits`` not in 0..23,
      a non-int ``bias``, a non-bool ``subnormals``), an unknown ``specials``/``overflow``,
      an ``overflow`` the specials cannot express (``"inf"`` without ``"ieee"``, ``"nan"``
      with ``"finite"``), a format with no normal binade or no finite non-zero value, or a
      ``bias`` that puts the exponent range outside float32's.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> fmt = F.FloatFormat(4, 3, specials="fn")  # OCP E4M3 (= F.E4M3FN)
    >>> fmt.bits, fmt.max_normal, fmt.min_subnormal
    (8, 448.0, 0.001953125)
    >>> # 1.0625 and 1.1875 are ties (spacing 0.125): to even; 500 overflows to NaN
    >>> F.quantize(jnp.array([1.0625, 1.1875, 500.0, 0.003]), fmt)
    Array([1.       , 1.25     ,       nan, 0.00390625], dtype=float32)
    >>> F.quantize(jnp.array([500.0]), F.FloatFormat(4, 3, specials="fn", overflow="saturate"))
    Array([448.], dtype=float32)
  """

  exp_bits: int
  man_bits: int
  bias: int | None = None
  specials: str = "ieee"
  overflow: str | None = None
  subnormals: bool = True
  name: str | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    e, m = self.exp_bits, self.man_bits
    if not isinstance(e, int) or isinstance(e, bool) or not 1 <= e <= 8:
      raise ValueError(f"FloatFormat: exp_bits must be an int in 1..8, got exp_bits={e!r}")
    if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= 23:
      raise ValueError(f"FloatFormat: man_bits must be an int in 0..23, got man_bits={m!r}")
    if self.specials not in SPECIALS:
      raise ValueError(f"FloatFormat: specials must be one of {SPECIALS}, got {self.specials!r}")
    if self.bias is None:
      object.__setattr__(self, "bias", 2 ** (e - 1) - 1)
    elif not isinstance(self.bias, int) or isinstance(self.bias, bool):
      raise ValueError(f"FloatFormat: bias must be an int, got bias={self.bias!r}")
    if self.overflow is None:
      default = {"ieee": "inf", "fn": "nan", "fnuz": "nan", "finite": "saturate"}
      object.__setattr__(self, "overflow", default[self.specials])
    if self.overflow not in OVERFLOWS:
      raise ValueError(f"FloatFormat: overflow must be one of {OVERFLOWS}, got {self.overflow!r}")
    if self.overflow == "inf" and self.specials != "ieee":
      raise ValueError(
          f"FloatFormat: overflow='inf' needs specials='ieee' (a format with infinities), "
          f"got specials={self.specials!r}")
    if self.overflow == "nan" and self.specials == "finite":
      raise ValueError("FloatFormat: overflow='nan' needs a NaN code, but specials='finite'")
    if not isinstance(self.subnormals, bool):
      raise ValueError(f"FloatFormat: subnormals must be a bool, got {self.subnormals!r}")
    if self.specials == "ieee" and e == 1:
      raise ValueError(
          "FloatFormat: exp_bits=1 with specials='ieee' leaves no normal binade "
          "(the only non-zero exponent field is reserved for inf/NaN); use specials='finite'")
    if self.specials == "fn" and m == 0 and self.emax_field == 0:
      raise ValueError("FloatFormat: specials='fn' with exp_bits=1, man_bits=0 has no finite "
                       "non-zero value")
    if self.emin < -126:
      raise ValueError(
          f"FloatFormat: bias={self.bias} puts the smallest normal exponent ({self.emin}) below "
          "float32's (-126); jaxlp emulates formats inside float32")
    if self.emax > 127:
      raise ValueError(
          f"FloatFormat: bias={self.bias} with exp_bits={e} puts the largest exponent "
          f"({self.emax}) above float32's (127)")

  # -- structure -------------------------------------------------------------------------
  @property
  def bits(self) -> int:
    """Total storage bits (sign + exponent + fraction)."""
    return 1 + self.exp_bits + self.man_bits

  @property
  def has_inf(self) -> bool:
    return self.specials == "ieee"

  @property
  def has_nan(self) -> bool:
    return self.specials != "finite"

  @property
  def has_negative_zero(self) -> bool:
    return self.specials != "fnuz"

  @property
  def emax_field(self) -> int:
    """Largest exponent field that holds finite normal numbers."""
    top = 2**self.exp_bits - 1
    if self.specials == "ieee":
      return top - 1
    if self.specials == "fn" and self.man_bits == 0:
      return top - 1  # the all-ones code (the whole top binade) is NaN
    return top

  @property
  def emin(self) -> int:
    """Unbiased exponent of the smallest normal number."""
    return 1 - self.bias

  @property
  def emax(self) -> int:
    """Unbiased exponent of the largest finite number."""
    return self.emax_field - self.bias

  @property
  def max_man_code(self) -> int:
    """Largest fraction code in the top finite binade."""
    full = 2**self.man_bits - 1
    if self.specials == "fn" and self.man_bits > 0:
      return full - 1
    return full

  @property
  def max_normal(self) -> float:
    return (1 + self.max_man_code / 2**self.man_bits) * 2.0**self.emax

  @property
  def min_normal(self) -> float:
    return 2.0**self.emin

  @property
  def min_subnormal(self) -> float:
    """Smallest positive value (``min_normal`` when subnormals are off)."""
    if not self.subnormals:
      return self.min_normal
    return 2.0 ** (self.emin - self.man_bits)

  @property
  def eps(self) -> float:
    """Distance from 1 to the next larger value."""
    return 2.0**-self.man_bits

  def __repr__(self):
    if self.name:
      return f"jaxlp.formats.{self.name}"
    return (f"FloatFormat(exp_bits={self.exp_bits}, man_bits={self.man_bits}, bias={self.bias}, "
            f"specials={self.specials!r}, overflow={self.overflow!r}, "
            f"subnormals={self.subnormals})")

  # -- rounding ---------------------------------------------------------------------------
  supported_roundings = B.ROUNDINGS

  def _round_bits(self, bits, rounding, rand, rand_bits, *, scale_exp=None, saturate=False):
    """Round float32 bit patterns to this format; returns float32 bit patterns.

    ``scale_exp`` (int32, broadcastable) rounds to the format's grid scaled by
    ``2**scale_exp`` instead (MX elements times their shared scale), exactly; ``saturate``
    forces saturating overflow.
    """
    sign, mag, field = B.split(bits)
    m = self.man_bits
    if scale_exp is None:
      r = self._round_mag(mag, field, rounding, sign, rand, rand_bits)
    else:
      e = B.floor_log2(mag)
      emin = self.emin + scale_exp
      if self.subnormals:
        qe = jnp.maximum(e, emin) - m
      else:
        qe = jnp.where(e < emin, emin, e - m)
      r = B.round_to_quantum(mag, qe, rounding, negative=sign, rand=rand, rand_bits=rand_bits)

    max_bits = B.u32(B.f32_bits(self.max_normal))
    if scale_exp is not None:
      # max * 2**scale_exp beyond float32 (MX scales rounded up near FLT_MAX): the largest
      # value of the scaled grid that float32 holds is (2 - 2**-m) * 2**127
      top = B.f32_bits((2.0 - 2.0**-m) * 2.0**127)
      max_bits = jnp.minimum(B.ldexp_bits(max_bits, scale_exp), B.u32(top))
    finite = B.is_finite_mag(mag)
    over = r > max_bits
    rule = self._overflow_rule(rounding, saturate)
    if rule == "max":
      over_val = max_bits
    elif rule == "nan":
      over_val = B.u32(B.QNAN_BITS)
    elif rule == "inf_if_positive":
      over_val = jnp.where(sign, max_bits, B.u32(B.INF_BITS))
    elif rule == "inf_if_negative":
      over_val = jnp.where(sign, B.u32(B.INF_BITS), max_bits)
    else:
      over_val = B.u32(B.INF_BITS)
    out = jnp.where(over, over_val, r)

    # Non-finite inputs.
    is_inf = mag == B.u32(B.INF_BITS)
    inf_val = {"inf": B.u32(B.INF_BITS), "max": max_bits,
               "nan": B.u32(B.QNAN_BITS)}[self._inf_input_rule]
    out = jnp.where(finite, out, jnp.where(is_inf, inf_val, B.u32(B.QNAN_BITS)))
    is_nan_out = B.is_nan_mag(out)
    signed = out | jnp.where(sign & ~is_nan_out, B.u32(B.SIGN_MASK), B.u32(0))
    if not self.has_negative_zero:
      signed = jnp.where(out == 0, B.u32(0), signed)
    return signed

  def _overflow_rule(self, rounding: str, saturate: bool = False) -> str:
    """What a finite value that rounds beyond ``max_normal`` becomes: ``"max"``, ``"nan"``,
    ``"inf"``, or IEEE's directed-rounding exceptions ``"inf_if_positive"`` (``up``: ±max
    for negatives) and ``"inf_if_negative"`` (``down``). Shared with the torch bridge's
    Triton kernel (``jaxlp/torch/_triton.py``)."""
    if saturate or self.overflow == "saturate":
      return "max"
    if self.overflow == "nan":
      return "nan"
    return {"toward_zero": "max", "up": "inf_if_positive",
            "down": "inf_if_negative"}.get(rounding, "inf")

  @property
  def _inf_input_rule(self) -> str:
    """What an input infinity becomes: ``"inf"``, ``"max"`` (saturating) or ``"nan"``."""
    if self.has_inf:
      return "inf"
    return "max" if self.overflow == "saturate" else "nan"

  @property
  def _quantum_below_normal(self) -> int:
    """The quantum exponent below the normal range (subnormal spacing, or ``emin`` without
    subnormals): ``_round_mag``'s ``big`` is ``2**`` this."""
    return self.emin - self.man_bits if self.subnormals else self.emin

  def _round_mag(self, mag, field, rounding, sign, rand, rand_bits):
    """``round_to_quantum(mag, qe)`` with qe = this format's quantum, from the exponent field.

    Bit-identical to ``qe = max(floor_log2|x|, emin) - m`` (or the no-subnormal rule): the
    number of dropped significand bits is ``d = qe - (max(field, 1) - 150)``. For a normal
    input floor_log2 is ``field - 127``; a float32 subnormal input is below every format's
    ``emin`` (>= -126), so only ``emin`` matters there and ``clz`` is never needed. Below
    the format's normal range (the only place ``d >= 24`` can occur) qe is a constant.
    """
    m, emin = self.man_bits, self.emin
    f1 = jnp.maximum(field, 1)
    if self.subnormals:
      # qe = max(e, emin) - m  =>  d = max(23 - m, emin + 150 - m - f1)
      d = jnp.maximum(23 - m, (emin + 150 - m) - f1)
      d_range = (23 - m, max(23 - m, emin + 149 - m))
    else:
      # qe = emin if e < emin else e - m
      d = jnp.where(field < emin + 127, (emin + 150) - f1, 23 - m)
      d_range = (min(23 - m, 24), max(23 - m, emin + 149))
    big = B.u32(B.f32_bits(2.0**self._quantum_below_normal))  # qe wherever d > 23 - m
    return B.round_dropped_bits(mag, d, rounding, big=big, negative=sign, rand=rand,
                                rand_bits=rand_bits, d_range=d_range)
