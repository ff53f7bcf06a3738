"""The exact block dot product's definition (``DotPolicy(block_dot="exact")``): the bits
that every implementation must equal, in pure jnp (any backend).

Block formats with integer significands (``BlockFormat`` / ``hbfp`` / ``hbfp_batched``, whose
elements are ``k * 2**(e - man_bits)`` with ``|k| <= 2**man_bits - 1``, and MXINT8 =
``mx("int8")``, ``k in [-128, 127]`` times ``2**(s - 6)``) make a dot product over a block of
the contraction axis an integer dot product times a power of two. The "exact" bits of a GEMM
``C = A (M, K) . B (K, N)`` of quantized operands are defined as:

1. **K-blocks**: K is cut into consecutive blocks of ``g`` elements (the last one may be
   shorter), where ``g`` is the coarsest length both operands' blocks refine: each operand's
   block length along its contraction axis (tile size, ``block_size``, the whole axis, or 1
   when its blocks run along another axis), combined by ``gcd`` (a whole-axis block imposes
   nothing). :func:`contraction_blocks` computes it.
2. **Block partials**: for output (m, n) and K-block b, ``p = fl32(sum_k a[m, k] * b[k, n])``
   over the block: the exact dot product, rounded ONCE to float32 (round to nearest even).
   On every backend it is computed from integer significands: per (row, K-block) of A and
   per (K-block, column) of B, ``x = k * 2**Q`` with ``Q = max(floor(log2 |x|max') -
   (bits - 1), -149)`` (``|x|'``: negative exact powers of two count one binade lower, so
   that ``-2**t`` is ``-2**bits * 2**Q``), ``|k| <= 2**bits``; the int32 dot of the
   significands is exact (``g * 2**(bits_a + bits_b) <= 2**31 - 1`` is required) and
   :func:`scale_exact` turns ``n * 2**(Qa + Qb)`` into the correctly rounded float32.
3. **Range**: a partial that overflows is ``±inf``; a partial or running sum below
   ``2**-126`` in magnitude is flushed to zero, keeping its sign (XLA:CPU flushes float32
   subnormals in its arithmetic; flushing explicitly gives the same bits where the hardware
   keeps them). A block holding a non-finite value (the formats turn such blocks into NaN)
   makes its partials NaN.
4. **Accumulation**: ``s = p_0; for b in 1, 2, ...: s = flush(fl32(s + p_b))``, K-blocks in
   ascending order, sequentially, in float32 (never an FMA: the partials are built from
   integer bits). There is no initial ``+0.0`` (XLA folds ``0 + x`` into ``x``, which
   differs for ``x = -0.0``).

Relation to today's emulation (``block_dot=None``: fp32 products, fp32 sums in XLA's dot):
the products of two block values are exact in float32, and so is every partial sum within a
block of <= 2**(24 - bits_a - bits_b) elements (they are multiples of ``2**(Qa+Qb)`` below
``2**24`` of them). The two differ in how the sums cross block boundaries: XLA's dot adds
products in its own (unspecified, backend- and shape-dependent) order and rounds partial
sums that mix blocks; "exact" rounds each block once and adds the blocks in a declared order.
Measured differences: README, "Block formats on tensor cores".

:func:`block_dot_reference` is this definition in pure jnp (an int32 dot per K-block in a
``lax.scan``). The other implementations with the same bits use its parts
(:func:`split_significands`, :func:`split_blocks`, :func:`scale_exact`, :func:`accumulate`,
:func:`check_operands`): the batched XLA int8 dot and the dispatch (``block_dot``) in
``jaxlp/ops/_block_dot.py``, and the Pallas kernel in ``jaxlp/pallas/_block_gemm.py``. This
module sits below both (formats <- pallas <- ops), as ``formats/_quantize.py`` does for the
quantize kernels.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp._util import cdiv
from jaxlp.formats import _bits as B
from jaxlp.formats._block import BlockFormat, MXFormat

INT32_MAX = 2**31 - 1
#: Q of a block holding a non-finite value (any Qa + Qb >= NAN_Q // 2 gives NaN partials).
NAN_Q = 1 << 20


# ---------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------
def significand_bits(fmt) -> int | None:
  """Magnitude bits of the integer significands of a block format (None: not one).

  ``BlockFormat(man_bits)``: ``man_bits``; MXINT8 (``mx("int8")``): 7. Significands ``k`` of
  :func:`split_significands` satisfy ``-2**bits <= k <= 2**bits - 1``.
  """
  if isinstance(fmt, BlockFormat):
    return fmt.man_bits
  if isinstance(fmt, MXFormat) and fmt.elem == "int8":
    return 7
  return None


def contraction_blocks(len_a: int, len_b: int, k: int) -> int:
  """The K-block length ``g`` of a GEMM from its operands' block lengths along K: ``gcd``,
  where a block over the whole axis (``>= k``) imposes nothing."""
  la = None if len_a >= k else len_a
  lb = None if len_b >= k else len_b
  if la is None and lb is None:
    return max(k, 1)
  if la is None or lb is None:
    return la if lb is None else lb
  return math.gcd(la, lb)


def check_exact(g: int, bits_a: int, bits_b: int, what: str = "block_dot"):
  """Raise ValueError unless int32 holds a K-block's significand dot exactly."""
  if g * (1 << (bits_a + bits_b)) > INT32_MAX:
    raise ValueError(
        f"jaxlp {what}: block_dot='exact' needs K-block * 2**(bits_a + bits_b) <= 2**31 - 1 "
        f"for an exact int32 dot, got K-block {g} with {bits_a}- and {bits_b}-bit "
        "significands; use smaller blocks or fewer mantissa bits")


