"""Order-faithful low-precision all-reduce: every partial sum rounded to a format.

Semantics. For each leaf the addends are the workers' float32
values ``g_0 .. g_{W-1}`` (worker-major over a tuple ``axis_name``); ``Q`` is
:func:`jaxlp.formats.quantize` to ``fmt``; ``+`` is an IEEE float32 add (nearest even with
gradual underflow on every backend: see :mod:`jaxlp.parallel._arith`).

* ``"chain"`` (CPD): ``acc = Q(g_0)``; ``acc = Q(acc + g_r)`` for r = 1..W-1 (gather, then
  the same sequential sum on every worker).
* ``"ring"``: the leaf is flattened (C order), zero-padded to ``W*L`` and cut into W chunks
  of L. Chunk c is accumulated starting at worker c: ``acc = Q(g_c[c])``,
  ``acc = Q(acc + g_{c+k mod W}[c])`` for k = 1..W-1. Implemented as a real ring
  reduce-scatter (W-1 ``ppermute`` hops, each worker adds its own chunk) followed by an
  all-gather. The hop and gather payloads are the rounded partial sums bit-packed into
  8/16-bit words when the format fits (see :mod:`jaxlp.parallel._codec`).
* ``"tree"``: level by level, pairs (0,1), (2,3), ... are added and rounded; an odd last
  node is carried up unchanged to the next level (so for W = 3: ``Q(Q(g_0+g_1) + g_2)``,
  W = 6: ``Q(Q(Q(g0+g1)+Q(g2+g3)) + Q(g4+g5))``). Leaves are not rounded before their
  first add; for W = 1 the result is ``Q(g_0)``.
* ``"native"``: ``Q(g)`` then ``lax.psum`` in float32 (the backend's order), then ``Q``
  (what a collective in the wire dtype does; not order-faithful, identical on workers).
* ``kahan=True`` (chain and ring): ``s = Q(g_first)``, ``c = +0``, then per addend
  ``y = Q(g - c); t = Q(s + y); c = Q(Q(t - s) - y); s = t``; result ``s`` (CPD's
  ``kahan_sum_gradients``; the compensation is not added back).
* ``aps=True``: APS (:func:`jaxlp.parallel.format_emax`): ``shift = emax(fmt) - A`` per leaf, the
  addends become ``Q(g * 2**shift)`` (exact power-of-two scaling on the bits), the sum is
  taken as above and multiplied by ``2**-shift`` (IEEE-rounded). An all-zero leaf gives
  zeros.

Non-finite values (with and without APS; the policy of every jaxlp reduction, see
:mod:`jaxlp.parallel._compressed`): if any worker's leaf holds a NaN or ±inf, or a partial
sum overflows to ±inf (or to NaN in a format whose overflow is NaN), the whole leaf is NaN on
every worker, so ``optax.apply_if_finite`` and ``jaxlp train``'s ``nonfinite_steps`` see the
step. Non-finite addends enter the sum as NaN (a format without infinities would otherwise
saturate ±inf to its largest finite value); the packed ring payloads carry NaN in every
format. No extra communication: every worker holds the summed leaf and decides alike.

Stochastic rounding (``rounding="stochastic"``, ``key`` required, the same key on every
worker): the rounding done when worker r's addend enters (and, in the ring, the first
``Q(g_c[c])`` done by worker c) uses the noise word ``hash(fold_in(fold_in(fold_in(key,
l), r), t), i)`` of :func:`jaxlp.formats._bits.hash_bits`, with l the leaf number (tree
flatten order), i the element's flat C-order index in the leaf and t a tag: 0 for the sum
``Q(s + y)``/``Q(acc + g)``, 1 for ``y``, 2 for ``Q(t - s)``, 3 for ``c``, 7 for the APS
pre-cast. So chain and ring use the same per-worker keys; the tree rounding of node p at
level ``lv`` (0-based) uses r = ``W + lv * W + p``; native's pre-cast uses the worker's r and
the final rounding r = W. The noise therefore does not depend on devices vs emulation.

Every definition above is per leaf; the implementation of the chain, ring and tree orders sums all
the leaves of a pytree at once, side by side in one bucket (ring: chunk c of the bucket is every
leaf's chunk c), each element with its own leaf's chunk, noise key, index and APS shift. So a
pytree costs one ring of W-1 hops (or one gather) and one traced sum, whatever its number of
leaves (native goes leaf by leaf). 8 leaves, ring + Kahan + APS over a named vmap of 4
workers: traced, lowered and compiled in 5.0 s against 18.2 s leaf by leaf (2-core CPU VM,
2026-11-30).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp._util import cdiv
from jaxlp.formats import _bits as B
from jaxlp.formats._quantize import check_format, is_elementwise, key_words, quantize_f32
from jaxlp.parallel import _axes
from jaxlp.parallel._aps import aps_shift, exponent_of_max, finite_max_bits, shifts_of
from jaxlp.parallel._arith import add_f32, scale_pow2, sub_f32
from jaxlp.parallel._codec import codec_for

ORDERS = ("ring", "chain", "tree", "native")
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
TAG_SUM, TAG_Y, TAG_TS, TAG_C, TAG_PRE = 0, 1, 2, 3, 7


class _Rounder:
  """Q with the documented noise scheme for one leaf."""

  def __init__(self, fmt, rounding, key, leaf_no):
    self.fmt, self.rounding = fmt, rounding
    self.key = None if rounding != "stochastic" else jax.random.fold_in(key, leaf_no)

  def __call__(self, x, idx, r, tag):
    if self.key is None:
      return self._round(x, jnp.zeros((), jnp.uint32))
    k0, k1 = _noise_words(self.key, r, tag)
    return self._round(x, B.hash_bits(k0, k1, idx))

  def _round(self, x, rand):
    return quantize_f32(x, self.fmt, self.rounding, rand, None)


def _noise_words(leaf_key, r, tag):
  """The key words of the noise of worker (or node) ``r``'s rounding ``tag`` in a leaf."""
  return key_words(jax.random.fold_in(jax.random.fold_in(leaf_key, r), tag))


