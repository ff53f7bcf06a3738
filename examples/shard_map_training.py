"""Data-parallel MLP training with ``jax.shard_map`` (devices) x named ``vmap`` (emulated
nodes), gradients summed in E3M0 with APS over both axes — CPD's ``--emulate-node``.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/shard_map_training.py
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxlp
from jaxlp.training import _data as D


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--emulate", type=int, default=4, help="emulated nodes per device")
  p.add_argument("--smoke", action="store_true")
  a = p.parse_args(argv)
  steps = 5 if a.smoke else a.steps
  ndev, emu = jax.device_count(), a.emulate
  W = ndev * emu
  mesh = jax.make_mesh((ndev,), ("dev",), axis_types=(jax.sharding.AxisType.Auto,))
  ds = D.load_digits()
  x_all = ds.x_train.reshape(len(ds.x_train), -1)
  fmt = jaxlp.formats.cpd_float(3, 0)

  def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() / W

  def node_grad(params, x, y):
    g = jax.grad(loss_fn)(params, x, y)
    return jaxlp.parallel.psum(g, ("dev", "emu"), fmt=fmt, order="chain", aps=True)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("dev"), P("dev")),
                     out_specs=P(), check_vma=False)
  def grads(params, x, y):
    xe = x.reshape((emu, -1) + x.shape[1:])
    ye = y.reshape((emu, -1))
    g = jax.vmap(node_grad, in_axes=(None, 0, 0), axis_name="emu")(params, xe, ye)
    return jax.tree_util.tree_map(lambda t: t[0], g)

  tx = optax.sgd(0.1, momentum=0.9)

  @jax.jit
  def step(params, opt_state, x, y):
    g = grads(params, x, y)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (64, 64)) * 0.1, "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 10)) * 0.1, "b2": jnp.zeros(10)}
  opt_state = tx.init(params)
  # replicated on the mesh from the start, as every step returns them: one compile of `step`
  # (uncommitted arrays would make the second step's inputs differ from the first's)
  params, opt_state = jax.device_put((params, opt_state), jax.NamedSharding(mesh, P()))
  rng = np.random.default_rng(0)
  per = 4
  for _ in range(steps):
    idx = rng.choice(len(x_all), W * per, replace=False)
    params, opt_state = step(params, opt_state, x_all[idx], ds.y_train[idx])
  h = jax.nn.relu(ds.x_test.reshape(len(ds.x_test), -1) @ params["w1"] + params["b1"])
  acc = float(np.mean(np.argmax(np.asarray(h @ params["w2"] + params["b2"]), -1) == ds.y_test))
  print(f"{ndev} devices x {emu} emulated = {W} workers, {steps} steps, test accuracy {acc:.4f}")
  return acc


if __name__ == "__main__":
  main()
