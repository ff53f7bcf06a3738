"""Exactly specified block dot products (``DotPolicy(block_dot="exact")``) and the FP8 fast
mode (``block_dot="fp8"``).

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

Implementations with those bits: :func:`block_dot_reference` (pure jnp: an int32 dot per
K-block in a ``lax.scan``, any backend), :func:`block_dot_xla_int8` (one batched XLA int8 x
int8 -> int32 ``dot_general`` over (nblocks, block) batch dims, then the same scan; needs
<= 7-bit significands) and the Pallas kernel in ``jaxlp/pallas/_block_gemm.py``.
:func:`block_dot` dispatches on the platform the computation is compiled for; which
implementation a GPU runs is a :class:`jaxlp.DotPolicy` field (``gpu_impl``, default
:data:`GPU_IMPL`).
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
from jaxlp.formats._float_format import FloatFormat

BLOCK_DOTS = (None, "exact", "fp8")
INT32_MAX = 2**31 - 1
#: Q of a block holding a non-finite value (any Qa + Qb >= NAN_Q // 2 gives NaN partials).
NAN_Q = 1 << 20
IMPLS = ("reference", "xla_int8", "pallas")

#: The default implementation :func:`block_dot` runs on a GPU (``DotPolicy.gpu_impl``; every
#: one gives the same bits; CPU always runs the reference): "auto", "pallas", "xla_int8" or
#: "reference". A default, not a switch: choose per policy.
#: "pallas" is the integer-tensor-core kernel. Measured on an H100 (2026-11-26,
#: ``benchmarks/block_gemm.py``) at 4096^3 and 8192^3, before the kernel's fast scaling was
#: added (not measured since):
#: - HBFP8: 11-12 TFLOP/s, against 1.4-1.8 for the reference;
#: - MXINT8: 20-22 TFLOP/s, against 0.7.
#: "xla_int8", the batched XLA int8 dot, needs a (K-blocks, M, N) int32 intermediate (8-86
#: GiB there).
#: "auto": GEMMs with few output tiles and many K-blocks take "xla_int8", the rest "pallas"
#: with the Pallas operand preparation (``PREP`` in ``jaxlp/pallas/_block_gemm.py``). The
#: kernel's parallelism is its output tiles, each looping over every K-block in order: a
#: weight gradient of ResNet-18 (batch 128) such as (576, 131072) x (131072, 64) has 5 tiles
#: of 128 x 128 for 128 K-blocks of 1024, a few programs on a GPU of 132 SMs. "xla_int8"
#: computes every K-block's integer dot at once (one batched int8 GEMM into a (K-blocks, M,
#: N) int32 array, 19 MB there) and then runs the declared accumulation. The rule: fewer
#: than :data:`SPLIT_TILES` tiles of 128 x 128, at least 2 K-blocks and an intermediate of
#: at most :data:`SPLIT_MAX_BYTES`. Measured on an H200 (jax 0.11.2, 2026-11-27,
#: ``benchmarks/layers.py --gpu-impl auto,pallas``, one run): the exact HBFP8 ResNet-18 step
#: (batch 128) took 37.8 ms with "auto" against 53.2 ms with "pallas", the same bits
#: (``tests/ops/test_block_dot_gpu.py`` passed there); its compile took 131 s against 57 s.
GPU_IMPL = "auto"
GPU_IMPLS = ("auto", "pallas", "xla_int8", "reference")
SPLIT_TILES = 32
SPLIT_MAX_BYTES = 256 << 20
#: The default route of the Pallas kernel on a GPU (``DotPolicy.gpu_route``;
#: ``jaxlp/pallas/_block_gemm.py``): "auto" (bf16 tensor
#: cores, with one float32 add per output per K-block instead of an int -> float conversion
#: and scaling, on the tiles whose block exponents allow it; int8 on the others) or "int8"
#: (integer tensor cores everywhere). Both give the reference's bits. Measured on an H100
#: (2026-11-26, ``benchmarks/block_gemm.py`` at 8192^3, plain and 2^U{-12..12}-scaled
#: K-blocks): "auto" gave the reference's bits in every case and ran at 103-115 TFLOP/s
#: (HBFP8) and 172-197 (MXINT8), against 35 and 52 for "int8".
GPU_ROUTE = "auto"
GPU_ROUTES = ("auto", "int8")

#: The default GEMM of the fp8 fast mode on a GPU for per-K-block (MX) scales
#: (``DotPolicy.fp8_gpu_impl``): "pallas" (``fp8_block_gemm``
#: in ``jaxlp/pallas/_block_gemm.py``: the blocks summed inside one kernel) or "xla" (one
#: batched fp8 ``dot_general`` over the K-blocks, then the scaled sum: a (K-blocks, M, N)
#: float32 intermediate, 64 GiB at 8192^3). Neither is bit-exact. Measured on an H100
#: (jax 0.11.2, 2026-11-26): "pallas" ran the 8192^3 MXFP8 GEMM at 102 TFLOP/s, which "xla"
#: cannot hold in memory, and the ResNet-18 ``mxfp8_fp8`` step in 49.8 ms, against 64.8 ms
#: with "xla" in an earlier run on the same kind of machine. Per-tensor scales always take
#: the single XLA fp8 dot.
FP8_GPU_IMPL = "pallas"
FP8_GPU_IMPLS = ("pallas", "xla")


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


_FP8 = {"e4m3fn": (jnp.float8_e4m3fn, 8, 3), "e5m2": (jnp.float8_e5m2, 15, 2)}


def fp8_kind(fmt) -> str | None:
  """The fp8 dtype (``"e4m3fn"`` / ``"e5m2"``) the fp8 fast mode casts ``fmt`` values to, or
  None when ``fmt`` has no fp8 twin: ``mx(FloatFormat)`` with <= 3 mantissa bits (per-block
  scales) or an elementwise ``FloatFormat`` with <= 3 mantissa bits (per-tensor scale);
  <= 2 mantissa bits use e5m2 (wider range), 3 use e4m3fn."""
  elem = fmt.elem if isinstance(fmt, MXFormat) else fmt
  if not isinstance(elem, FloatFormat) or elem.man_bits > 3:
    return None
  return "e5m2" if elem.man_bits <= 2 else "e4m3fn"


def block_length(fmt, shape, axis: int, eff_axis: int | None) -> int:
  """Length of ``fmt``'s blocks along ``axis`` of an operand of ``shape`` (the extent of the
  axis for one block over the whole axis; 1 when its blocks run along another axis).

  ``eff_axis``: the axis an axis-blocked format was actually blocked along (None: its own).
  Raises NotImplementedError for tile-blocked formats on operands that are not 2-D.
  """
  n = shape[axis]
  if isinstance(fmt, MXFormat) or (isinstance(fmt, BlockFormat) and fmt.axis is not None):
    a = (fmt.axis if eff_axis is None else eff_axis) % len(shape)
    if a != axis:
      return 1
    return n if fmt.block_size is None else min(fmt.block_size, n)
  if len(shape) != 2:
    raise NotImplementedError(
        f"jaxlp.dot_general: block_dot with the tile-blocked format {fmt!r} needs 2-D "
        f"operands, got shape {shape}")
  t = fmt.tile[axis]
  return n if t is None else min(t, n)


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
# Implementations
# ---------------------------------------------------------------------------------------
def _check(a, b, g, bits_a, bits_b):
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
    raise ValueError(f"block_dot: operands must be (M, K) and (K, N), got a.shape={a.shape}, "
                     f"b.shape={b.shape}")
  if not (isinstance(g, int) and g >= 1):
    raise ValueError(f"block_dot: the K-block length must be a positive int, got {g!r}")
  check_exact(g, bits_a, bits_b)


def _operands(a, b, g, bits_a, bits_b):
  ka, qa = split_significands(a, g, bits_a)  # (M, nb, g), (M, nb)
  kb, qb = split_significands(b.T, g, bits_b)  # (N, nb, g), (N, nb)
  return ka, qa, kb, qb


#: K-blocks per step of :func:`_scan_blocks`' loop (the same operations in the same order
#: unrolled: on a GPU each loop step also reads its predicate back to the host)
SCAN_UNROLL = 16


def _scan_blocks(n_blocks, qa, qb):
  """The declared accumulation over K-blocks of int32 partial dots n_blocks (nb, M, N)."""
  def partial(n, qa_b, qb_b):
    return scale_exact(n, qa_b[:, None] + qb_b[None, :])

  def body(s, x):
    return accumulate(s, partial(*x)), None

  s0 = partial(n_blocks[0], qa[:, 0], qb[:, 0])
  s, _ = lax.scan(body, s0, (n_blocks[1:], qa.T[1:], qb.T[1:]),
                  unroll=max(1, min(SCAN_UNROLL, n_blocks.shape[0] - 1)))
  return s


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def block_dot_reference(a, b, g: int, bits_a: int, bits_b: int):
  """The definition (module docstring) in pure jnp: ``a`` (M, K) . ``b`` (K, N) float32
  block-format values, K-blocks of ``g``, significands of ``bits_a`` / ``bits_b`` bits; an
  exact int32 dot per K-block inside a ``lax.scan`` over the K-blocks. Any backend."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  _check(a, b, g, bits_a, bits_b)
  M, N = a.shape[0], b.shape[1]
  ka, qa, kb, qb = _operands(a, b, g, bits_a, bits_b)
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


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def block_dot_xla_int8(a, b, g: int, bits_a: int, bits_b: int):
  """The same bits as :func:`block_dot_reference` with ONE XLA int8 x int8 -> int32
  ``dot_general`` batched over the K-blocks ((nb, M, g) x (nb, g, N) -> (nb, M, N)), then the
  declared accumulation. Needs significands of <= 7 bits (int8)."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  _check(a, b, g, bits_a, bits_b)
  if max(bits_a, bits_b) > 7:
    raise ValueError(f"block_dot_xla_int8: int8 significands need <= 7 bits, got {bits_a} "
                     f"and {bits_b}")
  M, N = a.shape[0], b.shape[1]
  ka, qa, kb, qb = _operands(a, b, g, bits_a, bits_b)
  if ka.shape[1] == 0:
    return jnp.zeros((M, N), jnp.float32)
  # K-blocks zero-padded to a multiple of 4 (exact: zeros add nothing). XLA:GPU (jax 0.11.2,
  # H100, 2026-11-26) returned twice the int32 dot for 2-element K-blocks.
  pad = (0, 0), (0, 0), (0, -g % 4)
  ka, kb = jnp.pad(ka.astype(jnp.int8), pad), jnp.pad(kb.astype(jnp.int8), pad)
  n = lax.dot_general(ka, kb, (((2,), (2,)), ((1,), (1,))),
                      preferred_element_type=jnp.int32)  # (nb, M, N)
  return _scan_blocks(n, qa, qb)


def block_dot_pallas(a, b, g: int, bits_a: int, bits_b: int, *, interpret: bool = False,
                     route: str = GPU_ROUTE, prep: str | None = None):
  """The same bits with the Pallas tensor-core kernel (``jaxlp/pallas/_block_gemm.py``);
  ``prep`` None: that module's ``PREP``."""
  from jaxlp.pallas._block_gemm import block_gemm  # noqa: PLC0415  (import cycle)

  return block_gemm(a, b, g, bits_a, bits_b, interpret=interpret, route=route, prep=prep)


