"""PowerSGD's thin products and Gram-Schmidt on their faster paths give the bits of a numpy
oracle (fixed pairwise sums of separately rounded products, IEEE division and square root):
``thin_matmul``'s one pass over ``a`` for all columns (``n * k >= _ONE_PASS_MIN``) and its
column-by-column path, the same for ``thin_matmul_t`` (PowerSGD's ``M^T P``: all r columns
from one read of ``a`` where ``k * n >= _ONE_PASS_MIN`` and ``r >= 2``), and Gram-Schmidt's
columns materialized by a barrier on their norm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.parallel.compressors import _lowrank
from jaxlp.parallel.compressors._base import materialize

SPECIALS = np.array([0.0, -0.0, 2.0 ** -149, -(2.0 ** -140), 1e-38, 3e38, -3e38, np.inf,
                     -np.inf, np.nan], np.float32)


def _pairwise(x):
  """det_sum's tree along the last axis, in float32 (numpy keeps subnormals, as det_sum's
  definition; XLA:CPU's adds are compared on values where that does not matter below)."""
  x = np.asarray(x, np.float32)
  if x.shape[-1] == 0:
    return np.zeros(x.shape[:-1], np.float32)
  while x.shape[-1] > 1:
    if x.shape[-1] % 2:
      x = np.concatenate([x, np.zeros(x.shape[:-1] + (1,), np.float32)], axis=-1)
    x = x[..., 0::2] + x[..., 1::2]
  return x[..., 0]


def _thin_matmul_oracle(a, b):
  with np.errstate(all="ignore"):
    return np.stack([_pairwise(a * b[:, j]) for j in range(b.shape[1])], axis=-1)


def _gram_schmidt_oracle(x):
  with np.errstate(all="ignore"):
    cols = []
    for i in range(x.shape[1]):
      c = x[:, i].astype(np.float32)
      big = np.isinf(_pairwise(c * c)) and np.all(np.isfinite(c))
      cols.append(c * np.float32(2.0 ** -100 if big else 1.0))
    for i in range(len(cols)):
      c = cols[i]
      nrm = np.sqrt(_pairwise(c * c))
      c = np.zeros_like(c) if nrm == 0 else c / nrm
      if np.isnan(nrm):
        c = np.full_like(c, np.nan)
      cols[i] = c
      for j in range(i + 1, len(cols)):
        d = _pairwise(c * cols[j])
        cols[j] = cols[j] - d * c
    return np.stack(cols, axis=-1)


