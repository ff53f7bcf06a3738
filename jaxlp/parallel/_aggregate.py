"""The compressor families' aggregations (see :class:`jaxlp.parallel.compressors.Aggregation`).

* :data:`DENSE_QUANTIZERS` (``cgx``, ``qsgd``, ``onebit``, ``tbq``, ``terngrad``):

  - ``"sra"`` (``"auto"``) -- CGX scatter-reduce-allgather (torch_cgx
    ``scatter_reduce_allgather.cc``): the (fused) vector is cut into W equal chunks (the last
    one padded by repeating the last element); each worker encodes every chunk and sends chunk
    j to worker j (``all_to_all``); the owner adds the decoded peer chunks to its OWN
    UNQUANTIZED chunk in ascending rank order, re-encodes the reduced chunk (with its "server"
    residual for error-feedback compressors, as CaSync's ROOT_DECOMP_COMP task), and the
    encoded chunks are all-gathered and decoded by everyone:
    ``chunk r = Q(x_r + sum_{j != r} Q(x_j))``. CGX chunks layer-aware with 4-element
    alignment and polls peers in arrival order; jaxlp uses equal chunks and rank order.
  - ``"ring"`` -- CGX compressed ring (torch_cgx ``ring.cc``): chunks as for ``"sra"``; in
    W-1 reduce-scatter steps worker r encodes its partial sum of chunk ``r-1-s`` (its own
    unquantized data at step 0), sends it to ``r+1`` (``ppermute``) and adds the decoded
    partial sum of chunk ``r-2-s`` received from ``r-1`` to its own unquantized chunk. Chunk c
    thus collects ``x_{c+1}, x_{c+2}, ..., x_c`` with W-1 re-quantizations; the owner c encodes
    the final sum once more and that encoding is all-gathered unchanged (CGX forwards the
    compressed bytes around the ring), so every worker decodes the same bits. The worker
    residual of chunk j is used when this worker encodes chunk j; the server residual as in
    ``"sra"``.
  - ``"allgather"`` -- every worker's payload is all-gathered, decoded and summed (rank
    order); a ``plan`` with ``partitions > 1`` encodes the leaf in that many pieces.

  The mean divides BEFORE encoding (the CGX hook). State per leaf:
  ``{"worker": ..., "server": ...}``.

* :data:`SPARSIFIERS` (``topk``, ``randomk``, ``dgc``, ``graddrop``): all-gather
  (GRACE/HiPress), mean divided before encoding.

* :data:`LOW_RANK` (``powersgd``): PyTorch ``powerSGD_hook`` on a bucket of matrices: the P's
  of the bucket all-reduced in one fused sum, then the Q's in another (the same bits as
  unfused, fewer collectives); only Q is divided by W. With ``batched=True`` and ``bucket_mb``
  the whole bucket is one zero-padded square matrix (``batched_powerSGD_hook``) whose state is
  per bucket. Unlike PyTorch, tensors that fail PowerSGD's compression test are reduced in
  fp32 without error feedback. The three stages (:func:`powersgd_start`,
  :func:`powersgd_middle`, :func:`powersgd_finish`) are shared with :mod:`jaxlp.torch.ddp`.

* :data:`CASTS` (``cast``): fp16/bf16 cast, divide by W in the narrow type (PyTorch's order)
  and sum in that type with a ring all-reduce (:func:`jaxlp.parallel.psum`,
  ``order="ring"``: each partial sum rounded to the type, as NCCL's ring in that dtype);
  narrower casts and formats without a native dtype all-gather their codes, sum the decoded
  values in fp32 in rank order and divide by W.

Byte counts (``wire_bytes``): an all-gather of P bytes sends (W-1)*P per worker, an
all-to-all of W rows of P bytes (W-1)*P, a ring hop P.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp._util import cdiv
from jaxlp.parallel import _axes
from jaxlp.parallel.compressors._base import exact_div, materialize, numel
from jaxlp.parallel.compressors._lowrank import outer_sum, thin_matmul, thin_matmul_t
from jaxlp.parallel.compressors._protocol import Bucket, ReduceContext

__all__ = ["CASTS", "DENSE_QUANTIZERS", "LOW_RANK", "SPARSIFIERS"]


# ---------------------------------------------------------------------------------------------
# Collectives (narrow floats travel as their bit patterns) and the rank-ordered fp32 sum

def bitwise(collective, a):
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


def tree_collective(collective, tree, axis_name):
  return jax.tree_util.tree_map(lambda a: bitwise(lambda b: collective(b, axis_name), a), tree)


def rank_order_sum(stack):
  """``stack[0] + stack[1] + ... + stack[W-1]`` (sequential float adds in rank order)."""
  acc = stack[0]
  for j in range(1, stack.shape[0]):
    acc = acc + stack[j]
  return acc


def gathered_sum(x, axis_name):
  """All-gather ``x`` and sum it in rank order (the body of ``ordered_psum``)."""
  return rank_order_sum(bitwise(lambda a: _axes.all_gather(a, axis_name), x))


def fp32_bytes(n: int, w: int) -> int:
  """Bytes one worker sends for an fp32 leaf of ``n`` elements (an all-gather)."""
  return (w - 1) * 4 * n


# ---------------------------------------------------------------------------------------------
# Elementwise-state helpers: fuse/split states, chunk them per worker

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


def split_flat(flat, shapes):
  out, off = [], 0
  for shp in shapes:
    n = math.prod(shp)
    out.append(flat[off:off + n].reshape(shp))
    off += n
  return out


def _pad_edge(x, m):
  return jnp.pad(x, (0, m - x.shape[0]), mode="edge") if m > x.shape[0] else x


def _encode_pieces(comp, x, st, key, k):
  """Encode ``x`` cut into ``k`` equal pieces (SeCoPa partitions)."""
  n = x.shape[0]
  c = cdiv(n, k)
  xs = _pad_edge(x, k * c).reshape(k, c)
  sts = _split_state(st, k, c, n)
  keys = jax.random.split(key, k)
  if getattr(comp, "_encode_branches", False):
    # one piece at a time: under vmap the encoder's data-dependent lax.cond (the sparsifiers'
    # top-k fallback) becomes a select that runs both branches (top-k, 4 pieces of 2.36M:
    # 20 ms under vmap, 3.3 ms as a loop; the same bits)
    payload, sts = lax.map(lambda a: comp.encode(*a), (xs, sts, keys))
  else:
    payload, sts = jax.vmap(comp.encode)(xs, sts, keys)
  return payload, _join_state(sts, n), c


def _pieces(comp, n, parts):
  """(pieces, piece length) of an all-gathered encoding."""
  if parts > 1 and comp.elementwise_state:
    return parts, cdiv(n, parts)
  return 1, n


# ---------------------------------------------------------------------------------------------
# The three aggregation algorithms of elementwise payloads

def allgather_reduce(comp, x, st, key, axis_name, w, parts=1):
  """Every worker's encoding of ``x`` all-gathered, decoded and summed in rank order.

  The ``w`` gathered payloads are decoded by one decode vmapped over them (one batched
  scatter or sampler in the program, not ``w`` copies: XLA:CPU compiles every kernel on its
  own), then added as ``d_0 + d_1 + ... + d_{w-1}`` (:func:`rank_order_sum`): the same adds
  in the same order as decoding and adding one worker at a time, so the same bits."""
  n = x.shape[0]
  if _pieces(comp, n, parts)[0] > 1:
    payload, st, c = _encode_pieces(comp, x, st, key, parts)
    dec = lambda p: jax.vmap(lambda q: comp.decode(q, (c,)))(p).reshape(-1)[:n]  # noqa: E731
  else:
    payload, st = comp.encode(x, st, key)
    dec = lambda p: comp.decode(p, (n,))  # noqa: E731
  gathered = tree_collective(_axes.all_gather, payload, axis_name)
  decoded = jax.vmap(dec)(gathered)
  assert decoded.shape[0] == w, (decoded.shape, w)
  return rank_order_sum(decoded), st


def sra_reduce(comp, x, st, key, axis_name, w, me):
  n = x.shape[0]
  c = cdiv(n, w)
  xs = _pad_edge(x, w * c).reshape(w, c)
  wst = _split_state(st["worker"], w, c, n)
  payload, wst = jax.vmap(comp.encode)(xs, wst, jax.random.split(key, w))
  recv = tree_collective(_axes.all_to_all, payload, axis_name)
  dec = jax.vmap(lambda p: comp.decode(p, (c,)))(recv)
  acc = lax.dynamic_index_in_dim(xs, me, keepdims=False)
  for j in range(w):
    acc = acc + jnp.where(me == j, jnp.float32(0), dec[j])
  sst = _split_state(st["server"], w, c, n)
  mine = jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, me, keepdims=False), sst)
  p2, mine = comp.encode(acc, mine, jax.random.fold_in(key, 0x5EC0))
  sst = jax.tree_util.tree_map(
      lambda a, b: lax.dynamic_update_index_in_dim(a, b, me, 0), sst, mine)
  gathered = tree_collective(_axes.all_gather, p2, axis_name)
  out = jax.vmap(lambda p: comp.decode(p, (c,)))(gathered).reshape(-1)[:n]
  return out, {"worker": _join_state(wst, n), "server": _join_state(sst, n)}


def ring_reduce(comp, x, st, key, axis_name, w, me):
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
    recv = tree_collective(_axes.ring_shift, payload, axis_name)
    seg = (me - 2 - s) % w
    acc = lax.dynamic_index_in_dim(xs, seg, keepdims=False) + comp.decode(recv, (c,))
  # seg == me: the fully reduced segment; its encoding travels the ring unchanged
  sst = _split_state(st["server"], w, c, n)
  p2, mine = comp.encode(acc, take(sst, me), jax.random.fold_in(key, 0x5EC0))
  sst = put(sst, mine, me)
  gathered = tree_collective(_axes.all_gather, p2, axis_name)
  out = jax.vmap(lambda p: comp.decode(p, (c,)))(gathered).reshape(-1)[:n]
  return out, {"worker": _join_state(wst, n), "server": _join_state(sst, n)}


# ---------------------------------------------------------------------------------------------
# Families

class _Elementwise:
  """Shared by the families whose bucket is one fused flat vector with flat state."""
  algorithms = ("auto", "allgather")

  def compresses(self, comp, shape) -> bool:
    del comp, shape
    return True

  def init_leaf(self, comp, shape, dtype, key):
    return comp.init(shape, dtype, key=key)

  def init_bucket(self, comp, bucket, key):
    del comp, bucket, key
    return None

  def reduce(self, comp, xs, states, bucket_state, bucket: Bucket, ctx: ReduceContext):
    sizes = [numel(s) for s in bucket.shapes]
    x = jnp.concatenate([jnp.ravel(a).astype(jnp.float32) for a in xs])
    st = _fuse_states(list(states))
    r, st = self._reduce_flat(comp, x, st, bucket, ctx)
    outs, off = [], 0
    for shp, n in zip(bucket.shapes, sizes, strict=True):
      outs.append(r[off:off + n].reshape(shp))
      off += n
    return outs, _unfuse_states(st, sizes), bucket_state

  def _reduce_flat(self, comp, x, st, bucket, ctx):
    raise NotImplementedError

  def _gathered_payload(self, comp, n, parts):
    k, c = _pieces(comp, n, parts)
    return k * comp.wire_bytes((c,))


class _DenseQuantizers(_Elementwise):
  algorithms = ("auto", "sra", "ring", "allgather")

  def init_leaf(self, comp, shape, dtype, key):
    return {"worker": comp.init(shape, dtype, key=key), "server": comp.init(shape, dtype)}

  def _reduce_flat(self, comp, x, st, bucket, ctx):
    k = jax.random.fold_in(ctx.worker_key, bucket.leaves[0])
    if ctx.mean:
      x = _mean_share(x, ctx.w)
    if ctx.algorithm in ("auto", "sra"):
      return sra_reduce(comp, x, st, k, ctx.axis_name, ctx.w, ctx.me)
    if ctx.algorithm == "ring":
      return ring_reduce(comp, x, st, k, ctx.axis_name, ctx.w, ctx.me)
    r, wst = allgather_reduce(comp, x, st["worker"], k, ctx.axis_name, ctx.w, bucket.parts)
    return r, dict(st, worker=wst)

  def wire_bytes(self, comp, bucket, w, algorithm) -> int:
    n = sum(numel(s) for s in bucket.shapes)
    if algorithm == "allgather":
      return (w - 1) * self._gathered_payload(comp, n, bucket.parts)
    # sra: all_to_all of W chunk encodings + all-gather of the owner's; ring: W-1 hops + the
    # same all-gather
    return 2 * (w - 1) * comp.wire_bytes((cdiv(n, w),))


def _mean_share(x, w):
  """``x / W`` correctly rounded, computed once: the exact division (about 100 integer ops per
  element) is otherwise fused into, and redone by, every pass that reads it (the bucket's
  min/max, the levels, the packing, the residual: measured 4 times per element in CGX's SRA)."""
  return materialize(exact_div(x, w))


def _bound(comp, w):
  """A sparsifier bound to its ``w`` workers where its capacity depends on W (DGC's warm-up
  cap: the message never costs more than the dense all-reduce)."""
  return comp.for_workers(w) if hasattr(comp, "for_workers") else comp


class _Sparsifiers(_Elementwise):

  def _reduce_flat(self, comp, x, st, bucket, ctx):
    comp = _bound(comp, ctx.w)
    k = jax.random.fold_in(ctx.worker_key, bucket.leaves[0])
    if ctx.mean:
      x = _mean_share(x, ctx.w)
    return allgather_reduce(comp, x, st, k, ctx.axis_name, ctx.w, bucket.parts)

  def wire_bytes(self, comp, bucket, w, algorithm) -> int:
    del algorithm
    n = sum(numel(s) for s in bucket.shapes)
    return (w - 1) * self._gathered_payload(_bound(comp, w), n, bucket.parts)


def _ring_in_narrow_type(comp) -> bool:
  return comp.native_dtype is not None and comp.bits >= 16


def cast_share(comp, x, w):
  """This worker's addend in PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``:
  ``x`` rounded to the cast format, then divided by ``w`` in that format
  (``buffer.to(dtype).div_(W)``: the float32 quotient of the rounded value, rounded again,
  which equals the correctly rounded narrow quotient since float32 has more than twice the
  narrow significand plus two bits). float32 result on the narrow grid. Shared by the
  engine's :data:`CASTS` family and :mod:`jaxlp.torch.ddp`'s hooks.

  The division is IEEE float32's (:func:`~jaxlp.parallel.compressors._base.exact_div`); for
  a power-of-two ``w`` whose quotients of the format's values cannot reach float32's
  subnormal range (float16 for any ``w < 2**100``), it is evaluated as the product with
  ``1/w``: exact, so the same bits, without the integer division.
  """
  c = comp.round(x)
  k = int(w).bit_length() - 1 if isinstance(w, int) and w > 0 and w & (w - 1) == 0 else None
  if k is not None and comp.format.min_subnormal * 2.0 ** -k >= 2.0 ** -126:
    return comp.round(c * jnp.float32(2.0 ** -k))
  return comp.round(exact_div(c, w))


def cast_ring_sum(comp, c, axis_name):
  """The sum over ``axis_name`` of the narrow values ``c`` in the cast type, as an all-reduce
  in that dtype (every partial sum rounded to it): :func:`jaxlp.parallel.psum`'s ring
  (per-hop rounding, 16-bit payloads, the same bits in every mode). float32 result. For two
  workers this is the one correctly rounded add ``Q(c_0 + c_1)`` of any all-reduce in the
  narrow dtype (PyTorch's hook with gloo or NCCL); for more, psum's declared ring order."""
  from jaxlp.parallel._psum import psum  # noqa: PLC0415

  return psum(c, axis_name, fmt=comp.format, order="ring").astype(jnp.float32)


def cast_gathered_sum(comp, stack):
  """:func:`cast_ring_sum`'s sums from the W workers' addends gathered as the rows of
  ``stack`` (``(W, n)``; the PyTorch bridge's hooks): psum's ring order (the vector cut into
  W chunks, chunk c accumulated from worker c's chunk on, ``acc = Q(acc + c_r[c])`` for
  r = c+1, c+2, ... mod W) with psum's own rounding and add (``_Rounder``, ``_step``),
  without emulating the ring's messages (which costs about 30x the adds on XLA:CPU). The
  same bits where every sum is finite; psum's non-finite policy (a NaN or inf anywhere makes
  the whole leaf NaN) is not applied: an element whose sum overflows is ±inf (NaN) alone, as
  in PyTorch's all-reduce in the narrow dtype."""
  from jaxlp.parallel._psum import TAG_SUM, _iota, _Rounder, _step  # noqa: PLC0415

  w, n = stack.shape
  size = cdiv(n, w)
  xs = jnp.pad(stack.astype(jnp.float32), ((0, 0), (0, w * size - n))).reshape(w, w, size)
  q = _Rounder(comp.format, "nearest", None, 0)
  chunks = jnp.arange(w)
  idx = _iota(w * size).reshape(w, size)
  acc = q(xs[chunks, chunks], idx, chunks[:, None], TAG_SUM)
  comp_ = jnp.zeros_like(acc)
  for k in range(1, w):
    r = (chunks + k) % w
    acc, comp_ = _step(acc, comp_, xs[r, chunks], idx, r[:, None], q, False)
  return acc.reshape(-1)[:n]


class _Casts(_Elementwise):

  def _reduce_flat(self, comp, x, st, bucket, ctx):
    w = ctx.w
    if _ring_in_narrow_type(comp):
      c = cast_share(comp, x, w) if ctx.mean else comp.round(x)
      return cast_ring_sum(comp, c, ctx.axis_name), st
    out, _ = allgather_reduce(comp, x, (), None, ctx.axis_name, w)
    return (exact_div(out, w) if ctx.mean else out), st

  def wire_bytes(self, comp, bucket, w, algorithm) -> int:
    del algorithm
    n = sum(numel(s) for s in bucket.shapes)
    if _ring_in_narrow_type(comp):
      from jaxlp.parallel._psum import payload_bytes  # noqa: PLC0415
      return int(payload_bytes(n, w, comp.format, "ring"))
    return (w - 1) * comp.wire_bytes((n,))


# ---------------------------------------------------------------------------------------------
# PowerSGD: three stages around the two sums (shared with jaxlp.torch.ddp)

def powersgd_start(comp, mats, states, keys):
  """``M += e`` (error feedback), ``Q = orth(Q_prev)`` (warm start) or ``orth(randn)``,
  ``P = M Q``. Returns ``(ms, local P's)``; the P's are then summed over workers."""
  ms = [m + st["error"].reshape(m.shape) if comp.error_feedback else m
        for m, st in zip(mats, states, strict=True)]
  if comp.warm_start:
    qs = [comp.orth(st["q"]) for st in states]
  else:
    qs = [comp.orth(jax.random.normal(k, st["q"].shape, jnp.float32))
          for st, k in zip(states, keys, strict=True)]
  return ms, [thin_matmul(m, q) for m, q in zip(ms, qs, strict=True)]


def powersgd_middle(comp, ms, p_sums):
  """``P = orth(sum P)``, ``Q = M^T P``. Returns ``(ps, local Q's)``; the Q's are then summed."""
  ps = [comp.orth(p) for p in p_sums]
  return ps, [thin_matmul_t(m, p) for m, p in zip(ms, ps, strict=True)]


def powersgd_finish(comp, ms, ps, q_sums, states, w, mean=True):
  """``Q = sum Q / W``, ``M~ = P Q^T``, ``e = M - M~``. Returns ``(approximations of the mean
  (or of the sum with mean=False), new states)``."""
  outs, news = [], []
  for m, st, p, q in zip(ms, states, ps, q_sums, strict=True):
    qm = exact_div(q, w)
    approx_mean = outer_sum(p, qm)
    outs.append(approx_mean if mean else outer_sum(p, q))
    new = dict(st, q=qm, iter=st["iter"] + 1)
    if comp.error_feedback:
      new["error"] = (m - approx_mean).reshape(-1)
    news.append(new)
  return outs, news


def fused_gathered_sum(arrays, axis_name):
  """One rank-ordered sum for a list of arrays (concatenated: a fused all-reduce)."""
  if len(arrays) == 1:
    return [gathered_sum(arrays[0], axis_name)]
  flat = jnp.concatenate([jnp.ravel(a) for a in arrays])
  return split_flat(gathered_sum(flat, axis_name), [a.shape for a in arrays])


def _powersgd_core(comp, mats, sts, keys, axis_name, w, mean):
  """PyTorch ``powerSGD_hook`` on a bucket of matrices: P's of all matrices all-reduced in one
  fused sum, then the Q's in another (and the plain mean before ``start_iter`` in one)."""
  ms, ps = powersgd_start(comp, mats, sts, keys)
  ps, qs = powersgd_middle(comp, ms, fused_gathered_sum(ps, axis_name))
  outs, news = powersgd_finish(comp, ms, ps, fused_gathered_sum(qs, axis_name), sts, w, mean)
  if comp.start_iter > 0:
    vanilla = fused_gathered_sum([exact_div(m, w) if mean else m for m in mats], axis_name)
    warm = sts[0]["iter"] < comp.start_iter
    outs = [jnp.where(warm, v, o) for v, o in zip(vanilla, outs, strict=True)]
    news = [jax.tree_util.tree_map(lambda a, b: jnp.where(warm, a, b),
                                   dict(st, iter=st["iter"] + 1), nw)
            for st, nw in zip(sts, news, strict=True)]
  return outs, news


class _LowRank:
  algorithms = ("auto", "allgather")

  def compresses(self, comp, shape) -> bool:
    return comp.matrix_shape(tuple(shape)) is not None

  def init_leaf(self, comp, shape, dtype, key):
    return comp.init(shape, dtype, key=key)

  def init_bucket(self, comp, bucket, key):
    if not (comp.batched and bucket.fused):
      return None
    return comp.init((sum(numel(s) for s in bucket.shapes),), key=key)

  def reduce(self, comp, xs, states, bucket_state, bucket: Bucket, ctx: ReduceContext):
    if bucket_state is not None:  # batched: the bucket is one zero-padded square matrix
      total = sum(numel(s) for s in bucket.shapes)
      n_, m_, _ = comp.matrix_shape((total,))
      x = jnp.concatenate([jnp.ravel(a).astype(jnp.float32) for a in xs])
      mat = jnp.pad(x, (0, n_ * m_ - x.shape[0])).reshape(n_, m_)
      (o,), (nb,) = _powersgd_core(comp, [mat], [bucket_state],
                                   [jax.random.fold_in(ctx.step_key, 2000003 + bucket.index)],
                                   ctx.axis_name, ctx.w, ctx.mean)
      outs = split_flat(o.reshape(-1)[:total], bucket.shapes)
      return outs, list(states), nb
    mats = [comp.to_matrix(a.astype(jnp.float32), shp) for a, shp in zip(xs, bucket.shapes,
                                                                         strict=True)]
    outs, news = _powersgd_core(comp, mats, list(states),
                                [jax.random.fold_in(ctx.step_key, i) for i in bucket.leaves],
                                ctx.axis_name, ctx.w, ctx.mean)
    return ([comp.from_matrix(o, shp) for o, shp in zip(outs, bucket.shapes, strict=True)],
            news, bucket_state)

  def wire_bytes(self, comp, bucket, w, algorithm) -> int:
    del algorithm
    if comp.batched and bucket.fused:
      mats = [comp.matrix_shape((sum(numel(s) for s in bucket.shapes),))]
    else:
      mats = [comp.matrix_shape(tuple(s)) for s in bucket.shapes]
    floats = sum((n + m) * r for n, m, r in mats)  # the fused P's, then the fused Q's
    if comp.start_iter > 0:  # the plain mean before start_iter is sent at every step
      floats += sum(n * m for n, m, _ in mats)
    return fp32_bytes(floats, w)


DENSE_QUANTIZERS = _DenseQuantizers()
SPARSIFIERS = _Sparsifiers()
LOW_RANK = _LowRank()
CASTS = _Casts()