def splits_k_blocks(M: int, N: int, K: int, g: int) -> bool:
  """Whether ``gpu_impl="auto"`` runs an (M, K) x (K, N) GEMM with K-blocks of ``g`` as
  "xla_int8" (see :data:`SPLIT_TILES`) rather than "pallas"."""
  nb = cdiv(K, g) if K else 0
  return (cdiv(M, 128) * cdiv(N, 128) < SPLIT_TILES and nb >= 2
          and 4 * nb * M * N <= SPLIT_MAX_BYTES)


def block_dot_gpu_auto(a, b, g: int, bits_a: int, bits_b: int, *, interpret: bool = False,
                       route: str = GPU_ROUTE):
  """``gpu_impl="auto"``: "xla_int8" where :func:`splits_k_blocks`, else "pallas" with
  the Pallas operand preparation (``prep="pallas"``)."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  if splits_k_blocks(a.shape[0], b.shape[1], a.shape[1], g):
    return block_dot_xla_int8(a, b, g, bits_a, bits_b)
  return block_dot_pallas(a, b, g, bits_a, bits_b, interpret=interpret, route=route,
                          prep="pallas")


_IMPL_FNS = {"reference": block_dot_reference, "xla_int8": block_dot_xla_int8,
             "pallas": block_dot_pallas, "auto": block_dot_gpu_auto}


def check_gpu_choice(value, allowed, what: str):
  """``value`` if it is one of ``allowed``, else a ValueError naming ``what``."""
  if value not in allowed:
    raise ValueError(f"{what}={value!r} not in {allowed}")
  return value


def block_dot(a, b, g: int, bits_a: int, bits_b: int, *, impl: str | None = None,
              gpu_impl: str = GPU_IMPL, gpu_route: str = GPU_ROUTE):
  """``a`` (M, K) . ``b`` (K, N) with the exact block bits (module docstring).

  ``impl=None`` follows the platform the computation is compiled for
  (``lax.platform_dependent``): CUDA runs ``gpu_impl`` (:data:`GPU_IMPLS`; the Pallas
  kernel on ``gpu_route``, :data:`GPU_ROUTES`) where the significands fit int8 (the
  reference otherwise), every other platform the reference. All give the same bits.
  """
  check_gpu_choice(gpu_impl, GPU_IMPLS, "block_dot: gpu_impl")
  check_gpu_choice(gpu_route, GPU_ROUTES, "block_dot: gpu_route")
  if impl is not None:
    if impl not in IMPLS:
      raise ValueError(f"block_dot: impl={impl!r} not in {IMPLS}")
    return _IMPL_FNS[impl](a, b, g, bits_a, bits_b)
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  _check(a, b, g, bits_a, bits_b)
  if max(bits_a, bits_b) > 7:
    return block_dot_reference(a, b, g, bits_a, bits_b)
  return _dispatch(a, b, g, bits_a, bits_b, gpu_impl, gpu_route)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _dispatch(a, b, g, bits_a, bits_b, gpu_impl, gpu_route):
  def reference(a, b):
    return block_dot_reference(a, b, g, bits_a, bits_b)

  def gpu(a, b):
    if gpu_impl in ("pallas", "auto"):
      return _IMPL_FNS[gpu_impl](a, b, g, bits_a, bits_b, route=gpu_route)
    return _IMPL_FNS[gpu_impl](a, b, g, bits_a, bits_b)

  return lax.platform_dependent(a, b, cuda=gpu, default=reference)


# ---------------------------------------------------------------------------------------
# FP8 fast mode
# ---------------------------------------------------------------------------------------
def _fp8_scaled(x, kind: str, g: int | None, exact_scale: bool):
  """``x`` (R, K) -> (fp8 values (R, nb, g'), scale exponents (R, nb)): per K-block (g) or
  per tensor (g None: one block of K). ``exact_scale``: MX's own scale (max exponent ->
  emax), else one binade of headroom (no overflow whatever the mantissa of the max)."""
  dtype, emax, _ = _FP8[kind]
  R, K = x.shape
  gg = max(K, 1) if g is None else g
  nb = cdiv(K, gg) if K else 0
  x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * gg - K))).reshape(R, nb, gg)
  mag = B.to_bits(x) & B.u32(B.ABS_MASK)
  if g is None:
    mx = jnp.max(mag, initial=B.u32(0), keepdims=True).reshape(1, 1, 1)
    mx = jnp.broadcast_to(mx, (R, nb, 1))
  else:
    mx = jnp.max(mag, axis=-1, keepdims=True, initial=B.u32(0))
  fl = B.floor_log2(jnp.minimum(mx, B.u32(0x7F7FFFFF)))
  s = jnp.where(fl < -149, 0, fl - (emax if exact_scale else emax - 1))
  s = jnp.clip(s, -127, 127)
  return jnp.ldexp(x, -s).astype(dtype), s[..., 0]


def fp8_dot(a, b, fmt_a, fmt_b, g: int | None, *, gpu_impl: str = FP8_GPU_IMPL):
  """FP8 fast mode: ``a`` (M, K) . ``b`` (K, N) of ``fmt_a`` / ``fmt_b`` values cast to fp8
  (:func:`fp8_kind`) with power-of-two scales -- per K-block of ``g`` for MX operands, per
  tensor otherwise -- one ``lax.dot_general`` on the fp8 arrays (batched over the K-blocks)
  with ``preferred_element_type=float32``, scaled back and summed over the blocks.

  NOT bit-exact: the cast is exact for MX values and for float values whose range fits
  the fp8 type under one scale, but the dot's accumulation is the hardware's (Hopper's fp8
  tensor cores accumulate in a format narrower than fp32), and the sum over K-blocks is
  XLA's ``sum``. Its error against the exact emulation is measured by
  ``benchmarks/block_gemm.py``. ``gpu_impl`` (:data:`FP8_GPU_IMPLS`): the GEMM a GPU runs
  for per-K-block scales (see :data:`FP8_GPU_IMPL`).
  """
  check_gpu_choice(gpu_impl, FP8_GPU_IMPLS, "fp8_dot: gpu_impl")
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  ka, kb = fp8_kind(fmt_a), fp8_kind(fmt_b)
  if ka is None or kb is None:
    raise ValueError(f"fp8_dot: {fmt_a!r} / {fmt_b!r} have no fp8 twin (fp8 mode takes mx "
                     "or FloatFormat values with <= 3 mantissa bits)")
  blocked = isinstance(fmt_a, MXFormat) or isinstance(fmt_b, MXFormat)
  gg = g if blocked else None
  a8, sa = _fp8_scaled(a, ka, gg, isinstance(fmt_a, MXFormat))
  b8, sb = _fp8_scaled(b.T, kb, gg, isinstance(fmt_b, MXFormat))
  if not blocked or gpu_impl == "xla" or a8.shape[1] == 0:
    return _fp8_xla(a8, sa, b8, sb)

  def pallas(a8, sa, b8, sb):
    from jaxlp.pallas._block_gemm import fp8_block_gemm  # noqa: PLC0415  (import cycle)

    return fp8_block_gemm(a8, sa, b8, sb)

  return lax.platform_dependent(a8, sa, b8, sb, cuda=pallas, default=_fp8_xla)


def _fp8_xla(a8, sa, b8, sb):
  d = lax.dot_general(a8, b8, (((2,), (2,)), ((1,), (1,))),
                      preferred_element_type=jnp.float32)  # (nb, M, N)
  e = sa.T[:, :, None] + sb.T[:, None, :]
  return jnp.sum(jnp.ldexp(d, e), axis=0)
