"""Pallas kernel of the exact block GEMM for wide and two-level formats
(``DotPolicy(block_dot="exact")`` with MXFP6 E3M2, MXFP8, NVFP4 and other significands that
do not fit the int8 kernel of ``jaxlp/pallas/_block_gemm.py``): the bits of
``block_dot_reference`` in ``jaxlp/formats/_block_dot.py``, on bfloat16 tensor cores.

Every significand ``k`` of a K-block is cut into limbs (``split_limbs``: ``k = sum_i l_i
2**(W i)``, ``|l_i| <= 2**W``; one limb, ``k`` itself, where the whole dot fits), each stored
as a bfloat16 value, which is exact: a limb is a window of ``k``'s bits, and ``k`` has at
most :class:`~jaxlp.formats._block_dot.SigSpec` ``prec`` significant bits (a float
element's ``man_bits + 1``, times a UE4M3 scale's 4: 2 to 8), or ``W <= 8``. Per output
tile and K-block, each pair of limbs is one bf16 x bf16 -> float32 ``dot`` over the block:
its products are exact and every sum of them is an integer of at most ``g * 2**(2W) <=
2**24`` (:func:`~jaxlp.formats._block_dot.limb_width`), so the float32 result is the exact
integer whatever order and alignment the MMA adds in, provided it keeps float32's 24 bits
(the premise of the bf16 route of ``_block_gemm.py``, confirmed there on an H100). The
dots are converted to int32 (exact), summed per diagonal ``i + j``, and assembled and rounded
once by the reference's own functions (``exact_partial``: digits of ``W`` bits, times the
tensor scales' 48-bit significand product for two-level formats, normalized, rounded to
nearest even, flushed below ``2**-126``), then added to the float32 accumulator with
``accumulate``, K-blocks ascending. One limb each and no tensor scale (MXFP6 E3M2, NVFP4
without a tensor scale): the partial is the dot times ``2**q``, exact where the tile's block
exponents keep it a normal float32 (a ``lax.cond`` per tile and K-block, as in the int8
kernel), else ``scale_exact``.

Limbs per operand (K-blocks of 32 / 16): MXFP4, MXFP6, NVFP4: 1; MXFP8 E4M3FN (18 bits): 2
(4 dots per K-block instead of 1); E5M2 (32 bits): 4 (16 dots). The integer assembly and
rounding, a few hundred integer operations per output and K-block for two-level formats,
runs on the CUDA cores. Not run on a GPU yet: CPU tests check the interpreter's bits
against the reference and that the kernel lowers and compiles for sm_90.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxlp._util import cdiv, next_pow2, round_up
from jaxlp.formats import _bits as B
from jaxlp.formats._block_dot import (
    NAN_Q,
    LimbPlan,
    accumulate,
    check_operands,
    exact_partial,
    limb_diagonals,
    limb_plan,
    limb_width,
    plan_limbs,
    scale_exact,
    scale_operands,
)

#: As ``FAST_Q_MIN``/``FAST_Q_MAX`` of ``_block_gemm.py``: ``fl32(n) * 2**q`` is
#: ``scale_exact(n, q)`` for nonzero ``|n| < 2**31`` and ``-126 <= q <= 96``.
FAST_Q_MIN, FAST_Q_MAX = -126, 96
#: The tensor scales' digits are passed in one row of this many int32 (zero-padded).
G_SLOTS = 8


def kernel_plan(g: int, bits_a: int, bits_b: int, prec=None) -> LimbPlan:
  """The kernel's :class:`~jaxlp.formats._block_dot.LimbPlan`: the whole significands in
  one dot where they are exact in bfloat16 (``prec <= 8``) and their dot in float32 (``g *
  2**(bits_a + bits_b) <= 2**24``); else limbs of ``limb_width(g, prec)`` bits. ``prec``:
  the operands' significant bits (None: as many as their ``bits``)."""
  pa, pb = (bits_a, bits_b) if prec is None else prec
  whole = max(pa, pb) <= 8 and g * (1 << (bits_a + bits_b)) <= 1 << 24
  return limb_plan(g, bits_a, bits_b, whole=whole, W=limb_width(g, max(pa, pb)))


def _operand(x, g: int, bits: int, plan: LimbPlan, nl: int, rows: int, e):
  """bf16 limbs (rows, nb * nl * gp) (K-block t's limb i at columns ``(t nl + i) gp``, each
  K-block zero-padded to ``gp``) and int32 exponents (rows, nb) plus ``e``; padding rows are
  zero blocks with exponent 0."""
  R, K = x.shape
  nb = cdiv(K, g)
  gp = round_up(g, 16)
  blocks = jnp.pad(x, ((0, 0), (0, nb * g - K))).reshape(R, nb, g)
  limbs, q, _ = plan_limbs(blocks, bits, plan.W, nl)
  v = jnp.stack([lb.astype(jnp.float32).astype(jnp.bfloat16) for lb in limbs], axis=2)
  v = jnp.pad(v, ((0, rows - R), (0, 0), (0, 0), (0, gp - g))).reshape(rows, nb * nl * gp)
  return v, jnp.pad(q + e, ((0, rows - R), (0, 0)))