# ---------------------------------------------------------------------------------------
# Integer significands and exact scaling
# ---------------------------------------------------------------------------------------
def split_significands(x, g: int, bits: int):
  """Integer significands of ``x`` (R, K) (float32 values of a block format) per K-block.

  Returns ``(k, q)``: ``k`` (R, nb, g) int32 with ``x[r, b*g + i] == k[r, b, i] * 2**q[r, b]``
  (K zero-padded to ``nb * g``), ``q`` (R, nb) int32, ``NAN_Q`` for a block holding a
  non-finite value. Exact provided ``x`` lies on its format's block grid (it does after
  quantization with a format of ``bits`` significand bits and blocks that refine ``g``).
  """
  R, K = x.shape
  nb = cdiv(K, g) if K else 0
  x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * g - K))).reshape(R, nb, g)
  k, q, _ = split_blocks(x, bits)
  return k, q


def split_blocks(x, bits: int):
  """:func:`split_significands` of blocks along the last axis of ``x`` (float32, zero
  padding allowed): ``(k, q, nonzero)``, ``nonzero`` true where a block holds a nonzero
  magnitude (-0.0 is zero). Also the body of the Pallas operand preparation
  (``jaxlp/pallas/_block_gemm.py``): reductions as max only."""
  bits_ = B.to_bits(x)
  neg = (bits_ & B.u32(B.SIGN_MASK)) != 0
  mag = bits_ & B.u32(B.ABS_MASK)
  adj = jnp.where(neg & (mag != 0), mag - B.u32(1), mag)
  fl = B.floor_log2(jnp.minimum(adj, B.u32(0x7F7FFFFF)))
  q = jnp.maximum(jnp.maximum(jnp.max(fl, axis=-1), -150) - (bits - 1), -149)
  top = jnp.max(mag, axis=-1)
  field = (mag >> 23).astype(jnp.int32)
  m = (mag & B.u32(B.FRAC_MASK)).astype(jnp.int32)
  m = jnp.where(field > 0, m | (1 << 23), m)
  e0 = jnp.where(field > 0, field - 150, -149)
  k = m >> jnp.clip(q[..., None] - e0, 0, 31)
  k = jnp.where(neg, -k, k)
  q = jnp.where(top >= B.u32(B.INF_BITS), NAN_Q, q).astype(jnp.int32)
  return k, q, top != 0


def _f32_from_int_bits(bits):
  return lax.bitcast_convert_type(bits, jnp.float32)


