"""Sharded data parallelism (FSDP / ZeRO) through optax: :func:`sharded_optimizer`.

Every worker of the data axis keeps ``1/W`` of every parameter leaf (its *shard*) and the
optimizer state of that shard. One training step, inside the worker's ``shard_map`` /
``pmap`` / named ``vmap`` program (so also inside ``jit``):

1. ``params = tx.gather(shards)``: all-gather every leaf (exact, or rounded once to a
   ``param_wire`` format: ZeRO++'s qwZ);
2. ``grads = jax.grad(loss)(params, batch)`` on the worker's batch;
3. ``updates, state = tx.update(grads, state, shards)``: reduce-scatter every gradient leaf
   with its ``grad_wire`` (fp32, a low-precision sum with per-hop rounding in a declared
   order, or qgZ's quantize-once all-to-all with a float32 sum) and run the optax
   ``optimizer`` on the shard;
4. ``shards = optax.apply_updates(shards, updates)``.

Shard layout (W workers; worker ``o`` holds slab ``o``). A leaf whose first dimension is a
multiple of W is cut along it: the shard has shape ``(d0 / W,) + rest`` (rows
``o*d0/W ..``). Any other leaf (scalars included) is flattened in C order, zero-padded to
``W * ceil(n / W)`` elements and cut into W pieces: the shard is 1-D of length
``ceil(n / W)``; the padding lives at the end of the last shards, stays zero under the
elementwise optimizers (its gradient is zero) and is dropped by :meth:`~ShardedOptimizer.gather`.
Both layouts cut the flattened leaf into the same W contiguous chunks as
:func:`jaxlp.parallel.psum` does, so with the same format and order the reduce-scatter gives
every element the bits ``psum`` would.

Which wire each leaf gets, first match wins: ``include`` / ``exclude`` (globs on the
'/'-joined leaf path, e.g. ``"Dense_0/kernel"``; a leaf that is not selected travels in
float32 both ways, exactly), then the first rule of ``rules`` whose glob matches the path,
then ``grad_wire`` / ``param_wire``. Every pattern must match at least one leaf (a typo is a
``ValueError`` listing the paths).

Gradient wires:

* ``None``: :func:`jaxlp.parallel.reduce_scatter` in float32 with ``order``; with
  ``"ring"``, ``"chain"`` or ``"tree"`` the bits of ``jaxlp.parallel.psum(g, fmt=FP32,
  order=order)``. ``"native"``: the backend's own collectives on the leaf as it is --
  ``lax.psum_scatter`` along the first dimension (one per axis name, worker-major), or, for a
  flattened leaf, ``lax.psum`` of the whole leaf and this worker's slice. No reshape or
  padding comes between the gradient and the collective, because XLA may fuse a ``psum`` with
  the reduction that computed the gradient (a bias gradient's sum over the batch and the sum
  over emulated workers become one reduction in another order), and a reshape changes what it
  fuses. Where the backend's reduce-scatter adds like its all-reduce in the same program, this
  gives the bits of ``lax.psum(g)``, i.e. of an fp32 replicated data-parallel step: so on
  XLA:CPU (tested with ``jaxlp train``: MLP and CNN, 1, 2 and 4 devices, named-vmap workers
  and two processes). That is the backend's choice, not a specification: for bits that hold
  everywhere use ``"ring"``, ``"chain"`` or ``"tree"``.
* an elementwise format (``jaxlp.formats.BF16``, ``E4M3``, ``cpd_float(...)``...) with an
  order of psum (``"ring"``, ``"chain"``, ``"tree"``, ``"native"``): every partial sum rounded
  (psum's semantics: ``aps``, ``kahan``, ``rounding``), the bits of
  ``jaxlp.parallel.psum(g, fmt=wire, order=order, ...)`` (stochastic rounding excepted: the
  noise of leaf ``l`` comes from ``fold_in(fold_in(key, step), l)``).
* a block format (``jaxlp.formats.mx(...)``, ``BlockFormat(m, axis=-1, block_size=b)``), an
  elementwise format with ``order="all_to_all"``, or a dense-quantizer compressor
  (:func:`jaxlp.parallel.sharded_support`): :func:`jaxlp.parallel.compressed_reduce_scatter`
  (qgZ: each worker rounds its addend once, one all-to-all, a float32 sum in rank order;
  ``error_feedback`` keeps each worker's rounding error of a format wire and adds it to the
  next step's gradient -- a float32 array the size of the full leaf per worker). All the
  compressed leaves of a step share ONE all-to-all (their payloads concatenated; each leaf's
  bits are those of its own call).

The ``optimizer`` sees only the shard: the result equals the replicated optimizer's when it
is elementwise (``optax.sgd`` with or without momentum and ``add_decayed_weights``: the same
bits, tested; ``adam`` / ``adamw``: the same arithmetic, but XLA may compile the scalar
bias-correction division differently at the shard's shape, so the bits can be an ulp
apart). Transforms that look at a whole leaf or all leaves (``clip_by_global_norm``, LARS /
LAMB trust ratios, Adafactor's factored moments) compute per shard -- a different
optimizer.

ZeRO levels: keep ``shards`` between steps and gather at the start (FSDP / ZeRO-3); or keep the
full parameters replicated, ``shards = tx.shard(params)`` each step and ``params =
tx.gather(new_shards)`` at its end (ZeRO-2: the same bits, more memory); or all-reduce the
gradients yourself and call ``tx.update(reduced_grads, state, shards, reduced=True)``
(ZeRO-1: optimizer state sharded, no reduce-scatter).

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  SC 2020 (ZeRO-1/2/3). Wang et al., "ZeRO++: Extremely Efficient Collective Communication
  for Giant Model Training", arXiv:2306.10209 (qwZ, qgZ). Zhao et al., "PyTorch FSDP:
  Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp.formats._quantize import FORMAT_TYPES, ROUNDINGS, check_format, is_elementwise
from jaxlp.parallel import _axes
from jaxlp.parallel._psum import _FLOAT_DTYPES
from jaxlp.parallel._reduce import _div
from jaxlp.parallel._sharded import (
  REDUCE_SCATTER_ORDERS,
  all_gather,
  gather_jobs,
  reduce_scatter,
)
from jaxlp.parallel._sharded import wire_payload_bytes as _payload
from jaxlp.parallel._sharded_compressed import (
  compressed_jobs,
  init_sharded_state,
  reduce_scatter_jobs,
  sharded_support,
  sharded_wire_bytes,
)

_WHO = "sharded_optimizer"


class ShardedOptState(NamedTuple):
  """State of a :class:`ShardedOptimizer` (one per worker).

  Attributes:
    count: int32 number of updates so far (step ``t`` draws stochastic noise from
      ``fold_in(key, t)``).
    key: the base PRNG key (``sharded_optimizer(key=...)``, default ``jax.random.key(0)``).
    inner: the optax optimizer's state for this worker's shards.
    wire: one entry per parameter leaf (tree-flatten order): None, or the
      :class:`~jaxlp.parallel.ShardedState` of a leaf reduced by
      :func:`~jaxlp.parallel.compressed_reduce_scatter` (its error-feedback residual or
      compressor state).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxlp import parallel as P
    >>> params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    >>> tx = P.sharded_optimizer(optax.adam(1e-3), "w", params)
    >>> st = jax.vmap(lambda p: tx.init(tx.shard(p)), in_axes=None, axis_size=2,
    ...               axis_name="w")(params)
    >>> st.inner[0].mu["w"].shape, st.inner[0].mu["b"].shape  # 2 workers' shards, stacked
    ((2, 2, 3), (2, 2))
  """

  count: Any
  key: Any
  inner: Any
  wire: tuple


class _Leaf(NamedTuple):
  path: str
  shape: tuple
  dtype: Any
  grad_wire: Any
  param_wire: Any


def _path_str(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:  # pragma: no cover - a key type jax may add later
      parts.append(str(k))
  return "/".join(parts)


def _patterns(value, name):
  if value is None:
    return None
  if isinstance(value, str):
    return (value,)
  try:
    pats = tuple(value)
  except TypeError:
    raise TypeError(f"{_WHO}: {name}={value!r} must be a str or a sequence of str") from None
  for p in pats:
    if not isinstance(p, str):
      raise TypeError(f"{_WHO}: {name} entries must be str glob patterns, got {p!r}")
  return pats


def _is_compressor(wire) -> bool:
  return wire is not None and not isinstance(wire, FORMAT_TYPES)


def _check_grad_wire(wire, rounding, where):
  if wire is None:
    return
  if isinstance(wire, FORMAT_TYPES):
    check_format(wire, rounding if is_elementwise(wire) else "nearest")
    try:
      _payload(wire, 1)
    except TypeError as e:
      raise TypeError(f"{_WHO}: {where}={wire!r} cannot travel: {e}") from None
    return
  try:
    ok, why = sharded_support(wire)
  except TypeError:
    raise TypeError(f"{_WHO}: {where} must be None, a jaxlp format or a compressor of "
                    f"jaxlp.parallel.compressors, got {wire!r}") from None
  if not ok:
    raise ValueError(f"{_WHO}: {where}={type(wire).__name__} cannot run sharded: {why}. Use a "
                     "dense quantizer (cgx, qsgd, onebit, tbq, terngrad), cast, or a jaxlp "
                     "format (e.g. jaxlp.formats.mx(jaxlp.formats.E2M1FN))")


def _check_param_wire(wire, where):
  if wire is None:
    return
  if not isinstance(wire, FORMAT_TYPES):
    raise TypeError(f"{_WHO}: {where} must be None or a jaxlp format (the parameters are "
                    f"gathered rounded once to it), got {wire!r}")
  check_format(wire)
  try:
    _payload(wire, 1)
  except TypeError as e:
    raise TypeError(f"{_WHO}: {where}={wire!r} cannot travel: {e}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedOptimizer:
  """An optax optimizer over parameters sharded on a data axis (made by
  :func:`sharded_optimizer`; the module docstring of :mod:`jaxlp.parallel._fsdp` has the
  semantics).

  ``shard``, ``gather``, ``reduce``, ``update`` (and ``init`` without ``num_workers``) run
  inside the worker's program (a ``shard_map``, ``pmap`` or ``vmap`` over ``axis_name``);
  ``stack_shards``, ``unstack_shards`` and ``wire_bytes`` run outside it.

  Attributes:
    optimizer: the optax transformation applied to the shards.
    axis_name: the data axis (or tuple of axes, worker-major).
    leaves: per parameter leaf (tree-flatten order) its '/'-joined ``path``, ``shape``,
      ``dtype``, ``grad_wire`` and ``param_wire`` after include/exclude/rules.

  Example:
    Which wire each leaf got, and the shards of 4 workers:

    >>> import jax.numpy as jnp, optax
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> params = {"bias": jnp.zeros(10), "kernel": jnp.zeros((8, 5))}
    >>> tx = P.sharded_optimizer(optax.sgd(0.1), "w", params, grad_wire=F.BF16,
    ...                          rules=[("bias", None)])
    >>> [(leaf.path, leaf.grad_wire) for leaf in tx.leaves]
    [('bias', None), ('kernel', jaxlp.formats.BF16)]
    >>> [tx.shard_shape(leaf, 4) for leaf in tx.leaves]   # bias: flattened, padded to 12
    [(3,), (2, 5)]
  """

  optimizer: Any
  axis_name: Any
  leaves: tuple
  treedef: Any
  order: str
  aps: bool
  kahan: bool
  rounding: str
  error_feedback: bool
  mean: bool
  key: Any

  # -- layout --------------------------------------------------------------------------------
  @staticmethod
  def _rows(shape, w) -> bool:
    return len(shape) >= 1 and shape[0] % w == 0

  def _shard_len(self, leaf, w) -> int:
    if self._rows(leaf.shape, w):
      return leaf.shape[0] // w
    return -(-math.prod(leaf.shape) // w)

  def shard_shape(self, leaf, w) -> tuple:
    """The shape of one worker's shard of ``leaf`` (an entry of :attr:`leaves`) over W=w."""
    k = self._shard_len(leaf, w)
    return (k,) + tuple(leaf.shape[1:]) if self._rows(leaf.shape, w) else (k,)

  def _reduce_layout(self, x, leaf, w):
    """The leaf as reduce-scattered: itself (rows) or flat and zero-padded to W*k."""
    if self._rows(leaf.shape, w):
      return x
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, w * self._shard_len(leaf, w) - flat.size))

  def _from_gathered(self, full, leaf, w):
    if self._rows(leaf.shape, w):
      return full
    return full[:math.prod(leaf.shape)].reshape(leaf.shape)

  def _flat(self, tree, what):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef != self.treedef:
      raise ValueError(f"{_WHO}: {what} has the tree structure {treedef}, not the parameters' "
                       f"{self.treedef}")
    return leaves

  def _w(self, what):
    try:
      return _axes.axis_size(self.axis_name), _axes.axis_index(self.axis_name)
    except NameError:
      raise ValueError(f"{_WHO}: {what} runs inside the workers' program (shard_map, pmap or "
                       f"vmap over axis {self.axis_name!r}); the axis is not bound here"
                       ) from None

  # -- inside the map ------------------------------------------------------------------------
  def shard(self, params):
    """This worker's shards of the full (replicated) ``params`` (no communication).

    Args:
      params: pytree shaped like the parameters given to :func:`sharded_optimizer`.

    Returns:
      The pytree of shards (:meth:`shard_shape` each).
    """
    w, me = self._w("shard")
    out = []
    for leaf, x in zip(self.leaves, self._flat(params, "params"), strict=True):
      x = jnp.asarray(x)
      if tuple(x.shape) != leaf.shape:
        raise ValueError(f"{_WHO}: shard: leaf {leaf.path!r} has shape {x.shape}, expected "
                         f"{leaf.shape}")
      k = self._shard_len(leaf, w)
      out.append(lax.dynamic_slice_in_dim(self._reduce_layout(x, leaf, w), me * k, k, 0))
    return jax.tree_util.tree_unflatten(self.treedef, out)

  def gather(self, shards):
    """The full parameters from every worker's shards, each leaf exact or rounded once to
    its ``param_wire`` (qwZ; every worker gets the same bits), all leaves in ONE all-gather
    (their payloads concatenated; the bits of one ``all_gather`` per leaf).

    Args:
      shards: this worker's shards.

    Returns:
      The full parameters (each leaf's shape and dtype).
    """
    w, _ = self._w("gather")
    items = []
    for l, s in enumerate(self._flat(shards, "shards")):  # as all_gather(s, fmt=param_wire)
      s = jnp.asarray(s)
      pw = self.leaves[l].param_wire
      if s.ndim == 0 or (pw is not None and s.dtype not in _FLOAT_DTYPES):
        all_gather(s, self.axis_name, fmt=pw)  # its error
      items.append((s, pw, 0, 0))  # leaf number 0: the noise of a call per leaf
    stacked = gather_jobs(items, self.axis_name, w)  # ONE all-gather for every leaf
    out = [self._from_gathered(st.reshape((w * it[0].shape[0],) + it[0].shape[1:]), leaf, w)
           for st, it, leaf in zip(stacked, items, self.leaves, strict=True)]
    return jax.tree_util.tree_unflatten(self.treedef, out)

  def init(self, shards, *, num_workers: int | None = None) -> ShardedOptState:
    """The state for this worker: ``optimizer.init(shards)`` and the wire states.

    Args:
      shards: this worker's shards (:meth:`shard`).
      num_workers: W, for a call outside the workers' program (e.g. ``jax.vmap(partial(
        tx.init, num_workers=W))(stacked)``); None: the size of ``axis_name``.

    Returns:
      A :class:`ShardedOptState`.
    """
    w = int(num_workers) if num_workers is not None else self._w("init")[0]
    self._flat(shards, "shards")
    base = jax.random.key(0) if self.key is None else self.key
    wire = []
    for i, leaf in enumerate(self.leaves):
      if self._compressed(leaf):
        full = self._reduce_shape(leaf, w)
        ef = self.error_feedback and not _is_compressor(leaf.grad_wire)
        st = init_sharded_state(leaf.grad_wire, jax.ShapeDtypeStruct(full, jnp.float32),
                                error_feedback=ef)
        wire.append(st._replace(key=jax.random.fold_in(base, i)))
      else:
        wire.append(None)
    return ShardedOptState(jnp.zeros((), jnp.int32), base, self.optimizer.init(shards),
                           tuple(wire))

  def _reduce_shape(self, leaf, w):
    if self._rows(leaf.shape, w):
      return leaf.shape
    return (w * self._shard_len(leaf, w),)

  def _compressed(self, leaf) -> bool:
    g = leaf.grad_wire
    return g is not None and (_is_compressor(g) or not is_elementwise(g)
                              or self.order == "all_to_all")

  def reduce(self, grads, state: ShardedOptState, *, reduced: bool = False):
    """Reduce-scatter ``grads``: this worker's shard of the (mean) gradient, each leaf over
    its ``grad_wire`` (the first half of :meth:`update`).

    Args:
      grads: this worker's full gradients (shaped like the parameters).
      state: from :meth:`init`.
      reduced: the gradients are already summed over the workers (identical everywhere, e.g.
        from ``jaxlp.parallel.psum``): take this worker's slice, no communication and no
        ``mean`` division (ZeRO-1).

    Returns:
      ``(shard_grads, new_state)``: gradients shaped like the shards; the state with the
      step count and the wire states advanced (``inner`` unchanged).
    """
    w, me = self._w("reduce")
    gl = self._flat(grads, "grads")
    step_key = jax.random.fold_in(state.key, state.count)
    out, new_wire = [], []
    all_jobs, pending = [], []  # the compressed leaves: one all-to-all for all of them
    for i, (leaf, g, ws) in enumerate(zip(self.leaves, gl, state.wire, strict=True)):
      g = jnp.asarray(g)
      if tuple(g.shape) != leaf.shape:
        raise ValueError(f"{_WHO}: gradient {leaf.path!r} has shape {g.shape}, expected "
                         f"{leaf.shape}")
      x = self._reduce_layout(g, leaf, w)
      k = self._shard_len(leaf, w)
      if reduced:
        out.append(lax.dynamic_slice_in_dim(x, me * k, k, 0))
        new_wire.append(ws)
      elif self._compressed(leaf):
        jobs, finish = compressed_jobs(x, ws, self.axis_name, leaf.grad_wire, mean=self.mean,
                                       rounding="nearest" if _is_compressor(leaf.grad_wire)
                                       else self.rounding)
        pending.append((i, len(all_jobs), len(jobs), finish))
        all_jobs += jobs
        out.append(None)
        new_wire.append(None)
      elif leaf.grad_wire is None and self.order == "native":
        out.append(self._native(_div(g, w) if self.mean else g, leaf, w, me, k))
        new_wire.append(ws)
      else:
        if self.mean:
          x = _div(x, w)
        key = jax.random.fold_in(step_key, i) if self.rounding == "stochastic" else None
        out.append(reduce_scatter(x, self.axis_name, fmt=leaf.grad_wire, order=self.order,
                                  kahan=self.kahan, aps=self.aps,
                                  rounding=self.rounding if leaf.grad_wire is not None
                                  else "nearest", key=key))
        new_wire.append(ws)
    if all_jobs:
      slabs, states = reduce_scatter_jobs(all_jobs, self.axis_name, w, me)
      for i, start, n, finish in pending:
        out[i], new_wire[i] = finish(slabs[start:start + n], states[start:start + n])
    return (jax.tree_util.tree_unflatten(self.treedef, out),
            state._replace(count=state.count + 1, wire=tuple(new_wire)))

  def _native(self, g, leaf, w, me, k):
    """float32 ``order="native"``: the backend's collectives on the leaf as it is (no
    reshape or padding: XLA fuses a psum with the reduction that computed the gradient, and a
    reshape in between changes what it fuses)."""
    axes = _axes.as_tuple(self.axis_name)
    if not self._rows(leaf.shape, w):
      red = lax.psum(g, axes)
      return lax.dynamic_slice_in_dim(self._reduce_layout(red, leaf, w), me * k, k, 0)
    for a in axes:  # worker-major: slab of the first axis, then of the next within it
      g = lax.psum_scatter(g, a, scatter_dimension=0, tiled=True)
    return g

  def update(self, grads, state: ShardedOptState, shards=None, *, reduced: bool = False):
    """Reduce-scatter ``grads`` to this worker's shard (:meth:`reduce`) and run the optimizer
    on it.

    Args:
      grads: this worker's full gradients (shaped like the parameters).
      state: from :meth:`init`.
      shards: this worker's shards (passed to the optimizer as ``params``; needed by e.g.
        ``optax.add_decayed_weights``).
      reduced: as in :meth:`reduce` (ZeRO-1: the gradients are already all-reduced).

    Returns:
      ``(updates, new_state)``: updates shaped like the shards, for ``optax.apply_updates``.
    """
    sg, state = self.reduce(grads, state, reduced=reduced)
    updates, inner = self.optimizer.update(sg, state.inner, shards)
    return updates, state._replace(inner=inner)

  # -- outside the map -----------------------------------------------------------------------
  def stack_shards(self, params, num_workers: int):
    """Every worker's shards stacked on a new leading axis (outside the workers' program):
    what ``jax.vmap(tx.shard, in_axes=None, axis_size=W, axis_name=...)`` gives.

    Args:
      params: the full parameters.
      num_workers: W.

    Returns:
      Pytree of ``(W,) + shard_shape`` arrays.
    """
    w = int(num_workers)
    out = []
    for leaf, x in zip(self.leaves, self._flat(params, "params"), strict=True):
      x = jnp.asarray(x)
      out.append(self._reduce_layout(x, leaf, w).reshape((w,) + self.shard_shape(leaf, w)))
    return jax.tree_util.tree_unflatten(self.treedef, out)

  def unstack_shards(self, stacked):
    """The full parameters from stacked shards (inverse of :meth:`stack_shards`; exact).

    Args:
      stacked: pytree of ``(W,) + shard_shape`` arrays.

    Returns:
      The full parameters.
    """
    out = []
    for leaf, s in zip(self.leaves, self._flat(stacked, "stacked shards"), strict=True):
      s = jnp.asarray(s)
      w = s.shape[0]
      full = s.reshape((w * s.shape[1],) + tuple(s.shape[2:]))
      out.append(self._from_gathered(full, leaf, w))
    return jax.tree_util.tree_unflatten(self.treedef, out)

  def wire_bytes(self, num_workers: int) -> dict:
    """Bytes one worker sends per step (:func:`jaxlp.parallel.sharded_wire_bytes`).

    Args:
      num_workers: W.

    Returns:
      ``{"reduce_scatter": int, "all_gather": int}``.
    """
    w = int(num_workers)
    rs = ag = 0
    for leaf in self.leaves:
      full = jax.ShapeDtypeStruct(self._reduce_shape(leaf, w), jnp.float32)
      comp = self._compressed(leaf)
      if leaf.grad_wire is None and self.order == "native" and not self._rows(leaf.shape, w):
        rs += 2 * (w - 1) * self._shard_len(leaf, w) * 4  # all-reduce (ring) of the leaf
      else:
        rs += sharded_wire_bytes(full, w, fmt=leaf.grad_wire,
                                 order="all_to_all" if comp else self.order,
                                 kahan=self.kahan and not comp, aps=self.aps and not comp)
      shard = jax.ShapeDtypeStruct(self.shard_shape(leaf, w), leaf.dtype)
      ag += sharded_wire_bytes(shard, w, collective="all_gather", fmt=leaf.param_wire)
    return {"reduce_scatter": int(rs), "all_gather": int(ag)}


