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
  """The hook's three jitted stages (the engine's powersgd_start / middle / finish, with the
  sums done by chain_sum in FP32 as CommState's) reproduce compressed_allreduce's PowerSGD
  step for the same two ranks and the same initial Q."""
  comp = C.powersgd(2)
  shape = (24, 16)
  w = 2
  rng = np.random.default_rng(1)
  g = rng.standard_normal((w,) + shape).astype(np.float32)
  st0 = init_compression_state(comp, jnp.zeros(shape))
  out, _ = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "w", comp, min_size=0),
                            axis_name="w", in_axes=(0, None)))(jnp.asarray(g), st0)
  plan, _, _ = ddp._layerwise_plan([shape], 2, 2.0)
  start, middle, finish = ddp._powersgd_stages(plan, ddp._hook_comp(2, 2.0, 0.0, False), w,
                                               None, True)
  q0 = st0.leaves[0]["q"].reshape(-1)
  err = jnp.zeros(g[0].size)
  firsts = [start(jnp.asarray(g[r].reshape(-1)), err, q0) for r in range(w)]
  p_sum = jnp.asarray(ddp.chain_sum(np.stack([np.asarray(f[2]) for f in firsts]), F.FP32))
  mids = [middle(firsts[r][0], p_sum) for r in range(w)]
  q_sum = jnp.asarray(ddp.chain_sum(np.stack([np.asarray(m[1]) for m in mids]), F.FP32))
  approx, new_err, q_new = finish(firsts[0][0], mids[0][0], q_sum, firsts[0][1])
  np.testing.assert_allclose(np.asarray(approx).reshape(shape), np.asarray(out[0]), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(new_err), g[0].reshape(-1) - np.asarray(approx),
                             rtol=1e-6, atol=1e-6)
  assert q_new.shape == (16 * 2,)


def test_q_draws_are_pytorchs():
  """PowerSGD's initial Q's: what PyTorch's hook draws (``torch.manual_seed(seed)`` in a
  forked RNG, ``torch.randn`` per Q in shape-group order, one ``(B, m, r)`` draw per group
  with ``batch_tensors_with_same_shape``), bit for bit, and the global RNG untouched."""
  shapes = [(6, 8), (5,), (10, 3), (6, 2, 4), (7, 7), (10, 3)]
  plan, before, after = ddp._layerwise_plan(shapes, 2, 1.0)
  # PyTorch groups the tensors by their (n, m) view, groups in order of first appearance
  assert [(n, m) for _, n, m, _ in plan.mats] == [(6, 8), (6, 8), (10, 3), (10, 3), (7, 7)]
  assert plan.unc == ((48, 53),) and before == 48 + 5 + 30 + 48 + 49 + 30
  assert after == 2 * 14 * 2 + 5 + 2 * 13 * 2 + 14 * 2
  for batch in (False, True):
    state = torch.random.get_rng_state()
    got = ddp._draw_q(plan, 1234, torch.float32, batch)
    assert torch.equal(torch.random.get_rng_state(), state)
    with torch.random.fork_rng(devices=[]):
      torch.manual_seed(1234)
      want = []
      for idx in plan.groups:
        _, _, m, r = plan.mats[idx[0]]
        if batch and len(idx) > 1:
          want.append(torch.randn(len(idx), m, r, device="cpu", dtype=torch.float32))
        else:
          want += [torch.randn(1, m, r, device="cpu", dtype=torch.float32) for _ in idx]
    want = torch.cat([w.reshape(-1) for w in want])
    assert torch.equal(got, want)
  batched = ddp._draw_q(ddp._square_plan(50, 2), 7, torch.float16, False)
  with torch.random.fork_rng(devices=[]):
    torch.manual_seed(7)
    assert torch.equal(batched, torch.randn(8, 2, dtype=torch.float16).reshape(-1))


def test_powersgd_state_is_pytorchs():
  """PyTorch's state class, defaults and start_powerSGD_iter rule; what it pickles is the
  whole state (PyTorch's __getstate__ reads ``self.__slots__``, which for a subclass is the
  subclass's own: overridden). Unpickling needs a process group (PyTorch's __setstate__)."""
  import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as tps  # noqa: PLC0415
  st = ddp.PowerSGDState(None)
  assert isinstance(st, tps.PowerSGDState)
  assert (st.matrix_approximation_rank, st.start_powerSGD_iter, st.min_compression_rate,
          st.use_error_feedback, st.warm_start, st.orthogonalization_epsilon,
          st.compression_stats_logging_frequency, st.batch_tensors_with_same_shape) == \
      (1, 1000, 2, True, True, 0, 10000, False)
  for start in (0, 1):
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
      ddp.PowerSGDState(None, start_powerSGD_iter=start)
  assert ddp.PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False,
                           warm_start=False).start_powerSGD_iter == 0
  st.error_dict[0] = torch.arange(3.0)
  st.iter = 5
  saved = st.__getstate__()
  assert set(saved) == set(tps.PowerSGDState.__slots__) - {"process_group"}
  assert saved["iter"] == 5 and torch.equal(saved["error_dict"][0], torch.arange(3.0))
  with pytest.raises(TypeError, match="PowerSGDState"):
    ddp.powerSGD_hook(object(), None)
  with pytest.raises(TypeError, match="hook must be"):
    ddp.fp16_compress_wrapper("powerSGD_hook")


