"""``jaxlp train --shard zero1|zero2|fsdp``: the sharded data-parallel step of :class:`Trainer`.

Every worker keeps the optimizer state of its shard (``1/W`` of every parameter leaf; layout
of :func:`jaxlp.parallel.sharded_optimizer`). The levels (ZeRO, Rajbhandari et al. 2020):

* ``zero1``: the gradients are all-reduced exactly as the replicated run reduces them
  (fp32, ``--grad-format`` with ``--order``/``--aps``/``--kahan``, ``--compress``); each
  worker updates its shard and the parameters are all-gathered (exact).
* ``zero2``: the gradients are reduce-scattered (each worker receives only its shard's sum),
  the shard is updated and the parameters all-gathered; parameters stay replicated between
  steps.
* ``fsdp``: as ``zero2``, but between steps each worker keeps only its parameter shard; the
  step starts with the all-gather (``--param-wire``: rounded once to a format, ZeRO++'s qwZ).

Gradient reduce-scatter of ``zero2``/``fsdp``: fp32 by default -- the backend's
``psum_scatter`` over the workers in the order the replicated run's ``lax.psum`` adds them
(emulated workers of a device first, then devices), which on XLA:CPU gives every element the
bits of that ``psum`` (tested), so an fp32 sharded run equals the replicated run bit for bit;
``--grad-format F`` (with ``--order``, ``--aps``, ``--kahan``): every partial sum rounded to
F in the declared order, psum's bits (``--order ring``, ``chain`` or ``tree``), so again
equal to the replicated run with the same flags; ``--grad-wire W``: quantize once,
all-to-all, float32 sum (qgZ; no replicated counterpart); ``--compress SPEC``: a dense
quantizer or cast per slab (:func:`jaxlp.parallel.sharded_support` names why the others
cannot run sharded).

Multi-process (``jaxlp train --coordinator HOST:PORT --num-processes N --process-id I``): one
mesh over every process's devices; the inputs are the same on every process (the data and its
order follow the seed), the state lives on the mesh, and each process evaluates a local copy
of the gathered parameters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlp import formats as F

SHARD_LEVELS = ("zero1", "zero2", "fsdp")
#: elements per block of ``int8-block`` / ``int4-block`` (one int16 exponent each)
BLOCK_SIZE = 64
WIRE_NAMES = ("fp32", "int8-block[:B]", "int4-block[:B]", "mxfp8", "mxfp6", "mxfp4", "mxint8",
              "a preset (bf16, fp16, e4m3, ...)")


def parse_wire(spec: str | None, flag: str):
  """A wire name of ``--grad-wire`` / ``--param-wire`` -> a jaxlp format, or None for fp32.

  ``int8-block[:B]`` / ``int4-block[:B]``: ``BlockFormat(7 | 3, axis=-1, block_size=B)``
  (sign-magnitude 8 / 4-bit integers, one power-of-two scale per B elements, default
  :data:`BLOCK_SIZE`); ``mxfp8`` / ``mxfp6`` / ``mxfp4`` / ``mxint8``: OCP MX (E4M3FN /
  E3M2FN / E2M1FN / int8 elements, blocks of 32); else a preset name of
  :func:`jaxlp.formats.get_format` (``fp32``: None).
  """
  if spec is None:
    return None
  name, sep, rest = spec.strip().lower().partition(":")
  if name in ("int8-block", "int4-block"):
    bs = BLOCK_SIZE
    if sep:
      try:
        bs = int(rest)
      except ValueError:
        raise ValueError(f"{flag} {spec}: the block size after ':' must be an int, got "
                         f"{rest!r}") from None
      if not 1 <= bs <= 2**20:
        raise ValueError(f"{flag} {spec}: the block size must be in 1..{2**20}, got {bs}")
    return F.BlockFormat(7 if name == "int8-block" else 3, axis=-1, block_size=bs)
  if sep:
    raise ValueError(f"{flag} {spec}: only int8-block and int4-block take ':BLOCK'")
  mx = {"mxfp8": F.E4M3FN, "mxfp6": F.E3M2FN, "mxfp4": F.E2M1FN, "mxint8": "int8"}
  if name in mx:
    return F.mx(mx[name])
  try:
    f = F.get_format(name)
  except ValueError:
    raise ValueError(f"{flag}: unknown wire {spec!r}; choose from {', '.join(WIRE_NAMES)}"
                     ) from None
  return None if f == F.FP32 else f


def check(cfg, flags: dict) -> dict:
  """The sharding flags of ``cfg`` (ValueError naming the flag); returns ``grad_wire`` and
  ``param_wire`` (formats or None) to add to :func:`check_flags`'s result."""
  from jaxlp.parallel import sharded_support

  if cfg.shard is None:
    for k in ("grad_wire", "param_wire"):
      if getattr(cfg, k) is not None:
        raise ValueError(f"--{k.replace('_', '-')} applies to sharded training: it needs "
                         "--shard zero2 or fsdp")
    return {"grad_wire": None, "param_wire": None}
  if cfg.shard not in SHARD_LEVELS:
    raise ValueError(f"--shard must be one of {SHARD_LEVELS}, got {cfg.shard!r}")
  gw = parse_wire(cfg.grad_wire, "--grad-wire")
  pw = parse_wire(cfg.param_wire, "--param-wire")
  if cfg.grad_wire is not None:
    if cfg.shard == "zero1":
      raise ValueError("--grad-wire applies to --shard zero2/fsdp (reduce-scatter); --shard "
                       "zero1 all-reduces the gradients as the replicated run does (use "
                       "--grad-format or --compress)")
    if flags["fmt"] is not None or flags["compressor"] is not None:
      raise ValueError("give one gradient wire: --grad-wire, --grad-format or --compress")
    if cfg.order != "chain":
      raise ValueError(f"--order {cfg.order} applies to --grad-format (per-hop rounding); "
                       "--grad-wire rounds once and sums in float32 in rank order")
  if cfg.param_wire is not None and cfg.shard != "fsdp":
    raise ValueError(f"--param-wire applies to --shard fsdp: --shard {cfg.shard} keeps the "
                     "float32 parameters replicated and gathers them exactly (a rounded "
                     "all-gather needs the float32 master shard that only fsdp keeps)")
  comp = flags["compressor"]
  if comp is not None and cfg.shard != "zero1":
    ok, why = sharded_support(comp)
    if not ok:
      raise ValueError(f"--compress {cfg.compress}: cannot run sharded ({why}); use --shard "
                       "zero1 (all-reduce, then shard), or a dense quantizer / cast (cgx, "
                       "qsgd, onebit, tbq, terngrad, cast)")
    if flags["reduce_opts"]:
      raise ValueError(f"--compress {cfg.compress}: {sorted(flags['reduce_opts'])} are options "
                       f"of the all-reduce engine; --shard {cfg.shard} compresses every leaf "
                       "per slab")
  if cfg.lars:
    raise ValueError("--lars needs each whole leaf's norms; a sharded optimizer sees only its "
                     "shard (not implemented for --shard)")
  if cfg.weight_man is not None:
    raise ValueError("--weight-man (HBFP master weights, tiled over whole leaves) is not "
                     "implemented for --shard")
  return {"grad_wire": gw, "param_wire": pw}


