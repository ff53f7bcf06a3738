"""Auto Precision Scaling (APS, CPD §1.4): exact per-leaf power-of-two gradient scaling.

References:
  Ruobing Han, James Demmel, Yang You, "Auto-Precision Scaling for Distributed Deep
  Learning", arXiv:1911.08907. Original code: drcut/CPD ``CPDtorch/utils/dist_util.py``
  (``sum_gradients(..., use_APS=True)``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxlp.formats import _bits as B
from jaxlp.formats._compat import CPDFloat, QPyTorchFloat
from jaxlp.formats._fixed_point import FixedPoint
from jaxlp.formats._float_format import FloatFormat
from jaxlp.parallel import _axes

#: Exponent reported for an all-zero leaf (below every float32 exponent).
ZERO_EXPONENT = -1000


def format_emax(fmt) -> int:
  """Largest exponent U with 2**U <= the format's largest finite value (APS target).

  ``FloatFormat``: ``fmt.emax``; ``cpd_float(E, M)``: ``2**(E-1) - 1`` (CPD's ``U``);
  ``qpytorch_float(E, M)``: ``min(2**(E-1), 127)``; ``FixedPoint``: ``wl - fl - 2``.

  Args:
    fmt: a ``FloatFormat``, ``cpd_float``, ``qpytorch_float`` or ``FixedPoint`` format.

  Returns:
    The exponent U (an int).

  Raises:
    TypeError: ``fmt`` is of another type (e.g. a block format).

  Example:
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> P.format_emax(F.E4M3), P.format_emax(F.BF16), P.format_emax(F.cpd_float(5, 2))
    (7, 127, 15)
  """
  if isinstance(fmt, FloatFormat):
    return fmt.emax
  if isinstance(fmt, CPDFloat):
    return fmt.bias
  if isinstance(fmt, QPyTorchFloat):
    return min(2 ** (fmt.exp_bits - 1), 127)
  if isinstance(fmt, FixedPoint):
    return fmt.wl - fmt.fl - 2
  raise TypeError(f"aps: no APS exponent is defined for fmt={fmt!r} (use a FloatFormat, "
                  "cpd_float, qpytorch_float or FixedPoint)")


def ceil_log2_times(mag, w: int):
  """Exact ``ceil(log2(|x| * w))`` for finite nonzero float32 magnitude bits and int w >= 1.

  ``w = 2**p * q`` (q odd); the product of the 24-bit significand and q is formed exactly
  as a 64-bit integer in two uint32 words. Needs ``w < 2**16``.
  """
  if not isinstance(w, int) or w < 1 or w >= 2**16:
    raise ValueError(f"aps: the number of workers must be in 1..65535, got W={w!r}")
  p = (w & -w).bit_length() - 1
  q = w >> p
  if q == 1:
    return B.ceil_log2(mag) + p
  field = (mag >> 23).astype(B.I32)
  sig = jnp.where(field > 0, (mag & B.u32(B.FRAC_MASK)) | B.u32(0x800000),
                  mag & B.u32(B.FRAC_MASK))
  e_lsb = jnp.maximum(field, 1) - 150
  s1 = sig >> 16
  s0 = sig & B.u32(0xFFFF)
  qq = B.u32(q)
  a = s1 * qq  # < 2^24
  b = s0 * qq  # < 2^32
  lo = ((a & B.u32(0xFFFF)) << 16) + b
  carry = (lo < b).astype(B.U32)
  hi = (a >> 16) + carry
  fl_hi = B.top_bit(hi)
  fl_lo = B.top_bit(lo)
  fl = jnp.where(hi != 0, 32 + fl_hi, fl_lo)
  pow2 = jnp.where(hi != 0, ((hi & (hi - B.u32(1))) == 0) & (lo == 0),
                   (lo & (lo - B.u32(1))) == 0)
  return jnp.where(pow2, fl, fl + 1) + e_lsb + p


def local_exponent(x, w: int):
  """Per-worker ``(ceil(log2(max|x| * w)), any non-finite)`` of a float32 array.

  An all-zero array gives :data:`ZERO_EXPONENT`. Maxima are taken on the bit patterns
  (exact for subnormals, which XLA's float max may flush).
  """
  mx, bad = finite_max_bits(x)
  return exponent_of_max(mx, w), bad


def finite_max_bits(x):
  """``(largest finite |x| as float32 bits, any non-finite)`` of an array (0 if empty)."""
  mag = B.to_bits(x.astype(jnp.float32)).reshape(-1) & B.u32(B.ABS_MASK)
  bad = jnp.any(mag >= B.u32(B.INF_BITS))
  fin = jnp.where(mag >= B.u32(B.INF_BITS), B.u32(0), mag)
  return (jnp.max(fin) if fin.size else B.u32(0)), bad


def exponent_of_max(mx, w: int):
  """``ceil(log2(max * w))`` of the largest-magnitude bits ``mx`` (any shape, elementwise;
  :data:`ZERO_EXPONENT` where ``mx`` is 0): :func:`local_exponent`'s second half, shared by
  the leaves of a bucket."""
  return jnp.where(mx == 0, jnp.int32(ZERO_EXPONENT), ceil_log2_times(mx, w)).astype(jnp.int32)


def aps_shift(x, axis_name, fmt, w: int):
  """Shared ``(shift, leaf_is_zero, leaf_has_nonfinite)`` of one leaf over ``axis_name``.

  ``A = max over workers of ceil(log2(max|g| * W))``, ``shift = emax(fmt) - A``; an
  all-zero leaf (on every worker) has shift 0.
  """
  a, bad = local_exponent(x, w)
  return shifts_of(_axes.pmax(jnp.stack([a, bad.astype(jnp.int32)]), axis_name), fmt)


def shifts_of(both, fmt):
  """``(shift, zero, non-finite)`` from the max-reduced ``(exponent, non-finite)`` int32 rows
  ``both`` (2, ...): :func:`aps_shift` of one leaf, or of many leaves side by side."""
  a, bad = both[0], both[1] != 0
  zero = a == ZERO_EXPONENT
  shift = jnp.where(zero, 0, format_emax(fmt) - a).astype(jnp.int32)
  return shift, zero, bad
