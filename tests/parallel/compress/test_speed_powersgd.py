"""PowerSGD's fast products (issue 14, item 5) give the bits of the previous ones.

The references are the previous implementations: per-element FMA guard (two hashes), and
``M^T P`` as ``thin_matmul(M.T, P)`` (a transposed copy of M, summed along its last axis).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxlp.parallel.compressors as C
from jaxlp.formats._bits import fma_guard
from jaxlp.parallel.compressors._base import det_sum
from jaxlp.parallel.compressors._powersgd import outer_sum, thin_matmul, thin_matmul_t


def ref_thin_matmul(a, b):
  b = lax.optimization_barrier(b)
  return jnp.stack([det_sum(fma_guard(a * b[..., None, :, j]), axis=-1)
                    for j in range(b.shape[-1])], axis=-1)


def ref_outer_sum(p, q):
  p, q = lax.optimization_barrier((p, q))
  out = None
  for j in range(p.shape[-1]):
    t = fma_guard(p[..., :, j, None] * q[..., None, :, j])
    out = t if out is None else out + t
  return out


def _same(a, b):
  return np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("n,m,r", [(37, 53, 2), (1, 9, 1), (64, 33, 3)])
def test_products_equal_reference(n, m, r):
  rng = np.random.default_rng(n)
  a = rng.standard_normal((2, n, m)).astype(np.float32)  # a leading batch axis (batched)
  a[0, 0, :5] = -0.0
  a[1, 3 % n, :] = 1e-40  # subnormal products
  a = jnp.asarray(a)
  q = jnp.asarray(rng.standard_normal((2, m, r)).astype(np.float32))
  p = jnp.asarray(rng.standard_normal((2, n, r)).astype(np.float32))
  f = jax.jit(lambda a, p, q: (thin_matmul(a, q), thin_matmul_t(a, p), outer_sum(p, q)))
  g = jax.jit(lambda a, p, q: (ref_thin_matmul(a, q),
                               ref_thin_matmul(jnp.swapaxes(a, -1, -2), p), ref_outer_sum(p, q)))
  for x, y in zip(f(a, p, q), g(a, p, q), strict=True):
    assert _same(x, y)
  # per matrix (no batch axis) and under vmap: the same bits
  one = jax.jit(lambda a, p, q: (thin_matmul(a, q), thin_matmul_t(a, p), outer_sum(p, q)))
  for i in range(2):
    for x, y in zip(one(a[i], p[i], q[i]), g(a, p, q), strict=True):
      assert _same(x, y[i])
  for x, y in zip(jax.vmap(one)(a, p, q), g(a, p, q), strict=True):
    assert _same(x, y)


def test_encode_decode_steps_equal_reference():
  """Three steps of encode (error feedback, warm start) and decode against the reference ops."""
  c = C.powersgd(2)
  g = jnp.asarray(np.random.default_rng(0).standard_normal((40, 24)).astype(np.float32))

  def ref_step(g, st):
    mat = c.to_matrix(g, g.shape) + st["error"].reshape(40, 24)
    q = C.orthogonalize(st["q"])
    p = C.orthogonalize(ref_thin_matmul(mat, q))
    q = ref_thin_matmul(mat.T, p)
    return {"p": p, "q": q}, dict(st, q=q, iter=st["iter"] + 1,
                                  error=(mat - ref_outer_sum(p, q)).reshape(-1))

  st = c.init(g.shape, key=jax.random.key(1))
  enc = jax.jit(lambda g, s: c.encode(g, s))
  ref = jax.jit(ref_step)
  for _ in range(3):
    (pa, sa), (pb, sb) = enc(g, st), ref(g, st)
    for x, y in zip(jax.tree_util.tree_leaves((pa, sa)), jax.tree_util.tree_leaves((pb, sb)),
                    strict=True):
      assert _same(x, y)
    assert _same(c.decode(pa, g.shape), ref_outer_sum(pb["p"], pb["q"]))
    st = sa
