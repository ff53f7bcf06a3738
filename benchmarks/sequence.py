"""Training-step time of sequence models with every matmul quantized (TransformerLM, LSTMLM):
fp32 vs HBFP8 / MXFP8 emulation, the exact and accumulator modes; wire bytes per compressor.

Models (``jaxlp.flax.models``, byte vocabulary of 257): a GPT-style ``TransformerLM`` (batch 8,
sequence 64, width 128, 4 heads, 2 pre-LN blocks, tied logits: the shape of issue 45) and an
``LSTMLM`` (batch 8, sequence 64, 2 LSTM layers of 128, tied decoder). Each policy is applied
with ``jaxlp.flax.quantize_model`` (every matmul it reaches: projections, MLPs, attention q.k
and p.v, ``Embed.attend``, LSTM gates); one jitted Adam step (forward with dropout, backward,
update); "dot_general eqns quantized" counts the ``dot_general`` equations of that step's
jaxpr that jaxlp quantized, of all (``jaxlp.flax.matmul_report``: all of them means no matmul
runs in fp32; a mode's count depends on how many dots it emits per GEMM). All rows are
compiled first, then timed in ``--rounds`` interleaved rounds of ``--steps`` steps each (so
that a change of the machine's load hits every row alike); the median step time and its ratio
to the fp32 row of the same run are printed. A policy mode that cannot run on these matmuls
prints a "not supported yet" row with the reason.

Policies: ``fp32``; ``hbfp8`` and ``mxfp8`` (``jaxlp train --policy hbfp8`` / ``mxfp8``:
HBFPEmulator's 24x24 tiles, OCP MXFP8); ``hbfp8_exact`` (the same with
``block_dot="exact"``: integer block dots); ``mxfp8_fp8`` (MXFP8 with ``block_dot="fp8"``: fp8
dots with per-block scales, the fast mode, not bit-exact; off a GPU a dot batched over the
K-blocks);
``acc_bf16`` (``DotPolicy(fwd_acc=Accum(acc=BF16))``: a bfloat16 accumulator emulated in every
forward GEMM); ``nvfp4`` and ``nvfp4_recipe`` (``jaxlp train --policy nvfp4`` /
``nvfp4-recipe``: NVFP4 everywhere; the NVFP4 pretraining recipe with 16x16 weight tiles,
stochastic gradients and the RHT; not in the default set: ``--policies`` names them).
"compile s" is the time of the first call of each row's step (tracing, compiling, one step).

The wire table (``--no-wire`` skips it; nothing is timed) gives, for the three language models
of ``jaxlp train`` at their default size (width 16: 128 units, 2 layers), with the byte
vocabulary (257) and a Penn Treebank word vocabulary (10,000 words + ``<mask>``), the bytes
one of 8 workers sends per step for an fp32 all-reduce, a low-precision sum and each
compressor (``jaxlp.training._loop.wire_bytes_per_step``: the engine's own count), with the
largest gradient leaf and its share of the parameters (with words: the embedding).

``--grads`` (nothing is timed) compares, for each model and each 8-bit policy of ``jaxlp
train`` (hbfp8, mxfp8, e4m3 = E4M3 forward / E5M2 gradients, e5m2), the gradient of one loss
on a window of the built-in text (32 rows of 64 bytes, the reproductions' size, at
initialisation, no dropout) with the fp32 gradient: the cosine of the whole gradient, and
leaf by leaf the smallest cosine (with that leaf and its fp32 norm relative to the largest
leaf's), the median and smallest norm ratio, and the leaves whose gradient is exactly zero
(underflow).

Usage: python benchmarks/sequence.py [--small] [--models transformer,lstm]
       [--policies fp32,hbfp8,...] [--steps N] [--rounds R] [--no-wire] [--grads] [--json F]
"""

from __future__ import annotations

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import dataclasses
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jaxlp
import jaxlp.flax as jf
from jaxlp import formats as F
from jaxlp.flax.models import LSTMLM, TransformerLM
from jaxlp.training import TrainConfig
from jaxlp.training._loop import _parse_compress, _policy, wire_bytes_per_step

VOCAB = 257
MODELS = ("transformer", "lstm")


