"""Training-step time of quantized layers: fp32 vs HBFP8 vs MXFP8 vs float E4M3 policies.

Models: ResNet-18 (CIFAR shape 32x32x3, batch 128, width 64) and an MLP (784-512-512-10,
batch 128), every Dense/Conv quantized with ``jaxlp.flax.quantize_model``; one jitted SGD step
(forward, backward, update); median wall time over ``--steps`` steps after a warm-up (compile)
step, all policies in the same run. ``--small`` shrinks the models for CI.

Usage: python benchmarks/layers.py [--small] [--models resnet18,mlp] [--steps N] [--json F]
"""

from __future__ import annotations

import os as _os
import sys as _sys

# This folder holds a script named like a module that jax's dependencies import
# ("compression"); keep it off sys.path so running any benchmark as a script is safe.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxlp.flax as jf
from jaxlp.flax.models import MLP, ResNet18
from jaxlp.formats import E4M3, E4M3FN, E5M2
from jaxlp.ops._policy import DotPolicy, float_policy, hbfp_policy, mx_policy

POLICIES = {
    "fp32": DotPolicy(),
    "hbfp8": hbfp_policy(7, 24),
    "mxfp8": mx_policy(E4M3FN, 32),
    "float_e4m3": float_policy(E4M3, E5M2),
}


def numpy_init(model, x, seed=0):
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)

  def make(path, s):
    name = path[-1].key
    if name == "kernel":
      return jnp.asarray(rng.normal(0, np.sqrt(2 / np.prod(s.shape[:-1])), s.shape), s.dtype)
    return jnp.ones(s.shape, s.dtype) if name in ("scale", "var") else jnp.zeros(s.shape, s.dtype)

  return jax.tree_util.tree_map_with_path(make, shapes)


def make_case(name, small):
  if name == "resnet18":
    batch, model = (8, ResNet18(width=4)) if small else (128, ResNet18(width=64))
    x = jax.random.normal(jax.random.key(0), (batch, 32, 32, 3))
  elif name == "mlp":
    batch, model = (32, MLP((128, 128, 10))) if small else (128, MLP((512, 512, 10)))
    x = jax.random.normal(jax.random.key(0), (batch, 784))
  else:
    raise ValueError(f"unknown model {name!r}")
  return model, x, jnp.arange(batch) % 10


def time_step(model, x, labels, policy, steps):
  q = jf.quantize_model(model, policy)
  v = numpy_init(model, x)
  params = v["params"]
  stats = v.get("batch_stats")
  tx = optax.sgd(0.01, momentum=0.9)
  opt = tx.init(params)
  has_bn = stats is not None

  @jax.jit
  def step(params, stats, opt, x, labels):  # data as arguments: no constant folding
    def loss_fn(p):
      if has_bn:
        logits, upd = q.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
        upd = upd["batch_stats"]
      else:
        logits, upd = q.apply({"params": p}, x), stats
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd

    (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), upd, opt, loss

  t0 = time.perf_counter()
  state = jax.block_until_ready(step(params, stats, opt, x, labels))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state = jax.block_until_ready(step(*state[:3], x, labels))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), compile_s, float(state[3])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="tiny models for CI")
  ap.add_argument("--models", default="resnet18,mlp")
  ap.add_argument("--policies", default=",".join(POLICIES))
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--json", default=None, help="write the results to this file")
  args = ap.parse_args(argv)
  steps = args.steps or (3 if args.small else 5)
  rows = []
  print(f"# jaxlp layers benchmark: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d')}, small={args.small}, steps={steps}")
  print("| model | policy | step ms (median) | compile s | overhead vs fp32 |")
  print("|---|---|---|---|---|")
  for mname in args.models.split(","):
    model, x, labels = make_case(mname, args.small)
    base = None
    for pname in args.policies.split(","):
      t, c, loss = time_step(model, x, labels, POLICIES[pname], steps)
      base = t if pname == "fp32" else base
      ratio = t / base if base else float("nan")
      rows.append(dict(model=mname, policy=pname, step_ms=1e3 * t, compile_s=c,
                       overhead=ratio, loss=loss, batch=int(x.shape[0])))
      print(f"| {mname} (batch {x.shape[0]}) | {pname} | {1e3 * t:.1f} | {c:.1f} | "
            f"{ratio:.2f}x |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