def _same_bits(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  nan = np.isnan(want)
  assert np.array_equal(np.isnan(got), nan), "NaN positions differ"
  assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def _jit(fn):
  """A fresh jit (a new function object: JAX's trace cache would otherwise keep the trace made
  under another ``_ONE_PASS_MIN``)."""
  return jax.jit(lambda *args: fn(*args))


def _one_pass(a, b):
  """Whether thin_matmul traces the (n, r, k) products of its one-pass path."""
  jaxpr = jax.make_jaxpr(lambda a, b: _lowrank.thin_matmul(a, b))(a, b)
  want = (a.shape[0], b.shape[1], a.shape[1])
  return any(v.aval.shape == want for e in jaxpr.eqns for v in e.outvars)


def _thin_matmul_t_oracle(a, b):
  """``a^T b``: column j is the pairwise sum over a's rows of ``a[i, :] * b[i, j]``."""
  return _thin_matmul_oracle(np.ascontiguousarray(a.T), b)


def _one_pass_t(a, b):
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
def test_thin_matmul_paths_match_the_oracle(monkeypatch, r, one_pass_min):
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", one_pass_min)
  a = _data((6, 37), 0, specials=False) * np.float32(0.5)
  a[0, :2] = SPECIALS[:2]  # +-0 (no subnormals: XLA:CPU flushes them, numpy does not)
  a[1, :] = 0.0  # an all-zero row
  b = _data((37, r), 1, specials=False)
  assert _one_pass(a, b) == (one_pass_min == 0 and r > 1)
  got = _jit(_lowrank.thin_matmul)(jnp.asarray(a), jnp.asarray(b))
  _same_bits(got, _thin_matmul_oracle(a, b))
  # under vmap: the same bits per batch element
  batched = _jit(jax.vmap(_lowrank.thin_matmul))(jnp.stack([a, -a]), jnp.stack([b, b]))
  _same_bits(batched[0], got)
  _same_bits(batched[1], _thin_matmul_oracle(-a, b))


@pytest.mark.parametrize("r", [2, 4])
def test_thin_matmul_one_pass_equals_columns_with_specials(monkeypatch, r):
  a = _data((5, 64), 2, specials=True)
  b = _data((64, r), 3, specials=True)
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", 0)
  assert _one_pass(a, b)
  one = np.asarray(_jit(_lowrank.thin_matmul)(a, b))
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", 2 ** 40)
  assert not _one_pass(a, b)
  cols = np.asarray(_jit(_lowrank.thin_matmul)(a, b))
  assert np.array_equal(one.view(np.uint32), cols.view(np.uint32))


@pytest.mark.parametrize("shape", [(33, 1), (40, 2), (7, 3)])
@pytest.mark.parametrize("kind", ["normal", "zero_column", "dependent", "big", "nan"])
def test_gram_schmidt_matches_the_oracle(shape, kind):
  x = _data(shape, 4, specials=False)
  if kind == "zero_column":
    x[:, 0] = 0.0
  elif kind == "dependent" and shape[1] > 1:
    x[:, 1] = x[:, 0] * np.float32(3.0)
  elif kind == "big":
    x[:, 0] *= np.float32(2.0 ** 100)  # its sum of squares overflows: scaled by 2**-100
  elif kind == "nan":
    x[3, 0] = np.nan
  got = jax.jit(_lowrank.gram_schmidt)(jnp.asarray(x))
  _same_bits(got, _gram_schmidt_oracle(x))


def test_the_benchmark_bucket_takes_the_one_pass_path():
  a, b = np.zeros((128, 9216), np.float32), np.zeros((9216, 2), np.float32)
  assert _one_pass(a, b)
  assert not _one_pass(a, b[:, :1])


def test_materialize_with_an_anchor_keeps_every_bit_pattern():
  bits = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001,
                   0x7F800001, 0xFFFFFFFF, 0x3F800000], np.uint32)
  x = jnp.asarray(bits.view(np.float32))
  got = jax.jit(lambda x, a: materialize(x, anchor=a))(x, jnp.float32(2.0))
  assert np.array_equal(np.asarray(got).view(np.uint32), bits)


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("one_pass_min", [0, 2 ** 40])  # one pass for r >= 2 / column by column
def test_thin_matmul_t_paths_match_the_oracle(monkeypatch, r, one_pass_min):
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", one_pass_min)
  a = _data((11, 37), 0, specials=False) * np.float32(0.5)  # 11 rows: odd levels pad a zero
  a[0, :2] = SPECIALS[:2]  # +-0 (no subnormals: XLA:CPU flushes them, numpy does not)
  a[1, :] = 0.0  # an all-zero row
  b = _data((11, r), 1, specials=False)
  assert _one_pass_t(a, b) == (one_pass_min == 0 and r > 1)
  got = _jit(_lowrank.thin_matmul_t)(jnp.asarray(a), jnp.asarray(b))
  assert got.shape == (37, r)
  _same_bits(got, _thin_matmul_t_oracle(a, b))
  batched = _jit(jax.vmap(_lowrank.thin_matmul_t))(jnp.stack([a, -a]), jnp.stack([b, b]))
  _same_bits(batched[0], got)
  _same_bits(batched[1], _thin_matmul_t_oracle(-a, b))


@pytest.mark.parametrize("r", [2, 4])
def test_thin_matmul_t_one_pass_equals_columns_with_specials(monkeypatch, r):
  a = _data((9, 64), 2, specials=True)
  b = _data((9, r), 3, specials=True)
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", 0)
  assert _one_pass_t(a, b)
  one = np.asarray(_jit(_lowrank.thin_matmul_t)(a, b))
  monkeypatch.setattr(_lowrank, "_ONE_PASS_MIN", 2 ** 40)
  assert not _one_pass_t(a, b)
  cols = np.asarray(_jit(_lowrank.thin_matmul_t)(a, b))
  assert np.array_equal(one.view(np.uint32), cols.view(np.uint32))


def test_thin_matmul_t_matches_thin_matmul_of_the_transpose():
  """The docstring's promise: the bits of ``thin_matmul(a^T, b)`` (both one-pass here)."""
  a = _data((16, 4096), 5, specials=True)
  b = _data((16, 2), 6, specials=False)
  assert _one_pass_t(a, b)
  got = np.asarray(_jit(_lowrank.thin_matmul_t)(a, b))
  want = np.asarray(_jit(_lowrank.thin_matmul)(np.ascontiguousarray(a.T), b))
  _same_bits(got, want)


def test_the_benchmark_bucket_takes_thin_matmul_ts_one_pass_path():
  a, p = np.zeros((128, 9216), np.float32), np.zeros((128, 2), np.float32)
  assert _one_pass_t(a, p)
  assert not _one_pass_t(a, p[:, :1])
