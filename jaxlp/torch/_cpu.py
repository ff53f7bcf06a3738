"""The torch bridge's native path for CPU tensors: the JAX spec's bits in NumPy, no compiling.

Why (2-core CI machine, 2026-11-29, ``benchmarks/torch_quantize.py``): through JAX a CPU
call pays a DLPack import, the compiled executable's dispatch and an export (73-250 us for
100 elements, QPyTorch: 7 us), and every new (format, rounding, shape) compiles for 50-200
ms. Here the tensor's memory is read as uint32 bit patterns (``Tensor.numpy()``, no copy)
and rounded with NumPy integer operations: nothing is compiled, so a new shape costs nothing
more than a known one.

What runs here (float32, float16 and bfloat16 CPU tensors of at most
``jaxlp.torch._quantize.NATIVE_MAX`` elements; larger ones go to the compiled spec with
bucketed shapes, where XLA's fused multi-threaded loop is faster, but ``qpytorch_block`` with
``dim >= 0``, which stays here at any size):
:class:`~jaxlp.FloatFormat` (every preset, every rounding), ``qpytorch_float``
(``float_quantize``), ``cpd_float`` (``jaxlp.torch.cpd``), :class:`~jaxlp.FixedPoint` (every
rounding), :class:`~jaxlp.torch.QPyTorchFixedPoint` (``fixed_point_quantize``, with the clamp
mask) and ``qpytorch_block`` (``block_quantize``). Stochastic rounding uses the spec's noise
(the counter-based hash of the flat index under ``jax.random.bits(key, (2,))``, the key words
derived here with Threefry-2x32 as JAX's partitionable scheme does), so when that JAX
configuration is the default the bits equal the JAX route's for the same seed; under another
PRNG configuration stochastic calls take the JAX route. Every other format (``BlockFormat``,
``mx``, ``hbfp``, ...) takes the JAX route (``jaxlp/torch/_quantize.py``).

How the bits stay the spec's: every format has a *full* port (``_full_*``), a line-by-line
translation of its jnp definition in ``jaxlp/formats`` (integer operations on the uint32
pattern, the same branches and constants, the constants taken from the format objects), and
most have a *fast* path: a few operations that give the same bits wherever a cheap check of
the whole tensor (its smallest and largest magnitude) says they apply; elements outside (a
subnormal, an overflow, a NaN) are recomputed by the full port. The fast paths use float32
arithmetic only where it is exact (scalings by powers of two of normal values, ``floor`` and
``rint`` of normal values, QPyTorch's own float additions), so flush-to-zero settings cannot
change a result. ``tests/torch_bridge/test_cpu_path.py`` compares both paths with the JAX spec
bit for bit on crafted patterns (every exponent field with ties, half-ulps and extremes, both
signs) and a million random bit patterns per format and rounding.

Why a port and not one definition for both: the spec is written for XLA, which fuses its
branch-free arithmetic into one loop; evaluated eagerly (NumPy executes each operation on its
own, ~0.6 us per operation at 100 elements) it takes 30-80 operations per call where the fast
paths take 5-15, and sharing it would mean rewriting ``jaxlp/formats`` (which the Pallas
kernels also trace) against an array-namespace parameter. The Triton kernels of CUDA tensors
(``_triton_kernels.py``) are the same kind of port, tested the same way.

Per-call cost (what a 100-element call pays; 2-core CI VM, NumPy 2.4, 2026-11-29): a NumPy
operation costs about 0.25 us with array or 0-d array operands and 0.4-0.8 us with a NumPy
scalar operand, so the fast paths take their constants as read-only 0-d arrays (:func:`_k`)
and check ranges with ``argmax``/``argmin`` (0.25 us against 0.7 for ``np.maximum.reduce``).
A stochastic call also derives the key words (Threefry-2x32 in Python integers, about 2.6
us: :func:`_threefry_words`) and hashes the flat index (12 NumPy operations, about 3 us:
:func:`noise`); together more than QPyTorch's whole stochastic call at that size (4.5-5.5 us).
Where the optional C accelerator ``jaxlp.torch._cnoise`` was built (``setup.py``, where the
install finds a C compiler; ``_cnoise.c``) both are one C call of well under a microsecond at
that size, with the same words, and so is fixed point's stochastic rounding on its fast path
(8 NumPy operations: :func:`_scaled`); tests/torch_bridge/test_cpu_noise_c.py compares them
with the NumPy functions and JAX. Without it the NumPy functions here run.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import torch

from jaxlp.formats._block import QPyTorchBlock
from jaxlp.formats._compat import CPDFloat, QPyTorchFloat
from jaxlp.formats._fixed_point import FixedPoint
from jaxlp.formats._float_format import FloatFormat
from jaxlp.torch._formats import QPyTorchFixedPoint

try:  # the optional C accelerator of the noise words (module docstring)
  from jaxlp.torch import _cnoise
except ImportError:  # not built (no C compiler at install, or a source tree on sys.path)
  _cnoise = None

_U = np.uint32
_I = np.int32
SIGN = _U(0x80000000)
ABS = _U(0x7FFFFFFF)
EXP = _U(0x7F800000)
FRAC = _U(0x007FFFFF)
INF = _U(0x7F800000)
QNAN = _U(0x7FC00000)
HIDDEN = _U(0x00800000)
ZERO = _U(0)
ONE = _U(1)
_SH23 = _U(23)

#: Most elements a tensor may have here (the noise index is 32 bits, as in the spec).
MAX_ELEMENTS = 2**32 - 1

_ROUNDINGS = ("nearest", "nearest_away", "toward_zero", "up", "down", "stochastic",
              "nearest_half_up")


def _f32_bits(v) -> int:
  with np.errstate(over="ignore"):
    return int(np.asarray(v, np.float32).view(np.uint32))


# --------------------------------------------------------------------------------------------
# The stochastic noise: jaxlp.formats._bits.hash_bits of the flat index, under the key words
# jax.random.bits(key, (2,), uint32) of the key data (Threefry-2x32, partitionable scheme).
# --------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_L1 = 1 << 64  # the second lane of the two-lane integers below
_M2 = _M32 | (_M32 << 64)
_BOTH = 1 | _L1
_DUP = 1 | (1 << 32)  # x * _DUP: each lane's 32 bits twice, side by side


def _threefry_words(w0: int, w1: int) -> tuple[int, int]:
  """``jax.random.bits(key, (2,), uint32)`` of a threefry2x32 key with data ``(w0, w1)``
  (uncached: :func:`key_words`).

  JAX's partitionable scheme hashes the counters (0, 0) and (0, 1) with Threefry-2x32 (20
  rounds) and XORs each output pair. Both counters run at once here, 64 bits apart in one
  Python integer. A rotation left by r of a lane's clean 32 bits is ``(x * _DUP) >> (32 - r)``
  (the lane doubled, shifted) masked to 32 bits; the mask is taken once per round, after the
  XOR, so ``x1`` is clean before every rotation. ``x0`` is never masked: its additions carry
  into the unused bits 32-63 of each lane (25 additions of values below 2**33 stay below
  2**38), which only reach ``x1`` through the masked XOR and the final ``& _M32``. The rounds
  are written out (the interpreter's cost per round is the cost of the call).

  References:
    Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011 (Threefry-2x32,
    rotation constants 13 15 26 6 / 17 29 16 24 and key schedule).
  """
  m, d = _M2, _DUP
  a = w0 * _BOTH
  b = w1 * _BOTH
  c = (w0 ^ w1 ^ 0x1BD11BDA) * _BOTH
  x0 = a  # counters (0, 0) and (0, 1) plus the first key injection
  x1 = (b + _L1) & m
  x0 += x1; x1 = ((x1 * d >> 19) ^ x0) & m  # noqa: E702  (rotations 13 15 26 6)
  x0 += x1; x1 = ((x1 * d >> 17) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 6) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 26) ^ x0) & m  # noqa: E702
  x0 += b; x1 = (x1 + c + _BOTH) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 15) ^ x0) & m  # noqa: E702  (rotations 17 29 16 24)
  x0 += x1; x1 = ((x1 * d >> 3) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 16) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 8) ^ x0) & m  # noqa: E702
  x0 += c; x1 = (x1 + a + 2 * _BOTH) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 19) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 17) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 6) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 26) ^ x0) & m  # noqa: E702
  x0 += a; x1 = (x1 + b + 3 * _BOTH) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 15) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 3) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 16) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 8) ^ x0) & m  # noqa: E702
  x0 += b; x1 = (x1 + c + 4 * _BOTH) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 19) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 17) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 6) ^ x0) & m  # noqa: E702
  x0 += x1; x1 = ((x1 * d >> 26) ^ x0) & m  # noqa: E702
  x0 += c; x1 += a + 5 * _BOTH  # noqa: E702
  w = x0 ^ x1
  return w & _M32, (w >> 64) & _M32


@functools.lru_cache(maxsize=1024)
def key_words(w0: int, w1: int) -> tuple[int, int]:
  """``jax.random.bits(key, (2,), uint32)`` of a threefry2x32 key with data ``(w0, w1)``:
  :func:`_threefry_words`, cached (a ``seed=`` repeats its words; a fresh draw from a torch
  RNG calls :func:`_threefry_words` directly)."""
  return _threefry_words(w0, w1)


def _k(v) -> np.ndarray:
  """A read-only 0-d uint32 array: a NumPy operation on an array and a 0-d array costs less
  than one with a NumPy scalar (about 0.25 against 0.4-0.8 us at 100 elements, NumPy 2.4)."""
  a = np.array(v, np.uint32)
  a.setflags(write=False)
  return a


def _kf(v) -> np.ndarray:
  """:func:`_k` for a float32 constant."""
  a = np.array(v, np.float32)
  a.setflags(write=False)
  return a


def _max(a) -> int | float:
  """The largest element of non-empty 1-d ``a`` (NaN if a float ``a`` holds one): ``argmax``
  and ``item`` (about 0.25 us at 100 elements against 0.7 us for ``np.maximum.reduce``)."""
  return a.item(a.argmax())


def _min(a) -> int | float:
  """The smallest element of non-empty 1-d ``a`` (NaN if a float ``a`` holds one)."""
  return a.item(a.argmin())


_GOLDEN = _U(0x9E3779B9)
_FM1, _FM2 = _k(0x85EBCA6B), _k(0xC2B2AE35)
_S13, _S16 = _k(13), _k(16)


def _mixed_index(n: int) -> np.ndarray:
  """``g ^ (g >> 16)`` for ``g = arange(n) * 0x9E3779B9`` (uint32): ``hash_bits``'s scaled
  index after the first xor-shift of its first ``fmix32`` (see :func:`noise`)."""
  g = np.arange(n, dtype=np.uint32)
  g *= _GOLDEN
  g ^= g >> _S16
  return g


@functools.lru_cache(maxsize=32)
def _mixed_index_ro(n: int) -> np.ndarray:
  """:func:`_mixed_index` of a tensor size up to 65536, cached (read-only)."""
  g = _mixed_index(n)
  g.setflags(write=False)
  return g


def noise(n: int, k0: int, k1: int) -> np.ndarray:
  """``hash_bits(k0, k1, arange(n))``: the spec's noise word of each flat index, i.e.
  ``fmix32(fmix32(g ^ k0) ^ k1)`` for ``g = arange(n) * 0x9E3779B9`` (``jaxlp/formats/_bits.py``)
  in 12 NumPy operations (18 written out), by two exact identities of uint32 xor-shifts
  (``s(v) = v ^ (v >> 16)`` is linear over XOR, and ``s(s(v)) = v`` since ``v >> 32 = 0``):

  * the first step of the first ``fmix32``: ``s(g ^ k0) = s(g) ^ s(k0)``, where ``s(g)`` is
    cached per ``n`` (:func:`_mixed_index`);
  * the last step of the first and the first of the second: with ``p`` the first one's last
    product, ``s(s(p) ^ k1) = s(s(p)) ^ s(k1) = p ^ s(k1)``: both steps drop out.

  References:
    Appleby, MurmurHash3 (``fmix32``, public domain).
  """
  h = np.bitwise_xor(_mixed_index_ro(n) if n <= 65536 else _mixed_index(n),
                     np.array(k0 ^ (k0 >> 16), np.uint32))
  h *= _FM1
  t = np.right_shift(h, _S13)  # the scratch array of the shifts below
  h ^= t
  h *= _FM2
  h ^= np.array(k1 ^ (k1 >> 16), np.uint32)
  h *= _FM1
  np.right_shift(h, _S13, out=t)
  h ^= t
  h *= _FM2
  np.right_shift(h, _S16, out=t)
  h ^= t
  return h


# --------------------------------------------------------------------------------------------
# Ports of jaxlp/formats/_bits.py (uint32 arrays; int32 exponents)
# --------------------------------------------------------------------------------------------
def _top_bit24(v):
  """``top_bit(v, max_bits=24)``: floor(log2 v) of uint32 v < 2**24, -1 where v == 0."""
  e = (v.astype(np.float32).view(np.uint32) >> _SH23).astype(_I) - 127
  e[v == 0] = -1
  return e


def _floor_log2(mag):
  field = (mag >> _SH23).astype(_I)
  frac = mag & FRAC
  sub_e = _top_bit24(frac) - 149
  return np.where(field > 0, field - 127, np.where(frac == 0, -150, sub_e)).astype(_I)


def _pow2_bits(e):
  """Bits of 2**e for int32 e in [-149, 128] (128: +inf's bits)."""
  normal = (np.clip(e, -126, 128) + 127).astype(_U) << _SH23
  sub = ONE << np.clip(e + 149, 0, 22).astype(_U)
  return np.where(e >= -126, normal, sub)


def _ldexp_bits(mag, s):
  """``ldexp_bits``: bits of |x| * 2**s (finite magnitude bits, int32 s), exact where
  representable; beyond float32: +inf's bits; zero stays zero."""
  field = (mag >> _SH23).astype(_I)
  frac = mag & FRAC
  sig = np.where(field > 0, frac | HIDDEN, frac)
  new_e = _floor_log2(mag) + s
  top = _top_bit24(np.maximum(sig, ONE))
  norm_frac = np.where(top <= 23, sig << np.clip(23 - top, 0, 31).astype(_U),
                       sig >> np.clip(top - 23, 0, 31).astype(_U)) & FRAC
  normal = ((np.clip(new_e, -126, 128) + 127).astype(_U) << _SH23) | norm_frac
  normal = np.where(new_e >= 128, INF, normal)
  sh = np.maximum(field, 1) - 150 + s + 149
  sub = np.where(sh >= 0, sig << np.clip(sh, 0, 31).astype(_U),
                 sig >> np.clip(-sh, 0, 31).astype(_U))
  sub = np.where(sh <= -32, ZERO, sub)
  out = np.where(new_e >= -126, normal, sub)
  return np.where(mag == 0, ZERO, out).astype(_U)


def _round_dropped_bits(mag, d, rounding, big, negative=None, rand=None):
  """``round_dropped_bits(mag, d, rounding, big=big, negative=negative, rand=rand)`` (no
  ``d_range``: the spec's bounds only prune branches, the bits are the same)."""
  d = np.asarray(d, _I)
  dc = np.clip(d, 0, 31).astype(_U)
  low_mask = (ONE << dc) - ONE
  field = mag >> _SH23
  frac = mag & FRAC
  sig = np.where(field > 0, frac | HIDDEN, frac)
  rem = sig & low_mask
  half = (ONE << dc) >> ONE
  if rounding == "nearest":
    kodd = (sig >> dc) & ONE
    small = (mag + (half - ONE) + kodd) & ~low_mask
    bigv = np.where(sig > half, big, ZERO)
  else:
    if rounding == "nearest_away":
      inc = rem >= half
    elif rounding == "nearest_half_up":
      inc = (rem > half) | ((rem == half) & ~negative)
    elif rounding == "toward_zero":
      inc = np.zeros(mag.shape, bool)
    elif rounding == "up":
      inc = (rem != 0) & ~negative
    elif rounding == "down":
      inc = (rem != 0) & negative
    elif rounding == "stochastic":
      thr = rem << np.clip(32 - d, 0, 31).astype(_U)
      thr = np.where(d <= 32, thr, rem >> np.clip(d - 32, 0, 31).astype(_U))
      inc = rand < thr
    else:  # pragma: no cover - validated by callers
      raise ValueError(f"unknown rounding {rounding!r}")
    if rounding != "stochastic":
      inc = inc & (d > 0)
    small = (mag & ~low_mask) + (inc.astype(_U) << dc)
    bigv = np.where(inc, big, ZERO)
  out = np.where(d <= 23, small, bigv)
  return np.where(d <= 0, mag, out).astype(_U)


def _round_to_quantum(mag, qe, rounding, negative=None, rand=None):
  field = (mag >> _SH23).astype(_I)
  qe = np.asarray(qe, _I)
  d = qe - (np.maximum(field, 1) - 150)
  big = _pow2_bits(np.clip(qe, -149, 128))
  return _round_dropped_bits(mag, d, rounding, big, negative, rand)


def _quiet(f):
  """``f`` with NumPy's floating-point warnings off: the full ports compute on NaN and inf
  inputs as the spec does (``floor(inf)``, ``fmod(inf, 2)``, a signalling NaN's add), which
  NumPy would report."""

  @functools.wraps(f)
  def g(*args):
    with np.errstate(all="ignore"):
      return f(*args)
  return g


def _patch(out, bad, full, bits, rand):
  """``out[bad] = full(bits[bad], rand[bad])``: the full port where the fast path is out of
  its range (``bad``: a boolean mask, or None for none)."""
  if bad is not None:
    idx = np.flatnonzero(bad)
    if idx.size:
      out[idx] = full(bits[idx], None if rand is None else rand[idx])
  return out


def _guarded(core, full, lo_ok: int, hi_ok: int | None = None, zero_sign: bool = False):
  """A fast path: ``core(bits, rand) -> (out, bad or None)`` where every nonzero magnitude
  lies in ``[lo_ok, hi_ok]`` (uint32 magnitude bits; zeros are passed to ``core`` too); the
  elements outside that range (and those ``core`` marks ``bad``) get ``full``'s bits.

  The range is checked with one or two reductions; only a tensor holding a zero or an element
  outside pays for an element mask (and ``core`` then sees those elements zeroed, so it never
  reads a NaN, an infinity or a subnormal). ``zero_sign``: -0.0 inputs give +0.0."""
  lo1 = _U(lo_ok - 1)
  hi_u = None if hi_ok is None else _U(hi_ok)
  abs0 = _k(ABS)

  def f(bits, rand):
    mag = bits & abs0
    if _min(mag) >= lo_ok and (hi_u is None or _max(mag) <= hi_ok):
      out, bad = core(bits, rand)
      return _patch(out, bad, full, bits, rand)
    outside = (mag - ONE) < lo1  # 0 < |x| < lo_ok (a zero wraps to 2**32 - 1)
    if hi_u is not None:
      outside |= mag > hi_u
    clean = bits
    if outside.any():
      clean = bits.copy()
      clean[outside] = ZERO
    out, bad = core(clean, rand)
    if zero_sign:
      out[bits == SIGN] = ZERO
    return _patch(out, outside if bad is None else outside | bad, full, bits, rand)

  return f


# --------------------------------------------------------------------------------------------
# Elementwise formats: (fast, full), each a function (flat uint32 bits, noise) -> out bits
# --------------------------------------------------------------------------------------------
def _float_format(fmt: FloatFormat, rounding: str):
  """``FloatFormat._round_bits`` (no MX scale)."""
  m, emin = fmt.man_bits, fmt.emin
  maxb = _U(_f32_bits(fmt.max_normal))
  big = _U(_f32_bits(2.0**fmt._quantum_below_normal))
  rule = fmt._overflow_rule(rounding)
  infv = {"inf": INF, "max": maxb, "nan": QNAN}[fmt._inf_input_rule]
  subnormals = fmt.subnormals
  neg_zero = fmt.has_negative_zero
  d0 = 23 - m

  @_quiet
  def full(bits, rand):
    sgn = bits & SIGN
    negative = sgn != 0
    mag = bits & ABS
    field = (mag >> _SH23).astype(_I)
    f1 = np.maximum(field, 1)
    if subnormals:
      d = np.maximum(d0, (emin + 150 - m) - f1)
    else:
      d = np.where(field < emin + 127, (emin + 150) - f1, d0)
    r = _round_dropped_bits(mag, d, rounding, big, negative, rand)
    if rule == "max":
      over_val = maxb
    elif rule == "nan":
      over_val = QNAN
    elif rule == "inf_if_positive":
      over_val = np.where(negative, maxb, INF)
    elif rule == "inf_if_negative":
      over_val = np.where(negative, INF, maxb)
    else:
      over_val = INF
    out = np.where(r > maxb, over_val, r)
    out = np.where(mag < INF, out, np.where(mag == INF, infv, QNAN))
    signed = out | np.where(negative & (out <= INF), SIGN, ZERO)
    if not neg_zero:
      signed = np.where(out == 0, ZERO, signed)
    return signed.astype(_U)

  # Fast path: finite magnitudes in the format's normal range (and zeros). There d = 23 - m
  # for every element, so the rounding drops a fixed number of bits of the signed pattern (a
  # carry moves into the exponent field, never into the sign: the magnitude stays below
  # inf's bits); a zero keeps its pattern, as in the spec. Results beyond max_normal are
  # recomputed by the full port (its overflow rule).
  # (0-d constants: see _k)
  low = _k((1 << d0) - 1)
  keep = _k(0xFFFFFFFF ^ ((1 << d0) - 1))
  half1 = _k((1 << d0 >> 1) - 1 if d0 else 0)
  half = _k(1 << d0 >> 1)
  sd0 = _k(d0)
  s32 = _k(32 - d0)
  one, abs0, sign0, h22 = _k(1), _k(ABS), _k(SIGN), _k(1 << 22)
  maxb_i = int(maxb)

  def core(bits, rand):
    if d0 == 0:
      out = bits.copy()
    elif rounding == "nearest":
      if d0 == 23:  # m = 0: the kept integer is the hidden bit (odd)
        out = bits + h22
      else:
        out = np.right_shift(bits, sd0)
        out &= one
        out += half1
        out += bits
      out &= keep
    elif rounding == "toward_zero":
      out = bits & keep
    elif rounding == "nearest_away":
      out = bits + half
      out &= keep
    elif rounding == "stochastic":
      inc = bits & low
      inc <<= s32
      inc = np.less(rand, inc)
      out = bits & keep
      out += inc.astype(_U) << sd0
    else:  # up / down: toward +-inf, by the sign
      inc = bits & low
      inc = inc != 0
      inc &= (bits >= sign0) if rounding == "down" else (bits < sign0)
      out = bits & keep
      out += inc.astype(_U) << sd0
    if _max(out & abs0) > maxb_i:
      return out, (out & ABS) > maxb
    return out, None

  fast = _guarded(core, full, (emin + 127) << 23, 0x7F7FFFFF, zero_sign=not neg_zero)
  return fast, full


def _qpytorch_float(fmt: QPyTorchFloat, rounding: str):
  """``QPyTorchFloat._round_bits``."""
  E, M = fmt.exp_bits, fmt.man_bits
  if (E, M) == (8, 23):
    ident = lambda bits, rand: bits.copy()  # noqa: E731
    return ident, ident
  min_exp, max_exp = 2 - 2 ** (E - 1), 2 ** (E - 1)
  drop = 23 - M
  mask = _U((1 << drop) - 1)
  keep = ~mask
  add_n = _U(1 << (drop - 1)) if drop else ZERO
  shr = _U(32 - drop) if drop else ZERO
  sat = _U(fmt._saturation_bits)
  s_mag = _U(fmt._rebase_bits)
  sat_lim = _U((127 + max_exp) << 23)  # a result whose exponent field exceeds 127 + max_exp

  def add_of(rand):
    if drop == 0:
      return ZERO
    if rounding == "nearest":
      return add_n
    return (rand >> shr) & mask

  @_quiet
  def full(bits, rand):
    add = add_of(rand)
    sgn = bits & SIGN
    mag = bits & ABS
    t = (mag >> _SH23).astype(_I) - 127
    qn = (bits + add) & keep
    qfield = ((qn >> _SH23) & _U(0xFF)).astype(_I)
    qn = np.where((qn != 0) & (qfield > 127 + max_exp), sat | sgn, qn)
    if E == 8:
      v = (s_mag + (mag & FRAC)) | sgn
      vq = (v + add) & keep
      diff = (vq & ABS) - s_mag
      qs = np.where(diff == 0, ZERO, diff | sgn)
    else:
      sf = (s_mag | sgn).view(np.float32)
      v = (bits.view(np.float32) + sf).view(_U)
      vq = (v + add) & keep
      qs = (vq.view(np.float32) - sf).view(_U)
    return np.where(t < min_exp, qs, qn).astype(_U)

  # Fast path. With no magnitude below 2**min_exp (the rebase branch) and none that can
  # saturate: the normal branch, (bits + add) & keep, for every element. Otherwise one
  # formula for both branches: q = fl32(round(fl32(x + s)) - s) with s = copysign(2**min_exp,
  # x) in the rebase branch and s = +0 in the normal one (x + 0 and v' - 0 are exact, so that
  # is the normal branch; zeros give +0.0 as the spec), checked for saturation; with exp = 8
  # the rebase add is the spec's exact integer add only where float32 arithmetic keeps
  # subnormals (checked), and a NaN input (whose pattern a float add would change) takes the
  # full port.
  sub_lim = (127 + min_exp) << 23
  # no result can saturate when every |x| + add stays below 2**(max_exp + 1)
  nosat = ((128 + max_exp) << 23) - (int(add_n) if rounding == "nearest" else int(mask))
  s_f = np.float32(2.0**min_exp)
  inf_lim = int(INF) if E == 8 else nosat

  span = nosat - sub_lim
  abs0, sub0, keep0, add0, shr0 = _k(ABS), _k(sub_lim), _k(keep), _k(add_n), _k(shr)

  def fast(bits, rand):
    mag = bits & abs0
    if E < 8:
      # every magnitude in [sub_lim, nosat) <=> mag - sub_lim (wrapping) below the span
      inside = _max(np.subtract(mag, sub0, out=mag)) < span
    else:
      inside = _min(mag) >= sub_lim
    if inside:
      if not drop:
        return bits.copy()
      # (rand >> (32 - drop)) is below 2**drop: add_of's mask is not needed here
      out = bits + add0 if rounding == "nearest" else np.right_shift(rand, shr0)
      if rounding != "nearest":
        out += bits
      out &= keep0
      return out
    add = add_of(rand)
    mag = bits & ABS
    mx = int(np.maximum.reduce(mag))
    if mx > inf_lim or (E == 8 and not _ieee_subnormals()):
      return full(bits, rand)  # a NaN (or, exp < 8, an inf or a possible saturation)
    x = bits.view(np.float32)
    s = (mag < _U(sub_lim)) * s_f
    np.copysign(s, x, out=s)
    v = x + s
    vb = v.view(_U)
    if drop:
      vb += add
      vb &= keep
    if E < 8 and mx >= nosat:
      over = (vb & EXP) > sat_lim
      if over.any():
        vb[over] = sat | (bits[over] & SIGN)
    v -= s
    return v.view(_U)

  return fast, full


def _cpd_float(fmt: CPDFloat, rounding: str):
  """``CPDFloat._round_bits`` (nearest only)."""
  E, M, bias = fmt.exp_bits, fmt.man_bits, fmt.bias
  d0 = 23 - M
  big = _U(_f32_bits(2.0 ** (1 - bias - M)))

  @_quiet
  def full(bits, rand):
    sgn = bits & SIGN
    mag = bits & ABS
    field = (mag >> _SH23).astype(_I)
    ne = field - (127 - bias)
    k = np.maximum(1 - ne, 0)
    keepk = ~((ONE << np.minimum(k, 31).astype(_U)) - ONE)
    mag_t = np.where(k >= 24, ZERO, mag & keepk)
    r = _round_dropped_bits(mag_t, d0 + k, "nearest", big)
    r = np.where(ne >= 2**E - 1, INF, r)
    out = r | sgn
    out = np.where(field == 0, ZERO, out)
    return np.where((field == 255) | (mag == 0), bits, out).astype(_U)

  # Fast path: normal target exponents below the overflow test (1 <= ne <= 2**E - 2): round
  # to nearest even dropping 23 - M bits of the signed pattern (a carry out of the top binade
  # gives CPD's finite 2**(bias + 1)); zeros keep their pattern.
  keep = _k(0xFFFFFFFF ^ ((1 << d0) - 1))
  half1 = _k((1 << d0 >> 1) - 1 if d0 else 0)
  sd0, one, h22 = _k(d0), _k(1), _k(1 << 22)

  def core(bits, rand):
    if d0 == 0:
      return bits.copy(), None
    if d0 == 23:  # M = 0: the kept integer is the hidden bit (odd)
      out = bits + h22
    else:
      out = np.right_shift(bits, sd0)
      out &= one
      out += half1
      out += bits
    out &= keep
    return out, None

  lo_ok = (128 - bias) << 23  # ne >= 1
  hi_ok = ((2**E - 2 + 127 - bias) << 23) | 0x7FFFFF  # ne <= 2**E - 2
  return _guarded(core, full, lo_ok, hi_ok), full


def _fixed_point(fmt: FixedPoint, rounding: str):
  """``FixedPoint._round_bits``."""
  fl = fmt.fl
  clamp = fmt.clamp
  hi_b, lo_b = (_U(b) for b in fmt._clamp_bits)
  lo_mag = lo_b & ABS

  @_quiet
  def full(bits, rand):
    sgn = bits & SIGN
    mag = bits & ABS
    finite = mag < INF
    r = _round_to_quantum(mag, np.full(mag.shape, -fl, _I), rounding, sgn != 0, rand)
    out = np.where(finite, r | sgn, bits)
    if clamp:
      omag = out & ABS
      nan = omag > INF
      neg = (out & SIGN) != 0
      out = np.where(~nan & ~neg & (omag > hi_b), hi_b, out)
      out = np.where(~nan & neg & (omag > lo_mag), lo_b, out)
    return out.astype(_U)

  fast = _scaled_fast(fl, rounding, full, (hi_b, lo_b) if clamp else None)
  return fast, full


_SUBNORMAL = np.float32(2.0**-140)
_F_ONE = np.float32(1.0)


def _ieee_subnormals() -> bool:
  """Whether float32 arithmetic in this thread keeps subnormals (no flush-to-zero or
  denormals-are-zero, which ``torch.set_flush_denormal(True)`` turns on)."""
  return bool(_SUBNORMAL * _F_ONE != 0)


_F_MAX = float(np.finfo(np.float32).max)
_TWO32 = np.float32(4294967296.0)


def _scaled(fl: int, rounding: str, qpytorch: bool = False):
  """Fixed point's rounding onto the ``2**-fl`` grid in float32, for ``|fl| <= 126``: a
  function (bits, noise) -> unclamped result bits, or None for other ``fl`` and roundings.

  ``y = x * 2**fl`` is exact wherever it is normal, and ``rint`` / ``trunc`` (of ``y``),
  ``floor`` (of ``|y|``, stochastic) give the spec's rounded multiple with the spec's sign of
  zero; ``* 2**-fl`` is exact again (a nonzero result is at least ``2**-fl >= 2**-126``).
  Stochastic: the fraction of ``|y|`` times ``2**32`` is the spec's threshold (``rem << (32 -
  d)``, or ``rem >> (d - 32)`` for d > 32, truncated), and a noise word below it rounds up.
  Where ``|y| < 2**-126`` the exact ``y`` rounds to zero (nearest, toward zero) or has a zero
  threshold (stochastic), so a ``y`` rounded by the multiply (or a subnormal x) cannot change
  the result, as long as the arithmetic keeps subnormals (checked per call with
  :func:`_ieee_subnormals`). An overflow of ``y`` gives inf (or NaN): callers check the result
  range. ``qpytorch``: QPyTorch's ``nearbyint(fl32(y + 0.5) - 0.5)`` instead of ``rint``.
  """
  if rounding not in ("nearest", "toward_zero", "stochastic") or not -126 <= fl <= 126:
    return None
  up = _kf(2.0**fl)
  down = _kf(2.0**-fl)
  half = _kf(0.5)
  two32 = _kf(_TWO32)

  upf, downf = float(2.0**fl), float(2.0**-fl)

  def core(bits, rand, mag=None):
    x = bits.view(np.float32)
    if rounding == "stochastic":
      c = _cnoise
      if mag is not None and c is not None:
        # the fast path's call (every |x| * 2**fl finite): the same operations in C
        out = np.empty(bits.shape, _U)
        c.scaled_stochastic(out, bits, rand, upf, downf)
        return out
      # |x| (from the magnitude bits where the caller has them: a new array it hands over)
      y = np.abs(x) if mag is None else mag.view(np.float32)
      y *= up
      n = np.floor(y)
      y -= n
      y *= two32
      n += rand < y.astype(_U)
      n *= down
      return np.copysign(n, x, out=n).view(_U)  # -0.0 for a negative x that rounds to 0
    y = x * up
    if qpytorch:
      # n = rint(fl32(y + 0.5) - 0.5), QPyTorch's own operations: with z = fl32(y + 0.5), z -
      # 0.5 is exact for |z| < 2**23 (both multiples of ulp(z) <= 0.5), so rint gives floor(z)
      # or, for an integer z (a tie), the even one of z - 1 and z, with the spec's sign of
      # zero (-0.0 exactly where z < 0.5); for |z| >= 2**23 z is an integer and the float32
      # subtraction's tie goes to the even neighbour: the spec's n
      y += half
      y -= half
    if rounding == "toward_zero":
      np.trunc(y, out=y)
    else:
      np.rint(y, out=y)
    y *= down
    return y.view(_U)

  return core


def _scaled_fast(fl, rounding, full, bounds, qpytorch=False, with_mask=False):
  """The fast path of :func:`_scaled`: its result where every element's result is finite and
  inside the clamp ``bounds`` ((hi, lo) bits, or None: no clamp); elements beyond the bounds
  are clamped (the spec clamps after rounding; an overflow of ``y`` is beyond them too),
  others (NaN, an overflow without clamping) get ``full``. With ``with_mask`` it returns
  (bits, clamp mask or None)."""
  core = _scaled(fl, rounding, qpytorch)
  if core is None:
    return full
  hi_b, lo_b = bounds if bounds else (_U(0x7F7FFFFF), _U(0xFF7FFFFF))
  hi_f, lo_f = float(hi_b.view(np.float32)), float(lo_b.view(np.float32))
  # |x| <= inside: no clamp, no overflow, no NaN. The bounds are multiples of 2**-fl (float32
  # values at least 2**-fl apart there), so x <= hi rounds to at most hi (every rounding here
  # is monotone and moves x by less than 2**-fl), and hi <= |lo|. Without bounds: y = |x| *
  # 2**fl is finite, and a result rounded up stays finite while FLT_MAX is a multiple of the
  # quantum 2**-fl (fl >= -104); for fl < -104 a |x| above FLT_MAX's largest multiple of the
  # quantum, 2**128 - 2**-fl, can round up to 2**128 (inf: the spec's overflow, which the
  # range check below finds; FixedPoint and QPyTorchFixedPoint allow fl >= -100 only).
  if bounds:
    inside = min(int(hi_b & ABS), int(lo_b & ABS))
  elif fl < -104:
    inside = _f32_bits(2.0**128 - 2.0**-fl)
  else:
    inside = (min(254, 254 - fl) << 23) | 0x7FFFFF

  abs0 = _k(ABS)

  def fast(bits, rand):
    if not _ieee_subnormals():
      return full(bits, rand)
    mag = bits & abs0
    if _max(mag) <= inside:
      q = core(bits, rand, mag)
      return (q, None) if with_mask else q
    # an overflow of y (inf, or NaN for stochastic rounding's fraction) gives an infinite
    # result, and a NaN input a NaN: both are found in the result's range below
    with np.errstate(all="ignore"):
      q = core(bits, rand)
    qf = q.view(np.float32)
    if float(np.maximum.reduce(qf)) <= hi_f and float(np.minimum.reduce(qf)) >= lo_f:
      return (q, None) if with_mask else q  # (a NaN fails both comparisons)
    gt = qf > hi_f
    lt = qf < lo_f
    other = ~((qf <= hi_f) | gt | lt)  # NaN
    mask = None
    if bounds:
      q[gt] = hi_b
      q[lt] = lo_b
      mask = gt | lt
    else:
      other |= gt | lt  # beyond float32: an overflow of y
    q = _patch(q, other, (lambda b, r: full(b, r)[0]) if with_mask else full, bits, rand)
    return (q, mask) if with_mask else q

  return fast


def _qpytorch_fixed(fmt: QPyTorchFixedPoint, rounding: str):
  """``QPyTorchFixedPoint.quantize_with_mask``: functions (bits, noise) -> (bits, clamp mask
  or None where nothing was clamped)."""
  fl = fmt.fl
  lo_b, hi_b = (_U(b) for b in fmt.bounds_bits)
  clamp = fmt.clamp
  half = np.float32(0.5)
  hi_key, lo_key = _order_key(hi_b), _order_key(lo_b)

  def clamp_full(q):
    if not clamp:
      return q, None
    notnan = (q & ABS) <= INF
    k = _order_key(q)
    gt = notnan & (k > hi_key)
    lt = notnan & (k < lo_key)
    return np.where(gt, hi_b, np.where(lt, lo_b, q)).astype(_U), gt | lt

  def round_full(bits, rand):
    sgn = bits & SIGN
    mag = bits & ABS
    finite = mag < INF
    y_mag = _ldexp_bits(np.where(finite, mag, ZERO), np.full(mag.shape, fl, _I))
    if rounding == "nearest":
      y = np.where(finite, y_mag | sgn, bits).view(np.float32)
      nb = _half_up_even_odd(y, half)
      nsgn = nb & SIGN
      nmag = nb & ABS
      nfin = nmag < INF
      nmag = np.where(nfin, nmag, ZERO)
      r = _round_to_quantum(nmag, np.full(mag.shape, fl - 149, _I), "nearest")
      qm = _ldexp_bits(r, np.full(mag.shape, -fl, _I))
      return np.where(nfin, qm | nsgn, nb).astype(_U)
    overflow = finite & (y_mag == INF)
    r = _round_to_quantum(np.where(finite, mag, ZERO), np.full(mag.shape, -fl, _I),
                          "stochastic", sgn != 0, rand)
    q = np.where(finite, r | sgn, bits)
    return np.where(overflow, INF | sgn, q).astype(_U)

  @_quiet
  def full(bits, rand):
    return clamp_full(round_full(bits, rand))

  return _scaled_fast(fl, rounding, full, (hi_b, lo_b) if clamp else None, qpytorch=True,
                      with_mask=True), full


def _order_key(bits):
  """uint32 key whose unsigned order is the IEEE order of non-NaN floats (-0 == +0)
  (``jaxlp/torch/_formats.py``)."""
  bits = np.asarray(bits, _U)
  key = np.where((bits & SIGN) != 0, ~bits, bits | SIGN)
  return np.where((bits & ABS) == 0, SIGN, key).astype(_U)


def _half_up_even_odd(y, half):
  """Bits of ``n = nearbyint(fl32(y + 0.5) - 0.5)`` as ``QPyTorchFixedPoint`` defines it:
  ``floor(z)`` for ``z = fl32(y + 0.5)``, minus one where ``z`` is an odd integer; a zero
  result is -0.0 where ``z < 0.5`` (the spec's operations; the fast path computes the same
  with ``rint(z - 0.5)``)."""
  z = y + half
  f = np.floor(z)
  odd = (z == f) & ((f - np.float32(2.0) * np.floor(f * half)) != 0)
  n = np.where(odd, f - np.float32(1.0), f)
  nb = n.view(_U)
  return np.where((nb & ABS) == 0, np.where(z < half, SIGN, ZERO), nb).astype(_U)


def _qpytorch_block_full(bits, mx, rounding, wl, rand):
  """``QPyTorchBlock._quantize_f32`` given each element's block maximum magnitude bits."""
  sgn = bits & SIGN
  negative = sgn != 0
  mag = bits & ABS
  mx_field = (mx >> _SH23).astype(_I)
  e = mx_field - 127
  mode = "nearest_half_up" if rounding == "nearest" else "stochastic"
  pre = _round_to_quantum(mag, e - 21, "nearest", negative)
  q = _round_to_quantum(pre, e + 2 - wl, mode, negative, rand)
  clip = _ldexp_bits(np.full(mag.shape, _f32_bits(2 ** (wl - 1) - 1), _U), e + 2 - wl)
  q = np.where(q >= _pow2_bits(np.clip(e + 1, -149, 128)), clip, q)
  out = q | np.where(negative & (q != 0), SIGN, ZERO)
  rb = bits
  drop = 23 - wl
  if drop == 0:
    pass
  elif rounding == "nearest":
    rb = rb + _U(1 << (22 - wl))
  else:
    rb = rb + ((rand >> _U(32 - drop)) & _U((1 << drop) - 1))
  rb = rb & _U(0xFFFFFFFF ^ ((1 << drop) - 1))
  clip0 = _U(((1 << (wl - 2)) - 1) << (25 - wl)) | (rb & SIGN)
  rb = np.where((rb & EXP) != 0, clip0, rb)
  out = np.where(mx_field == 0, rb, out)
  return np.where(mx < INF, out, QNAN).astype(_U)


def _block_maxima(mag, shape, dim):
  """The block maxima of magnitude bits ``mag`` (flat) for ``qpytorch_block``'s ``dim``: a
  (1,) array (-1: one block), or an array of ``shape`` with 1 on every axis but ``dim``."""
  if dim == -1:
    return np.maximum.reduce(mag, keepdims=True)
  axes = tuple(a for a in range(len(shape)) if a != dim)
  m = mag.reshape(shape)
  return np.maximum.reduce(m, axis=axes, keepdims=True) if axes else m


def _qpytorch_block(fmt: QPyTorchBlock, rounding: str):
  """``QPyTorchBlock._quantize_f32``: functions (flat bits, noise, shape) -> out bits."""
  wl, dim = fmt.wl, fmt.dim

  @_quiet
  def full(bits, rand, shape, mxs=None):
    if mxs is None:
      mxs = _block_maxima(bits & ABS, shape, dim)
    mx = np.broadcast_to(mxs, shape if dim != -1 else bits.shape).reshape(-1)
    return _qpytorch_block_full(bits, mx, rounding, wl, rand)

  # Fast path: every block maximum finite with its exponent E in [-100, 124]. There
  # QPyTorch's float arithmetic, which the spec reproduces with integer operations, is exact:
  # the rebase constant 6 * 2**E is a finite float32 and v = fl32(x + 6 * 2**E) (in [2**(E+2),
  # 2**(E+3)] <= 2**127) is the spec's pre-rounded x (to nearest even onto 2**(E - 21)) plus
  # that constant; |v - 6 * 2**E| is exact. Nearest: rounding v's pattern half up onto
  # 2**(E + 2 - wl) is the spec's ties-toward-+inf rounding (v > 0), and v' - 6 * 2**E is
  # exact (+0.0 for a zero, as the spec). Stochastic: the spec rounds the pre-rounded
  # magnitude, whose quotient by the step is exact, as fixed point's fast path does. Every
  # nonzero result is at least 2**(E + 2 - wl) >= 2**-121 (normal); a subnormal x is far
  # below half a unit of v's last place, so flush-to-zero cannot change v.
  drop = 23 - wl
  add = _k(1 << (drop - 1) if drop else 0)
  keep = _k(0xFFFFFFFF ^ ((1 << drop) - 1))
  cv = _kf(2 ** (wl - 1) - 1)
  abs0, two32, zero_f = _k(ABS), _kf(_TWO32), _kf(0.0)
  step_scale = np.float32(2.0 ** (2 - wl))
  inv_scale = np.float32(2.0 ** (wl - 2))

  def fast(bits, rand, shape):
    if dim == -1:
      return whole(bits, rand, shape)
    mxs = _block_maxima(bits & ABS, shape, dim)
    if (int(np.maximum.reduce(mxs, axis=None)) >= (252 << 23)
        or int(np.minimum.reduce(mxs, axis=None)) < (27 << 23)):
      return full(bits, rand, shape, mxs)
    e_bits = mxs & EXP  # 2**E
    base = (e_bits + _U(0x01400000)).view(np.float32)  # 6 * 2**E = 1.5 * 2**(E + 2)
    x = bits.view(np.float32)
    if dim != -1:
      x = x.reshape(shape)
    if rounding == "nearest":
      lim = (e_bits.view(np.float32) * step_scale) * cv  # (2**(wl-1) - 1) * 2**(E+2-wl)
      v = x + base
      if drop:
        vb = v.view(_U)
        vb += add
        vb &= keep
      v -= base
      np.minimum(v, lim, out=v)
      np.maximum(v, -lim, out=v)
      return v.view(_U).reshape(-1)
    # stochastic: k = floor(|pre| / step) (+1 with probability frac), clipped at 2**(wl-1)-1
    inv_step = (_U(254 << 23) - e_bits).view(np.float32) * inv_scale  # 2**-(E + 2 - wl)
    y = x + base
    y -= base
    np.abs(y, out=y)
    y *= inv_step
    n = np.floor(y)
    y -= n
    y *= two32
    n += rand.reshape(n.shape) < y.astype(_U)
    np.minimum(n, cv, out=n)
    n *= (e_bits.view(np.float32) * step_scale)  # * 2**(E + 2 - wl)
    np.copysign(n, x, out=n)
    n += zero_f  # the sign where the result is not zero: -0.0 + 0.0 = +0.0, others exact
    return n.view(_U).reshape(-1)

  @functools.lru_cache(maxsize=256)
  def whole_consts(e):
    """(6 * 2**E, 2**-(E + 2 - wl), 2**(E + 2 - wl), (2**(wl-1) - 1) * 2**(E + 2 - wl)): 0-d
    float32 constants of a block maximum's exponent E."""
    step = 2.0 ** (e + 2 - wl)
    return (_kf(6.0 * 2.0**e), _kf(2.0 ** (wl - 2 - e)), _kf(step),
            _kf((2 ** (wl - 1) - 1) * step))

  def whole(bits, rand, shape):
    # dim = -1: the same operations with the one block's constants as scalars, and (nearest)
    # the clip only where the largest magnitude could round up to 2**(E + 1)
    x = bits.view(np.float32)
    mag = bits & abs0
    m = abs(x.item(mag.argmax()))  # the largest magnitude (a NaN's bits are larger: fails)
    if not 2.0**-100 <= m < 2.0**125:
      return full(bits, rand, shape)
    e = math.frexp(m)[1] - 1  # E = floor(log2 m), exact
    base, inv_step, step, lim = whole_consts(e)
    if rounding != "nearest":
      # |pre| = fl32(|x| + 6 * 2**E) - 6 * 2**E: the pre-rounding (to nearest even onto a grid
      # that 6 * 2**E lies on) is symmetric, so it may round the magnitude
      y = mag.view(np.float32)
      y += base
      y -= base
      y *= inv_step
      n = np.floor(y)
      y -= n
      y *= two32
      n += rand < y.astype(_U)
      np.minimum(n, cv, out=n)
      n *= step
      np.copysign(n, x, out=n)
      n += zero_f  # the sign where the result is not zero: -0.0 + 0.0 = +0.0, others exact
      return n.view(_U)
    v = x + base
    if drop:
      vb = v.view(_U)
      vb += add
      vb &= keep
    v -= base
    if m >= 2.0 ** (e + 1) - float(step):
      np.minimum(v, lim, out=v)
      np.maximum(v, -lim, out=v)
    return v.view(_U)

  return fast, full


_ELEMENTWISE = {FloatFormat: _float_format, QPyTorchFloat: _qpytorch_float,
                CPDFloat: _cpd_float, FixedPoint: _fixed_point}


@functools.lru_cache(maxsize=256)
def plan(fmt, rounding: str):
  """``(kind, fast, full)`` for ``fmt`` and ``rounding``, or None where this path does not
  apply. ``kind``: "elementwise" (functions of flat uint32 bits and noise words returning
  bits), "mask" (``QPyTorchFixedPoint``: they return (bits, clamp mask or None)) or "block"
  (``qpytorch_block``: they also take the shape). ``fast`` gives ``full``'s bits everywhere;
  ``full`` is the line-by-line port (tests check both against the spec)."""
  if rounding not in getattr(fmt, "supported_roundings", ()):
    return None
  make = _ELEMENTWISE.get(type(fmt))
  if make is not None:
    kind = "elementwise"
  elif type(fmt) is QPyTorchFixedPoint:
    kind, make = "mask", _qpytorch_fixed
  elif type(fmt) is QPyTorchBlock:
    kind, make = "block", _qpytorch_block
  else:
    return None
  fast, full = make(fmt, rounding)
  return kind, fast, full


# --------------------------------------------------------------------------------------------
# Tensors in and out
# --------------------------------------------------------------------------------------------
def _bits_of(x):
  """Flat uint32 float32 patterns of contiguous CPU tensor ``x`` (a view for float32; float16
  and bfloat16 widen exactly, as XLA:CPU's ``astype``: a float16 NaN keeps its payload and
  gets the quiet bit, a bfloat16 one is shifted as it is)."""
  dt = x.dtype
  if dt is torch.float32:
    return x.numpy().view(_U).reshape(-1)
  if dt is torch.bfloat16:
    return x.view(torch.int16).numpy().view(np.uint16).reshape(-1).astype(_U) << _U(16)
  h = x.numpy().view(np.uint16).reshape(-1)
  bits = h.view(np.float16).astype(np.float32).view(_U)
  nan = (h & np.uint16(0x7FFF)) > np.uint16(0x7C00)
  if nan.any():  # XLA sets the quiet bit of a NaN it widens (NumPy keeps a signalling one)
    bits[nan] |= _U(0x00400000)
  return bits


def _tensor_of(out, dtype, shape):
  """A CPU tensor of ``dtype`` and ``shape`` from flat float32 bit patterns ``out`` (narrowed
  to nearest even, as XLA:CPU's ``astype``: a NaN keeps its payload's top bits and gets the
  quiet bit (float16), or becomes the canonical quiet NaN with its sign (bfloat16)).

  NaN payloads are XLA's only as far as XLA's own conversions are consistent: a NaN that
  the spec passes through unchanged (``cpd_float``) can come back from XLA's fused program
  with another payload (tests compare half-precision NaNs as NaNs)."""
  if dtype is torch.float32:
    return torch.from_numpy(out.view(np.float32).reshape(shape))
  if dtype is torch.float16:
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float16's range: +-inf
      h = out.view(np.float32).astype(np.float16).view(np.uint16)
    nan = (h & np.uint16(0x7FFF)) > np.uint16(0x7C00)
    if nan.any():  # XLA sets the quiet bit of a NaN it narrows
      h[nan] |= np.uint16(0x0200)
    return torch.from_numpy(h.view(np.int16).reshape(shape)).view(torch.float16)
  r = out + _U(0x7FFF)
  r += (out >> _U(16)) & ONE
  h = r >> _U(16)
  nan = (out & ABS) > INF
  if nan.any():  # XLA:CPU's conversion: the sign and the canonical quiet NaN
    h[nan] = ((out[nan] >> _U(16)) & _U(0x8000)) | _U(0x7FC0)
  return torch.from_numpy(h.astype(np.uint16).view(np.int16).reshape(shape)).view(
      torch.bfloat16)


def quantize(t, fmt, rounding: str, words, with_mask: bool = False):
  """CPU tensor ``t`` rounded to ``fmt`` in NumPy: the tensor (``(q, mask)`` for
  ``QPyTorchFixedPoint`` with ``with_mask``), or None where this path does not apply (the
  caller then takes the JAX route). ``words``: the uint32[2] key data of a stochastic call.

  The caller has checked ``t``'s dtype and layout (float32, float16 or bfloat16, strided)."""
  hit = _RUNNERS.get((id(fmt), rounding))
  if hit is not None and hit[0] is fmt:
    run = hit[1]
  else:
    run = runner(fmt, rounding)
    if len(_RUNNERS) >= 1024:
      _RUNNERS.clear()
    _RUNNERS[(id(fmt), rounding)] = (fmt, run)
  return None if run is None else run(t, words, with_mask)


# (id(fmt), rounding) -> (fmt, runner): the runner of a format object seen before, without
# hashing the dataclass; the entry holds the format, so its id cannot be reused meanwhile
_RUNNERS: dict = {}


_F32 = torch.float32


@functools.lru_cache(maxsize=256)
def runner(fmt, rounding: str):
  """The function ``(tensor, key words, with_mask) -> result or None`` of ``fmt`` and
  ``rounding`` (None where this path does not apply), specialised once per format."""
  p = plan(fmt, rounding)
  if p is None:
    return None
  kind, fast, _ = p
  stochastic = rounding == "stochastic"
  block_dim = fmt.dim if kind == "block" else None

  def run(t, words, with_mask):
    if with_mask and kind != "mask":
      return None
    if stochastic and not _stochastic_supported():
      return None
    if t.requires_grad:
      t = t.detach()
    if t.is_neg():
      t = t.resolve_neg()
    if not t.is_contiguous():
      t = t.contiguous()
    dt = t.dtype
    if dt is _F32:
      a = t.numpy()
      bits = a.view(_U)
      if a.ndim != 1:
        bits = bits.reshape(-1)
    elif dt is not torch.float16 and dt is not torch.bfloat16:
      return None  # the JAX route raises the dtype error
    else:
      a = None
      bits = _bits_of(t)
    n = bits.size
    if n == 0 or (block_dim is not None and block_dim >= t.dim()):
      # nothing to round / the JAX route raises the dim error
      if block_dim is not None and n and block_dim >= t.dim():
        return None
      out = t.clone()
      return (out, torch.zeros(t.shape, dtype=torch.bool)) if with_mask else out
    rand = None
    if stochastic:
      if n > MAX_ELEMENTS:
        return None
      rand = _rand(n, words)
    mask = None
    if kind == "elementwise":
      out = fast(bits, rand)
    elif kind == "block":
      out = fast(bits, rand, tuple(t.shape))
    else:
      out, mask = fast(bits, rand)
    if a is not None:
      o = out.view(np.float32)
      q = torch.from_numpy(o if a.ndim == 1 else o.reshape(a.shape))
    else:
      q = _tensor_of(out, dt, t.shape)
    if not with_mask:
      return q
    if mask is None:
      return q, torch.zeros(t.shape, dtype=torch.bool)
    return q, torch.from_numpy(mask.reshape(t.shape))

  return run


def _rand(n: int, words) -> np.ndarray:
  """The noise words of ``n`` elements under key data ``words``: a tuple of ints (a fresh
  draw, new at every call: its key words are not cached) or a uint32[2] array (a seed's,
  whose key words repeat: :func:`key_words`)."""
  c = _cnoise
  if type(words) is tuple:
    if c is not None:
      rand = np.empty(n, _U)
      c.fill_drawn(rand, *words)
      return rand
    k0, k1 = _threefry_words(*words)
  else:
    k0, k1 = key_words(int(words[0]), int(words[1]))
  if c is not None:
    rand = np.empty(n, _U)
    c.fill(rand, k0, k1)
    return rand
  return noise(n, k0, k1)


def _stochastic_supported() -> bool:
  """Whether the noise here is the spec's: ``jax.random.bits`` of the key data is computed
  as Threefry-2x32 in JAX's partitionable scheme (the default configuration)."""
  c = jax.config
  return c.jax_default_prng_impl == "threefry2x32" and bool(c.jax_threefry_partitionable)
