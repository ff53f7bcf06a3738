"""numpy references for two-level block formats (NVFP4) and MX scale rules.

The NVFP4 reference runs the float32 operations of the definition one numpy float32
operation at a time (numpy keeps float32 subnormals; IEEE rounding), with ml_dtypes casts
for the E4M3FN scale and the E2M1 elements: nothing from jaxlp. The MX scale exponents are
computed with exact rationals (``fractions.Fraction``) from the rules' definitions.
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np

F32 = np.float32
ELEM_DTYPES = {"E2M1FN": ml_dtypes.float4_e2m1fn, "E2M3FN": ml_dtypes.float6_e2m3fn,
               "E3M2FN": ml_dtypes.float6_e3m2fn, "E4M3FN": ml_dtypes.float8_e4m3fn,
               "E5M2": ml_dtypes.float8_e5m2}


def _cast(v, dt):
  """Round-to-nearest-even cast of float32 values to an ml_dtypes type, back to float32."""
  return np.asarray(v, F32).astype(dt).astype(F32)


def blocks_1d(x, axis, bs):
  """(blocked view (..., nb, bs) zero-padded, inverse function)."""
  xm = np.moveaxis(x, axis, -1)
  n = xm.shape[-1]
  nb = -(-n // bs)
  p = np.zeros(xm.shape[:-1] + (nb * bs,), xm.dtype)
  p[..., :n] = xm
  b = p.reshape(xm.shape[:-1] + (nb, bs))

  def back(v):
    return np.moveaxis(v.reshape(xm.shape[:-1] + (nb * bs,))[..., :n], -1, axis)

  return b, back


def blocks_2d(x, tr, tc):
  """Tiles of the last two axes (a 1-D array is one row): ((L, nr, nc, tr * tc), inverse)."""
  shape = x.shape
  v = x.reshape((1, 1) + shape) if x.ndim == 1 else x.reshape((-1,) + shape[-2:])
  ell, r, c = v.shape
  nr, nc = -(-r // tr), -(-c // tc)
  p = np.zeros((ell, nr * tr, nc * tc), x.dtype)
  p[:, :r, :c] = v
  b = p.reshape(ell, nr, tr, nc, tc).transpose(0, 1, 3, 2, 4).reshape(ell, nr, nc, tr * tc)

  def back(w):
    w = w.reshape(ell, nr, nc, tr, tc).transpose(0, 1, 3, 2, 4).reshape(ell, nr * tr, nc * tc)
    return w[:, :r, :c].reshape(shape)

  return b, back


def scaled_block_reference(x, *, elem="E2M1FN", elem_max=6.0, block_size=16, axis=-1,
                           tile=None, scale_fmt="ue4m3", tensor_scale=True):
  """(quantized x, elements, block scales (blocked layout), g) by the five steps.

  1. g = max(fl(amax / (E * 448)), 2**-121) (or 1); 2. s = fl(fl(amax_b / E) / g);
  3. sb = E4M3FN(clamp(s, 2**-6, 448)) | 2**ceil(log2 s) | clamp(s, 2**-126, FLT_MAX);
  4. q = elem(clamp(fl(x * fl(fl(1 / g) / sb)), -E, E)); 5. fl(q * fl(g * sb)), saturating
  at FLT_MAX.
  A tensor (two-level) or block (one-level) holding inf or NaN gives NaN.
  """
  x = np.asarray(x, F32)
  dt = ELEM_DTYPES[elem]
  E = F32(elem_max)
  with np.errstate(all="ignore"):
    amax = np.abs(x).max(initial=F32(0)) if x.size else F32(0)
    if tensor_scale:
      g = np.maximum(F32(amax) / F32(elem_max * 448.0), F32(2.0**-121))
    else:
      g = F32(1.0)
    xs = x.reshape(1) if x.ndim == 0 else x
    b, back = blocks_2d(xs, *tile) if tile is not None else blocks_1d(xs, axis, block_size)
    amax_b = np.abs(b).max(axis=-1, keepdims=True)
    bs = amax_b / E
    s = bs / g if tensor_scale else bs
    if scale_fmt == "ue4m3":
      sb = _cast(np.clip(s, F32(2.0**-6), F32(448.0)), ml_dtypes.float8_e4m3fn)
    elif scale_fmt == "e8m0":
      e = np.array([_ceil_log2(v) for v in s.ravel()], np.int64).reshape(s.shape)
      sb = np.ldexp(F32(1.0), np.clip(e, -127, 127)).astype(F32)
    else:
      sb = np.clip(s, F32(2.0**-126), F32(np.finfo(F32).max))
    r = (F32(1.0) / g) / sb
    y = np.clip(b * r, -E, E)
    q = _cast(y, dt)
    out = q * (g * sb)
    fmax = F32(np.finfo(F32).max)
    out = np.clip(out, -fmax, fmax)  # step 5 saturates at FLT_MAX
    bad = ~np.isfinite(amax_b) | (not np.isfinite(amax) if tensor_scale else False)
    out = np.where(bad, F32(np.nan), out)
    q = np.where(bad, F32(np.nan), q)
    g = F32(np.nan) if tensor_scale and not np.isfinite(amax) else F32(g)
  res = back(out).reshape(x.shape)
  return res.astype(F32), back(q).reshape(x.shape).astype(F32), sb[..., 0], g


def _ceil_log2(v) -> int:
  """ceil(log2 v) of a float32 value, exactly (v == 0 gives -1000)."""
  v = float(v)
  if v == 0:
    return -1000
  m, e = math.frexp(v)  # v = m * 2**e, 0.5 <= m < 1
  return e - 1 if m == 0.5 else e


def _floor_log2(q: Fraction) -> int:
  e = q.numerator.bit_length() - q.denominator.bit_length()
  while Fraction(2) ** e > q:
    e -= 1
  while Fraction(2) ** (e + 1) <= q:
    e += 1
  return e


def mx_scale_exponent(amax: float, rule: str, emax: int, man_bits: int, max_normal: float):
  """The MX scale exponent of ``rule`` (clamped to [-127, 127]) from exact rationals."""
  a = Fraction(float(np.float32(amax)))
  if a == 0:
    return -127
  if rule == "floor":
    e = _floor_log2(a) - emax
  elif rule == "ceil":
    fl = _floor_log2(a)
    e = (fl if a == Fraction(2) ** fl else fl + 1) - emax
  elif rule == "even":
    fl = _floor_log2(a)
    step = Fraction(2) ** (fl - man_bits)  # amax's significand rounded to man_bits bits
    k = a / step
    rounded = (math.floor(k) + (1 if k - math.floor(k) >= Fraction(1, 2) else 0)) * step
    e = _floor_log2(rounded) - emax
  elif rule == "rceil":
    q = a / Fraction(max_normal)
    fl = _floor_log2(q)
    e = fl if q == Fraction(2) ** fl else fl + 1
  else:
    raise ValueError(rule)
  return max(-127, min(127, e))
