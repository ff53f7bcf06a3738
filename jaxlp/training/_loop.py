"""Training core of ``jaxlp train``: data-parallel SGD over N (emulated) workers whose
gradients are summed in low precision (optionally with APS/Kahan), compressed, or in fp32.

Gradient convention (CPD's): each worker's loss is divided by the number of workers before
the backward pass, so the low-precision SUM across workers is the mean gradient.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
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
from jaxlp.parallel import compressors as C
from jaxlp.parallel import payload_bytes, psum
from jaxlp.parallel._compressed import compressed_allreduce, init_compression_state

ORDERS = ("chain", "ring", "tree", "native")


@dataclasses.dataclass
class TrainConfig:
  """One training run: each field is the ``jaxlp train`` flag of the same name.

  The fields group as in ``jaxlp train --help``: model and data (``model``, ``data``,
  ``data_dir``, ``width``); workers and gradient reduction (``nodes``, ``devices``,
  ``grad_exp``/``grad_man`` or ``grad_format``, ``order``, ``aps``, ``kahan``, ``lars``,
  ``compress``); forward/backward quantization (``hbfp``, ``tile``, ``weight_man``,
  ``policy``); optimisation (``epochs``, ``batch_size``, ``lr``, ``schedule``,
  ``warmup_epochs``, ``momentum``, ``weight_decay``, ``seed``); output (``out``, ``resume``,
  ``quiet``). ``max_steps_per_epoch`` caps an epoch (for quick tests).

  Example:
    >>> from jaxlp.training import TrainConfig
    >>> TrainConfig(nodes=8, grad_exp=3, grad_man=0, aps=True).order
    'chain'
  """

  model: str = "mlp"
  data: str = "digits"
  data_dir: str | None = None
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
  hbfp: int | None = None
  tile: int = 24
  weight_man: int | None = None
  policy: str | None = None
  epochs: int = 10
  batch_size: int = 128
  lr: float = 0.05
  schedule: str = "constant"
  warmup_epochs: int = 0
  momentum: float = 0.9
  weight_decay: float = 0.0
  seed: int = 0
  width: int = 16
  max_steps_per_epoch: int | None = None
  out: str | None = None
  resume: bool = False
  quiet: bool = False


def grad_format(cfg: TrainConfig):
  """The gradient-communication format of a config, or None for fp32."""
  if cfg.grad_format is not None and (cfg.grad_exp is not None or cfg.grad_man is not None):
    raise ValueError("give either --grad-format or --grad-exp/--grad-man, not both")
  if cfg.grad_format is not None:
    f = F.get_format(cfg.grad_format)
    return None if f == F.FP32 else f
  if cfg.grad_exp is None and cfg.grad_man is None:
    return None
  if cfg.grad_exp is None or cfg.grad_man is None:
    raise ValueError("--grad-exp and --grad-man must be given together")
  if (cfg.grad_exp, cfg.grad_man) == (8, 23):
    return None  # CPD: 8/23 means an ordinary fp32 all-reduce
  return F.cpd_float(cfg.grad_exp, cfg.grad_man)


def wire_bytes_per_step(cfg: TrainConfig, compressor=None, params=None, *,
                        min_size: int = 1024) -> int:
  """Bytes each worker sends per step for the configured gradient reduction.

  Low-precision sums use :func:`jaxlp.parallel.payload_bytes` per gradient leaf (the bytes
  the implemented collectives move); fp32 is a ring all-reduce (2(W-1)/W * 4 bytes/element).
  """

  W = cfg.nodes
  if W <= 1:
    return 0
  leaves = jax.tree_util.tree_leaves(params)
  fp32_ring = lambda n: 2 * (W - 1) * math.ceil(n / W) * 4
  if compressor is not None:
    # Mirrors jaxlp.parallel.compressed_allreduce: small leaves and vectors go in fp32; dense
    # quantizers/casts use scatter-reduce-allgather (2(W-1) chunk payloads); PowerSGD
    # all-reduces its factors; sparsifiers all-gather their payload to W-1 peers.
    total = 0
    for leaf in leaves:
      n = leaf.size
      kind = getattr(compressor, "kind", "")
      if n < min_size or leaf.ndim <= 1 or (kind == "lowrank" and
                                        compressor.matrix_shape(leaf.shape) is None):
        total += fp32_ring(n)
      elif kind in ("quantizer", "cast", "lowrank"):
        chunk = (math.ceil(n / W),) if kind != "lowrank" else leaf.shape
        wb = compressor.wire_bytes(chunk, leaf.dtype)
        total += 2 * (W - 1) * (wb if kind != "lowrank" else math.ceil(wb / W))
      else:
        total += (W - 1) * compressor.wire_bytes(leaf.shape, leaf.dtype)
    return int(total)
  fmt = grad_format(cfg)
  if fmt is None:
    return int(sum(fp32_ring(leaf.size) for leaf in leaves))

  return int(sum(payload_bytes(leaf.size, W, fmt, cfg.order, kahan=cfg.kahan, aps=cfg.aps)
                 for leaf in leaves))


def _policy(cfg: TrainConfig):
  if cfg.hbfp is not None and cfg.policy is not None:
    raise ValueError("give either --hbfp or --policy, not both")
  if cfg.hbfp is None and cfg.policy is None:
    return None

  if cfg.hbfp is not None:
    return jaxlp.hbfp_policy(man_bits=cfg.hbfp, tile=cfg.tile)
  presets = {
      "hbfp8": lambda: jaxlp.hbfp_policy(man_bits=8, tile=cfg.tile),
      "hbfp12": lambda: jaxlp.hbfp_policy(man_bits=12, tile=cfg.tile),
      "mxfp8": lambda: jaxlp.mx_policy(),
      "e4m3": lambda: jaxlp.float_policy(fwd=jaxlp.formats.E4M3, bwd=jaxlp.formats.E5M2),
  }
  if cfg.policy not in presets:
    raise ValueError(f"unknown --policy {cfg.policy!r}; choose from {sorted(presets)}")
  return presets[cfg.policy]()


_REDUCE_OPTS = ("algorithm", "bucket_mb", "min_size")


def _parse_compress(spec: str):
  """``name:key=value,key=value`` -> (compressor from jaxlp.parallel.compressors, options of
  ``compressed_allreduce``: ``algorithm``, ``bucket_mb``, ``min_size``)."""

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
    kwargs[k] = val
  factory = getattr(C, name, None)
  if factory is None or name.startswith("_"):
    raise ValueError(f"--compress: unknown compressor {name!r}")
  opts = {k: kwargs.pop(k) for k in _REDUCE_OPTS if k in kwargs}
  if opts.get("algorithm", "auto") not in ("auto", "sra", "ring", "allgather"):
    raise ValueError(f"--compress {spec!r}: algorithm must be auto, sra, ring or allgather")
  try:
    return factory(**kwargs), opts
  except TypeError as e:
    raise ValueError(f"--compress {spec!r}: {e}") from e


class Trainer:
  """The training loop one epoch at a time: builds the data, the model, the optimizer and the
  jitted data-parallel step of a :class:`TrainConfig`.

  Args:
    cfg: the run.

  Raises:
    ValueError: an invalid configuration (the message names the flag).

  Example:
    >>> from jaxlp.training import TrainConfig, Trainer
    >>> t = Trainer(TrainConfig(nodes=2, max_steps_per_epoch=1, quiet=True))
    >>> m = t.run_epoch()
    >>> m["epoch"], t.epoch
    (1, 1)
  """

  def __init__(self, cfg: TrainConfig):
    import optax

    from jaxlp.training import _data as D
    from jaxlp.training import _models as M

    self.cfg = cfg
    if cfg.nodes < 1:
      raise ValueError(f"--nodes must be >= 1, got {cfg.nodes}")
    if cfg.batch_size % cfg.nodes:
      raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by --nodes {cfg.nodes}")
    if cfg.order not in ORDERS:
      raise ValueError(f"--order must be one of {ORDERS}, got {cfg.order!r}")

    if cfg.devices > 0:
      ndev = cfg.devices
    else:  # auto: as many real devices as divide the number of workers
      ndev = max(d for d in range(1, jax.device_count() + 1) if cfg.nodes % d == 0)
    if ndev > jax.device_count() or cfg.nodes % ndev:
      raise ValueError(f"--devices {cfg.devices}: need a divisor of --nodes {cfg.nodes} that is "
                       f"at most the {jax.device_count()} available device(s)")
    self.ndev = ndev
    self.axis = ("dev", "nodes") if ndev > 1 else "nodes"
    self.fmt = grad_format(cfg)
    if (cfg.aps or cfg.kahan) and self.fmt is None:
      raise ValueError("--aps/--kahan need a low-precision gradient format "
                       "(--grad-exp/--grad-man or --grad-format)")
    self.compressor, self.reduce_opts = (_parse_compress(cfg.compress) if cfg.compress
                                         else (None, {}))
    if self.compressor is not None and self.fmt is not None:
      raise ValueError("give either --compress or a gradient format, not both")
    self.ds = D.load(cfg.data, cfg.data_dir, cfg.seed)
    policy = _policy(cfg)
    kw = {}
    if policy is not None:
      kw = dict(dot_general=jaxlp.dot_general(policy),
                conv_general_dilated=jaxlp.conv_general_dilated(policy))
    self.model = M.build(cfg.model, self.ds.num_classes, width=cfg.width, **kw)
    key = jax.random.key(cfg.seed)
    init_key, self.step_key = jax.random.split(key)
    variables = self.model.init(init_key, jnp.asarray(self.ds.x_train[:2]), train=False)
    self.params = variables["params"]
    self.batch_stats = variables.get("batch_stats", {})
    self.n_params = int(sum(x.size for x in jax.tree_util.tree_leaves(self.params)))
    if cfg.schedule not in ("constant", "triangle"):
      raise ValueError(f"--schedule must be 'constant' or 'triangle', got {cfg.schedule!r}")
    steps_per_epoch = len(self.ds.x_train) // cfg.batch_size
    if cfg.max_steps_per_epoch:
      steps_per_epoch = min(steps_per_epoch, cfg.max_steps_per_epoch)
    lr = cfg.lr
    if cfg.schedule == "triangle":  # DavidNet: 0 -> lr over warm-up, then linearly -> 0
      up = max(cfg.warmup_epochs * steps_per_epoch, 1)
      down = max((cfg.epochs - cfg.warmup_epochs) * steps_per_epoch, 1)
      lr = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, up),
                                 optax.linear_schedule(cfg.lr, 0.0, down)], [up])
    if cfg.lars:
      from jaxlp.optim import lars

      self.tx = lars(lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
      self.tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay),
                            optax.sgd(lr, momentum=cfg.momentum,
                                      nesterov=cfg.schedule == "triangle"))
    if cfg.weight_man is not None:
      if cfg.hbfp is None:
        raise ValueError("--weight-man needs --hbfp (HBFP's wide weight storage)")
      from jaxlp.optim import master_weights

      # HBFPEmulator's shell optimizer: FP32 update of a wide copy, narrow params to the model.
      self.tx = master_weights(self.tx, fmt=F.hbfp(cfg.hbfp, cfg.tile),
                                wide_fmt=F.hbfp(cfg.weight_man, cfg.tile))
    self.opt_state = self.tx.init(self.params)
    self.comp_state = None
    if self.compressor is not None:
      one = init_compression_state(self.compressor, self.params)
      self.comp_state = jax.tree_util.tree_map(
          lambda a: jnp.broadcast_to(a, (cfg.nodes,) + a.shape), one)
    self.wire_per_step = wire_bytes_per_step(cfg, self.compressor, self.params,
                                             min_size=self.reduce_opts.get("min_size", 1024))
    self.epoch = 0
    self.step = 0
    self._build_step()

  # -- the jitted step ---------------------------------------------------------------------
  def _reduce(self, g, key, comp_state):
    cfg = self.cfg
    W = cfg.nodes
    if self.compressor is not None:
      # compressed_allreduce with mean=False: the loss is already pre-scaled by 1/W.
      return compressed_allreduce(g, comp_state, self.axis, self.compressor, mean=False, key=key,
                                  **self.reduce_opts)
    if self.fmt is None or W == 1:
      return jax.tree_util.tree_map(lambda a: lax.psum(a, self.axis), g), comp_state

    return psum(g, self.axis, fmt=self.fmt, order=cfg.order, kahan=cfg.kahan, aps=cfg.aps,
                rounding="nearest"), comp_state

  def _build_step(self):
    import optax

    model, W = self.model, self.cfg.nodes
    has_bn = bool(jax.tree_util.tree_leaves(self.batch_stats))

    def node_loss(params, batch_stats, x, y):
      if has_bn:
        logits, upd = model.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                                  mutable=["batch_stats"])
        new_bs = upd["batch_stats"]
      else:
        logits = model.apply({"params": params}, x, train=True)
        new_bs = batch_stats
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss / W, new_bs  # CPD: pre-scale so that the SUM over workers is the mean

    def node_step(params, batch_stats, x, y, key, comp_state):
      (loss, new_bs), g = jax.value_and_grad(node_loss, has_aux=True)(params, batch_stats, x, y)
      g, comp_state = self._reduce(g, key, comp_state)
      loss = lax.psum(loss, self.axis)
      new_bs = jax.tree_util.tree_map(lambda a: lax.pmean(a, self.axis), new_bs)
      return g, loss, new_bs, comp_state

    vstep = jax.vmap(node_step, in_axes=(None, None, 0, 0, None, 0), axis_name="nodes")
    if self.ndev > 1:
      # Real devices x emulated nodes: shard the worker axis over a device mesh and vmap the
      # workers of each device; reductions run over ("dev", "nodes"), worker-major.

      mesh = jax.make_mesh((self.ndev,), ("dev",), axis_types=(jax.sharding.AxisType.Auto,))
      vstep = jax.shard_map(vstep, mesh=mesh,
                            in_specs=(P(), P(), P("dev"), P("dev"), P(), P("dev")),
                            out_specs=P("dev"), check_vma=False)

    def train_step(params, batch_stats, opt_state, comp_state, x, y, key):
      xs = x.reshape((W, x.shape[0] // W) + x.shape[1:])
      ys = y.reshape((W, y.shape[0] // W))
      cs = comp_state if comp_state is not None else jnp.zeros((W,), jnp.float32)
      g, loss, bs, cs = vstep(params, batch_stats, xs, ys, key, cs)
      g0 = jax.tree_util.tree_map(lambda a: a[0], g)  # identical on every worker
      bs0 = jax.tree_util.tree_map(lambda a: a[0], bs)
      updates, opt_state = self.tx.update(g0, opt_state, params)
      params = optax.apply_updates(params, updates)
      leaves = jax.tree_util.tree_leaves(g0)
      finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(a)) for a in leaves]))
      return params, bs0, opt_state, (cs if comp_state is not None else None), loss[0], finite

    self._train_step = jax.jit(train_step)

    def predict(params, batch_stats, x):
      v = {"params": params}
      if has_bn:
        v["batch_stats"] = batch_stats
      return jnp.argmax(model.apply(v, x, train=False), -1)

    self._predict = jax.jit(predict)

  # -- epochs ----------------------------------------------------------------------------
  def evaluate(self) -> float:
    ds, correct = self.ds, 0
    bs = 512
    for i in range(0, len(ds.x_test), bs):
      pred = self._predict(self.params, self.batch_stats, jnp.asarray(ds.x_test[i:i + bs]))
      correct += int(np.sum(np.asarray(pred) == ds.y_test[i:i + bs]))
    return correct / len(ds.x_test)

  def run_epoch(self, progress=None) -> dict:
    cfg, ds = self.cfg, self.ds
    t0 = time.perf_counter()
    rng = np.random.default_rng([cfg.seed, self.epoch])
    perm = rng.permutation(len(ds.x_train))
    steps = len(perm) // cfg.batch_size
    if steps == 0:
      raise ValueError(f"--batch-size {cfg.batch_size} exceeds the training set ({len(perm)})")
    if cfg.max_steps_per_epoch:
      steps = min(steps, cfg.max_steps_per_epoch)
    losses, nonfinite = [], 0
    for s in range(steps):
      idx = perm[s * cfg.batch_size:(s + 1) * cfg.batch_size]
      key = jax.random.fold_in(self.step_key, self.step)
      (self.params, self.batch_stats, self.opt_state, self.comp_state, loss,
       finite) = self._train_step(self.params, self.batch_stats, self.opt_state, self.comp_state,
                                  jnp.asarray(ds.x_train[idx]), jnp.asarray(ds.y_train[idx]), key)
      losses.append(float(loss))
      nonfinite += int(not bool(finite))
      self.step += 1
      if progress:
        progress(s + 1, steps, losses[-1])
    acc = self.evaluate()
    self.epoch += 1
    return {"epoch": self.epoch, "train_loss": float(np.mean(losses)), "test_accuracy": acc,
            "wire_bytes": int(self.wire_per_step * steps), "steps": steps,
            "nonfinite_steps": nonfinite, "seconds": time.perf_counter() - t0}

  # -- checkpoints -----------------------------------------------------------------------
  def state_dict(self):
    return jax.device_get({"params": self.params, "batch_stats": self.batch_stats,
                           "opt_state": self.opt_state, "comp_state": self.comp_state,
                           "epoch": self.epoch, "step": self.step})

  def load_state_dict(self, st):
    as_jnp = lambda t: jax.tree_util.tree_map(jnp.asarray, t)
    self.params = as_jnp(st["params"])
    self.batch_stats = as_jnp(st["batch_stats"])
    self.opt_state = as_jnp(st["opt_state"])
    self.comp_state = None if st["comp_state"] is None else as_jnp(st["comp_state"])
    self.epoch, self.step = int(st["epoch"]), int(st["step"])


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
  epoch) and a checkpoint written after every epoch (through a temporary file and
  ``os.replace``); ``cfg.resume`` continues from that checkpoint.

  Args:
    cfg: the run.
    stream: where progress goes unless ``cfg.quiet`` (default ``sys.stdout``).

  Returns:
    One dict per epoch: ``epoch``, ``train_loss``, ``test_accuracy``, ``wire_bytes``,
    ``seconds``, ... (the lines of ``metrics.jsonl``).

  Raises:
    ValueError: an invalid configuration (the message names the flag), or ``resume`` without
      a checkpoint in ``cfg.out``.

  Example:
    >>> from jaxlp.training import TrainConfig, train
    >>> hist = train(TrainConfig(nodes=2, epochs=1, max_steps_per_epoch=2, quiet=True))
    >>> [h["epoch"] for h in hist], 0.0 <= hist[0]["test_accuracy"] <= 1.0
    ([1], True)
  """
  stream = stream or sys.stdout
  trainer = Trainer(cfg)
  history: list[dict] = []
  ckpt = metrics_path = None
  if cfg.out:
    os.makedirs(cfg.out, exist_ok=True)
    ckpt = os.path.join(cfg.out, "checkpoint.pkl")
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    if cfg.resume:
      if not os.path.exists(ckpt):
        raise ValueError(f"--resume: no checkpoint in {cfg.out}")
      with open(ckpt, "rb") as f:
        trainer.load_state_dict(pickle.load(f))
      with open(metrics_path) as f:
        history = [json.loads(line) for line in f if line.strip()][: trainer.epoch]
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
      json.dump(dataclasses.asdict(cfg) | {"n_params": trainer.n_params,
                                           "wire_bytes_per_step": trainer.wire_per_step},
                f, indent=2)
    with open(metrics_path, "w") as f:
      for h in history:
        f.write(json.dumps(h) + "\n")
  if not cfg.quiet:
    fmt = trainer.fmt if trainer.fmt is not None else (cfg.compress or "fp32")
    stream.write(f"jaxlp train: {cfg.model} on {cfg.data} ({len(trainer.ds.x_train)} train / "
                 f"{len(trainer.ds.x_test)} test), {cfg.nodes} worker(s) on {trainer.ndev} "
                 f"device(s), gradients {fmt}"
                 f"{' +APS' if cfg.aps else ''}{' +Kahan' if cfg.kahan else ''}, order "
                 f"{cfg.order}, {trainer.n_params} params\n")
  while trainer.epoch < cfg.epochs:
    prog = None if cfg.quiet else _progress_printer(trainer.epoch + 1, cfg.epochs, stream)
    m = trainer.run_epoch(prog)
    history.append(m)
    if not cfg.quiet:
      stream.write(f"epoch {m['epoch']:>3}/{cfg.epochs}  loss {m['train_loss']:.4f}  "
                   f"test acc {m['test_accuracy']:.4f}  wire {m['wire_bytes'] / 1e6:.2f} MB  "
                   f"{m['seconds']:.1f}s\n")
      stream.flush()
    if cfg.out:
      with open(metrics_path, "a") as f:
        f.write(json.dumps(m) + "\n")
      with open(ckpt + ".tmp", "wb") as f:
        pickle.dump(trainer.state_dict(), f)
      os.replace(ckpt + ".tmp", ckpt)
  return history
