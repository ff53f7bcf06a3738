"""Pallas kernel of the exact block GEMM (``DotPolicy(block_dot="exact")``) on tensor cores:
the same bits as ``block_dot_reference`` in ``jaxlp/formats/_block_dot.py`` (the definition,
below this module; the dispatch that calls the kernel is ``jaxlp/ops/_block_dot.py``).

The integer significands and the per-(row, K-block) / per-(K-block, column) exponents are
split off in jnp (``split_significands``). Grid (M tiles, N tiles); each program owns a
(bm, bn) output tile and loops over the K-blocks strictly ascending (``lax.fori_loop``). A
per-tile route, computed in jnp from the tile's block exponents before the calls, splits the
tiles between two kernels (each skips the other's tiles with ``pl.when``): the bf16 kernel
writes its tiles, then the int8 kernel writes the rest into the same buffer
(``input_output_aliases``):

* **bf16 route** (``route="auto"``, tiles whose exponents stay in :data:`BF16_Q_MIN` ..
  :data:`FAST_Q_MAX`): the block values ``k * 2**(qa - 1)`` and ``k * 2**qb`` are bfloat16
  (8-bit significands, ``|k| <= 2**7``, are exact there). A K-block's partial is a bf16 x
  bf16 -> float32 ``jnp.dot`` (tensor cores), times 2, added to the float32 sum (started at
  +0.0, which turns a -0.0 partial into the reference's +0.0). It has the reference's bits
  because every product is exact and every sum of products inside a K-block is a multiple
  of ``2**(qa + qb - 1)`` below ``2**24`` of them (``g * 2**(bits_a + bits_b) <= 2**24``,
  :func:`bf16_route_ok`): exact in float32 in any order, whatever the hardware's alignment
  and rounding, provided it keeps float32's 24 bits (Hopper's bf16 MMA accumulates in
  float32; its fp8 MMA does not, and is not used). So the partial is the exact
  ``n * 2**(qa + qb)``, a normal float32 (no rounding, no flush), and the sum of such
  partials never falls below ``2**-126`` (they are multiples of ``2**-125``): the
  declared accumulation without its flush. The factor 2 also keeps Triton from folding
  ``s + dot(a, b)`` into ``dot(a, b, s)`` (its dot-add combine), which would add ``s``
  inside the MMA with the hardware's rounding instead of float32's.
* **int8 route** (every other tile, or every tile with ``route="int8"``): each K-block is
  zero-padded to ``gp`` (a multiple of the in-kernel chunk ``c``, a power of two >= 32,
  the int8 MMA depth); its int32 dot is the sum of int8 x int8 -> int32 ``jnp.dot``s over
  its chunks (integer adds: exact in any order), scaled exactly and added to the float32
  accumulator (started at the first block's partial) with ``accumulate``, the reference's
  function. The scaling is ``scale_exact`` (the reference's) or, where the tile's block
  exponents keep every partial a normal float32, the conversion times a power of two,
  which has the same bits there (a ``lax.cond`` per tile and K-block). With the bf16 route
  on, the int8 route reads the bf16 route's operands where their padded K-blocks are a
  multiple of 32 (:func:`int8_reads_bf16`): every block is stored as ``k * 2**s`` with
  ``s`` clipped so that the bfloat16 value is exact for any exponent (:func:`bf16_scale`),
  and the kernel reads ``k`` back (an exact float32 scaling and conversion). So each operand
  is written once before the calls, not as bf16 and int8 copies (on the CPU, XLA's estimate
  of the preparation's bytes fell by a quarter; GPU time not measured).

:func:`fp8_block_gemm` is the fp8 fast mode's GEMM with per-K-block (MX) scales
(``block_dot="fp8"``, not bit-exact): the same tile loop with fp8 dots, each scaled and
added to the float32 sum.

GPU notes, one H100, jax 0.11.2 (2026-11-26; ``benchmarks/block_gemm.py``, RESULTS.md): at
8192^3 both routes gave the reference's bits, with plain and with 2^U{-12..12}-scaled
K-blocks. The bf16 route (``route="auto"``, the default through ``GPU_ROUTE`` in
``jaxlp/ops/_block_dot.py``) ran at 103-115 TFLOP/s for HBFP8 and 172-197 for MXINT8; the
int8 route at 35 and 52. That run is also what confirms the bf16 route's premise: the
hardware keeps float32's 24 bits in the bf16 MMA's accumulation. Static counts on the sm_90
compile (``benchmarks/tools/ptx_per_mac.py``): RESULTS.md. bm, bn are powers of two >= 16.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxlp._util import cdiv, next_pow2, round_up
from jaxlp.formats import _bits as B
from jaxlp.formats._block_dot import (
    accumulate,
    check_operands,
    scale_exact,
    split_blocks,
    split_significands,
)

#: q range of the fast scaling (see the kernel): a nonzero |n| < 2**31 times 2**q is a normal
#: float32 for -126 <= q <= 96, so ``fl32(n) * 2**q`` equals ``scale_exact(n, q)`` there (and
#: ``flush`` of it is the identity); zero gives +0.0 in both.
FAST_Q_MIN, FAST_Q_MAX = -126, 96
#: Smallest ``qa``, ``qb`` and ``qa + qb`` of a bf16-route tile: the operands ``k * 2**(qa - 1)``
#: and ``k * 2**qb`` and the halved partials ``n * 2**(qa + qb - 1)`` are normal (>= 2**-126).
BF16_Q_MIN = -125
ROUTES = ("auto", "int8")


def bf16_route_ok(g: int, bits_a: int, bits_b: int) -> bool:
  """Whether a K-block of ``g`` can take the bf16 route: 8-bit significands (bf16's
  precision) and every sum of its products below ``2**24`` units (exact in float32)."""
  return max(bits_a, bits_b) <= 7 and g * (1 << (bits_a + bits_b)) <= 1 << 24


def _chunk(g: int) -> int:
  return min(max(32, next_pow2(g)), 128)


def _bf16_chunk(gpb: int) -> int:
  """The bf16 route's dot depth: the largest of 16, 32, 64 dividing ``gpb`` (a multiple of
  16, the bf16 MMA depth)."""
  return math.gcd(gpb, 64)


def _dot_nt(a, b, out_dtype):
  """``a`` (m, k) . ``b`` (n, k)^T: both operands K-major, the layout wgmma reads natively
  (8-bit wgmma requires it), and no transpose of B in jnp before the call."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def _descale(v, q, shift: int):
  """The int8 significands ``k`` of bf16 values ``v = k * 2**bf16_scale(q, shift)`` (exact:
  ``k`` is an integer, the power of two a normal float32)."""
  f = v.astype(jnp.float32) * B.from_bits(B.pow2_bits(-bf16_scale(q, shift)))
  return f.astype(jnp.int32).astype(jnp.int8)


