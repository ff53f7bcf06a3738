"""Independent numpy references for jaxlp.formats tests.

Nothing here uses jaxlp's bit tricks: formats are decoded code by code from their definition,
and rounding is done by search over the enumerated representable values in float64 (exact,
since every value involved is a dyadic rational with a short significand).
"""

from __future__ import annotations

import numpy as np

MODES = ("nearest", "nearest_away", "toward_zero", "up", "down")


def f32(v):
  return np.asarray(v, np.float32)


def bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def same_bits(a, b):
  """Bitwise equality with every NaN counted equal to every NaN (payloads ignored)."""
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  na, nb = np.isnan(a), np.isnan(b)
  return (na & nb) | (~na & ~nb & (a.view(np.uint32) == b.view(np.uint32)))


def assert_same_bits(got, want, inputs=None, msg=""):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  ok = same_bits(got, want)
  if not ok.all():
    idx = np.flatnonzero(~ok.ravel())[:10]
    lines = []
    for i in idx:
      xin = "" if inputs is None else f"x={np.asarray(inputs, np.float32).ravel()[i]!r} "
      lines.append(f"{xin}got={got.ravel()[i]!r} want={want.ravel()[i]!r}")
    raise AssertionError(f"{msg}: {(~ok).sum()} mismatches of {ok.size}:\n" + "\n".join(lines))


def decode_codes(e, m, bias, specials, subnormals=True):
  """float64 value of every code (NaN for NaN codes) of a sign/e/m format, by definition."""
  n = 1 << (1 + e + m)
  c = np.arange(n, dtype=np.int64)
  sign = (c >> (e + m)) & 1
  field = (c >> m) & ((1 << e) - 1)
  frac = c & ((1 << m) - 1)
  top = (1 << e) - 1
  mag = np.where(field == 0,
                 (frac if subnormals else 0) * 2.0 ** (1 - bias - m),
                 (1.0 + frac / 2.0**m) * 2.0 ** (field.astype(np.float64) - bias))
  val = np.where(sign == 1, -mag, mag)
  if specials == "ieee":
    val = np.where((field == top) & (frac == 0), np.where(sign == 1, -np.inf, np.inf), val)
    val = np.where((field == top) & (frac != 0), np.nan, val)
  elif specials == "fn":
    val = np.where((field == top) & (frac == (1 << m) - 1), np.nan, val)
  elif specials == "fnuz":
    val = np.where((sign == 1) & (field == 0) & (frac == 0), np.nan, val)
  return val


class RefFormat:
  """Reference model of a FloatFormat-like grid: sorted finite magnitudes + overflow policy."""

  def __init__(self, e, m, bias, specials, overflow, subnormals=True):
    self.e, self.m, self.bias, self.specials = e, m, bias, specials
    self.overflow, self.subnormals = overflow, subnormals
    vals = decode_codes(e, m, bias, specials, subnormals)
    self.codes = vals
    fin = vals[np.isfinite(vals)]
    pos = np.unique(np.abs(fin))
    self.max = pos[-1]
    # grid spacing at the top: max is in binade floor(log2 max), spacing 2^(that - m)
    top_q = 2.0 ** (np.floor(np.log2(self.max)) - m)
    self.top_q = top_q
    self.grid = np.concatenate([pos, [self.max + top_q]])  # includes 0 and one point past max
    self.has_inf = specials == "ieee"
    self.has_nan = specials != "finite"
    self.neg_zero = specials != "fnuz"

  @property
  def values(self):
    """All finite representable values (float64, with -0.0 where it exists)."""
    fin = self.codes[np.isfinite(self.codes)]
    if not self.neg_zero:
      fin = np.where(fin == 0, 0.0, fin)
    return np.unique(fin)

  def round(self, x, mode):
    """Reference rounding of float32 array x -> float32 array."""
    x = np.asarray(x, np.float32)
    xd = x.astype(np.float64)
    neg = np.signbit(x)
    a = np.abs(xd)
    g = self.grid
    a_c = np.minimum(a, g[-1])  # beyond max + q every mode overflows or gives max
    i = np.clip(np.searchsorted(g, a_c, side="right") - 1, 0, len(g) - 2)
    lo = g[i]
    hi = g[i + 1]
    exact = a_c == lo
    # magnitude direction: "away" = away from zero
    if mode == "nearest":
      q = hi - lo
      lo_even = np.mod(lo / q, 2) == 0
      mid = (lo + hi) / 2
      r = np.where(a_c < mid, lo, np.where(a_c > mid, hi, np.where(lo_even, lo, hi)))
    elif mode == "nearest_away":
      mid = (lo + hi) / 2
      r = np.where(a_c < mid, lo, hi)
    elif mode == "toward_zero":
      r = lo
    elif mode in ("up", "down"):
      away = (~neg) if mode == "up" else neg
      r = np.where(away, hi, lo)
    else:
      raise ValueError(mode)
    r = np.where(exact, lo, r)
    # a >= max + q: the unbounded-exponent rounding is >= max + q in every mode -> overflow
    over = (r > self.max) | (a >= g[-1])
    mx = self.max
    if self.overflow == "saturate":
      ov = np.full_like(a, mx)
    elif self.overflow == "nan":
      ov = np.full_like(a, np.nan)
    else:
      if mode == "toward_zero":
        ov = np.full_like(a, mx)
      elif mode == "up":
        ov = np.where(neg, mx, np.inf)
      elif mode == "down":
        ov = np.where(neg, np.inf, mx)
      else:
        ov = np.full_like(a, np.inf)
    r = np.where(over, ov, r)
    # specials
    isinf = np.isinf(xd)
    if self.has_inf:
      inf_v = np.inf
    elif self.overflow == "saturate":
      inf_v = mx
    else:
      inf_v = np.nan
    r = np.where(isinf, inf_v, r)
    r = np.where(np.isnan(xd), np.nan, r)
    out = np.where(neg, -r, r)
    if not self.neg_zero:
      out = np.where(out == 0, 0.0, out)
    return out.astype(np.float32)