def _nbytes(tree) -> int:
  total = 0
  for a in jax.tree_util.tree_leaves(tree):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      total += int(np.prod(a.shape)) * 8
    else:
      total += int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
  return total


class ShardedRun:
  """The sharded state and step of one :class:`Trainer` (``cfg.shard`` set)."""

  def __init__(self, t, flags):
    import optax

    from jaxlp.parallel import sharded_optimizer

    cfg = t.cfg
    self.t, self.level = t, cfg.shard
    W = self.W = cfg.nodes
    ndev = t.ndev
    self.nn = W // ndev
    if jax.process_count() > 1 and ndev != jax.device_count():
      raise ValueError(f"--devices {cfg.devices}: a multi-process run uses every device of "
                       f"every process ({jax.device_count()}), got {ndev}")
    fmt, comp = t.fmt, t.compressor
    self.zero1 = cfg.shard == "zero1"
    if self.zero1:  # the gradients are all-reduced as in the replicated run: no wire here
      grad_wire, order = None, "native"
    elif flags["grad_wire"] is not None:
      grad_wire, order = flags["grad_wire"], "all_to_all"
    elif comp is not None:
      grad_wire, order = comp, "all_to_all"
    elif fmt is not None:
      grad_wire, order = fmt, cfg.order
    else:
      grad_wire, order = None, "native"
    # the replicated run's lax.psum over (dev, nodes) adds the emulated workers of a device
    # first, then the devices; the backend's psum_scatter in that order matches it
    self.nodes_major = ndev > 1 and order == "native"
    axis = (("nodes", "dev") if self.nodes_major else ("dev", "nodes")) if ndev > 1 else "nodes"
    per_hop = grad_wire is not None and order != "all_to_all"
    self.tx = sharded_optimizer(t.tx, axis, t.params, grad_wire=grad_wire,
                                param_wire=flags["param_wire"], order=order,
                                aps=cfg.aps and per_hop, kahan=cfg.kahan and per_hop,
                                mean=False)
    params, opt_state = t.params, t.opt_state
    self.replicated_per_worker = _nbytes(params) + _nbytes(opt_state)
    stacked = self._to_trainer_order(self.tx.stack_shards(params, W))
    init = functools.partial(self.tx.init, num_workers=W)
    self.opt = jax.vmap(init)(stacked)
    if not self.zero1:
      t.comp_state = None
    shard_bytes = _nbytes(stacked) // W
    opt_bytes = _nbytes(self.opt) // W
    wire = self.tx.wire_bytes(W)
    self.per_worker = opt_bytes + (shard_bytes if cfg.shard == "fsdp" else _nbytes(params))
    # per device: the workers' shards and states; zero1/zero2 keep one copy of the parameters
    if cfg.shard == "fsdp":
      self.per_device = self.nn * (shard_bytes + opt_bytes)
    else:
      self.per_device = _nbytes(params) + self.nn * opt_bytes
    self.replicated_per_device = self.replicated_per_worker
    if self.zero1:
      self._rs_bytes = None
      self._ag_bytes = wire["all_gather"]
      # the replicated run's all-reduce of the full gradients, then the all-gather
      self._wire_fn = lambda c: t._allreduce_wire_bytes(c, params) + self._ag_bytes  # noqa: E731
    else:
      total = wire["reduce_scatter"] + wire["all_gather"]
      self._wire_fn = lambda c: total  # noqa: E731
    self.full_params_like = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    if cfg.shard == "fsdp":
      t.params = stacked
    t.opt_state = self.opt
    self._build(optax)

  # -- layout between the trainer's stacking (device-major) and the worker order ------------
  def _perm(self):
    """trainer index i = d*nn + n  ->  shard (slab) index n*ndev + d (nodes-major axis)."""
    nd = self.W // self.nn
    return np.asarray([n * nd + d for d in range(nd) for n in range(self.nn)])

  def _to_trainer_order(self, stacked):
    if not self.nodes_major:
      return stacked
    perm = self._perm()
    return jax.tree_util.tree_map(lambda a: a[perm], stacked)

  def _to_slab_order(self, stacked):
    if not self.nodes_major:
      return stacked
    inv = np.argsort(self._perm())
    return jax.tree_util.tree_map(lambda a: a[inv], stacked)

  def full_params(self, params):
    """The full parameters of the trainer's ``params`` (stacked shards for fsdp)."""
    if self.level != "fsdp":
      return params
    return self.tx.unstack_shards(self._to_slab_order(params))

  def local_full_params(self, params):
    """This process's copy of the full parameters of the trainer's ``params`` (fsdp: the
    shards all-gathered, exactly)."""
    full = self._gather(params) if self.level == "fsdp" else params
    return jax.tree_util.tree_map(_local, full)

  def wire_bytes(self, comp) -> int:
    return int(self._wire_fn(comp))

  # -- the step --------------------------------------------------------------------------
  def _build(self, optax):
    t, tx, W = self.t, self.tx, self.W
    fsdp = self.level == "fsdp"
    mesh = None
    if t.ndev > 1:
      mesh = jax.make_mesh((t.ndev,), ("dev",), axis_types=(jax.sharding.AxisType.Auto,))
    t._mesh = self.mesh = mesh
    node_loss = t._node_loss()
    inner = t.tx

    def make_train_step(comp):
      def node_step(p, batch_stats, x, y, key, opt, cs):
        shards = p if fsdp else tx.shard(p)
        params = tx.gather(p) if fsdp else p
        # the replicated run's key: its dropout / masking / rounding noise per worker
        (loss, new_bs), g = jax.value_and_grad(node_loss, has_aux=True)(params, batch_stats, x,
                                                                        y, key)
        if self.zero1:
          g, cs = t._reduce(g, key, cs, comp)
          sg, opt = tx.reduce(g, opt, reduced=True)
        else:
          sg, opt = tx.reduce(g, opt)
        updates, inner_state = inner.update(sg, opt.inner, shards)
        opt = opt._replace(inner=inner_state)
        shards = optax.apply_updates(shards, updates)
        out = shards if fsdp else tx.gather(shards)
        loss = lax.psum(loss, t.axis)
        new_bs = jax.tree_util.tree_map(lambda a: lax.pmean(a, t.axis), new_bs)
        ok = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(a)) for a in jax.tree_util.tree_leaves(sg)]
                                 + [jnp.isfinite(loss)]))
        ok = lax.pmin(ok.astype(jnp.int32), t.axis)
        return out, loss, new_bs, opt, cs, ok

      vstep = jax.vmap(node_step, in_axes=(0 if fsdp else None, None, 0, 0, None, 0, 0),
                       axis_name="nodes")
      if mesh is not None:
        vstep = jax.shard_map(vstep, mesh=mesh,
                              in_specs=(P("dev") if fsdp else P(), P(), P("dev"), P("dev"), P(),
                                        P("dev"), P("dev")),
                              out_specs=P("dev"), check_vma=False)

      def train_step(p, batch_stats, opt_state, comp_state, x, y, key_data):
        key = jax.random.wrap_key_data(key_data, impl=self._key_impl)
        xs = x.reshape((W, x.shape[0] // W) + x.shape[1:])
        ys = y.reshape((W, y.shape[0] // W) + y.shape[1:])
        cs = comp_state if comp_state is not None else jnp.zeros((W,), jnp.float32)
        out, loss, bs, opt, cs, ok = vstep(p, batch_stats, xs, ys, key, opt_state, cs)
        first = lambda tree: jax.tree_util.tree_map(lambda a: a[0], tree)  # noqa: E731
        p = out if fsdp else first(out)
        return (p, first(bs), opt, cs if comp_state is not None else None, loss[0],
                ok[0].astype(bool))

      jitted = jax.jit(train_step, out_shardings=self._out_shardings())

      def run(p, batch_stats, opt_state, comp_state, x, y, key):
        kd = jax.random.key_data(key)
        x, y, kd = (self._global(a) for a in (x, y, kd))
        return jitted(p, batch_stats, opt_state, comp_state, x, y, kd)

      return run

    self._key_impl = str(jax.random.key_impl(t.step_key))
    t._train_steps = {}
    t._make_train_step = make_train_step
    predict = t._predict
    self._gather = jax.jit(self.full_params, out_shardings=self._rep())

    def predict_local(params, batch_stats, x):
      local = jax.tree_util.tree_map(_local, (self.local_full_params(params), batch_stats))
      return predict(*local, x)

    t._predict = predict_local

  def _rep(self):
    return None if self.mesh is None else NamedSharding(self.mesh, P())

  def _out_shardings(self):
    if self.mesh is None:
      return None
    rep, dev = NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P("dev"))
    return (dev if self.level == "fsdp" else rep, rep, dev, dev, rep, rep)

  def _global(self, a):
    """A host value as an array replicated on the mesh (every process passes the same)."""
    if self.mesh is None or jax.process_count() == 1 or isinstance(a, jax.core.Tracer):
      return jnp.asarray(a)  # a tracer: Trainer._check_lm_step traces the step abstractly
    return jax.make_array_from_process_local_data(NamedSharding(self.mesh, P()),
                                                  np.asarray(a))

  def place(self):
    """Put the state where the compiled step leaves it (stacked state split over the mesh)."""
    t = self.t
    if self.mesh is None:
      return
    rep, dev = NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P("dev"))
    t.params = _put(t.params, dev if self.level == "fsdp" else rep)
    t.batch_stats = _put(t.batch_stats, rep)
    t.opt_state = _put(t.opt_state, dev)
    if t.comp_state is not None:
      t.comp_state = _put(t.comp_state, dev)

  def header(self) -> str:
    """The line ``jaxlp train`` prints under its header."""
    t, cfg = self.t, self.t.cfg
    if self.zero1:
      red = "all-reduced as without --shard"
    else:
      leaf = self.tx.leaves[0] if self.tx.leaves else None
      gw = "fp32" if leaf is None or leaf.grad_wire is None else (
          cfg.grad_wire or cfg.compress or cfg.grad_format)
      red = f"reduce-scattered ({gw}, order {self.tx.order})"
    pw = cfg.param_wire or "fp32, exact"
    m = self.memory()
    mb = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    return (f"jaxlp train: --shard {cfg.shard} over {self.W} workers: gradients {red}, "
            f"parameters all-gathered ({pw}); parameters + optimizer state "
            f"{mb(m['state_bytes_per_device'])} per device ({t.ndev} device(s)), replicated "
            f"{mb(m['replicated_state_bytes_per_device'])}")

  def memory(self) -> dict:
    """Bytes of parameters + optimizer state (+ wire state), sharded and replicated."""
    return {"state_bytes_per_device": int(self.per_device),
            "replicated_state_bytes_per_device": int(self.replicated_per_device),
            "state_bytes_per_worker": int(self.per_worker),
            "replicated_state_bytes_per_worker": int(self.replicated_per_worker)}


def _local(a):
  """A local (this process's) copy of a replicated array."""
  if isinstance(a, jax.Array) and not a.is_fully_addressable:
    return a.addressable_data(0)
  return a


def _put(tree, sharding):
  def one(a):
    if isinstance(a, jax.Array) and a.sharding == sharding:
      return a
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      impl = str(jax.random.key_impl(a))
      return jax.random.wrap_key_data(one(jax.random.key_data(a)), impl=impl)
    if jax.process_count() == 1:
      return jax.device_put(a, sharding)
    host = np.asarray(_local(a)) if isinstance(a, jax.Array) else np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

  return jax.tree_util.tree_map(one, tree)