def _check(fmt, order, kahan, rounding, key):
  check_format(fmt, rounding)
  if not is_elementwise(fmt):
    raise TypeError(f"psum: fmt must be an elementwise format (FloatFormat, cpd_float, "
                    f"qpytorch_float, FixedPoint), got fmt={fmt!r}")
  if order not in ORDERS:
    raise ValueError(f"psum: order must be one of {ORDERS}, got order={order!r}")
  if kahan and order not in ("chain", "ring"):
    raise ValueError(f"psum: kahan=True needs order='chain' or 'ring', got order={order!r}")
  if rounding == "stochastic" and key is None:
    raise ValueError("psum: rounding='stochastic' needs key=jax.random.key(...)")


def psum(tree, axis_name, *, fmt, order: str = "ring", kahan: bool = False,
         aps: bool = False, rounding: str = "nearest", key=None, pack: bool = True):
  """Sum ``tree`` over ``axis_name`` with every partial sum rounded to ``fmt``.

  Args:
    tree: pytree of float32/float16/bfloat16 arrays (any shapes, scalars included).
    axis_name: a named axis of pmap / shard_map / vmap, or a tuple of them (worker-major
      in the order given, e.g. ``("dev", "emu")``).
    fmt: elementwise jaxlp format of the partial sums.
    order: ``"ring"`` | ``"chain"`` | ``"tree"`` | ``"native"`` (see module docstring).
    kahan: compensated summation (chain, ring).
    aps: Auto Precision Scaling per leaf.
    rounding: rounding mode of every ``Q``.
    key: PRNG key for stochastic rounding (same on all workers).
    pack: send ring payloads bit-packed in 8/16-bit words when the format fits.

  Returns:
    Pytree of the same structure, shapes and dtypes; identical bits on every worker.

  Raises:
    TypeError: ``fmt`` is not a jaxlp format, or not an elementwise one; a leaf is not
      float32/float16/bfloat16.
    ValueError: ``order`` is not in :data:`ORDERS`; ``kahan=True`` with ``"tree"`` or
      ``"native"``; an unknown ``rounding`` or one ``fmt`` does not support;
      ``rounding="stochastic"`` without ``key``; ``aps=True`` with 65536 or more workers.

  Example:
    Four workers (a named ``vmap``, under ``jit``) with four values each; every partial sum
    is rounded to E4M3, so the result differs from the float32 sum
    ``[11.6, 22.7, 33.8, 44.9]``:

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> g = jnp.array([[1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4],
    ...                [10.0, 20.0, 30.0, 40.0], [0.5, 0.5, 0.5, 0.5]])
    >>> f = lambda x: P.psum(x, "w", fmt=F.E4M3, order="chain")
    >>> jax.jit(jax.vmap(f, axis_name="w"))(g)[0]
    Array([12., 22., 32., 44.], dtype=float32)
  """
  _check(fmt, order, kahan, rounding, key)
  w = _axes.axis_size(axis_name)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  for l, leaf in enumerate(leaves):
    if leaf.dtype not in _FLOAT_DTYPES:
      raise TypeError(f"psum: leaves must be float32/float16/bfloat16, got leaf {l} of "
                      f"dtype={leaf.dtype}")
  if order == "native":
    out = [_native_leaf(leaf, axis_name, w, _Rounder(fmt, rounding, key, l), aps)
           for l, leaf in enumerate(leaves)]
  else:
    out = _bucket(leaves, axis_name, w, fmt, rounding, key, order, kahan, aps, pack)
  return jax.tree_util.tree_unflatten(treedef, out)


