"""Training core of ``jaxlp train``: data-parallel SGD over N (emulated) workers whose
gradients are summed in low precision (optionally with APS/Kahan), compressed, or in fp32.

Gradient convention (CPD's): each worker's loss is divided by the number of workers before
the backward pass, so the low-precision SUM across workers is the mean gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxlp
from jaxlp import formats as F
from jaxlp.formats._block_dot import check_exact
from jaxlp.parallel import ORDERS as ORDERS
from jaxlp.parallel import compressors as C
from jaxlp.parallel import payload_bytes, psum
from jaxlp.parallel._compressed import (
  ALGORITHMS,
  compressed_allreduce,
  compressed_wire_bytes,
  init_compression_state,
)
from jaxlp.training import _portable, _runs
from jaxlp.training._recipes import NVFP4_PIECES, RECIPE_NAMES, ends_rules, recipe_policy


@dataclasses.dataclass
class TrainConfig:
  """One training run: each field is the ``jaxlp train`` flag of the same name.

  The fields group as in ``jaxlp train --help``: model and data (``model``, ``data``,
  ``data_dir``, ``width``; for the language models also ``tokens``, ``seq_len``, ``layers``,
  ``dropout``); workers and gradient reduction (``nodes``, ``devices``,
  ``grad_exp``/``grad_man`` or ``grad_format``, ``order``, ``aps``, ``kahan``, ``lars``,
  ``compress``); sharded training (``shard``: ``"zero1"``, ``"zero2"`` or ``"fsdp"``;
  ``grad_wire``, ``param_wire``: see :mod:`jaxlp.training._sharded`); forward/backward
  quantization (``hbfp``, ``tile``, ``weight_man``, ``policy``, ``exact_blocks``);
  optimisation (``optimizer``, ``epochs``, ``batch_size``, ``lr``, ``schedule``,
  ``warmup_epochs``, ``momentum``, ``weight_decay``, ``seed``); output (``out``, ``resume``,
  ``overwrite``, ``migrate_pickle``, ``quiet``).
  ``max_steps_per_epoch`` caps an epoch (for quick tests).

  ``width`` scales every model (MLP hidden units ``8 * width``, CNN channels ``2 * width``
  and ``4 * width``; the defaults give 128 and 32/64; the language models' embedding, LSTM
  and transformer width ``8 * width``, 128 by default).

  Fields left None get their model's default when the config is made: ``data`` ``"text"``
  for the language models (``lstm``, ``transformer``, ``bert``; ``LM_MODELS``) and
  ``"digits"`` for the others; ``optimizer`` ``"adam"`` (language models; ``momentum`` is
  Adam's b1) or ``"sgd"``; ``batch_size`` 32 (language models: rows of ``seq_len`` tokens)
  or 128; ``lr`` 0.002 (Adam) or 0.05 (SGD); for the language models ``seq_len`` 64,
  ``layers`` 2, ``dropout`` 0.1, ``tokens`` ``"bytes"`` (``"words"`` with a ``data_dir``).
  ``tokens``, ``seq_len``, ``layers`` and ``dropout`` are refused for the classifiers.

  ``tile`` is the HBFP tile (None: 24) of ``hbfp``/``weight_man`` and the ``hbfp8``/``hbfp12``
  policies; it is refused without them. A folder ``out`` that already holds a run needs
  ``resume`` (continue it: every field must equal the run's ``config.json`` except
  ``epochs``, which may grow, and ``quiet``) or ``overwrite`` (replace it).
  ``migrate_pickle`` lets ``resume`` convert a checkpoint of an older jaxlp
  (``checkpoint.pkl``, a pickle: loading it can run code) to ``checkpoint.msgpack``. The
  checks run (and fail with a ValueError/TypeError naming the flag) in :class:`Trainer`.

  Example:
    >>> from jaxlp.training import TrainConfig
    >>> TrainConfig(nodes=8, grad_exp=3, grad_man=0, aps=True).order
    'chain'
    >>> c = TrainConfig(model="lstm")
    >>> c.data, c.optimizer, c.batch_size, c.lr, c.seq_len, c.tokens
    ('text', 'adam', 32, 0.002, 64, 'bytes')
  """

  model: str = "mlp"
  data: str | None = None
  data_dir: str | None = None
  tokens: str | None = None
  seq_len: int | None = None
  layers: int | None = None
  dropout: float | None = None
  nodes: int = 1
  devices: int = 0
  grad_exp: int | None = None
  grad_man: int | None = None
  grad_format: str | None = None
  order: str = "chain"
  aps: bool = False
  kahan: bool = False
  lars: bool = False
  compress: str | None = None
  shard: str | None = None
  grad_wire: str | None = None
  param_wire: str | None = None
  hbfp: int | None = None
  tile: int | None = None
  weight_man: int | None = None
  policy: str | None = None
  exact_blocks: bool = False
  optimizer: str | None = None
  epochs: int = 10
  batch_size: int | None = None
  lr: float | None = None
  schedule: str = "constant"
  warmup_epochs: int = 0
  momentum: float = 0.9
  weight_decay: float = 0.0
  seed: int = 0
  width: int = 16
  max_steps_per_epoch: int | None = None
  out: str | None = None
  resume: bool = False
  overwrite: bool = False
  migrate_pickle: bool = False
  quiet: bool = False

  def __post_init__(self):
    from jaxlp.training._models import LM_MODELS

    lm = self.model in LM_MODELS
    if self.data is None:
      self.data = "text" if lm else "digits"
    if lm:
      for k, v in (("seq_len", 64), ("layers", 2), ("dropout", 0.1)):
        if getattr(self, k) is None:
          setattr(self, k, v)
      if self.tokens is None and self.data == "text":
        self.tokens = "words" if self.data_dir is not None else "bytes"
    if self.optimizer is None:
      self.optimizer = "adam" if lm else "sgd"
    if self.batch_size is None:
      self.batch_size = 32 if lm else 128
    if self.lr is None:
      self.lr = 0.002 if self.optimizer == "adam" else 0.05


def grad_format(cfg: TrainConfig):
  """The gradient-communication format of a config, or None for fp32."""
  if cfg.grad_format is not None and (cfg.grad_exp is not None or cfg.grad_man is not None):
    raise ValueError("give either --grad-format or --grad-exp/--grad-man, not both")
  if cfg.grad_format is not None:
    try:
      f = F.get_format(cfg.grad_format)
    except (ValueError, TypeError) as e:
      raise ValueError(f"--grad-format: {e}") from None
    return None if f == F.FP32 else f
  if cfg.grad_exp is None and cfg.grad_man is None:
    return None
  if cfg.grad_exp is None or cfg.grad_man is None:
    raise ValueError("--grad-exp and --grad-man must be given together")
  if (cfg.grad_exp, cfg.grad_man) == (8, 23):
    return None  # CPD: 8/23 means an ordinary fp32 all-reduce
  try:
    return F.cpd_float(cfg.grad_exp, cfg.grad_man)
  except (ValueError, TypeError) as e:
    raise ValueError(f"--grad-exp {cfg.grad_exp} --grad-man {cfg.grad_man}: {e}") from None


def wire_bytes_per_step(cfg: TrainConfig, compressor=None, params=None, *,
                        min_size: int = 1024) -> int:
  """Bytes each worker sends per step for the configured gradient reduction.

  Compressed runs: :func:`jaxlp.parallel.compressed_wire_bytes` with the ``--compress``
  options (``algorithm``, ``bucket_mb``, ``min_size``, ``skip_vectors``; ``min_size`` here
  only when the spec has none) -- the engine's own accounting of its collectives.
  A DGC with warm-up counts the capacity it is given: the unspecialised one the first stage's,
  ``comp.at_stage(s)`` stage ``s``'s (:meth:`Trainer.wire_bytes_at` counts each step's stage).
  Low-precision sums use :func:`jaxlp.parallel.payload_bytes` per gradient leaf (the bytes
  the implemented collectives move); fp32 is a ring all-reduce (2(W-1)/W * 4 bytes/element).
  """

  W = cfg.nodes
  if W <= 1:
    return 0
  leaves = jax.tree_util.tree_leaves(params)
  fp32_ring = lambda n: 2 * (W - 1) * math.ceil(n / W) * 4
  if compressor is not None:
    opts = dict(_parse_compress(cfg.compress)[1]) if cfg.compress else {}
    opts.setdefault("min_size", min_size)
    return compressed_wire_bytes(params, compressor, W, **opts)
  fmt = grad_format(cfg)
  if fmt is None:
    return int(sum(fp32_ring(leaf.size) for leaf in leaves))

  return int(sum(payload_bytes(leaf.size, W, fmt, cfg.order, kahan=cfg.kahan, aps=cfg.aps)
                 for leaf in leaves))


HBFP_TILE = 24  # TrainConfig.tile None: HBFPEmulator's default tile
EXACT_PRESETS = ("hbfp8", "hbfp12", "mxint8")  # --policy presets --exact-blocks applies to


def _policy(cfg: TrainConfig):
  if cfg.hbfp is not None and cfg.policy is not None:
    raise ValueError("give either --hbfp or --policy, not both")
  hbfp_preset = cfg.policy in ("hbfp8", "hbfp12")
  if cfg.tile is not None and cfg.hbfp is None and not hbfp_preset:
    raise ValueError(f"--tile {cfg.tile} applies only to HBFP (--hbfp or --policy hbfp8/"
                     "hbfp12); remove it")
  if cfg.hbfp is None and cfg.policy is None:
    if cfg.exact_blocks:
      raise ValueError("--exact-blocks needs an integer block policy: --hbfp MANT or --policy "
                       f"{'/'.join(EXACT_PRESETS)}")
    return None
  tile = HBFP_TILE if cfg.tile is None else cfg.tile

  # HBFPEmulator main (bfp/bfp_ops.py): activations, weights and output gradients in
  # tile x tile blocks, so the tile defines the format (the per-sample variant ignores it).
  def hbfp(man_bits):
    try:
      return jaxlp.hbfp_policy(man_bits=man_bits, tile=tile, activations="tiled")
    except (ValueError, TypeError) as e:
      flag = f"--hbfp {cfg.hbfp}" if cfg.hbfp is not None else f"--policy {cfg.policy}"
      raise ValueError(f"{flag} --tile {tile}: {e}") from None

  presets = {
      "hbfp8": lambda: hbfp(8),
      "hbfp12": lambda: hbfp(12),
      "mxfp8": lambda: jaxlp.mx_policy(),
      "mxint8": lambda: jaxlp.mx_policy("int8"),
      "e4m3": lambda: jaxlp.float_policy(fwd=jaxlp.formats.E4M3, bwd=jaxlp.formats.E5M2),
      "e5m2": lambda: jaxlp.float_policy(fwd=jaxlp.formats.E5M2, bwd=jaxlp.formats.E5M2),
  }
  if cfg.hbfp is not None:
    policy = hbfp(cfg.hbfp)
  elif cfg.policy in presets:
    policy = presets[cfg.policy]()
  elif recipe_policy(cfg.policy) is not None:  # bf16, nvfp4[+pieces], mxfp4, mxfp8-rceil
    policy = recipe_policy(cfg.policy)[0]
  else:
    raise ValueError(f"unknown --policy {cfg.policy!r}; choose from {sorted(presets)}, "
                     f"{', '.join(RECIPE_NAMES)} or nvfp4+PIECE+... (PIECE: "
                     f"{', '.join(NVFP4_PIECES)})")
  if not cfg.exact_blocks:
    return policy
  # exact integer block dots (DotPolicy(block_dot="exact")): the same bits on every backend
  if cfg.hbfp is None and cfg.policy not in EXACT_PRESETS:
    raise ValueError(f"--exact-blocks applies to integer block policies (--hbfp, --policy "
                     f"{'/'.join(EXACT_PRESETS)}), not --policy {cfg.policy}; remove it")
  man = cfg.hbfp if cfg.hbfp is not None else {"hbfp8": 8, "hbfp12": 12}.get(cfg.policy)
  try:
    if man is not None and tile:  # K-blocks <= tile: refuse an inexact int32 dot up front
      check_exact(tile, man, man, what="train")
    return dataclasses.replace(policy, block_dot="exact")
  except ValueError as e:
    raise ValueError(f"--exact-blocks: {e}") from None


INT_MAX = 2**31 - 1  # every integer flag is at most this (XLA's shapes and step counters)
SEED_MAX = 2**32 - 1  # JAX's PRNG keys take 32-bit seeds here: larger seeds would alias
# HBFP tiles: --tile 2**31 - 1 overflowed XLA's shape arithmetic and aborted the process;
# 4096 is far beyond the tiles in use (24, 64), and 0 gives one exponent per tensor
TILE_MAX = 4096
# the language models' depth and window: far beyond what trains on one machine here, and a
# bound before the model is built (a Python loop over the layers)
LAYERS_MAX = 64
SEQ_LEN_MAX = 65536
OPTIMIZERS = ("sgd", "adam")
_LM_KEY_TAG = 0x6C6D  # folded into the step key for the language models' own randomness
_Q_KEY_TAG = 0x7174  # ... for the classifiers' stochastic rounding (quantize_model's rngs)
EVAL_ROWS = 10  # streams of the language models' valid/test text (AWD-LSTM's eval batch)
_INT_FIELDS = {  # field: (lowest allowed, highest allowed, None allowed)
    "nodes": (1, INT_MAX, False), "devices": (0, INT_MAX, False),
    "grad_exp": (1, INT_MAX, True), "grad_man": (0, INT_MAX, True), "hbfp": (1, INT_MAX, True),
    "tile": (0, TILE_MAX, True), "weight_man": (1, INT_MAX, True), "epochs": (1, INT_MAX, False),
    "batch_size": (1, INT_MAX, False), "warmup_epochs": (0, INT_MAX, False),
    "seed": (0, SEED_MAX, False), "width": (1, INT_MAX, False),
    "max_steps_per_epoch": (1, INT_MAX, True), "seq_len": (1, SEQ_LEN_MAX, True),
    "layers": (1, LAYERS_MAX, True)}
_FLOAT_FIELDS = {"lr": 0.0, "momentum": 0.0, "weight_decay": 0.0}  # finite, >= this
_BOOL_FIELDS = ("aps", "kahan", "lars", "exact_blocks", "resume", "overwrite", "migrate_pickle",
                "quiet")
_STR_FIELDS = ("model", "data", "data_dir", "tokens", "grad_format", "order", "compress",
               "policy", "optimizer", "schedule", "out", "shard", "grad_wire", "param_wire")


def _flag(name):
  return "--" + name.replace("_", "-")


def check_config(cfg: TrainConfig) -> None:
  """Types and ranges of every field (TypeError/ValueError naming the flag)."""
  from jaxlp.training._data import DATASETS
  from jaxlp.training._models import LM_MODELS, MODELS
  from jaxlp.training._text import TOKENS

  for k, (lo, hi, none_ok) in _INT_FIELDS.items():
    v = getattr(cfg, k)
    if v is None and none_ok:
      continue
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"{_flag(k)} must be an int, got {v!r}")
    if v < lo:
      raise ValueError(f"{_flag(k)} must be >= {lo}, got {v}")
    if v > hi:
      why = {"seed": " (JAX's PRNG seeds are 32-bit: a larger seed would repeat a smaller one)",
             "tile": " (0 = one exponent per tensor)"}.get(k, "")
      raise ValueError(f"{_flag(k)} must be at most {hi}{why}, got {v}")
  for k, lo in _FLOAT_FIELDS.items():
    v = getattr(cfg, k)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
      raise TypeError(f"{_flag(k)} must be a number, got {v!r}")
    if not math.isfinite(v) or v < lo:
      raise ValueError(f"{_flag(k)} must be a finite number >= {lo}, got {v}")
  if cfg.lr <= 0:
    raise ValueError(f"--lr must be > 0, got {cfg.lr}")
  if cfg.momentum >= 1:
    raise ValueError(f"--momentum must be in [0, 1), got {cfg.momentum}")
  for k in _BOOL_FIELDS:
    if not isinstance(getattr(cfg, k), bool):
      raise TypeError(f"{_flag(k)} must be True or False, got {getattr(cfg, k)!r}")
  for k in _STR_FIELDS:
    v = getattr(cfg, k)
    if v is not None and not isinstance(v, str):
      raise TypeError(f"{_flag(k)} must be a string, got {v!r}")
  for k, choices in (("model", MODELS), ("data", DATASETS), ("order", ORDERS),
                     ("schedule", ("constant", "triangle")), ("optimizer", OPTIMIZERS)):
    if getattr(cfg, k) not in choices:
      raise ValueError(f"{_flag(k)} must be one of {choices}, got {getattr(cfg, k)!r}")
  if cfg.tokens is not None and cfg.tokens not in TOKENS:
    raise ValueError(f"--tokens must be one of {TOKENS}, got {cfg.tokens!r}")
  if cfg.dropout is not None:
    v = cfg.dropout
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
      raise TypeError(f"--dropout must be a number, got {v!r}")
    if not 0.0 <= v < 1.0:
      raise ValueError(f"--dropout must be in [0, 1), got {v}")
  lm = cfg.model in LM_MODELS
  if lm and cfg.data != "text":
    raise ValueError(f"--model {cfg.model} is a language model: it trains on --data text "
                     f"(built in, or train.txt/valid.txt/test.txt from --data-dir), not --data "
                     f"{cfg.data}")
  if not lm and cfg.data == "text":
    raise ValueError(f"--data text is for the language models (--model "
                     f"{'/'.join(LM_MODELS)}), not --model {cfg.model}")
  if not lm:
    for k in ("tokens", "seq_len", "layers", "dropout"):
      if getattr(cfg, k) is not None:
        raise ValueError(f"{_flag(k)} applies only to the language models (--model "
                         f"{'/'.join(LM_MODELS)}), not --model {cfg.model}")
  if cfg.tokens == "words" and cfg.data_dir is None:
    raise ValueError("--tokens words needs --data-dir (the built-in text is byte level)")
  if cfg.lars and cfg.optimizer != "sgd":
    raise ValueError(f"--lars is its own optimizer (CPD's LARS SGD); remove --optimizer "
                     f"{cfg.optimizer} or --lars")
  if cfg.batch_size % cfg.nodes:
    raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by --nodes {cfg.nodes}")
  if cfg.warmup_epochs and cfg.schedule != "triangle":
    raise ValueError("--warmup-epochs applies only to --schedule triangle")
  if cfg.warmup_epochs > cfg.epochs:
    raise ValueError(f"--warmup-epochs {cfg.warmup_epochs} exceeds --epochs {cfg.epochs}")
  if cfg.data_dir is not None and cfg.data in ("digits", "synthetic"):
    raise ValueError(f"--data-dir applies only to --data cifar10/mnist/text (--data {cfg.data} "
                     "is built in)")
  if cfg.weight_man is not None:
    if cfg.hbfp is None:
      raise ValueError("--weight-man needs --hbfp (HBFP's wide weight storage)")
    try:
      F.hbfp(cfg.weight_man, HBFP_TILE if cfg.tile is None else cfg.tile)
    except (ValueError, TypeError) as e:
      raise ValueError(f"--weight-man {cfg.weight_man}: {e}") from None
  if cfg.out is None:
    for k in ("resume", "overwrite", "migrate_pickle"):
      if getattr(cfg, k):
        raise ValueError(f"{_flag(k)} applies to a run folder: it needs --out")


_REDUCE_OPTS = ("algorithm", "bucket_mb", "min_size", "skip_vectors")


def _check_momentum_correction(compressor, cfg) -> None:
  """DGC's momentum correction REPLACES the optimizer's momentum (Lin et al. 2018, Sec. 3.2):
  stacking both applies momentum twice (the digits MLP diverges). Refuse the pair. A compressor
  that applies momentum correction says so with its ``momentum_correction`` factor."""
  m = getattr(compressor, "momentum_correction", 0.0)
  if m and cfg.momentum:
    raise ValueError(
        f"--compress {cfg.compress}: DGC's momentum correction (momentum={m}) replaces SGD's "
        f"momentum, and --momentum {cfg.momentum} would apply momentum twice; pass --momentum 0 "
        "(DGC's momentum then does the job), or dgc:momentum=0 to keep SGD's momentum instead")


def _parse_compress(spec: str):
  """``name:key=value,key=value`` -> (compressor from jaxlp.parallel.compressors, options of
  ``compressed_allreduce``: ``algorithm``, ``bucket_mb``, ``min_size``, ``skip_vectors``)."""

  name, _, rest = spec.partition(":")
  kwargs: dict[str, Any] = {}
  for item in filter(None, rest.split(",")):
    k, _, v = item.partition("=")
    if not _:
      raise ValueError(f"--compress {spec!r}: expected key=value, got {item!r}")
    k = {"bucket": "bucket_size"}.get(k, k)
    try:
      val: Any = int(v)
    except ValueError:
      try:
        val = float(v)
      except ValueError:
        val = {"true": True, "false": False}.get(v.lower(), v)
    if isinstance(val, int) and not isinstance(val, bool) and abs(val) > INT_MAX:
      raise ValueError(f"--compress {spec!r}: {k}={val} is out of range (at most {INT_MAX} "
                       "in magnitude)")
    kwargs[k] = val
  factory = getattr(C, name, None)
  if factory is None or name.startswith("_"):
    raise ValueError(f"--compress: unknown compressor {name!r}")
  opts = {k: kwargs.pop(k) for k in _REDUCE_OPTS if k in kwargs}
  if opts.get("algorithm", "auto") not in ALGORITHMS:
    raise ValueError(f"--compress {spec!r}: algorithm must be auto, sra, ring or allgather")
  if not isinstance(opts.get("skip_vectors", True), bool):
    raise ValueError(f"--compress {spec!r}: skip_vectors must be true or false, got "
                     f"{opts['skip_vectors']!r}")
  try:
    comp = factory(**kwargs)
  except TypeError as e:
    raise ValueError(f"--compress {spec!r}: {e}") from e
  algs = comp.aggregation.algorithms
  if opts.get("algorithm", "auto") not in algs:
    raise ValueError(f"--compress {spec!r}: algorithm={opts['algorithm']} needs a dense "
                     f"quantizer; {name} takes algorithm in {', '.join(algs)}")
  return comp, opts


def _check_reduce_opts(spec, opts):
  """Types and ranges of the reduction options of ``--compress`` (``min_size``,
  ``bucket_mb``)."""
  v = opts.get("min_size", 0)
  if isinstance(v, bool) or not isinstance(v, int) or v < 0:
    raise ValueError(f"--compress {spec!r}: min_size must be an int >= 0, got {v!r}")
  if "bucket_mb" in opts:
    v = opts["bucket_mb"]
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
        or v <= 0):
      raise ValueError(f"--compress {spec!r}: bucket_mb must be a number > 0, got {v!r}")


def check_flags(cfg: TrainConfig) -> dict:
  """Every check of a configuration that needs no data and no model (ValueError/TypeError
  naming the flag): field types and ranges, devices, gradient format, compressor, policy.

  Returns the resolved pieces: ``ndev``, ``fmt``, ``compressor``, ``reduce_opts``,
  ``grad_wire``, ``param_wire``, ``policy``. ``jaxlp compare`` calls it for every
  configuration before the first run."""
  check_config(cfg)
  if cfg.devices > 0:
    ndev = cfg.devices
  else:  # auto: as many real devices as divide the number of workers
    ndev = max(d for d in range(1, jax.device_count() + 1) if cfg.nodes % d == 0)
  if ndev > jax.device_count() or cfg.nodes % ndev:
    raise ValueError(f"--devices {cfg.devices}: need a divisor of --nodes {cfg.nodes} that is "
                     f"at most the {jax.device_count()} available device(s)")
  fmt = grad_format(cfg)
  if (cfg.aps or cfg.kahan) and fmt is None:
    raise ValueError("--aps/--kahan need a low-precision gradient format "
                     "(--grad-exp/--grad-man or --grad-format)")
  compressor, reduce_opts = _parse_compress(cfg.compress) if cfg.compress else (None, {})
  if compressor is not None and fmt is not None:
    raise ValueError("give either --compress or a gradient format, not both")
  _check_reduce_opts(cfg.compress, reduce_opts)
  _check_momentum_correction(compressor, cfg)
  if cfg.order != "chain" and fmt is None:
    raise ValueError(
        f"--order {cfg.order} applies only to a low-precision gradient sum (--grad-exp/"
        "--grad-man or --grad-format): fp32 runs reduce with lax.psum and --compress runs "
        "with the compressor's aggregation (choose it with --compress NAME:algorithm=...)")
  flags = {"ndev": ndev, "fmt": fmt, "compressor": compressor, "reduce_opts": reduce_opts}
  from jaxlp.training import _sharded
  return flags | _sharded.check(cfg, flags) | {"policy": _policy(cfg)}


def _device_bytes(dev) -> tuple[int | None, str]:
  """(memory of device ``dev`` in bytes or None if unknown, its name)."""
  try:
    stats = dev.memory_stats() or {}
  except Exception:  # pragma: no cover - backends without memory statistics
    stats = {}
  limit = stats.get("bytes_limit")
  if limit is None and dev.platform == "cpu":
    try:
      limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - no sysconf (Windows)
      limit = None
  return (int(limit) if limit else None), f"{dev.platform}:{dev.id}"


def _gib(n) -> str:
  return f"{n / 2**30:,.1f} GiB"


def _check_memory(cfg: TrainConfig, variables, ndev: int) -> None:
  """Refuse a model that cannot fit before allocating it: a lower bound of the memory one
  device needs (parameters and batch statistics, the optimizer's momentum, and the gradient
  of each worker it runs) against the device's memory (host RAM for the CPU)."""
  n = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(variables))
  state = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
              for a in jax.tree_util.tree_leaves(variables))
  per_dev = cfg.nodes // ndev
  need = state * (2 + per_dev)
  limit, name = _device_bytes(jax.devices()[0])
  if limit is None or need <= limit:
    return
  more = f" or fewer workers per device (--nodes {cfg.nodes}, --devices)" if per_dev > 1 else ""
  raise ValueError(f"--width {cfg.width}: the {cfg.model} has {n:,} parameters "
                   f"({_gib(state)}); training it with {per_dev} worker(s) per device needs at "
                   f"least {_gib(need)} (parameters, momentum and one gradient per worker), "
                   f"more than the {_gib(limit)} of {name}; choose a smaller --width{more}")


