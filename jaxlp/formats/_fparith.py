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
from jax import lax

from jaxlp.formats import _bits as B

U32 = jnp.uint32
I32 = jnp.int32
#: The number of quotient bits :func:`div_mag` computes (>= 26: 24 kept, a guard bit, and
#: a 27th bit when the significand quotient is >= 1).
_QUOTIENT_BITS = 27


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


def pack_rne(m, e, sticky):
  """Bits of the float32 nearest (ties to even) to ``(m + t) * 2**e``, ``t`` in ``[0, 1)``.

  Args:
    m: uint32 integer significand, ``0 <= m < 2**31``; at least 24 significant bits
      wherever ``sticky`` can be set (every caller here gives 24..30).
    e: int32 exponent of ``m``'s least significant bit.
    sticky: bool, True where ``t > 0`` (bits below ``m`` that were dropped).

  Returns:
    uint32 float32 bits: normal, subnormal (gradual underflow) or +inf on overflow; zero
    where ``m == 0``.
  """
  m = jnp.asarray(m, U32)
  e = jnp.asarray(e, I32)
  t = B.top_bit(m)
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


def mul_mag(a, b):
  """Bits of ``fl32(a * b)`` for finite non-negative float32 magnitude bits ``a``, ``b``.

  The 48-bit product of the two 24-bit significands is formed from 12-bit limbs (every
  partial product below 2**24), then rounded once by :func:`pack_rne`.
  """
  sa, ea = normalize(a)
  sb, eb = normalize(b)
  m12 = B.u32(0xFFF)
  a1, a0 = sa >> B.u32(12), sa & m12
  b1, b0 = sb >> B.u32(12), sb & m12
  mid = a0 * b1 + a1 * b0  # < 2**25
  low = a0 * b0 + ((mid & m12) << B.u32(12))  # < 2**25
  hi = a1 * b1 + (mid >> B.u32(12)) + (low >> B.u32(24))  # product >> 24, < 2**24
  low = low & B.u32(0xFFFFFF)  # product mod 2**24
  m = (hi << B.u32(6)) | (low >> B.u32(18))  # product >> 18: 28 or 29 significant bits
  sticky = (low & B.u32(0x3FFFF)) != 0
  out = pack_rne(m, ea + eb - 28, sticky)
  return jnp.where((a == 0) | (b == 0), B.u32(0), out)


def div_mag(a, b):
  """Bits of ``fl32(a / b)`` for finite non-negative float32 magnitude bits, ``b != 0``.

  Restoring long division of the 24-bit significands to 27 quotient bits plus a sticky bit
  from the remainder, rounded once by :func:`pack_rne`.
  """
  sa, ea = normalize(a)
  sb, eb = normalize(b)
  shape = jnp.broadcast_shapes(jnp.shape(sa), jnp.shape(sb))

  def step(_, rq):
    r, q = rq
    bit = r >= sb
    return jnp.where(bit, r - sb, r) << B.u32(1), (q << B.u32(1)) | bit.astype(U32)

  # A loop, not unrolled: its results are materialized, so XLA cannot fuse (and recompute)
  # the division into a broadcasting consumer -- a block scale used by 16 elements was
  # recomputed 16 times and the fused program took minutes to compile (measured).
  r, q = lax.fori_loop(0, _QUOTIENT_BITS, step,
                       (jnp.broadcast_to(sa, shape), jnp.zeros(shape, U32)))
  out = pack_rne(q, ea - eb - (_QUOTIENT_BITS - 1), r != 0)
  return jnp.where(a == 0, B.u32(0), out)
