"""The ``jaxlp`` command (also ``python -m jaxlp``): train, compare, plot, plan, bench, formats.

Argument parsing lives here only; the library never reads argv or the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import sys

from jaxlp.training import ORDERS, TrainConfig
from jaxlp.training._loop import (
  INT_MAX,
  LAYERS_MAX,
  OPTIMIZERS,
  SEED_MAX,
  SEQ_LEN_MAX,
  TILE_MAX,
)

LR_DEFAULT = 0.05
MOMENTUM_DEFAULT = 0.9

DEFAULT_COMPARE = [
    "fp32=",
    "E3M0=--grad-exp 3 --grad-man 0",
    "E3M0+APS=--grad-exp 3 --grad-man 0 --aps",
]


_SEED_WHY = " (JAX's PRNG seeds are 32-bit: a larger seed would repeat a smaller one)"
#: what a --shard run reports about its memory (metrics.jsonl; compare's summary.json)
_MEMORY_KEYS = ("state_bytes_per_device", "replicated_state_bytes_per_device")
#: files ``jaxlp compare`` writes into --out beside the run folders
_COMPARE_FILES = ("summary.json", "accuracy_vs_epoch.png", "accuracy_vs_wire_bytes.png",
                  "perplexity_vs_epoch.png", "perplexity_vs_wire_bytes.png")


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # exit code 2 and one line naming the flag (argparse's contract)
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(lo: int, hi: int = INT_MAX, why: str = ""):
  """argparse type: an int in lo..hi (the error names the flag through argparse)."""
  def parse(text):
    try:
      v = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < lo:
      raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
    if v > hi:
      raise argparse.ArgumentTypeError(f"must be at most {hi}{why}, got {v}")
    return v

  parse.__name__ = "int"
  return parse


def _float(lo: float, *, lo_open=False, hi: float | None = None):
  """argparse type: a finite float >= lo (> lo with lo_open), < hi."""
  def parse(text):
    try:
      v = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or v < lo or (lo_open and v == lo) or (hi is not None and v >= hi):
      rng = f"{'>' if lo_open else '>='} {lo}" + (f" and < {hi}" if hi is not None else "")
      raise argparse.ArgumentTypeError(f"must be a finite number {rng}, got {text}")
    return v

  parse.__name__ = "float"
  return parse


def _add_train_args(p: argparse.ArgumentParser, *, with_out=True):
  from jaxlp.training._data import DATASETS
  from jaxlp.training._models import MODELS
  from jaxlp.training._text import TOKENS

  g = p.add_argument_group("model and data")
  g.add_argument("--model", choices=MODELS, default="mlp",
                 help="network (default: mlp); lstm, transformer (GPT-style) and bert (masked "
                      "LM) are language models on --data text")
  g.add_argument("--data", choices=DATASETS, default=None,
                 help="dataset (default: digits, text for the language models); digits = "
                      "scikit-learn's bundled 8x8 digits, text = the standard library's "
                      "pydoc_data topics, byte level (no download)")
  g.add_argument("--data-dir", default=None,
                 help="folder with CIFAR-10 pickles / MNIST IDX files / train.txt, valid.txt, "
                      "test.txt (Penn Treebank, WikiText-2) for --data text")
  g.add_argument("--tokens", choices=TOKENS, default=None,
                 help="--data text: bytes (default for the built-in text) or words (default "
                      "with --data-dir: whitespace-split words + <eos> per line)")
  g.add_argument("--width", type=_int(1), default=16,
                 help="model width: mlp hidden units 8*W, cnn channels 2*W/4*W, resnet/vgg "
                      "base channels W, language models' embedding/hidden size 8*W (default 16)")
  g.add_argument("--seq-len", type=_int(1, SEQ_LEN_MAX), default=None,
                 help="language models: tokens per window (BPTT length; default 64)")
  g.add_argument("--layers", type=_int(1, LAYERS_MAX), default=None,
                 help="language models: LSTM layers / transformer blocks (default 2)")
  g.add_argument("--dropout", type=_float(0.0, hi=1.0), default=None,
                 help="language models: dropout rate (default 0.1)")
  g = p.add_argument_group("workers and gradient reduction")
  g.add_argument("--nodes", type=_int(1), default=8,
                 help="number of data-parallel workers, emulated with named vmap (default: 8)")
  g.add_argument("--devices", type=_int(0), default=0,
                 help="real devices to spread the workers over (default 0 = auto: as many as "
                      "divide --nodes); 1 = all emulated on one device")
  g.add_argument("--grad-exp", type=_int(1), default=None,
                 help="CPD gradient exponent bits (with --grad-man; 8/23 = fp32)")
  g.add_argument("--grad-man", type=_int(0), default=None, help="CPD gradient mantissa bits")
  g.add_argument("--grad-format", default=None, help="a preset gradient format, e.g. E4M3, BF16")
  g.add_argument("--order", choices=ORDERS, default="chain",
                 help="summation order of the low-precision all-reduce (default: chain = CPD)")
  g.add_argument("--aps", action="store_true", help="Auto Precision Scaling")
  g.add_argument("--kahan", action="store_true", help="Kahan-compensated low-precision sum")
  g.add_argument("--lars", action="store_true", help="LARS optimizer (CPD's variant)")
  g.add_argument("--compress", default=None, metavar="SPEC",
                 help="gradient compressor, e.g. cgx:bits=4,bucket=512  powersgd:rank=2  "
                      "dgc:ratio=0.001  onebit  topk:ratio=0.01; reduction options in the same "
                      "list: algorithm=sra|ring|allgather, bucket_mb=25, min_size=1024. DGC "
                      "needs --momentum 0 (its momentum correction replaces SGD's); "
                      "dgc:warmup=STEPS is the steps per warm-up stage (one compiled step "
                      "per stage). onebit's error feedback does not mix with SGD momentum "
                      "(digits CNN, 10 epochs: 0.42 test accuracy against fp32's 0.92 with "
                      "the default --momentum 0.9): unless --lr, --momentum or --lars is "
                      "given, onebit runs plain SGD at lr/(1-momentum) = 0.5, momentum 0 "
                      "(0.93 against 0.92; 0.88 against 0.90 over 6 seeds)")
  g.add_argument("--shard", choices=("zero1", "zero2", "fsdp"), default=None,
                 help="shard the optimizer state over the workers (zero1: gradients "
                      "all-reduced; zero2: gradients reduce-scattered; fsdp: parameters "
                      "sharded too, all-gathered each step); with an fp32 or --grad-format "
                      "reduction the run has the replicated run's bits")
  g.add_argument("--grad-wire", default=None, metavar="WIRE",
                 help="--shard zero2/fsdp: gradient reduce-scatter rounded once to WIRE, "
                      "all-to-all, float32 sum (ZeRO++ qgZ): int8-block[:B], int4-block[:B] "
                      "(B=64 per power-of-two scale), mxfp8, mxfp6, mxfp4, mxint8, bf16, "
                      "fp16, e4m3, ...")
  g.add_argument("--param-wire", default=None, metavar="WIRE",
                 help="--shard fsdp: parameter all-gather rounded once to WIRE (ZeRO++ qwZ; "
                      "the float32 shards stay the master copy); names as --grad-wire")
  g = p.add_argument_group("forward/backward quantization")
  g.add_argument("--hbfp", type=_int(1), default=None, metavar="MANT",
                 help="HBFP mantissa bits (activations, weights and gradients in tiles)")
  g.add_argument("--tile", type=_int(0, TILE_MAX, " (0 = one exponent per tensor)"),
                 default=None,
                 help="HBFP tile size (default 24; 0 = one exponent per tensor); only with "
                      "--hbfp or --policy hbfp8/hbfp12")
  g.add_argument("--weight-man", type=_int(1), default=None, metavar="MANT",
                 help="HBFP wide weight storage mantissa bits (e.g. 16; needs --hbfp)")
  g.add_argument("--policy", default=None,
                 help="layer policy preset: hbfp8, hbfp12, mxfp8, mxint8, e4m3 (E4M3 forward, "
                      "E5M2 gradients), e5m2; recipes: bf16, mxfp4, mxfp8-rceil, nvfp4 "
                      "(plain) with pieces +tiles, +sr, +rht, +ends (e.g. nvfp4+sr+rht), "
                      "nvfp4-recipe (all four)")
  g.add_argument("--exact-blocks", action="store_true",
                 help="integer block policies (--hbfp, --policy hbfp8/hbfp12/mxint8): exact "
                      "integer dot per K-block, K-blocks summed in fp32 in a declared order "
                      "(DotPolicy(block_dot='exact')): the same bits on CPU (reference) and "
                      "GPU (bf16 or int8 tensor cores where the significands fit int8); "
                      "with the mlp or cnn and an fp32 reduction the whole step (loss, sums, "
                      "update) is portable too, so the whole run has the same bits")
  g = p.add_argument_group("optimisation")
  g.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                 help="sgd (default; with --momentum) or adam (default for the language "
                      "models; AdamW with --weight-decay, --momentum is its b1)")
  g.add_argument("--epochs", type=_int(1), default=10,
                 help="epochs to train to (on --resume: may grow)")
  g.add_argument("--batch-size", type=_int(1), default=None,
                 help="global batch, split over workers (default 128; language models: 32 "
                      "rows of --seq-len tokens)")
  g.add_argument("--lr", type=_float(0.0, lo_open=True), default=None,
                 help=f"learning rate (default {LR_DEFAULT} for sgd, 0.002 for adam; with "
                      "--compress onebit see --compress)")
  g.add_argument("--schedule", choices=("constant", "triangle"), default="constant",
                 help="learning rate: constant, or DavidNet's triangle (0 -> --lr over "
                      "--warmup-epochs, then linearly to 0; with Nesterov momentum)")
  g.add_argument("--warmup-epochs", type=_int(0), default=0,
                 help="warm-up epochs of --schedule triangle")
  g.add_argument("--momentum", type=_float(0.0, hi=1.0), default=None,
                 help=f"SGD momentum (default {MOMENTUM_DEFAULT}; with --compress onebit see "
                      "--compress)")
  g.add_argument("--weight-decay", type=_float(0.0), default=0.0)
  g.add_argument("--seed", type=_int(0, SEED_MAX, _SEED_WHY), default=0,
                 help=f"random seed, 0..{SEED_MAX} (default 0)")
  g.add_argument("--max-steps-per-epoch", type=_int(1), default=None, help=argparse.SUPPRESS)
  if with_out:
    g = p.add_argument_group("run folder")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="write config.json, metrics.jsonl and checkpoint.msgpack here; a DIR "
                        "that holds a run needs --resume or --overwrite")
    g.add_argument("--resume", action="store_true",
                   help="continue DIR's run: every flag must equal its config.json, except "
                        "--epochs (may grow) and --quiet")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run in DIR: every check runs first, and the old run is "
                        "deleted only once the new run's first checkpoint is written (it is "
                        "put back if the new run fails or is interrupted before)")
    g.add_argument("--migrate-pickle", action="store_true",
                   help="with --resume: convert DIR's checkpoint.pkl of an older jaxlp (a "
                        "pickle: loading it can run code, so only for files you trust) to "
                        "checkpoint.msgpack")
  p.add_argument("--quiet", action="store_true", help="no progress output")


def _optimizer_defaults(args) -> tuple[float, float, str | None]:
  """``(lr, momentum, note)`` of a run: the flags, else the defaults; for a compressor whose
  error feedback does not mix with momentum (``folds_momentum``: onebit) with neither
  ``--lr``, ``--momentum`` nor ``--lars`` given, plain SGD at the default momentum SGD's
  effective step ``lr / (1 - momentum)``, and a note saying so."""
  lr, momentum = args.lr, args.momentum
  from jaxlp.training._models import LM_MODELS

  sgd = (args.optimizer or ("adam" if args.model in LM_MODELS else "sgd")) == "sgd"
  if lr is None and momentum is None and args.compress and not args.lars and sgd:
    from jaxlp.training._loop import _parse_compress

    try:
      comp = _parse_compress(args.compress)[0]
    except ValueError:
      comp = None  # the run's own checks report the bad spec
    if getattr(comp, "folds_momentum", False):
      lr = float(f"{LR_DEFAULT / (1.0 - MOMENTUM_DEFAULT):.12g}")  # 0.5, not 0.5000000000000001
      return lr, 0.0, (f"--compress {args.compress}: plain SGD at lr {lr:g} = {LR_DEFAULT} / "
                       f"(1 - {MOMENTUM_DEFAULT}), momentum 0 (1-bit error feedback does not "
                       "mix with momentum; --lr / --momentum override)")
  # lr None: TrainConfig's default for the optimizer (LR_DEFAULT for sgd)
  return lr, MOMENTUM_DEFAULT if momentum is None else momentum, None


def _config_from_args(args) -> TrainConfig:
  names = {f.name for f in dataclasses.fields(TrainConfig)}
  fields = {k: v for k, v in vars(args).items() if k in names}
  fields["lr"], fields["momentum"], note = _optimizer_defaults(args)
  if note and not getattr(args, "quiet", False):
    print(note, flush=True)
  return TrainConfig(**fields)


def _cmd_train(args) -> int:
  from jaxlp.training import train

  cfg = _config_from_args(args)
  mp = (args.coordinator, args.num_processes, args.process_id)
  if all(v is None for v in mp):
    train(cfg)
    return 0
  if any(v is None for v in mp):
    raise ValueError("--coordinator, --num-processes and --process-id go together")
  if args.process_id >= args.num_processes:
    raise ValueError(f"--process-id {args.process_id} must be below --num-processes "
                     f"{args.num_processes}")
  if cfg.shard is None:
    raise ValueError("a multi-process run (--coordinator) is implemented for sharded "
                     "training: add --shard zero1, zero2 or fsdp")
  if cfg.out is not None:
    raise ValueError("--out is not implemented for a multi-process run (the run folder "
                     "would need the gathered state); run without --out")
  from jaxlp.parallel import initialize, shutdown

  initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
  try:
    train(cfg)
  finally:
    shutdown()
  return 0


def _parse_compare_spec(spec: str):
  name, sep, flags = spec.partition("=")
  if not sep:
    name, flags = spec, spec
  return name.strip(), shlex.split(flags)


def _check_compare_names(names, out):
  """Each configuration's run folder is ``out/NAME``: refuse names that are empty, leave
  ``out``, are hidden or one of compare's own files, or give two configurations one folder."""
  seen: dict[str, str] = {}
  for name in names:
    if not name:
      raise ValueError("--config: a configuration needs a name (NAME=FLAGS), got an empty one")
    if any(c in name for c in "/\\") or os.path.isabs(name):
      raise ValueError(f"--config {name!r}: a configuration name is the name of its run folder "
                       f"in --out {out}; it may not contain / or \\")
    if name.startswith("."):
      raise ValueError(f"--config {name!r}: a configuration name is the name of its run folder "
                       f"in --out {out}; it may not start with '.'")
    folder = _safe(name)
    if folder in _COMPARE_FILES:
      raise ValueError(f"--config {name!r}: {folder} is a file compare writes in --out {out}; "
                       "choose another name")
    key = folder.casefold()  # one folder on case-insensitive file systems
    if key in seen:
      other = seen[key]
      what = ("is given twice" if other == name else
              f"and {other!r} would share the run folder {os.path.join(out, folder)}")
      raise ValueError(f"--config {name!r} {what}; give every configuration its own name")
    seen[key] = name


