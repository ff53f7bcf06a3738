"""IEEE 754 binary32 multiplication and division, correctly rounded, with integer ops only.

``mul_mag(a, b)`` and ``div_mag(a, b)`` return the bits of ``fl32(a * b)`` and
``fl32(a / b)`` (round to nearest, ties to even, gradual underflow, overflow to +inf) for the
magnitude bits of finite non-negative float32 values. They exist because the float
arithmetic of the backends is not IEEE everywhere:

* XLA on CPU flushes float32 subnormals (inputs and results) to zero;
* Triton's NVIDIA backend lowers an f32 ``/`` to ``div.full.f32``, an approximation with up
  to 2 ulp of error (checked on this project's sm_90 compile path), so a Pallas kernel that
  divides would not have the bits of the same division under XLA.

With integer ops only, a formula such as NVFP4's scale chain gives the same bits in the spec,
in the Pallas kernel (interpreted or compiled by Triton) and in a float32 reference that runs
with gradual underflow (numpy, PyTorch on CPU). Everything is elementwise on ``uint32`` /
``int32`` arrays and broadcasts.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxlp.formats import _bits as B

U32 = jnp.uint32
I32 = jnp.int32


def normalize(mag):
  """``(sig, e)`` with ``mag``'s value ``= sig * 2**(e - 23)``, ``sig`` in ``[2**23, 2**24)``.

  ``mag``: uint32 magnitude bits of finite values; float32 subnormals are normalized (their
  top set bit moved to bit 23). Zero gives ``sig = 0`` (and ``e = -150``).
  """
  field = (mag >> 23).astype(I32)
  frac = mag & B.u32(B.FRAC_MASK)
  e = B.floor_log2(mag)
  sh = jnp.clip(-126 - e, 0, 23).astype(U32)  # a subnormal's top bit p = e + 149 goes to 23
  sig = jnp.where(field > 0, frac | B.u32(1 << 23), frac << sh)
  return sig, e


def pack_rne(m, e, sticky, top=None):
  """Bits of the float32 nearest (ties to even) to ``(m + t) * 2**e``, ``t`` in ``[0, 1)``.

  Args:
    m: uint32 integer significand, ``0 <= m < 2**31``; at least 24 significant bits
      wherever ``sticky`` can be set (every caller here gives 24..30).
    e: int32 exponent of ``m``'s least significant bit.
    sticky: bool, True where ``t > 0`` (bits below ``m`` that were dropped).
    top: the index of ``m``'s top set bit (int32) where the caller knows it cheaply; None
      computes it.

  Returns:
    uint32 float32 bits: normal, subnormal (gradual underflow) or +inf on overflow; zero
    where ``m == 0``.
  """
  m = jnp.asarray(m, U32)
  e = jnp.asarray(e, I32)
  t = B.top_bit(m) if top is None else top
  big_e = t + e  # exponent of the leading bit
  qe = jnp.maximum(big_e, -126) - 23  # exponent of the result's last place
  d = jnp.maximum(qe - e, 0)  # bits of m below the last place (>= 0 for every caller here)
  dc = jnp.minimum(d, 31).astype(U32)
  kept = m >> dc
  rem = m & ((B.u32(1) << dc) - B.u32(1))
  half = (B.u32(1) << dc) >> B.u32(1)
  odd = (kept & B.u32(1)) != 0
  up = (rem > half) | ((rem == half) & (sticky | odd))
  up = up & (d > 0) & (d <= 31)  # d >= 32: the value is below half the last place
  kept = kept + up.astype(U32)
  # kept * 2**qe with qe >= -149: bits = (qe + 149) << 23 + kept (a carry out of the
  # significand ripples into the exponent field; field 0 holds the subnormals)
  bits = ((qe + 149).astype(U32) << B.u32(23)) + kept
  bits = jnp.where(bits >= B.u32(B.INF_BITS), B.u32(B.INF_BITS), bits)
  return jnp.where(m == 0, B.u32(0), bits)


def mul_sig(sa, ea, sb, eb):
  """Bits of ``fl32(a * b)`` from :func:`normalize`'d operands ``(sa, ea)``, ``(sb, eb)``.

  The 48-bit product of the two 24-bit significands is formed from 12-bit limbs (every
  partial product below 2**24), then rounded once by :func:`pack_rne`. A zero operand
  (``sig = 0``) gives 0.
  """
  m12 = B.u32(0xFFF)
  a1, a0 = sa >> B.u32(12), sa & m12
  b1, b0 = sb >> B.u32(12), sb & m12
  mid = a0 * b1 + a1 * b0  # < 2**25
  low = a0 * b0 + ((mid & m12) << B.u32(12))  # < 2**25
  hi = a1 * b1 + (mid >> B.u32(12)) + (low >> B.u32(24))  # product >> 24, < 2**24
  low = low & B.u32(0xFFFFFF)  # product mod 2**24
  m = (hi << B.u32(6)) | (low >> B.u32(18))  # product >> 18: top bit 28 or 29
  sticky = (low & B.u32(0x3FFFF)) != 0
  top = 28 + (m >> B.u32(29)).astype(I32)
  out = pack_rne(m, ea + eb - 28, sticky, top)
  return jnp.where((sa == 0) | (sb == 0), B.u32(0), out)


def mul_mag(a, b):
  """Bits of ``fl32(a * b)`` for finite non-negative float32 magnitude bits ``a``, ``b``."""
  return mul_sig(*normalize(a), *normalize(b))


def mul_narrow(q, k: int, sb, eb):
  """Bits of ``fl32(q * b)`` where the float32 magnitude bits ``q`` are normal with at most
  ``k + 1`` significant bits (``k <= 6``, static; e.g. an E2M1 value) or zero, and ``b`` is
  :func:`normalize`'d: one small integer product, no limbs."""
  c = ((q & B.u32(B.FRAC_MASK)) >> B.u32(23 - k)) | B.u32(1 << k)  # q = c * 2**(eq - k)
  eq = (q >> B.u32(23)).astype(I32) - 127
  m = c * sb  # < 2**(k + 25) <= 2**31
  top = (23 + k) + (m >> B.u32(24 + k)).astype(I32)
  out = pack_rne(m, eq - k + eb - 23, False, top)
  return jnp.where((q == 0) | (sb == 0), B.u32(0), out)


