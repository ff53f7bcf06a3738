"""Triton kernels of the torch bridge for CUDA tensors: the JAX spec's bits, natively.

Each kernel is a line-by-line port of the jnp definition it names (``jaxlp/formats/_bits.py``,
``_float_format.py``, ``_compat.py``, ``_fixed_point.py``, ``_block.py`` and
``jaxlp/torch/_formats.py``): integer operations on the uint32 pattern of float32 values, the
same branches, the same constants (computed on the host by the format objects, see
``jaxlp/torch/_triton.py``). Stochastic noise is the spec's counter-based hash of the flat
element index (``hash_bits``) under the two words ``jax.random.bits(key, (2,))`` of the key,
which each program derives from the key data (Threefry-2x32, :func:`_key_words`). Tests
compare every kernel with the spec bit for bit (NaN-aware), in Triton's interpreter on the CPU
and on a GPU when one is present.

Float arithmetic appears only where the spec has it (QPyTorch's subnormal rebase and fixed
point rounding), in scalings by powers of two that are exact where they are used, and in
fixed point's stochastic fast path (:func:`_stochastic_fast`: a floor and an exact
subtraction, taken for a block only where every element's result is provably the bit-level
path's). So FMA contraction (Triton's default) cannot change a result: every product it could
fuse is exact.

This module imports ``triton`` at import time: it is imported only when a CUDA tensor is
quantized and Triton is installed (``jaxlp/torch/_triton.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

SIGN = tl.constexpr(0x80000000)
ABS = tl.constexpr(0x7FFFFFFF)
FRAC = tl.constexpr(0x007FFFFF)
EXP = tl.constexpr(0x7F800000)
INF = tl.constexpr(0x7F800000)
QNAN = tl.constexpr(0x7FC00000)

#: Rounding codes (constexpr) of :func:`_round_dropped`.
ROUND_CODES = {"nearest": 0, "nearest_away": 1, "toward_zero": 2, "up": 3, "down": 4,
               "stochastic": 5, "nearest_half_up": 6}


# --------------------------------------------------------------------------------------------
# _bits.py
# --------------------------------------------------------------------------------------------
@triton.jit
def _fmix32(h):
  h = h ^ (h >> 16)
  h = h * 0x85EBCA6B
  h = h ^ (h >> 13)
  h = h * 0xC2B2AE35
  h = h ^ (h >> 16)
  return h


@triton.jit
def _noise(offs, k0, k1):
  """``hash_bits(k0, k1, index)`` of the flat indices ``offs``."""
  h = (offs.to(tl.uint32) * 0x9E3779B9) ^ k0
  h = _fmix32(h)
  return _fmix32(h ^ k1)


@triton.jit
def _rotl(x, R: tl.constexpr):
  return (x << R) | (x >> (32 - R))


@triton.jit
def _tf_round(x0, x1, ka, kb, I: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr,
              R2: tl.constexpr, R3: tl.constexpr):
  """Four Threefry-2x32 rounds (rotations R0..R3), then key injection ``I``: ``x0 += ka``,
  ``x1 += kb + I``."""
  x0 = x0 + x1
  x1 = x0 ^ _rotl(x1, R0)
  x0 = x0 + x1
  x1 = x0 ^ _rotl(x1, R1)
  x0 = x0 + x1
  x1 = x0 ^ _rotl(x1, R2)
  x0 = x0 + x1
  x1 = x0 ^ _rotl(x1, R3)
  return x0 + ka, x1 + kb + I


@triton.jit
def _threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32, 20 rounds (Salmon et al., SC 2011), on uint32 scalars."""
  k2 = k0 ^ k1 ^ 0x1BD11BDA
  x0, x1 = _tf_round(x0 + k0, x1 + k1, k1, k2, 1, 13, 15, 26, 6)
  x0, x1 = _tf_round(x0, x1, k2, k0, 2, 17, 29, 16, 24)
  x0, x1 = _tf_round(x0, x1, k0, k1, 3, 13, 15, 26, 6)
  x0, x1 = _tf_round(x0, x1, k1, k2, 4, 17, 29, 16, 24)
  return _tf_round(x0, x1, k2, k0, 5, 13, 15, 26, 6)


