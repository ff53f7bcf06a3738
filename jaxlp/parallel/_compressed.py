"""The compressed-reduction engine: filters, buckets and dispatch to the compressor families.

Works inside ``jax.vmap(..., axis_name=...)``, ``jax.shard_map`` and ``jax.pmap`` with the same
code; every worker ends with bit-identical results (every worker decodes the same payloads and
sums them in ascending rank order).

The engine (:func:`compressed_allreduce`) does three things and nothing compressor-specific:

1. Filters (CGX ``should_compress_``): leaves with ``size < min_size``, (``skip_vectors``)
   ``ndim <= 1``, empty leaves and leaves the family refuses
   (:meth:`~jaxlp.parallel.compressors.Aggregation.compresses`, e.g. PowerSGD's compression
   test) are reduced in fp32 (divide-first mean, :func:`ordered_psum`). A ``plan`` (SeCoPa)
   replaces ``min_size``/``skip_vectors``.
2. Buckets: ``bucket_mb`` fuses the compressed leaves (in tree order) into buckets of at most
   that many MB of fp32 (not with a ``plan``; then every leaf is its own bucket with the
   plan's partitions).
3. Dispatches every bucket to the compressor's family, ``compressor.aggregation``
   (:mod:`jaxlp.parallel._aggregate`: dense quantizers' scatter-reduce-allgather / ring /
   all-gather, sparsifiers' all-gather, PowerSGD's two fused all-reduces, casts' ring in the
   narrow type), which owns its state and its byte count.

Non-finite values (one policy for every compressor; :func:`jaxlp.parallel.psum` and
:func:`jaxlp.parallel.reduce_gradients` without a compressor follow the same rule). The unit
is the leaf, or with ``bucket_mb`` the fused bucket (the leaves of a bucket share scales,
thresholds and chunks, so they are skipped together):

* If any worker's gradient holds a NaN or ±inf anywhere in a unit, or the unit's reduced
  result is not finite (a sum that overflows, e.g. ``mean=False`` with gradients near the
  float32 maximum), every element of every leaf of the unit is NaN, on every worker (the same
  bits), so that ``optax.apply_if_finite`` and ``jaxlp train``'s ``nonfinite_steps`` see the
  step, whatever the compressor would have made of the value (a NaN never selected by
  top-k, an inf sent as ``+threshold`` by TBQ, ...).
* The unit's state (error-feedback residuals of TBQ, top-k, random-k, DGC's momenta,
  GradDrop, 1-bit; PowerSGD's error, Q and iteration count; batched PowerSGD's bucket state)
  is then kept from the previous step on every worker: the bad step leaves no trace in it,
  and the next finite step gives what it would have given had the bad step never happened
  (with the next ``count``: the state's step counter, hence the noise key, still advances).
  A worker whose new state for a unit would not be finite (an error-feedback residual that
  overflows float32 although the result is finite) keeps its previous state for that unit.
* How the engine knows: every worker computes one flag per compressed unit (all of its
  gradient elements finite) and the flags are all-gathered, 8 per byte, in one collective per
  call: ``(W-1) * ceil(units / 8)`` bytes per worker and step, counted by
  :func:`compressed_wire_bytes`. The result is checked after the reduction, on values every
  worker holds. Leaves reduced in fp32 need no flag: their all-gather carries the values.
* Finite gradients give finite results wherever the true result is representable: the
  compressors compute their ranges, norms and means without overflow (CGX's ``max - min``,
  QSGD's and DGC's norms, 1-bit's means, TernGrad's ranges and statistics, the column norms
  of PowerSGD's orthogonalization), exactly as before wherever no overflow occurs; the mean
  divides by W before reducing. Formats that cannot hold a value make the unit NaN:
  ``cast("fp16")`` of gradients beyond 65504 (as PyTorch's fp16 hook, which gives inf), a sum
  beyond the float32 range with ``mean=False``, and PowerSGD, whose products ``M Q`` and
  ``M^T P`` (sums over a row or column, not divided by W) overflow for gradients near the
  float32 maximum.

:func:`compressed_wire_bytes` is the byte accounting of the same filters and buckets.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.parallel import _axes
from jaxlp.parallel._aggregate import fp32_bytes, gathered_sum
from jaxlp.parallel.compressors._base import exact_div, numel, pack_bits, unpack_bits
from jaxlp.parallel.compressors._protocol import Bucket, ReduceContext

ALGORITHMS = ("auto", "sra", "ring", "allgather")
_PRNG_IMPL = "threefry2x32"


class CompressionState(NamedTuple):
  """State of :func:`compressed_allreduce`.

  Attributes:
    count: int32 step counter (drives the per-step noise key); optax's name. The old name
      ``step`` still reads it, with a ``DeprecationWarning``.
    key: typed PRNG key (``jax.random.key(seed)``, threefry); per step and worker keys are
      folded from it. As a pytree the state holds the key's data (uint32[..., 2]): flattening
      gives ``jax.random.key_data(key)`` and unflattening wraps it back, so a state converts
      to numpy, pickles and reloads like any other array pytree (``jax.device_get`` included).
    leaves: one entry per gradient leaf (tree-flatten order): the family's per-leaf state
      (for dense quantizers ``{"worker": ..., "server": ...}``; the server residual is used by
      ``"sra"``/``"ring"``, the owner uses its chunk of it).
    buckets: per-bucket states of families that keep one per fused bucket
      (``powersgd(batched=True)`` with ``bucket_mb``: one square matrix per bucket, as
      PyTorch's ``batched_powerSGD_hook``); empty otherwise.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> st = P.init_compression_state(P.compressors.cgx(bits=4), {"w": jnp.zeros((8, 4))})
    >>> st.count, st.leaves, st.buckets
    (Array(0, dtype=int32), ({'worker': (), 'server': ()},), ())
    >>> jax.random.key_data(st.key)
    Array([0, 0], dtype=uint32)
  """
  count: Any
  key: Any
  leaves: tuple
  buckets: tuple = ()

  @property
  def step(self):
    warnings.warn("CompressionState.step is deprecated: use CompressionState.count",
                  DeprecationWarning, stacklevel=2)
    return self.count


def _is_typed_key(k) -> bool:
  return hasattr(k, "dtype") and jnp.issubdtype(k.dtype, jax.dtypes.prng_key)


def _is_key_data(k) -> bool:
  return (isinstance(k, (jax.Array, np.ndarray)) and not _is_typed_key(k)
          and k.dtype == np.uint32 and k.ndim >= 1 and k.shape[-1] == 2)


def _flatten_state(st):
  key = jax.random.key_data(st.key) if _is_typed_key(st.key) else st.key
  return (st.count, key, st.leaves, st.buckets), None


def _unflatten_state(aux, children):
  del aux
  count, key, leaves, buckets = children
  if _is_key_data(key):
    key = jax.random.wrap_key_data(key, impl=_PRNG_IMPL)
  return CompressionState(count, key, leaves, buckets)


jax.tree_util.register_pytree_node(CompressionState, _flatten_state, _unflatten_state)


def _typed_key(key, what):
  """A typed key; legacy uint32[2] keys are wrapped (threefry, the same bits) with a
  DeprecationWarning."""
  if _is_typed_key(key):
    return key
  if hasattr(key, "dtype") and jnp.dtype(key.dtype) == jnp.uint32 and key.shape[-1:] == (2,):
    warnings.warn(f"compressed_allreduce: {what} is a legacy uint32[2] PRNG key; pass a typed "
                  "key (jax.random.key(seed)); it is wrapped with jax.random.wrap_key_data",
                  DeprecationWarning, stacklevel=3)
    return jax.random.wrap_key_data(key, impl=_PRNG_IMPL)
  raise TypeError(f"compressed_allreduce: {what} must be a typed PRNG key "
                  f"(jax.random.key(seed)), got {key!r}")


def _aggregation(compressor):
  agg = getattr(compressor, "aggregation", None)
  if agg is None:
    raise TypeError(f"compressor {compressor!r} has no aggregation (use a compressor from "
                    "jaxlp.parallel.compressors or implement compressors.Compressor)")
  return agg


def _check_algorithm(compressor, agg, algorithm):
  if algorithm not in ALGORITHMS:
    raise ValueError(f"{algorithm=} must be 'auto', 'sra', 'ring' or 'allgather'")
  if algorithm not in agg.algorithms:
    raise ValueError(f"{algorithm=} needs a dense quantizer, got {type(compressor).__name__} "
                     f"(its family takes algorithm in {agg.algorithms})")


def _group_buckets(todo, sizes, bucket_mb):
  """Consecutive leaves (tree order) in buckets of at most ``bucket_mb`` MB of fp32."""
  if not bucket_mb:
    return [[i] for i in todo]
  limit = int(bucket_mb * 2 ** 20) // 4
  groups, cur, size = [], [], 0
  for i in todo:
    if cur and size + sizes[i] > limit:
      groups.append(cur)
      cur, size = [], 0
    cur.append(i)
    size += sizes[i]
  if cur:
    groups.append(cur)
  return groups


def _plan_buckets(compressor, agg, shapes, *, min_size, skip_vectors, bucket_mb, plan):
  """``(fp32 leaf numbers, buckets)``: the filters, then the buckets of the rest."""
  if plan is not None and len(plan) != len(shapes):
    raise ValueError(f"plan has {len(plan)} entries, tree has {len(shapes)} leaves")
  plain, todo, parts = [], [], {}
  for i, shp in enumerate(shapes):
    if plan is not None:
      ok, p = bool(plan[i][0]), int(plan[i][1])
    else:
      ok, p = numel(shp) >= min_size and not (skip_vectors and len(shp) <= 1), 1
    if ok and numel(shp) and agg.compresses(compressor, shp):
      todo.append(i)
      parts[i] = p
    else:
      plain.append(i)
  fused = bool(bucket_mb) and plan is None
  groups = _group_buckets(todo, [numel(s) for s in shapes], bucket_mb if fused else None)
  buckets = [Bucket(b, tuple(g), tuple(shapes[i] for i in g), 1 if fused else parts[g[0]],
                    fused) for b, g in enumerate(groups)]
  return plain, buckets


def init_compression_state(compressor, params, *, seed: int = 0, bucket_mb: float | None = None,
                           min_size: int = 1024, skip_vectors: bool = True,
                           plan=None) -> CompressionState:
  """Initial state of ``compressed_allreduce`` for gradients shaped like ``params``.

  Args:
    compressor: a compressor from :mod:`jaxlp.parallel.compressors`.
    params: pytree of arrays (or ShapeDtypeStructs) shaped like the gradients.
    seed: seed of the noise key (``jax.random.key(seed)``) and of PowerSGD's initial Q
      (identical on every worker, as PyTorch's ``RandomState(0)``).
    bucket_mb, min_size, skip_vectors, plan: only for families whose state is per bucket
      (``powersgd(batched=True)`` with ``bucket_mb``): give the same values as to
      ``compressed_allreduce``. Ignored otherwise.

  Returns:
    A :class:`CompressionState`. Per-leaf state is allocated for every leaf, whatever the
    filters, so the same state works for any ``min_size``/``bucket_mb``/``algorithm`` (except
    batched PowerSGD with buckets, see above).

  Raises:
    TypeError: ``compressor`` has no ``aggregation`` (not a compressor).
    ValueError: ``plan`` with a different number of entries than ``params`` has leaves.

  Example:
    Top-k keeps an error-feedback residual per leaf (flat, one entry per element):

    >>> import jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> st = P.init_compression_state(P.compressors.topk(0.25), {"w": jnp.zeros((2, 3))})
    >>> st.leaves
    ({'residual': Array([0., 0., 0., 0., 0., 0.], dtype=float32)},)
  """
  agg = _aggregation(compressor)
  leaves = jax.tree_util.tree_leaves(params)
  shapes = [tuple(leaf.shape) for leaf in leaves]
  base = jax.random.key(seed)
  _, buckets = _plan_buckets(compressor, agg, shapes, min_size=min_size,
                             skip_vectors=skip_vectors, bucket_mb=bucket_mb, plan=plan)
  bucket_states, bucketed = [], set()
  for b in buckets:
    bs = agg.init_bucket(compressor, b, jax.random.fold_in(base, 2000003 + b.index))
    bucket_states.append(bs)
    if bs is not None:
      bucketed.update(b.leaves)
  if all(bs is None for bs in bucket_states):
    bucket_states = []
  states = []
  for i, leaf in enumerate(leaves):
    if i in bucketed:
      states.append({})
      continue
    states.append(agg.init_leaf(compressor, shapes[i], leaf.dtype,
                                jax.random.fold_in(base, 1000003 + i)))
  return CompressionState(jnp.zeros((), jnp.int32), base, tuple(states), tuple(bucket_states))


def ordered_psum(x, axis_name, w=None):
  """Sum ``x`` over the named axis in ascending rank order, the same bits on every worker.

  An all-gather followed by sequential float adds in rank order, so the bits are the same
  under named ``vmap``, ``shard_map`` and ``pmap`` (``lax.psum``'s order differs between
  them). Narrow floats travel as their bit patterns.

  Args:
    x: an array (any float dtype) on each worker.
    axis_name: the named axis (or tuple of axes) to sum over.
    w: deprecated; the axis size is read from the axis.

  Returns:
    The sum, with ``x``'s shape and dtype, identical on every worker.

  Raises:
    ValueError: a deprecated ``w`` that differs from the axis size.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.parallel import ordered_psum
    >>> jax.vmap(lambda v: ordered_psum(v, "w"), axis_name="w")(jnp.arange(4.0))
    Array([6., 6., 6., 6.], dtype=float32)
  """
  if w is not None:
    warnings.warn("ordered_psum(x, axis_name, w): w is deprecated (the axis size is read from "
                  "the axis)", DeprecationWarning, stacklevel=2)
    if int(w) != _axes.axis_size(axis_name):
      raise ValueError(f"ordered_psum: w={w} but axis {axis_name!r} has size "
                       f"{_axes.axis_size(axis_name)}")
  return gathered_sum(x, axis_name)


def _bucket_states(compressor, agg, state, buckets):
  """The per-bucket states the family needs (None entries: none), checked against ``state``."""
  dummy = jax.random.key(0)
  want = [jax.eval_shape(lambda b=b: agg.init_bucket(compressor, b, dummy)) for b in buckets]
  if all(x is None for x in want):
    return [None] * len(buckets)
  shapes = lambda ts: [[tuple(a.shape) for a in jax.tree_util.tree_leaves(t)] for t in ts]  # noqa
  have = list(state.buckets)
  if len(have) != len(want) or shapes(have) != shapes(want):
    raise ValueError(
        f"compressed_allreduce: {type(compressor).__name__} with bucket_mb keeps one state per "
        "bucket and needs bucket states made with the same filters: create the state with "
        "init_compression_state(compressor, params, bucket_mb=..., min_size=..., "
        f"skip_vectors=...) (state has {len(have)} bucket state(s) shaped {shapes(have)}, the "
        f"filters give {shapes(want)})")
  return have


def _all_finite(tree):
  """True (a bool scalar) when every element of the float arrays of ``tree`` is finite."""
  flags = [jnp.all(jnp.isfinite(a)) for a in jax.tree_util.tree_leaves(tree)
           if jnp.issubdtype(jnp.result_type(a), jnp.inexact) and jnp.size(a)]
  out = jnp.bool_(True)
  for f in flags:
    out = out & f
  return out


def _finite_on_every_worker(flags, axis_name):
  """AND over the workers of one local bool flag per unit: the flags travel 8 per byte in
  one all-gather (:func:`flag_bytes` bytes per worker)."""
  n = flags.shape[0]
  packed = pack_bits(flags.astype(jnp.uint32), 1)
  gathered = _axes.all_gather(packed, axis_name)
  w = gathered.shape[0]
  bits = unpack_bits(gathered.reshape(-1), 1, w * packed.shape[0] * 8)
  return jnp.all(bits.reshape(w, -1)[:, :n] == 1, axis=0)


def flag_bytes(units: int, w: int) -> int:
  """Bytes one worker sends for the finite flags of ``units`` compressed units (leaves or
  fused buckets): an all-gather of ``ceil(units / 8)`` bytes."""
  return (w - 1) * ((units + 7) // 8)


def _select(pred, new, old):
  """``new`` where the bool scalar ``pred`` holds, else ``old`` (pytrees of one structure)."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


def _nan_unless(ok, x):
  return jnp.where(ok, x, jnp.asarray(jnp.nan, x.dtype))


class _Spec(str):
  """Text shown without quotes inside a container's repr."""

  def __repr__(self):
    return str(self)


def _describe(tree) -> str:
  """A pytree of arrays as text: ``{'residual': float32[6]}``."""
  def one(a):
    try:
      shape = tuple(jnp.shape(a))
      dt = jnp.dtype(a.dtype) if hasattr(a, "dtype") else jnp.result_type(a)
    except TypeError:
      return _Spec(type(a).__name__)
    name = "key" if jnp.issubdtype(dt, jax.dtypes.prng_key) else dt.name
    return _Spec(f"{name}[{','.join(map(str, shape))}]")
  try:
    return repr(jax.tree_util.tree_map(one, tree))
  except Exception:  # noqa: BLE001 -- only a description for an error message
    return type(tree).__name__


def _signature(tree):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  sig = []
  for a in leaves:
    try:
      dt = jnp.dtype(a.dtype) if hasattr(a, "dtype") else jnp.result_type(a)
    except TypeError:
      dt = type(a)
    sig.append((tuple(jnp.shape(a)), dt))
  return treedef, sig


_MADE_BY = ("make the state with init_compression_state(compressor, params) for the same "
            "compressor and gradients shaped like this tree")


def _check_state_type(state, n_leaves):
  if not isinstance(state, CompressionState):
    raise TypeError(f"compressed_allreduce: state must be the CompressionState that "
                    f"init_compression_state(compressor, params) returns, got "
                    f"{type(state).__name__} {_describe(state)}")
  if not isinstance(state.leaves, (tuple, list)) or len(state.leaves) != n_leaves:
    have = len(state.leaves) if isinstance(state.leaves, (tuple, list)) else state.leaves
    raise ValueError(f"compressed_allreduce: state.leaves has {have} per-leaf states, the "
                     f"gradient tree has {n_leaves} leaves; {_MADE_BY}")
  count = state.count
  if jnp.shape(count) != () or not jnp.issubdtype(jnp.result_type(count), jnp.integer):
    raise ValueError(f"compressed_allreduce: state.count must be an integer scalar (the step "
                     f"counter), got {_describe(count)}; {_MADE_BY}")


def _check_leaf_states(state, leaves, paths, compressor, init_opts):
  """The per-leaf states have the structure, shapes and dtypes ``init_compression_state``
  would build for this compressor and these gradients."""
  want = jax.eval_shape(lambda: init_compression_state(
      compressor, [jax.ShapeDtypeStruct(jnp.shape(g), jnp.result_type(g)) for g in leaves],
      **init_opts))
  name = type(compressor).__name__
  for i, (have, exp) in enumerate(zip(state.leaves, want.leaves, strict=True)):
    try:
      same = _signature(have) == _signature(exp)
    except Exception:  # noqa: BLE001 -- anything that is not a pytree of arrays differs
      same = False
    if not same:
      raise ValueError(
          f"compressed_allreduce: state.leaves[{i}], the state of gradient leaf {paths[i]} "
          f"(shape {tuple(jnp.shape(leaves[i]))}), does not match the compressor: {name} "
          f"needs {_describe(exp)}, the state holds {_describe(have)} (a state made for "
          f"another compressor or for other shapes?); {_MADE_BY}")


def compressed_allreduce(tree, state: CompressionState, axis_name, compressor, *,
                         min_size: int = 1024, skip_vectors: bool = True,
                         algorithm: str = "auto", bucket_mb: float | None = None,
                         mean: bool = True, plan=None, key=None):
  """Compressed sum (or mean) of a gradient pytree over ``axis_name``.

  Args:
    tree: pytree of float arrays (this worker's gradients).
    state: from :func:`init_compression_state` (per worker: residuals differ by worker).
    axis_name: the named axis (vmap/shard_map/pmap axis, or a tuple of names).
    compressor: a compressor from :mod:`jaxlp.parallel.compressors`.
    min_size: leaves with fewer elements are reduced in fp32 (CGX ``layer_min_size``).
    skip_vectors: reduce leaves with ``ndim <= 1`` (biases, norms) in fp32.
    algorithm: ``"auto"``, ``"sra"`` (scatter-reduce-allgather), ``"ring"`` (CGX compressed
      ring; both dense quantizers only) or ``"allgather"``.
    bucket_mb: fuse the compressed leaves into buckets of at most this many MB (fp32).
    mean: divide by W -- BEFORE compression (CGX hook) for quantizers/sparsifiers; cast then
      divide for ``cast``; Q only, for PowerSGD (PyTorch).
    plan: optional per-leaf decisions (e.g. :func:`jaxlp.parallel.secopa_plan` output):
      a sequence, in leaf order, of ``(compress: bool, partitions: int)``; overrides the
      ``min_size``/``skip_vectors`` filters. ``partitions > 1`` encodes the leaf in that many
      independent pieces (all-gather path).
    key: optional typed PRNG key (``jax.random.key``) overriding ``state.key`` for this step;
      a legacy uint32[2] key is accepted with a ``DeprecationWarning``.

  Returns:
    ``(reduced_tree, new_state)``; ``reduced_tree`` is identical on every worker. Non-finite
    values (module docstring): a leaf (with ``bucket_mb``: a fused bucket) in which any
    worker's gradient holds a NaN or ±inf, or whose reduced value is not finite, is NaN in
    every element on every worker, and its state is kept from the previous step; the flags
    that tell every worker cost one all-gather of ``ceil(units / 8)`` bytes per call.

  Raises:
    TypeError: ``state`` is not a :class:`CompressionState`; ``key`` is not a PRNG key;
      ``compressor`` is not a compressor.
    ValueError: an unknown ``algorithm``; ``"sra"``/``"ring"`` with a compressor that is not
      a dense quantizer; ``plan`` with a different number of leaves than ``tree``; a
      ``state`` that is not what ``init_compression_state(compressor, params)`` builds for
      these gradients (another number of leaves, a per-leaf state of another compressor or
      of other shapes or dtypes: the message names the leaf, what the compressor needs and
      what the state holds; a count that is not an integer scalar); batched PowerSGD with
      ``bucket_mb`` whose ``state`` was made without the same
      ``bucket_mb``/``min_size``/``skip_vectors`` (its bucket shapes differ).

  Example:
    Four workers (a named ``vmap``) average four values each with 2-bit CGX
    (scatter-reduce-allgather: each worker owns a chunk of one value, which a min/max bucket
    of one element sends exactly, so here the mean is exact):

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> c = P.compressors.cgx(bits=2, bucket_size=4)
    >>> st = P.init_compression_state(c, jnp.zeros(4))
    >>> g = jnp.array([[1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4],
    ...                [10.0, 20.0, 30.0, 40.0], [0.5, 0.5, 0.5, 0.5]])
    >>> f = lambda x: P.compressed_allreduce(x, st, "w", c, min_size=1, skip_vectors=False)
    >>> out, new_st = jax.jit(jax.vmap(f, axis_name="w"))(g)
    >>> out[0]
    Array([ 2.9  ,  5.675,  8.45 , 11.225], dtype=float32)
    >>> new_st.count
    Array([1, 1, 1, 1], dtype=int32)
  """
  agg = _aggregation(compressor)
  _check_algorithm(compressor, agg, algorithm)
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in flat]
  leaves = [g for _, g in flat]
  _check_state_type(state, len(leaves))
  shapes = [tuple(g.shape) for g in leaves]
  plain, buckets = _plan_buckets(compressor, agg, shapes, min_size=min_size,
                                 skip_vectors=skip_vectors, bucket_mb=bucket_mb, plan=plan)
  bstates = _bucket_states(compressor, agg, state, buckets)
  _check_leaf_states(state, leaves, paths, compressor,
                     dict(bucket_mb=bucket_mb, min_size=min_size, skip_vectors=skip_vectors,
                          plan=plan))
  base = _typed_key(state.key if key is None else key, "state.key" if key is None else "key")
  w = _axes.axis_size(axis_name)
  me = _axes.axis_index(axis_name)
  step_key = jax.random.fold_in(base, state.count)
  ctx = ReduceContext(axis_name, w, me, step_key, jax.random.fold_in(step_key, me), mean,
                      algorithm)

  out = [None] * len(leaves)
  new_states = list(state.leaves)
  for i in plain:
    x = leaves[i].astype(jnp.float32)
    r = gathered_sum(exact_div(x, w) if mean else x, axis_name)  # NaN/inf travel in the sum
    out[i] = _nan_unless(_all_finite(r), r).astype(leaves[i].dtype)
  if buckets:  # the non-finite policy (module docstring): one flag per bucket, all-gathered
    ok = _finite_on_every_worker(
        jnp.stack([_all_finite([leaves[i] for i in b.leaves]) for b in buckets]), axis_name)
  new_buckets = list(state.buckets)
  for b, bs in zip(buckets, bstates, strict=True):
    olds = [state.leaves[i] for i in b.leaves]
    outs, sts, nbs = agg.reduce(compressor, [leaves[i] for i in b.leaves], olds, bs, b, ctx)
    outs = [o.reshape(shapes[i]).astype(leaves[i].dtype)
            for i, o in zip(b.leaves, outs, strict=True)]
    good = ok[b.index] & _all_finite(outs)  # the same on every worker
    renew = good & _all_finite((sts, nbs))  # this worker's new state is finite
    for i, o, s, old in zip(b.leaves, outs, sts, olds, strict=True):
      out[i] = _nan_unless(good, o)
      new_states[i] = _select(renew, s, old)
    if bs is not None:
      new_buckets[b.index] = _select(renew, nbs, bs)
  return treedef.unflatten(out), state._replace(count=state.count + 1, leaves=tuple(new_states),
                                                buckets=tuple(new_buckets))


def compressed_wire_bytes(tree, compressor, axis_size: int, *, min_size: int = 1024,
                          skip_vectors: bool = True, algorithm: str = "auto",
                          bucket_mb: float | None = None, plan=None) -> int:
  """Bytes one worker sends per step in :func:`compressed_allreduce` with these options.

  The same filters and buckets as :func:`compressed_allreduce`; fp32 leaves are all-gathered
  (``(W-1) * 4`` bytes per element, :func:`ordered_psum`), every bucket counts what its
  family's collectives send (``compressor.aggregation.wire_bytes``): an all-gather of a
  P-byte payload sends ``(W-1)*P``, an all-to-all of W rows of P bytes ``(W-1)*P``, a ring
  hop P. So the CGX scatter-reduce-allgather of an n-element bucket sends
  ``2(W-1) * wire_bytes(ceil(n/W))``, a sparsifier ``(W-1) * wire_bytes(n)``, PowerSGD the
  fused P's and Q's (``(W-1) * 4 * (n+m) r`` per matrix), a bf16 cast
  :func:`jaxlp.parallel.payload_bytes` of its ring. The finite flags of the compressed units
  (leaves, or fused buckets) add one all-gather of ``ceil(units / 8)`` bytes: ``(W-1) *
  ceil(units / 8)`` (see the module docstring). Every step sends the same bytes.

  Args:
    tree: pytree of arrays or ShapeDtypeStructs shaped like the gradients.
    compressor: a compressor from :mod:`jaxlp.parallel.compressors`.
    axis_size: the number of workers W (0 bytes for W = 1).
    min_size, skip_vectors, algorithm, bucket_mb, plan: as in :func:`compressed_allreduce`.

  Returns:
    The number of bytes (an int).

  Raises:
    ValueError: an unknown ``algorithm`` or one the compressor's family does not take; a
      ``plan`` of the wrong length; ``axis_size < 1``.
    TypeError: ``compressor`` is not a compressor.

  Example:
    4-bit CGX over 4 workers: a 1024-element matrix in 4 chunks of 256 (128 B of levels
    + 8 B of min/unit each), sent twice by each worker to 3 peers; the vector in fp32; the
    matrix's finite flag (one byte to 3 peers):

    >>> import jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> params = {"w": jnp.zeros((32, 32)), "b": jnp.zeros(32)}
    >>> P.compressed_wire_bytes(params, P.compressors.cgx(bits=4, bucket_size=512), 4)
    1203
  """
  agg = _aggregation(compressor)
  _check_algorithm(compressor, agg, algorithm)
  w = int(axis_size)
  if w < 1:
    raise ValueError(f"compressed_wire_bytes: axis_size={axis_size} must be >= 1")
  shapes = [tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree)]
  plain, buckets = _plan_buckets(compressor, agg, shapes, min_size=min_size,
                                 skip_vectors=skip_vectors, bucket_mb=bucket_mb, plan=plan)
  total = sum(fp32_bytes(numel(shapes[i]), w) for i in plain)
  total += sum(agg.wire_bytes(compressor, b, w, algorithm) for b in buckets)
  total += flag_bytes(len(buckets), w) if buckets else 0
  return int(total)