@contextlib.contextmanager
def _device_memory(cfg: TrainConfig, what: str):
  """XLA's RESOURCE_EXHAUSTED (out of device memory) as one ValueError naming the flags."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text:
      raise
    first = " ".join(text.split("\n", 1)[0].split())[:200]
    raise ValueError(f"out of device memory while {what} ({first}): --model {cfg.model} "
                     f"--width {cfg.width} with --batch-size {cfg.batch_size} over --nodes "
                     f"{cfg.nodes} does not fit; choose a smaller --width or --batch-size"
                     ) from None


class Trainer:
  """The training loop one epoch at a time: builds the data, the model, the optimizer and the
  jitted data-parallel step of a :class:`TrainConfig`.

  Args:
    cfg: the run.

  Raises:
    ValueError: an invalid configuration or data file (the message names the flag or file).
    TypeError: a field of the wrong type (e.g. a float ``batch_size``; the message names the
      flag).

  Example:
    >>> from jaxlp.training import TrainConfig, Trainer
    >>> t = Trainer(TrainConfig(nodes=2, max_steps_per_epoch=1, quiet=True))
    >>> m = t.run_epoch()
    >>> m["epoch"], t.epoch
    (1, 1)
  """

  def __init__(self, cfg: TrainConfig):
    import optax

    from jaxlp.training import _models as M

    self.cfg = cfg
    flags = check_flags(cfg)
    ndev = self.ndev = flags["ndev"]
    self.axis = ("dev", "nodes") if ndev > 1 else "nodes"
    self.fmt, self.compressor = flags["fmt"], flags["compressor"]
    self.reduce_opts, policy = flags["reduce_opts"], flags["policy"]
    self.lm = cfg.model in M.LM_MODELS
    key = jax.random.key(cfg.seed)
    init_key, self.step_key = jax.random.split(key)
    if self.lm:
      steps_per_epoch = self._setup_lm(policy, init_key)
    else:
      steps_per_epoch = self._setup_classifier(policy, init_key)
    self.n_params = int(sum(x.size for x in jax.tree_util.tree_leaves(self.params)))
    lr = cfg.lr
    if cfg.schedule == "triangle":  # DavidNet: 0 -> lr over warm-up, then linearly -> 0
      up = max(cfg.warmup_epochs * steps_per_epoch, 1)
      down = max((cfg.epochs - cfg.warmup_epochs) * steps_per_epoch, 1)
      lr = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, up),
                                 optax.linear_schedule(cfg.lr, 0.0, down)], [up])
    if self.portable:
      self.tx = _portable.sgd(self._lr_table(lr, cfg.epochs * steps_per_epoch), cfg.momentum,
                              nesterov=cfg.schedule == "triangle",
                              weight_decay=cfg.weight_decay)
    elif cfg.lars:
      from jaxlp.optim import lars

      self.tx = lars(lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "adam":  # AdamW's decoupled decay; --momentum is b1
      self.tx = optax.adamw(lr, b1=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
      self.tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay),
                            optax.sgd(lr, momentum=cfg.momentum,
                                      nesterov=cfg.schedule == "triangle"))
    if cfg.weight_man is not None:
      from jaxlp.optim import master_weights

      # HBFPEmulator's shell optimizer: FP32 update of a wide copy, narrow params to the model.
      tile = HBFP_TILE if cfg.tile is None else cfg.tile
      try:
        wide = F.hbfp(cfg.weight_man, tile)
      except (ValueError, TypeError) as e:
        raise ValueError(f"--weight-man {cfg.weight_man}: {e}") from None
      self.tx = master_weights(self.tx, fmt=F.hbfp(cfg.hbfp, tile), wide_fmt=wide)
    self.opt_state = self.tx.init(self.params)
    self.comp_state = None
    if self.compressor is not None:
      one = init_compression_state(self.compressor, self.params)
      self.comp_state = jax.tree_util.tree_map(
          lambda a: jnp.broadcast_to(a, (cfg.nodes,) + a.shape), one)
    self._wire_bytes: dict = {}  # per warm-up stage
    self.epoch = 0
    self.step = 0
    self._build_step()
    self._shard = None
    if cfg.shard is not None:  # parameters / optimizer state sharded over the workers
      from jaxlp.training._sharded import ShardedRun
      self._shard = ShardedRun(self, flags)
    if self.lm:
      self._check_lm_step()

  def _steps_per_epoch(self, steps: int) -> int:
    cfg = self.cfg
    if cfg.max_steps_per_epoch:
      steps = min(steps, cfg.max_steps_per_epoch)
    if cfg.schedule == "triangle" and cfg.epochs * steps > INT_MAX:
      raise ValueError(f"--epochs {cfg.epochs}: the triangle schedule spans {cfg.epochs} x "
                       f"{steps} steps, more than optax's step counter holds ({INT_MAX})")
    return steps

  def _setup_classifier(self, policy, init_key) -> int:
    """Data, model and variables of an image classifier; returns the steps per epoch."""
    from jaxlp.training import _data as D
    from jaxlp.training import _models as M

    cfg, ndev = self.cfg, self.ndev
    self.ds = D.load(cfg.data, cfg.data_dir, cfg.seed)
    steps_per_epoch = len(self.ds.x_train) // cfg.batch_size
    if steps_per_epoch == 0:
      raise ValueError(f"--batch-size {cfg.batch_size} exceeds the training set "
                       f"({len(self.ds.x_train)} images of --data {cfg.data})")
    steps_per_epoch = self._steps_per_epoch(steps_per_epoch)
    kw = {}
    # stochastic policies and per-layer choices (a recipe's BF16 ends) go through
    # quantize_model (keys from the rng stream "quantize"); the others into every layer
    ends = bool(cfg.policy and (recipe_policy(cfg.policy) or (None, False))[1])
    use_q = policy is not None and (policy.stochastic or ends)
    if policy is not None and not use_q:
      kw = dict(dot_general=jaxlp.dot_general(policy),
                conv_general_dilated=jaxlp.conv_general_dilated(policy))
    # --exact-blocks with the MLP or the CNN and an fp32 reduction: every op of the step has
    # specified bits (jaxlp.training._portable), so the run is the same on every backend
    self.portable = bool(cfg.exact_blocks and cfg.model in ("mlp", "cnn") and not cfg.lars
                         and cfg.optimizer == "sgd" and cfg.weight_man is None
                         and self.compressor is None and self.fmt is None
                         and cfg.shard is None)
    self.model = M.build(cfg.model, self.ds.num_classes, width=int(cfg.width),
                         portable=self.portable, **kw)
    self.apply_model = self.model.apply
    self.policy, self.qmodel = policy, None
    x0 = jnp.asarray(self.ds.x_train[:2])
    if use_q:
      from jaxlp.flax import quantize_model  # noqa: PLC0415 -- flax: the examples extra

      rules = (ends_rules(quantize_model(self.model, policy), init_key, x0, train=False)
               if ends else ())
      self.qmodel = quantize_model(self.model, policy, rules=rules)
      self.apply_model = self.qmodel.apply
    # The parameters are those of the plain model: a policy or the portable layers change no
    # parameter (names, shapes, initial values; the same bits, checked for every built-in
    # classifier), so the plain model is initialised, as one jitted program for every run:
    # not the quantized forward pass (its compile), not op by op (the portable MLP/CNN took
    # 2.5-3.5x the CPU time of one program, measured), and an fp32 run and a quantized run of
    # one model start from one program's bits on every backend.
    plain = M.build(cfg.model, self.ds.num_classes, width=int(cfg.width))
    init = jax.jit(lambda k, x: plain.init(k, x, train=False))
    init_dev = _portable.init_device() if self.portable else None
    # before allocating: the shapes, traced abstractly
    _check_memory(cfg, jax.eval_shape(init, init_key, x0), ndev)
    with _device_memory(cfg, "initialising the model"):
      if init_dev is not None:  # the CPU's erf_inv defines the initial weights
        with jax.default_device(init_dev):
          variables = init(init_key, x0)
        variables = jax.tree_util.tree_map(jnp.asarray, jax.device_get(variables))
      else:
        variables = init(init_key, x0)
    self.params = variables["params"]
    self.batch_stats = variables.get("batch_stats", {})
    return steps_per_epoch

  def _setup_lm(self, policy, init_key) -> int:
    """Text, windows, model and parameters of a language model (every matmul quantized by
    :func:`jaxlp.flax.quantize_model`); returns the steps per epoch."""
    from jaxlp.training import _models as M
    from jaxlp.training import _text as T

    cfg = self.cfg
    self.portable = False
    self.ds = T.load(cfg.data_dir, cfg.tokens)
    rows, seq_len = cfg.batch_size, cfg.seq_len
    self.train_windows = T.lm_windows(self.ds.train, rows, seq_len)
    steps_per_epoch = len(self.train_windows[0])
    if steps_per_epoch == 0:
      raise ValueError(f"--batch-size {rows} x --seq-len {seq_len}: the training text has "
                       f"{len(self.ds.train):,} tokens, fewer than one batch of {rows} rows of "
                       f"{seq_len} + 1 tokens; choose a smaller --batch-size or --seq-len")
    steps_per_epoch = self._steps_per_epoch(steps_per_epoch)
    # evaluation: EVAL_ROWS streams (fewer for a tiny split), every target counted once; the
    # windows of valid and test in one array (one compiled evaluation)
    rows_eval = min(EVAL_ROWS, len(self.ds.valid) - 1, len(self.ds.test) - 1)
    valid = T.lm_windows(self.ds.valid, rows_eval, seq_len, partial=True)
    test = T.lm_windows(self.ds.test, rows_eval, seq_len, partial=True)
    self.eval_windows = tuple(np.concatenate(pair) for pair in zip(valid, test))
    self.eval_split = len(valid[0])  # windows [0, eval_split) are valid, the rest test
    self.model = M.build(cfg.model, self.ds.vocab_size, width=int(cfg.width),
                         layers=cfg.layers, dropout=cfg.dropout, seq_len=seq_len)
    self.qmodel = None
    x0 = jnp.zeros((2, seq_len), jnp.int32)
    if policy is not None:
      from jaxlp.flax import quantize_model  # noqa: PLC0415 -- flax: the examples extra

      ends = bool(cfg.policy and (recipe_policy(cfg.policy) or (None, False))[1])
      rules = (ends_rules(quantize_model(self.model, policy), init_key, x0, train=False)
               if ends else ())
      self.qmodel = quantize_model(self.model, policy, rules=rules)
    self.apply_model = (self.qmodel or self.model).apply
    self.policy = policy
    init = lambda k, x: self.model.init(k, x, train=False)
    _check_memory(self.cfg, jax.eval_shape(init, init_key, x0), self.ndev)
    with _device_memory(cfg, "initialising the model"):
      variables = jax.jit(init)(init_key, x0)
    self.params = variables["params"]
    self.batch_stats = {}
    return steps_per_epoch

  @staticmethod
  def _lr_table(lr, steps: int):
    """The learning rate of each of ``steps`` steps as float32, evaluated on the CPU where
    there is one (``lr``: a float or an optax schedule)."""
    if not callable(lr):
      return np.asarray([lr], np.float32)
    dev = _portable.init_device()
    with jax.default_device(dev) if dev is not None else contextlib.nullcontext():
      return np.asarray(jax.device_get(lr(jnp.arange(max(steps, 1)))), np.float32)

  # -- DGC warm-up stages: one static payload capacity (one compiled step) per stage ---------
  def _stage(self, step: int) -> int:
    """DGC's warm-up stage of step ``step`` (``DGC.stage_at``); 0 for anything else."""
    comp = self.compressor
    return comp.stage_at(step) if callable(getattr(comp, "stage_at", None)) else 0

  def _compressor_at(self, step: int):
    """The compressor of step ``step``: DGC specialised to that step's warm-up stage (its own
    static payload capacity, ``DGC.at_stage``), any other compressor as configured."""
    comp = self.compressor
    if callable(getattr(comp, "stage_at", None)):
      return comp.at_stage(comp.stage_at(step))
    return comp

  def wire_bytes_at(self, step: int) -> int:
    """Bytes each worker sends at step ``step`` (:func:`wire_bytes_per_step` of that step's
    compressor: DGC's warm-up stages send less as the sparsity rises)."""
    stage = self._stage(step)
    if stage not in self._wire_bytes and self._shard is not None:
      self._wire_bytes[stage] = self._shard.wire_bytes(self._compressor_at(step))
    if stage not in self._wire_bytes:
      self._wire_bytes[stage] = self._allreduce_wire_bytes(self._compressor_at(step),
                                                           self.params)
    return self._wire_bytes[stage]

  def _allreduce_wire_bytes(self, comp, params) -> int:
    """Bytes each worker sends to all-reduce the gradients of ``params`` with ``comp`` (None:
    the configured sum): :func:`wire_bytes_per_step`."""
    return wire_bytes_per_step(self.cfg, comp, params,
                               min_size=self.reduce_opts.get("min_size", 1024))

  @property
  def wire_per_step(self) -> int:
    """Bytes each worker sends per step once any DGC warm-up is over (the steady state)."""
    comp = self.compressor
    last = comp.stages * comp.warmup if callable(getattr(comp, "stage_at", None)) else 0
    return self.wire_bytes_at(last)

  # -- the jitted step ---------------------------------------------------------------------
  def _reduce(self, g, key, comp_state, comp=None):
    cfg = self.cfg
    W = cfg.nodes
    comp = self.compressor if comp is None else comp
    if comp is not None:
      # compressed_allreduce with mean=False: the loss is already pre-scaled by 1/W.
      return compressed_allreduce(g, comp_state, self.axis, comp, mean=False, key=key,
                                  **self.reduce_opts)
    if self.fmt is None or W == 1:
      total = _portable.sum_over_axis if self.portable and W > 1 else lax.psum
      return jax.tree_util.tree_map(lambda a: total(a, self.axis), g), comp_state

    return psum(g, self.axis, fmt=self.fmt, order=cfg.order, kahan=cfg.kahan, aps=cfg.aps,
                rounding="nearest"), comp_state

  def _classifier_loss(self, has_bn, params, batch_stats, x, y, key):
    """One worker's loss on its images, pre-scaled by 1/W (CPD), and its batch statistics."""
    import optax

    apply, W = self.apply_model, self.cfg.nodes
    kw = {}
    if self.qmodel is not None and self.policy.stochastic:  # this worker's rounding noise
      kw["rngs"] = {"quantize": jax.random.fold_in(jax.random.fold_in(key, _Q_KEY_TAG),
                                                   lax.axis_index(self.axis))}
    if has_bn:
      logits, upd = apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                          mutable=["batch_stats"], **kw)
      new_bs = upd["batch_stats"]
    else:
      logits = apply({"params": params}, x, train=True, **kw)
      new_bs = batch_stats
    if self.portable:  # the same pre-scaled mean, every rounding specified
      scale = np.float32(1.0 / (x.shape[0] * W))
      return _portable.cross_entropy(logits, y, jnp.asarray(scale)), new_bs
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss / W, new_bs  # CPD: pre-scale so that the SUM over workers is the mean

  def _lm_keys(self, key):
    """This worker's (dropout, masking, quantization) keys of a step: ``key`` folded with a
    tag (apart from the compressor's use of ``key``) and the worker's index."""
    k = jax.random.fold_in(jax.random.fold_in(key, _LM_KEY_TAG), lax.axis_index(self.axis))
    return jax.random.split(k, 3)

  def _lm_rngs(self, k_drop, k_quant):
    rngs = {"dropout": k_drop}
    if self.policy is not None and self.policy.stochastic:
      rngs["quantize"] = k_quant
    return rngs

  def _lm_loss(self, params, batch_stats, x, y, key):
    """One worker's mean token cross-entropy (BERT: over its masked tokens), pre-scaled by
    1/W (CPD's convention, as for the classifiers)."""
    import optax

    from jaxlp.flax.models import mask_tokens

    k_drop, k_mask, k_quant = self._lm_keys(key)
    if self.cfg.model == "bert":
      inputs, w = mask_tokens(k_mask, x, mask_id=self.ds.mask_id,
                              num_tokens=self.ds.num_tokens)
      y = x
    else:
      inputs, w = x, jnp.ones(x.shape, jnp.float32)
    logits = self.apply_model({"params": params}, inputs, train=True,
                              rngs=self._lm_rngs(k_drop, k_quant))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    loss = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
    return loss / self.cfg.nodes, batch_stats

  def _node_loss(self):
    """One worker's loss function ``(params, batch_stats, x, y, key) -> (loss pre-scaled by
    1/W, new batch statistics)`` (:meth:`_lm_loss` or :meth:`_classifier_loss`); the step of
    the replicated run and that of ``--shard`` (:mod:`jaxlp.training._sharded`) share it."""
    if self.lm:
      return self._lm_loss
    return functools.partial(self._classifier_loss,
                             bool(jax.tree_util.tree_leaves(self.batch_stats)))

  def _build_step(self):
    import optax

    W = self.cfg.nodes
    has_bn = bool(jax.tree_util.tree_leaves(self.batch_stats))
    node_loss = self._node_loss()

    mesh = None
    if self.ndev > 1:
      mesh = jax.make_mesh((self.ndev,), ("dev",), axis_types=(jax.sharding.AxisType.Auto,))
    self._mesh = mesh

    def make_train_step(comp):
      def node_step(params, batch_stats, x, y, key, comp_state):
        (loss, new_bs), g = jax.value_and_grad(node_loss, has_aux=True)(params, batch_stats, x,
                                                                        y, key)
        g, comp_state = self._reduce(g, key, comp_state, comp)
        loss = (_portable.sum_over_axis(loss, self.axis) if self.portable and W > 1
                else lax.psum(loss, self.axis))
        new_bs = jax.tree_util.tree_map(lambda a: lax.pmean(a, self.axis), new_bs)
        return g, loss, new_bs, comp_state

      vstep = jax.vmap(node_step, in_axes=(None, None, 0, 0, None, 0), axis_name="nodes")
      if mesh is not None:
        # Real devices x emulated nodes: shard the worker axis over a device mesh and vmap the
        # workers of each device; reductions run over ("dev", "nodes"), worker-major.

        vstep = jax.shard_map(vstep, mesh=mesh,
                              in_specs=(P(), P(), P("dev"), P("dev"), P(), P("dev")),
                              out_specs=P("dev"), check_vma=False)
      return jax.jit(functools.partial(train_step, vstep))

    def train_step(vstep, params, batch_stats, opt_state, comp_state, x, y, key):
      xs = x.reshape((W, x.shape[0] // W) + x.shape[1:])
      ys = y.reshape((W, y.shape[0] // W) + y.shape[1:])
      cs = comp_state if comp_state is not None else jnp.zeros((W,), jnp.float32)
      g, loss, bs, cs = vstep(params, batch_stats, xs, ys, key, cs)
      g0 = jax.tree_util.tree_map(lambda a: a[0], g)  # identical on every worker
      bs0 = jax.tree_util.tree_map(lambda a: a[0], bs)
      updates, opt_state = self.tx.update(g0, opt_state, params)
      params = (_portable.apply_updates(params, updates) if self.portable
                else optax.apply_updates(params, updates))
      leaves = jax.tree_util.tree_leaves(g0)
      # a step counts as non-finite when its loss or any gradient element is not finite
      finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(a)) for a in leaves]
                                   + [jnp.isfinite(loss[0])]))
      return params, bs0, opt_state, (cs if comp_state is not None else None), loss[0], finite

    # one compiled step per DGC warm-up stage (compiled when the stage starts); else one
    self._train_steps: dict = {}
    self._make_train_step = make_train_step

    def predict(params, batch_stats, x):
      v = {"params": params}
      if has_bn:
        v["batch_stats"] = batch_stats
      if self.qmodel is not None and self.policy.stochastic:  # a fixed key: the same noise
        return jnp.argmax(self.apply_model(v, x, train=False,
                                           rngs={"quantize": jax.random.key(0)}), -1)
      return jnp.argmax(self.apply_model(v, x, train=False), -1)

    self._predict = jax.jit(predict)
    if self.lm:
      self._eval_sums = jax.jit(self._lm_eval_all)

  def _lm_eval_all(self, params, xs, ys, ws):
    """Per window of ``xs`` (windows, rows, seq_len): :meth:`_lm_eval_sums`, in a loop (window
    ``j`` gets key ``fold_in(key(0), j)``)."""
    keys = jax.vmap(lambda j: jax.random.fold_in(jax.random.key(0), j))(
        jnp.arange(xs.shape[0]))
    return lax.map(lambda a: self._lm_eval_sums(params, *a), (xs, ys, ws, keys))

  def _lm_eval_sums(self, params, x, y, w, key):
    """(sum of the token cross-entropies weighted by ``w``, sum of ``w``) of one window;
    BERT masks the window with ``key`` (fixed per window: every run is evaluated on the same
    masked positions) and counts the masked positions only."""
    import optax

    from jaxlp.flax.models import mask_tokens

    k_mask, k_quant = jax.random.split(key)
    inputs = x
    if self.cfg.model == "bert":
      inputs, wm = mask_tokens(k_mask, x, mask_id=self.ds.mask_id,
                               num_tokens=self.ds.num_tokens)
      y, w = x, w * wm
    rngs = {"quantize": k_quant} if self.policy is not None and self.policy.stochastic else {}
    logits = self.apply_model({"params": params}, inputs, train=False, rngs=rngs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(ce * w), jnp.sum(w)

  def _check_lm_step(self):
    """Trace (abstractly; nothing runs) the training step and the evaluation of a language
    model before anything is written: a policy mode that cannot run on its matmuls is a
    ValueError naming the flags."""
    cfg = self.cfg
    rows, seq_len = cfg.batch_size, cfg.seq_len
    x = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)
    xe, ye, we = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.eval_windows)
    # the step of stage 0, kept: run_epoch uses this jitted function (its trace is cached)
    step = self._train_steps.setdefault(self._stage(0),
                                        self._make_train_step(self._compressor_at(0)))
    try:
      jax.eval_shape(step, self.params, self.batch_stats, self.opt_state, self.comp_state, x, x,
                     self.step_key)
      jax.eval_shape(self._eval_sums, self._full_params(), xe, ye, we)
    except NotImplementedError as e:
      flags = " ".join(f for f in (
          f"--hbfp {cfg.hbfp}" if cfg.hbfp is not None else "",
          f"--policy {cfg.policy}" if cfg.policy else "",
          "--exact-blocks" if cfg.exact_blocks else "") if f)
      raise ValueError(f"--model {cfg.model} with {flags or 'this configuration'}: not "
                       f"supported yet on its (batch, sequence, features) matmuls ({e})"
                       ) from None

  # -- epochs ----------------------------------------------------------------------------
  def evaluate(self) -> float:
    """Test accuracy of an image classifier (:meth:`evaluate_text` for a language model)."""
    if self.lm:
      raise ValueError("Trainer.evaluate: a language model has no accuracy; use evaluate_text")
    ds, correct = self.ds, 0
    bs = 512
    for i in range(0, len(ds.x_test), bs):
      pred = self._predict(self.params, self.batch_stats, jnp.asarray(ds.x_test[i:i + bs]))
      correct += int(np.sum(np.asarray(pred) == ds.y_test[i:i + bs]))
    return correct / len(ds.x_test)

  def _full_params(self):
    """This process's copy of the full parameters (a ``--shard fsdp`` run keeps only the
    workers' shards between steps: gathered here)."""
    return self.params if self._shard is None else self._shard.local_full_params(self.params)

  def evaluate_text(self) -> dict:
    """A language model's mean token cross-entropy (BERT: of its masked tokens) on the
    valid and test text: ``valid_loss``, ``valid_perplexity``, ``test_loss``,
    ``perplexity`` (of the test text; ``exp`` of its loss)."""
    ce, n = jax.device_get(self._eval_sums(self._full_params(), *self.eval_windows))
    ce, n = np.asarray(ce, np.float64), np.asarray(n, np.float64)
    out = {}
    for split, part in (("valid", slice(0, self.eval_split)),
                        ("test", slice(self.eval_split, None))):
      loss = float(ce[part].sum() / max(n[part].sum(), 1.0))
      out[f"{split}_loss"] = loss
      out["perplexity" if split == "test" else f"{split}_perplexity"] = perplexity(loss)
    return out

  def run_epoch(self, progress=None) -> dict:
    cfg, ds = self.cfg, self.ds
    t0 = time.perf_counter()
    rng = np.random.default_rng([cfg.seed, self.epoch])
    if self.lm:  # one window of every stream per step, the windows in a random order
      perm = rng.permutation(len(self.train_windows[0]))
      steps = len(perm)
    else:
      perm = rng.permutation(len(ds.x_train))
      steps = len(perm) // cfg.batch_size
    if steps == 0:
      raise ValueError(f"--batch-size {cfg.batch_size} exceeds the training set ({len(perm)})")
    if cfg.max_steps_per_epoch:
      steps = min(steps, cfg.max_steps_per_epoch)
    losses, nonfinite, wire = [], 0, 0
    for s in range(steps):
      if self.lm:
        xb, yb = self.train_windows[0][perm[s]], self.train_windows[1][perm[s]]
      else:
        idx = perm[s * cfg.batch_size:(s + 1) * cfg.batch_size]
        xb, yb = ds.x_train[idx], ds.y_train[idx]
      key = jax.random.fold_in(self.step_key, self.step)
      stage = self._stage(self.step)
      if stage not in self._train_steps:
        self._train_steps[stage] = self._make_train_step(self._compressor_at(self.step))
      wire += self.wire_bytes_at(self.step)
      if s == 0:
        self._place_state()
      with _device_memory(cfg, f"running step {self.step + 1}"):
        (self.params, self.batch_stats, self.opt_state, self.comp_state, loss,
         finite) = self._train_steps[stage](self.params, self.batch_stats, self.opt_state,
                                           self.comp_state, jnp.asarray(xb),
                                           jnp.asarray(yb), key)
        losses.append(float(loss))
      nonfinite += int(not bool(finite))
      self.step += 1
      if progress:
        progress(s + 1, steps, losses[-1])
    with _device_memory(cfg, "evaluating"):
      scores = self.evaluate_text() if self.lm else {"test_accuracy": self.evaluate()}
    self.epoch += 1
    mem = {} if self._shard is None else self._shard.memory()
    return {"epoch": self.epoch, "train_loss": float(np.mean(losses)), **scores,
            "wire_bytes": int(wire), "steps": steps,
            "nonfinite_steps": nonfinite, "seconds": time.perf_counter() - t0} | mem

  # -- checkpoints -----------------------------------------------------------------------
  def state_dict(self):
    """The training state (params, batch_stats, opt_state, comp_state, epoch, step)."""
    st = {"params": self.params, "batch_stats": self.batch_stats,
          "opt_state": self.opt_state, "comp_state": self.comp_state}
    # typed PRNG keys cannot go through device_get; they stay jax arrays
    st = jax.tree_util.tree_map(lambda a: a if _runs._is_key(a) else jax.device_get(a), st)
    return st | {"epoch": self.epoch, "step": self.step}

  def load_state_dict(self, st):
    """Restore :meth:`state_dict` (arrays are converted to ``jax.Array``)."""
    as_jnp = lambda t: jax.tree_util.tree_map(
        lambda a: a if _runs._is_key(a) else jnp.asarray(a), t)
    self.params = as_jnp(st["params"])
    self.batch_stats = as_jnp(st["batch_stats"])
    self.opt_state = as_jnp(st["opt_state"])
    self.comp_state = None if st["comp_state"] is None else as_jnp(st["comp_state"])
    self.epoch, self.step = int(st["epoch"]), int(st["step"])

  def _place_state(self):
    """Put the state where the compiled step leaves it (replicated over the mesh; the workers'
    compression state split over it), so that the first step and the later ones share one
    executable instead of compiling twice. A no-op on one device or for placed arrays."""
    if self._shard is not None:
      return self._shard.place()
    if self._mesh is None:
      return
    rep = jax.sharding.NamedSharding(self._mesh, P())
    self.params, self.batch_stats, self.opt_state = jax.device_put(
        (self.params, self.batch_stats, self.opt_state), rep)
    if self.comp_state is not None:
      self.comp_state = jax.device_put(
          self.comp_state, jax.sharding.NamedSharding(self._mesh, P("dev")))

  def _state_tree(self):
    return {"params": self.params, "batch_stats": self.batch_stats,
            "opt_state": self.opt_state, "comp_state": self.comp_state}

  def save_checkpoint(self, path: str, history: list[dict]) -> None:
    """Write the state, the configuration and ``history`` to ``path`` (msgpack, atomic)."""
    data = _runs.checkpoint_bytes(_runs.recorded_config(self.cfg), self.epoch, self.step,
                                  history, self._state_tree())
    _runs.atomic_write(path, data)

  def load_checkpoint(self, path: str) -> list[dict]:
    """Restore a :meth:`save_checkpoint` file into this trainer's own freshly built state
    (the structure, shapes and dtypes must match). Returns the stored history.

    Raises ValueError naming ``path``: a damaged file (unreadable, truncated, or an array,
    the history, the epoch or the step that does not match the SHA-256 stored with it),
    another format version, or a checkpoint of another configuration."""
    return self._load_checkpoint(path)[0]

  def _load_checkpoint(self, path: str) -> tuple[list[dict], int]:
    ck = _runs.read_checkpoint(path)
    diffs = _runs.config_differences(self.cfg, ck["config"], type(self.cfg)())
    if diffs:
      raise ValueError(f"{path} belongs to another configuration: {'; '.join(diffs)}")
    st = _runs.unflatten_state(ck["state"], self._state_tree(), path)
    self.load_state_dict(st | {"epoch": ck["epoch"], "step": ck["step"]})
    return list(ck["history"]), int(ck["version"])