@triton.jit
def _key_words(w0, w1):
  """``jax.random.bits(key, (2,), uint32)`` of threefry2x32 key data (w0, w1) in JAX's
  partitionable scheme: word i hashes the counter (0, i) and XORs the two outputs."""
  zero = w0 * 0
  a0, b0 = _threefry2x32(w0, w1, zero, zero)
  a1, b1 = _threefry2x32(w0, w1, zero, zero + 1)
  return a0 ^ b0, a1 ^ b1


@triton.jit
def _clip(v, lo, hi):
  return tl.minimum(tl.maximum(v, lo), hi)


@triton.jit
def _top_bit24(v):
  """``top_bit(v, max_bits=24)``: floor(log2 v) of uint32 v < 2**24, -1 where v == 0."""
  e = (v.to(tl.float32).to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - 127
  return tl.where(v == 0, -1, e)


@triton.jit
def _floor_log2(mag):
  field = (mag >> 23).to(tl.int32)
  frac = mag & FRAC
  sub_e = _top_bit24(frac) - 149
  return tl.where(field > 0, field - 127, tl.where(frac == 0, -150, sub_e))


@triton.jit
def _pow2_bits(e):
  """Bits of 2**e, e (int32) in [-149, 128]."""
  normal = (_clip(e, -126, 128) + 127).to(tl.uint32) << 23
  one = (e * 0 + 1).to(tl.uint32)
  sub = one << _clip(e + 149, 0, 22).to(tl.uint32)
  return tl.where(e >= -126, normal, sub)


@triton.jit
def _ldexp_bits(mag, s):
  field = (mag >> 23).to(tl.int32)
  frac = mag & FRAC
  sig = tl.where(field > 0, frac | 0x800000, frac)
  new_e = _floor_log2(mag) + s
  top = _top_bit24(tl.maximum(sig, 1))
  norm_frac = tl.where(top <= 23, sig << _clip(23 - top, 0, 31).to(tl.uint32),
                       sig >> _clip(top - 23, 0, 31).to(tl.uint32)) & FRAC
  normal = ((_clip(new_e, -126, 128) + 127).to(tl.uint32) << 23) | norm_frac
  normal = tl.where(new_e >= 128, INF, normal)
  sh = tl.maximum(field, 1) - 150 + s + 149
  sub = tl.where(sh >= 0, sig << _clip(sh, 0, 31).to(tl.uint32),
                 sig >> _clip(-sh, 0, 31).to(tl.uint32))
  sub = tl.where(sh <= -32, 0, sub)
  out = tl.where(new_e >= -126, normal, sub)
  return tl.where(mag == 0, 0, out)


@triton.jit
def _round_dropped(mag, d, big, sgn, rand, ROUND: tl.constexpr):
  """``round_dropped_bits(mag, d, rounding, big=big, negative=sgn != 0, rand=rand)`` with an
  unbounded ``d`` (the spec's ``d_range`` only prunes branches; the bits are the same)."""
  dc = _clip(d, 0, 31).to(tl.uint32)
  one = (mag * 0 + 1).to(tl.uint32)
  low_mask = (one << dc) - one
  field = mag >> 23
  frac = mag & FRAC
  sig = tl.where(field > 0, frac | 0x800000, frac)
  rem = sig & low_mask
  half = (one << dc) >> 1
  if ROUND == 0:
    kodd = (sig >> dc) & 1
    small = (mag + (half - one) + kodd) & (low_mask ^ 0xFFFFFFFF)
    bigv = tl.where(sig > half, big, 0)
  else:
    if ROUND == 1:
      inc = rem >= half
    elif ROUND == 6:
      inc = (rem > half) | ((rem == half) & (sgn == 0))
    elif ROUND == 2:
      inc = rem != rem
    elif ROUND == 3:
      inc = (rem != 0) & (sgn == 0)
    elif ROUND == 4:
      inc = (rem != 0) & (sgn != 0)
    else:
      thr = rem << _clip(32 - d, 0, 31).to(tl.uint32)
      thr = tl.where(d <= 32, thr, rem >> _clip(d - 32, 0, 31).to(tl.uint32))
      inc = rand < thr
    if ROUND != 5:
      inc = inc & (d > 0)
    small = (mag & (low_mask ^ 0xFFFFFFFF)) + (inc.to(tl.uint32) << dc)
    bigv = tl.where(inc, big, 0)
  out = tl.where(d <= 23, small, bigv)
  return tl.where(d <= 0, mag, out)


@triton.jit
def _round_to_quantum(mag, qe, sgn, rand, ROUND: tl.constexpr):
  field = (mag >> 23).to(tl.int32)
  d = qe - (tl.maximum(field, 1) - 150)
  big = _pow2_bits(_clip(qe, -149, 128))
  return _round_dropped(mag, d, big, sgn, rand, ROUND)


# --------------------------------------------------------------------------------------------
# Elementwise formats
# --------------------------------------------------------------------------------------------
@triton.jit
def _float_format(bits, rand, ROUND: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr,
                  SUBNORMALS: tl.constexpr, BIG: tl.constexpr, MAXB: tl.constexpr,
                  OVER: tl.constexpr, INFV: tl.constexpr, NEG_ZERO: tl.constexpr):
  """``FloatFormat._round_bits`` (no scale). OVER: 0 ``max_bits``, 1 NaN, 2 inf, 3 ``up``'s
  rule, 4 ``down``'s rule; INFV: what an input infinity becomes."""
  sgn = bits & SIGN
  mag = bits & ABS
  field = (mag >> 23).to(tl.int32)
  f1 = tl.maximum(field, 1)
  if SUBNORMALS:
    d = tl.maximum(23 - M, (EMIN + 150 - M) - f1)
  else:
    d = tl.where(field < EMIN + 127, (EMIN + 150) - f1, 23 - M)
  r = _round_dropped(mag, d, BIG, sgn, rand, ROUND)
  if OVER == 0:
    over_val = r * 0 + MAXB
  elif OVER == 1:
    over_val = r * 0 + QNAN
  elif OVER == 2:
    over_val = r * 0 + INF
  elif OVER == 3:
    over_val = tl.where(sgn != 0, MAXB, INF)
  else:
    over_val = tl.where(sgn != 0, INF, MAXB)
  out = tl.where(r > MAXB, over_val, r)
  out = tl.where(mag < INF, out, tl.where(mag == INF, INFV, QNAN))
  signed = out | tl.where((sgn != 0) & (out <= INF), SIGN, 0)
  if not NEG_ZERO:
    signed = tl.where(out == 0, 0, signed)
  return signed


@triton.jit
def _qpytorch_float(bits, rand, ROUND: tl.constexpr, E: tl.constexpr, M: tl.constexpr,
                    SAT: tl.constexpr, SMAG: tl.constexpr):
  """``QPyTorchFloat._round_bits``; SAT: bits of its max value, SMAG: bits of 2**min_exp."""
  if E == 8 and M == 23:
    out = bits
  else:
    MIN_EXP: tl.constexpr = 2 - 2 ** (E - 1)
    MAX_EXP: tl.constexpr = 2 ** (E - 1)
    DROP: tl.constexpr = 23 - M
    MASK: tl.constexpr = (1 << DROP) - 1
    KEEP: tl.constexpr = 0xFFFFFFFF ^ MASK
    if M == 23:  # no fraction bit dropped: only the exponent range acts
      add = bits * 0
    elif ROUND == 0:
      add = (bits * 0) + (1 << (DROP - 1))
    else:
      add = (rand >> (32 - DROP)) & MASK
    sgn = bits & SIGN
    mag = bits & ABS
    t = (mag >> 23).to(tl.int32) - 127
    qn = (bits + add) & KEEP
    qfield = ((qn >> 23) & 0xFF).to(tl.int32)
    qn = tl.where((qn != 0) & (qfield > 127 + MAX_EXP), SAT | sgn, qn)
    if E == 8:
      v = (SMAG + (mag & FRAC)) | sgn
      vq = (v + add) & KEEP
      diff = (vq & ABS) - SMAG
      qs = tl.where(diff == 0, 0, diff | sgn)
    else:
      sf = (SMAG | sgn).to(tl.float32, bitcast=True)
      v = (bits.to(tl.float32, bitcast=True) + sf).to(tl.uint32, bitcast=True)
      vq = (v + add) & KEEP
      qs = (vq.to(tl.float32, bitcast=True) - sf).to(tl.uint32, bitcast=True)
    out = tl.where(t < MIN_EXP, qs, qn)
  return out


@triton.jit
def _stochastic_fast(bits, rand, FL: tl.constexpr):
  """``_round_to_quantum(mag, -FL, sgn, rand, 5) | sgn`` in float arithmetic: (bits, ok), the
  same bits wherever ``ok`` (x is zero, or normal with x * 2**FL normal; |FL| <= 126).

  There y = |x| * 2**FL is exact and its fraction is exactly the dropped bits ``rem / 2**d``,
  so ``trunc(frac * 2**32)`` is the spec's threshold (``rem << (32 - d)``, or
  ``rem >> (d - 32)`` for d > 32), and ``(floor(y) + inc) * 2**-FL`` is exact: an integer
  times a power of two whose result is zero or at least ``2**-126``. The whole
  ``QPyTorchFixedPoint`` stochastic kernel compiles to 55 sm_90 PTX instructions per element
  on this path, against 95 for the kernel before it had one (``benchmarks/RESULTS.md``;
  speed not measured)."""
  mag = bits & ABS
  field = (mag >> 23).to(tl.int32)
  y = (mag.to(tl.float32, bitcast=True)) * (2.0 ** FL)
  n = tl.floor(y)
  thr = ((y - n) * 4294967296.0).to(tl.uint32)
  n = tl.where(rand < thr, n + 1.0, n)
  q = (n * (2.0 ** -FL)).to(tl.uint32, bitcast=True) | (bits & SIGN)
  ok = (mag == 0) | ((field >= 1) & (field + FL >= 1) & (field + FL <= 254))
  return q, ok


@triton.jit
def _fixed_point(bits, rand, ROUND: tl.constexpr, FL: tl.constexpr, CLAMP: tl.constexpr,
                 HI: tl.constexpr, LO: tl.constexpr):
  """``FixedPoint._round_bits``; HI, LO: its bounds' bits (rounded toward zero)."""
  sgn = bits & SIGN
  mag = bits & ABS
  if ROUND == 5 and FL <= 126 and FL >= -126:
    r, ok = _stochastic_fast(bits, rand, FL)
    if tl.min((ok | (mag >= INF)).to(tl.int32)) == 0:  # a block with an element outside it
      r = _round_to_quantum(mag, (mag * 0).to(tl.int32) - FL, sgn, rand, ROUND) | sgn
  else:
    r = _round_to_quantum(mag, (mag * 0).to(tl.int32) - FL, sgn, rand, ROUND) | sgn
  out = tl.where(mag < INF, r, bits)
  if CLAMP:
    omag = out & ABS
    neg = out & SIGN
    out = tl.where((omag <= INF) & (neg == 0) & (omag > HI), HI, out)
    out = tl.where((omag <= INF) & (neg != 0) & (omag > (LO & 0x7FFFFFFF)), LO, out)
  return out


@triton.jit
def _half_up_even_odd(y):
  """Bits of ``n = nearbyint(fl32(y + 0.5) - 0.5)`` as ``QPyTorchFixedPoint`` defines it."""
  z = y + 0.5
  f = tl.floor(z)
  odd = (z == f) & ((f - 2.0 * tl.floor(f * 0.5)) != 0.0)
  nb = tl.where(odd, f - 1.0, f).to(tl.uint32, bitcast=True)
  zero = tl.where(z < 0.5, SIGN, 0).to(tl.uint32)  # -0.0 / +0.0 (no float -0.0 literal)
  return tl.where((nb & ABS) == 0, zero, nb)


@triton.jit
def _qpytorch_fixed_nearest(bits, fl_t, rand):
  """The bit-level nearest path of ``QPyTorchFixedPoint.quantize_with_mask``."""
  sgn = bits & SIGN
  mag = bits & ABS
  finite = mag < INF
  y_mag = _ldexp_bits(tl.where(finite, mag, 0), fl_t)
  y = tl.where(finite, y_mag | sgn, bits).to(tl.float32, bitcast=True)
  nb = _half_up_even_odd(y)
  nsgn = nb & SIGN
  nmag = nb & ABS
  nfin = nmag < INF
  nmag = tl.where(nfin, nmag, 0)
  r = _round_to_quantum(nmag, fl_t - 149, nsgn, rand, 0)
  qm = _ldexp_bits(r, -fl_t)
  return tl.where(nfin, qm | nsgn, nb)


@triton.jit
def _qpytorch_fixed_fast(bits, FL: tl.constexpr):
  """The same nearest path with float scalings by 2**fl and 2**-fl: (bits, ok), equal to
  :func:`_qpytorch_fixed_nearest` wherever ``ok`` (both scalings exact: no subnormal input,
  scaled value or result; |fl| <= 126)."""
  mag = bits & ABS
  field = (mag >> 23).to(tl.int32)
  y = bits.to(tl.float32, bitcast=True) * (2.0 ** FL)
  nb = _half_up_even_odd(y)
  nfield = ((nb >> 23) & 0xFF).to(tl.int32)
  q = (nb.to(tl.float32, bitcast=True) * (2.0 ** -FL)).to(tl.uint32, bitcast=True)
  q = tl.where(((nb & ABS) == 0) | (nfield == 255), nb, q)
  ok = (mag == 0) | (field == 255) | ((field >= 1) & (field + FL >= 1))
  ok = ok & (((nb & ABS) == 0) | (nfield == 255) | (nfield - FL >= 1))
  return q, ok


@triton.jit
def _qpytorch_fixed_stochastic(bits, rand, FL: tl.constexpr):
  """The stochastic path of ``QPyTorchFixedPoint.quantize_with_mask`` on the bits, for finite x."""
  sgn = bits & SIGN
  mag = bits & ABS
  finite = mag < INF
  r = _round_to_quantum(tl.where(finite, mag, 0), (mag * 0).to(tl.int32) - FL, sgn, rand, 5)
  # the spec's ``ldexp_bits(mag, fl) == inf``: floor(log2 |x|) + fl >= 128, i.e. a normal x
  # with field + fl >= 255 (a subnormal x has floor(log2 |x|) < -126 and fl <= 149)
  field = (mag >> 23).to(tl.int32)
  return tl.where((field >= 1) & (field + FL >= 255), INF | sgn, r | sgn)


@triton.jit
def _qpytorch_fixed(bits, rand, ROUND: tl.constexpr, FL: tl.constexpr, CLAMP: tl.constexpr,
                    HI: tl.constexpr, LO: tl.constexpr):
  """``QPyTorchFixedPoint.quantize_with_mask``: (bits, clamped) (HI, LO: bound bits)."""
  mag = bits & ABS
  finite = mag < INF
  fl_t = (mag * 0).to(tl.int32) + FL
  if ROUND == 0:
    if FL <= 126 and FL >= -126:
      q, ok = _qpytorch_fixed_fast(bits, FL)
      if tl.min(ok.to(tl.int32)) == 0:  # a block with a subnormal case: the bit-level path
        q = _qpytorch_fixed_nearest(bits, fl_t, rand)
    else:
      q = _qpytorch_fixed_nearest(bits, fl_t, rand)
  else:
    if FL <= 126 and FL >= -126:
      r, ok = _stochastic_fast(bits, rand, FL)  # ok: no overflow either
      if tl.min((ok | ~finite).to(tl.int32)) == 0:  # as for nearest
        r = _qpytorch_fixed_stochastic(bits, rand, FL)
    else:
      r = _qpytorch_fixed_stochastic(bits, rand, FL)
    q = tl.where(finite, r, bits)
  if CLAMP:
    # float comparisons order non-NaN values as the spec's order keys do (-0.0 == +0.0),
    # and are false for NaN
    qf = q.to(tl.float32, bitcast=True)
    gt = qf > (q * 0 + HI).to(tl.float32, bitcast=True)
    lt = qf < (q * 0 + LO).to(tl.float32, bitcast=True)
    out = tl.where(gt, HI, tl.where(lt, LO, q))
    clamped = gt | lt
  else:
    out = q
    clamped = q != q
  return out, clamped


@triton.jit
def _qpytorch_block(bits, mxb, rand, ROUND: tl.constexpr, WL: tl.constexpr,
                    CLIPV: tl.constexpr):
  """``QPyTorchBlock._quantize_f32`` given the block max magnitude bits ``mxb``; CLIPV: the
  bits of ``2**(wl-1) - 1``."""
  sgn = bits & SIGN
  mag = bits & ABS
  mx_field = (mxb >> 23).to(tl.int32)
  e = mx_field - 127
  pre = _round_to_quantum(mag, e - 21, sgn, rand, 0)
  if ROUND == 0:
    q = _round_to_quantum(pre, e + 2 - WL, sgn, rand, 6)
  else:
    q = _round_to_quantum(pre, e + 2 - WL, sgn, rand, 5)
  clip = _ldexp_bits(mag * 0 + CLIPV, e + 2 - WL)
  q = tl.where(q >= _pow2_bits(_clip(e + 1, -149, 128)), clip, q)
  out = q | tl.where((sgn != 0) & (q != 0), SIGN, 0)
  DROP: tl.constexpr = 23 - WL
  if WL == 23:  # no fraction bit dropped
    rb = bits
  elif ROUND == 0:
    rb = bits + (1 << (22 - WL))
  else:
    rb = bits + ((rand >> (32 - DROP)) & ((1 << DROP) - 1))
  rb = rb & (0xFFFFFFFF ^ ((1 << DROP) - 1))
  clip0 = (((1 << (WL - 2)) - 1) << (25 - WL)) | (rb & SIGN)
  rb = tl.where((rb & EXP) != 0, clip0, rb)
  out = tl.where(mx_field == 0, rb, out)
  return tl.where(mxb < INF, out, QNAN)


# --------------------------------------------------------------------------------------------
# Kernels: one program per BLOCK elements of the flat, contiguous tensor
# --------------------------------------------------------------------------------------------
@triton.jit
def _store(y_ptr, offs, out, m):
  """Store float32 bits ``out`` in ``y_ptr``'s dtype, rounding to nearest even as XLA's
  ``astype`` does (bfloat16 on the bits: the same on every backend, subnormals included)."""
  if y_ptr.dtype.element_ty == tl.bfloat16:
    r = out + 0x7FFF + ((out >> 16) & 1)
    h = tl.where((out & ABS) > INF, (out >> 16) | 0x40, r >> 16)
    tl.store(y_ptr + offs, h.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)
  else:
    tl.store(y_ptr + offs, out.to(tl.float32, bitcast=True).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _load(x_ptr, offs, n, K0, K1, STOCH: tl.constexpr):
  """(float32 bits, noise words, mask). float16/bfloat16 widen as XLA's ``astype`` does:
  exactly, and a float16 NaN keeps its payload with the quiet bit set (the hardware
  conversion returns a canonical NaN instead; QPyTorch-style roundings see the payload).
  K0, K1: the key data; the noise hash's words are derived here (:func:`_key_words`)."""
  m = offs < n
  x = tl.load(x_ptr + offs, mask=m, other=0.0)
  if x.dtype == tl.bfloat16:
    bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
  elif x.dtype == tl.float16:
    h = x.to(tl.uint16, bitcast=True).to(tl.uint32)
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    nan_bits = ((h & 0x8000) << 16) | 0x7FC00000 | ((h & 0x3FF) << 13)
    bits = tl.where((h & 0x7FFF) > 0x7C00, nan_bits, bits)
  else:
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
  if STOCH:
    k0, k1 = _key_words(K0.to(tl.uint32), K1.to(tl.uint32))
    rand = _noise(offs, k0, k1)
  else:
    rand = bits * 0
  return bits, rand, m


@triton.jit(do_not_specialize=["K0", "K1"])
def float_kernel(x_ptr, y_ptr, n, K0, K1, ROUND: tl.constexpr, M: tl.constexpr,
                 EMIN: tl.constexpr, SUBNORMALS: tl.constexpr, BIG: tl.constexpr,
                 MAXB: tl.constexpr, OVER: tl.constexpr, INFV: tl.constexpr,
                 NEG_ZERO: tl.constexpr, BLOCK: tl.constexpr):
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  bits, rand, m = _load(x_ptr, offs, n, K0, K1, ROUND == 5)
  out = _float_format(bits, rand, ROUND, M, EMIN, SUBNORMALS, BIG, MAXB, OVER, INFV, NEG_ZERO)
  _store(y_ptr, offs, out, m)


@triton.jit(do_not_specialize=["K0", "K1"])
def qpytorch_float_kernel(x_ptr, y_ptr, n, K0, K1, ROUND: tl.constexpr, E: tl.constexpr,
                          M: tl.constexpr, SAT: tl.constexpr, SMAG: tl.constexpr,
                          BLOCK: tl.constexpr):
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  bits, rand, m = _load(x_ptr, offs, n, K0, K1, ROUND == 5)
  out = _qpytorch_float(bits, rand, ROUND, E, M, SAT, SMAG)
  _store(y_ptr, offs, out, m)


@triton.jit(do_not_specialize=["K0", "K1"])
def fixed_kernel(x_ptr, y_ptr, n, K0, K1, ROUND: tl.constexpr, FL: tl.constexpr,
                 CLAMP: tl.constexpr, HI: tl.constexpr, LO: tl.constexpr, BLOCK: tl.constexpr):
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  bits, rand, m = _load(x_ptr, offs, n, K0, K1, ROUND == 5)
  out = _fixed_point(bits, rand, ROUND, FL, CLAMP, HI, LO)
  _store(y_ptr, offs, out, m)


@triton.jit(do_not_specialize=["K0", "K1"])
def qpytorch_fixed_kernel(x_ptr, y_ptr, mask_ptr, n, K0, K1, ROUND: tl.constexpr,
                          FL: tl.constexpr, CLAMP: tl.constexpr, HI: tl.constexpr,
                          LO: tl.constexpr, WITH_MASK: tl.constexpr, BLOCK: tl.constexpr):
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  bits, rand, m = _load(x_ptr, offs, n, K0, K1, ROUND == 5)
  out, clamped = _qpytorch_fixed(bits, rand, ROUND, FL, CLAMP, HI, LO)
  _store(y_ptr, offs, out, m)
  if WITH_MASK:
    tl.store(mask_ptr + offs, clamped.to(tl.int8), mask=m)


@triton.jit(do_not_specialize=["K0", "K1"])
def qpytorch_block_kernel(x_ptr, mx_ptr, y_ptr, n, inner, size, K0, K1, ROUND: tl.constexpr,
                          WL: tl.constexpr, CLIPV: tl.constexpr, BLOCK: tl.constexpr):
  """``mx_ptr``: the block maxima's float32 magnitudes, one per index of the block axis
  (``size`` of them, ``inner`` elements apart in the flat order; one for the whole tensor)."""
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  bits, rand, m = _load(x_ptr, offs, n, K0, K1, ROUND == 5)
  mx = tl.load(mx_ptr + (offs // inner) % size, mask=m, other=0.0)
  out = _qpytorch_block(bits, mx.to(tl.uint32, bitcast=True), rand, ROUND, WL, CLIPV)
  _store(y_ptr, offs, out, m)


@triton.jit(do_not_specialize=["K0", "K1"])
def qpytorch_block_whole_kernel(x_ptr, y_ptr, n, K0, K1, ROUND: tl.constexpr, WL: tl.constexpr,
                                CLIPV: tl.constexpr, BLOCK: tl.constexpr):
  """:class:`QPyTorchBlock` with one block for the whole tensor (``dim=-1``) in ONE program:
  the maximum magnitude (as bits: for non-negative floats their order, and any NaN or inf
  is >= INF, which the rounding turns into NaN as the float maximum does), then the rounding,
  BLOCK elements at a time. For small tensors: no separate ``amax`` launch."""
  mx = tl.zeros([BLOCK], tl.uint32)
  for start in range(0, n, BLOCK):
    offs = start + tl.arange(0, BLOCK)
    bits, rand, m = _load(x_ptr, offs, n, K0, K1, False)
    mx = tl.maximum(mx, tl.where(m, bits & ABS, 0))
  mxb = tl.max(mx, axis=0)
  for start in range(0, n, BLOCK):
    offs = start + tl.arange(0, BLOCK)
    bits, rand, m = _load(x_ptr, offs, n, K0, K1, ROUND == 5)
    out = _qpytorch_block(bits, mx * 0 + mxb, rand, ROUND, WL, CLIPV)
    _store(y_ptr, offs, out, m)