def _dot_nt(a, b):
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(nb: int, gp: int, plan: LimbPlan, scaled: bool):
  na, nbl = plan.na, plan.nb
  fast_ok = not scaled and na == nbl == 1

  def kernel(qa_ref, qb_ref, va_ref, vb_ref, *rest):
    o_ref = rest[-1]
    G = [rest[0][0, j] for j in range(cdiv(48, plan.W))] if scaled else None

    def partial(t):
      def dot(i, j):  # exact integers below 2**24 in float32
        d = _dot_nt(va_ref[:, pl.ds((t * na + i) * gp, gp)],
                    vb_ref[:, pl.ds((t * nbl + j) * gp, gp)])
        return d.astype(jnp.int32)

      D = limb_diagonals(dot, na, nbl)
      qa = qa_ref[:, pl.ds(t, 1)]
      qb = qb_ref[pl.ds(t, 1), :]
      q = qa + qb
      if not fast_ok:
        return exact_partial(D, q, plan, G)
      # one dot: where every partial of the tile is normal, the exact value is the dot
      # (an integer below 2**24) times 2**q, a float32 multiply without rounding; taken
      # from the int32 (a zero sum is +0.0, as in the reference, whatever the MMA's sign)
      fast = (jnp.min(qa) + jnp.min(qb) >= FAST_Q_MIN) & (jnp.max(qa) + jnp.max(qb) <= FAST_Q_MAX)
      return lax.cond(fast, lambda: D[0].astype(jnp.float32) * B.from_bits(B.pow2_bits(q)),
                      lambda: scale_exact(D[0], q))

    o_ref[...] = lax.fori_loop(1, nb, lambda t, s: accumulate(s, partial(t)), partial(0))

  return kernel


@functools.partial(jax.jit, static_argnums=(2, 3, 4),
                   static_argnames=("prec", "interpret", "block_m", "block_n", "num_warps",
                                    "num_stages"))
def limb_gemm(a, b, g: int, bits_a: int, bits_b: int, scales=None, *, prec=None,
              interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
              num_warps: int | None = None, num_stages: int | None = None):
  """``a`` (M, K) . ``b`` (K, N) with the exact block bits (``block_dot_reference``), for
  any significands the reference takes, on bf16 tensor cores (module docstring).

  Args:
    a, b: float32 values of block formats with ``bits_a`` / ``bits_b`` significand bits
      whose blocks refine the K-blocks of length ``g`` (two-level formats: the values
      without the tensor scale, ``two_level_values``).
    g: K-block length.
    bits_a, bits_b: significand magnitude bits.
    scales: None, or ``(sa, sb)``: float32 per-tensor scales (None for an operand without
      one), multiplied into every partial before it is rounded.
    prec: ``(prec_a, prec_b)``, the operands' significant bits (``SigSpec.prec``; None:
      ``bits``): up to 8, whole significands or limbs of up to 10 bits are bf16-exact.
    interpret: run in the Pallas interpreter (CPU testing).
    block_m, block_n: output tiles (powers of two >= 16; default min(32, next_pow2(dim))).
    num_warps, num_stages: Triton launch parameters (default 4 and 1).

  Returns:
    (M, N) float32.

  Raises:
    ValueError: bad shapes, a K-block or significands beyond the limb path's bounds
      (``check_exact``), or bad tile sizes.
  """
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  check_operands(a, b, g, bits_a, bits_b, limbs=True)
  M, N = a.shape[0], b.shape[1]
  nb = cdiv(a.shape[1], g)
  if M * N == 0 or nb == 0:
    return jnp.zeros((M, N), jnp.float32)
  plan = kernel_plan(g, bits_a, bits_b, prec)
  bm = block_m or max(16, min(32, next_pow2(M)))
  bn = block_n or max(16, min(32, next_pow2(N)))
  for name, v in (("block_m", bm), ("block_n", bn)):
    if v < 16 or v & (v - 1):
      raise ValueError(f"limb_gemm: {name} must be a power of two >= 16, got {v}")
  Mp, Np = round_up(M, bm), round_up(N, bn)
  gp = round_up(g, 16)
  Gf, ea, eb, bad = scale_operands(scales)
  va, qa = _operand(a, g, bits_a, plan, plan.na, Mp, ea)
  vb, qb = _operand(b.T, g, bits_b, plan, plan.nb, Np, eb)
  extra, extra_specs = [], []
  if scales is not None:
    qa = jnp.where(bad, NAN_Q, qa)
    G = jnp.stack(Gf(plan.W)).astype(jnp.int32)
    extra = [jnp.pad(G, (0, G_SLOTS - G.shape[0])).reshape(1, G_SLOTS)]
    extra_specs = [pl.BlockSpec((1, G_SLOTS), lambda i, j: (0, 0))]
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt  # GPU only
    params = plt.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or 1)
  out = pl.pallas_call(
      _kernel(nb, gp, plan, scales is not None),
      out_shape=jax.ShapeDtypeStruct((Mp, Np), jnp.float32),
      grid=(Mp // bm, Np // bn),
      in_specs=[pl.BlockSpec((bm, nb), lambda i, j: (i, 0)),
                pl.BlockSpec((nb, bn), lambda i, j: (0, j)),
                pl.BlockSpec((bm, nb * plan.na * gp), lambda i, j: (i, 0)),
                pl.BlockSpec((bn, nb * plan.nb * gp), lambda i, j: (j, 0)),
                *extra_specs],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=params,
      name="jaxlp_limb_gemm",
  )(qa, qb.T, va, vb, *extra)
  return out[:M, :N]