def _cmd_compare(args) -> int:
  from jaxlp.training import _runs, plot_runs, train
  from jaxlp.training._loop import check_flags

  specs = args.config or DEFAULT_COMPARE
  out = args.out or "runs/compare"
  base = [a for a in args.base_flags]
  parsed = [_parse_compare_spec(spec) for spec in specs]
  _check_compare_names([n for n, _ in parsed], out)
  runs = []
  for name, flags in parsed:  # every configuration is checked before the first run
    sub = _Parser(prog=f"jaxlp compare --config {name}")
    _add_train_args(sub, with_out=False)
    try:
      a = sub.parse_args(base + flags)
    except SystemExit as e:
      raise SystemExit(2) from e
    cfg = _config_from_args(a)
    cfg.out = os.path.join(out, _safe(name))
    cfg.quiet = True
    try:
      check_flags(cfg)
    except (ValueError, TypeError) as e:
      raise type(e)(f"--config {name}: {e}") from None
    runs.append((name, flags, cfg))
  results = []
  with _runs.RunLock(out):  # one compare per output folder; each run locks its own folder
    for name, flags, cfg in runs:
      if args.resume:  # finished runs are reused, interrupted ones continue
        cfg = _runs.continue_or_replace(cfg, args.overwrite)
      else:
        cfg.overwrite = args.overwrite
      print(f"[{len(results) + 1}/{len(runs)}] {name}: {' '.join(base + flags) or '(defaults)'}",
            flush=True)
      try:
        hist = train(cfg)
      except KeyboardInterrupt as e:
        e.config = name  # for the message of main()
        raise
      results.append((name, cfg.out, hist))
      last = hist[-1]
      score = (f"final test ppl {last['perplexity']:.3f}" if _is_lm(hist)
               else f"final test acc {last['test_accuracy']:.4f}")
      print(f"      {score}  loss {last['train_loss']:.4f}  "
            f"{sum(h['seconds'] for h in hist):.1f}s", flush=True)
    print()
    print(compare_table([(n, h) for n, _, h in results]))
    with open(os.path.join(out, "summary.json"), "w") as f:
      json.dump([{"config": n, "dir": d, **_scores(h)}
                 | {k: h[-1][k] for k in _MEMORY_KEYS if k in h[-1]}  # --shard runs
                 for n, d, h in results], f, indent=2)
    if not args.no_plot:
      paths = plot_runs([d for _, d, _ in results], out, labels=[n for n, _, _ in results])
      print("\nplots: " + ", ".join(paths))
  return 0