def policies() -> dict:
  """name -> DotPolicy (None: fp32)."""
  hbfp8 = _policy(TrainConfig(model="transformer", policy="hbfp8"))
  mxfp8 = _policy(TrainConfig(model="transformer", policy="mxfp8"))
  return {
      "fp32": None,
      "hbfp8": hbfp8,
      "mxfp8": mxfp8,
      "hbfp8_exact": dataclasses.replace(hbfp8, block_dot="exact"),
      "mxfp8_fp8": dataclasses.replace(mxfp8, block_dot="fp8"),
      "acc_bf16": jaxlp.DotPolicy(fwd_acc=jaxlp.Accum(acc=F.BF16)),
      "nvfp4": _policy(TrainConfig(model="transformer", policy="nvfp4")),
      "nvfp4_recipe": _policy(TrainConfig(model="transformer", policy="nvfp4-recipe")),
  }


DEFAULT_POLICIES = ("fp32", "hbfp8", "mxfp8", "hbfp8_exact", "mxfp8_fp8", "acc_bf16")
POLICIES = DEFAULT_POLICIES + ("nvfp4", "nvfp4_recipe")


def make_case(name: str, small: bool):
  """(model, tokens, description) of a benchmark case."""
  batch, seq, width, layers = (2, 8, 16, 1) if small else (8, 64, 128, 2)
  if name == "transformer":
    model = TransformerLM(VOCAB, features=width, num_heads=4, num_layers=layers, max_len=seq)
    what = f"transformer (batch {batch}, seq {seq}, width {width}, 4 heads, {layers} layers)"
  else:
    model = LSTMLM(VOCAB, features=width, num_layers=layers)
    what = f"lstm (batch {batch}, seq {seq}, {layers} layers of {width})"
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, VOCAB - 1)
  return model, tokens, what


