"""RandomK samples k distinct indices in O(k) (a keyed Feistel permutation with cycle walking)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.parallel.compressors as C
from jaxlp.parallel.compressors._sparse import feistel_sample


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("n", [1, 2, 3, 10, 100, 1000, 4097])
def test_distinct_in_range(n):
  for k in sorted({1, max(1, n // 3), n}):
    for s in range(3):
      idx = np.asarray(feistel_sample(jnp.array([s, 7 * s + 1], jnp.uint32), n, k))
      assert idx.dtype == np.int32 and idx.shape == (k,)
      assert len(set(idx.tolist())) == k and idx.min() >= 0 and idx.max() < n


def test_o_k_memory_for_huge_n():
  n = 2 ** 31 - 1
  out = jax.eval_shape(lambda s: feistel_sample(s, n, 5), jax.ShapeDtypeStruct((2,), jnp.uint32))
  assert out.shape == (5,)
  # compiles and runs with O(k) buffers (a permutation of n would need 8 GiB)
  compiled = jax.jit(lambda s: feistel_sample(s, n, 5)).lower(
      jax.ShapeDtypeStruct((2,), jnp.uint32)).compile()
  idx = np.asarray(compiled(jnp.array([1, 2], jnp.uint32)))
  assert len(set(idx.tolist())) == 5 and idx.min() >= 0 and idx.max() < n
  mem = compiled.memory_analysis()
  if mem is not None:
    assert mem.temp_size_in_bytes < 2 ** 20
  with pytest.raises(ValueError, match="randomk"):
    feistel_sample(jnp.zeros(2, jnp.uint32), 10, 11)


@pytest.mark.usefixtures("fast_compile")
def test_uniform_inclusion_and_position():
  """Chi-square tests at 99.9% confidence (a false alarm 1 time in 1000 per statistic; the
  seeds are fixed, so the test is deterministic): every index is sent with probability k/n,
  and every index is equally likely in every slot."""
  n, k, trials = 50, 10, 3000
  seeds = jax.random.bits(jax.random.key(1), (trials, 2), jnp.uint32)
  idx = np.asarray(jax.jit(jax.vmap(lambda s: feistel_sample(s, n, k)))(seeds))
  counts = np.bincount(idx.ravel(), minlength=n)
  e = trials * k / n
  chi2 = ((counts - e) ** 2 / e).sum()
  assert chi2 < 85.35  # chi2(df=49).ppf(0.999)
  slot = np.zeros((k, n))
  for j in range(k):
    slot[j] = np.bincount(idx[:, j], minlength=n)
  e = trials / n
  chi2 = ((slot - e) ** 2 / e).sum()
  assert chi2 < 594.0  # chi2(df=10*49).ppf(0.999)


def test_randomk_roundtrip_and_residual():
  c = C.randomk(0.1)
  x = jnp.asarray(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
  payload, st = jax.jit(lambda x, st: c.encode(x, st, jax.random.key(4)))(x, c.init((1000,)))
  out = np.asarray(c.decode(payload, (1000,)))
  assert (out != 0).sum() == 100
  np.testing.assert_array_equal(np.asarray(st["residual"]) + out, np.asarray(x))
  assert c.wire_bytes((1000,)) == 8 + 4 * 100


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("n,k", [(1, 1), (2 ** 16, 655), (2 ** 16 + 1, 656), (100_003, 1000),
                                 (5000, 5000), (77, 0)])
def test_gpu_schedule_gives_the_same_indices(n, k):
  """The unrolled cycle-walking steps of the GPU schedule leave in-range indices alone: the
  same indices as the plain loop (the CPU schedule); n = 2**16 + 1 is the worst case (half
  the permuted domain out of range). On CUDA the loop is still there, for the rare index
  that needs more steps."""
  cpu = jax.jit(lambda sd: feistel_sample(sd, n, k, impl="cpu"))
  gpu = jax.jit(lambda sd: feistel_sample(sd, n, k, impl="gpu"))
  for s in range(3):
    seed = jnp.array([s, 11 * s + 5], jnp.uint32)
    assert np.asarray(cpu(seed)).tobytes() == np.asarray(gpu(seed)).tobytes()
  low = jax.jit(lambda sd: feistel_sample(sd, n, k)).trace(
    jax.ShapeDtypeStruct((2,), jnp.uint32)).lower(lowering_platforms=("cuda",)).as_text()
  assert low.count("stablehlo.while") == (1 if k else 0)