def _is_lm(hist) -> bool:
  """A language model's run: its metrics have a perplexity instead of an accuracy."""
  return bool(hist) and "perplexity" in hist[-1]


def _scores(hist) -> dict:
  """summary.json's scores of one run: final and best test accuracy (classifiers) or test
  perplexity (language models; best = lowest)."""
  if _is_lm(hist):
    return {"final_perplexity": hist[-1]["perplexity"],
            "best_perplexity": min(h["perplexity"] for h in hist),
            "final_valid_perplexity": hist[-1]["valid_perplexity"]}
  return {"final_test_accuracy": hist[-1]["test_accuracy"],
          "best_test_accuracy": max(h["test_accuracy"] for h in hist)}


def compare_table(results) -> str:
  """``jaxlp compare``'s table: one row per (name, history); accuracy columns for the
  classifiers, test perplexity columns for the language models ("-" where a column does not
  apply)."""
  lms = [_is_lm(h) for _, h in results]
  cols = [("config", 14)]
  if not all(lms):
    cols += [("final acc", 10), ("best acc", 10)]
  if any(lms):
    cols += [("final ppl", 11), ("best ppl", 10)]
  cols += [("final loss", 12), ("wire MB", 10), ("seconds", 9)]
  lines = ["".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(cols))]
  lines.append("-" * len(lines[0]))
  for (name, hist), lm in zip(results, lms):
    cells = [f"{name:<14}"]
    if not all(lms):
      cells += ([f"{'-':>10}"] * 2 if lm else
                [f"{hist[-1]['test_accuracy']:>10.4f}",
                 f"{max(h['test_accuracy'] for h in hist):>10.4f}"])
    if any(lms):
      cells += ([f"{hist[-1]['perplexity']:>11.3f}",
                 f"{min(h['perplexity'] for h in hist):>10.3f}"] if lm else
                [f"{'-':>11}", f"{'-':>10}"])
    cells += [f"{hist[-1]['train_loss']:>12.4f}",
              f"{sum(h['wire_bytes'] for h in hist) / 1e6:>10.2f}",
              f"{sum(h['seconds'] for h in hist):>9.1f}"]
    lines.append("".join(cells))
  return "\n".join(lines)