def _finite_or_nan(x):
  # non-finite addends enter as NaN: a format without infinities would saturate ±inf to its
  # largest finite value, and every rounding, add and packed payload carries NaN
  return jnp.where(jnp.isfinite(x), x, jnp.float32(jnp.nan))


def _leaf_policy(res, shape, dtype, check=True):
  """The non-finite policy: a leaf with a non-finite value anywhere is NaN everywhere (every
  worker holds the same ``res``, so every worker decides the same); ``check=False``: decided
  already (:func:`_unscaled`)."""
  if check and res.size:
    res = jnp.where(jnp.all(jnp.isfinite(res)), res, jnp.float32(jnp.nan))
  return res.reshape(shape).astype(dtype)


def _native_leaf(leaf, axis_name, w, q, aps):
  n = leaf.size
  x = _finite_or_nan(leaf.astype(jnp.float32).reshape(-1))
  me = _axes.axis_index(axis_name)
  if aps:
    shift, _, bad = aps_shift(x, axis_name, q.fmt, w)
    x = q(scale_pow2(x, shift), _iota(n), me, TAG_PRE)
  if n == 0:
    res = x
  else:
    xq = x if aps else q(x, _iota(n), me, TAG_PRE)
    res = q(lax.psum(xq, _axes.as_tuple(axis_name)), _iota(n), w, TAG_SUM)
  if aps:
    res = jnp.where(bad, jnp.float32(jnp.nan), scale_pow2(res, -shift))
  return _leaf_policy(res, leaf.shape, leaf.dtype)


class _BucketRounder(_Rounder):
  """:class:`_Rounder` of a bucket of leaves laid side by side: the noise of each element
  under its own leaf's key (``leaf_id``: the position in ``leaf_nos`` of every element along
  the bucket's last axis; None for a single leaf)."""

  def __init__(self, fmt, rounding, key, leaf_nos, leaf_id):
    self.fmt, self.rounding, self.leaf_id = fmt, rounding, leaf_id
    self.key = None
    if rounding == "stochastic":  # the leaves' keys, (leaves,)
      self.key = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.asarray(leaf_nos, jnp.uint32))

  def __call__(self, x, idx, r, tag):
    if self.key is None:
      return self._round(x, jnp.zeros((), jnp.uint32))
    kw = jax.vmap(lambda k: jnp.stack(_noise_words(k, r, tag)))(self.key)  # (leaves, 2)
    if self.leaf_id is None:
      k0, k1 = kw[0, 0], kw[0, 1]
    else:  # per element of the last axis (the ring's APS pre-cast has a leading W axis)
      lead = (1,) * (jnp.ndim(idx) - 1)
      k0, k1 = (kw[self.leaf_id, i].reshape(lead + self.leaf_id.shape) for i in (0, 1))
    return self._round(x, B.hash_bits(k0, k1, idx))


