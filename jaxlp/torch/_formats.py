"""Torch-side compatibility formats: QPyTorch's CPU fixed point, bit for bit."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxlp.formats import _bits as B

_f32 = B.f32_bits  # bits of float32(v): round to nearest even, as a C double->float cast


def _order_key(bits):
  """uint32 key whose unsigned order is the IEEE order of finite/inf floats (-0 == +0)."""
  sign = (bits & B.u32(B.SIGN_MASK)) != 0
  mag = bits & B.u32(B.ABS_MASK)
  key = jnp.where(sign, ~bits, bits | B.u32(B.SIGN_MASK))
  return jnp.where(mag == 0, B.u32(B.SIGN_MASK), key)


@dataclasses.dataclass(frozen=True)
class QPyTorchFixedPoint:
  """QPyTorch's CPU ``fixed_point_quantize(x, wl, fl, clamp, symmetric, rounding)``.

  ``jaxlp.FixedPoint`` is the clean format (exact round-half-to-even); this class reproduces
  what QPyTorch's CPU kernel actually computes, bit for bit, for ``rounding="nearest"``:

  * ``y = ldexp(x, fl)`` in float32 (overflow gives ±inf);
  * ``n = nearbyint(fl32(y + 0.5) - 0.5)``: the ``+ 0.5`` is a float32 addition that rounds,
    so ``n = floor(z)`` with ``z = fl32(y + 0.5)``, except that an odd integer ``z`` gives
    ``z - 1``; a zero result is ``-0.0`` iff ``z < 0.5``. Consequences: ``-0.0`` and tiny
    negatives give ``+0.0``; odd integers ``y`` in ``[2**23, 2**24)`` move up by one;
    ``y = 0.5 + 2**-24`` gives 0 (RNE would give 1);
  * ``q = ldexp(n, -fl)``; with ``clamp``, ``q`` is clamped to ``[t_min, t_max]`` where the
    bounds are float32(RNE) of ``-2**(wl-fl-1)`` and ``2**(wl-fl-1) - 2**-fl`` (so for
    ``wl > 25`` the top bound rounds up to ``2**(wl-fl-1)``), ``symmetric``: ``t_min``
    = float32(``t_min + 2**-fl``). NaN passes through.

  ``rounding="stochastic"`` is jaxlp's exact unbiased stochastic rounding onto the
  ``2**-fl`` grid (counter-based noise) followed by the same overflow and clamp rules;
  QPyTorch's ``nearbyint(y + u - 0.5)`` with a float32 ``u`` is the same distribution up to
  the float32 rounding of ``y + u``, but not the same draws.

  Args:
    wl: word length, the total number of bits including the sign (1..64).
    fl: number of fractional bits (-100..149); values are multiples of ``2**-fl``.
    clamp: clamp (saturate) to ``[t_min, t_max]`` after rounding; False lets values
      outside the range through unchanged apart from the rounding.
    symmetric: raise the lower bound by ``2**-fl`` (a range symmetric about zero).

  Raises:
    ValueError: ``wl`` is not an int in 1..64, ``fl`` is not an int in -100..149, or
      ``2**(wl-fl-1)`` exceeds the float32 range (``wl - fl - 1 > 127``).
    TypeError: ``clamp`` or ``symmetric`` is not a bool.

  Example:
    >>> import torch
    >>> from jaxlp.torch import QPyTorchFixedPoint, quantize
    >>> fmt = QPyTorchFixedPoint(wl=8, fl=4)
    >>> quantize(torch.tensor([0.1, 1.3, -2.7, 100.0]), fmt)
    tensor([ 0.1250,  1.3125, -2.6875,  7.9375])
    >>> fmt.supported_roundings
    ('nearest', 'stochastic')

  References:
    Tiiiger/QPyTorch@f58bba7, ``qtorch/quant/quant_cpu/quant_cpu.cpp``
    (``fixed_point_quantize_nearest``), ``sim_helper.cpp`` (``round``, ``fixed_min_max``).
  """

  wl: int
  fl: int
  clamp: bool = True
  symmetric: bool = False

  def __post_init__(self):
    if not isinstance(self.wl, int) or isinstance(self.wl, bool) or not 1 <= self.wl <= 64:
      raise ValueError(f"QPyTorchFixedPoint: wl must be an int in 1..64, got wl={self.wl!r}")
    if not isinstance(self.fl, int) or isinstance(self.fl, bool) or not -100 <= self.fl <= 149:
      raise ValueError(f"QPyTorchFixedPoint: fl must be an int in -100..149, got fl={self.fl!r}")
    if self.wl - self.fl - 1 > 127:
      raise ValueError(
          f"QPyTorchFixedPoint: range 2**(wl-fl-1) = 2**{self.wl - self.fl - 1} exceeds float32")
    for name in ("clamp", "symmetric"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"QPyTorchFixedPoint: {name} must be a bool, got {getattr(self, name)!r}")

  supported_roundings = ("nearest", "stochastic")

  @property
  def bounds_bits(self) -> tuple[int, int]:
    """float32 bits of (t_min, t_max) exactly as QPyTorch's ``fixed_min_max`` stores them."""
    t_min = -np.ldexp(1.0, self.wl - self.fl - 1)
    t_min32 = float(np.float32(t_min))
    t_max = -t_min32 - np.ldexp(1.0, -self.fl)
    if self.symmetric:
      t_min32 = t_min32 + np.ldexp(1.0, -self.fl)
    return _f32(t_min32), _f32(t_max)

  def quantize_with_mask(self, x, rounding, rand):
    """(q, mask): the quantized float32 array and where the clamp changed the value."""
    bits = B.to_bits(x)
    sign, mag, _ = B.split(bits)
    sbit = jnp.where(sign, B.u32(B.SIGN_MASK), B.u32(0))
    finite = B.is_finite_mag(mag)
    y_mag = B.ldexp_bits(jnp.where(finite, mag, B.u32(0)), self.fl)
    overflow = finite & (y_mag == B.u32(B.INF_BITS))
    if rounding == "nearest":
      y = B.from_bits(jnp.where(finite, y_mag | sbit, bits))
      z = y + jnp.float32(0.5)  # the float32 addition QPyTorch rounds in
      f = jnp.floor(z)
      odd = (z == f) & (jnp.fmod(f, jnp.float32(2.0)) != 0)
      n = jnp.where(odd, f - jnp.float32(1.0), f)
      n = jnp.where(n == 0, jnp.where(z < 0.5, jnp.float32(-0.0), jnp.float32(0.0)), n)
      nb = B.to_bits(n)
      nsign, nmag, _ = B.split(nb)
      nfin = B.is_finite_mag(nmag)
      nmag = jnp.where(nfin, nmag, B.u32(0))
      # ldexp(n, -fl) rounds to nearest even when the result is a float32 subnormal.
      r = B.round_to_quantum(nmag, self.fl - 149, "nearest", negative=nsign)
      qm = B.ldexp_bits(r, -self.fl)
      q = jnp.where(nfin, qm | jnp.where(nsign, B.u32(B.SIGN_MASK), B.u32(0)), nb)
    elif rounding == "stochastic":
      r = B.round_to_quantum(jnp.where(finite, mag, B.u32(0)), -self.fl, "stochastic",
                             negative=sign, rand=rand)
      q = jnp.where(finite, r | sbit, bits)
      q = jnp.where(overflow, B.u32(B.INF_BITS) | sbit, q)
    else:
      raise ValueError(f"QPyTorchFixedPoint: unsupported rounding={rounding!r}")
    if not self.clamp:
      return B.from_bits(q), jnp.zeros(q.shape, bool)
    lo, hi = self.bounds_bits
    lo, hi = B.u32(lo), B.u32(hi)
    notnan = ~B.is_nan_mag(q & B.u32(B.ABS_MASK))
    k = _order_key(q)
    gt = notnan & (k > _order_key(hi))
    lt = notnan & (k < _order_key(lo))
    out = jnp.where(gt, hi, jnp.where(lt, lo, q))
    return B.from_bits(out), gt | lt

  def _quantize_f32(self, x, rounding, rand, rand_bits):
    del rand_bits
    return self.quantize_with_mask(x, rounding, rand)[0]
