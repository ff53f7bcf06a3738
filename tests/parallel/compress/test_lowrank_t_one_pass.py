"""``thin_matmul_t`` (PowerSGD's ``M^T P``) on its one-pass path (all r columns from one read
of ``a``, ``k * n >= _ONE_PASS_MIN`` and ``r >= 2``) and column by column gives the bits of a
numpy oracle (fixed pairwise sums over the rows of separately rounded products), also under
``vmap``, and the two paths agree bit for bit on specials (±0, subnormals, ±inf, NaN)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.parallel.compressors import _lowrank

SPECIALS = np.array([0.0, -0.0, 2.0 ** -149, -(2.0 ** -140), 1e-38, 3e38, -3e38, np.inf,
                     -np.inf, np.nan], np.float32)


def _pairwise(x):
  """det_sum's tree along the last axis, in float32."""
  x = np.asarray(x, np.float32)
  if x.shape[-1] == 0:
    return np.zeros(x.shape[:-1], np.float32)
  while x.shape[-1] > 1:
    if x.shape[-1] % 2:
      x = np.concatenate([x, np.zeros(x.shape[:-1] + (1,), np.float32)], axis=-1)
    x = x[..., 0::2] + x[..., 1::2]
  return x[..., 0]


def _oracle(a, b):
  """``a^T b``: column j is the pairwise sum over a's rows of ``a[i, :] * b[i, j]``."""
  with np.errstate(all="ignore"):
    return np.stack([_pairwise(a.T * b[:, j]) for j in range(b.shape[1])], axis=-1)


def _same_bits(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  nan = np.isnan(want)
  assert np.array_equal(np.isnan(got), nan), "NaN positions differ"
  assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def _jit(fn):
  """A fresh jit (JAX's trace cache would keep a trace made under another _ONE_PASS_MIN)."""
  return jax.jit(lambda *args: fn(*args))


def _one_pass(a, b):
  """Whether thin_matmul_t traces the (k, r, n) products of its one-pass path."""
  jaxpr = jax.make_jaxpr(lambda a, b: _lowrank.thin_matmul_t(a, b))(a, b)
  want = (a.shape[-2], b.shape[-1], a.shape[-1])
  return any(v.aval.shape[-3:] == want for e in jaxpr.eqns for v in e.outvars
             if len(v.aval.shape) >= 3)


def _data(shape, seed, specials):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  if specials:
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, 12), replace=False)
    flat[idx] = rng.choice(SPECIALS, size=idx.size)
  return x


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("one_pass_min", [0, 2 ** 40])  # one pass for r >= 2 / column by column
def test_thin_matmul_t_paths_match_the_oracle(monkeypatch, r, one_pass_min):
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", one_pass_min)
  a = _data((11, 37), 0, specials=False) * np.float32(0.5)  # 11 rows: odd levels pad a zero
  a[0, :2] = SPECIALS[:2]  # +-0 (no subnormals: XLA:CPU flushes them, numpy does not)
  a[1, :] = 0.0  # an all-zero row
  b = _data((11, r), 1, specials=False)
  assert _one_pass(a, b) == (one_pass_min == 0 and r > 1)
  got = _jit(_lowrank.thin_matmul_t)(jnp.asarray(a), jnp.asarray(b))
  assert got.shape == (37, r)
  _same_bits(got, _oracle(a, b))
  batched = _jit(jax.vmap(_lowrank.thin_matmul_t))(jnp.stack([a, -a]), jnp.stack([b, b]))
  _same_bits(batched[0], got)
  _same_bits(batched[1], _oracle(-a, b))


@pytest.mark.parametrize("r", [2, 4])
def test_thin_matmul_t_one_pass_equals_columns_with_specials(monkeypatch, r):
  a = _data((9, 64), 2, specials=True)
  b = _data((9, r), 3, specials=True)
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", 0)
  assert _one_pass(a, b)
  one = np.asarray(_jit(_lowrank.thin_matmul_t)(a, b))
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", 2 ** 40)
  assert not _one_pass(a, b)
  cols = np.asarray(_jit(_lowrank.thin_matmul_t)(a, b))
  assert np.array_equal(one.view(np.uint32), cols.view(np.uint32))


def test_thin_matmul_t_matches_thin_matmul_of_the_transpose():
  """The docstring's promise: the bits of ``thin_matmul(a^T, b)`` (both one-pass here)."""
  a = _data((16, 4096), 5, specials=True)
  b = _data((16, 2), 6, specials=False)
  assert _one_pass(a, b)
  got = np.asarray(_jit(_lowrank.thin_matmul_t)(a, b))
  want = np.asarray(_jit(_lowrank.thin_matmul)(np.ascontiguousarray(a.T), b))
  _same_bits(got, want)


def test_the_benchmark_bucket_takes_the_one_pass_path():
  a, p = np.zeros((128, 9216), np.float32), np.zeros((128, 2), np.float32)
  assert _one_pass(a, p)
  assert not _one_pass(a, p[:, :1])