def scale_exact(n, q):
  """``fl32(n * 2**q)`` of int32 ``n`` (``|n| <= 2**31 - 1``) and int32 ``q``, correctly
  rounded (nearest even), ``±inf`` on overflow, flushed to a signed zero below ``2**-126``;
  NaN where ``q >= NAN_Q // 2``. Integer operations only (the same bits in XLA and in a
  Triton kernel, with or without hardware subnormals): no clz (the NVIDIA Triton backend
  rejects it), no bitcast of constants."""
  neg = n < 0
  a = jnp.where(neg, -n, n)
  # floor(log2 a): the exponent of the (rounded) conversion, one less if it rounded up.
  fb = lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
  l0 = jnp.clip((fb >> 23) - 127, 0, 31)
  lg = l0 - ((a >> l0) == 0).astype(jnp.int32)
  qexp = jnp.maximum(lg + q - 23, -149)
  sh = qexp - q
  shr = jnp.clip(sh, 1, 31)
  r0 = a >> shr
  rem = a - (r0 << shr)
  half = 1 << (shr - 1)
  up = (rem > half) | ((rem == half) & ((r0 & 1) == 1))
  r_right = jnp.where(sh >= 32, 0, r0 + up.astype(jnp.int32))
  r = jnp.where(sh > 0, r_right, a << jnp.clip(-sh, 0, 23))
  field = qexp + 149 + (r >> 23)
  mant = r & 0x7FFFFF
  bits = (jnp.clip(field, 0, 254) << 23) | mant
  bits = jnp.where(field >= 255, 0x7F800000, bits)
  bits = jnp.where((field <= 0) | (a == 0), 0, bits)  # zero, or flushed below 2**-126
  bits = jnp.where(q >= NAN_Q // 2, 0x7FC00000, bits)
  p = _f32_from_int_bits(bits)
  return jnp.where(neg, -p, p)


def flush(x):
  """``x`` (float32) with magnitudes below ``2**-126`` replaced by a zero of the same sign."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  tiny = (bits & 0x7FFFFFFF) < 0x00800000
  return _f32_from_int_bits(jnp.where(tiny, bits & jnp.int32(-(2**31)), bits))


def accumulate(s, p):
  """One step of the declared accumulation: ``flush(fl32(s + p))``."""
  return flush(s + p)


# ---------------------------------------------------------------------------------------
# The definition in pure jnp
# ---------------------------------------------------------------------------------------
def check_operands(a, b, g, bits_a, bits_b):
  """Raise ValueError unless ``a`` (M, K), ``b`` (K, N), the K-block length ``g`` and the
  significand bits make an exact block dot (:func:`check_exact`)."""
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
    raise ValueError(f"block_dot: operands must be (M, K) and (K, N), got a.shape={a.shape}, "
                     f"b.shape={b.shape}")
  if not (isinstance(g, int) and g >= 1):
    raise ValueError(f"block_dot: the K-block length must be a positive int, got {g!r}")
  check_exact(g, bits_a, bits_b)


def operand_significands(a, b, g, bits_a, bits_b):
  """:func:`split_significands` of ``a`` (M, K) and of ``b.T`` (N, K): ``(ka, qa, kb, qb)``."""
  ka, qa = split_significands(a, g, bits_a)  # (M, nb, g), (M, nb)
  kb, qb = split_significands(b.T, g, bits_b)  # (N, nb, g), (N, nb)
  return ka, qa, kb, qb


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def block_dot_reference(a, b, g: int, bits_a: int, bits_b: int):
  """The definition (module docstring) in pure jnp: ``a`` (M, K) . ``b`` (K, N) float32
  block-format values, K-blocks of ``g``, significands of ``bits_a`` / ``bits_b`` bits; an
  exact int32 dot per K-block inside a ``lax.scan`` over the K-blocks. Any backend."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  check_operands(a, b, g, bits_a, bits_b)
  M, N = a.shape[0], b.shape[1]
  ka, qa, kb, qb = operand_significands(a, b, g, bits_a, bits_b)
  if ka.shape[1] == 0:
    return jnp.zeros((M, N), jnp.float32)

  def partial(ka_b, kb_b, qa_b, qb_b):
    n = lax.dot_general(ka_b, kb_b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return scale_exact(n, qa_b[:, None] + qb_b[None, :])

  def body(s, x):
    return accumulate(s, partial(*x)), None

  xs = (jnp.moveaxis(ka, 1, 0), jnp.moveaxis(kb, 1, 0), qa.T, qb.T)
  s0 = partial(*(x[0] for x in xs))
  s, _ = lax.scan(body, s0, tuple(x[1:] for x in xs))
  return s
