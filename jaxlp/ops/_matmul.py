"""`jaxlp.matmul`: GEMM with rounded products and a low-precision accumulator.

:func:`matmul_reference` is the pure-jnp reference: for every output element the reduction
index k runs strictly ascending; the loop over k is a ``lax.scan`` vectorised over the whole
(batch, M, N) output. The Pallas kernel :func:`jaxlp.pallas.matmul` gives identical
bits (same step functions from :mod:`jaxlp.pallas._gemm`). :func:`matmul` (= ``jaxlp.matmul``)
runs the kernel on a GPU where ``kernel_applies`` (``jaxlp/pallas/_matmul.py``) says so and the
reference elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp._util import cdiv
from jaxlp.pallas import _gemm as G
from jaxlp.pallas._matmul import kernel_applies
from jaxlp.pallas._matmul import matmul as _kernel_matmul


def matmul(a, b, *, mul=None, acc=None, algorithm: str = "naive", chunk: int | None = None,
           rounding: str = "nearest", key=None, dimension_numbers=None,
           preferred_element_type=None, bias=None, grad: str = "fp32"):
  """Matrix product with every product rounded to ``mul`` and every partial sum to ``acc``.

  Same arguments and bits as :func:`matmul_reference` (documented there). On a GPU it runs
  the Pallas kernel :func:`jaxlp.pallas.matmul` where
  ``kernel_applies`` in ``jaxlp/pallas/_matmul.py`` (the algorithm's kernel was measured faster
  than the reference, enough multiply-adds); the choice follows the platform the
  computation is compiled for (``lax.platform_dependent``), so arrays on a CPU device
  always take the reference. On a GPU, a ``"chunked"`` kernel sums inside a chunk in the
  matrix unit's order (naive/kahan: same bits everywhere).

  Derivative (``grad``; the roundings themselves have no useful derivative, so one is
  defined, never a silent zero). With ``g`` the output cotangent and ``A``, ``B`` the
  operands in the ``(batch, M, K) @ (batch, K, N)`` form:

  * ``grad="fp32"`` (default): the derivative of the exact product, as if every rounding were
    the identity (the straight-through rule of :func:`jaxlp.quantize`): ``dA = g @ B^T`` and
    ``dB = A^T @ g`` as float32 GEMMs (``Precision.HIGHEST``), ``d bias = g``; forward mode
    gives ``dA @ B + A @ dB (+ d bias)``, the same GEMMs. ``jax.grad``, ``jax.jvp``,
    ``jax.vmap``, ``jax.jit`` and higher orders all work.
  * ``grad="emulate"``: the backward GEMMs run through the same emulation (same ``mul``,
    ``acc``, ``algorithm``, ``chunk``, ``rounding``, accumulator starting at +0), as
    ``DotPolicy``'s ``dlhs_acc``/``drhs_acc`` do: ``dA = matmul(g, B^T)``,
    ``dB = matmul(A^T, g)``, ``d bias = g``. With ``rounding="stochastic"`` the ``dA`` GEMM
    draws its noise from ``jax.random.fold_in(key, 1)`` and the ``dB`` GEMM from
    ``fold_in(key, 2)`` (the forward keeps ``key``): deterministic, and the three GEMMs'
    noise is independent. Second derivatives repeat the rule (keys folded again). A
    ``jax.custom_vjp``: reverse mode only, ``jax.jvp`` raises JAX's ``TypeError`` ("can't apply
    forward-mode autodiff (jvp) to a custom_vjp function").

  Either way, cotangents of broadcast batch dimensions (and of a broadcast ``bias``) are
  summed in float32, and a float16/bfloat16 operand gets the float32 cotangent rounded to its
  dtype. The kernel (:func:`jaxlp.pallas.matmul`) has the same derivative and bits.

  Args:
    a, b: float32/float16/bfloat16 operands.
    mul, acc: elementwise formats of the products and of the running sum, or None (fp32).
    algorithm: ``"naive"``, ``"kahan"`` or ``"chunked"``.
    chunk: chunk length for ``"chunked"``.
    rounding: rounding mode of every ``mul``/``acc`` rounding.
    key: PRNG key for ``rounding="stochastic"``.
    dimension_numbers: None (``a (..., M, K) @ b (..., K, N)``) or ``lax.dot_general``'s.
    preferred_element_type: output dtype.
    bias: optional initial accumulator value.
    grad: the derivative: ``"fp32"`` (default) or ``"emulate"`` (see above).

  Returns:
    The product, shaped as ``lax.dot_general`` would shape it.

  Raises:
    DTypeError: ``a`` or ``b`` is not float32, float16 or bfloat16 (e.g. a numpy float64
      array or an integer array; the same rule and error type as :func:`jaxlp.quantize`).
    TypeError: a ``dimension_numbers`` entry that is not an int.
    ValueError: a ``dimension_numbers`` axis out of range or named twice; operands with
      ndim < 2 and no ``dimension_numbers``; contracting (or paired batch) dimensions of
      different sizes; batch dimensions that do not broadcast (all three name both shapes);
      an unknown ``algorithm`` or ``grad``; a ``mul``/``acc`` that is not an elementwise
      format or does not support ``rounding``; ``chunk`` missing or not a positive int for
      ``"chunked"``, given for another algorithm, or ``"chunked"`` with ``mul``;
      ``"stochastic"`` without ``key``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> a, b = jnp.array([[256.0, 1.0, 1.0, 1.0, 1.0]]), jnp.ones((5, 1))
    >>> jaxlp.matmul(a, b)  # float32 accumulator
    Array([[260.]], dtype=float32)
    >>> # BF16 accumulator (spacing 2 at 256): 256 + 1 is a tie, back to 256 every step
    >>> jaxlp.matmul(a, b, acc=F.BF16)
    Array([[256.]], dtype=float32)
    >>> # chunks of 4: 256 + (1 + 1 + 1) = 259 -> 260, then 260 + 1 -> 260 (tie, to even)
    >>> jaxlp.matmul(a, b, acc=F.BF16, algorithm="chunked", chunk=4)
    Array([[260.]], dtype=float32)
    >>> # d/dx of sum(x @ w) is g @ w^T with g = [[1, 1]]: 256 + 1, summed in float32 ...
    >>> import jax
    >>> x, w = jnp.ones((1, 1)), jnp.array([[256.0, 1.0]])
    >>> jax.grad(lambda x: jaxlp.matmul(x, w, acc=F.BF16).sum())(x)
    Array([[257.]], dtype=float32)
    >>> # ... or in the same BF16 accumulator (grad="emulate"): 256 + 1 is a tie, to 256
    >>> jax.grad(lambda x: jaxlp.matmul(x, w, acc=F.BF16, grad="emulate").sum())(x)
    Array([[256.]], dtype=float32)
  """
  a, b = G.operands(a, b, dimension_numbers)
  kw = dict(mul=mul, acc=acc, algorithm=algorithm, chunk=chunk, rounding=rounding,
            dimension_numbers=dimension_numbers, preferred_element_type=preferred_element_type,
            grad=grad)
  G.check_args(a, b, mul, acc, algorithm, chunk, rounding, key)
  G.check_grad(grad)
  if not kernel_applies(a.shape, b.shape, algorithm=algorithm, chunk=chunk):
    return matmul_reference(a, b, key=key, bias=bias, **kw)
  if dimension_numbers is not None:  # hashable (a static argument of the dispatch)
    kw["dimension_numbers"] = tuple(tuple(tuple(d) for d in pair) for pair in dimension_numbers)
  return _dispatch(a, b, key, bias, tuple(kw.items()))


#: Platforms whose compiled code runs the Pallas kernel (Triton on NVIDIA GPUs); every other
#: platform runs the pure-jnp version.
_KERNEL_PLATFORMS = ("cuda",)


@functools.partial(jax.jit, static_argnums=(4,))
def _dispatch(a, b, key, bias, static):
  def reference(a, b, key, bias):
    return matmul_reference(a, b, key=key, bias=bias, **dict(static))

  def kernel(a, b, key, bias):
    return _kernel_matmul(a, b, key=key, bias=bias, **dict(static))

  branches = dict.fromkeys(_KERNEL_PLATFORMS, kernel)
  return lax.platform_dependent(a, b, key, bias, **branches, default=reference)


def matmul_reference(a, b, *, mul=None, acc=None, algorithm: str = "naive",
                     chunk: int | None = None, rounding: str = "nearest", key=None,
                     dimension_numbers=None, preferred_element_type=None, bias=None,
                     grad: str = "fp32"):
  """Matrix product with every product rounded to ``mul`` and every partial sum to ``acc``.

  Per output element (k strictly ascending, s = +0.0 initially, or the ``bias``):

  * ``"naive"``: ``p = Q_mul(fl32(a_k * b_k)); s = Q_acc(fl32(s + p))``.
  * ``"kahan"`` (CPD's ``quant_gemm`` in ``CPDtorch/quant/quant_function.py``; c = 0 at first):
    ``p = Q_mul(a_k*b_k); y = Q_acc(p - c); t = Q_acc(s + y); c = Q_acc(Q_acc(t - s) - y);
    s = t``; the output is s (c is not added back). With ``mul = acc = cpd_float(e, m)`` this
    is CPD's kernel without its tail-tile bug.
  * ``"chunked"``: k is cut into consecutive chunks of ``chunk`` (the last one zero-padded);
    each chunk's dot is an fp32 dot (``precision=HIGHEST``, fp32 accumulation, summation
    order within the chunk is the backend's, as in a matrix unit) and
    ``s = Q_acc(fl32(s + chunk_dot))``. ``mul`` must be None.

  ``mul=None`` means the fp32 product, rounded to fp32 and then added: never a fused
  multiply-add (the product's bits are XORed with a word that is always zero but that no
  compiler can prove zero, before the add).
  ``acc=None`` means fp32 accumulation. Arithmetic is the backend's fp32 (XLA on CPU flushes
  float32 subnormal results of the multiply/add to zero; the rounding to ``mul``/``acc`` is
  exact bit-level).

  Args:
    a, b: float32/float16/bfloat16 arrays (converted exactly to float32).
    mul, acc: elementwise jaxlp formats (FloatFormat/presets, cpd_float, qpytorch_float,
      FixedPoint) or None.
    algorithm: ``"naive"``, ``"kahan"`` or ``"chunked"``.
    chunk: chunk length for ``"chunked"``.
    rounding: rounding mode of every ``mul``/``acc`` rounding.
    key: PRNG key for ``rounding="stochastic"``; noise word of rounding r of step t of output
      element o is ``hash_bits(k0, k1, (t*R + r)*O + o)`` (see :mod:`jaxlp.pallas._gemm`).
    dimension_numbers: None for ``a (..., M, K) @ b (..., K, N)`` (broadcast batch dims),
      else ``lax.dot_general``'s ``((lc, rc), (lb, rb))``; transposed operands are expressed
      through it (e.g. ``(((0,), (0,)), ((), ()))`` for ``a.T @ b``).
    preferred_element_type: output dtype (default ``result_type(a, b)``); the fp32 result is
      cast to it (round to nearest even).
    bias: optional array broadcastable to the output shape: the accumulator's initial value
      (``D = A B + C`` of a matrix unit), converted exactly to float32 and NOT rounded to
      ``acc`` first (pass ``jaxlp.quantize(bias, acc)`` if it must be an ``acc`` value); the
      first addition rounds. With ``K = 0`` the result is the bias.
    grad: the derivative, ``"fp32"`` or ``"emulate"`` (see :func:`matmul`).

  Returns:
    The product, shaped as ``lax.dot_general`` would shape it.
  """
  kw = dict(mul=mul, acc=acc, algorithm=algorithm, chunk=chunk, rounding=rounding)
  return G.gemm_call(functools.partial(_reference_gemm, **kw), a, b, key=key,
                     dimension_numbers=dimension_numbers,
                     preferred_element_type=preferred_element_type, bias=bias, grad=grad, **kw)


def _reference_gemm(A, Bm, s0, kw, *, mul, acc, algorithm, chunk, rounding):
  """The emulated GEMM on canonical operands: A (Bt, M, K) @ Bm (Bt, K, N) float32, s0 the
  (Bt, M, N) initial accumulator, kw the (2,) uint32 key words; returns S (Bt, M, N)."""
  Bt, M, K = A.shape
  N = Bm.shape[2]
  o_idx = G.output_index(jnp.arange(Bt)[:, None, None], jnp.arange(M)[None, :, None],
                         jnp.arange(N)[None, None, :], M, N)
  # hash_guard: an always-zero word no compiler can prove zero is XORed into each fp32
  # product, so XLA cannot contract multiply and add into an FMA (see _gemm.StepCtx).
  ctx = G.StepCtx(mul, acc, rounding, kw, o_idx, Bt * M * N, G.ROUNDINGS_PER_STEP[algorithm],
                  hash_guard=True)
  if algorithm == "chunked":
    nc = cdiv(K, chunk)
    Ap = jnp.pad(A, ((0, 0), (0, 0), (0, nc * chunk - K))).reshape(Bt, M, nc, chunk)
    Bp = jnp.pad(Bm, ((0, 0), (0, nc * chunk - K), (0, 0))).reshape(Bt, nc, chunk, N)
    xs = (jnp.moveaxis(Ap, 2, 0), jnp.moveaxis(Bp, 1, 0), jnp.arange(nc))

    def body(s, x):
      a_blk, b_blk, t = x
      return G.chunk_step(ctx, s, G.chunk_dot(a_blk, b_blk), t), None

    s, _ = lax.scan(body, s0, xs)
  else:
    xs = (jnp.moveaxis(A, 2, 0)[..., None], jnp.moveaxis(Bm, 1, 0)[:, :, None, :],
          jnp.arange(K))
    if algorithm == "naive":
      def body(s, x):
        a_col, b_row, t = x
        return G.naive_step(ctx, s, a_col, b_row, t), None

      s, _ = lax.scan(body, s0, xs)
    else:
      def body(carry, x):
        a_col, b_row, t = x
        return G.kahan_step(ctx, carry, a_col, b_row, t), None

      (s, _), _ = lax.scan(body, (s0, jnp.zeros_like(s0)), xs)
  return s
