"""Bit-packing of values on a low-precision grid into 8/16-bit words (the wire payload).

A value already rounded to an elementwise float-like format is encoded losslessly in the
format's own sign/exponent/fraction layout; codes the format leaves unused (e.g. the
inf/NaN binade) carry the special values it can produce (±inf, NaN, CPD's finite
``2**(bias+1)``). If there are not enough spare codes one more exponent bit is used.
Formats whose code does not fit in 16 bits, and non-float formats, are sent as float32.
NaN payloads are canonicalised (any NaN decodes to the quiet NaN ``0x7FC00000``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats import _bits as B
from jaxlp.formats._compat import CPDFloat, QPyTorchFloat
from jaxlp.formats._float_format import FloatFormat


@dataclasses.dataclass(frozen=True)
class Codec:
  """Layout of one packed code: sign | field (``ebits``) | fraction (``m``)."""

  m: int
  emin: int  # unbiased exponent of field 1
  ebits: int
  subnormals: bool
  max_code: int  # largest magnitude code holding a finite value
  specials: tuple  # ((code, float32 bits), ...) for special values
  dtype: object

  @property
  def nbits(self):
    return 1 + self.ebits + self.m

  def encode(self, x):
    """Code of each value (values must be on the format's grid, or special)."""
    if self.m <= 10:
      return self._encode_lut(x)
    return self._encode_arith(x)

  def decode(self, code):
    """float32 value of each code (a table lookup)."""
    table = jnp.asarray(_decode_table(self))
    return jnp.take(table, code.astype(jnp.int32), mode="clip")

  def _encode_lut(self, x):
    # A grid value has at most m significant fraction bits, so bits >> (23 - m) indexes it.
    sh = 23 - self.m
    table = jnp.asarray(_encode_table(self))
    bits = B.to_bits(x)
    code = jnp.take(table, (bits >> sh).astype(jnp.int32), mode="clip")
    nan = [c for c, sb in self.specials if sb == B.QNAN_BITS]
    if nan:
      code = jnp.where(B.is_nan_mag(bits & B.u32(B.ABS_MASK)), jnp.asarray(nan[0], self.dtype),
                       code)
    return code

  def _encode_arith(self, x):
    bits = B.to_bits(x)
    sign = (bits >> 31).astype(B.U32)
    mag = bits & B.u32(B.ABS_MASK)
    m = self.m
    e = B.floor_log2(mag)
    normal = e >= self.emin
    field = jnp.where(normal, e - self.emin + 1, 0).astype(B.U32)
    frac_n = (mag >> B.u32(23 - m)) & B.u32((1 << m) - 1)
    # Subnormal of the format: integer multiple of 2^(emin - m).
    f32field = (mag >> 23).astype(B.I32)
    sig = jnp.where(f32field > 0, (mag & B.u32(B.FRAC_MASK)) | B.u32(0x800000),
                    mag & B.u32(B.FRAC_MASK))
    sh = (jnp.maximum(f32field, 1) - 150) - (self.emin - m)
    frac_s = jnp.where(sh >= 0, sig << jnp.clip(sh, 0, 31).astype(B.U32),
                       sig >> jnp.clip(-sh, 0, 31).astype(B.U32))
    frac = jnp.where(normal, frac_n, frac_s)
    code = (sign << B.u32(self.nbits - 1)) | (field << B.u32(m)) | frac
    for c, sb in self.specials:
      if sb == B.QNAN_BITS:
        hit = B.is_nan_mag(mag)
      else:
        hit = bits == B.u32(sb)
      code = jnp.where(hit, B.u32(c), code)
    return code.astype(self.dtype)

  def _decode_arith(self, code):
    code = code.astype(B.U32)
    m = self.m
    sign = (code >> B.u32(self.nbits - 1)) & B.u32(1)
    field = ((code >> B.u32(m)) & B.u32((1 << self.ebits) - 1)).astype(B.I32)
    frac = code & B.u32((1 << m) - 1)
    nb = (((field - 1 + self.emin + 127).astype(B.U32)) << 23) | (frac << B.u32(23 - m))
    sb = B.ldexp_bits(B.to_bits(frac.astype(jnp.float32)), jnp.int32(self.emin - m))
    mag = jnp.where(field == 0, sb, nb)
    out = mag | (sign << 31)
    for c, sbits in self.specials:
      out = jnp.where(code == B.u32(c), B.u32(sbits), out)
    return B.from_bits(out)


# The lookup tables are built once per codec by one compiled call each (built op by op at
# trace time they cost one small XLA compile per op, seconds per traced reduction on CPU).
@functools.cache
def _decode_table(codec: Codec) -> np.ndarray:
  with jax.ensure_compile_time_eval():
    return np.asarray(jax.jit(codec._decode_arith)(np.arange(1 << codec.nbits, dtype=np.uint32)))


@functools.cache
def _encode_table(codec: Codec) -> np.ndarray:
  """Code of each float32 grid value, indexed by its bits >> (23 - m) (m <= 10)."""
  rep = np.arange(1 << (9 + codec.m), dtype=np.uint32) << np.uint32(23 - codec.m)
  with jax.ensure_compile_time_eval():
    return np.asarray(jax.jit(lambda r: codec._encode_arith(B.from_bits(r)))(rep))


def _layout(fmt):
  """(m, emin, normal binades, top-binade max fraction, has -0, specials to carry) or None."""
  if isinstance(fmt, FloatFormat):
    if not fmt.subnormals:
      subn = False
    else:
      subn = True
    nbin = fmt.emax_field
    specials = [B.QNAN_BITS]
    if fmt.has_inf:
      specials += [B.INF_BITS, B.INF_BITS | B.SIGN_MASK]
    return (fmt.man_bits, fmt.emin, nbin, fmt.max_man_code, fmt.has_negative_zero, subn,
            specials)
  if isinstance(fmt, CPDFloat):
    e, m, bias = fmt.exp_bits, fmt.man_bits, fmt.bias
    specials = [B.QNAN_BITS, B.INF_BITS, B.INF_BITS | B.SIGN_MASK]
    if bias + 1 <= 127:
      big = (bias + 1 + 127) << 23
      specials += [big, big | B.SIGN_MASK]
    return (m, 1 - bias, 2**e - 2, 2**m - 1, True, True, specials)
  if isinstance(fmt, QPyTorchFloat):
    e, m = fmt.exp_bits, fmt.man_bits
    if m == 23:
      return None
    min_exp = 2 - 2 ** (e - 1)
    nbin = 2**e - 1
    if min_exp + nbin - 1 > 127:  # exp=8: the top binade does not exist in float32
      nbin = 127 - min_exp + 1
    specials = [B.QNAN_BITS, B.INF_BITS, B.INF_BITS | B.SIGN_MASK]
    return (m, min_exp, nbin, 2**m - 1, True, True, specials)
  return None


def codec_for(fmt):
  """The packing codec of ``fmt``, or None if it is sent as float32."""
  lay = _layout(fmt)
  if lay is None:
    return None
  m, emin, nbin, max_frac, has_neg0, subn, specials = lay
  ebits = max(1, int(nbin).bit_length())
  while True:
    nbits = 1 + ebits + m
    if nbits > 16:
      return None
    max_code = (nbin << m) | max_frac
    free_pos = list(range(max_code + 1, 1 << (ebits + m)))
    sign_bit = 1 << (ebits + m)
    free_neg = [sign_bit | c for c in free_pos]
    if not has_neg0:
      free_neg = [sign_bit] + free_neg
    assigned = []
    ok = True
    for sb in specials:
      pool = free_neg if (sb & B.SIGN_MASK) and sb != B.QNAN_BITS else free_pos
      if not pool:
        pool = free_neg if pool is free_pos else free_pos
      if not pool:
        ok = False
        break
      assigned.append((pool.pop(0), sb))
    if ok:
      dtype = jnp.uint8 if nbits <= 8 else jnp.uint16
      return Codec(m, emin, ebits, subn, max_code, tuple(assigned), dtype)
    ebits += 1


# ---------------------------------------------------------------------------------------------
# Integer codes of block floating point (BlockFormat(m, axis=...)) on the wire, branch-free.
#
# A block with shared exponent e has the quantum 2^qe, qe = e - m, and its elements are the
# sign-magnitude integers k = min(rne(|x| / 2^qe), 2^m - 1) (rne: round half to even), i.e.
# exactly the integers of BlockFormat's nearest rounding (round to a multiple of 2^qe, then
# saturate at 2^e - 2^qe). The functions below compute k from the float32 bits and k * 2^qe
# back, with a handful of integer ops per element and no float arithmetic on values that may
# be subnormal (XLA:CPU flushes those), so they give the same bits as the general
# ``scale_pow2`` emulation for every input, on every backend.

def bfp_codes(mag, qe, man_bits: int):
  """``min(rne(|x| / 2**qe), 2**man_bits - 1)`` (uint32) of finite float32 magnitude bits.

  Args:
    mag: uint32 magnitude bits (sign cleared) of finite values.
    qe: int32 quantum exponent (broadcastable), any value.
    man_bits: the saturation bound's bits, 1..24.

  Returns:
    uint32 k. With |x| = sig * 2^lsb (sig the 24-bit significand, lsb = max(field, 1) - 150)
    and d = qe - lsb dropped bits: k = rne(sig / 2^d) for d > 0 (the carry of
    ``sig + 2^(d-1) - 1 + bit d of sig`` decides ties to even; d >= 25 gives 0), and
    ``sig << -d`` (exact; past 32 bits: saturated) for d <= 0; then the saturation.
  """
  field = mag >> B.u32(23)
  sig = jnp.where(field > 0, (mag & B.u32(B.FRAC_MASK)) | B.u32(0x800000), mag)
  d = jnp.asarray(qe, B.I32) - (jnp.maximum(field.astype(B.I32), 1) - 150)
  dc = jnp.clip(d, 1, 31).astype(B.U32)
  half = B.u32(1) << (dc - B.u32(1))
  k = (sig + (half - B.u32(1)) + ((sig >> dc) & B.u32(1))) >> dc
  top = B.u32((1 << man_bits) - 1)
  up = jnp.clip(-d, 0, 31).astype(B.U32)
  k_up = jnp.where(sig > (B.u32(0xFFFFFFFF) >> up), top, sig << up)  # saturate, no wrap
  return jnp.minimum(jnp.where(d > 0, k, k_up), top)


def bfp_values(k, qe):
  """Magnitude bits of ``k * 2**qe`` rounded to float32 (nearest even), as
  ``scale_pow2(float(k), qe)``, for uint32 ``k < 2**24`` and int32 ``qe`` (broadcastable).

  ``float(k)`` is exact; a normal result moves its exponent field by ``qe``; a subnormal one
  is ``k << (qe + 149)`` (exact: ``qe >= -149``) or, for ``qe < -149``, ``k`` shifted right by
  ``-149 - qe`` with ties to even; past float32's range: +inf.
  """
  qe = jnp.asarray(qe, B.I32)
  kb = B.to_bits(k.astype(jnp.float32))
  nf = (kb >> B.u32(23)).astype(B.I32) + qe  # the result's exponent field if normal
  normal = kb.astype(B.I32) + (qe << 23)
  sh_up = jnp.clip(qe + 149, 0, 31).astype(B.U32)
  sh_dn = jnp.clip(-149 - qe, 1, 31).astype(B.U32)
  down = (k + ((B.u32(1) << (sh_dn - B.u32(1))) - B.u32(1)) + ((k >> sh_dn) & B.u32(1))) >> sh_dn
  sub = jnp.where(qe >= -149, k << sh_up, down)
  out = jnp.where((k != 0) & (nf >= 1), normal.astype(B.U32), sub)
  return jnp.where((k != 0) & (nf >= 255), B.u32(B.INF_BITS), out)


def max_last(x):
  """``jnp.max(x, axis=-1)`` of an integer array by pairwise halving (elementwise maxima of the
  two halves, log2(n) steps). The same values; on XLA:CPU a reduce over a short minor axis is
  not vectorised (the block max of 2.4M magnitude bits in blocks of 64: 3.7-5.6 ms, halving
  0.8 ms)."""
  n = x.shape[-1]
  if n == 0:
    return jnp.zeros(x.shape[:-1], x.dtype)
  while n > 1:
    h = n // 2
    top = jnp.maximum(x[..., :h], x[..., h:2 * h])
    x = jnp.concatenate([top, x[..., 2 * h:]], axis=-1) if n % 2 else top
    n = x.shape[-1]
  return x[..., 0]