def _seeds(text):
  try:
    seeds = tuple(int(v) for v in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not seeds or any(v < 0 for v in seeds) or len(set(seeds)) != len(seeds):
    raise argparse.ArgumentTypeError(f"expected distinct seeds >= 0, got {text!r}")
  if max(seeds) > SEED_MAX:
    raise argparse.ArgumentTypeError(f"seeds must be at most {SEED_MAX}{_SEED_WHY}, got "
                                     f"{max(seeds)}")
  return seeds


def _row_labels(text: str) -> tuple:
  """``--rows``: row labels separated by commas; a comma followed by a space belongs to a
  label (``HBFP8, narrow weights``)."""
  labels = tuple(re.split(r",(?! )", text))
  if not all(labels):
    raise argparse.ArgumentTypeError(f"expected comma-separated row labels, got {text!r}")
  return labels


def _cmd_reproduce(args) -> int:
  from jaxlp.training import CLAIMS, reproduce

  if args.list:
    for name, c in CLAIMS.items():
      print(f"{name:<10} {c.system}\n           {c.statement}")
    return 0
  if args.claim is None:
    raise ValueError(f"give a claim: {', '.join(CLAIMS)} or all (--list describes them)")
  names = list(CLAIMS) if args.claim == "all" else [args.claim]
  if args.claim != "all" and args.claim not in CLAIMS:
    raise ValueError(f"unknown claim {args.claim!r}; choose from {', '.join(CLAIMS)} or all")
  if args.claim == "all" and args.rows is not None:
    raise ValueError("--rows names rows of one claim; give the claim, not all")
  for name in names:
    reproduce(name, seeds=args.seeds, out=args.out, data_dir=args.data_dir, toy=args.toy,
              overwrite=args.overwrite, plots=not args.no_plot, epochs=args.epochs,
              max_steps=args.max_steps, rows=args.rows)
  return 0


def _safe(name: str) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"


def _cmd_plot(args) -> int:
  from jaxlp.training import plot_runs

  for d in args.dirs:
    if not os.path.exists(os.path.join(d, "metrics.jsonl")):
      print(f"jaxlp plot: error: {d} has no metrics.jsonl", file=sys.stderr)
      return 2
  paths = plot_runs(args.dirs, args.out or ".")
  print("\n".join(paths))
  return 0


def _cmd_plan(args) -> int:
  import jax
  import jax.numpy as jnp

  from jaxlp.parallel import secopa_plan
  from jaxlp.training import _models as M

  shape = {"digits": (8, 8, 1), "synthetic": (8, 8, 1), "mnist": (28, 28, 1),
           "cifar10": (32, 32, 3)}[args.data]
  model = M.build(args.model, 10, width=args.width)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2,) + shape)))
  leaves = jax.tree_util.tree_leaves_with_path(variables["params"])
  sizes = [_prod(v.shape) for _, v in leaves]
  plan = secopa_plan(sizes, topology=args.topology, num_nodes=args.nodes)
  print(f"SeCoPa plan for {args.model} ({len(sizes)} gradient tensors, {sum(sizes)} elements), "
        f"{args.nodes} nodes, topology {args.topology}\n")
  print(plan if isinstance(plan, str) else _format_plan(leaves, sizes, plan))
  return 0


