"""Compressed sharded reduction (ZeRO++ qgZ) with error feedback, and the sharded byte count.

:func:`compressed_reduce_scatter` is the gradient reduce-scatter of sharded data parallelism
with a compressed wire: per leaf, every worker cuts its gradient into W slabs (as
:func:`jaxlp.parallel.reduce_scatter`), optionally divides by W (``mean``, exact division) and
adds its error-feedback residual, compresses each slab ONCE, sends slab ``o`` to worker ``o``
(one ``all_to_all``), and worker ``o`` decodes the W slabs and sums them in float32 in
ascending rank order (qgZ: quantize once, all-to-all, dequantize, sum in fp32; there is no
re-quantization of partial sums and no second collective). The leaves travel together: ONE
``all_to_all`` per call carries every leaf's payload (each leaf's code and scale bytes for
worker ``o``, leaf after leaf, concatenated into one uint8 row per destination; each
collective is a rendezvous of every worker, whose fixed cost -- milliseconds between
processes -- outweighs the bytes of small leaves), and one ``pmax`` the non-finite flags of
all leaves. The encoding, the bytes and the sum of every leaf are those of a call on that leaf
alone; :func:`jaxlp.parallel.sharded_optimizer` sends all its compressed leaves this way too.

``wire`` is either

* a jaxlp format: an elementwise one (packed 8/16-bit words) or an axis-blocked block format
  -- ``mx(E4M3FN)``, ``mx(E2M1FN)``, ``mx("int8")``, ``BlockFormat(7 or 3, axis=-1,
  block_size=b)`` (int8 / int4 blocks with a power-of-two scale). The rounding is exactly
  :func:`~jaxlp.parallel.reduce_scatter`'s ``order="all_to_all"`` (the same noise words, with
  the step key ``fold_in(state.key, state.count)``), so without error feedback and ``mean``
  the result equals ``reduce_scatter(x, axis, fmt=wire, order="all_to_all", key=step key)``
  bit for bit for finite gradients (non-finite ones: below). With error feedback the
  residual is ``e = x' - Q(x')`` (IEEE float32), where ``x' = x (/ W) + e_prev`` is what was
  rounded.
* a compressor of :mod:`jaxlp.parallel.compressors` whose encoding of one slab does not need
  the others: the dense quantizers (``cgx``, ``qsgd``, ``onebit``, ``tbq``, ``terngrad``) and
  ``cast``. Each slab is encoded with ``compressor.encode`` (its own state, e.g. 1-bit's
  error feedback, on the slab's part of the flat state; per-slab keys
  ``split(fold_in(fold_in(step key, worker), leaf), W)``). Sparsifiers and PowerSGD are
  refused (:func:`sharded_support`): their selection / factorisation needs the whole leaf.

Non-finite values follow :func:`jaxlp.parallel.psum`'s policy (with the leaf as the unit,
for format wires and compressors alike): if any worker's gradient holds a NaN or ±inf in a
leaf, or any worker's reduced slab of it is not finite (an overflowing sum), the leaf is NaN
in every slab on every worker, and its state (error-feedback residual, a compressor's state)
is kept from the previous step, so the next finite step gives what it would have given
without the bad one (``count`` still advances). A worker whose new state alone is not finite
keeps its previous one. One int32 flag per leaf is max-reduced over the workers (as in
:func:`jaxlp.parallel.reduce_scatter` with elementwise formats; not counted by
:func:`sharded_wire_bytes`). Unlike :func:`~jaxlp.parallel.reduce_scatter` with a block
format, which NaNs only the non-finite blocks, here a block wire NaNs the whole leaf.

The parameter all-gather (qwZ) is :func:`jaxlp.parallel.all_gather` with ``fmt=`` a block
format. :func:`sharded_wire_bytes` counts the bytes of both collectives with the all-reduce
engine's conventions (:func:`jaxlp.parallel.compressed_wire_bytes`): an all-gather of P bytes
sends ``(W-1)*P`` per worker, an all-to-all of W rows of P bytes ``(W-1)*P``, a ring hop P.

References:
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
  Training", arXiv:2306.10209 (qwZ, qgZ). Megatron-Core's distributed optimizer
  (reduce-scatter with fp32 accumulation).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlp.formats._quantize import FORMAT_TYPES, check_format, is_elementwise
from jaxlp.parallel import _axes
from jaxlp.parallel._aggregate import (
  CASTS,
  DENSE_QUANTIZERS,
  LOW_RANK,
  SPARSIFIERS,
  _join_state,
  _split_state,
)
from jaxlp.parallel._arith import add_f32, sub_f32
from jaxlp.parallel._codec import codec_for
from jaxlp.parallel._psum import _FLOAT_DTYPES, TAG_PRE, _Rounder
from jaxlp.parallel._sharded import (
  REDUCE_SCATTER_ORDERS,
  _BlockWire,
  _iota,
  _row_format,
  _scatter_dim,
  _slab_rows,
  _slab_shape,
  _unslab,
  _wire,
  fused_collective,
  rank_sum,
)
from jaxlp.parallel.compressors._base import exact_div, numel

_REFUSED = {
    "TopK": "top-k selects the k largest entries of the whole leaf (a global selection); "
            "per slab it would be a different compressor",
    "RandomK": "random-k samples k indices of the whole leaf and sends (index, value) pairs "
               "by all-gather; per slab it would be a different compressor",
    "DGC": "DGC's threshold is sampled from the whole leaf (a global top-k estimate) and its "
           "momentum correction is per leaf",
    "GradDrop": "GradDrop's drop threshold is estimated from the whole leaf",
    "PowerSGD": "PowerSGD factorises the whole gradient matrix (P = M Q needs every row) and "
                "all-reduces its low-rank factors; there is nothing to scatter",
}


def sharded_support(compressor) -> tuple:
  """Whether ``compressor`` can run in :func:`compressed_reduce_scatter`, and why not.

  Args:
    compressor: a compressor of :mod:`jaxlp.parallel.compressors` (or a jaxlp format, which
      always can).

  Returns:
    ``(True, "")`` or ``(False, reason)``.

  Raises:
    TypeError: ``compressor`` is neither a compressor nor a jaxlp format.

  Example:
    >>> from jaxlp import parallel as P
    >>> P.sharded_support(P.compressors.cgx(bits=4))
    (True, '')
    >>> ok, why = P.sharded_support(P.compressors.powersgd(2))
    >>> ok, why.split(" (")[0]
    (False, 'PowerSGD factorises the whole gradient matrix')
  """
  if isinstance(compressor, FORMAT_TYPES):
    return True, ""
  agg = getattr(compressor, "aggregation", None)
  if agg is None:
    raise TypeError(f"sharded: wire must be a jaxlp format or a compressor of "
                    f"jaxlp.parallel.compressors, got {compressor!r}")
  if agg is DENSE_QUANTIZERS or agg is CASTS:
    return True, ""
  name = type(compressor).__name__
  if agg is SPARSIFIERS or agg is LOW_RANK:
    return False, _REFUSED.get(name, "its aggregation needs the whole leaf")
  return False, (f"{name}'s aggregation {type(agg).__name__} is not a dense quantizer or cast "
                 "(only those encode each slab on its own)")


def _check_wire(wire, who):
  if wire is None:
    raise TypeError(f"{who}: wire must be a jaxlp format or a compressor (None: use "
                    "jaxlp.parallel.reduce_scatter for float32)")
  ok, why = sharded_support(wire)
  if not ok:
    raise ValueError(f"{who}: {type(wire).__name__} cannot run sharded: {why}. Use a dense "
                     "quantizer (cgx, qsgd, onebit, tbq, terngrad), cast, or a jaxlp format "
                     "(e.g. jaxlp.formats.mx(jaxlp.formats.E2M1FN))")
  if isinstance(wire, FORMAT_TYPES):
    check_format(wire)
    if not is_elementwise(wire):
      _row_format(wire, who)


class ShardedState(NamedTuple):
  """State of :func:`compressed_reduce_scatter`.

  Attributes:
    count: int32 step counter (drives the step's noise key).
    key: typed PRNG key; the step key is ``fold_in(key, count)``.
    leaves: one entry per gradient leaf (tree-flatten order): ``{}`` (no state),
      ``{"residual": float32 array of the leaf's shape}`` (a format wire with error feedback)
      or the compressor's state for the flat leaf (its flat arrays in the C order of the leaf
      with the scatter dimension moved first; the leaf's own order for dimension 0).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> st = P.init_sharded_state(F.mx(F.E4M3FN), {"w": jnp.zeros((4, 2))},
    ...                           error_feedback=True)
    >>> st.leaves[0]["residual"].shape
    (4, 2)
  """
  count: Any
  key: Any
  leaves: tuple


def init_sharded_state(wire, params, *, error_feedback: bool = False,
                       seed: int = 0) -> ShardedState:
  """Initial state of :func:`compressed_reduce_scatter` for gradients shaped like ``params``.

  Args:
    wire: the wire format or compressor (as given to :func:`compressed_reduce_scatter`).
    params: pytree of arrays (or ShapeDtypeStructs) shaped like one worker's gradients.
    error_feedback: keep a residual per leaf (format wires; compressors keep what their own
      ``init`` returns, e.g. 1-bit's error feedback).
    seed: seed of the noise key (``jax.random.key(seed)``) and of the compressors' init.

  Returns:
    A :class:`ShardedState` (residuals are zeros).

  Raises:
    TypeError: ``wire`` is not a jaxlp format or compressor, or a block format without axis
      blocks.
    ValueError: a compressor that cannot run sharded (:func:`sharded_support`), or
      ``error_feedback=True`` with a compressor (its own state decides).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> st = P.init_sharded_state(P.compressors.onebit(), {"w": jnp.zeros(8)})
    >>> st.count, sorted(st.leaves[0])
    (Array(0, dtype=int32), ['residual'])
  """
  _check_wire(wire, "init_sharded_state")
  is_fmt = isinstance(wire, FORMAT_TYPES)
  if error_feedback and not is_fmt:
    raise ValueError("init_sharded_state: error_feedback=True is for format wires; a "
                     f"compressor keeps its own state ({type(wire).__name__}.init)")
  base = jax.random.key(seed)
  leaves = []
  for i, leaf in enumerate(jax.tree_util.tree_leaves(params)):
    shape = tuple(leaf.shape)
    if is_fmt:
      leaves.append({"residual": jnp.zeros(shape, jnp.float32)} if error_feedback else {})
    else:
      leaves.append(wire.init((numel(shape),), jnp.float32,
                              key=jax.random.fold_in(base, 1000003 + i)))
  return ShardedState(jnp.zeros((), jnp.int32), base, tuple(leaves))


def compressed_reduce_scatter(tree, state: ShardedState, axis_name, wire, *,
                              scatter_dimension: int = 0, mean: bool = False,
                              rounding: str = "nearest", tiled: bool = True,
                              pack: bool = True, key=None):
  """Compressed gradient reduce-scatter (qgZ): quantize once, all-to-all, float32 sum.

  Args:
    tree: pytree of float32/float16/bfloat16 arrays (this worker's gradients).
    state: from :func:`init_sharded_state` (per worker).
    axis_name: a named axis of pmap / shard_map / vmap, or a tuple of them (worker-major).
    wire: a jaxlp format (elementwise, ``mx(...)``, ``BlockFormat(..., axis=-1,
      block_size=...)``) or a dense-quantizer / cast compressor (module docstring).
    scatter_dimension: the dimension cut into W slabs (size a multiple of W).
    mean: divide every worker's gradient by W (exact division) before compressing, so the
      sum is the mean.
    rounding: rounding mode of a format wire (``"stochastic"`` draws from the step key).
    tiled: keep the scatter dimension (size/W); ``False`` needs size W and removes it.
    pack: send an elementwise format's values as packed 8/16-bit words when they fit.
    key: optional typed PRNG key overriding ``state.key`` for this step.

  Returns:
    ``(slabs, new_state)``: ``slabs`` as :func:`jaxlp.parallel.reduce_scatter` returns them
    (each leaf's dtype), ``new_state`` with ``count + 1`` and the new residuals / states.
    A leaf with a NaN or ±inf on any worker (or a non-finite sum) is NaN in every slab and
    keeps its previous state (module docstring).

  Raises:
    TypeError: ``wire`` is not a format or compressor; a leaf that is not
      float32/float16/bfloat16.
    ValueError: a compressor that cannot run sharded (the message names the reason); a state
      with a different number of leaves; the scatter dimension errors of ``reduce_scatter``;
      an unknown ``rounding``.

  Example:
    Four workers (a named ``vmap``) reduce-scatter 8 gradients each in MXFP4 (E2M1 elements,
    one E8M0 scale per 4 values) with error feedback; each gets 2 values of the mean
    (exactly ``1.5, 1.625, ..., 2.375``; 4-bit elements are coarse):

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> wire = F.mx(F.E2M1FN, block_size=4)
    >>> g = jnp.arange(32.0).reshape(4, 8) / 8
    >>> st = P.init_sharded_state(wire, jnp.zeros(8), error_feedback=True)
    >>> f = lambda x, s: P.compressed_reduce_scatter(x, s, "w", wire, mean=True)
    >>> out, st2 = jax.jit(jax.vmap(f, axis_name="w", in_axes=(0, None)))(g, st)
    >>> out.reshape(-1)
    Array([1.5    , 1.53125, 1.5625 , 1.71875, 1.75   , 2.     , 2.0625 ,
           2.0625 ], dtype=float32)
    >>> st2.leaves[0]["residual"][1]  # worker 1's rounding errors, fed back next step
    Array([ 0.     ,  0.03125,  0.0625 , -0.03125,  0.     ,  0.03125,
            0.0625 ,  0.09375], dtype=float32)
  """
  jobs, finish = compressed_jobs(tree, state, axis_name, wire, scatter_dimension=scatter_dimension,
                                 mean=mean, rounding=rounding, tiled=tiled, pack=pack, key=key)
  w = _axes.axis_size(axis_name)
  return finish(*reduce_scatter_jobs(jobs, axis_name, w, _axes.axis_index(axis_name)))


def compressed_jobs(tree, state, axis_name, wire, *, scatter_dimension=0, mean=False,
                    rounding="nearest", tiled=True, pack=True, key=None):
  """The checks of :func:`compressed_reduce_scatter` and its leaves as :class:`_Job` s:
  ``(jobs, finish)``; ``finish(*reduce_scatter_jobs(jobs, ...))`` is its result. Jobs of
  several calls may run in one :func:`reduce_scatter_jobs` (one all-to-all for all)."""
  who = "compressed_reduce_scatter"
  _check_wire(wire, who)
  is_fmt = isinstance(wire, FORMAT_TYPES)
  if is_fmt:
    check_format(wire, rounding)
  elif rounding != "nearest":
    raise ValueError(f"{who}: rounding={rounding!r} is for format wires; a compressor rounds "
                     "its own way")
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if len(leaves) != len(state.leaves):
    raise ValueError(f"{who}: state has {len(state.leaves)} leaves, tree has {len(leaves)} "
                     "(make it with init_sharded_state(wire, params))")
  w = _axes.axis_size(axis_name)
  step_key = jax.random.fold_in(state.key if key is None else key, state.count)
  fmt = wire
  if is_fmt and not is_elementwise(wire):
    fmt = _row_format(wire, who)
  jobs = [_job(who, leaf, st, l, w, wire, fmt, rounding, step_key, scatter_dimension, mean,
               tiled, pack)
          for l, (leaf, st) in enumerate(zip(leaves, state.leaves, strict=True))]

  def finish(out, news):
    return (jax.tree_util.tree_unflatten(treedef, out),
            state._replace(count=state.count + 1, leaves=tuple(news)))

  return jobs, finish


class _Job(NamedTuple):
  """One leaf of a compressed reduce-scatter: its float32 values (flat, ``/ W`` with
  ``mean``), layout, state entry and wire."""
  x: Any
  shape: tuple
  d: int
  dtype: Any
  st: Any
  wire: Any  # the format (rows along the last axis for a block format) or the compressor
  is_fmt: bool
  rounding: str
  step_key: Any
  l: int
  pack: bool
  tiled: bool


def _job(who, leaf, st, l, w, wire, fmt, rounding, step_key, scatter_dimension, mean, tiled,
         pack):
  leaf = jnp.asarray(leaf)
  if leaf.dtype not in _FLOAT_DTYPES:
    raise TypeError(f"{who}: leaves must be float32/float16/bfloat16, got leaf {l} of "
                    f"dtype={leaf.dtype}")
  shape = leaf.shape
  d = _scatter_dim(who, l, shape, scatter_dimension, w, tiled)
  x = leaf.astype(jnp.float32).reshape(-1)
  if mean:
    x = exact_div(x, w)
  is_fmt = isinstance(wire, FORMAT_TYPES)
  return _Job(x, shape, d, leaf.dtype, st, fmt if is_fmt else wire, is_fmt, rounding, step_key,
              l, pack, tiled)


def reduce_scatter_jobs(jobs, axis_name, w, me):
  """Run the compressed reduce-scatter of several leaves (:class:`_Job`) with ONE all-to-all:
  each leaf is encoded as on its own, the payloads of all leaves (their bytes, per
  destination row) are concatenated into one uint8 buffer (:func:`fused_collective`), and
  each leaf is decoded and summed from its part; the non-finite flags of all leaves are
  max-reduced in one ``pmax`` of a vector. The bits of every leaf are those of one call per
  leaf. Returns (slabs, new states), one each per job."""
  enc = [None if j.x.size == 0 else _encode_job(j, w, me) for j in jobs]
  sent = [e[0] for e in enc if e is not None]
  recv = iter(fused_collective(lambda b: _axes.all_to_all(b, axis_name), sent, 1) if sent
              else [])
  done = []
  for j, e in zip(jobs, enc, strict=True):
    done.append(None if e is None else _finish_job(j, next(recv), e[1], w))
  flags = [jnp.bool_(False) if r is None else
           (jnp.any(~jnp.isfinite(j.x)) if r[2] is None else r[2]) | jnp.any(~jnp.isfinite(r[0]))
           for j, r in zip(jobs, done, strict=True)]
  if any(r is not None for r in done):
    bads = _axes.pmax(jnp.stack(flags).astype(jnp.int32), axis_name) > 0
  out, news = [], []
  for i, (j, r) in enumerate(zip(jobs, done, strict=True)):
    if r is None:
      res, new = j.x, j.st
    else:
      res, new = _nonfinite_policy(r[0], j.st, r[1], bads[i])
    out.append(_slab_shape(res, j.shape, j.d, w, j.tiled).astype(j.dtype))
    news.append(new)
  return out, news


def _nonfinite_policy(res, old, new, bad):
  """psum's non-finite policy for one leaf, given ``bad``: whether any worker's gradient holds
  a NaN or ±inf in the leaf or any worker's reduced slab of it is not finite (one int32 flag
  per leaf max-reduced over the workers, as :func:`jaxlp.parallel.reduce_scatter`'s
  elementwise formats do; :func:`reduce_scatter_jobs` reduces the flags of all leaves at
  once). Then the leaf is NaN in every slab and its state stays ``old`` on every worker. A
  worker whose new state alone is not finite (an overflowing residual) keeps its old one."""
  res = jnp.where(bad, jnp.float32(jnp.nan), res)
  renew = ~bad & _all_finite(new)
  return res, jax.tree_util.tree_map(lambda a, b: _where(renew, a, b), new, old)


def _all_finite(tree):
  ok = jnp.bool_(True)
  for a in jax.tree_util.tree_leaves(tree):
    if jnp.issubdtype(jnp.result_type(a), jnp.inexact) and jnp.size(a):
      ok = ok & jnp.all(jnp.isfinite(a))
  return ok


def _where(pred, a, b):
  if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(a)
    return jax.random.wrap_key_data(
        jnp.where(pred, jax.random.key_data(a), jax.random.key_data(b)), impl=impl)
  return jnp.where(pred, a, b)


def _encode_job(j, w, me):
  """(payload rows, context) of one leaf: what it sends to every worker (row o to worker o)."""
  if j.is_fmt:
    return _encode_format(j.x, j.st, j.shape, j.d, w, me, j.wire, j.rounding, j.step_key, j.l,
                          j.pack)
  return _encode_compressor(j.x, j.st, j.shape, j.d, w, me, j.wire, j.step_key, j.l)


def _finish_job(j, recv, ctx, w):
  """(reduced slab, new state, x_bad or None) of one leaf from the rows it received."""
  if j.is_fmt:
    wire, rows, qr, x_bad = ctx
    m = rows.shape[1]
    res = rank_sum(jax.vmap(lambda p: wire.decode(p, m))(recv))
    new = j.st
    if qr is not None:
      new = {"residual": _unslab(sub_f32(rows, qr), j.shape, j.d, w).reshape(j.shape)}
    return res, new, x_bad
  sts, m, n = ctx
  dec = jax.vmap(lambda p: j.wire.decode(p, (m,)))(recv)
  return rank_sum(dec), _join_state(sts, n), None


def _encode_format(x, st, shape, d, w, me, fmt, rounding, step_key, l, pack):
  ef = "residual" in st
  if ef:
    x = add_f32(x, st["residual"].astype(jnp.float32).reshape(-1))
  rows = _slab_rows(x, shape, d, w)
  wire = _wire(fmt, pack, "compressed_reduce_scatter")
  x_bad = qr = None
  if not ef and rounding == "nearest" and isinstance(wire, _BlockWire):
    # the codes of Q(rows) straight from the rows (the same bits, no rounded copy)
    payload = jax.vmap(wire.encode_nearest)(rows)
    if not wire.is_mx:  # a block of x holds a NaN or inf iff its scale is the NaN marker
      x_bad = jnp.any(payload["scales"] == jnp.int16(-32768))
  else:
    q = _Rounder(fmt, rounding, step_key if rounding == "stochastic" else None, l)
    qr = q(rows, _slab_rows(_iota(x.size), shape, d, w), me, TAG_PRE)
    payload = jax.vmap(wire.encode)(qr, rows)
  return payload, (wire, rows, qr if ef else None, x_bad)


def _encode_compressor(x, st, shape, d, w, me, comp, step_key, l):
  n = x.size
  m = n // w
  rows = _slab_rows(x, shape, d, w)
  sts = _split_state(st, w, m, n)
  keys = jax.random.split(jax.random.fold_in(jax.random.fold_in(step_key, me), l), w)
  payload, sts = jax.vmap(comp.encode)(rows, sts, keys)
  return payload, (sts, m, n)


def sharded_wire_bytes(tree, axis_size: int, *, collective: str = "reduce_scatter", fmt=None,
                       order: str = "ring", kahan: bool = False, aps: bool = False,
                       pack: bool = True, scatter_dimension: int = 0) -> int:
  """Bytes one worker sends in one sharded collective of ``tree`` (the engine's conventions).

  ``collective="reduce_scatter"`` (``tree`` shaped like the full leaves; slab size
  ``m = size/W``, word size ``b`` of ``fmt`` on the wire: 1/2 packed, else 4):

  * ``"ring"``: ``(W-1)`` hops of ``m`` words (two with ``kahan``) + the finished chunk to its
    owner: one hop of ``m`` words when dimension 0 is scattered (or the dimensions before it
    have size 1), else the all-gather of the chunks, ``(W-1) m`` words;
  * ``"chain"`` / ``"tree"``: an all-to-all of the slabs, ``(W-1) m`` float32 (words with
    ``aps``);
  * ``"native"``: the backend's float32 ring reduce-scatter, ``(W-1) m * 4``;
  * ``"all_to_all"`` (also what :func:`compressed_reduce_scatter` sends): ``(W-1)`` times one
    slab's payload: :func:`wire_payload_bytes` of ``fmt``, or ``compressor.wire_bytes((m,))``
    when ``fmt`` is a compressor.

  ``collective="all_gather"`` (``tree`` = this worker's shards): ``(W-1)`` times the shard's
  payload: its own bytes with ``fmt=None``, else the wire format's (rows along a block
  format's axis).

  Args:
    tree: pytree of arrays or ShapeDtypeStructs.
    axis_size: the number of workers W (0 bytes for W = 1).
    collective: ``"reduce_scatter"`` or ``"all_gather"``.
    fmt: ``None`` (float32 / the shard's dtype), a jaxlp format, or (``"all_to_all"``) a
      compressor.
    order, kahan, aps, pack, scatter_dimension: as in :func:`jaxlp.parallel.reduce_scatter`
      (``order`` etc. are ignored for ``"all_gather"``).

  Returns:
    The number of bytes (an int).

  Raises:
    ValueError: an unknown ``collective`` or ``order``; ``axis_size < 1``; a scatter
      dimension that does not divide by W; a compressor that cannot run sharded.
    TypeError: ``fmt`` is neither a format nor a compressor; a compressor with an order
      other than ``"all_to_all"``; a block format with another order.

  Example:
    A 1024 x 256 gradient over 8 workers: the float32 ring sends 8 hops of a 32768-value
    chunk; qgZ with MXFP4 (4-bit codes + a scale byte per 32) sends 7 slabs of 17408 bytes;
    the qwZ all-gather of a 128 x 256 shard in MXFP8 sends 7 x 33792 bytes:

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> g = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    >>> P.sharded_wire_bytes(g, 8)
    1048576
    >>> P.sharded_wire_bytes(g, 8, order="all_to_all", fmt=F.mx(F.E2M1FN))
    121856
    >>> shard = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    >>> P.sharded_wire_bytes(shard, 8, collective="all_gather", fmt=F.mx(F.E4M3FN))
    236544
  """
  w = int(axis_size)
  if w < 1:
    raise ValueError(f"sharded_wire_bytes: axis_size={axis_size} must be >= 1")
  if collective not in ("reduce_scatter", "all_gather"):
    raise ValueError(f"sharded_wire_bytes: collective must be 'reduce_scatter' or "
                     f"'all_gather', got {collective!r}")
  is_comp = fmt is not None and not isinstance(fmt, FORMAT_TYPES)
  if is_comp:
    _check_wire(fmt, "sharded_wire_bytes")
    if collective != "reduce_scatter" or order != "all_to_all":
      raise TypeError("sharded_wire_bytes: a compressor runs only in the reduce-scatter's "
                      "all-to-all (collective='reduce_scatter', order='all_to_all')")
  elif fmt is not None:
    check_format(fmt)
  leaves = jax.tree_util.tree_leaves(tree)
  total = 0
  for l, leaf in enumerate(leaves):
    shape = tuple(leaf.shape)
    n = numel(shape)
    if collective == "all_gather":
      total += (w - 1) * _shard_bytes(fmt, shape, leaf.dtype, pack)
      continue
    if order not in REDUCE_SCATTER_ORDERS:
      raise ValueError(f"sharded_wire_bytes: order must be one of {REDUCE_SCATTER_ORDERS}, "
                       f"got {order!r}")
    if fmt is not None and not is_comp and not is_elementwise(fmt) and order != "all_to_all":
      raise TypeError(f"sharded_wire_bytes: a block format travels only with "
                      f"order='all_to_all', got order={order!r}")
    d = _scatter_dim("sharded_wire_bytes", l, shape, scatter_dimension, w, True)
    m = n // w
    if n == 0 or w == 1:
      continue
    codec = codec_for(fmt) if (fmt is not None and not is_comp and is_elementwise(fmt)
                               and pack) else None
    wb = 4 if codec is None else jnp.dtype(codec.dtype).itemsize
    if order == "ring":
      aligned = numel(shape[:d]) == 1
      total += (w - 1) * m * wb * (2 if kahan else 1) + (m * wb if aligned else (w - 1) * m * wb)
    elif order in ("chain", "tree"):
      total += (w - 1) * m * (wb if aps else 4)
    elif order == "native":
      total += (w - 1) * m * 4
    elif is_comp:
      total += (w - 1) * int(fmt.wire_bytes((m,)))
    else:
      total += (w - 1) * _wire(fmt, pack, "sharded_wire_bytes").row_bytes(m)
  return int(total)


def _shard_bytes(fmt, shape, dtype, pack):
  n = numel(shape)
  if fmt is None:
    return n * jnp.dtype(dtype).itemsize
  wire = _wire(fmt, pack, "sharded_wire_bytes")
  if is_elementwise(fmt):
    return wire.row_bytes(n)
  if n == 0:
    return 0
  ax = fmt.axis % max(len(shape), 1)
  m = shape[ax] if shape else 1
  return (n // m) * wire.row_bytes(m)
