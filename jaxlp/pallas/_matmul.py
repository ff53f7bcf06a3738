"""Pallas kernel for the low-precision-accumulator GEMM (same bits as `jaxlp.matmul`).

Grid (batch, M tiles, N tiles); each program owns a (bm, bn) output tile and loops over k
strictly ascending inside the kernel (``lax.fori_loop``), calling the same per-step functions
as the reference (:mod:`jaxlp.pallas._gemm`): per-MAC rounding for "naive"/"kahan" (a
(bm, 1) column of A times a (1, bn) row of B per step), and for "chunked" an fp32
``jnp.dot`` of a (bm, chunk) x (chunk, bn) block per step (``precision=HIGHEST``: IEEE fp32
on the Triton backend, not TF32), rounded into the accumulator.

Operands are zero-padded to whole tiles (and K to whole chunks); padded rows/columns are
sliced off. With ``mul=None`` the fp32 product is XORed with a zero word read from an
input at run time (GPU; in interpret mode with the reference's hash guard, see
``_gemm.StepCtx``) before it is added, so neither XLA nor Triton/LLVM contracts multiply and
add into an FMA.

GPU notes: tiles bm, bn must be powers of two (Triton), and for "chunked" bm, bn, chunk
>= 16 (tensor-core dot). The within-chunk summation order of the Triton dot differs from
XLA's, so on GPU "chunked" equals the reference only up to that order (naive/kahan are
bit-identical on every backend).
"""

from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxlp._util import cdiv, next_pow2, round_up
from jaxlp.pallas import _gemm as G
from jaxlp.pallas._quantize import on_gpu

#: Arrays with fewer output MACs than this are left to the reference.
MIN_PALLAS_MACS = 1 << 20


#: Whether, on a GPU, the kernel of an algorithm is faster than the XLA reference (then
#: :func:`jaxlp.matmul` runs the kernel there). Measured on one H100 80GB HBM3 (jax 0.11.2,
#: 4096^3, TFLOP/s; ``benchmarks/RESULTS.md``, 2026-11-23). Re-measure with
#: ``python benchmarks/kernels.py --check`` and update.
KERNEL_IS_FASTER = types.MappingProxyType({
    # reference / kernel: acc=BF16 0.64 / 2.14, mul=acc=BF16 0.64 / 1.19,
    # stochastic acc=FP16 0.44 / 0.69 (the same bits: checked at 2048^3)
    "naive": True,
    # mul=acc=cpd_float(5, 2): reference 0.201, kernel 0.173
    "kahan": False,
    # acc=BF16, chunk 32: reference 9.05, kernel 26.3 -- but within a chunk the kernel sums
    # in the tensor core's order, so its bits may differ from the reference: not dispatched
    "chunked": False,
})


def kernel_applies(a_shape, b_shape, *, algorithm="naive", chunk=None) -> bool:
  """Whether :func:`jaxlp.matmul` runs the kernel for operands of these shapes on a GPU:
  at least ``MIN_PALLAS_MACS`` multiply-adds (estimated as ``a.size * b.shape[-1]``), for
  "chunked" ``chunk`` a power of two >= 16, and the algorithm's kernel measured faster than
  the reference (:data:`KERNEL_IS_FASTER`). Static: shapes only."""
  if not KERNEL_IS_FASTER.get(algorithm, False):
    return False
  if algorithm == "chunked" and (not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1)):
    return False
  macs = math.prod(a_shape) * (b_shape[-1] if len(b_shape) else 1)
  return macs >= MIN_PALLAS_MACS


def can_use_pallas_matmul(a, b, *, algorithm="naive", chunk=None) -> bool:
  """Whether ``jaxlp.matmul(a, b, ...)`` runs the kernel: both operands live on a GPU
  device (see ``on_gpu`` in ``jaxlp/pallas/_quantize.py``; False for tracers, whose platform is
  chosen at lowering) and :func:`kernel_applies`. Either way the naive/kahan bits are the
  same.

  Args:
    a, b: the operands (arrays or array-likes).
    algorithm: ``"naive"``, ``"kahan"`` or ``"chunked"``.
    chunk: chunk length for ``"chunked"``.

  Returns:
    bool.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import pallas
    >>> # tiny operands (fewer than MIN_PALLAS_MACS multiply-adds) never take the kernel
    >>> pallas.can_use_pallas_matmul(jnp.ones((2, 3)), jnp.ones((3, 2)))
    False
  """
  return (on_gpu(a) and on_gpu(b)
          and kernel_applies(jnp.shape(a), jnp.shape(b), algorithm=algorithm, chunk=chunk))


def _make_kernel(*, mul, acc, rounding, algorithm, chunk, K, M, N, n_out, bm, bn, interpret):
  def kernel(kw_ref, zero_ref, a_ref, b_ref, c_ref, o_ref):
    b_id, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = i * bm + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
    cols = j * bn + lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
    o_idx = G.output_index(b_id, rows, cols, M, N)
    kw = (kw_ref[0], kw_ref[1])
    ctx = G.StepCtx(mul, acc, rounding, kw, o_idx, n_out, G.ROUNDINGS_PER_STEP[algorithm],
                    zero=None if interpret else zero_ref[0], hash_guard=interpret)
    s0 = c_ref[...]
    if algorithm == "chunked":
      def body(t, s):
        a_blk = a_ref[:, pl.ds(t * chunk, chunk)]
        b_blk = b_ref[pl.ds(t * chunk, chunk), :]
        return G.chunk_step(ctx, s, G.chunk_dot(a_blk, b_blk), t)

      s = lax.fori_loop(0, cdiv(K, chunk), body, s0)
    elif algorithm == "naive":
      def body(t, s):
        return G.naive_step(ctx, s, a_ref[:, pl.ds(t, 1)], b_ref[pl.ds(t, 1), :], t)

      s = lax.fori_loop(0, K, body, s0)
    else:
      def body(t, carry):
        return G.kahan_step(ctx, carry, a_ref[:, pl.ds(t, 1)], b_ref[pl.ds(t, 1), :], t)

      s, _ = lax.fori_loop(0, K, body, (s0, jnp.zeros_like(s0)))
    o_ref[...] = s

  return kernel