def perplexity(loss: float) -> float:
  """``exp(loss)`` of a mean token cross-entropy in nats (inf past float range, NaN for a
  NaN loss)."""
  if math.isnan(loss):
    return float("nan")
  return math.exp(loss) if loss < 700 else float("inf")


def _progress_printer(epoch, epochs, stream):
  if not stream.isatty():
    return None
  width = 28

  def show(i, n, loss):
    filled = int(width * i / n)
    stream.write(f"\repoch {epoch}/{epochs} [{'#' * filled}{'.' * (width - filled)}] "
                 f"{i}/{n} loss {loss:.4f}")
    stream.flush()
    if i == n:
      stream.write("\r" + " " * (width + 48) + "\r")

  return show


def train(cfg: TrainConfig, stream=None) -> list[dict]:
  """Run (or resume) a training run to ``cfg.epochs`` and return its per-epoch metrics.

  With ``cfg.out`` set, the run folder gets ``config.json``, ``metrics.jsonl`` (one line per
  epoch, appended and fsynced) and ``checkpoint.msgpack`` after every epoch
  (``flax.serialization`` msgpack written through a temporary file, fsync and ``os.replace``;
  it holds the configuration, the metrics history, the epoch, the state and the SHA-256 of
  every array, verified when it is read). A folder that already holds a run needs
  ``cfg.resume`` (continue: the configuration must equal the run's, ``epochs`` may grow; a
  ``metrics.jsonl`` left torn by a crash is repaired from the checkpoint) or ``cfg.overwrite``.

  One writer per folder: the run holds an OS lock on ``out`` (``out/.lock``, with its pid) from
  before it reads the folder until it returns; a second run on the same folder, in this
  process or another, is refused. Every check -- flags, data, shapes, the folder, a resumed
  checkpoint -- runs before anything in the folder is changed. ``overwrite`` moves the old run
  aside (``out/.replaced-PID``) and deletes it only once the new run's first checkpoint is
  written; if the new run fails or is interrupted before that, the old run is put back (a
  killed process's set-aside run is put back by the next writer of the folder).

  Args:
    cfg: the run.
    stream: where progress goes unless ``cfg.quiet`` (default ``sys.stdout``).

  Returns:
    One dict per epoch: ``epoch``, ``train_loss``, ``test_accuracy`` (classifiers) or
    ``valid_loss``, ``valid_perplexity``, ``test_loss``, ``perplexity`` (language models:
    mean token cross-entropy in nats and its ``exp``; ``perplexity`` is the test text's;
    BERT: of the masked tokens), ``wire_bytes``, ``steps``, ``nonfinite_steps`` (steps whose
    loss or gradient had a NaN/inf), ``seconds`` (the lines of ``metrics.jsonl``).

  Raises:
    ValueError: an invalid configuration (the message names the flag), one that cannot fit
      in memory (naming ``--width``); ``out`` in use by another run; ``out`` holding a
      run without ``resume``/``overwrite``; ``resume`` with a changed configuration, fewer
      epochs than done, without a run, or over a damaged run folder or checkpoint (the message
      names the file); a pickle checkpoint without ``migrate_pickle``.
    TypeError: a field of the wrong type.
    KeyboardInterrupt: Ctrl-C; raised as ``jaxlp.training._runs.Interrupted``, which says
      the epoch, what is saved in ``out`` and whether resuming continues it.

  Example:
    >>> from jaxlp.training import TrainConfig, train
    >>> hist = train(TrainConfig(nodes=2, epochs=1, max_steps_per_epoch=2, quiet=True))
    >>> [h["epoch"] for h in hist], 0.0 <= hist[0]["test_accuracy"] <= 1.0
    ([1], True)
  """
  stream = stream or sys.stdout
  if cfg.out is None:
    run = _Run(cfg, stream)
    return run.guarded(run.train_without_folder)
  if not isinstance(cfg.out, str) or not cfg.out:
    raise ValueError(f"--out must be a folder path, got {cfg.out!r}")
  with _runs.RunLock(cfg.out):  # before anything in the folder is read
    run = _Run(cfg, stream)
    return run.guarded(run.train_in_folder)


