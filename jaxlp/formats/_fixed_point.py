"""`FixedPoint`: two's-complement fixed point emulated on float32."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxlp.formats import _bits as B


@dataclasses.dataclass(frozen=True)
class FixedPoint:
  """Signed fixed point with ``wl`` total bits, ``fl`` of them fractional.

  Values are multiples of ``2**-fl``. With ``clamp=True`` results are clamped (after
  rounding) to ``[-2**(wl-fl-1), 2**(wl-fl-1) - 2**-fl]`` (``symmetric=True``: the lower
  bound is ``-upper``), as QPyTorch's ``fixed_point_quantize`` does. ``"nearest"`` is
  round-half-to-even (QPyTorch's CPU build; its CUDA build rounds half away from zero, which
  is ``rounding="nearest_away"`` here). NaN stays NaN; ±inf clamps to the range (or stays
  inf when ``clamp=False``).

  Known differences from QPyTorch's CPU build (tests/formats/test_qtorch_parity.py): its
  ``nearbyint((y + 0.5) - 0.5)`` double-rounds in float32 at ``y = x * 2**fl = 0.5 + 2**-24``
  (gives 0; exact RNE gives 1) and at odd integers ``2**23 < |y| < 2**24``; and for
  ``wl - fl - 1 > 24`` its float32 clamp bound rounds up to ``2**(wl-fl-1)`` (outside the
  format) where jaxlp clamps to the largest float32 below the true bound.

  Raises:
    ValueError: ``wl`` not an int in 1..32, ``fl`` not an int in -100..149, or a range
      ``2**(wl-fl-1)`` beyond float32.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> fmt = F.FixedPoint(wl=4, fl=2)  # steps of 0.25 in [-2, 1.75]
    >>> fmt.min_value, fmt.max_value
    (-2.0, 1.75)
    >>> # 0.375 and 0.625 are ties: both go to the even multiple 0.5; 5 and -3 clamp
    >>> F.quantize(jnp.array([0.375, 0.625, 5.0, -3.0]), fmt)
    Array([ 0.5 ,  0.5 ,  1.75, -2.  ], dtype=float32)

  References:
    Tiiiger/QPyTorch@f58bba7, ``qtorch/quant/quant_cpu/quant_cpu.cpp`` (fixed point).
  """

  wl: int
  fl: int
  clamp: bool = True
  symmetric: bool = False

  def __post_init__(self):
    if not isinstance(self.wl, int) or isinstance(self.wl, bool) or not 1 <= self.wl <= 32:
      raise ValueError(f"FixedPoint: wl must be an int in 1..32, got wl={self.wl!r}")
    if not isinstance(self.fl, int) or isinstance(self.fl, bool):
      raise ValueError(f"FixedPoint: fl must be an int, got fl={self.fl!r}")
    if not -100 <= self.fl <= 149:
      raise ValueError(
          f"FixedPoint: fl must be in -100..149 (2**-fl inside float32), got fl={self.fl}")
    if self.wl - self.fl - 1 > 127:
      raise ValueError(
          f"FixedPoint: range 2**(wl-fl-1) = 2**{self.wl - self.fl - 1} exceeds float32")

  supported_roundings = B.ROUNDINGS

  @property
  def max_value(self) -> float:
    return 2.0 ** (self.wl - self.fl - 1) - 2.0**-self.fl

  @property
  def min_value(self) -> float:
    return -self.max_value if self.symmetric else -(2.0 ** (self.wl - self.fl - 1))

  @property
  def _clamp_bits(self) -> tuple[int, int]:
    """Bits of the clamp bounds (max, min), rounded toward zero into float32 (exact whenever
    wl <= 25)."""
    return (_f32_toward_zero_bits(self.max_value),
            _f32_toward_zero_bits(-self.min_value) | B.SIGN_MASK)

  def _round_bits(self, bits, rounding, rand, rand_bits):
    sign, mag, _ = B.split(bits)
    finite = B.is_finite_mag(mag)
    r = B.round_to_quantum(mag, -self.fl, rounding, negative=sign, rand=rand,
                           rand_bits=rand_bits)
    out = r | jnp.where(sign, B.u32(B.SIGN_MASK), B.u32(0))
    out = jnp.where(finite, out, bits)
    if self.clamp:
      # The bounds rounded toward zero into float32 (exact whenever wl <= 25).
      hi, lo = (B.u32(b) for b in self._clamp_bits)
      omag = out & B.u32(B.ABS_MASK)
      nan = B.is_nan_mag(omag)
      neg = (out & B.u32(B.SIGN_MASK)) != 0
      out = jnp.where(~nan & ~neg & (omag > hi), hi, out)
      out = jnp.where(~nan & neg & (omag > (lo & B.u32(B.ABS_MASK))), lo, out)
    return out


def _f32_toward_zero_bits(v: float) -> int:
  """Bits of the largest-magnitude float32 not exceeding |v| (v >= 0)."""
  f = np.float32(v)
  if float(f) > v:
    f = np.nextafter(f, np.float32(0))
  return int(np.asarray(f).view(np.uint32))