def _layout(counts):
  """``(leaf_id, pos, lengths)`` of a bucket of leaves side by side, ``counts[j]`` elements of
  leaf j: per element its leaf j (int32; None for a single leaf), its position in the leaf's
  part and that part's length (uint32). Computed in the program from an iota and the few
  offsets (a binary search), not embedded and not foldable: a per-element constant of a large
  model's bucket would be megabytes in the program, and XLA constant-folds a cumulative sum
  of a constant for minutes (ResNet-18's 62 leaves, measured)."""
  total = int(sum(counts))
  if len(counts) == 1:
    return None, _iota(total), jnp.uint32(total)
  starts = np.cumsum(counts)[:-1]
  leaf_id = jnp.searchsorted(jnp.asarray(starts, jnp.int32), lax.iota(jnp.int32, total),
                             side="right", method="scan").astype(jnp.int32)
  offsets = jnp.asarray(np.concatenate([[0], starts]), jnp.uint32)
  pos = _iota(total) - offsets[leaf_id]
  return leaf_id, pos, jnp.asarray(counts, jnp.uint32)[leaf_id]


def _bucket(leaves, axis_name, w, fmt, rounding, key, order, kahan, aps, pack):
  """ring/chain/tree of every leaf at once, with each leaf's own bits.

  The non-empty leaves are laid side by side in one bucket (ring: row c of the (W, S) bucket
  is every leaf's chunk c; chain/tree: the leaves' flat concatenation), and every element
  carries its leaf's noise key, flat index in its leaf and APS shift. Rounding is elementwise
  and each element meets the same addends in the same order as in a sum of its leaf alone, so
  the bits are the per-leaf definition's; the bucket traces and compiles one sum (one ring of
  W-1 hops, one gather) for the whole tree instead of one per leaf.
  """
  out = list(leaves)  # an empty leaf is its own sum
  live = [l for l, leaf in enumerate(leaves) if leaf.size]
  if not live:
    return out
  sizes = [leaves[l].size for l in live]
  flat = [_finite_or_nan(leaves[l].astype(jnp.float32).reshape(-1)) for l in live]
  me = _axes.axis_index(axis_name)
  codec = codec_for(fmt) if pack else None
  ring = order == "ring"
  # per element of the bucket's last axis: its leaf (position in live), and for the ring the
  # chunk length of its leaf and its position in the chunk (flat index = c * length + pos)
  counts = [cdiv(n, w) for n in sizes] if ring else sizes
  offsets = np.concatenate([[0], np.cumsum(counts)])
  leaf_id, pos, lengths = _layout(counts)
  if ring:
    x = jnp.concatenate([jnp.pad(f, (0, w * k - n)).reshape(w, k)
                         for f, n, k in zip(flat, sizes, counts)], axis=1)
  else:
    x = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
  q = _BucketRounder(fmt, rounding, key, live, leaf_id)

  def per_element(v):  # a per-leaf value on the bucket's last axis (every chunk alike)
    if leaf_id is None:
      return v[0]
    return v[leaf_id][None] if ring else v[leaf_id]

  if aps:
    # one max-reduction for every leaf: (exponent, any non-finite) per leaf
    # (the exponent's arithmetic once, on the vector of the leaves' maxima)
    mx, bad = zip(*(finite_max_bits(f) for f in flat))
    local = jnp.stack([exponent_of_max(jnp.stack(mx), w), jnp.stack(bad).astype(jnp.int32)])
    shifts, _, bad = shifts_of(_axes.pmax(local, axis_name), fmt)
    shift_e = per_element(shifts)
    # the flat index in its leaf of every element of the (W, S) ring bucket: c * length + pos
    idx = lax.iota(jnp.uint32, w)[:, None] * jnp.atleast_1d(lengths)[None] + pos[None] \
        if ring else pos
    x = q(scale_pow2(x, shift_e), idx, me, TAG_PRE)
  if ring:
    s = ring_reduce_scatter(x, axis_name, w, me, q, kahan, codec, (pos, lengths))
    res = ring_gather(s, axis_name, codec).reshape(w, -1)
  else:
    g = _gather(x, axis_name, codec if aps else None)
    res = chain_sum(g, q, kahan, pos) if order == "chain" else tree_sum(g, q, w, pos)
  for j, l in enumerate(live):
    part = res[..., offsets[j]:offsets[j + 1]]
    part = part.reshape(-1)[:sizes[j]] if ring else part
    if aps:
      part = _unscaled(part, shifts[j], bad[j])
    out[l] = _leaf_policy(part, leaves[l].shape, leaves[l].dtype, check=not aps)
  return out


