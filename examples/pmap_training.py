"""Data-parallel MLP training with ``jax.pmap`` and a low-precision (E4M3 + APS) ring psum.

On a CPU-only machine run with several forced devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/pmap_training.py
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxlp
from jaxlp.training import _data as D


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--smoke", action="store_true")
  a = p.parse_args(argv)
  steps = 5 if a.smoke else a.steps
  n = jax.local_device_count()
  ds = D.load_digits()
  x_all = ds.x_train.reshape(len(ds.x_train), -1)
  fmt = jaxlp.formats.E4M3

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (64, 64)) * 0.1, "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 10)) * 0.1, "b2": jnp.zeros(10)}

  def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() / n

  tx = optax.sgd(0.1, momentum=0.9)

  def step(params, opt_state, x, y):
    loss, g = jax.value_and_grad(loss_fn)(params, x, y)
    g = jaxlp.parallel.psum(g, "dev", fmt=fmt, order="ring", aps=True)  # = mean gradient
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.psum(loss, "dev")

  pstep = jax.pmap(step, axis_name="dev")
  params = init(jax.random.key(0))
  opt_state = tx.init(params)
  rep = lambda t: jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), t)
  params, opt_state = rep(params), rep(opt_state)
  rng = np.random.default_rng(0)
  per = 16
  for _ in range(steps):
    idx = rng.choice(len(x_all), n * per, replace=False)
    xb = x_all[idx].reshape(n, per, -1)
    yb = ds.y_train[idx].reshape(n, per)
    params, opt_state, loss = pstep(params, opt_state, xb, yb)
  p0 = jax.tree_util.tree_map(lambda t: t[0], params)
  h = jax.nn.relu(ds.x_test.reshape(len(ds.x_test), -1) @ p0["w1"] + p0["b1"])
  acc = float(np.mean(np.argmax(np.asarray(h @ p0["w2"] + p0["b2"]), -1) == ds.y_test))
  print(f"{n} devices, {steps} steps, loss {float(loss[0]):.4f}, test accuracy {acc:.4f}")
  return acc


if __name__ == "__main__":
  main()
