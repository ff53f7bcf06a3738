"""jaxlp.parallel.sharded_optimizer: FSDP / ZeRO through optax.

The sharded step must give the replicated data-parallel step's bits where the reduction has
specified bits (psum's orders, also with a low-precision format), under a named vmap and
inside a user's shard_map; the wires, rules and refusals do what the docstring says.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxlp import formats as F
from jaxlp import parallel as JP

W = 4
# rows layout (8 % 4 == 0), a flattened + padded leaf (10 values), a scalar (float32, not a
# weakly typed Python float: the steps' outputs are strongly typed, and a weak first input made
# every two-step run below compile its program twice)
PARAMS = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 8 * 6).reshape(8, 6),
                    "bias": jnp.linspace(0.5, -0.5, 10)},
          "scale": jnp.asarray(1.5, jnp.float32)}


def _loss(p, x):
  h = x @ p["dense"]["kernel"]                            # (b, 6)
  y = jnp.concatenate([h, h[:, :4]], axis=1) + p["dense"]["bias"][None]
  return jnp.sum(jnp.tanh(y) ** 2) * p["scale"]


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint32) if a.dtype == np.float32 else a


def _assert_tree_bits(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b),
                          strict=True):
    np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=jax.tree_util.keystr(path))


def _batch():
  return jax.random.normal(jax.random.key(7), (W, 3, 8)) * 3


def _sharded_run(tx, steps=2, x=None):
  x = _batch() if x is None else x

  def step(shards, state, x):
    g = jax.grad(_loss)(tx.gather(shards), x)
    upd, state = tx.update(g, state, shards)
    return optax.apply_updates(shards, upd), state

  shards = tx.stack_shards(PARAMS, W)
  state = jax.vmap(tx.init, axis_name="w")(shards)
  run = jax.jit(jax.vmap(step, axis_name="w"))
  for _ in range(steps):
    shards, state = run(shards, state, x)
  return tx.unstack_shards(shards), state


def _replicated_run(tx, steps=2):
  x = _batch()

  def step(p, s, x):
    u, s = tx.update(jax.grad(_loss)(p, x), s, p)
    return optax.apply_updates(p, u), s

  p = jax.tree_util.tree_map(lambda a: jnp.stack([a] * W), PARAMS)
  s = jax.vmap(tx.init)(p)
  run = jax.jit(jax.vmap(step, axis_name="w"))
  for _ in range(steps):
    p, s = run(p, s, x)
  return jax.tree_util.tree_map(lambda a: a[0], p)


@pytest.mark.parametrize("fmt, order, aps", [(None, "ring", False), (F.E4M3, "tree", True)])
def test_sharded_step_equals_replicated_step_bit_for_bit(fmt, order, aps):
  # reduce-scatter + SGD with momentum and weight decay on the shard + all-gather == the
  # replicated all-reduce (jaxlp's psum with the same format/order) + the same optimizer
  opt = optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.05, momentum=0.9))
  tx = JP.sharded_optimizer(opt, "w", PARAMS, grad_wire=fmt, order=order, aps=aps)
  got, state = _sharded_run(tx)
  ref = optax.chain(JP.reduce_gradients("w", fmt=fmt or F.FP32, order=order, aps=aps), opt)
  _assert_tree_bits(got, _replicated_run(ref))
  assert state.count.tolist() == [2] * W


@pytest.mark.xla_default_emitters
def test_user_shard_map_over_devices_times_vmap_equals_vmap(cpu_devices):
  # the same qgZ (int4 blocks, error feedback) + qwZ (MXINT8) step inside a user's shard_map
  # over 2 devices x 2 emulated workers: the bits of the 4-worker vmap
  wire = F.BlockFormat(3, axis=-1, block_size=16)
  opt = optax.adam(1e-2)
  mk = lambda axis: JP.sharded_optimizer(opt, axis, PARAMS, grad_wire=wire,  # noqa: E731
                                         param_wire=F.mx("int8"), error_feedback=True,
                                         include="dense/kernel")
  ref, ref_state = _sharded_run(mk("w"))
  tx = mk(("dev", "w"))
  mesh = jax.make_mesh((2,), ("dev",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=cpu_devices[:2])

  def step(shards, state, x):
    g = jax.grad(_loss)(tx.gather(shards), x)
    upd, state = tx.update(g, state, shards)
    return optax.apply_updates(shards, upd), state

  vstep = jax.vmap(step, axis_name="w")
  run = jax.jit(jax.shard_map(vstep, mesh=mesh, in_specs=P("dev"), out_specs=P("dev"),
                              check_vma=False))
  shards = tx.stack_shards(PARAMS, W)
  state = jax.vmap(functools.partial(tx.init, num_workers=W))(shards)
  # the inputs placed as the outputs come back, so that the second step reuses the executable
  # (from single-device inputs it compiled the same program twice)
  shards, state, x = jax.device_put((shards, state, _batch()),
                                    jax.sharding.NamedSharding(mesh, P("dev")))
  for _ in range(2):
    shards, state = run(shards, state, x)
  _assert_tree_bits(tx.unstack_shards(shards), ref)
  res = [ws.leaves[0]["residual"] for ws in state.wire if ws is not None]
  assert len(res) == 1 and np.any(np.asarray(res[0]) != 0)  # error feedback ran
  _assert_tree_bits(res, [ws.leaves[0]["residual"] for ws in ref_state.wire if ws is not None])


def test_wires_are_the_collectives_of_jaxlp_parallel():
  # one step's pieces: gather == all_gather(fmt) of each shard; reduce == reduce_scatter /
  # compressed_reduce_scatter of the (flattened, padded) leaf
  int8 = F.BlockFormat(7, axis=-1, block_size=4)
  tx = JP.sharded_optimizer(optax.identity(), "w", PARAMS, param_wire=F.E4M3,
                            rules=[("dense/kernel", int8, int8)], mean=False)
  assert [(leaf.path, leaf.grad_wire, leaf.param_wire) for leaf in tx.leaves] == [
      ("dense/bias", None, F.E4M3), ("dense/kernel", int8, int8), ("scale", None, F.E4M3)]
  g = jax.random.normal(jax.random.key(1), (W, 8, 6))

  def f(gk):
    grads = {"dense": {"kernel": gk, "bias": gk[0, :2].repeat(5)}, "scale": gk[1, 1]}
    st = tx.init(tx.shard(PARAMS))
    sg, _ = tx.reduce(grads, st)
    want_k, _ = JP.compressed_reduce_scatter(gk, JP.init_sharded_state(int8, gk), "w", int8)
    flat = jnp.pad(grads["dense"]["bias"], (0, 2))
    want_b = JP.reduce_scatter(flat, "w")
    full = tx.gather(tx.shard(PARAMS))
    want_full_k = JP.all_gather(tx.shard(PARAMS)["dense"]["kernel"], "w", fmt=int8)
    return sg, want_k, want_b, full, want_full_k

  sg, want_k, want_b, full, want_full_k = jax.jit(jax.vmap(f, axis_name="w"))(g)
  _assert_tree_bits(sg["dense"]["kernel"], want_k)
  _assert_tree_bits(sg["dense"]["bias"], want_b)
  _assert_tree_bits(full["dense"]["kernel"], want_full_k)
  # the elementwise param wire: every gathered value is the E4M3 value of the master
  _assert_tree_bits(full["dense"]["bias"][0], F.quantize(PARAMS["dense"]["bias"], F.E4M3))
  _assert_tree_bits(full["scale"][0], F.quantize(PARAMS["scale"], F.E4M3))
  assert not np.array_equal(np.asarray(full["dense"]["kernel"][0]),
                            np.asarray(PARAMS["dense"]["kernel"]))  # int8 blocks round


def test_zero1_reduced_gradients_are_sliced():
  tx = JP.sharded_optimizer(optax.sgd(0.1), "w", PARAMS)

  def f(x):
    g = JP.psum(jax.grad(_loss)(PARAMS, x), "w", fmt=F.E5M2, order="ring")
    st = tx.init(tx.shard(PARAMS))
    sg, st2 = tx.reduce(g, st, reduced=True)
    return g, sg, st2.count

  g, sg, count = jax.jit(jax.vmap(f, axis_name="w"))(_batch())
  full = tx.unstack_shards(sg)
  _assert_tree_bits(full, jax.tree_util.tree_map(lambda a: a[0], g))
  assert count.tolist() == [1] * W


def test_layout_stack_unstack_and_wire_bytes():
  tx = JP.sharded_optimizer(optax.sgd(0.1), "w", PARAMS, grad_wire=F.mx(F.E2M1FN),
                            exclude=["scale", "dense/bias"])
  st = tx.stack_shards(PARAMS, W)
  assert st["dense"]["kernel"].shape == (W, 2, 6)  # rows
  assert st["dense"]["bias"].shape == (W, 3) and st["scale"].shape == (W, 1)  # flat, padded
  np.testing.assert_array_equal(np.asarray(st["dense"]["bias"]).reshape(-1)[10:], 0.0)
  _assert_tree_bits(tx.unstack_shards(st), PARAMS)
  # shard() inside the map == stack_shards outside
  _assert_tree_bits(jax.vmap(tx.shard, in_axes=None, axis_size=W, axis_name="w")(PARAMS), st)
  wb = tx.wire_bytes(W)
  k = jax.ShapeDtypeStruct((8, 6), jnp.float32)
  want_rs = (JP.sharded_wire_bytes(k, W, order="all_to_all", fmt=F.mx(F.E2M1FN))
             + JP.sharded_wire_bytes(jax.ShapeDtypeStruct((12,), jnp.float32), W)
             + JP.sharded_wire_bytes(jax.ShapeDtypeStruct((4,), jnp.float32), W))
  assert wb["reduce_scatter"] == want_rs
  assert wb["all_gather"] == (W - 1) * 4 * (12 + 3 + 1)


def test_refusals_name_the_problem():
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match=r"rules\[0\]='dense/kernl' matches no parameter"):
    JP.sharded_optimizer(sgd, "w", PARAMS, rules=[("dense/kernl", F.BF16)])
  with pytest.raises(ValueError, match="exclude='bias' matches no parameter.*dense/bias"):
    JP.sharded_optimizer(sgd, "w", PARAMS, exclude="bias")
  with pytest.raises(ValueError, match="TopK cannot run sharded: top-k selects"):
    JP.sharded_optimizer(sgd, "w", PARAMS, grad_wire=JP.compressors.topk(0.1))
  with pytest.raises(TypeError, match="cannot travel"):
    JP.sharded_optimizer(sgd, "w", PARAMS, param_wire=F.BlockFormat(7))  # per-tensor block
  with pytest.raises(TypeError, match="param_wire must be None or a jaxlp format"):
    JP.sharded_optimizer(sgd, "w", PARAMS, param_wire=JP.compressors.cgx(4))
  with pytest.raises(ValueError, match="aps/kahan apply to per-hop sums"):
    JP.sharded_optimizer(sgd, "w", PARAMS, grad_wire=F.mx(F.E4M3FN), aps=True)
  with pytest.raises(TypeError, match=r"rules\[0\]"):
    JP.sharded_optimizer(sgd, "w", PARAMS, rules=["dense/*"])
  with pytest.raises(ValueError, match="order must be one of"):
    JP.sharded_optimizer(sgd, "w", PARAMS, order="spiral")
  tx = JP.sharded_optimizer(sgd, "w", PARAMS)
  with pytest.raises(ValueError, match="runs inside the workers' program"):
    tx.shard(PARAMS)
  with pytest.raises(ValueError, match="tree structure"):
    tx.stack_shards({"a": jnp.zeros(3)}, W)