def _unscaled(part, shift, bad):
  """One leaf's APS sum ``part`` unscaled by ``2**-shift``, NaN everywhere if ``bad`` or if an
  element of the result is not finite: read off the scaled sum (non-finite, or its largest
  finite magnitude overflows when unscaled: the scaling is monotonic), so that XLA needs no
  second copy of the unscaling to decide (it fuses one into every consumer of a cheap
  elementwise result: the leaf's values and the leaf's check)."""
  mx, nonfinite = finite_max_bits(part)
  overflow = ~jnp.isfinite(scale_pow2(B.from_bits(mx), -shift))
  return jnp.where(bad | nonfinite | overflow, jnp.float32(jnp.nan), scale_pow2(part, -shift))


def _iota(n, start=0):
  return lax.iota(jnp.uint32, n) + jnp.asarray(start, jnp.uint32)


def _gather(x, axis_name, codec):
  if codec is None:
    return _axes.all_gather(x, axis_name)
  return codec.decode(_axes.all_gather(codec.encode(x), axis_name))


def chain_sum(g, q, kahan, idx=None):
  """psum's chain order over the rows of ``g`` (W, n); ``idx``: the elements' flat indices in
  the leaf (noise), default ``0..n-1``."""
  w, n = g.shape
  idx = _iota(n) if idx is None else idx
  s = q(g[0], idx, 0, TAG_SUM)
  c = jnp.zeros_like(s)

  def body(r, sc):
    gr = lax.dynamic_index_in_dim(g, r, 0, keepdims=False)
    return _step(sc[0], sc[1], gr, idx, r, q, kahan)

  s, c = lax.fori_loop(1, w, body, (s, c))
  return s


def _step(s, c, g, idx, r, q, kahan):
  if not kahan:
    return q(add_f32(s, g), idx, r, TAG_SUM), c
  y = q(sub_f32(g, c), idx, r, TAG_Y)
  t = q(add_f32(s, y), idx, r, TAG_SUM)
  c = q(sub_f32(q(sub_f32(t, s), idx, r, TAG_TS), y), idx, r, TAG_C)
  return t, c


