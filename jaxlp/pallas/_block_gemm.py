"""Pallas kernel of the exact block GEMM (``DotPolicy(block_dot="exact")``) on integer
tensor cores: the same bits as ``block_dot_reference`` in ``jaxlp/ops/_block_dot.py``.

The int8 significands and the per-(row, K-block) / per-(K-block, column) exponents are
split off in jnp (``split_significands``); each K-block is zero-padded to ``gp`` (a
multiple of the in-kernel chunk ``c``, a power of two >= 32, the int8 MMA depth). Grid
(M tiles, N tiles); each program owns a (bm, bn) output tile and loops over the K-blocks
strictly ascending (``lax.fori_loop``): the block's int32 dot is the sum of int8 x int8 ->
int32 ``jnp.dot``s over its chunks (integer adds: exact in any order), scaled exactly and
added to the float32 accumulator (started at the first block's partial) with
``accumulate``, the reference's function. The scaling is ``scale_exact`` (the reference's)
or, where the tile's block exponents keep every partial a normal float32, the conversion
times a power of two, which has the same bits there (a ``lax.cond`` per tile and K-block).

GPU notes: on an H100 (2026-11-26), before the fast scaling, it gave the reference's bits at
4096^3 and 8192^3 and ran at 11-22 TFLOP/s. The per-K-block ``scale_exact`` dominated (~30
integer operations per output every 24 or 32 MACs), not the int8 MMA. The fast scaling is
not measured on a GPU yet. bm, bn are powers of two >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxlp._util import next_pow2, round_up
from jaxlp.formats import _bits as B
from jaxlp.ops import _block_dot as BD

#: q range of the fast scaling (see the kernel): a nonzero |n| < 2**31 times 2**q is a normal
#: float32 for -126 <= q <= 96, so ``fl32(n) * 2**q`` equals ``scale_exact(n, q)`` there (and
#: ``flush`` of it is the identity); zero gives +0.0 in both.
FAST_Q_MIN, FAST_Q_MAX = -126, 96


def _chunk(g: int) -> int:
  return min(max(32, next_pow2(g)), 128)


def _make_kernel(nb: int, gp: int, c: int, bm: int, bn: int):
  n_chunks = gp // c

  def kernel(qa_ref, qb_ref, ka_ref, kb_ref, o_ref):
    def partial(t):
      def chunk(u, n):
        off = t * gp + u * c
        a = ka_ref[:, pl.ds(off, c)]
        b = kb_ref[pl.ds(off, c), :]
        return n + jnp.dot(a, b, preferred_element_type=jnp.int32)

      n = lax.fori_loop(0, n_chunks, chunk, jnp.zeros((bm, bn), jnp.int32))
      qa = qa_ref[:, pl.ds(t, 1)]
      qb = qb_ref[pl.ds(t, 1), :]
      q = qa + qb
      # Where every partial of the tile is normal (FAST_Q_MIN <= q <= FAST_Q_MAX), the
      # exact scaling is the int32 -> float32 conversion (rounded once) times 2**q (exact):
      # two instructions per output instead of scale_exact's integer rounding.
      fast = (jnp.min(qa) + jnp.min(qb) >= FAST_Q_MIN) & (jnp.max(qa) + jnp.max(qb) <= FAST_Q_MAX)
      return lax.cond(fast, lambda: n.astype(jnp.float32) * B.from_bits(B.pow2_bits(q)),
                      lambda: BD.scale_exact(n, q))

    o_ref[...] = lax.fori_loop(1, nb, lambda t, s: BD.accumulate(s, partial(t)), partial(0))

  return kernel


@functools.partial(jax.jit, static_argnums=(2, 3, 4),
                   static_argnames=("interpret", "block_m", "block_n", "num_warps"))
def block_gemm(a, b, g: int, bits_a: int, bits_b: int, *, interpret: bool = False,
               block_m: int | None = None, block_n: int | None = None, num_warps: int = 4):
  """``a`` (M, K) . ``b`` (K, N) with the exact block bits (``jaxlp/ops/_block_dot.py``).

  Args:
    a, b: float32 values of block formats with ``bits_a`` / ``bits_b`` (<= 7) significand
      bits whose blocks refine the K-blocks of length ``g``.
    g: K-block length.
    bits_a, bits_b: significand magnitude bits.
    interpret: run in the Pallas interpreter (CPU testing).
    block_m, block_n: output tile (powers of two >= 16; default min(64, next_pow2(dim))).
    num_warps: Triton warps per program.

  Returns:
    (M, N) float32.

  Raises:
    ValueError: bad shapes, ``bits`` > 7, or a K-block too long for an exact int32 dot.
  """
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  BD._check(a, b, g, bits_a, bits_b)
  if max(bits_a, bits_b) > 7:
    raise ValueError(f"block_gemm: int8 significands need <= 7 bits, got {bits_a} and {bits_b}")
  M, N = a.shape[0], b.shape[1]
  ka, qa, kb, qb = BD._operands(a, b, g, bits_a, bits_b)  # (M, nb, g) (M, nb) (N, nb, g) (N, nb)
  # an all-zero block's exponent is arbitrary (its dots are 0, +0.0 whatever q; a NaN partner
  # block stays NaN): 0 keeps its tiles on the fast scaling
  qa = jnp.where(jnp.any(ka != 0, axis=-1), qa, 0)
  qb = jnp.where(jnp.any(kb != 0, axis=-1), qb, 0)
  nb = ka.shape[1]
  if M * N == 0 or nb == 0:
    return jnp.zeros((M, N), jnp.float32)
  c = _chunk(g)
  gp = round_up(g, c)
  bm = block_m or max(16, min(64, next_pow2(M)))
  bn = block_n or max(16, min(64, next_pow2(N)))
  Mp, Np = round_up(M, bm), round_up(N, bn)
  ka = jnp.pad(ka.astype(jnp.int8), ((0, Mp - M), (0, 0), (0, gp - g))).reshape(Mp, nb * gp)
  kb = jnp.pad(kb.astype(jnp.int8), ((0, Np - N), (0, 0), (0, gp - g))).reshape(Np, nb * gp).T
  qa = jnp.pad(qa, ((0, Mp - M), (0, 0)))
  qb = jnp.pad(qb, ((0, Np - N), (0, 0))).T
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt  # GPU only
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  out = pl.pallas_call(
      _make_kernel(nb, gp, c, bm, bn),
      out_shape=jax.ShapeDtypeStruct((Mp, Np), jnp.float32),
      grid=(Mp // bm, Np // bn),
      in_specs=[
          pl.BlockSpec((bm, nb), lambda i, j: (i, 0)),
          pl.BlockSpec((nb, bn), lambda i, j: (0, j)),
          pl.BlockSpec((bm, nb * gp), lambda i, j: (i, 0)),
          pl.BlockSpec((nb * gp, bn), lambda i, j: (0, j)),
      ],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=params,
      name="jaxlp_block_gemm",
  )(qa, qb, ka, kb)
  return out[:M, :N]
