"""PowerSGD's orthogonalization follows PyTorch's rule (Gram-Schmidt for rank <= 2, Householder
QR above), and with QR a gradient of lower rank than the factors is recovered exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.parallel import compressed_allreduce, init_compression_state
from jaxlp.parallel import compressors as C
from jaxlp.parallel.compressors import _lowrank as L


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def test_rule_gram_schmidt_up_to_rank_2_qr_above():
  rng = np.random.default_rng(0)
  for r in (1, 2, 3, 5):
    x = jnp.asarray(rng.standard_normal((40, r)).astype(np.float32))
    got = jax.jit(C.orthogonalize)(x)
    ref = L.gram_schmidt if r <= 2 else (lambda v: jnp.linalg.qr(v, mode="reduced")[0])
    np.testing.assert_array_equal(_bits(got), _bits(jax.jit(ref)(x)))
    np.testing.assert_allclose(np.asarray(got).T @ np.asarray(got), np.eye(r), atol=2e-6)
  x = jnp.asarray(rng.standard_normal((40, 2)).astype(np.float32))
  np.testing.assert_array_equal(_bits(C.orthogonalize(x, method="qr")),
                                _bits(jnp.linalg.qr(x, mode="reduced")[0]))
  np.testing.assert_array_equal(_bits(C.orthogonalize(jnp.concatenate([x, x], 1),
                                                      method="gram_schmidt")[:, :2]),
                                _bits(L.gram_schmidt(x)))
  with pytest.raises(ValueError, match="method"):
    C.orthogonalize(x, method="householder")
  with pytest.raises(ValueError, match="orthogonalization"):
    C.powersgd(2, orthogonalization="svd")


@pytest.mark.usefixtures("fast_compile")
def test_gram_schmidt_epsilon_and_zero_columns():
  """PyTorch's formula ``col / (||col|| + eps)``; with eps = 0 an all-zero column stays zero
  (PyTorch: NaN)."""
  x = np.array([[3.0, 1.0], [4.0, 2.0]], np.float32)
  eps = 1e-3
  c0 = x[:, 0] / (np.float32(5.0) + np.float32(eps))
  c1 = x[:, 1] - np.dot(c0, x[:, 1]) * c0
  c1 = c1 / (np.linalg.norm(c1) + eps)
  np.testing.assert_allclose(np.asarray(C.orthogonalize(jnp.asarray(x), epsilon=eps)),
                             np.stack([c0, c1], 1), rtol=2e-6)
  z = C.orthogonalize(jnp.zeros((4, 2)))
  assert not np.isnan(np.asarray(z)).any() and not np.asarray(z).any()


def test_qr_signs_are_torchs():
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(1)
  for shape in ((50, 4), (3, 64, 8)):
    a = rng.standard_normal(shape).astype(np.float32)
    got = np.asarray(C.orthogonalize(jnp.asarray(a)))
    want = torch.linalg.qr(torch.from_numpy(a))[0].numpy()
    np.testing.assert_allclose(got, want, atol=5e-6)  # the same columns, the same signs


def _rank_deficient_run(comp, g, steps):
  """``steps`` PowerSGD all-reduces of the same gradients (2 workers, warm start)."""
  st = init_compression_state(comp, jnp.zeros(g.shape[1:]))
  st = jax.tree_util.tree_map(lambda a: jnp.stack([a] * g.shape[0]), st)
  f = jax.jit(jax.vmap(lambda x, s: compressed_allreduce(x, s, "w", comp, min_size=0),
                       axis_name="w"))
  outs = []
  for _ in range(steps):
    out, st = f(g, st)
    outs.append(np.asarray(out[0]))
  return outs


def _rel(a, b):
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("rank,grad_rank", [(4, 2), (2, 1)])
def test_rank_above_the_gradients_rank_recovers_it_exactly(rank, grad_rank):
  """Rank r > rank(G), G the same on both workers: with QR (PyTorch's choice for r > 2, and
  ``orthogonalization="qr"``) the approximation is G to float32 rounding at the first step
  and after warm start; Gram-Schmidt normalises rounding noise into the surplus columns,
  which are then not orthogonal to the others (a relative error of order 1)."""
  rng = np.random.default_rng(2)
  a = rng.standard_normal((48, grad_rank)).astype(np.float32)
  b = rng.standard_normal((grad_rank, 40)).astype(np.float32)
  g = np.stack([a @ b, a @ b])
  mean = (g[0] + g[1]) / 2
  qr = "auto" if rank > 2 else "qr"
  for out in _rank_deficient_run(C.powersgd(rank, orthogonalization=qr), jnp.asarray(g), 3):
    assert _rel(out, mean) < 1e-5
  gs = _rank_deficient_run(C.powersgd(rank, orthogonalization="gram_schmidt",
                                      error_feedback=False), jnp.asarray(g), 3)
  assert max(_rel(out, mean) for out in gs) > 1e-2


def test_batched_rank_is_clipped_to_the_square():
  assert C.powersgd(4, batched=True).matrix_shape((5,)) == (3, 3, 3)
  assert C.powersgd(4, batched=True).matrix_shape((100,)) == (10, 10, 4)