class _Run:
  """One call of :func:`train`: what it has done so far, for the clean-up and the message of
  an interrupted or failed run."""

  def __init__(self, cfg: TrainConfig, stream):
    self.cfg, self.stream = cfg, stream
    self.trainer: Trainer | None = None
    self.saved = 0  # finished epochs in the folder's checkpoint
    self.aside: str | None = None  # the run --overwrite set aside, until our first checkpoint
    self.wrote = False  # config.json of this run is in the folder
    self.started = False  # the epochs are running

  def guarded(self, body):
    try:
      return body()
    except BaseException as e:
      note = ""
      if self.aside is not None:
        _runs.restore_aside(self.cfg.out, self.aside)
        self.aside, self.wrote = None, False
        note = f"the run that --overwrite was replacing is back in {self.cfg.out}"
      if isinstance(e, KeyboardInterrupt) and not isinstance(e, _runs.Interrupted):
        epoch = self.trainer.epoch + 1 if self.started else 0
        # resuming continues the folder's run: a resumed one, or a new one that wrote its
        # config.json (and was not rolled back to the run it was replacing)
        resumable = self.cfg.out is not None and (self.cfg.resume or self.wrote)
        raise _runs.Interrupted(self.cfg.out, epoch, self.saved, resumable, note) from None
      raise

  def train_without_folder(self):
    self.trainer = Trainer(self.cfg)
    self._header([])
    return self._loop([], None, None)

  def train_in_folder(self):
    cfg = self.cfg
    notes = []
    note = _runs.recover_aside(cfg.out)  # an --overwrite whose process was killed
    if note:
      notes.append(note)
    present = _runs.check_out(cfg)  # before the (slow) trainer
    trainer = self.trainer = Trainer(cfg)
    ckpt = os.path.join(cfg.out, _runs.CHECKPOINT)
    metrics_path = os.path.join(cfg.out, _runs.METRICS)
    if cfg.resume:
      history, more = _resume(trainer, cfg, ckpt, metrics_path)
      notes += more
      self.saved, self.wrote = trainer.epoch, True
    else:
      history = []
      if present:  # --overwrite: everything checked; the old run goes aside, not away
        self.aside = _runs.move_aside(cfg.out, present)
      self.wrote = True
      _runs.atomic_write(metrics_path, b"")
    rec = _runs.recorded_config(cfg) | {"n_params": trainer.n_params,
                                        "wire_bytes_per_step": trainer.wire_per_step}
    if trainer._shard is not None:
      rec |= trainer._shard.memory()
    _runs.atomic_write(os.path.join(cfg.out, _runs.CONFIG),
                       (json.dumps(rec, indent=2) + "\n").encode())
    self._header(notes)
    return self._loop(history, ckpt, metrics_path)

  def _header(self, notes):
    cfg, trainer, stream = self.cfg, self.trainer, self.stream
    if cfg.quiet:
      return
    fmt = trainer.fmt if trainer.fmt is not None else (cfg.compress or cfg.grad_wire or "fp32")
    if trainer.lm:
      sizes = f"{trainer.ds.name}, {trainer.ds.sizes()}, windows of {cfg.seq_len}"
    else:
      sizes = f"{len(trainer.ds.x_train)} train / {len(trainer.ds.x_test)} test"
    stream.write(f"jaxlp train: {cfg.model} on {cfg.data} ({sizes}), {cfg.nodes} worker(s) on "
                 f"{trainer.ndev} "
                 f"device(s), gradients {fmt}"
                 f"{' +APS' if cfg.aps else ''}{' +Kahan' if cfg.kahan else ''}, order "
                 f"{cfg.order}, {trainer.n_params} params\n")
    if trainer._shard is not None:
      stream.write(trainer._shard.header() + "\n")
    for note in notes:
      stream.write(f"jaxlp train: {note}\n")
    stream.flush()

  def _loop(self, history, ckpt, metrics_path):
    cfg, trainer, stream = self.cfg, self.trainer, self.stream
    self.started = True
    while trainer.epoch < cfg.epochs:
      prog = None if cfg.quiet else _progress_printer(trainer.epoch + 1, cfg.epochs, stream)
      m = trainer.run_epoch(prog)
      history.append(m)
      if not cfg.quiet:
        score = (f"valid ppl {m['valid_perplexity']:.3f}  test ppl {m['perplexity']:.3f}"
                 if trainer.lm else f"test acc {m['test_accuracy']:.4f}")
        stream.write(f"epoch {m['epoch']:>3}/{cfg.epochs}  loss {m['train_loss']:.4f}  "
                     f"{score}  wire {m['wire_bytes'] / 1e6:.2f} MB  {m['seconds']:.1f}s\n")
        stream.flush()
      if ckpt is not None:
        # metrics first: a crash before the checkpoint leaves one extra line, dropped on resume
        _runs.append_line(metrics_path, json.dumps(m))
        trainer.save_checkpoint(ckpt, history)
        self.saved = trainer.epoch
        if self.aside is not None:  # the new run has its first checkpoint: it replaces the old
          aside, self.aside = self.aside, None
          _runs.discard_aside(aside)
    return history


