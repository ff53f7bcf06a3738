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
from jaxlp.parallel.compressors._lowrank import outer_sum, thin_matmul, thin_matmul_t


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


def _largest_big_fusion(hlo_text, min_elements):
  """Instruction count of the largest fused computation whose result has at least
  ``min_elements`` elements (a per-element loop over the whole matrix)."""
  import re  # noqa: PLC0415
  worst, name, count, big = 0, None, 0, False
  for line in hlo_text.splitlines():
    if line.startswith("%fused"):
      name, count = line, 0
      shape = re.search(r"-> \w+\[([\d,]*)\]", line)
      dims = [int(d) for d in shape.group(1).split(",") if d] if shape else []
      big = int(np.prod(dims)) >= min_elements if dims else False
    elif name and line.startswith("}"):
      if big:
        worst = max(worst, count)
      name = None
    elif name:
      count += 1
  return worst


def test_small_factors_are_not_recomputed_per_element():
  """The reduced Q's ``/ W`` (an exact division on the bits, ~100 integer ops) and the
  orthogonalised factors are computed once, not fused into the ``n x m`` loops that broadcast
  them. XLA:CPU drops ``optimization_barrier`` before fusion; with it, the engine's PowerSGD on
  ResNet-18's matrices took 125 ms instead of 29 (CPU, 2026-11-26) when its output was
  reshaped (as in a ``shard_map`` body)."""
  from jaxlp.parallel import _aggregate as A  # noqa: PLC0415
  c = C.powersgd(2)
  n, m = 64, 96
  st = c.init((n, m))

  def body(mat, st):
    ms, ps = A.powersgd_start(c, [mat], [st], [None])
    ps, qs = A.powersgd_middle(c, ms, ps)
    outs, news = A.powersgd_finish(c, ms, ps, qs, [st], 4)
    return outs[0][None], news[0]

  with jax.default_device(jax.devices("cpu")[0]):  # XLA:CPU's fusion, also under cuda,cpu
    mat = jnp.ones((n, m), jnp.float32)
    st = jax.device_put(st)
    text = jax.jit(body).lower(mat, st).compile().as_text()
  worst = _largest_big_fusion(text, n * m)
  assert worst > 0, "no n x m fused loop found: the HLO text format changed"
  # about 60 instructions (a product, a sum, the no_fma XOR) against about 200 with the division
  assert worst < 100, "a per-element loop recomputes a small factor"