def tree_sum(g, q, w, idx=None):
  """psum's tree order over the rows of ``g`` (W, n); ``idx`` as in :func:`chain_sum`."""
  idx = _iota(g.shape[1]) if idx is None else idx
  nodes = [g[r] for r in range(w)]
  rounded = False
  lv = 0
  while len(nodes) > 1:
    nxt = []
    for p in range(0, len(nodes) - 1, 2):
      nxt.append(q(add_f32(nodes[p], nodes[p + 1]), idx, w + lv * w + p // 2, TAG_SUM))
    if len(nodes) % 2:
      nxt.append(nodes[-1])
    nodes = nxt
    rounded = True
    lv += 1
  return nodes[0] if rounded else q(nodes[0], idx, 0, TAG_SUM)


def ring_reduce_scatter(xs, axis_name, w, me, q, kahan, codec, layout=None):
  """psum's ring reduce-scatter of the chunks ``xs`` (W, L): chunk c accumulated starting at
  worker c, W-1 hops of (packed) partial sums. Returns the finished chunk ``(me + 1) mod W``
  that worker ``me`` holds (float32, decoded).

  ``layout``: None (one leaf: element j of chunk c has flat index ``c * L + j``), or the
  uint32 arrays ``(pos, lengths)`` of a bucket of leaves side by side (element j of chunk c
  has index ``c * lengths[j] + pos[j]`` in its leaf)."""
  length = xs.shape[1]
  if layout is None:
    pos, lengths = _iota(length), length
  else:
    pos, lengths = (jnp.asarray(v, jnp.uint32) for v in layout)

  def chunk(c):
    return lax.dynamic_index_in_dim(xs, c, 0, keepdims=False)

  def idx_of(c):
    return pos + c.astype(jnp.uint32) * lengths

  enc = (lambda v: v) if codec is None else codec.encode
  dec = (lambda v: v) if codec is None else codec.decode
  s = q(chunk(me), idx_of(me), me, TAG_SUM)
  c = jnp.zeros_like(s)

  def hop(k, sc):
    s, c = sc
    if kahan:
      s_in, c_in = _axes.ring_shift(jnp.stack([enc(s), enc(c)]), axis_name)
      s, c = dec(s_in), dec(c_in)
    else:
      s = dec(_axes.ring_shift(enc(s), axis_name))
    cid = (me - k) % w
    return _step(s, c, chunk(cid), idx_of(cid), me, q, kahan)

  s, c = lax.fori_loop(1, w, hop, (s, c))
  return s


def ring_gather(s, axis_name, codec):
  """All-gather the finished chunks of :func:`ring_reduce_scatter` (worker i holds chunk
  i + 1): the (W * L,) flat sum in chunk order."""
  full = _gather(s, axis_name, codec)
  return jnp.roll(full, 1, axis=0).reshape(-1)


def payload_bytes(size: int, w: int, fmt, order: str = "ring", *, kahan: bool = False,
                  aps: bool = False, pack: bool = True) -> int:
  """Bytes one worker sends for one leaf of ``size`` elements (for the benchmark table).

  ring: (W-1) hops of one chunk (two with Kahan) + the all-gather of its final chunk to
  W-1 peers; chain/tree: its whole leaf to W-1 peers (bit-packed only with APS, where the
  addends are on the format's grid); native: float32 ring all-reduce, 2(W-1)/W * 4 bytes
  per element. APS adds one int32 pair to the max-reduction (not counted).

  Args:
    size: number of elements of the leaf.
    w: number of workers W.
    fmt: elementwise jaxlp format of the partial sums (decides the packed word size).
    order: ``"ring"`` | ``"chain"`` | ``"tree"`` | ``"native"``; any other value counts as
      ``"native"``.
    kahan: compensated summation (ring: two payloads per hop).
    aps: Auto Precision Scaling (chain/tree: packed addends).
    pack: payloads bit-packed in 8/16-bit words when the format fits (as in :func:`psum`).

  Returns:
    The number of bytes (an int).

  Example:
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> P.payload_bytes(1024, 4, F.BF16)  # ring: 3 hops + 3 gathers of 256 16-bit words
    3072
    >>> P.payload_bytes(1024, 4, F.BF16, "chain")
    12288
    >>> P.payload_bytes(1024, 4, F.BF16, "native")
    6144
  """
  codec = codec_for(fmt) if pack else None
  wb = 4 if codec is None else jnp.dtype(codec.dtype).itemsize
  length = cdiv(size, w)
  if order == "ring":
    return (w - 1) * length * wb * (2 if kahan else 1) + (w - 1) * length * wb
  if order in ("chain", "tree"):
    return (w - 1) * size * (wb if aps else 4)
  return int(2 * (w - 1) * length * 4)