def _resume(trainer: Trainer, cfg: TrainConfig, ckpt: str, metrics_path: str):
  """Load the run folder's checkpoint into ``trainer`` and validate its metrics (nothing is
  written until everything checks out). Returns (history, notes)."""
  legacy = os.path.join(cfg.out, _runs.LEGACY_CHECKPOINT)
  notes = []
  if os.path.exists(ckpt):
    history, version = trainer._load_checkpoint(ckpt)
    if version < _runs.VERSION:
      notes.append(f"{ckpt} is a checkpoint of format version {version}, which has no "
                   "checksums: it was loaded unverified (the next one is written with them)")
  elif os.path.exists(legacy):
    if not cfg.migrate_pickle:
      raise ValueError(f"{legacy} is a pickle checkpoint of an older jaxlp; loading a pickle "
                       "can run arbitrary code. If you trust the file, resume with "
                       "--migrate-pickle (TrainConfig(migrate_pickle=True)) to convert it to "
                       f"{_runs.CHECKPOINT}")
    if cfg.hbfp is not None or cfg.policy in ("hbfp8", "hbfp12"):
      raise ValueError(f"{legacy}: HBFP runs of older jaxlp versions used per-sample "
                       "activation blocks; this version tiles them (--tile), so the run "
                       "cannot be continued")
    st = _runs.load_legacy_pickle(legacy)
    names = ("params", "batch_stats", "opt_state", "comp_state")
    if not isinstance(st, dict) or not all(k in st for k in names + ("epoch", "step")):
      raise ValueError(f"{legacy} is not a jaxlp checkpoint")
    flat = _runs.flatten_state({k: st[k] for k in names})
    tree = _runs.unflatten_state(flat, trainer._state_tree(), legacy)
    trainer.load_state_dict(tree | {"epoch": st["epoch"], "step": st["step"]})
    lines, _ = _runs.read_metrics_lines(metrics_path)
    history = lines[:trainer.epoch]
    _runs.check_history(history, trainer.epoch, metrics_path)
    notes.append(f"converted {legacy} to {_runs.CHECKPOINT} (--migrate-pickle)")
  else:
    # no checkpoint: legitimate only for a run stopped before its first checkpoint, whose
    # metrics hold at most the line of epoch 1 (appended just before that checkpoint)
    lines, _ = _runs.read_metrics_lines(metrics_path)
    if len(lines) > 1 or (lines and not (isinstance(lines[0], dict)
                                         and lines[0].get("epoch") == 1)):
      raise ValueError(f"--resume: {ckpt} is missing, but {metrics_path} records "
                       f"{len(lines)} finished epochs: the checkpoint was deleted or lost, so "
                       "the run cannot continue; restore the file, or start over with "
                       "--overwrite")
    trainer.epoch = trainer.step = 0  # killed before the first checkpoint
    history = []
  if cfg.epochs < trainer.epoch:
    raise ValueError(f"--epochs {cfg.epochs}: the run in {cfg.out} has already done "
                     f"{trainer.epoch} epochs (--epochs may only grow on --resume)")
  stored = _runs.read_json(os.path.join(cfg.out, _runs.CONFIG))
  if (cfg.schedule == "triangle" and cfg.epochs != stored.get("epochs", cfg.epochs)):
    raise ValueError(f"--epochs {cfg.epochs}: the triangle schedule of the run in {cfg.out} "
                     f"spans its {stored.get('epochs')} epochs; it cannot be extended")
  note = _runs.reconcile_metrics(metrics_path, history)
  if note:
    notes.append(note)
  if os.path.exists(legacy) and not os.path.exists(ckpt):
    trainer.save_checkpoint(ckpt, history)
  return history, notes
