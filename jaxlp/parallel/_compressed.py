"""Compressed all-reduce: aggregation of compressed gradients over a named axis.

Works inside ``jax.vmap(..., axis_name=...)``, ``jax.shard_map`` and ``jax.pmap`` with the same
code; every worker ends with bit-identical results (every worker decodes the same payloads and
sums them in ascending rank order).

Algorithms (``algorithm=``):

* ``"sra"`` -- CGX scatter-reduce-allgather (torch_cgx ``scatter_reduce_allgather.cc``): the
  (fused) vector is cut into W equal chunks (the last one padded by repeating the last element);
  each worker encodes every chunk and sends chunk j to worker j (``all_to_all``); the owner adds
  the decoded peer chunks to its OWN UNQUANTIZED chunk in ascending rank order, re-encodes the
  reduced chunk (with its "server" residual for error-feedback compressors, as CaSync's
  ROOT_DECOMP_COMP task), and the encoded chunks are all-gathered and decoded by everyone:
  ``chunk r = Q(x_r + sum_{j != r} Q(x_j))``. CGX chunks layer-aware with 4-element alignment
  and polls peers in arrival order; jaxlp uses equal chunks and ascending rank order.
* ``"ring"`` -- CGX compressed ring (torch_cgx ``ring.cc``): the vector is cut into W chunks as
  for ``"sra"``; in W-1 reduce-scatter steps worker r encodes its partial sum of chunk
  ``r-1-s`` (its own unquantized data at step 0), sends it to ``r+1`` (``ppermute``) and adds the
  decoded partial sum of chunk ``r-2-s`` received from ``r-1`` to its own unquantized chunk.
  Chunk c thus collects ``x_{c+1}, x_{c+2}, ..., x_c`` with W-1 re-quantizations; the owner c
  encodes the final sum once more and that encoding is all-gathered unchanged (CGX forwards the
  compressed bytes around the ring), so every worker decodes the same bits. The worker
  residual of chunk j is used when this worker encodes chunk j; the server residual as in
  ``"sra"``.
* ``"allgather"`` -- every worker's payload is all-gathered, decoded and summed (rank order).
  Sparsifiers always use it (GRACE/HiPress). ``"auto"`` = ``"sra"`` for quantizers.
* PowerSGD uses its two all-reduces (P, then Q); ``cast`` to fp16/bf16 casts, divides by W in
  the narrow type (PyTorch's order) and sums in that type with a ring all-reduce
  (:func:`jaxlp.parallel.psum`, ``order="ring"``: each partial sum rounded to the type, as
  NCCL's ring in that dtype); narrower casts and
  formats without a native dtype all-gather their codes, sum the decoded values in fp32 in rank
  order and divide by W.

Filters (CGX ``should_compress_``): leaves with ``size < min_size`` or (``skip_vectors``)
``ndim <= 1`` are reduced in fp32 (divide-first mean). ``bucket_mb`` fuses the compressed leaves
(in tree order) into flat buckets of at most that many MB of fp32 before encoding. For
PowerSGD a bucket keeps one matrix per leaf but all-reduces the P's of the bucket in one fused
sum and the Q's in another (PyTorch ``powerSGD_hook``; the same bits as unfused, fewer
collectives); with ``batched=True`` the whole bucket is one zero-padded square matrix
(``batched_powerSGD_hook``), whose state lives in ``CompressionState.buckets``. Unlike PyTorch,
tensors that fail PowerSGD's compression test are reduced in fp32 without error feedback
(PyTorch's bucket-wide feedback gives them the residual ``local - mean``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp._util import cdiv
from jaxlp.parallel import _axes
from jaxlp.parallel.compressors._base import exact_div, numel


class CompressionState(NamedTuple):
  """State of :func:`compressed_allreduce`.

  Attributes:
    count: int32 step counter (drives the per-step noise key); optax's name. The old name
      ``step`` still reads it, with a ``DeprecationWarning``.
    key: legacy uint32[2] PRNG key; per step and worker keys are folded from it.
    leaves: one entry per gradient leaf (tree-flatten order): the compressor's state, or for
      dense quantizers ``{"worker": ..., "server": ...}`` (the server residual is used by
      ``"sra"``/``"ring"``; the owner uses its chunk of it).
    buckets: per-bucket states of ``PowerSGD(batched=True)`` with ``bucket_mb`` (one square
      matrix per bucket, as PyTorch's ``batched_powerSGD_hook``); empty otherwise.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> st = P.init_compression_state(P.compressors.cgx(bits=4), {"w": jnp.zeros((8, 4))})
    >>> st.count, st.leaves, st.buckets
    (Array(0, dtype=int32), ({'worker': (), 'server': ()},), ())
  """
  count: Any
  key: Any
  leaves: tuple
  buckets: tuple = ()

  @property
  def step(self):
    import warnings  # noqa: PLC0415

    warnings.warn("CompressionState.step is deprecated: use CompressionState.count",
                  DeprecationWarning, stacklevel=2)
    return self.count


def _is_dense(comp):
  return comp.kind == "quantizer"


def init_compression_state(compressor, params, *, seed: int = 0, bucket_mb: float | None = None,
                           min_size: int = 1024, skip_vectors: bool = True,
                           plan=None) -> CompressionState:
  """Initial state of ``compressed_allreduce`` for gradients shaped like ``params``.

  Args:
    compressor: a compressor from :mod:`jaxlp.parallel.compressors`.
    params: pytree of arrays (or ShapeDtypeStructs) shaped like the gradients.
    seed: seed of the noise key and of PowerSGD's initial Q (identical on every worker, as
      PyTorch's ``RandomState(0)``).
    bucket_mb, min_size, skip_vectors, plan: only for ``PowerSGD(batched=True)`` with
      ``bucket_mb``, whose state is per bucket: give the same values as to
      ``compressed_allreduce``. Ignored otherwise.

  Returns:
    A :class:`CompressionState`. Per-leaf state is allocated for every leaf, whatever the
    filters, so the same state works for any ``min_size``/``bucket_mb``/``algorithm`` (except
    batched PowerSGD with buckets, see above).

  Example:
    Top-k keeps an error-feedback residual per leaf (flat, one entry per element):

    >>> import jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> st = P.init_compression_state(P.compressors.topk(0.25), {"w": jnp.zeros((2, 3))})
    >>> st.leaves
    ({'residual': Array([0., 0., 0., 0., 0., 0.], dtype=float32)},)
  """
  leaves = jax.tree_util.tree_leaves(params)
  base = jax.random.PRNGKey(seed)
  bucket_states, bucketed = [], set()
  if getattr(compressor, "kind", "") == "lowrank" and compressor.batched and bucket_mb:
    for b, (grp, total) in enumerate(_batched_bucket_shapes(
        compressor, params, min_size=min_size, skip_vectors=skip_vectors, bucket_mb=bucket_mb,
        plan=plan)):
      bucket_states.append(compressor.init((total,), key=jax.random.fold_in(base, 2000003 + b)))
      bucketed.update(grp)
  states = []
  for i, leaf in enumerate(leaves):
    shape = tuple(leaf.shape)
    if i in bucketed:
      states.append({})
      continue
    st = compressor.init(shape, leaf.dtype, key=jax.random.fold_in(base, 1000003 + i))
    if _is_dense(compressor):
      st = {"worker": st, "server": compressor.init(shape, leaf.dtype)}
    states.append(st)
  return CompressionState(jnp.zeros((), jnp.int32), base, tuple(states), tuple(bucket_states))


def _bitwise(collective, a):
  """Run ``collective`` on ``a``'s bit pattern when ``a`` is a float type other than f16/f32:
  XLA:CPU widens bf16 collectives to f32 and fp8 ones to f16 (2-4x the bytes between
  processes); unsigned integers of the same width travel as they are. The bits are unchanged.
  """
  dt = jnp.dtype(a.dtype)
  if jnp.issubdtype(dt, jnp.floating) and dt not in (jnp.float16, jnp.float32) and \
      dt.itemsize in (1, 2):
    u = jnp.uint8 if dt.itemsize == 1 else jnp.uint16
    return lax.bitcast_convert_type(collective(lax.bitcast_convert_type(a, u)), dt)
  return collective(a)


def _tree_collective(collective, tree, axis_name):
  return jax.tree_util.tree_map(lambda a: _bitwise(lambda b: collective(b, axis_name), a), tree)


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

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.parallel import ordered_psum
    >>> jax.vmap(lambda v: ordered_psum(v, "w"), axis_name="w")(jnp.arange(4.0))
    Array([6., 6., 6., 6.], dtype=float32)
  """
  g = _bitwise(lambda a: _axes.all_gather(a, axis_name), x)
  if w is not None:
    import warnings  # noqa: PLC0415

    warnings.warn("ordered_psum(x, axis_name, w): w is deprecated (the axis size is read from "
                  "the axis)", DeprecationWarning, stacklevel=2)
    if int(w) != g.shape[0]:
      raise ValueError(f"ordered_psum: w={w} but axis {axis_name!r} has size {g.shape[0]}")
  acc = g[0]
  for j in range(1, g.shape[0]):
    acc = acc + g[j]
  return acc


def _split_state(st, k, c, n):
  """Flat elementwise state (length n) -> (k, c) rows (zero padded); scalars -> (k,)."""
  def f(a):
    if a.ndim == 0:
      return jnp.broadcast_to(a, (k,))
    return jnp.pad(a, (0, k * c - n)).reshape(k, c)
  return jax.tree_util.tree_map(f, st)


def _join_state(st, n):
  def f(a):
    if a.ndim == 1:
      return a[0]
    return a.reshape(-1)[:n]
  return jax.tree_util.tree_map(f, st)


def _pad_edge(x, m):
  return jnp.pad(x, (0, m - x.shape[0]), mode="edge") if m > x.shape[0] else x


def _encode_pieces(comp, x, st, key, k):
  """Encode ``x`` cut into ``k`` equal pieces (SeCoPa partitions)."""
  n = x.shape[0]
  c = cdiv(n, k)
  xs = _pad_edge(x, k * c).reshape(k, c)
  sts = _split_state(st, k, c, n)
  payload, sts = jax.vmap(comp.encode)(xs, sts, jax.random.split(key, k))
  return payload, _join_state(sts, n), c


def _allgather_reduce(comp, x, st, key, axis_name, w, parts=1):
  n = x.shape[0]
  if parts > 1 and comp.elementwise_state:
    payload, st, c = _encode_pieces(comp, x, st, key, parts)
    dec = lambda p: jax.vmap(lambda q: comp.decode(q, (c,)))(p).reshape(-1)[:n]  # noqa: E731
  else:
    payload, st = comp.encode(x, st, key)
    dec = lambda p: comp.decode(p, (n,))  # noqa: E731
  gathered = _tree_collective(_axes.all_gather, payload, axis_name)
  out = None
  for j in range(w):
    d = dec(jax.tree_util.tree_map(lambda a, j=j: a[j], gathered))
    out = d if out is None else out + d
  return out, st


def _sra_reduce(comp, x, st, key, axis_name, w, me):
  n = x.shape[0]
  c = cdiv(n, w)
  xs = _pad_edge(x, w * c).reshape(w, c)
  wst = _split_state(st["worker"], w, c, n)
  payload, wst = jax.vmap(comp.encode)(xs, wst, jax.random.split(key, w))
  recv = _tree_collective(_axes.all_to_all, payload, axis_name)
  dec = jax.vmap(lambda p: comp.decode(p, (c,)))(recv)
  acc = lax.dynamic_index_in_dim(xs, me, keepdims=False)
  for j in range(w):
    acc = acc + jnp.where(me == j, jnp.float32(0), dec[j])
  sst = _split_state(st["server"], w, c, n)
  mine = jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, me, keepdims=False), sst)
  p2, mine = comp.encode(acc, mine, jax.random.fold_in(key, 0x5EC0))
  sst = jax.tree_util.tree_map(
      lambda a, b: lax.dynamic_update_index_in_dim(a, b, me, 0), sst, mine)
  gathered = _tree_collective(_axes.all_gather, p2, axis_name)
  out = jax.vmap(lambda p: comp.decode(p, (c,)))(gathered).reshape(-1)[:n]
  return out, {"worker": _join_state(wst, n), "server": _join_state(sst, n)}


