"""Shared pieces of the low-precision GEMM: argument handling and the per-step arithmetic.

Both the pure-jnp reference (:func:`jaxlp.ops.matmul`) and the Pallas kernel
(:func:`jaxlp.pallas.matmul`) call the step functions below on (tiles of) the output,
so their arithmetic is the same expression by construction; they differ only in how the
output is tiled and how the loop over k is expressed.

Noise index scheme for ``rounding="stochastic"``: the operands are brought to the canonical
form A (Bt, M, K), B (Bt, K, N), output O = Bt*M*N elements with flat index
``o = b*M*N + i*N + j`` (= the C-order index of the ``dot_general``-layout result). Step ``t``
(t = k for "naive"/"kahan", t = chunk number for "chunked") performs ``R`` roundings
(naive: 2 = product, sum; kahan: 5 = p, y, t, (t - s), c; chunked: 1 = sum), numbered
``r``; rounding r of step t of output o uses the noise word
``hash_bits(k0, k1, (t*R + r)*O + o)`` (uint32 arithmetic, wrapping mod 2**32) where
(k0, k1) = ``key_words(key)``.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp.formats import _bits as B
from jaxlp.formats._quantize import DTypeError, check_format, is_elementwise, join_key, split_key

ALGORITHMS = ("naive", "kahan", "chunked")
ROUNDINGS_PER_STEP = {"naive": 2, "kahan": 5, "chunked": 1}
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def operands(a, b, dimension_numbers):
  """``a``, ``b`` as jax arrays (shared by :func:`jaxlp.matmul`, its reference and
  :func:`jaxlp.pallas.matmul`), with :func:`jaxlp.quantize`'s dtype rule (the caller's
  dtype must be float32/float16/bfloat16: ``jnp.asarray`` would narrow a numpy float64
  array silently) and every ``dimension_numbers`` axis in range (not wrapped)."""
  out = []
  for name, x in (("a", a), ("b", b)):
    in_dtype = getattr(x, "dtype", None)
    try:
      x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    except (TypeError, ValueError):
      raise TypeError(f"matmul: {name} must be a float32, float16 or bfloat16 array, got "
                      f"{type(x).__name__} {x!r:.80}") from None
    dt = x.dtype if in_dtype is None else jnp.dtype(in_dtype)
    if dt not in _FLOAT_DTYPES or x.dtype not in _FLOAT_DTYPES:
      raise DTypeError(f"matmul: {name} must be float32, float16 or bfloat16, got "
                       f"{name}.dtype={dt} (cast explicitly; float64 would be double-rounded "
                       "through float32)")
    out.append(x)
  a, b = out
  if dimension_numbers is not None:
    try:
      (lc, rc), (lb, rb) = dimension_numbers
      groups = [("lhs contracting", lc, a.ndim), ("rhs contracting", rc, b.ndim),
                ("lhs batch", lb, a.ndim), ("rhs batch", rb, b.ndim)]
      groups = [(what, tuple(ds), n) for what, ds, n in groups]
    except (TypeError, ValueError):
      raise ValueError("matmul: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                       f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None
    for what, ds, n in groups:
      for d in ds:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
          raise TypeError(f"matmul: {what} dimension {d!r} in dimension_numbers="
                          f"{dimension_numbers} is not an int")
        if not -n <= d < n:
          raise ValueError(f"matmul: {what} dimension {d} in dimension_numbers="
                           f"{dimension_numbers} is out of range for an operand with {n} "
                           "dimension(s)")
    for side, (c, bt, n) in (("lhs", (groups[0][1], groups[2][1], a.ndim)),
                             ("rhs", (groups[1][1], groups[3][1], b.ndim))):
      norm = [int(d) % n for d in c + bt]
      if len(set(norm)) != len(norm):
        raise ValueError(f"matmul: dimension_numbers={dimension_numbers} names a {side} "
                         "dimension twice")
  return a, b


def check_args(a, b, mul, acc, algorithm, chunk, rounding, key):
  """Validate the GEMM arguments (shared by the reference and the kernel)."""
  if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
    raise ValueError(f"matmul: algorithm must be one of {ALGORITHMS}, got {algorithm=}")
  if not isinstance(rounding, str) or rounding not in B.ROUNDINGS:
    raise ValueError(f"matmul: unknown rounding={rounding!r}; expected one of {B.ROUNDINGS}")
  for name, x in (("a", a), ("b", b)):
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
      raise TypeError(f"matmul: {name} must be float32, float16 or bfloat16, got "
                      f"{name}.dtype={x.dtype}")
  for name, fmt in (("mul", mul), ("acc", acc)):
    if fmt is None:
      continue
    check_format(fmt, rounding)
    if not is_elementwise(fmt):
      raise ValueError(f"matmul: {name} must be an elementwise format (FloatFormat, cpd_float, "
                       f"qpytorch_float, FixedPoint), got {name}={fmt!r}")
  if algorithm == "chunked":
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
      raise ValueError(f"matmul: algorithm='chunked' needs a positive int chunk, got {chunk=}")
    if mul is not None:
      raise ValueError("matmul: algorithm='chunked' computes exact fp32 dots inside a chunk; "
                       f"products cannot be rounded, so mul must be None, got {mul=}")
  elif chunk is not None:
    raise ValueError(f"matmul: chunk applies only to algorithm='chunked', got {chunk=}")
  if rounding == "stochastic" and key is None:
    raise ValueError("matmul: rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")


def canonicalize(a, b, dimension_numbers):
  """Bring operands to A (Bt, M, K), B (Bt, K, N) float32; return (A, B, out_shape).

  ``dimension_numbers=None``: ``a`` (..., M, K) @ ``b`` (..., K, N) with broadcast leading
  dims (``jnp.matmul`` for ndim >= 2). Otherwise lax.dot_general's
  ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``; the result layout is
  (batch..., lhs free..., rhs free...) as in ``lax.dot_general``; several contracting dims
  are flattened in the order listed (that flat index is the ascending k).
  """
  if dimension_numbers is None:
    if a.ndim < 2 or b.ndim < 2:
      raise ValueError(f"matmul: a and b need ndim >= 2 without dimension_numbers, got "
                       f"a.shape={a.shape}, b.shape={b.shape}")
    if a.shape[-1] != b.shape[-2]:
      raise ValueError(f"matmul: contracting dimension mismatch: a.shape[-1]={a.shape[-1]} but "
                       f"b.shape[-2]={b.shape[-2]} (a @ b contracts the last axis of a with the "
                       f"second-to-last of b): a.shape={a.shape}, b.shape={b.shape}")
    try:
      batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
      raise ValueError(f"matmul: the batch dimensions of a.shape={a.shape} and b.shape={b.shape} "
                       f"(all but the last two: {a.shape[:-2]} and {b.shape[:-2]}) do not "
                       "broadcast") from None
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    nb = len(batch)
    dimension_numbers = (((a.ndim - 1,), (b.ndim - 2,)), (tuple(range(nb)), tuple(range(nb))))
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = (tuple(int(d) % n for d in ds) for ds, n in
                    ((lc, a.ndim), (rc, b.ndim), (lb, a.ndim), (rb, b.ndim)))
  for what, x, y in (("contracting", lc, rc), ("batch", lb, rb)):
    if len(x) != len(y):
      raise ValueError(f"matmul: dimension_numbers={dimension_numbers} pairs {len(x)} lhs "
                       f"{what} dimension(s) with {len(y)} rhs {what} dimension(s)")
    for dl, dr in zip(x, y):
      if a.shape[dl] != b.shape[dr]:
        raise ValueError(f"matmul: {what} dimension mismatch for dimension_numbers="
                         f"{dimension_numbers}: a.shape[{dl}]={a.shape[dl]} but b.shape[{dr}]="
                         f"{b.shape[dr]} (a.shape={a.shape}, b.shape={b.shape})")
  lf = tuple(d for d in range(a.ndim) if d not in lc + lb)
  rf = tuple(d for d in range(b.ndim) if d not in rc + rb)
  batch = tuple(a.shape[d] for d in lb)
  m_dims = tuple(a.shape[d] for d in lf)
  n_dims = tuple(b.shape[d] for d in rf)
  K = math.prod(a.shape[d] for d in lc)
  Bt, M, N = math.prod(batch), math.prod(m_dims), math.prod(n_dims)
  A = jnp.transpose(a, lb + lf + lc).reshape(Bt, M, K).astype(jnp.float32)
  Bm = jnp.transpose(b, rb + rc + rf).reshape(Bt, K, N).astype(jnp.float32)
  return A, Bm, batch + m_dims + n_dims


def bias_init(bias, out_shape, Bt, M, N):
  """The accumulator's initial value (Bt, M, N) float32: zeros, or ``bias`` broadcast to the
  output shape and converted exactly."""
  if bias is None:
    return jnp.zeros((Bt, M, N), jnp.float32)
  bias = jnp.asarray(bias)
  if not jnp.issubdtype(bias.dtype, jnp.floating):
    raise TypeError(f"matmul: bias must be a float array, got dtype {bias.dtype}")
  try:
    full = jnp.broadcast_to(bias, out_shape)
  except ValueError:
    raise ValueError(f"matmul: bias.shape={bias.shape} does not broadcast to the output shape "
                     f"{out_shape}") from None
  return full.astype(jnp.float32).reshape(Bt, M, N)


def out_dtype(a, b, preferred_element_type):
  if preferred_element_type is not None:
    dt = jnp.dtype(preferred_element_type)
    if dt not in _FLOAT_DTYPES:
      raise TypeError(f"matmul: preferred_element_type must be float32/float16/bfloat16, "
                      f"got {preferred_element_type=}")
    return dt
  return jnp.result_type(a.dtype, b.dtype)


def key_array(key, rounding):
  """(2,) uint32 key words for stochastic rounding, zeros otherwise."""
  if rounding != "stochastic":
    return jnp.zeros((2,), jnp.uint32)
  from jaxlp.formats._quantize import key_words
  return jnp.stack(key_words(key))


# ---------------------------------------------------------------------------------------
# The derivative (shared by reference and kernel)
# ---------------------------------------------------------------------------------------
#: Values of the ``grad`` argument of :func:`jaxlp.matmul` / :func:`jaxlp.pallas.matmul`.
GRADS = ("fp32", "emulate")


def check_grad(grad):
  if not isinstance(grad, str) or grad not in GRADS:
    raise ValueError(f"matmul: grad must be one of {GRADS}, got grad={grad!r}")


def gemm_call(gemm, a, b, *, mul, acc, algorithm, chunk, rounding, key, dimension_numbers,
              preferred_element_type, bias, grad):
  """The common body of :func:`jaxlp.matmul`'s reference and of the kernel wrapper.

  Checks the arguments, brings the operands to the canonical A (Bt, M, K), B (Bt, K, N)
  float32 form, runs ``gemm(A, B, C, kw)`` (C: the (Bt, M, N) initial accumulator, kw: the
  (2,) uint32 key words) with the derivative chosen by ``grad`` (:func:`differentiable`) and
  shapes and casts the result. The canonicalisation (transpose, reshape, batch broadcast,
  dtype casts, bias broadcast) is plain jnp, differentiated by JAX: the cotangents of
  broadcast batch dimensions or of a broadcast bias are summed in float32, and a
  float16/bfloat16 operand's cotangent is the float32 one rounded to its dtype (nearest even).
  """
  a, b = operands(a, b, dimension_numbers)
  check_args(a, b, mul, acc, algorithm, chunk, rounding, key)
  check_grad(grad)
  dt = out_dtype(a, b, preferred_element_type)
  A, Bm, out_shape = canonicalize(a, b, dimension_numbers)
  Bt, M, K = A.shape
  N = Bm.shape[2]
  C = bias_init(bias, out_shape, Bt, M, N)
  if Bt * M * N == 0 or K == 0:  # no GEMM: the result is the bias (plain autodiff)
    return C.reshape(out_shape).astype(dt)
  S = differentiable(gemm, grad, rounding, A, Bm, C, key)
  return S.reshape(out_shape).astype(dt)


def _dot32(x, y):
  """A float32 batched GEMM (Bt, m, k) @ (Bt, k, n) at ``Precision.HIGHEST`` (IEEE fp32
  products and fp32 accumulation in the backend's order; not TF32/bf16 passes on a GPU)."""
  return jnp.matmul(x, y, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def differentiable(gemm, grad, rounding, A, Bm, C, key):
  """``gemm(A, Bm, C, key_array(key, rounding))`` with a defined derivative.

  The emulated GEMM works on bit patterns (integer ops), through which JAX's own autodiff
  sees no dependence (a silent zero derivative); this defines it instead, on the canonical
  operands A (Bt, M, K), Bm (Bt, K, N) and the initial accumulator C (Bt, M, N):

  * ``grad="fp32"``: a ``jax.custom_jvp`` whose tangent is ``dA @ Bm + A @ dBm + dC`` with
    float32 GEMMs (:func:`_dot32`): the derivative of the exact product, as if every rounding
    were the identity (the straight-through rule of :func:`jaxlp.quantize`). The tangent is
    linear, so JAX transposes it for reverse mode: ``dA = g @ Bm^T``, ``dBm = A^T @ g`` (fp32
    GEMMs), ``dC = g``; ``jvp``, ``grad``, ``vmap``, ``jit`` and higher orders all work.
  * ``grad="emulate"``: a ``jax.custom_vjp`` whose backward GEMMs are the same emulation
    (same mul/acc/algorithm/chunk/rounding, accumulator starting at +0):
    ``dA = gemm(g, Bm^T)`` with key ``fold_in(key, 1)``, ``dBm = gemm(A^T, g)`` with key
    ``fold_in(key, 2)`` (stochastic rounding only; the forward keeps ``key``), ``dC = g``. The
    backward GEMMs are themselves differentiable the same way (keys folded again), so
    second derivatives are emulated GEMMs too. Forward mode (``jax.jvp``) is not defined for a
    custom_vjp: JAX raises ``TypeError``.
  """
  if grad == "fp32":
    return _fp32_derivative(gemm)(A, Bm, C, key_array(key, rounding))
  kd, impl = split_key(key if rounding == "stochastic" else None)
  return _emulated_derivative(gemm, rounding, impl)(A, Bm, C, kd)


def _fp32_derivative(gemm):
  @jax.custom_jvp
  def f(A, Bm, C, kw):
    return gemm(A, Bm, C, kw)

  def f_jvp(primals, tangents):
    A, Bm, C, kw = primals
    dA, dB, dC, _ = tangents
    out = gemm(A, Bm, C, kw)
    terms = []
    if not isinstance(dA, jax.custom_derivatives.SymbolicZero):
      terms.append(_dot32(dA, Bm))
    if not isinstance(dB, jax.custom_derivatives.SymbolicZero):
      terms.append(_dot32(A, dB))
    if not isinstance(dC, jax.custom_derivatives.SymbolicZero):
      terms.append(dC)
    if not terms:
      return out, jnp.zeros_like(out)
    t = terms[0]
    for x in terms[1:]:
      t = t + x
    return out, t

  f.defjvp(f_jvp, symbolic_zeros=True)
  return f


def _emulated_derivative(gemm, rounding, impl):
  def primal(A, Bm, C, kd):
    return gemm(A, Bm, C, key_array(join_key(kd, impl), rounding))

  f = jax.custom_vjp(primal)

  def fwd(A, Bm, C, kd):
    return primal(A, Bm, C, kd), (A, Bm, kd)

  def bwd(res, g):
    A, Bm, kd = res
    key = join_key(kd, impl)
    k1 = None if key is None else jax.random.fold_in(key, 1)
    k2 = None if key is None else jax.random.fold_in(key, 2)
    dA = differentiable(gemm, "emulate", rounding, g, jnp.swapaxes(Bm, 1, 2),
                        jnp.zeros(A.shape, jnp.float32), k1)
    dB = differentiable(gemm, "emulate", rounding, jnp.swapaxes(A, 1, 2), g,
                        jnp.zeros(Bm.shape, jnp.float32), k2)
    return dA, dB, g, None

  f.defvjp(fwd, bwd)
  return f


# ---------------------------------------------------------------------------------------
# Per-step arithmetic (shared by reference and kernel)
# ---------------------------------------------------------------------------------------
class StepCtx:
  """Static GEMM settings plus the traced key words, output indices and FMA guard word.

  Args:
    mul, acc, rounding: as :func:`jaxlp.matmul`.
    kw: (2,) uint32 key words (ignored unless stochastic) — either an array or a pair of
      scalars.
    o_idx: uint32 flat output index of each element of the tile (broadcastable to it).
    n_out: total number of output elements O.
    steps_r: roundings per step R.
    zero: a uint32 zero read at run time from a kernel input (GPU kernel), or None.
    hash_guard: XOR the product with ``fmix32(p) == fmix32(p ^ 1)`` (always 0: fmix32 is a
      bijection, which no compiler can prove). Used by the XLA paths (reference, interpret
      mode), where XLA:CPU/LLVM constant-propagate a literal zero through the whole loop
      and then contract ``s + a*b`` into an FMA (measured: an optimization barrier on the
      product or on a zero word does not prevent it in small unrolled loops).

  With ``mul=None`` the fp32 product passes through one of these XORs before it is added,
  so multiply and add are never contracted into an FMA (a rounded ``mul`` is a bit-level op
  already and needs no guard).
  """

  def __init__(self, mul, acc, rounding, kw, o_idx, n_out, steps_r, zero=None,
               hash_guard=True):
    self.mul, self.acc, self.rounding = mul, acc, rounding
    self.kw, self.o_idx, self.n_out, self.steps_r = kw, o_idx, n_out, steps_r
    self.zero, self.hash_guard = zero, hash_guard

  def _rand(self, t, r):
    if self.rounding != "stochastic":
      return B.u32(0)
    t = jnp.asarray(t).astype(jnp.uint32)
    idx = (t * B.u32(self.steps_r) + B.u32(r)) * B.u32(self.n_out % 2**32) + self.o_idx
    return B.hash_bits(self.kw[0], self.kw[1], idx)

  def q(self, v, fmt, t, r):
    """Round the float32 array ``v`` to ``fmt`` (None: leave the fp32 value)."""
    if fmt is None:
      return v
    return B.from_bits(fmt._round_bits(B.to_bits(v), self.rounding, self._rand(t, r), None))

  def product(self, a_col, b_row, t):
    p = a_col * b_row
    if self.mul is not None:
      return self.q(p, self.mul, t, 0)
    return self.guard(p)

  def guard(self, p):
    """``p`` unchanged, but opaque to FMA contraction with a following add."""
    pb = B.to_bits(p)
    if self.zero is not None:
      pb = pb ^ self.zero
    p = B.from_bits(pb)
    return B.fma_guard(p) if self.hash_guard else p


def naive_step(ctx: StepCtx, s, a_col, b_row, t):
  p = ctx.product(a_col, b_row, t)
  return ctx.q(s + p, ctx.acc, t, 1)


def kahan_step(ctx: StepCtx, carry, a_col, b_row, t):
  """CPD's compensated step with every intermediate rounded (CPD's ``quant_gemm``)."""
  s, c = carry
  p = ctx.product(a_col, b_row, t)
  y = ctx.q(p - c, ctx.acc, t, 1)
  tt = ctx.q(s + y, ctx.acc, t, 2)
  c = ctx.q(ctx.q(tt - s, ctx.acc, t, 3) - y, ctx.acc, t, 4)
  return tt, c


def chunk_step(ctx: StepCtx, s, part, t):
  # Guarded: XLA rewrites a 1-long dot into a multiply that could fuse into the add.
  return ctx.q(s + ctx.guard(part), ctx.acc, t, 0)


def chunk_dot(a_blk, b_blk):
  """The exact-fp32 partial dot of one chunk: (..., m, c) @ (..., c, n), float32, HIGHEST.

  Its within-chunk summation order is the backend's (XLA:CPU's dot emitter in interpret
  mode and in the reference; the tensor-core/IEEE Triton dot on GPU).
  """
  return jnp.matmul(a_blk, b_blk, precision=lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


def output_index(b, i, j, M, N):
  """uint32 flat output index b*M*N + i*N + j (broadcasting)."""
  b, i, j = (jnp.asarray(v).astype(jnp.uint32) for v in (b, i, j))
  return b * B.u32((M * N) % 2**32) + i * B.u32(N % 2**32) + j
