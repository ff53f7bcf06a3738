"""jaxlp.torch.ddp shares jaxlp.parallel's code: the chain sum is psum's chain (IEEE adds, so
BF16 subnormals add up instead of flushing to zero), PowerSGD runs the low-rank family's
stages, keys are typed, and the hook's ``order`` values have their own name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxlp import formats as F  # noqa: E402
from jaxlp.parallel import compressed_allreduce, init_compression_state, psum  # noqa: E402
from jaxlp.parallel import compressors as C  # noqa: E402
from jaxlp.torch import ddp  # noqa: E402


def test_bf16_subnormals_add_up_as_in_psum():
  stack = torch.tensor([[3e-39], [3e-39]])
  got = ddp.chain_sum(stack, F.BF16)
  want = jax.vmap(lambda v: psum(v, "w", fmt=F.BF16, order="chain"), axis_name="w")(
      jnp.asarray(stack.numpy()))[0]
  assert float(got[0]) == pytest.approx(6.06e-39, rel=1e-3)  # it was 0.0 (XLA:CPU flushes)
  np.testing.assert_array_equal(got.numpy().view(np.uint32), np.asarray(want).view(np.uint32))
  # the fp32 sum of the hook (order="chain") keeps subnormals too, as torch's own add
  fp32 = ddp.chain_sum(stack, F.FP32)
  assert fp32.numpy().view(np.uint32)[0] == (stack[0] + stack[1]).numpy().view(np.uint32)[0]


@pytest.mark.parametrize("fmt,kahan", [(F.E4M3, False), (F.cpd_float(5, 2), True)])
def test_chain_sum_is_psums_chain(fmt, kahan):
  """Bit for bit jaxlp.parallel.psum(order="chain") for nonzero data (CPD's start from +0
  differs from psum's ``Q(g_0)`` only for a -0 first addend)."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 64)).astype(np.float32)
  got = ddp.chain_sum(torch.from_numpy(x), fmt, kahan=kahan)
  want = jax.vmap(lambda v: psum(v, "w", fmt=fmt, order="chain", kahan=kahan),
                  axis_name="w")(jnp.asarray(x))[0]
  np.testing.assert_array_equal(got.numpy().view(np.uint32), np.asarray(want).view(np.uint32))
  with pytest.raises(TypeError):
    ddp.chain_sum(torch.from_numpy(x), "E4M3")


def test_powersgd_stages_give_the_engines_result():
  """The hook's three jitted stages (with the sums done as the hook does, by chain_sum in
  FP32) reproduce compressed_allreduce's PowerSGD step for the same two ranks."""
  comp = C.powersgd(2)
  shape = (24, 16)
  w = 2
  rng = np.random.default_rng(1)
  g = rng.standard_normal((w,) + shape).astype(np.float32)
  st0 = init_compression_state(comp, jnp.zeros(shape))
  out, _ = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "w", comp, min_size=0),
                            axis_name="w", in_axes=(0, None)))(jnp.asarray(g), st0)
  start, middle, finish = ddp._powersgd_fns(comp, shape)
  key = jax.random.key(0)
  leaf = st0.leaves[0]
  mats, ps = zip(*(start(jnp.asarray(g[r].reshape(-1)), leaf, key) for r in range(w)),
                 strict=True)
  p_sum = jnp.asarray(ddp.chain_sum(np.stack([np.asarray(p) for p in ps]), F.FP32))
  pq = [middle(mats[r], p_sum) for r in range(w)]
  q_sum = jnp.asarray(ddp.chain_sum(np.stack([np.asarray(q) for _, q in pq]), F.FP32))
  approx, new = finish(mats[0], pq[0][0], q_sum, leaf, w)
  np.testing.assert_allclose(np.asarray(approx).reshape(shape), np.asarray(out[0]), rtol=1e-5,
                             atol=1e-6)
  assert set(new) == {"q", "iter", "error"}


def test_keys_are_typed_and_order_values_renamed():
  state = ddp.CommState(compressor=C.topk(0.1), seed=3)
  k = state._key(1, 2)
  assert jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
  want = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
      jax.random.PRNGKey(3), 0), 1), 2)  # the legacy key's bits: unchanged noise
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(k)), np.asarray(want))
  assert ddp.FP32_SUM_MODES == ("chain", "allreduce")
  assert ddp.CommState(order="allreduce").order == "allreduce"
  with pytest.warns(DeprecationWarning, match="FP32_SUM_MODES"):
    assert ddp.ORDERS == ddp.FP32_SUM_MODES