def _ring_reduce(comp, x, st, key, axis_name, w, me):
  """CGX compressed ring: W-1 re-quantizing reduce-scatter steps, then the owner's final
  encoding is all-gathered unchanged."""
  n = x.shape[0]
  c = cdiv(n, w)
  xs = _pad_edge(x, w * c).reshape(w, c)
  wst = _split_state(st["worker"], w, c, n)
  take = lambda tree, i: jax.tree_util.tree_map(  # noqa: E731
      lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
  put = lambda tree, v, i: jax.tree_util.tree_map(  # noqa: E731
      lambda a, b: lax.dynamic_update_index_in_dim(a, b, i, 0), tree, v)
  seg = (me - 1) % w
  acc = lax.dynamic_index_in_dim(xs, seg, keepdims=False)
  for s in range(w - 1):
    # send my partial sum of segment (me-1-s) to me+1; receive segment (me-2-s) from me-1
    payload, mine = comp.encode(acc, take(wst, seg), jax.random.fold_in(key, s))
    wst = put(wst, mine, seg)
    recv = _tree_collective(_axes.ring_shift, payload, axis_name)
    seg = (me - 2 - s) % w
    acc = lax.dynamic_index_in_dim(xs, seg, keepdims=False) + comp.decode(recv, (c,))
  # seg == me: the fully reduced segment; its encoding travels the ring unchanged
  sst = _split_state(st["server"], w, c, n)
  p2, mine = comp.encode(acc, take(sst, me), jax.random.fold_in(key, 0x5EC0))
  sst = put(sst, mine, me)
  gathered = _tree_collective(_axes.all_gather, p2, axis_name)
  out = jax.vmap(lambda p: comp.decode(p, (c,)))(gathered).reshape(-1)[:n]
  return out, {"worker": _join_state(wst, n), "server": _join_state(sst, n)}


def _cast_reduce(comp, x, axis_name, w, mean):
  if comp.native_dtype is not None and comp.bits >= 16:
    # PyTorch's fp16/bf16 hooks: cast, divide in the narrow type, all-reduce in that type
    # (every partial sum rounded to it). jaxlp.parallel.psum's ring: per-hop rounding,
    # 16-bit payloads, 2(W-1)/W x 2 bytes per element, the same bits in every mode.
    from jaxlp.parallel._psum import psum

    c = comp.round(x)  # float32 on the narrow grid (see Cast.round)
    if mean:
      c = comp.round(exact_div(c, w))
    return psum(c, axis_name, fmt=comp.format, order="ring").astype(jnp.float32)
  out, _ = _allgather_reduce(comp, x, (), None, axis_name, w)
  return exact_div(out, w) if mean else out


def _split_flat(flat, shapes):
  out, off = [], 0
  for shp in shapes:
    n = math.prod(shp)
    out.append(flat[off:off + n].reshape(shp))
    off += n
  return out


def _fused_psum(arrays, axis_name, w):
  """One rank-ordered sum for a list of arrays (concatenated: a fused all-reduce)."""
  if len(arrays) == 1:
    return [ordered_psum(arrays[0], axis_name)]
  flat = jnp.concatenate([jnp.ravel(a) for a in arrays])
  return _split_flat(ordered_psum(flat, axis_name), [a.shape for a in arrays])


def _powersgd_core(comp, mats, sts, keys, axis_name, w, mean):
  """PyTorch ``powerSGD_hook`` on a bucket of matrices: P's of all matrices all-reduced in one
  fused sum, then the Q's in another (and the plain mean before ``start_iter`` in one).

  Returns ``(approximations, new_states)``; the approximations are of the mean (or sum)."""
  from jaxlp.parallel.compressors._powersgd import outer_sum, thin_matmul

  ms = [m + st["error"].reshape(m.shape) if comp.error_feedback else m
        for m, st in zip(mats, sts, strict=True)]
  if comp.warm_start:
    qs = [comp_orth(st["q"]) for st in sts]
  else:
    qs = [comp_orth(jax.random.normal(k, st["q"].shape, jnp.float32))
          for st, k in zip(sts, keys, strict=True)]
  ps = _fused_psum([thin_matmul(m, q) for m, q in zip(ms, qs, strict=True)],
                   axis_name, w)
  ps = [comp_orth(p) for p in ps]
  qsum = _fused_psum([thin_matmul(m.T, p) for m, p in zip(ms, ps, strict=True)],
                     axis_name, w)
  outs, news = [], []
  for m, st, p, q in zip(ms, sts, ps, qsum, strict=True):
    qm = exact_div(q, w)
    approx_mean = outer_sum(p, qm)
    outs.append(approx_mean if mean else outer_sum(p, q))
    new = dict(st, q=qm, iter=st["iter"] + 1)
    if comp.error_feedback:
      new["error"] = (m - approx_mean).reshape(-1)
    news.append(new)
  if comp.start_iter > 0:
    vanilla = _fused_psum([exact_div(m, w) if mean else m for m in mats], axis_name, w)
    warm = sts[0]["iter"] < comp.start_iter
    outs = [jnp.where(warm, v, o) for v, o in zip(vanilla, outs, strict=True)]
    news = [jax.tree_util.tree_map(lambda a, b: jnp.where(warm, a, b),
                                   dict(st, iter=st["iter"] + 1), nw)
            for st, nw in zip(sts, news, strict=True)]
  return outs, news


def comp_orth(x):
  from jaxlp.parallel.compressors._powersgd import orthogonalize
  return orthogonalize(x)


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


def _lowrank_filter(compressor, leaves, min_size, skip_vectors, plan):
  """Indices of the leaves PowerSGD compresses."""
  todo = []
  for i, g in enumerate(leaves):
    ok = (bool(plan[i][0]) if plan is not None
          else numel(g.shape) >= min_size and not (skip_vectors and len(g.shape) <= 1))
    if ok and numel(g.shape) and compressor.matrix_shape(g.shape) is not None:
      todo.append(i)
  return todo


def _batched_bucket_shapes(compressor, params, *, min_size=1024, skip_vectors=True,
                           bucket_mb=None, plan=None):
  leaves = jax.tree_util.tree_leaves(params)
  todo = _lowrank_filter(compressor, leaves, min_size, skip_vectors, plan)
  sizes = [numel(g.shape) for g in leaves]
  return [(grp, sum(sizes[i] for i in grp)) for grp in _group_buckets(todo, sizes, bucket_mb)]


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
    key: optional PRNG key overriding ``state.key`` for this step.

  Returns:
    ``(reduced_tree, new_state)``; ``reduced_tree`` is identical on every worker.

  Raises:
    ValueError: an unknown ``algorithm``; ``"sra"``/``"ring"`` with a compressor that is not
      a dense quantizer; ``state`` or ``plan`` with a different number of leaves than
      ``tree``; batched PowerSGD with ``bucket_mb`` whose ``state`` was made without the
      same ``bucket_mb``/``min_size``/``skip_vectors`` (its bucket shapes differ).

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
    >>> out, new_st = jax.vmap(f, axis_name="w")(g)
    >>> out[0]
    Array([ 2.9  ,  5.675,  8.45 , 11.225], dtype=float32)
    >>> new_st.count
    Array([1, 1, 1, 1], dtype=int32)
  """
  if algorithm not in ("auto", "sra", "ring", "allgather"):
    raise ValueError(f"{algorithm=} must be 'auto', 'sra', 'ring' or 'allgather'")
  if algorithm in ("sra", "ring") and not _is_dense(compressor):
    raise ValueError(f"{algorithm=} needs a dense quantizer, got {type(compressor).__name__}")
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if len(leaves) != len(state.leaves):
    raise ValueError(f"state has {len(state.leaves)} leaves, tree has {len(leaves)}")
  if plan is not None and len(plan) != len(leaves):
    raise ValueError(f"plan has {len(plan)} entries, tree has {len(leaves)} leaves")
  w = _axes.axis_size(axis_name)
  me = _axes.axis_index(axis_name)
  base = state.key if key is None else key
  step_key = jax.random.fold_in(base, state.count)
  worker_key = jax.random.fold_in(step_key, me)
  use_sra = _is_dense(compressor) and algorithm in ("auto", "sra")

  out = [None] * len(leaves)
  new_states = list(state.leaves)
  todo = []
  for i, g in enumerate(leaves):
    if plan is not None:
      comp_ok, parts = bool(plan[i][0]), int(plan[i][1])
    else:
      comp_ok = numel(g.shape) >= min_size and not (skip_vectors and g.ndim <= 1)
      parts = 1
    if compressor.kind == "lowrank" and compressor.matrix_shape(g.shape) is None:
      comp_ok = False
    if not comp_ok or numel(g.shape) == 0:
      x = g.astype(jnp.float32)
      out[i] = ordered_psum(exact_div(x, w) if mean else x, axis_name).astype(g.dtype)
      continue
    todo.append((i, parts))

  if compressor.kind == "lowrank":
    sizes = [numel(g.shape) for g in leaves]
    groups = _group_buckets([i for i, _ in todo], sizes, bucket_mb if plan is None else None)
    if compressor.batched and bucket_mb and plan is None:
      want = [compressor.matrix_shape((sum(sizes[i] for i in grp),)) for grp in groups]
      have = [tuple(b["q"].shape) for b in state.buckets]
      if have != [(m, r) for _, m, r in want]:
        raise ValueError(
            "compressed_allreduce: PowerSGD(batched=True) with bucket_mb needs bucket states: "
            "create the state with init_compression_state(compressor, params, bucket_mb=..., "
            f"min_size=..., skip_vectors=...) using the same filters (state has {len(have)} "
            f"bucket(s) with Q shapes {have}, the filters give {[(m, r) for _, m, r in want]})")
      new_buckets = []
      for b, (grp, (n_, m_, _)) in enumerate(zip(groups, want, strict=True)):
        x = jnp.concatenate([jnp.ravel(leaves[i]).astype(jnp.float32) for i in grp])
        mat = jnp.pad(x, (0, n_ * m_ - x.shape[0])).reshape(n_, m_)
        (o,), (nb,) = _powersgd_core(compressor, [mat], [state.buckets[b]],
                                     [jax.random.fold_in(step_key, 2000003 + b)], axis_name, w,
                                     mean)
        new_buckets.append(nb)
        flat = o.reshape(-1)[:sum(sizes[i] for i in grp)]
        for i, r in zip(grp, _split_flat(flat, [leaves[i].shape for i in grp]), strict=True):
          out[i] = r.astype(leaves[i].dtype)
      return treedef.unflatten(out), state._replace(count=state.count + 1,
                                                    leaves=tuple(new_states),
                                                    buckets=tuple(new_buckets))
    for grp in groups:
      mats = [compressor.to_matrix(leaves[i].astype(jnp.float32), leaves[i].shape) for i in grp]
      outs, news = _powersgd_core(compressor, mats, [state.leaves[i] for i in grp],
                                  [jax.random.fold_in(step_key, i) for i in grp], axis_name, w,
                                  mean)
      for i, o, nw in zip(grp, outs, news, strict=True):
        out[i] = compressor.from_matrix(o, leaves[i].shape).astype(leaves[i].dtype)
        new_states[i] = nw
    return treedef.unflatten(out), state._replace(count=state.count + 1, leaves=tuple(new_states))

  if bucket_mb and plan is None:
    groups = _group_buckets([i for i, _ in todo], [numel(g.shape) for g in leaves], bucket_mb)
    parts_of = {i: 1 for i, _ in todo}
  else:
    groups = [[i] for i, _ in todo]
    parts_of = dict(todo)

  for gi, grp in enumerate(groups):
    sizes = [numel(leaves[i].shape) for i in grp]
    x = jnp.concatenate([jnp.ravel(leaves[i]).astype(jnp.float32) for i in grp])
    st = _fuse_states([state.leaves[i] for i in grp])
    k = jax.random.fold_in(worker_key, grp[0])
    if compressor.kind == "cast":
      r = _cast_reduce(compressor, x, axis_name, w, mean)
    else:
      if mean:
        x = exact_div(x, w)
      if use_sra:
        r, st = _sra_reduce(compressor, x, st, k, axis_name, w, me)
      elif _is_dense(compressor) and algorithm == "ring":
        r, st = _ring_reduce(compressor, x, st, k, axis_name, w, me)
      elif _is_dense(compressor):
        r, wst = _allgather_reduce(compressor, x, st["worker"], k, axis_name, w,
                                   parts_of[grp[0]])
        st = dict(st, worker=wst)
      else:
        r, st = _allgather_reduce(compressor, x, st, k, axis_name, w, parts_of[grp[0]])
    offs = 0
    split = _unfuse_states(st, sizes)
    for i, n, s in zip(grp, sizes, split, strict=True):
      out[i] = r[offs:offs + n].reshape(leaves[i].shape).astype(leaves[i].dtype)
      new_states[i] = s
      offs += n
    del gi
  return treedef.unflatten(out), state._replace(count=state.count + 1, leaves=tuple(new_states))


def _fuse_states(states):
  if len(states) == 1:
    return states[0]
  def f(*a):
    return a[0] if a[0].ndim == 0 else jnp.concatenate(a)
  return jax.tree_util.tree_map(f, *states)


def _unfuse_states(st, sizes):
  if len(sizes) == 1:
    return [st]
  res = []
  off = 0
  for n in sizes:
    res.append(jax.tree_util.tree_map(
        lambda a, off=off, n=n: a if a.ndim == 0 else a[off:off + n], st))
    off += n
  return res