def _int8_kernel(nb: int, gp: int, c: int, bm: int, bn: int, from_bf16: bool = False):
  """The int8 route on the tiles whose route is 0 (the others are left as they are).

  ``from_bf16``: the operands are the bf16 route's (``va``, ``vb``, K-blocks padded to ``gp``)
  and the significands are recovered in the kernel (:func:`_descale`), so the int8 copies of
  the operands are never written; a further (in_, nb) ref holds ``qb`` transposed (``b``'s
  block exponents per row of its K-major tile)."""
  n_chunks = gp // c

  def int8_route(qa_ref, qb_ref, ka_ref, kb_ref, qbt_ref=None):
    def partial(t):
      def chunk(u, n):
        off = t * gp + u * c
        a = ka_ref[:, pl.ds(off, c)]
        b = kb_ref[:, pl.ds(off, c)]
        if from_bf16:
          a = _descale(a, qa_ref[:, pl.ds(t, 1)], 1)
          b = _descale(b, qbt_ref[:, pl.ds(t, 1)], 0)
        return n + _dot_nt(a, b, jnp.int32)

      n = lax.fori_loop(0, n_chunks, chunk, jnp.zeros((bm, bn), jnp.int32))
      qa = qa_ref[:, pl.ds(t, 1)]
      qb = qb_ref[pl.ds(t, 1), :]
      q = qa + qb
      # Where every partial of the tile is normal (FAST_Q_MIN <= q <= FAST_Q_MAX), the
      # exact scaling is the int32 -> float32 conversion (rounded once) times 2**q (exact):
      # two instructions per output instead of scale_exact's integer rounding.
      fast = (jnp.min(qa) + jnp.min(qb) >= FAST_Q_MIN) & (jnp.max(qa) + jnp.max(qb) <= FAST_Q_MAX)
      return lax.cond(fast, lambda: n.astype(jnp.float32) * B.from_bits(B.pow2_bits(q)),
                      lambda: scale_exact(n, q))

    return lax.fori_loop(1, nb, lambda t, s: accumulate(s, partial(t)), partial(0))

  def kernel(route_ref, qa_ref, qb_ref, ka_ref, kb_ref, *rest):
    o_ref = rest[-1]  # before it, when present, the bf16 kernel's output (aliased)
    qbt_ref = rest[0] if from_bf16 else None

    @pl.when(route_ref[0, 0] == 0)
    def _():
      o_ref[...] = int8_route(qa_ref, qb_ref, ka_ref, kb_ref, qbt_ref)

  return kernel


