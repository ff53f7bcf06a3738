"""PowerSGD's linear algebra, bit-reproducible in every execution mode: the thin products
``M Q`` and ``M^T P``, the rank-r reconstruction ``P Q^T`` and the orthogonalization of P and Q
(PyTorch's rule: Gram-Schmidt up to rank 2, Householder QR above).

Shared by the compressor (:mod:`jaxlp.parallel.compressors._powersgd`) and the aggregation
engine (:mod:`jaxlp.parallel._aggregate`), below both, so that neither imports the other.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxlp.parallel._arith import add_f32, sqrt_f32
from jaxlp.parallel.compressors._base import DOWN, det_sum, exact_div, materialize, no_fma

#: ``a``'s size (n * k) from which :func:`thin_matmul` reads ``a`` once for all columns.
_ONE_PASS_MIN = 2 ** 16


def thin_matmul(a, b):
  """``a (..., n, k) @ b (..., k, r)`` for a small ``r``, bit-reproducible: each output column
  is a fixed pairwise sum (:func:`det_sum`) of separately rounded products. XLA's matmul
  accumulates in an order that differs between batched (``vmap``) and per-device kernels;
  this does not, so PowerSGD gives the same bits under vmap, shard_map, pmap and multi-host.
  Memory-bound like the matmul it replaces (``r`` is the PowerSGD rank)."""
  # b is small but may be the end of a long elementwise chain (orthogonalize, exact_div: IEEE
  # div/sqrt on the bits); materialize keeps XLA from fusing that chain into the product and
  # recomputing it for every element of a (measured: 100x slower on CPU; an
  # optimization_barrier is dropped before fusion). The values are unchanged.
  # b's columns are read as the contiguous rows of its materialized transpose: XLA:CPU then
  # vectorizes each column's product loop (strided columns of b: 2.3x slower at r = 4 on a
  # 128 x 9216 matrix, 2-core CPU, 2026-11-29). The same values, the same bits.
  bt = materialize(jnp.swapaxes(b, -1, -2))
  if b.shape[-1] > 1 and a.shape[-1] * a.shape[-2] >= _ONE_PASS_MIN:
    # all r columns in one pass over a: the products as (..., n, r, k), each row of a used for
    # the r columns while it is in cache, the same pairwise tree along k. 128 x 9216: 0.78 ->
    # 0.56 ms at r = 2, 1.17 -> 0.82 ms at r = 4 (2-core CPU, loaded, 2026-11-29); the same bits
    return det_sum(no_fma(a[..., :, None, :] * bt[..., None, :, :], anchor=bt), axis=-1)
  cols = [det_sum(no_fma(a * bt[..., j, None, :], anchor=bt), axis=-1)
          for j in range(b.shape[-1])]
  return jnp.stack(cols, axis=-1)


def _pairwise_sum_rows(x, axis=-2):
  """:func:`det_sum` along ``axis`` (-2 or -3; the same pairs, the same zero padding when odd),
  adding whole contiguous rows: no transpose of a large matrix."""
  ax = x.ndim + axis
  if x.shape[ax] == 0:
    return jnp.zeros(x.shape[:ax] + x.shape[ax + 1:], x.dtype)
  while x.shape[ax] > 1:
    if x.shape[ax] % 2:
      pad = jnp.zeros(x.shape[:ax] + (1,) + x.shape[ax + 1:], x.dtype)
      x = jnp.concatenate([x, pad], axis=ax)
    x = lax.slice_in_dim(x, 0, None, 2, axis=ax) + lax.slice_in_dim(x, 1, None, 2, axis=ax)
  return jnp.squeeze(x, ax)


def thin_matmul_t(a, b):
  """``a (..., k, n)`` transposed times ``b (..., k, r)``: the bits of
  ``thin_matmul(swapaxes(a, -1, -2), b)`` (the same products, the same pairwise tree), summed
  over a's rows in place (``M^T P`` without materialising ``M^T``)."""
  b = materialize(b)  # see thin_matmul
  if b.shape[-1] > 1 and a.shape[-1] * a.shape[-2] >= _ONE_PASS_MIN:
    # all r columns in one pass over a (as thin_matmul): the products as (..., k, r, n), each
    # row of a used for the r columns while it is in cache, the same pairwise tree over the k
    # rows; the (..., r, n) sums transposed at the end (small). 128 x 9216 at r = 2 / 4: 0.52
    # / 0.97 -> 0.37 / 0.52 ms (2-core CPU, loaded, 2026-11-29); the same bits
    prods = no_fma(a[..., :, None, :] * b[..., :, :, None], anchor=b)
    return jnp.swapaxes(_pairwise_sum_rows(prods, axis=-3), -1, -2)
  cols = [_pairwise_sum_rows(no_fma(a * b[..., :, j, None], anchor=b))
          for j in range(b.shape[-1])]
  return jnp.stack(cols, axis=-1)


