"""PowerSGD's linear algebra, bit-reproducible in every execution mode: the thin products
``M Q`` and ``M^T P``, the rank-r reconstruction ``P Q^T`` and the orthogonalization of P and Q.

Shared by the compressor (:mod:`jaxlp.parallel.compressors._powersgd`) and the aggregation
engine (:mod:`jaxlp.parallel._aggregate`), below both, so that neither imports the other.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxlp.parallel._arith import sqrt_f32
from jaxlp.parallel.compressors._base import DOWN, det_sum, exact_div, materialize, no_fma


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
  b = materialize(b)
  cols = [det_sum(no_fma(a * b[..., None, :, j], anchor=b), axis=-1) for j in range(b.shape[-1])]
  return jnp.stack(cols, axis=-1)


def _pairwise_sum_rows(x):
  """:func:`det_sum` along axis -2 (the same pairs, the same zero padding when odd), adding
  whole contiguous rows: no transpose of a large matrix."""
  if x.shape[-2] == 0:
    return jnp.zeros(x.shape[:-2] + x.shape[-1:], x.dtype)
  while x.shape[-2] > 1:
    if x.shape[-2] % 2:
      x = jnp.concatenate([x, jnp.zeros(x.shape[:-2] + (1,) + x.shape[-1:], x.dtype)], axis=-2)
    x = x[..., 0::2, :] + x[..., 1::2, :]
  return x[..., 0, :]


def thin_matmul_t(a, b):
  """``a (..., k, n)`` transposed times ``b (..., k, r)``: the bits of
  ``thin_matmul(swapaxes(a, -1, -2), b)`` (the same products, the same pairwise tree), summed
  over a's rows in place (``M^T P`` without materialising ``M^T``)."""
  b = materialize(b)  # see thin_matmul
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


def orthogonalize(x):
  """Orthonormal columns spanning ``x`` (..., n, r): modified Gram-Schmidt, as PyTorch's
  ``_orthogonalize_gram_schmidt`` (``col /= ||col||``; then every later column minus its
  projection), with the dot products as fixed pairwise sums (the same bits in every execution
  mode). PyTorch (eps = 0) turns an all-zero column into NaN; here it stays zero. A column
  with a NaN or inf gives NaN (never a zero column that would hide it). A finite column whose
  sum of squares overflows float32 (entries beyond about ``2**64 / sqrt(n)``) is scaled by
  ``2**-100`` first: Gram-Schmidt's result does not depend on a column's positive scale, and
  the other columns keep their bits.

  Args:
    x: float32 array of shape ``(..., n, r)`` (leading axes are a batch).

  Returns:
    An array of ``x``'s shape whose nonzero columns are orthonormal.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp.parallel import compressors
    >>> compressors.orthogonalize(jnp.array([[3.0, 4.0], [4.0, -3.0]]))
    Array([[ 0.6,  0.8],
           [ 0.8, -0.6]], dtype=float32)
    >>> compressors.orthogonalize(jnp.array([[3.0, 0.0], [4.0, 0.0]]))  # zero column stays
    Array([[0.6, 0. ],
           [0.8, 0. ]], dtype=float32)

  References:
    PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``.
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
    nrm = materialize(sqrt_f32(det_sum(no_fma(c * c), axis=-1))[..., None])
    # a zero column stays zero; a NaN norm (a NaN or inf in the column) gives NaN
    cols[i] = c = materialize(jnp.where(nrm == 0, 0.0,
                                        exact_div(c, jnp.where(nrm == 0, 1.0, nrm))))
    for j in range(i + 1, len(cols)):
      d = det_sum(no_fma(c * cols[j]), axis=-1)[..., None]
      cols[j] = cols[j] - no_fma(d * c)
  return jnp.stack(cols, axis=-1)
