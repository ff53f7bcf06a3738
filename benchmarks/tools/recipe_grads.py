"""Gradient fidelity of the FP4/FP8 recipes' pieces: each layer's weight gradient vs fp32.

What it is for: the evidence behind ``jaxlp reproduce nvfp4`` (what each piece of the NVFP4
recipe does to one step's gradients, whether or not it changes the final loss at this scale).

Usage: python benchmarks/tools/recipe_grads.py [--small] [--policies NAME,NAME]
       [--keys K] [--batch B]

The digits CNN of ``jaxlp train --model cnn`` (seed 0's initial weights), one batch of B
training images: the gradient of the mean cross-entropy w.r.t. every conv/dense kernel with
every layer under ``jaxlp train --policy NAME`` (all layers; ``+ends`` is ignored here), against
the fp32 gradient of the same weights and batch. Per layer: the cosine similarity and the norm
ratio ``|g| / |g_fp32|``. For a policy with stochastic rounding, also the same for the mean of
the gradients of K keys: unbiased rounding makes the mean converge to the gradient of the
quantized forward pass, so a norm ratio near 1 there and not for nearest rounding shows a
rounding bias.
"""

from __future__ import annotations

import argparse
import os
import sys

# keep this script's folder off sys.path: no script name may shadow a module a dependency imports
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
  sys.path.pop(0)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

DEFAULT = ("bf16", "nvfp4", "nvfp4+tiles", "nvfp4+sr", "nvfp4+rht", "nvfp4-recipe", "mxfp4",
           "mxfp8", "mxfp8-rceil")


def _grad_fn(x, y, policy):
  """A jitted ``(params, key) -> gradient`` of the CNN with every layer under ``policy``."""
  import optax

  from jaxlp.flax import quantize_model
  from jaxlp.training import _models as M

  m = M.build("cnn", 10)
  apply = m.apply if policy is None else quantize_model(m, policy).apply

  def loss(p, k):
    rngs = {"quantize": k} if policy is not None and policy.stochastic else {}
    return optax.softmax_cross_entropy_with_integer_labels(
        apply({"params": p}, x, rngs=rngs), y).mean()

  return jax.jit(jax.grad(loss))


def _kernels(g):
  return {"/".join(str(getattr(k, "key", k)) for k in path[:-1]): np.ravel(np.asarray(a))
          for path, a in jax.tree_util.tree_leaves_with_path(g)
          if getattr(path[-1], "key", None) == "kernel"}


def _row(name, what, g, ref):
  cells = []
  for layer, a in _kernels(g).items():
    b = ref[layer]
    cos = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
    cells.append(f"{cos:.3f} / {np.linalg.norm(a) / np.linalg.norm(b):.3f}")
  return f"| {name} | {what} | " + " | ".join(cells) + " |"


def main(argv=None):
  from jaxlp.training import _data as D
  from jaxlp.training import _models as M
  from jaxlp.training._loop import TrainConfig, _policy

  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true", help="CI size: two policies, 2 keys, batch 32")
  p.add_argument("--policies", default=None, help="comma-separated jaxlp train --policy names")
  p.add_argument("--keys", type=int, default=8, help="keys averaged for stochastic policies")
  p.add_argument("--batch", type=int, default=128, help="training images in the batch")
  a = p.parse_args(argv)
  names = (("bf16", "nvfp4+sr") if a.small else DEFAULT) if a.policies is None else tuple(
      a.policies.split(","))
  keys, batch = (2, 32) if a.small else (a.keys, a.batch)
  if keys < 1 or batch < 1:
    p.error("--keys and --batch must be >= 1")
  policies = {}
  for n in names:
    try:
      policies[n] = _policy(TrainConfig(policy=n))
    except ValueError as e:
      p.error(f"--policies: {e}")
  ds = D.load("digits", None, 0)
  x, y = jnp.asarray(ds.x_train[:batch]), jnp.asarray(ds.y_train[:batch])
  variables = M.build("cnn", 10).init(jax.random.key(0), x[:2])
  params, k0 = variables["params"], jax.random.key(0)
  ref = _kernels(_grad_fn(x, y, None)(params, k0))
  print(f"# digits CNN, batch {batch}, seed 0's weights: cosine / norm ratio of each kernel's "
        f"gradient against fp32 ({jax.devices()[0].platform})\n")
  print("| policy | gradient | " + " | ".join(ref) + " |")
  print("|---|---|" + "---|" * len(ref))
  for n, pol in policies.items():
    f = _grad_fn(x, y, pol)
    if not pol.stochastic:
      print(_row(n, "nearest", f(params, k0), ref), flush=True)
      continue
    gs = [f(params, jax.random.key(100 + i)) for i in range(keys)]
    print(_row(n, "one key", gs[0], ref))
    mean = jax.tree.map(lambda *v: sum(v) / len(v), *gs)
    print(_row(n, f"mean of {keys} keys", mean, ref), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