def test_comm_state_follows_pytorch_defaults():
  """CommState: every layer compressed for PowerSGD and casts (PyTorch's hooks), CGX's
  filters for the others; batched PowerSGD state is per bucket, so PyTorch's start rule."""
  st = ddp.CommState(compressor=C.powersgd(2))
  assert (st.layer_min_size, st.skip_vectors) == (0, False)
  st = ddp.CommState(compressor=C.cast("fp16"))
  assert (st.layer_min_size, st.skip_vectors) == (0, False)
  st = ddp.CommState(compressor=C.cgx(4), layer_min_size=16)
  assert (st.layer_min_size, st.skip_vectors) == (16, True)
  with pytest.raises(ValueError, match="start_iter >= 2"):
    ddp.CommState(compressor=C.powersgd(2, batched=True))
  assert ddp.CommState(compressor=C.powersgd(2, batched=True, start_iter=2)).step == 0
  assert ddp.CommState(compressor=C.powersgd(2, batched=True, warm_start=False,
                                             error_feedback=False)).step == 0


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


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_hook_arithmetic_is_the_engines(name):
  """The fp16/bf16 hooks' two pieces are the engine's: ``cast_share`` (its power-of-two fast
  path gives exact_div's bits) and, from the gathered addends, ``cast_gathered_sum`` = psum's
  ring (``cast_ring_sum`` under a named vmap), bit for bit, for 2 to 5 workers, with zeros,
  ties and values that vanish. An overflow: psum's policy makes the whole leaf NaN, the
  hooks keep PyTorch's lone inf."""
  from jaxlp.parallel import _aggregate as A  # noqa: PLC0415
  from jaxlp.parallel.compressors._base import exact_div  # noqa: PLC0415
  comp = C.cast(name)
  for w in (2, 3, 4, 5):
    rng = np.random.default_rng(w)
    x = (rng.standard_normal((w, 1001)) * 10.0 ** rng.integers(-12, 5, (w, 1001)))
    x = x.astype(np.float32)
    x[:, :8] = [0.0, -0.0, 6e4, 1e-8, 3e-8, -6e-5, 1e4, 1.0 + 2.0 ** -11]
    c = jax.jit(jax.vmap(lambda v, w=w: A.cast_share(comp, v, w)))(jnp.asarray(x))
    slow = jax.jit(jax.vmap(lambda v, w=w: comp.round(exact_div(comp.round(v), w))))(
        jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(c).view(np.uint32),
                                  np.asarray(slow).view(np.uint32))
    ring = jax.jit(jax.vmap(lambda v: A.cast_ring_sum(comp, v, "w"), axis_name="w"))(c)
    gathered = jax.jit(lambda s: A.cast_gathered_sum(comp, s))(c)
    np.testing.assert_array_equal(np.asarray(ring[0]).view(np.uint32),
                                  np.asarray(gathered).view(np.uint32))
    big = np.asarray(c).copy()
    big[:, 2] = 3e38 if name == "bf16" else 6e4  # the sum overflows the narrow format
    ring = np.asarray(jax.jit(jax.vmap(lambda v: A.cast_ring_sum(comp, v, "w"),
                                       axis_name="w"))(jnp.asarray(big))[0])
    gathered = np.asarray(jax.jit(lambda s: A.cast_gathered_sum(comp, s))(jnp.asarray(big)))
    assert np.isnan(ring).all() and gathered[2] == np.inf
    np.testing.assert_array_equal(np.delete(gathered, 2), np.delete(np.asarray(
        jax.jit(lambda s: A.cast_gathered_sum(comp, s))(c)), 2))


class _Group:
  def size(self):
    return 2


class _Bucket:
  def __init__(self, n):
    self._buf = torch.ones(n)

  def buffer(self):
    return self._buf

  def gradients(self):
    return [self._buf[:6].view(2, 3), self._buf[6:]]

  def index(self):
    return 0

  def is_last(self):
    return True


def test_powersgd_state_that_does_not_fit_the_bucket_is_refused():
  """A state whose error or Q memory does not fit the bucket (made before DDP's bucket rebuild
  or shared by two models) raises, naming the field: no silent reset."""
  st = ddp.PowerSGDState(None, start_powerSGD_iter=2)
  st.process_group, st.iter = _Group(), 5
  st.error_dict[0] = torch.zeros(3)
  with pytest.raises(ValueError, match=r"error_dict\[0\] has 3 elements, bucket 0 needs 10"):
    ddp.powerSGD_hook(st, _Bucket(10))
  st = ddp.PowerSGDState(None, start_powerSGD_iter=2, matrix_approximation_rank=1)
  st.process_group, st.iter = _Group(), 5
  st.p_memory_dict[0], st.q_memory_dict[0] = torch.zeros(1), torch.zeros(7)
  with pytest.raises(ValueError, match=r"q_memory_dict\[0\] has 7 elements, bucket 0 needs 4"):
    ddp.batched_powerSGD_hook(st, _Bucket(10))