def matmul(a, b, *, mul=None, acc=None, algorithm: str = "naive", chunk: int | None = None,
           rounding: str = "nearest", key=None, dimension_numbers=None,
           preferred_element_type=None, bias=None, grad: str = "fp32", interpret: bool = False,
           block_m: int | None = None, block_n: int | None = None, num_warps: int = 4):
  """Pallas version of :func:`jaxlp.matmul` (same arguments and bits; see there).

  The derivative is :func:`jaxlp.matmul`'s (``grad="fp32"``: float32 GEMMs, ``jvp`` and
  ``grad``; ``grad="emulate"``: the backward GEMMs run through this kernel with the same
  settings, ``interpret``, tiles and warps included), so the gradients have the same bits as
  :func:`jaxlp.matmul`'s.

  Args:
    a, b: the operands; every argument before ``interpret`` is as in :func:`jaxlp.matmul`.
    interpret: run in the Pallas interpreter (CPU testing).
    block_m, block_n: output tile (powers of two on GPU; default min(64, next_pow2(dim)),
      at least 16 for "chunked"); the backward GEMMs of ``grad="emulate"`` use the same.
    num_warps: Triton warps per program.

  Returns:
    The product, shaped as ``lax.dot_general`` would shape it.

  Raises:
    DTypeError: ``a`` or ``b`` is not float32, float16 or bfloat16 (a numpy float64 array
      included), as in :func:`jaxlp.matmul`.
    TypeError: a ``dimension_numbers`` entry that is not an int.
    ValueError: the argument errors of :func:`jaxlp.matmul` (a ``dimension_numbers`` axis
      out of range or named twice, operands with ndim < 2 and no ``dimension_numbers``,
      dimensions that do not match or batch dimensions that do not broadcast, unknown
      ``algorithm`` or ``grad``, a ``mul``/``acc`` that is not an elementwise format, a bad
      ``chunk``, ``"stochastic"`` without ``key``).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp import pallas
    >>> a, b = jnp.array([[256.0, 1.0, 1.0], [1.0, 1.0, 256.0]]), jnp.ones((3, 1))
    >>> # BF16 accumulator, k ascending: row 0 loses both 1s (256 + 1 is a tie, to even);
    >>> # row 1 adds them before the 256 and keeps them
    >>> pallas.matmul(a, b, acc=F.BF16, interpret=True)
    Array([[256.],
           [258.]], dtype=float32)
  """
  static = dict(mul=mul, acc=acc, algorithm=algorithm, chunk=chunk, rounding=rounding)
  gemm = functools.partial(_kernel_gemm, interpret=interpret, block_m=block_m,
                           block_n=block_n, num_warps=num_warps, **static)
  return G.gemm_call(gemm, a, b, key=key, dimension_numbers=dimension_numbers,
                     preferred_element_type=preferred_element_type, bias=bias, grad=grad,
                     **static)


def _kernel_gemm(A, Bm, C, kw, *, mul, acc, algorithm, chunk, rounding, interpret, block_m,
                 block_n, num_warps):
  """The kernel on canonical operands: A (Bt, M, K) @ Bm (Bt, K, N) float32, C the (Bt, M, N)
  initial accumulator, kw the (2,) uint32 key words; returns S (Bt, M, N) float32."""
  Bt, M, K = A.shape
  N = Bm.shape[2]
  lo = 16 if algorithm == "chunked" else 1
  bm = block_m or max(lo, min(64, next_pow2(M)))
  bn = block_n or max(lo, min(64, next_pow2(N)))
  Mp, Np = round_up(M, bm), round_up(N, bn)
  Kp = round_up(K, chunk) if algorithm == "chunked" else K
  A = jnp.pad(A, ((0, 0), (0, Mp - M), (0, Kp - K)))
  Bm = jnp.pad(Bm, ((0, 0), (0, Kp - K), (0, Np - N)))
  C = jnp.pad(C, ((0, 0), (0, Mp - M), (0, Np - N)))
  kernel = _make_kernel(mul=mul, acc=acc, rounding=rounding, algorithm=algorithm, chunk=chunk,
                        K=K, M=M, N=N, n_out=Bt * M * N, bm=bm, bn=bn, interpret=interpret)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt  # GPU only
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((Bt, Mp, Np), jnp.float32),
      grid=(Bt, Mp // bm, Np // bn),
      in_specs=[
          pl.BlockSpec((2,), lambda b_, i, j: (0,)),
          pl.BlockSpec((1,), lambda b_, i, j: (0,)),
          pl.BlockSpec((None, bm, Kp), lambda b_, i, j: (b_, i, 0)),
          pl.BlockSpec((None, Kp, bn), lambda b_, i, j: (b_, 0, j)),
          pl.BlockSpec((None, bm, bn), lambda b_, i, j: (b_, i, j)),
      ],
      out_specs=pl.BlockSpec((None, bm, bn), lambda b_, i, j: (b_, i, j)),
      interpret=interpret,
      compiler_params=params,
      name=f"jaxlp_matmul_{algorithm}",
  )(kw, jnp.zeros((1,), jnp.uint32), A, Bm, C)
  return out[:, :M, :N]


__all__ = ["can_use_pallas_matmul", "kernel_applies", "matmul"]