def _bf16_kernel(nb: int, gpb: int, cb: int, bm: int, bn: int):
  """The bf16 route on the tiles whose route is 1 (the others are left unwritten)."""
  nb_chunks = gpb // cb

  def dot(va_ref, vb_ref, off):
    return _dot_nt(va_ref[:, pl.ds(off, cb)], vb_ref[:, pl.ds(off, cb)], jnp.float32)

  def kernel(route_ref, va_ref, vb_ref, o_ref):
    def block(t, s):
      if nb_chunks == 1:
        p = dot(va_ref, vb_ref, t * gpb)
      else:  # exact inside the block: the MMA may accumulate the chunks in any way
        p = lax.fori_loop(1, nb_chunks, lambda u, p: p + dot(va_ref, vb_ref, t * gpb + u * cb),
                          dot(va_ref, vb_ref, t * gpb))
      # the operands carry 2**(qa - 1): doubling is exact, and a multiply between the dot
      # and the add keeps Triton from moving s into the MMA's accumulator
      return s + p * 2.0

    @pl.when(route_ref[0, 0] == 1)
    def _():
      o_ref[...] = lax.fori_loop(0, nb, block, jnp.zeros((bm, bn), jnp.float32))

  return kernel


def _tile_routes(qa, qb, bm: int, bn: int):
  """(M tiles, N tiles) int32: 1 where the tile takes the bf16 route (its rows' and
  columns' block exponents satisfy the module docstring's range for every K-block).

  ``qa`` (Mp, nb), ``qb`` (nb, Np) with all-zero blocks at 0 (they impose nothing)."""
  Mp, nb = qa.shape
  Np = qb.shape[1]
  qa = qa.reshape(Mp // bm, bm, nb)
  qb = qb.reshape(nb, Np // bn, bn)
  a_lo, a_hi = jnp.min(qa, axis=1), jnp.max(qa, axis=1)  # (Mt, nb)
  b_lo, b_hi = jnp.min(qb, axis=2).T, jnp.max(qb, axis=2).T  # (Nt, nb)
  ok = ((a_lo[:, None] + b_lo[None] >= BF16_Q_MIN) & (a_hi[:, None] + b_hi[None] <= FAST_Q_MAX)
        & (a_lo[:, None] >= BF16_Q_MIN) & (b_lo[None] >= BF16_Q_MIN))  # (Mt, Nt, nb)
  return jnp.all(ok, axis=-1).astype(jnp.int32)


def bf16_scale(q, shift: int):
  """The exponent of the bf16 operands' scale: ``q - shift`` clipped to [-126, 110]. For
  every block of integers ``|k| < 2**7``, ``k * 2**bf16_scale`` is exact in bfloat16 (a
  normal number of at most 7 significant bits, or zero), so the significands can be read
  back from it (:func:`_descale`); in the bf16 route's range it is the block's value over
  ``2**shift``."""
  return jnp.clip(q - shift, -126, 110)


def _bf16_values(k, q, gpb: int, shift: int):
  """``k * 2**bf16_scale(q, shift)`` as bfloat16, each K-block zero-padded to ``gpb``: (R,
  nb * gpb). Exact for every block (:func:`bf16_scale`): the block's value over
  ``2**shift`` in the bf16 route's range, its significands times a power of two elsewhere
  (where the int8 route reads them back)."""
  R, nb, g = k.shape
  scale = B.from_bits(B.pow2_bits(bf16_scale(q, shift)))[..., None]
  v = (k.astype(jnp.float32) * scale).astype(jnp.bfloat16)
  return jnp.pad(v, ((0, 0), (0, 0), (0, gpb - g))).reshape(R, nb * gpb)


def _tiles(M: int, N: int, block_m, block_n, bf16: bool):
  """The route tiles: ``block_m`` x ``block_n`` (powers of two >= 16), by default
  min(128 (bf16 route) or 64, next_pow2(dim))."""
  cap = 128 if bf16 else 64
  bm = block_m or max(16, min(cap, next_pow2(M)))
  bn = block_n or max(16, min(cap, next_pow2(N)))
  for name, v in (("block_m", bm), ("block_n", bn)):
    if v < 16 or v & (v - 1):
      raise ValueError(f"block_gemm: {name} must be a power of two >= 16, got {v}")
  return bm, bn


def _nonzero_blocks(x, g: int):
  """(R, nb) bool: which K-blocks of ``x`` (R, K), zero-padded to ``nb * g``, hold a value
  whose magnitude is not zero (-0.0 counts as zero; inf and NaN as nonzero)."""
  R, K = x.shape
  nb = cdiv(K, g)
  mag = B.to_bits(jnp.pad(x, ((0, 0), (0, nb * g - K)))) & B.u32(B.ABS_MASK)
  return jnp.any(mag.reshape(R, nb, g) != 0, axis=-1)


def _prepare(a, b, g: int, bits_a: int, bits_b: int, bm: int, bn: int):
  """Significands and exponents, rows padded to the tiles: ``ka`` (Mp, nb, g), ``qa``
  (Mp, nb), ``kb`` (Np, nb, g), ``qb`` (nb, Np) int32; all-zero (and padding) blocks get
  exponent 0 (their dots are +0.0 whatever q, a NaN partner block stays NaN, and 0 keeps
  their tiles on the fast routes)."""
  ka, qa = _prepare_one(a, g, bits_a, round_up(a.shape[0], bm))
  kb, qb = _prepare_one(b.T, g, bits_b, round_up(b.shape[1], bn))
  return ka, qa, kb, qb.T


def _prepare_one(x, g: int, bits: int, rows: int):
  """:func:`_prepare` of one operand ``x`` (R, K), K-major: ``k`` (rows, nb, g), ``q``
  (rows, nb)."""
  R = x.shape[0]
  k, q = split_significands(x, g, bits)
  # a block's significands are all zero exactly when its magnitudes are (the largest one's
  # significand has its top bit set); testing the input lets XLA fuse this reduction with
  # the exponents' instead of reading the significands again
  q = jnp.where(_nonzero_blocks(x, g), q, 0)
  return jnp.pad(k, ((0, rows - R), (0, 0), (0, 0))), jnp.pad(q, ((0, rows - R), (0, 0)))


def tile_routes(a, b, g: int, bits_a: int, bits_b: int, *, block_m: int | None = None,
                block_n: int | None = None):
  """The route :func:`block_gemm` (``route="auto"``) takes per output tile: (M tiles,
  N tiles) int32, 1 = bf16, 0 = int8 (all 0 where :func:`bf16_route_ok` is false)."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  check_operands(a, b, g, bits_a, bits_b)
  bf16 = bf16_route_ok(g, bits_a, bits_b)
  bm, bn = _tiles(a.shape[0], b.shape[1], block_m, block_n, bf16)
  _, qa, _, qb = _prepare(a, b, g, bits_a, bits_b, bm, bn)
  routes = _tile_routes(qa, qb, bm, bn)
  return routes if bf16 else jnp.zeros_like(routes)


#: Where the bf16 route's operand ``va`` (and ``qa``) is computed: "jnp" (XLA fusions:
#: significands, block exponents, bf16 values) or "pallas" (:func:`prep_bf16_rows`: one
#: kernel reads each K-block of ``a`` once and writes its bf16 values and exponent; the same
#: bits, tested in the interpreter). The H200 census of 2026-11-26 put 29.6 of the 32.7 ms of
#: 14 GEMM shapes of an exact ResNet-18 step (each times its calls per step) in the jnp
#: preparation, timed alone. "pallas" is taken by ``GPU_IMPL = "auto"``, the default
#: (``jaxlp/ops/_block_dot.py``; measured there with the split weight gradients, not alone).
PREP = "jnp"
PREPS = ("jnp", "pallas")


def _prep_rows(R: int, W: int) -> int:
  """Rows per program of :func:`prep_bf16_rows`: about 8K elements of a K-block window."""
  return max(16, min(64, next_pow2(R), 8192 // W))


def prep_bf16_rows(a, g: int, bits: int, shift: int, rows: int, *, interpret: bool = False):
  """``(v, q)`` of the (R, K) operand ``a``: ``v`` (rows, nb * gpb) bfloat16, each K-block's
  values ``k * 2**bf16_scale(q, shift)`` zero-padded to ``gpb = round_up(g, 16)``, and ``q``
  (rows, nb) int32 with all-zero blocks at 0; rows ``>= R`` are zero blocks. The bits of
  :func:`_prepare` and :func:`_bf16_values` (jnp), in one Pallas kernel: each program takes
  a band of rows and walks the K-blocks, loading each block once (a power-of-two window,
  masked) and storing its values and exponents."""
  R, K = a.shape
  nb = cdiv(K, g)
  gpb = round_up(g, 16)
  W = next_pow2(gpb)
  br = math.gcd(_prep_rows(R, W), rows)  # divides rows (a multiple of a power of two >= 16)
  from jax.experimental.pallas import triton as plt  # masked loads and stores

  def kernel(a_ref, v_ref, q_ref):
    r0 = pl.program_id(0) * br
    row_ok = (r0 + lax.broadcasted_iota(jnp.int32, (br, W), 0)) < R
    col = lax.broadcasted_iota(jnp.int32, (br, W), 1)

    def block(t, carry):
      ok = row_ok & (col < g) & (t * g + col < K)
      x = plt.load(a_ref.at[:, pl.ds(t * g, W)], mask=ok, other=0.0)
      k, q, nonzero = split_blocks(x, bits)
      q = jnp.where(nonzero, q, 0)
      scale = B.from_bits(B.pow2_bits(bf16_scale(q, shift)))[:, None]
      v = (k.astype(jnp.float32) * scale).astype(jnp.bfloat16)
      plt.store(v_ref.at[:, pl.ds(t * gpb, W)], v, mask=col < gpb)
      q_ref[:, pl.ds(t, 1)] = q[:, None]
      return carry

    lax.fori_loop(0, nb, block, 0)

  v, q = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((rows, nb * gpb), jnp.bfloat16),
                 jax.ShapeDtypeStruct((rows, nb), jnp.int32)),
      grid=(rows // br,),
      in_specs=[pl.BlockSpec((br, K), lambda i: (i, 0))],
      out_specs=(pl.BlockSpec((br, nb * gpb), lambda i: (i, 0)),
                 pl.BlockSpec((br, nb), lambda i: (i, 0))),
      interpret=interpret,
      compiler_params=None if interpret else plt.CompilerParams(num_warps=4, num_stages=3),
      name="jaxlp_block_gemm_prep",
  )(a)
  return v, q


def int8_reads_bf16(g: int, bf16: bool) -> bool:
  """Whether the int8 route reads the bf16 route's operands (their K-blocks, padded to a
  multiple of 16, are a multiple of 32, the int8 MMA depth) instead of int8 copies."""
  return bf16 and round_up(g, 16) % 32 == 0


def kernel_operands(a, b, g: int, bits_a: int, bits_b: int, bm: int, bn: int, bf16: bool,
                    prep: str | None = None, interpret: bool = False):
  """What :func:`block_gemm`'s kernels read, computed before them: ``(routes, va,
  vb, qa, qb, ka8, kb8)``: the per-tile routes (all 0 without ``bf16``), the bf16 route's
  operands (None without it), the block exponents and the int8 significands, each K-block
  zero-padded; ``ka8``, ``kb8`` are None where the int8 route reads ``va``, ``vb``
  (:func:`int8_reads_bf16`: one copy of each operand instead of two). ``prep`` (None:
  :data:`PREP`): "pallas" computes ``va`` and ``qa`` with :func:`prep_bf16_rows` where the
  int8 route reads them, else everything is jnp. Separate so that its cost can be timed alone
  (``benchmarks/layers.py --gemm-census``)."""
  prep = PREP if prep is None else prep
  if prep not in PREPS:
    raise ValueError(f"block_gemm: prep={prep!r} not in {PREPS}")
  nb = cdiv(a.shape[1], g)
  gp = round_up(g, _chunk(g))
  if prep == "pallas" and int8_reads_bf16(g, bf16):
    gpb = round_up(g, 16)
    va, qa = prep_bf16_rows(a, g, bits_a, 1, round_up(a.shape[0], bm), interpret=interpret)
    kb, qb = _prepare_one(b.T, g, bits_b, round_up(b.shape[1], bn))
    routes = _tile_routes(qa, qb.T, bm, bn)
    return routes, va, _bf16_values(kb, qb, gpb, 0), qa, qb.T, None, None
  ka, qa, kb, qb = _prepare(a, b, g, bits_a, bits_b, bm, bn)
  Mp, Np = ka.shape[0], kb.shape[0]
  routes = jnp.zeros((Mp // bm, Np // bn), jnp.int32)
  va = vb = ka8 = kb8 = None
  if bf16:
    routes = _tile_routes(qa, qb, bm, bn)
    gpb = round_up(g, 16)
    va = _bf16_values(ka, qa, gpb, 1)
    vb = _bf16_values(kb, qb.T, gpb, 0)
  if not int8_reads_bf16(g, bf16):
    ka8 = jnp.pad(ka.astype(jnp.int8), ((0, 0), (0, 0), (0, gp - g))).reshape(Mp, nb * gp)
    kb8 = jnp.pad(kb.astype(jnp.int8), ((0, 0), (0, 0), (0, gp - g))).reshape(Np, nb * gp)
  return routes, va, vb, qa, qb, ka8, kb8


@functools.partial(jax.jit, static_argnums=(2, 3, 4),
                   static_argnames=("interpret", "block_m", "block_n", "num_warps", "num_stages",
                                    "route", "prep"))
def block_gemm(a, b, g: int, bits_a: int, bits_b: int, *, interpret: bool = False,
               block_m: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               route: str = "auto", prep: str | None = None):
  """``a`` (M, K) . ``b`` (K, N) with the exact block bits (``jaxlp/formats/_block_dot.py``).

  Args:
    a, b: float32 values of block formats with ``bits_a`` / ``bits_b`` (<= 7) significand
      bits whose blocks refine the K-blocks of length ``g``.
    g: K-block length.
    bits_a, bits_b: significand magnitude bits.
    interpret: run in the Pallas interpreter (CPU testing).
    block_m, block_n: the route tiles (powers of two >= 16; default min(128, next_pow2(dim))
      with the bf16 route, else min(64, ...)); the int8 route runs min(., 64) sub-tiles.
    num_warps: Triton warps per program (default 8 for 128 x 128 tiles, else 4).
    num_stages: Triton software-pipelining stages of the K loops (default 3 for the bf16
      kernel; 1 for the int8 kernel, the setting its bits were checked with on an H100).
    route: ``"auto"`` (bf16 tensor cores on the tiles whose exponents allow it, int8
      elsewhere: module docstring) or ``"int8"`` (int8 everywhere). Same bits.
    prep: how ``a``'s bf16 operand is computed: ``"jnp"`` or ``"pallas"`` (None:
      :data:`PREP`; see :func:`kernel_operands`). Same bits.

  Returns:
    (M, N) float32.

  Raises:
    ValueError: bad shapes, ``bits`` > 7, a K-block too long for an exact int32 dot, or an
      unknown route.
  """
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  check_operands(a, b, g, bits_a, bits_b)
  if max(bits_a, bits_b) > 7:
    raise ValueError(f"block_gemm: int8 significands need <= 7 bits, got {bits_a} and {bits_b}")
  if route not in ROUTES:
    raise ValueError(f"block_gemm: route={route!r} not in {ROUTES}")
  M, N = a.shape[0], b.shape[1]
  nb = cdiv(a.shape[1], g)
  if M * N == 0 or nb == 0:
    return jnp.zeros((M, N), jnp.float32)
  bf16 = route == "auto" and bf16_route_ok(g, bits_a, bits_b)
  c = _chunk(g)
  gp = round_up(g, c)
  bm, bn = _tiles(M, N, block_m, block_n, bf16)
  # the int8 route runs (im, in_) sub-tiles of the route tiles: its exact scaling needs the
  # registers of 32 outputs per thread
  im, in_ = min(bm, 64), min(bn, 64)
  Mp, Np = round_up(M, bm), round_up(N, bn)
  routes, va, vb, qa, qb, ka8, kb8 = kernel_operands(a, b, g, bits_a, bits_b, bm, bn, bf16,
                                                     prep, interpret)

  def params(warps, stages):
    if interpret:
      return None
    from jax.experimental.pallas import triton as plt  # GPU only
    return plt.CompilerParams(num_warps=warps, num_stages=num_stages or stages)

  out_shape = jax.ShapeDtypeStruct((Mp, Np), jnp.float32)
  tile = pl.BlockSpec((1, 1), lambda i, j: (i, j))
  prev = []
  if bf16:
    gpb = round_up(g, 16)
    warps = num_warps or (8 if bm * bn >= 128 * 128 else 4)
    prev = [pl.pallas_call(
        _bf16_kernel(nb, gpb, _bf16_chunk(gpb), bm, bn),
        out_shape=out_shape,
        grid=(Mp // bm, Np // bn),
        in_specs=[tile, pl.BlockSpec((bm, nb * gpb), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, nb * gpb), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=params(warps, 3),
        name="jaxlp_block_gemm_bf16",
    )(routes, va, vb)]
  # the int8 route on (im, in_) sub-tiles of the route tiles
  sub = jnp.repeat(jnp.repeat(routes, bm // im, axis=0), bn // in_, axis=1)
  out_spec = pl.BlockSpec((im, in_), lambda i, j: (i, j))
  from_bf16 = int8_reads_bf16(g, bf16)
  if from_bf16:  # the bf16 operands, descaled in the kernel (kernel_operands wrote no int8)
    gp = round_up(g, 16)
    c = math.gcd(gp, 128)
    ka8, kb8, extra = va, vb, [qb.T]
  else:
    extra = []
  out = pl.pallas_call(
      _int8_kernel(nb, gp, c, im, in_, from_bf16),
      out_shape=out_shape,
      grid=(Mp // im, Np // in_),
      in_specs=[tile,
                pl.BlockSpec((im, nb), lambda i, j: (i, 0)),
                pl.BlockSpec((nb, in_), lambda i, j: (0, j)),
                pl.BlockSpec((im, nb * gp), lambda i, j: (i, 0)),
                pl.BlockSpec((in_, nb * gp), lambda i, j: (j, 0)),
                *([pl.BlockSpec((in_, nb), lambda i, j: (j, 0))] if from_bf16 else []),
                *([out_spec] if prev else [])],
      out_specs=out_spec,
      input_output_aliases={5 + len(extra): 0} if prev else {},
      interpret=interpret,
      compiler_params=params(num_warps or 4, 1),
      name="jaxlp_block_gemm",
  )(sub, qa, qb, ka8, kb8, *extra, *prev)
  return out[:M, :N]


# ---------------------------------------------------------------------------------------
# FP8 fast mode (``DotPolicy(block_dot="fp8")``) with per-K-block scales: not bit-exact
# ---------------------------------------------------------------------------------------
def _fp8_kernel(nb: int, gp: int, bm: int, bn: int):
  def kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref):
    def block(t, s):
      p = _dot_nt(a_ref[:, pl.ds(t * gp, gp)], b_ref[:, pl.ds(t * gp, gp)], jnp.float32)
      # the block's scales 2**sa (rows) and 2**sb (columns); the multiply also keeps Triton
      # from moving s into the MMA's accumulator (fp8 MMAs accumulate narrower than float32)
      return s + p * sa_ref[:, pl.ds(t, 1)] * sb_ref[:, pl.ds(t, 1)].T

    o_ref[...] = lax.fori_loop(0, nb, block, jnp.zeros((bm, bn), jnp.float32))

  return kernel


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_n", "num_warps",
                                             "num_stages"))
def fp8_block_gemm(a8, sa, b8, sb, *, interpret: bool = False, block_m: int | None = None,
                   block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int = 3):
  """``sum_t (a8[:, t] . b8[:, t]^T) * 2**sa[:, t] * 2**sb[:, t]^T``, K-blocks ``t`` in
  ascending order, summed in float32: the fp8 fast mode's GEMM with per-K-block scales
  (``jaxlp.ops._block_dot.fp8_dot``) without its (K-blocks, M, N) intermediate.

  Args:
    a8: (M, nb, g) fp8 values (``float8_e4m3fn`` / ``float8_e5m2``), K-blocks of g.
    sa: (M, nb) int32 scale exponents of ``a8``'s blocks.
    b8: (N, nb, g) fp8 values of the transposed right operand (K-major).
    sb: (N, nb) int32 scale exponents.
    interpret, block_m, block_n, num_warps, num_stages: as :func:`block_gemm` (defaults:
      128 x 128 tiles, 8 warps, 3 stages).

  Returns:
    (M, N) float32. Not bit-exact: each K-block's fp8 dot is the MMA's (Hopper's fp8 MMA
    accumulates in fewer bits than float32; Triton may also widen the operands to float16
    and use float16 MMAs, which are exact for these products), and the scaling and the sum
    round in float32.
  """
  M, nb, g = a8.shape
  N = b8.shape[0]
  if b8.shape[1:] != (nb, g) or sa.shape != (M, nb) or sb.shape != (N, nb):
    raise ValueError(f"fp8_block_gemm: a8 {a8.shape}, sa {sa.shape}, b8 {b8.shape}, sb "
                     f"{sb.shape} do not match (M, nb, g), (M, nb), (N, nb, g), (N, nb)")
  if M * N == 0 or nb == 0:
    return jnp.zeros((M, N), jnp.float32)
  gp = next_pow2(max(g, 32))  # >= the fp8 MMA depth; a power of two (a Triton block dim)
  bm, bn = _tiles(M, N, block_m, block_n, True)
  Mp, Np = round_up(M, bm), round_up(N, bn)

  def operand(v, s, rows):
    v = jnp.pad(v, ((0, rows - v.shape[0]), (0, 0), (0, gp - g))).reshape(rows, nb * gp)
    scale = B.from_bits(B.pow2_bits(jnp.clip(s, -149, 127)))  # 2**s (subnormal below -126)
    return v, jnp.pad(scale, ((0, rows - s.shape[0]), (0, 0)))

  a, fa = operand(a8, sa, Mp)
  b, fb = operand(b8, sb, Np)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt  # GPU only
    params = plt.CompilerParams(num_warps=num_warps or (8 if bm * bn >= 128 * 128 else 4),
                                num_stages=num_stages)
  out = pl.pallas_call(
      _fp8_kernel(nb, gp, bm, bn),
      out_shape=jax.ShapeDtypeStruct((Mp, Np), jnp.float32),
      grid=(Mp // bm, Np // bn),
      in_specs=[pl.BlockSpec((bm, nb * gp), lambda i, j: (i, 0)),
                pl.BlockSpec((bm, nb), lambda i, j: (i, 0)),
                pl.BlockSpec((bn, nb * gp), lambda i, j: (j, 0)),
                pl.BlockSpec((bn, nb), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=params,
      name="jaxlp_fp8_block_gemm",
  )(a, fa, b, fb)
  return out[:M, :N]