def outer_sum(p, q):
  """``p (..., n, r) @ q (..., m, r).T`` for a small ``r``: the r rank-one terms added in
  ascending order, each product rounded separately (no FMA)."""
  p, q = materialize(p), materialize(q)  # see thin_matmul
  out = None
  for j in range(p.shape[-1]):
    t = no_fma(p[..., :, j, None] * q[..., None, :, j], anchor=p)
    out = t if out is None else out + t
  return out


ORTHOGONALIZATIONS = ("auto", "gram_schmidt", "qr")


def gram_schmidt(x, epsilon=0.0):
  """Orthonormal columns spanning ``x`` (..., n, r) by one pass of modified Gram-Schmidt, as
  PyTorch's ``_orthogonalize_gram_schmidt``: ``col /= ||col||`` (``||col|| + epsilon`` when
  ``epsilon > 0``), then every later column minus its projection on it. The dot products are
  fixed pairwise sums and the norms IEEE square roots (the same bits in every execution mode).

  With ``epsilon = 0`` PyTorch turns an all-zero column into NaN; here it stays zero. One pass
  loses orthogonality when a column is (numerically) in the span of the earlier ones: the
  remainder is rounding noise, and normalising it gives a column that is not orthogonal to
  the others (use :func:`householder_q` there).
  A column with a NaN or inf gives NaN (never a zero column that would hide it). A finite
  column whose sum of squares overflows float32 (entries beyond about ``2**64 / sqrt(n)``) is
  scaled by ``2**-100`` first: Gram-Schmidt's result does not depend on a column's positive
  scale, and the other columns keep their bits.

  Args:
    x: float32 array of shape ``(..., n, r)`` (leading axes are a batch).
    epsilon: PyTorch's ``orthogonalization_epsilon``.

  Returns:
    An array of ``x``'s shape whose nonzero columns are orthonormal.
  """
  # Each column's norm and normalized column are materialized: column i feeds every later
  # column, and XLA otherwise fuses (recomputes) the chain of integer-exact square roots and
  # divisions into each consumer. The values are unchanged. 2-core CPU, 2026-11-28:
  # 4096 x 4 compile 2.3 s -> 0.7 s, run 5.0 -> 0.51 ms; 512 x 2 run 0.26 -> 0.085 ms.
  # (Materializing the dot products and updated columns too was slower on ResNet-18's leaves.)
  # A finite column whose sum of squares overflows is scaled by 2**-100 (exact but for entries
  # far below the column's largest, which cannot matter next to it); times 1 elsewhere: the
  # same bits. Its projections then cannot overflow either.
  cols = []
  for i in range(x.shape[-1]):
    c = x[..., :, i]
    big = jnp.isinf(det_sum(no_fma(c * c), axis=-1)) & jnp.all(jnp.isfinite(c), axis=-1)
    cols.append(c * jnp.where(big, jnp.float32(DOWN), jnp.float32(1.0))[..., None])
  for i in range(len(cols)):
    c = cols[i]
    nrm = sqrt_f32(det_sum(no_fma(c * c), axis=-1))[..., None]
    if epsilon:
      nrm = materialize(add_f32(nrm, jnp.float32(epsilon)))
      cols[i] = c = materialize(exact_div(c, nrm), anchor=nrm)
    else:
      # a zero column stays zero; a NaN norm (a NaN or inf in the column) gives NaN
      nrm = materialize(nrm)
      cols[i] = c = materialize(jnp.where(nrm == 0, 0.0,
                                          exact_div(c, jnp.where(nrm == 0, 1.0, nrm))),
                                anchor=nrm)
    for j in range(i + 1, len(cols)):
      d = det_sum(no_fma(c * cols[j]), axis=-1)[..., None]
      cols[j] = cols[j] - no_fma(d * c)
  return jnp.stack(cols, axis=-1)