def ref_of(fmt):
  return RefFormat(fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.specials, fmt.overflow,
                   fmt.subnormals)


def probe_points(ref: RefFormat):
  """float32 inputs probing every code: codes, midpoints, +-1 ulp of both, overflow, specials."""
  g = ref.grid
  mids = (g[:-1] + g[1:]) / 2
  base = np.concatenate([g, mids, [2 * ref.max, 4 * ref.max, 1e30, 3.4e38]])
  base = base[base < 3.4e38]
  base = base.astype(np.float32)[base.astype(np.float32).astype(np.float64) == base]
  up = np.nextafter(base, np.float32(np.inf))
  dn = np.nextafter(base, np.float32(-np.inf))
  pts = np.concatenate([base, up, dn, f32([0.0, 1e-45, 1.1754942e-38, 1.17549435e-38,
                                            np.inf, np.nan, 3.4028235e38])])
  pts = pts[np.isfinite(pts) | np.isinf(pts) | np.isnan(pts)]
  pts = np.concatenate([pts, -pts])
  return np.unique(pts.view(np.uint32)).view(np.float32)


def cpd_float_reference(x, E, M):
  """CPD's ``float_kernel_nearest`` cast, step by step as drcut/CPD's CUDA source does it: integer
  significand arithmetic on the fp32 fields, result value built in float64 (exact)."""
  b = np.asarray(x, np.float32).view(np.uint32).astype(np.int64)
  s, f, m = b >> 31, (b >> 23) & 0xFF, b & 0x7FFFFF
  bias = 2 ** (E - 1) - 1
  sig, t = m | (1 << 23), f - 127
  ne = t + bias
  d = 23 - M

  def rne(v, drop):
    if drop == 0:
      return v
    half, low, kept = 1 << (drop - 1), v & ((1 << drop) - 1), v >> drop
    up = (low > half) | ((low == half) & ((kept & 1) == 1))
    return (kept + up) << drop

  val_n = rne(sig, d).astype(np.float64) * np.exp2((t - 23).astype(np.float64))
  k = 1 - ne
  sig_t = np.where(k >= 32, 0, sig >> np.clip(k, 0, 63))
  sig_s = sig_t if M == 23 else rne(sig_t, d)
  val_s = sig_s.astype(np.float64) * 2.0 ** (1 - bias - 23)
  val = np.where(ne > 0, val_n, val_s)
  val = np.where(ne >= 2**E - 1, np.inf, val)
  with np.errstate(over="ignore"):
    res = val.astype(np.float32)  # exact, except 2**128 -> inf (E = 8), as on the GPU
  res = np.where(s == 1, -res, res)
  res = np.where((f == 0) & (m != 0), np.float32(0.0), res)
  return np.where((f == 255) | ((f == 0) & (m == 0)), np.asarray(x, np.float32), res)