def sharded_optimizer(optimizer, axis_name, params, *, grad_wire=None, param_wire=None,
                      rules=(), include=None, exclude=None, order: str = "ring",
                      aps: bool = False, kahan: bool = False, rounding: str = "nearest",
                      error_feedback: bool = False, mean: bool = True,
                      key=None) -> ShardedOptimizer:
  """An optax ``optimizer`` over parameters, gradients and optimizer state sharded on
  ``axis_name`` (FSDP / ZeRO), with a wire format per leaf for the gradient reduce-scatter
  and the parameter all-gather (the module docstring of :mod:`jaxlp.parallel._fsdp` has the
  layout and the semantics).

  Args:
    optimizer: an ``optax.GradientTransformation`` (elementwise for the replicated result).
    axis_name: the data axis (or tuple of axes, worker-major).
    params: the full parameters (arrays or ``jax.ShapeDtypeStruct``), for their shapes and
      paths.
    grad_wire: default gradient wire: None (float32), a jaxlp format, or a dense-quantizer /
      cast compressor.
    param_wire: default parameter all-gather format: None (exact) or a jaxlp format
      (elementwise or axis-blocked).
    rules: ``[(pattern, grad_wire), ...]`` or ``[(pattern, grad_wire, param_wire), ...]``:
      the first rule whose glob matches a leaf's path sets its wires (a 2-tuple keeps the
      default ``param_wire``).
    include: glob pattern(s) of the leaves that get the wires (None = all); the others
      travel in float32, exactly.
    exclude: glob pattern(s) of leaves that travel in float32.
    order: the reduce-scatter order of float32 and elementwise wires: ``"ring"``,
      ``"chain"``, ``"tree"``, ``"native"`` (per-hop rounding, psum's bits) or
      ``"all_to_all"`` (round once, float32 sum). Block formats and compressors always take
      the all-to-all.
    aps, kahan: psum's Auto Precision Scaling / compensated sum for per-hop leaves (refused
      when a leaf takes the all-to-all).
    rounding: ``"nearest"`` or ``"stochastic"`` (any mode the formats support) for format
      wires of the reduce-scatter; the parameter all-gather rounds to nearest.
    error_feedback: keep each worker's rounding error of the all-to-all format wires and add
      it to the next step's gradient.
    mean: divide each worker's gradient by W before the sum (the sum is the mean; CPD's
      convention, as :func:`jaxlp.parallel.reduce_gradients`); False: the sum.
    key: base PRNG key for stochastic rounding (default ``jax.random.key(0)``).

  Returns:
    A :class:`ShardedOptimizer` with ``shard``, ``init``, ``gather``, ``reduce``, ``update``
    (inside the workers' program) and ``stack_shards``, ``unstack_shards``, ``wire_bytes``
    (outside).

  Raises:
    TypeError: a wire that is not a jaxlp format or compressor (a block format without axis
      blocks); a pattern that is not a str; a malformed rule.
    ValueError: an unknown ``order`` or ``rounding``; a compressor that cannot run sharded
      (the message names the reason); ``aps`` / ``kahan`` with an all-to-all leaf; a
      pattern that matches no leaf (the message lists the paths).

  Example:
    Four workers (a named ``vmap``; ``jax.shard_map`` over devices runs the same code), SGD
    with momentum, gradients reduce-scattered in int4 blocks (qgZ) except the bias, the
    parameters gathered in MXINT8 (qwZ):

    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> params = {"b": jnp.zeros(3), "w": jnp.ones((8, 3))}
    >>> tx = P.sharded_optimizer(optax.sgd(0.1, momentum=0.9), "w", params,
    ...                          grad_wire=F.BlockFormat(3, axis=-1, block_size=32),
    ...                          param_wire=F.mx("int8"), exclude="b")
    >>> def loss(p, x):
    ...   return jnp.sum((x @ p["w"] + p["b"][None]) ** 2)
    >>> def step(shards, state, x):
    ...   full = tx.gather(shards)                    # all-gather (qwZ)
    ...   g = jax.grad(loss)(full, x)                 # this worker's gradient
    ...   upd, state = tx.update(g, state, shards)    # reduce-scatter (qgZ) + SGD on the shard
    ...   return optax.apply_updates(shards, upd), state
    >>> shards = tx.stack_shards(params, 4)          # worker o holds rows 2o, 2o+1 of w
    >>> shards["w"].shape, shards["b"].shape         # b (3 values) is flattened and padded
    ((4, 2, 3), (4, 1))
    >>> state = jax.vmap(tx.init, axis_name="w")(shards)
    >>> x = jnp.arange(32.0).reshape(4, 1, 8) / 32   # one sample per worker
    >>> run = jax.jit(jax.vmap(step, axis_name="w"))
    >>> shards, state = run(shards, state, x)
    >>> tx.unstack_shards(shards)["b"]
    Array([-0.77500004, -0.77500004, -0.77500004], dtype=float32)
    >>> tx.wire_bytes(4)   # per worker and step
    {'reduce_scatter': 31, 'all_gather': 36}
  """
  import optax  # noqa: F401  (the optimizer is an optax transformation)

  if order not in REDUCE_SCATTER_ORDERS:
    raise ValueError(f"{_WHO}: order must be one of {REDUCE_SCATTER_ORDERS}, got {order!r}")
  if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
    raise TypeError(f"{_WHO}: optimizer must be an optax.GradientTransformation, got "
                    f"{optimizer!r}")
  for name, v in (("aps", aps), ("kahan", kahan), ("error_feedback", error_feedback),
                  ("mean", mean)):
    if not isinstance(v, bool):
      raise TypeError(f"{_WHO}: {name} must be True or False, got {v!r}")
  if rounding not in ROUNDINGS:
    raise ValueError(f"{_WHO}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
  _check_grad_wire(grad_wire, rounding, "grad_wire")
  _check_param_wire(param_wire, "param_wire")
  if rounding == "stochastic" and key is not None and not isinstance(key, jax.Array):
    raise TypeError(f"{_WHO}: key must be a jax PRNG key, got {key!r}")
  inc, exc = _patterns(include, "include"), _patterns(exclude, "exclude")
  norm_rules = []
  for i, rule in enumerate(rules or ()):
    if not isinstance(rule, (tuple, list)) or len(rule) not in (2, 3) \
        or not isinstance(rule[0], str):
      raise TypeError(f"{_WHO}: rules[{i}]={rule!r} must be (pattern, grad_wire) or "
                      "(pattern, grad_wire, param_wire)")
    gw = rule[1]
    pw = rule[2] if len(rule) == 3 else param_wire
    _check_grad_wire(gw, rounding, f"rules[{i}] grad_wire")
    _check_param_wire(pw, f"rules[{i}] param_wire")
    norm_rules.append((rule[0], gw, pw))
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = []
  for path, x in flat:
    p = _path_str(path)
    sel = (inc is None or any(fnmatch.fnmatchcase(p, q) for q in inc)) and not (
        exc is not None and any(fnmatch.fnmatchcase(p, q) for q in exc))
    gw, pw = (grad_wire, param_wire) if sel else (None, None)
    if sel:
      for pat, rgw, rpw in norm_rules:
        if fnmatch.fnmatchcase(p, pat):
          gw, pw = rgw, rpw
          break
    dtype = jnp.dtype(getattr(x, "dtype", jnp.float32))
    leaves.append(_Leaf(p, tuple(int(d) for d in jnp.shape(x)), dtype, gw, pw))
  paths = [leaf.path for leaf in leaves]
  bad = [f"{name}={q!r}" for name, ps in (("include", inc), ("exclude", exc))
         for q in (ps or ()) if not any(fnmatch.fnmatchcase(x, q) for x in paths)]
  bad += [f"rules[{i}]={r[0]!r}" for i, r in enumerate(norm_rules)
          if not any(fnmatch.fnmatchcase(x, r[0]) for x in paths)]
  if bad:
    raise ValueError(f"{_WHO}: pattern {', '.join(bad)} matches no parameter (a glob on the "
                     f"whole '/'-joined path, case-sensitive); the paths are: {paths}")
  tx = ShardedOptimizer(optimizer, axis_name, tuple(leaves), treedef, order, aps, kahan,
                        rounding, error_feedback, mean, key)
  for leaf in leaves:
    if tx._compressed(leaf) and (aps or kahan):
      raise ValueError(f"{_WHO}: aps/kahan apply to per-hop sums; leaf {leaf.path!r} takes the "
                       f"all-to-all (grad_wire={leaf.grad_wire!r}, order={order!r})")
  return tx