def householder_q(x):
  """The ``Q`` factor of the reduced Householder QR factorisation of ``x`` (..., n, r),
  ``n >= r``: ``jnp.linalg.qr(x, mode="reduced")[0]``, which runs LAPACK's ``geqrf`` +
  ``orgqr`` on the CPU (cuSOLVER's on a GPU), as ``torch.linalg.qr`` does.

  Sign convention: LAPACK's (``dlarfg``), not normalised. Step k reflects column k's part
  from row k down, ``v`` with leading element ``a``: if ``v`` has a nonzero below ``a``,
  ``R[k, k] = -sign(a) * ||v||`` (``sign(0) = +1``), so column k of ``Q`` is the Gram-Schmidt
  column times ``-sign(a)``; if not, no reflection (``R[k, k] = a``, column k of ``Q`` is the
  unit vector e_k). The diagonal of ``R`` is not made positive. ``torch.linalg.qr`` on the CPU
  follows the same convention, so P and Q have PyTorch's signs; a PowerSGD approximation
  ``P Q^T`` (and its error feedback) does not depend on the signs at all. ``Q`` is orthonormal
  to working precision also when ``x`` is rank-deficient (an all-zero column gives a unit
  column, not NaN). Bits: LAPACK's on the CPU (the same under ``vmap``, which loops over the
  batch); on a GPU the batched and the single-matrix solver may differ in the last bits.

  Args:
    x: float32 array of shape ``(..., n, r)`` with ``n >= r``.

  Returns:
    ``Q``, an array of ``x``'s shape with orthonormal columns.
  """
  return jnp.linalg.qr(x, mode="reduced")[0]


def orthogonalize(x, epsilon=0.0, method="auto"):
  """Orthonormal columns spanning ``x`` (..., n, r), chosen as PyTorch's PowerSGD hook
  (``_orthogonalize``) chooses: ``method="auto"`` is Gram-Schmidt (:func:`gram_schmidt`,
  with ``epsilon``) when the rank ``r = x.shape[-1]`` is at most 2, else Householder QR
  (:func:`householder_q`, ``epsilon`` unused, as PyTorch); PyTorch also uses Gram-Schmidt for
  half-precision factors, which the PyTorch bridge asks for with
  ``method="gram_schmidt"``. ``"gram_schmidt"`` and ``"qr"`` force one method (``"qr"``
  recovers a rank-deficient gradient exactly at ranks 1 and 2 too).

  Args:
    x: float32 array of shape ``(..., n, r)`` (leading axes are a batch); ``n >= r`` for QR.
    epsilon: PyTorch's ``orthogonalization_epsilon`` (Gram-Schmidt only).
    method: ``"auto"``, ``"gram_schmidt"`` or ``"qr"``.

  Returns:
    An array of ``x``'s shape with orthonormal columns (Gram-Schmidt: an all-zero column stays
    zero, where PyTorch gives NaN).

  Raises:
    ValueError: an unknown ``method``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp.parallel import compressors
    >>> compressors.orthogonalize(jnp.array([[3.0, 4.0], [4.0, -3.0]]))
    Array([[ 0.6,  0.8],
           [ 0.8, -0.6]], dtype=float32)
    >>> compressors.orthogonalize(jnp.array([[3.0, 0.0], [4.0, 0.0]]))  # zero column stays
    Array([[0.6, 0. ],
           [0.8, 0. ]], dtype=float32)
    >>> x = jnp.array([[3.0, 0.0, 0.0], [4.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, -5.0]])
    >>> compressors.orthogonalize(x)  # rank 3: Householder QR with LAPACK's (PyTorch's) signs
    Array([[-0.6,  0. ,  0. ],
           [-0.8,  0. ,  0. ],
           [-0. , -1. ,  0. ],
           [-0. , -0. ,  1. ]], dtype=float32)

  References:
    PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``
    (``_orthogonalize``, ``_orthogonalize_gram_schmidt``); LAPACK ``dgeqrf``/``dlarfg``.
  """
  if method not in ORTHOGONALIZATIONS:
    raise ValueError(f"orthogonalize: method={method!r} must be one of {ORTHOGONALIZATIONS}")
  if method == "qr" or (method == "auto" and x.shape[-1] > 2):
    return householder_q(x)
  return gram_schmidt(x, epsilon)