def narrow_bits(v: float) -> int | None:
  """``k`` such that the float32 constant ``v > 0`` has at most ``k + 1`` significant bits,
  if ``k <= 4`` (a divisor :func:`div_narrow` takes), else None."""
  bits = B.f32_bits(v)
  if not 0 < (bits >> 23) < 255:  # zero, subnormal or not finite
    return None
  sig = bits & B.FRAC_MASK
  k = 24 - (sig & -sig).bit_length() if sig else 0
  return k if k <= 4 else None


def div_narrow(a, b, k: int, *, fence=None):
  """Bits of ``fl32(a / b)`` for finite non-negative magnitude bits ``a`` and a non-zero
  divisor ``b`` whose significand has at most ``k + 1`` significant bits (``k <= 4``,
  static): an integer division of ``a``'s significand (shifted to give 26-27 quotient bits)
  by ``b``'s ``k + 1``-bit one. ``b`` may be a Python float (a constant divisor, which the
  compiler turns into a multiplication) or bits (e.g. a UE4M3 or E8M0 scale). ``fence``: as
  in :func:`div_mag`."""
  if not 0 <= k <= 4:
    raise ValueError(f"div_narrow: k must be in 0..4, got {k}")
  sa, ea = normalize(a)
  if fence is not None:
    sa, ea = fence((sa, ea))
  if isinstance(b, float):
    bits = B.f32_bits(b)
    d, eb = ((bits & B.FRAC_MASK) | (1 << 23)) >> (23 - k), (bits >> 23) - 127
  else:
    sb, eb = normalize(b)
    d = sb >> B.u32(23 - k)  # b = d * 2**(eb - k), 2**k <= d < 2**(k + 1)
  n = sa << B.u32(k + 3)  # < 2**31
  q = n // d  # in [2**25, 2**27)
  rem = n - q * d
  top = 25 + (q >> B.u32(26)).astype(I32)
  out = pack_rne(q, ea - eb - 26, rem != 0, top)
  return jnp.where(a == 0, B.u32(0), out)


def div_mag(a, b, *, fence=None):
  """Bits of ``fl32(a / b)`` for finite non-negative float32 magnitude bits, ``b != 0``.

  Long division of the 24-bit significands in base 2**8 with integer divisions (each
  numerator ``r * 2**8 < 2**32`` over the 24-bit divisor gives 8 exact quotient bits), to
  ``floor(sa * 2**26 / sb)`` -- 26 or 27 bits -- with the remainder as sticky bit, rounded
  once by :func:`pack_rne`. No float division (Triton's is approximate, and the backend's
  op allow-list has none). ``fence``: applied to the normalized operands (see
  :func:`jaxlp.formats._bits.fence`; None: nothing).
  """
  sa, ea = normalize(a)
  sb, eb = normalize(b)
  if fence is not None:
    sa, ea, sb, eb = fence((sa, ea, sb, eb))
  sb = jnp.maximum(sb, B.u32(1))  # b == 0 is the caller's to exclude; no division by 0
  q = jnp.zeros(jnp.broadcast_shapes(jnp.shape(sa), jnp.shape(sb)), U32)
  r = sa
  for bits in (8, 8, 8, 2):  # quotient digits of 8, 8, 8 and 2 bits: sa * 2**26 / sb
    n = r << B.u32(bits)
    d = n // sb
    r = n - d * sb
    q = (q << B.u32(bits)) | d
  top = 25 + (q >> B.u32(26)).astype(I32)
  out = pack_rne(q, ea - eb - 26, r != 0, top)
  return jnp.where(a == 0, B.u32(0), out)
