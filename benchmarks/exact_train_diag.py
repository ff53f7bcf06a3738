"""Where do ``jaxlp train --hbfp 8 --exact-blocks`` runs on two backends part? (issue 18, item 5)

In one process with two JAX backends (``JAX_PLATFORMS=cuda,cpu``), runs each stage of the first
training step on both with the SAME inputs (the second backend's outputs of the stage before)
and prints, per stage, whether the outputs have the same bits and, where not, how many elements
differ and by how many float32 ulps at most. Stages: parameter init, forward (logits), loss,
the gradient of the loss w.r.t. the logits, each layer's backward pieces, the optimizer update.
Then single primitives (exp, log, a batch sum, a multiply-add, erf_inv).

Usage: JAX_PLATFORMS=cuda,cpu python benchmarks/exact_train_diag.py [--platforms A,B]
With one backend (e.g. on a CPU-only machine) both columns are that backend: a smoke run.
"""

from __future__ import annotations

import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def _devices(platforms):
  devs = []
  for p in platforms:
    try:
      devs.append(jax.devices(p)[0])
    except RuntimeError:
      devs.append(jax.devices()[0])
  return devs


def _ulps(x, y):
  """Largest distance in float32 ulps between x and y (same sign assumed; NaN-aware)."""
  xi = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
  yi = np.asarray(y, np.float32).view(np.int32).astype(np.int64)
  # map to a monotone integer line
  xi = np.where(xi < 0, -(xi & 0x7FFFFFFF), xi)
  yi = np.where(yi < 0, -(yi & 0x7FFFFFFF), yi)
  return int(np.max(np.abs(xi - yi))) if xi.size else 0


def report(name, a, b):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
  lines, same = [], True
  for (path, x), y in zip(la, lb):
    x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
    if x.tobytes() == y.tobytes():
      continue
    same = False
    diff = x.view(np.uint8).reshape(x.size, -1) != y.view(np.uint8).reshape(y.size, -1)
    n, d = int(diff.sum()), int(diff.any(-1).sum())  # bytes, elements
    u = _ulps(x, y) if x.dtype == np.float32 else "-"
    lines.append(f"    {jax.tree_util.keystr(path) or '(leaf)'}: {d} of {x.size} elements "
                 f"differ, max {u} ulp (bytes {n})")
  print(f"{'same' if same else 'DIFFERS'}: {name}", flush=True)
  for ln in lines[:12]:
    print(ln)
  return same


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--platforms", default="cuda,cpu")
  ap.add_argument("--steps", type=int, default=3, help="training steps compared")
  a = ap.parse_args(argv)
  from jaxlp.training import TrainConfig, Trainer
  from jaxlp.training import _portable as PT

  dA, dB = _devices(a.platforms.split(","))
  print(f"# backends: {dA.platform} ({dA.device_kind}) vs {dB.platform} ({dB.device_kind}); "
        f"jax {jax.__version__}")
  # what `jaxlp train --hbfp 8 --exact-blocks` runs (8 workers) on one device of each backend
  cfg = TrainConfig(nodes=8, devices=1, hbfp=8, exact_blocks=True, quiet=True, epochs=1)
  tr = {}
  for d in (dA, dB):
    with jax.default_device(d):
      tr[d] = Trainer(cfg)
  t = tr[dB]
  print(f"# portable mode: {t.portable}")
  report("init params (each backend's Trainer)", tr[dA].params, tr[dB].params)

  def on(d, f, *args):
    return jax.device_get(f(*jax.device_put(args, d)))

  def both(name, f, *args):
    ra, rb = on(dA, f, *args), on(dB, f, *args)
    report(name, ra, rb)
    return rb

  step = t._make_train_step(None)
  bs = cfg.batch_size
  state = (t.params, t.batch_stats, t.opt_state, t.comp_state)
  for i in range(a.steps):
    x = np.asarray(t.ds.x_train[i * bs:(i + 1) * bs])
    y = np.asarray(t.ds.y_train[i * bs:(i + 1) * bs])
    key = jax.random.fold_in(t.step_key, i)
    out = both(f"training step {i + 1} from the same state (params, bs, opt, comp, loss, finite)",
               step, *state, x, y, key)
    state = out[:4]

  print("# primitives: XLA's own, then jaxlp.training._portable's")
  rng = np.random.default_rng(0)
  v = rng.standard_normal(1 << 16).astype(np.float32) * 8
  a1, a2, a3 = (rng.standard_normal(1 << 16).astype(np.float32) for _ in range(3))
  m = v[:128 * 512].reshape(128, 512)
  pos = np.abs(v) + np.float32(1e-3)
  cases = [
      ("exp", jnp.exp, (np.minimum(v, 80),)),
      ("log", jnp.log, (pos,)),
      ("sum of (128, 512) over axis 0", lambda a: a.sum(0), (m,)),
      ("a * b + c (FMA contraction?)", lambda a, b, c: a * b + c, (a1, a2, a3)),
      ("a / b", lambda a, b: a / b, (a1, a2)),
      ("erf_inv", jax.lax.erf_inv, (np.clip(a1 / 4, -0.99, 0.99),)),
      ("portable a * b + c (mul, add)", lambda a, b, c: PT.add(PT.mul(a, b), c), (a1, a2, a3)),
      ("portable exp", PT.exp, (np.minimum(v, 80),)),
      ("portable log", PT.log, (pos,)),
      ("portable tree_sum of (128, 512) over axis 0", PT.tree_sum, (m,)),
      ("portable cross_entropy and its gradient", jax.value_and_grad(PT.cross_entropy),
       (v[:1280].reshape(128, 10), (np.abs(a1[:128]) * 3).astype(np.int32) % 10,
        np.float32(1 / 128))),
  ]
  for name, f, args in cases:
    both(name, jax.jit(f), *args)
  return 0


if __name__ == "__main__":
  _sys.exit(main())