def _prod(shape):
  n = 1
  for s in shape:
    n *= int(s)
  return n


def _format_plan(leaves, sizes, plan):
  lines = [f"{'tensor':<48}{'elements':>12}  decision"]
  decisions = getattr(plan, "decisions", plan)
  for (path, _), n, d in zip(leaves, sizes, decisions):
    lines.append(f"{jax_path(path):<48}{n:>12}  {d}")
  return "\n".join(lines)


def jax_path(path) -> str:
  import jax

  return jax.tree_util.keystr(path)


def _cmd_bench(args) -> int:
  """``python -m benchmarks --run [--small] [NAME...]`` of the source checkout (the one front
  door; ``python -m benchmarks`` lists the benchmarks), loaded by file path so that a
  ``benchmarks`` package installed elsewhere is never picked up."""
  import importlib.util

  here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  front = os.path.join(here, "benchmarks", "__main__.py")
  if not os.path.isfile(front):
    print("jaxlp bench: error: benchmarks/ folder not found (run from a source checkout)",
          file=sys.stderr)
    return 2
  spec = importlib.util.spec_from_file_location("_jaxlp_benchmarks", front)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.main(["--run", *(["--small"] if args.small else []), *(args.only or [])])


def _cmd_formats(args) -> int:
  from jaxlp.cli._formats_demo import show

  return show(args.values)


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="jaxlp",
              description="jaxlp: low-precision training research in JAX. With no command, "
                          "'formats' is shown.")
  sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

  pt = sub.add_parser("train", help="train one configuration",
                      description="Data-parallel training with N emulated workers whose "
                                  "gradients are reduced in low precision or compressed.")
  _add_train_args(pt)
  g = pt.add_argument_group("multi-process (jax.distributed; one command per process)")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="address of process 0 (e.g. 127.0.0.1:1234); every process runs the "
                      "same command with its own --process-id; needs --shard")
  g.add_argument("--num-processes", type=_int(1), default=None, help="number of processes")
  g.add_argument("--process-id", type=_int(0), default=None, help="this process (0-based)")
  pt.set_defaults(func=_cmd_train)

  pc = sub.add_parser("compare", help="train several configurations; table + plots",
                      description="Run several configurations (each a set of 'jaxlp train' "
                                  "flags) and print a table; writes accuracy plots (PNG).")
  pc.add_argument("--config", action="append", metavar="NAME=FLAGS",
                  help="a configuration, e.g. 'E3M0+APS=--grad-exp 3 --grad-man 0 --aps' "
                       "(repeatable; default: fp32, E3M0, E3M0+APS — CPD's 4-bit APS finding)")
  pc.add_argument("--out", default=None, metavar="DIR", help="output folder (runs/compare)")
  pc.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
  pc.add_argument("--overwrite", action="store_true",
                  help="replace the runs of an earlier compare in the output folder (with "
                       "--resume: only those whose flags differ)")
  pc.add_argument("--resume", action="store_true",
                  help="continue an earlier (interrupted) compare in the output folder: "
                       "finished runs are reused, interrupted ones continue, missing ones start")
  pc.add_argument("base_flags", nargs=argparse.REMAINDER,
                  help="flags shared by every configuration, after '--', e.g. -- --epochs 5")
  pc.set_defaults(func=_cmd_compare)

  pr = sub.add_parser("reproduce", help="reproduce a replaced system's headline claim",
                      description="Train the settings of one claim (cpd, aps, hbfp, cgx, "
                                  "hipress, ddp, hbfp-lstm, hbfp-bert, nvfp4) over several seeds "
                                  "and judge it against fp32: a table with every seed, wire bytes "
                                  "and a verdict, plus plots. 'all' runs every claim; --list "
                                  "shows them.")
  pr.add_argument("claim", nargs="?", default=None, metavar="NAME",
                  help="cpd, aps, hbfp, cgx, hipress, ddp, hbfp-lstm, hbfp-bert, nvfp4 or "
                       "all")
  pr.add_argument("--list", action="store_true", help="list the claims and exit")
  pr.add_argument("--seeds", type=_seeds, default=(0, 1, 2), metavar="S,S,...",
                  help="comma-separated seeds (default 0,1,2)")
  pr.add_argument("--out", default="runs/reproduce", metavar="DIR",
                  help="output folder (runs/reproduce); finished runs there are reused")
  pr.add_argument("--data-dir", default=None, metavar="DIR",
                  help="CIFAR-10/MNIST folder (Penn Treebank/WikiText-2 text files for "
                       "hbfp-lstm/hbfp-bert): the full-scale settings (seeds' own models)")
  pr.add_argument("--toy", action="store_true",
                  help="a narrow MLP (the language models at width 1), 2 workers, one epoch of "
                       "two steps per run (smoke test; no verdicts)")
  pr.add_argument("--epochs", type=_int(1), default=None, metavar="E",
                  help="a reduced run: every run trains E epochs (default: the setting's)")
  pr.add_argument("--max-steps", type=_int(1), default=None, metavar="N",
                  help="a reduced run: at most N steps per epoch; the report marks the "
                       "settings reduced (for a machine too slow for their size)")
  pr.add_argument("--rows", type=_row_labels, default=None, metavar="LABEL[,LABEL...]",
                  help="train only these rows of the claim (labels as in its table, exactly; "
                       "', ' is part of a label) and each setting's fp32 baseline; settings "
                       "with none of them are skipped (unless fp32 is named). The report says "
                       "it is a subset. Finished runs are reused: remove a row's run folders "
                       "to train it again")
  pr.add_argument("--overwrite", action="store_true",
                  help="replace run folders whose configuration differs")
  pr.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
  pr.set_defaults(func=_cmd_reproduce)

  pp = sub.add_parser("plot", help="plot metrics of existing runs",
                      description="Draw accuracy vs epoch and accuracy vs wire bytes (PNG).")
  pp.add_argument("dirs", nargs="+", metavar="DIR", help="run folders with metrics.jsonl")
  pp.add_argument("--out", default=None, metavar="DIR", help="where to write the PNGs (.)")
  pp.set_defaults(func=_cmd_plot)

  pl = sub.add_parser("plan", help="SeCoPa selective-compression plan for a model",
                      description="HiPress's SeCoPa cost model applied to a model's gradients.")
  pl.add_argument("--model", default="resnet18",
                  choices=("mlp", "cnn", "resnet9", "resnet18", "vgg19"))
  pl.add_argument("--data", default="cifar10", choices=("digits", "synthetic", "mnist", "cifar10"))
  pl.add_argument("--width", type=_int(1), default=None,
                  help="model width (default: 16 for mlp/cnn, 64 otherwise)")
  pl.add_argument("--nodes", type=_int(1), default=16)
  pl.add_argument("--topology", choices=("ps", "ring"), default="ring")
  pl.set_defaults(func=_cmd_plan)

  pb = sub.add_parser("bench", help="run the benchmark suite and print its tables")
  pb.add_argument("--small", action="store_true", help="CI-sized inputs")
  pb.add_argument("--only", nargs="+", metavar="NAME",
                  help="benchmark names (listed by: python -m benchmarks)")
  pb.set_defaults(func=_cmd_bench)

  pf = sub.add_parser("formats", help="show the preset number formats and a rounding demo")
  pf.add_argument("--values", type=float, nargs="+",
                  default=[1.0625, 3.14159, 250.0, 1000.0, -0.001, 1e-40],
                  help="values to round (default: a few ties, overflows and tiny values)")
  pf.set_defaults(func=_cmd_formats)
  return p