def make_step(model, policy):
  """The jitted Adam training step of ``model`` under ``policy`` (None: fp32), and the
  quantized model (or None)."""
  qm = None if policy is None else jf.quantize_model(model, policy)
  apply = (qm or model).apply
  tx = optax.adam(1e-3)

  def loss_fn(params, tokens, key):
    rngs = {"dropout": key}
    if policy is not None and policy.stochastic:
      rngs["quantize"] = jax.random.fold_in(key, 1)
    logits = apply({"params": params}, tokens[:, :-1], train=True, rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @jax.jit
  def step(params, opt_state, tokens, key):
    loss, g = jax.value_and_grad(loss_fn)(params, tokens, key)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, tx, qm


def coverage(qm, params, tokens, policy=None) -> str:
  """``quantized/total`` matmuls of one training step (``jaxlp.flax.matmul_report``)."""
  if qm is None:
    return "-"
  rngs = {"dropout": jax.random.key(0)}
  if policy is not None and policy.stochastic:  # as the step passes it (make_step)
    rngs["quantize"] = jax.random.key(1)
  report = jf.matmul_report(qm, {"params": params}, tokens[:, :-1], train=True, rngs=rngs,
                            loss_fn=lambda logits: jnp.sum(logits))
  return f"{report.count(status='quantized')}/{len(report)}"


def run_case(name, small, names, steps, rounds):
  model, tokens, what = make_case(name, small)
  params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
  rows, ready = [], []
  pols = policies()
  for pname in names:
    row = {"model": name, "what": what, "policy": pname, "step_ms": None, "ratio": None,
           "matmuls": "-", "status": "ok"}
    try:
      step, tx, qm = make_step(model, pols[pname])
      row["matmuls"] = coverage(qm, params, tokens, pols[pname])
      state = (params, tx.init(params))
      t0 = time.perf_counter()
      p, o, loss = step(*state, tokens, jax.random.key(2))
      loss.block_until_ready()
      row["compile_s"] = time.perf_counter() - t0
      row["loss"] = float(loss)
      ready.append((row, step, [p, o]))
    except NotImplementedError as e:
      row["status"] = f"not supported yet: {' '.join(str(e).split())[:160]}"
    rows.append(row)
  times = {id(r): [] for r, _, _ in ready}
  for rnd in range(rounds):
    for row, step, state in ready:
      for i in range(steps):
        t0 = time.perf_counter()
        p, o, loss = step(state[0], state[1], tokens, jax.random.key(100 * rnd + i))
        loss.block_until_ready()
        times[id(row)].append(time.perf_counter() - t0)
        state[0], state[1] = p, o
  for row, _, _ in ready:
    row["step_ms"] = 1e3 * statistics.median(times[id(row)])
  base = next((r["step_ms"] for r in rows if r["policy"] == "fp32" and r["step_ms"]), None)
  for row in rows:
    if base and row["step_ms"]:
      row["ratio"] = row["step_ms"] / base
  return rows


#: (label, TrainConfig fields) of the wire table
WIRE_CONFIGS = (
    ("fp32 all-reduce (ring)", {}),
    ("E5M2 sum + APS (chain)", {"grad_format": "E5M2", "aps": True}),
    ("fp16 cast", {"compress": "cast:fmt=fp16"}),
    ("CGX 4-bit, bucket 1024", {"compress": "cgx:bits=4,bucket=1024"}),
    ("onebit", {"compress": "onebit"}),
    ("TernGrad", {"compress": "terngrad"}),
    ("TBQ", {"compress": "tbq:threshold=0.002"}),
    ("top-k 1%", {"compress": "topk:ratio=0.01"}),
    ("DGC 99.9%", {"compress": "dgc:ratio=0.001", "momentum": 0.0}),
    ("GradDrop 99%", {"compress": "graddrop"}),
    ("PowerSGD rank 2", {"compress": "powersgd:rank=2"}),
)


#: vocabularies of the wire table: bytes, and Penn Treebank's 10,000 words + <mask>
WIRE_VOCABS = (VOCAB, 10001)


def wire_table(nodes: int = 8) -> list[dict]:
  """Bytes per worker per step of every :data:`WIRE_CONFIGS` for the LMs of ``jaxlp train``."""
  from jaxlp.training._models import LM_MODELS, build

  rows = []
  for name, vocab in ((n, v) for v in WIRE_VOCABS for n in LM_MODELS):
    model = build(name, vocab, width=16)
    shapes = jax.eval_shape(lambda m=model: m.init(jax.random.key(0),
                                                   jnp.zeros((2, 64), jnp.int32)))["params"]
    sizes = [leaf.size for leaf in jax.tree_util.tree_leaves(shapes)]
    n, big = sum(sizes), max(sizes)
    base = None
    for label, fields in WIRE_CONFIGS:
      cfg = TrainConfig(model=name, nodes=nodes, **fields)
      comp = _parse_compress(cfg.compress)[0] if cfg.compress else None
      b = wire_bytes_per_step(cfg, comp, shapes)
      base = b if base is None else base
      rows.append({"model": name, "vocab": vocab, "params": n, "largest_leaf": big,
                   "config": label, "wire_bytes": b, "vs_fp32": b / base})
  return rows


GRAD_POLICIES = ("hbfp8", "mxfp8", "e4m3", "e5m2")


def grad_table(models, small: bool) -> list[dict]:
  """Per model and :data:`GRAD_POLICIES`: the quantized gradient of one loss against fp32."""
  import numpy as np

  from jaxlp.training import _text as T
  from jaxlp.training._models import build

  rows_, seq = (4, 16) if small else (32, 64)
  ds = T.load()
  x, y, _ = T.lm_windows(ds.train, rows_, seq)
  x, y = jnp.asarray(x[3]), jnp.asarray(y[3])
  out = []
  for name in models:
    model = build(name, ds.vocab_size, width=2 if small else 16, dropout=0.0, seq_len=seq)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]

    def grads(apply, params=params):
      loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
          apply({"params": p}, x), y).mean()
      return jax.jit(jax.value_and_grad(loss))(params)

    l0, g0 = grads(model.apply)
    ref = jax.tree_util.tree_leaves_with_path(g0)
    for pname in GRAD_POLICIES:
      pol = _policy(TrainConfig(model=name, policy=pname))
      l1, g1 = grads(jf.quantize_model(model, pol).apply)
      cos, ratio, zero, names, norms = [], [], [], [], []
      for (path, a), b in zip(ref, jax.tree_util.tree_leaves(g1), strict=True):
        a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        if na == 0:
          continue
        cos.append(float(a @ b / (na * nb)) if nb else 0.0)
        ratio.append(float(nb / na))
        names.append(jax.tree_util.keystr(path))
        norms.append(float(na))
        if nb == 0:
          zero.append(names[-1])
      worst = int(np.argmin(cos))
      flat = [np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in
                              jax.tree_util.tree_leaves(t)]) for t in (g0, g1)]
      cos_all = float(flat[0] @ flat[1] / (np.linalg.norm(flat[0]) * np.linalg.norm(flat[1])))
      out.append({"model": name, "policy": pname, "loss_fp32": float(l0), "loss": float(l1),
                  "leaves": len(cos), "cos_all": cos_all, "min_cos": min(cos),
                  "min_cos_leaf": names[worst],
                  "min_cos_leaf_rel_norm": norms[worst] / max(norms),
                  "median_norm_ratio": float(np.median(ratio)), "min_norm_ratio": min(ratio),
                  "zero_leaves": zero})
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="CI-sized models (smoke run)")
  ap.add_argument("--models", default=",".join(MODELS), help="transformer,lstm")
  ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                  help=f"comma-separated, from {', '.join(POLICIES)} (default: all but "
                  "the nvfp4 ones)")
  ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 5; "
                  "--small 1)")
  ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; "
                  "--small 1)")
  ap.add_argument("--no-wire", action="store_true", help="skip the wire-bytes table")
  ap.add_argument("--grads", action="store_true",
                  help="only the gradient check of the 8-bit policies against fp32 (no timing)")
  ap.add_argument("--json", default=None, metavar="F", help="write the rows as JSON")
  args = ap.parse_args(argv)
  models = [m for m in args.models.split(",") if m]
  names = [p for p in args.policies.split(",") if p]
  for m in models:
    if m not in MODELS:
      ap.error(f"--models: unknown model {m!r} (choose from {', '.join(MODELS)})")
  for p in names:
    if p not in POLICIES:
      ap.error(f"--policies: unknown policy {p!r} (choose from {', '.join(POLICIES)})")
  steps = args.steps if args.steps is not None else (1 if args.small else 5)
  rounds = args.rounds if args.rounds is not None else (1 if args.small else 3)
  if steps < 1 or rounds < 1:
    ap.error("--steps and --rounds must be >= 1")
  dev = jax.devices()[0]
  if args.grads:
    grads = grad_table(models, args.small)
    print("| model | policy | leaves | cosine, all leaves | min cosine (its leaf; its fp32 "
          "norm / the largest) | norm ratio: median (min) | zero gradients |")
    print("|---|---|---|---|---|---|---|")
    for g in grads:
      zero = ", ".join(g["zero_leaves"]) or "none"
      print(f"| {g['model']} | {g['policy']} | {g['leaves']} | {g['cos_all']:.4f} | "
            f"{g['min_cos']:.4f} "
            f"({g['min_cos_leaf']}; {g['min_cos_leaf_rel_norm']:.1e}) | "
            f"{g['median_norm_ratio']:.3f} ({g['min_norm_ratio']:.3f}) | "
            f"{len(g['zero_leaves'])}: {zero} |")
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"grads": grads}, f, indent=2)
    return grads
  print(f"# sequence: jax {jax.__version__}, {dev.platform} ({dev.device_kind}), "
        f"{platform.machine()}, {steps} steps x {rounds} rounds per row, median")
  rows = []
  for m in models:
    rows += run_case(m, args.small, names, steps, rounds)
  print("\n| model | policy | dot_general eqns quantized | step ms | vs fp32 | compile s | "
        "status |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    ms = f"{r['step_ms']:.1f}" if r["step_ms"] else "-"
    ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
    comp = f"{r['compile_s']:.1f}" if r.get("compile_s") else "-"
    print(f"| {r['what']} | {r['policy']} | {r['matmuls']} | {ms} | {ratio} | {comp} | "
          f"{r['status']} |")
  if dev.platform == "cpu":
    print("\nGPU rows: not measured (no GPU in this run)")
  wire = []
  if not args.no_wire:
    wire = wire_table()
    print("\n| model | vocab | params | largest leaf (share) | gradient reduction, 8 workers | "
          "MB per worker per step | vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for w in wire:
      print(f"| {w['model']} | {w['vocab']:,} | {w['params']:,} | {w['largest_leaf']:,} "
            f"({100 * w['largest_leaf'] / w['params']:.0f}%) | {w['config']} | "
            f"{w['wire_bytes'] / 1e6:.3f} | {w['vs_fp32']:.3f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"steps": rows, "wire": wire}, f, indent=2)
  return rows, wire


if __name__ == "__main__":
  main()