def _is_flag(token: str, flag: str) -> bool:
  """``token`` is ``flag`` or an abbreviation argparse accepts for it."""
  return token == flag or (len(token) > 2 and token.startswith("--") and flag.startswith(token))


def _resume_command(argv) -> str:
  """The command line that continues an interrupted ``train``/``compare``/``reproduce``."""
  cmd, rest = argv[0], list(argv[1:])
  own = rest[:rest.index("--")] if "--" in rest else rest  # compare: before the shared flags
  if cmd == "train":
    rest = [a for a in rest if not _is_flag(a, "--overwrite")]
    if not any(_is_flag(a, "--resume") for a in own):
      rest.append("--resume")
  elif cmd == "compare" and not any(_is_flag(a, "--resume") for a in own):
    rest.insert(0, "--resume")
  return "jaxlp " + shlex.join([cmd] + rest)


def _interrupted(command: str, argv, e: KeyboardInterrupt) -> str:
  """The one line for Ctrl-C."""
  from jaxlp.training._runs import Interrupted

  head = f"jaxlp {command}: interrupted"
  if not isinstance(e, Interrupted):  # outside a run
    return head + (f"; resume with: {_resume_command(argv)}"
                   if command in ("compare", "reproduce") else "")
  where = f" of configuration {e.config}" if getattr(e, "config", None) else ""
  if e.out is not None and command == "reproduce":
    where = f" of the run in {e.out}"
  at = f" at epoch {e.epoch}{where}" if e.epoch else f" before training started{where}"
  saved = f" ({e.saved} finished epoch(s) saved in {e.out})" if e.saved and e.out else ""
  if command in ("compare", "reproduce") or (e.out is not None and e.resumable):
    return f"{head}{at}{saved}; resume with: {_resume_command(argv)}"
  if e.out is None:
    return f"{head}{at} (no --out: nothing was saved)"
  return f"{head}{at}; " + (e.note or f"nothing was written to {e.out}")


def main(argv=None) -> int:
  """Run the ``jaxlp`` command; returns the exit code (2 and one line on stderr for a user
  error: a bad flag, configuration, data or run folder; 130 and one line saying how to resume
  for Ctrl-C)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command is None:
    args = parser.parse_args(["formats"])
  if getattr(args, "base_flags", None) and args.base_flags[0] == "--":
    args.base_flags = args.base_flags[1:]
  try:
    return args.func(args)
  except (ValueError, TypeError, OSError, ImportError, MemoryError) as e:
    # user errors: the library's messages name the flag or file; OSError's name the file
    msg = " ".join(str(e).split()) or type(e).__name__
    print(f"jaxlp {args.command}: error: {msg}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    print(_interrupted(args.command, argv, e), file=sys.stderr, flush=True)
    return 130


if __name__ == "__main__":  # pragma: no cover
  sys.exit(main())
