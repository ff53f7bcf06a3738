"""Shared pieces of the gradient compressors: the protocol, bit packing, sparse messages.

Every compressor is a frozen dataclass with

* ``init(shape, dtype=jnp.float32, key=None) -> state``: explicit state pytree (residuals,
  momenta, P/Q). Elementwise state arrays are FLAT, of length ``prod(shape)``, so that the
  aggregation can fuse leaves into buckets and cut them into per-worker chunks.
* ``encode(g, state, key) -> (payload, state)``: pure; ``payload`` is a dict of arrays (packed
  ``uint8`` codes, ``float32`` metadata, ``int32`` indices) -- what would go on the wire.
* ``decode(payload, shape) -> g`` (float32).
* ``wire_bytes(shape, dtype=jnp.float32) -> int``: the exact payload size, equal to the sum of
  ``payload[k].nbytes``.
* ``kind``: ``"quantizer"`` (dense codes; scatter-reduce-allgather or all-gather aggregation),
  ``"sparse"`` (index/value lists; all-gather), ``"lowrank"`` (PowerSGD) or ``"cast"``.
* ``elementwise_state``: True when every non-scalar state array is flat and elementwise, so
  the state can be fused/chunked with the gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp.formats._bits import fma_guard, fmix32
from jaxlp.parallel._arith import div_f32


def numel(shape) -> int:
  return int(math.prod(shape))


def packed_nbytes(n: int, bits: int) -> int:
  """Bytes of ``n`` codes of ``bits`` bits packed LSB-first (``ceil(n*bits/8)``)."""
  return (n * bits + 7) // 8


def pack_bits(codes, bits: int, pad_code: int = 0):
  """Pack unsigned ``bits``-bit codes (1..8) into a little-endian uint8 bit stream.

  Code ``j`` occupies stream bits ``[j*bits, (j+1)*bits)``, LSB first; stream bit ``t`` is bit
  ``t % 8`` of byte ``t // 8``. This is CGX's layout (groups of 8 codes in ``bits`` bytes,
  ``value |= level_j << (j*bits)``) and, for 2 bits, HiPress TBQ's (4 codes per byte, LSB first).
  A partial last byte is filled with ``pad_code``.

  Args:
    codes: array of unsigned codes (any shape, flattened in C order), each < ``2**bits``.
    bits: bits per code, 1 to 8.
    pad_code: code filling the unused slots of the last byte (when ``bits`` divides 8).

  Returns:
    uint8 array of ``ceil(n * bits / 8)`` bytes.

  Raises:
    ValueError: ``bits`` is not in 1..8.

  Example:
    Codes 1, 2, 3, 0 fill the first byte (``1 + 2*4 + 3*16 = 57``), code 1 the second:

    >>> import jax.numpy as jnp
    >>> from jaxlp.parallel import compressors
    >>> compressors.pack_bits(jnp.array([1, 2, 3, 0, 1]), 2)
    Array([57,  1], dtype=uint8)
    >>> compressors.pack_bits(jnp.array([5, 7, 1]), 3)  # 9 bits: 5 | 7 << 3 | 1 << 6, 0
    Array([125,   0], dtype=uint8)
  """
  if not 1 <= bits <= 8:
    raise ValueError(f"{bits=} must be in 1..8")
  codes = jnp.ravel(codes).astype(jnp.uint32)
  n = codes.shape[0]
  split = _whole_groups_apart(codes, 8 // bits if 8 % bits == 0 else 8,
                              lambda c: pack_bits(c, bits, pad_code))
  if split is not None:
    return split
  nbytes = packed_nbytes(n, bits)
  if 8 % bits == 0:
    per = 8 // bits
    codes = jnp.pad(codes, (0, nbytes * per - n), constant_values=pad_code)
    shifts = jnp.arange(per, dtype=jnp.uint32) * bits
    words = jnp.sum(codes.reshape(nbytes, per) << shifts[None, :], axis=1, dtype=jnp.uint32)
    return words.astype(jnp.uint8)
  # 8 codes fill ``bits`` bytes exactly. A group's 8*bits <= 64 stream bits are assembled into
  # two uint32 words (lo: stream bits 0..31, hi: 32..63) by shift-sums over the (groups, 8)
  # view (the codes' bits are disjoint, so a sum is an OR), and byte j of the group is
  # ``(lo >> 8j) | (hi >> (8j - 32))`` (XLA shifts by >= 32 give 0, and a "negative" amount
  # wraps to >= 32). Here the reduce is faster than strided columns (measured: 3 and 5 bits,
  # 1.0-1.5x).
  groups = -(-n // 8)
  g = jnp.pad(codes, (0, 8 * groups - n)).reshape(groups, 8)
  start = np.arange(8) * bits  # stream position of code i's bit 0 within its group
  lo_shl = np.minimum(start, 32).astype(np.uint32)
  hi_shr = np.where(start < 32, 32 - start, 0).astype(np.uint32)
  hi_shl = np.where(start < 32, 0, start - 32).astype(np.uint32)
  # one variadic reduce: the codes' producer (often the whole quantizer, noise included) is
  # fused into a single loop; two sums would each evaluate it (XLA:CPU drops optimization
  # barriers before fusion and has no multi-output sibling fusion)
  lo, hi = lax.reduce((g << lo_shl[None, :], (g >> hi_shr[None, :]) << hi_shl[None, :]),
                      (jnp.uint32(0), jnp.uint32(0)),
                      lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))
  sh = lax.broadcasted_iota(jnp.uint32, (groups, bits), 1) * jnp.uint32(8)
  out = (lo[:, None] >> sh) | (hi[:, None] >> (sh - jnp.uint32(32)))
  return out.reshape(-1)[:nbytes].astype(jnp.uint8)


def _whole_groups_apart(codes, group: int, pack):
  """``pack(codes)`` as the packed whole groups of ``group`` codes (which end on a byte
  boundary) followed by the packed rest, or None when ``codes`` is whole groups (or less than
  one). The same stream: padding a partial group (the codes' producer fused into a padded
  view) made XLA:CPU run the whole pack with per-element index arithmetic, 3-15x slower
  (TBQ's encode of 2359293 codes: 2.8 ms, against 0.18 for 2359296)."""
  n = codes.shape[0]
  full = n // group * group
  if full in (0, n):
    return None
  return jnp.concatenate([pack(codes[:full]), pack(codes[full:])])


def pack_bits_vectorized(codes, bits: int, pad_code: int = 0):
  """:func:`pack_bits` (the same bytes) for ``bits`` in 1, 2, 4, 8, for codes that are
  expensive to compute (stochastic rounding: a Threefry hash per code).

  :func:`pack_bits` sums the shifted codes over the minor axis of a ``(bytes, per)`` view, a
  reduce fusion into which XLA:CPU pulls the codes' producer and evaluates it without SIMD.
  Here ``32 / bits`` codes are OR-ed into a uint32 word as strided columns, an elementwise
  loop that is vectorised with its producer (TernGrad: the 2-bit pack with its noise 1.8x
  faster), and the words' little-endian bytes are the stream. The words are materialised
  (:func:`materialize`): a decoder in the same program would otherwise recompute the encoder
  for every code it unpacks. For cheap codes (signs, thresholds, materialised levels) the
  division this costs makes it slower than :func:`pack_bits` (measured: onebit, TBQ, CGX).
  """
  if 8 % bits:
    return pack_bits(codes, bits, pad_code)
  codes = jnp.ravel(codes).astype(jnp.uint32)
  n = codes.shape[0]
  if bits == 8 or n == 0:
    return pack_bits(codes, bits, pad_code)
  per = 32 // bits
  split = _whole_groups_apart(codes, per, lambda c: pack_bits_vectorized(c, bits, pad_code))
  if split is not None:
    return split
  nwords = -(-n // per)
  c = jnp.pad(codes, (0, nwords * per - n), constant_values=pad_code).reshape(nwords, per)
  word = c[:, 0]
  for j in range(1, per):
    word = word | (c[:, j] << jnp.uint32(j * bits))
  stream = lax.bitcast_convert_type(materialize(word), jnp.uint8).reshape(-1)
  return stream[:packed_nbytes(n, bits)]


def unpack_bits(packed, bits: int, n: int):
  """Inverse of :func:`pack_bits`: the first ``n`` codes as uint32.

  Args:
    packed: uint8 bit stream from :func:`pack_bits`.
    bits: bits per code, 1 to 8 (as given to :func:`pack_bits`).
    n: number of codes to read.

  Returns:
    uint32 array of ``n`` codes.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp.parallel import compressors
    >>> packed = compressors.pack_bits(jnp.array([5, 7, 1]), 3)
    >>> compressors.unpack_bits(packed, 3, 3)
    Array([5, 7, 1], dtype=uint32)
  """
  packed = jnp.ravel(packed).astype(jnp.uint32)
  mask = jnp.uint32((1 << bits) - 1)
  if 8 % bits == 0:
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint32) * bits
    codes = (packed[:, None] >> shifts[None, :]) & mask
    return codes.reshape(-1)[:n]
  # Groups of ``bits`` bytes hold 8 codes. A group's bytes are read as two uint32 words (lo:
  # stream bits 0..31, hi: 32..) and code i, at stream bit s = i * bits of its group, is
  # ``(lo >> s) | (hi << (32 - s)) | (hi >> (s - 32))``: XLA's shifts by >= 32 give 0, and a
  # "negative" amount wraps to >= 32, so each term is 0 where it does not apply. No select
  # chain over the 8 positions (measured on 2.36M 5-bit codes: 0.39 -> 0.17 ms).
  groups = -(-n // 8)
  have = min(packed.shape[0], groups * bits)
  b = jnp.pad(packed[:have], (0, groups * bits - have)).reshape(groups, bits)
  lo = b[:, 0]
  for k in range(1, min(bits, 4)):
    lo = lo | (b[:, k] << jnp.uint32(8 * k))
  hi = jnp.zeros_like(lo)
  for k in range(4, bits):
    hi = hi | (b[:, k] << jnp.uint32(8 * (k - 4)))
  s = lax.broadcasted_iota(jnp.uint32, (groups, 8), 1) * jnp.uint32(bits)
  lo, hi = lo[:, None], hi[:, None]
  codes = (lo >> s) | (hi << (jnp.uint32(32) - s)) | (hi >> (s - jnp.uint32(32)))
  return (codes & mask).reshape(-1)[:n]


def no_fma(x, anchor=None):
  """Keep ``x`` (a float32 product) from being contracted with a following add into an FMA.

  Without ``anchor`` every element goes through :func:`jaxlp.formats._bits.fma_guard` (two
  integer hashes per element). With ``anchor`` (any non-empty array computed at run time that
  does not depend on ``x``, e.g. a per-bucket scale), the bits of ``x`` are XOR-ed with one
  scalar zero that the compiler cannot prove to be zero (``fmix32(a) == fmix32(a ^ 1)`` of
  the anchor's first element ``a``, false since fmix32 is a bijection, materialised by an
  optimisation barrier): one XOR per element.
  Either way the value is ``x`` unchanged. The anchor must not be ``x`` or derived from it:
  reading an element of the product makes XLA materialise it.
  """
  x = jnp.asarray(x, jnp.float32)
  if anchor is None or jnp.size(anchor) == 0:
    return fma_guard(x)
  zero = _opaque_zero(jnp.asarray(anchor, jnp.float32))
  return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) ^ zero, jnp.float32)


def _as_u32(a):
  """The scalar ``a`` (any 8/16/32-bit dtype or bool) as a uint32 that differs for every bit
  pattern of ``a`` (floats bitcast, integers converted)."""
  if a.dtype == jnp.bool_:
    return a.astype(jnp.uint32)
  size = np.dtype(a.dtype).itemsize
  if jnp.issubdtype(a.dtype, jnp.floating):
    a = lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size])
  return a.astype(jnp.uint32)


def _opaque_zero(anchor):
  """uint32 0 that no compiler can prove to be 0: ``fmix32(a) == fmix32(a ^ 1)`` of the bit
  pattern ``a`` of ``anchor``'s first element (false: fmix32 is a bijection), materialised by
  an optimisation barrier. ``anchor``: a non-empty array (8/16/32-bit dtype or bool) computed
  at run time."""
  a = _as_u32(jnp.ravel(anchor)[0])
  return lax.optimization_barrier((fmix32(a) == fmix32(a ^ jnp.uint32(1))).astype(jnp.uint32))


F32_MAX = float(np.finfo(np.float32).max)
#: ``2**-100``: scales float32 values so that their squares and sums cannot overflow
#: (``|x| * 2**-100 <= 2**28``); values below ``2**-26`` then lose bits, which cannot matter
#: next to the values beyond ``2**64`` that make a sum of squares overflow.
DOWN = float(2.0 ** -100)


def redo_where(pred, fn, value):
  """``where(pred, fn(), value)`` that runs ``fn`` only when some ``pred`` holds: for rare
  fallbacks (a range, norm or sum that overflowed float32) that must cost nothing otherwise.

  A while loop of at most one step: none when ``pred`` is False everywhere; under ``vmap``
  one step for the whole batch when any element needs it (a ``lax.cond`` there becomes a
  select that computes both branches). ``fn`` takes no argument and returns an array of
  ``value``'s shape and dtype; ``pred`` (bool) broadcasts to it.
  """
  def body(c):
    p, v = c
    return jnp.zeros_like(p), jnp.where(p, fn(), v)
  return lax.while_loop(lambda c: jnp.any(c[0]), body, (jnp.asarray(pred), value))[1]


def safe_mean(v, count, total=None):
  """``exact_div(det_sum(v), count)`` (float32, ``v`` flat), also where the sum overflows
  float32 although the mean is finite: then from the sum of ``v * 2**-32`` (``count <
  2**31``), the mean rescaled and kept within ``±F32_MAX``. The same bits wherever the sum
  does not overflow; a non-finite element still gives a non-finite mean."""
  if total is None:
    total = det_sum(v)
  mean = exact_div(total, count)

  def scaled():
    small = det_sum(v * jnp.float32(2.0 ** -32))  # finite unless an element is not
    m = exact_div(small, count) * jnp.float32(2.0 ** 32)
    return jnp.where(jnp.isfinite(small), jnp.clip(m, -F32_MAX, F32_MAX), m)

  # a signed sum can overflow to inf - inf = NaN: redo every non-finite sum (a non-finite
  # element then costs the redo, and gives a non-finite mean again)
  return redo_where(~jnp.isfinite(total), scaled, mean)


def materialize(x, anchor=None):
  """``x`` (float32 or a 32-bit integer type) unchanged, bit for bit, but computed once into
  a buffer of its own instead of being fused into (and recomputed by) every consumer.

  For per-bucket or per-tensor values (a norm, a scale) that are broadcast over the elements.
  XLA:CPU drops ``optimization_barrier`` before fusion and fuses any chain of cheap
  elementwise ops into a consumer that broadcasts it, so an integer-exact square root of a
  bucket norm ran once per element, twice (encode and decode): QSGD's encode+decode took
  1.9-2.4x as long. An integer division is one of the ops XLA never duplicates into such a
  consumer (``InstructionFusion::IsExpensive``): the bits are divided by a one that no
  compiler can prove to be one (``1 ^`` :func:`_opaque_zero` of ``x`` itself).
  On other backends it costs one integer division per element of ``x``.

  ``anchor``: where ``x`` is the end of a long elementwise chain (an :func:`exact_div`), a
  small array computed at run time and already in a buffer of its own (e.g. the norm ``x`` was
  divided by), read by the barrier instead of ``x``'s first element: reading an element of
  ``x`` made XLA:CPU compute ``x``'s whole producer a second time for every element (a
  9216-long Gram-Schmidt column: 0.24-0.32 ms against 0.18 ms, 2-core CPU, 2026-11-29).
  """
  x = jnp.asarray(x)
  dt = x.dtype
  if x.size == 0 or dt.itemsize != 4:
    return x
  if anchor is not None and jnp.size(anchor) == 0:
    anchor = None
  b = x if jnp.issubdtype(dt, jnp.unsignedinteger) else lax.bitcast_convert_type(x, jnp.uint32)
  b = lax.optimization_barrier(b // (_opaque_zero(b if anchor is None else anchor)
                                     ^ jnp.uint32(1)))
  return b if b.dtype == dt else lax.bitcast_convert_type(b, dt)


def apart(fn, *args, min_size: int = 2 ** 12):
  """``fn(*args)`` (a pytree of arrays), bit for bit, computed in a loop of its own: on CPU
  XLA fuses neither ``fn``'s producers nor its consumers with it.

  XLA:CPU drops ``optimization_barrier`` before fusion and fuses whole chains (a quantizer,
  its noise, the bit packing; or a bit unpacking and the decoder's arithmetic) into one loop.
  When that loop's shape is a reduce, a ``(groups, 8)`` view or a conv kernel's ``(o, i, 3,
  3)`` its body is not vectorised: QSGD's decode ran 3x slower as one loop than as three. On
  CPU ``fn`` runs as the taken branch of a ``lax.cond`` whose predicate no compiler can
  prove (:func:`_opaque_zero` of the first element of ``args``), whose other branch gives
  zeros: a branch writes its result into the conditional's buffer, so nothing is copied.
  Other platforms (``lax.platform_dependent``) run ``fn`` as it is: a conditional there costs
  a device-to-host sync. Under ``vmap`` (``jax.custom_batching.custom_vmap``) the whole batch
  goes through one conditional: a batched predicate would turn it into a select of both
  branches, which measured 2x slower in the engine (QSGD, 4 workers under ``vmap``).
  ``fn`` must not close over traced values: pass them in ``args``.

  Results of fewer than ``min_size`` elements are computed as ``fn(*args)``: each
  conditional adds a few thunks (predicate, branch, operand copies). In a program of many
  leaves that also shifts XLA:CPU's scheduling: on the 2-core CI VM, QSGD's ResNet-18 round
  trip ran at 1.4 GB/s with its encoder's barriers on every leaf and at 2.1 GB/s with them
  on leaves of at least ``2**19`` elements only (each smaller leaf alone ran faster with
  them), while its decoder's barriers paid off at every size.
  """
  def anchors(tree):
    return [a for a in jax.tree_util.tree_leaves(tree)
            if jnp.size(a) and not jnp.issubdtype(a.dtype, jax.dtypes.prng_key)]

  size = sum(math.prod(o.shape) for o in jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)))
  if size < min_size or not anchors(args):
    return fn(*args)

  def cpu(*a):
    z = _opaque_zero(anchors(a)[0])
    shapes = jax.eval_shape(fn, *a)
    return lax.cond(z == 0, fn,
                    lambda *_: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                      shapes), *a)

  @jax.custom_batching.custom_vmap
  def call(*a):
    return lax.platform_dependent(*a, cpu=cpu, default=fn)

  @call.def_vmap
  def _batched(axis_size, in_batched, *a):
    # vmap of the barrier is the barrier of the vmapped function (one conditional for the
    # whole batch, its predicate not batched); a conditional with a batched predicate would
    # be a select of both branches
    del axis_size
    axes = jax.tree_util.tree_map(lambda b: 0 if b else None, list(in_batched))
    out = apart(jax.vmap(fn, in_axes=tuple(axes)), *a, min_size=min_size)
    return out, jax.tree_util.tree_map(lambda _: True, out)

  return call(*args)


def flat_in(g, dtype=jnp.float32, min_size: int = 2 ** 19):
  """``g`` flattened (C order) and cast to ``dtype``. A multi-dimensional ``g`` of at least
  ``min_size`` elements is first copied flat (:func:`apart`): a loop over a conv kernel's
  ``(o, i, 3, 3)`` shape has an innermost extent of 3, which XLA:CPU cannot vectorise, and
  every pass of an encoder that reads ``g`` through the reshape pays for it (QSGD's encode
  of ``(512, 512, 3, 3)``: 5.1 ms, 3.3 ms flat)."""
  if jnp.ndim(g) > 1:
    return apart(lambda a: jnp.ravel(a).astype(dtype), g, min_size=min_size)
  return jnp.ravel(g).astype(dtype)


def per_element(v, size: int, n: int):
  """Per-bucket values ``v`` (shape ``(nb,)``) repeated for each of the ``size`` elements of
  their bucket, first ``n`` entries: the flat vector ``v[i // size]``."""
  return jnp.broadcast_to(v[:, None], (v.shape[0], size)).reshape(-1)[:n]


def exact_div(a, d):
  """``a / d`` correctly rounded (IEEE 754 float32 division, round to nearest even, gradual
  underflow) on every backend, also under ``vmap``; float32 result, broadcast as ``a / d``.

  Computed by :func:`jaxlp.parallel._arith.div_f32` on the bit patterns with integer ops, not
  with the hardware division: XLA:GPU lowers float32 ``/`` to an approximate division (about a
  quarter of quotients off by one ulp on an H100), and XLA:CPU rewrites ``a / broadcast(b)``
  into ``a * broadcast(1/b)`` -- even for a non-constant scalar ``b`` -- (about 60% of quotients
  by 3 or 15 off by one ulp) and flushes subnormals.
  """
  return div_f32(a, d)


def det_sum(x, axis=-1):
  """Sum along ``axis`` in a fixed pairwise order (element-wise adds only), so the bits do not
  depend on how XLA vectorises a reduction (which differs between vmap and shard_map)."""
  x = jnp.moveaxis(jnp.asarray(x), axis, -1)
  if x.shape[-1] == 0:
    return jnp.zeros(x.shape[:-1], x.dtype)
  while x.shape[-1] > 1:
    if x.shape[-1] % 2:
      x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (1,), x.dtype)], axis=-1)
    x = x[..., 0::2] + x[..., 1::2]
  return x[..., 0]


def payload_nbytes(payload) -> int:
  """Sum of ``nbytes`` of the payload's arrays (works on arrays and ShapeDtypeStructs).

  Args:
    payload: a pytree (e.g. an ``encode`` payload dict) of arrays or ShapeDtypeStructs.

  Returns:
    The number of bytes (an int); for a compressor's payload it equals its ``wire_bytes``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.parallel import compressors
    >>> c = compressors.cgx(bits=4, bucket_size=512)
    >>> payload, _ = jax.jit(c.encode)(jnp.ones(1024), c.init((1024,)))
    >>> compressors.payload_nbytes(payload), c.wire_bytes((1024,))
    (528, 528)
    >>> # the payload's shapes alone (nothing computed)
    >>> shapes, _ = jax.eval_shape(c.encode, jnp.ones(1024), c.init((1024,)))
    >>> compressors.payload_nbytes(shapes)
    528
  """
  return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                 for a in jax.tree_util.tree_leaves(payload)))


def _rotl(x, r: int):
  return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def _threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32 with 20 rounds (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2,
  3", SC 2011), the rounds unrolled. JAX's own CPU lowering runs them in a ``fori_loop`` (to
  save compile time), which materialises both words 5 times: about 15x slower here."""
  rot = ((13, 15, 26, 6), (17, 29, 16, 24))
  ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
  x0 = x0 + ks[0]
  x1 = x1 + ks[1]
  for i in range(5):
    for r in rot[i % 2]:
      x0 = x0 + x1
      x1 = x0 ^ _rotl(x1, r)
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
  return x0, x1


def _threefry_key_data(key, n: int):
  """The two uint32 key words when the fast Threefry path applies (a Threefry-2x32 key,
  ``jax_threefry_partitionable`` on, fewer than ``2**32`` elements), else None."""
  typed = jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key)
  impl = str(jax.random.key_impl(key)) if typed else str(jax.config.jax_default_prng_impl)
  if (impl != "threefry2x32" or not jax.config.jax_threefry_partitionable or n >= 2 ** 32
      or (not typed and jnp.shape(key) != (2,))):
    return None
  return jax.random.key_data(key) if typed else jnp.asarray(key, jnp.uint32)


def random_bits32(key, shape):
  """``jax.random.bits(key, shape, jnp.uint32)``, the same bits, computed faster on CPU.

  For a Threefry-2x32 key with ``jax_threefry_partitionable`` on (the default), JAX's bits are
  ``threefry2x32(key, (hi, lo))`` of the 64-bit row-major element index, the two output words
  XOR-ed; this evaluates that hash with the rounds unrolled (one fused loop). Any other key
  implementation, the non-partitionable scheme or more than ``2**32`` elements go to
  ``jax.random.bits`` itself.
  """
  shape = tuple(shape)
  n = numel(shape)
  kd = _threefry_key_data(key, n)
  if kd is None:
    return jax.random.bits(key, shape, dtype=jnp.uint32)
  lo = lax.iota(jnp.uint32, n)
  w0, w1 = _threefry2x32(kd[0], kd[1], jnp.zeros_like(lo), lo)
  return (w0 ^ w1).reshape(shape)


def uniform01(key, shape):
  """U[0, 1) float32 noise with 24 random bits (exactly representable): the top 24 bits of
  ``jax.random.bits(key, shape, uint32)`` (via :func:`random_bits32`) times ``2**-24``.

  The noise of the quantizers (QSGD, TernGrad, stochastic CGX). With the default
  (partitionable) Threefry, element ``i`` (row-major) depends only on ``key`` and ``i``, not
  on ``shape``.

  Using both Threefry words of each hash (half the hashing) was measured and not adopted:
  XLA:CPU fuses the hash into each consumer and evaluates it once per word (no gain) unless
  the two words are forced into one buffer through a ``lax.cond`` with an opaque predicate,
  which gains 1.35x on the noise alone but runs 3x slower under ``vmap`` (both branches).
  """
  bits = random_bits32(key, shape)
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


# ---------------------------------------------------------------------------------------------
# Sparse messages: [count:int32][idx:int32 x k][val:f32 x k], fixed capacity k; unused slots
# carry index n (dropped by decode) and value 0.

def sparse_capacity(n: int, fraction: float) -> int:
  return min(n, max(1, math.ceil(n * fraction))) if n else 0


def sample_threshold(mag, key, keep, sample_rate):
  """HiPress DGC/GradDrop threshold: ``sample_cnt = ceil(n*sample_rate)`` magnitudes sampled
  with replacement, sorted descending, ``thr = sample[int(sample_cnt*keep)]`` (index clamped to
  the last sample; HiPress reads out of range when ``keep == 1``). ``sample_rate=None`` gives
  ``-1`` (no threshold: exact top-k).

  With a static ``keep`` (a Python number) the sample is not sorted: the value at that position
  is the smallest of the sample's ``lax.top_k`` (the same value; NaNs, which the sort places
  last, are counted apart). A traced ``keep`` (DGC's warm-up) sorts the sample.
  """
  n = mag.shape[0]
  if sample_rate is None or n == 0:
    return jnp.float32(-1.0)
  cnt = max(1, math.ceil(n * sample_rate))
  idx = jax.random.randint(key, (cnt,), 0, n)
  s = mag[idx]
  k = _static_float(keep)
  if k is None:
    samples = -jnp.sort(-s)
    pos = jnp.minimum(jnp.floor(cnt * jnp.asarray(keep, jnp.float32)).astype(jnp.int32), cnt - 1)
    return samples[pos]
  pos = min(int(np.floor(np.float32(cnt) * np.float32(k))), cnt - 1)  # float32, as the sort path
  nan = jnp.isnan(s)
  # the min of the top values, not top[pos]: XLA:CPU turns a TopK whose output is sliced at an
  # element into a full sort (measured: 0.1 ms -> 4 ms for 23.6k samples)
  top = jnp.min(lax.top_k(jnp.where(nan, -jnp.inf, s), pos + 1)[0])
  return jnp.where(pos >= cnt - jnp.sum(nan, dtype=jnp.int32), jnp.float32(jnp.nan), top)


# Sparse selection without a top_k over all n elements. The candidates (magnitude above a
# threshold) are compacted in index order into a small buffer (32-bit mask words, popcount
# prefix sums, binary search per slot); among them the k largest are found from the k-th
# largest of the magnitudes' bit patterns, ties broken by the lower index as lax.top_k does.
# Whenever the buffer would overflow (or, for exact top-k, the sampled threshold keeps fewer
# than k), a lax.cond falls back to the full lax.top_k. Only the order of the payload's
# (idx, val) pairs can differ from the full top_k's (ascending index instead of descending
# magnitude); the selected set, hence every decoded value, residual and aggregate, is the same.
#
# Two schedules of the same arithmetic, picked by the platform the program is compiled for
# (``impl=None``; "cpu" or "gpu" force one, for tests and benchmarks):
# * "cpu": the k-th largest key by a 31-step bisection, only when there are more than k
#   candidates (a lax.cond); binary searches as a loop (``searchsorted`` "scan"). Cheap
#   branches and loops, little work: what XLA:CPU runs fastest.
# * "gpu" (every other platform): one sort of the candidates' keys instead of the bisection,
#   no conditional around it, binary searches unrolled ("scan_unrolled"). On a GPU each loop
#   step is a few kernel launches and a conditional reads its predicate back to the host; the
#   H200 run of 2026-11-26 put the sparsifiers' bucketed round trips at 0.16-0.35x of the copy.
#   One lax.cond (the rare fallback) is left.
# A third, "radix" (``select_sparse`` only; no platform's default), has no candidate buffer and
# so no fallback and no conditional: see _select_radix. On one H200 (2026-11-27, ResNet-18's
# gradients in 25 MB buckets) it was slower than "gpu" for top-k (25.7 against 33.9 GB/s; its
# eight counting passes took 0.52 of its 1.00 ms of kernels per round trip) and about even for
# DGC (23.2 against 20.7 GB/s, one run): benchmarks/RESULTS.md.

_FAST_MIN = 1 << 15  # below this many elements the full top_k is as fast
_INF_BITS = 0x7F800000


def _static_float(x):
  return None if isinstance(x, jax.core.Tracer) else float(x)


def _mag_key(mag):
  """int32 keys ordered as the float32 magnitudes ``>= 0`` (NaN keys > ``_INF_BITS``); the
  comparisons on them are exact also for subnormals (XLA:CPU may flush those in float ops)."""
  return lax.bitcast_convert_type(jnp.asarray(mag, jnp.float32), jnp.int32)


def _above(key, thr):
  """``mag > thr`` and not NaN, on the keys."""
  return (key > _mag_key(thr)) & (key <= _INF_BITS)


_IMPLS = (None, "cpu", "gpu")
_SELECT_IMPLS = _IMPLS + ("radix",)  # select_sparse's schedules: see _select_radix


def check_impl(impl):
  if impl not in _IMPLS:
    raise ValueError(f"impl={impl!r} must be one of {_IMPLS}")


def per_platform(impl, cpu, gpu, *args):
  """``cpu(*args)`` or ``gpu(*args)``: two schedules of the same result. ``impl=None`` picks
  by the platform the program is compiled for (``lax.platform_dependent``: "cpu" on CPU,
  "gpu" elsewhere); "cpu"/"gpu" force one."""
  check_impl(impl)
  if impl == "cpu":
    return cpu(*args)
  if impl == "gpu":
    return gpu(*args)
  return lax.platform_dependent(*args, cpu=cpu, default=gpu)


def _true_positions(mask, cap: int, impl=None):
  """The first ``cap`` positions where ``mask`` (bool[n]) is True, ascending, padded with
  ``n``; and the number of True entries (which may exceed ``cap``)."""
  words = _mask_words(mask)
  pc = lax.population_count(words).astype(jnp.int32)
  incl = lax.associative_scan(jnp.add, pc)  # exact (int32); far faster than cumsum on XLA:CPU
  return _positions_of(words, pc, incl, cap, mask.shape[0], impl), incl[-1]


def _positions_of(words, pc, incl, cap: int, n: int, impl):
  """``_true_positions`` from the mask's words, their popcounts and its inclusive sum."""
  j = lax.iota(jnp.int32, cap)
  w = per_platform(impl, lambda a, v: jnp.searchsorted(a, v, side="right", method="scan"),
                   lambda a, v: jnp.searchsorted(a, v, side="right", method="scan_unrolled"),
                   incl, j)
  w = jnp.minimum(w, words.shape[0] - 1).astype(jnp.int32)
  r = j - (incl[w] - pc[w])  # slot j is the r-th set bit of word w
  return jnp.where(j < incl[-1], w * 32 + _bit_of_rank(words[w], r), n)


def _mask_words(mask):
  """bool[n] as little-endian uint32 words (bit ``i % 32`` of word ``i // 32``), padded."""
  n = mask.shape[0]
  nw = -(-n // 32)
  if nw * 32 != n:
    mask = jnp.pad(mask, (0, nw * 32 - n))
  shifts = lax.broadcasted_iota(jnp.uint32, (1, 32), 1)
  return jnp.sum(mask.reshape(nw, 32).astype(jnp.uint32) << shifts, axis=1, dtype=jnp.uint32)


def _bit_of_rank(word, r):
  """The position (0-31) of the ``r``-th (0-based) set bit of ``word``, by halving."""
  pos = jnp.zeros_like(r)
  for width in (16, 8, 4, 2, 1):
    low = lax.population_count(word & jnp.uint32((1 << width) - 1)).astype(jnp.int32)
    go = r >= low
    r = jnp.where(go, r - low, r)
    word = jnp.where(go, word >> jnp.uint32(width), word)
    pos = jnp.where(go, pos + width, pos)
  return pos


def _kth_largest_key(keys, k):
  """The largest ``b`` with ``sum(keys >= b) >= k`` (``k >= 1``, keys of values >= 0): the
  k-th largest key, bit by bit from the top."""
  def body(i, ans):
    c = ans | (jnp.int32(1) << (30 - i))
    return jnp.where(jnp.sum(keys >= c, dtype=jnp.int32) >= k, c, ans)
  return lax.fori_loop(0, 31, body, jnp.int32(0))


def _largest_of(cidx, ckey, count, k_sel, k_cap: int, n: int, impl=None):
  """Of the ``count`` candidates ``cidx`` (ascending, keys ``ckey``, padding after them), the
  ``k_sel`` largest (all if ``count <= k_sel``; among equal keys the lower indices): their
  indices ascending in ``k_cap`` slots, padded with ``n``.

  The keys greater than the k-th largest key are taken, and of the keys equal to it the
  first ones, up to ``k_sel`` in all. "cpu" finds that key by bisection, and only when there
  are more than ``k_sel`` candidates; "gpu" reads it from the sorted keys, always: with
  fewer candidates it is -1 (an empty slot's key) or the smallest key, and the same rule
  then takes every candidate, as "cpu" does."""
  slots = cidx.shape[0]
  valid = lax.iota(jnp.int32, slots) < count
  keys = jnp.where(valid, ckey, -1)

  def take(kth):
    gt = keys > kth
    eq = (keys == kth) & valid
    tie_rank = lax.associative_scan(jnp.add, eq.astype(jnp.int32))
    return gt | (eq & (tie_rank <= k_sel - jnp.sum(gt, dtype=jnp.int32)))

  def cpu(keys):
    return lax.cond(count > k_sel, lambda: take(_kth_largest_key(keys, k_sel)), lambda: valid)

  def gpu(keys):
    return take(jnp.sort(keys)[jnp.clip(slots - k_sel, 0, slots - 1)])

  sel = per_platform(impl, cpu, gpu, keys)
  pos, _ = _true_positions(sel, k_cap, impl)
  return jnp.where(pos < slots, cidx[jnp.minimum(pos, slots - 1)], n)


# The "radix" schedule: no candidate buffer, hence no overflow, no fallback and no conditional
# at all (under vmap nothing runs twice). The k-th largest candidate key is found over all n
# keys, 4 bits at a time: each of 8 passes counts the keys at or above 15 splitting values in
# one fused reduction. Of the keys equal to it, the ones with the lowest indices are taken, as
# many as k still needs: one prefix sum of the popcounts of the "greater" and "equal" mask
# words gives, per word, how many equal keys to take and where the selection's slots fall, and
# the exactly-sized selection is compacted as above. About ten passes over the bucket, each a
# plain reduction or elementwise kernel, and one prefix sum over n/32 words.
_RADIX_PASSES = tuple((lo, 4) for lo in (27, 23, 19, 15, 11, 7, 3)) + ((0, 3),)  # bits 30..0


def _kth_largest_radix(ckey, k):
  """The largest ``b`` in ``[0, 2**31)`` with ``sum(ckey >= b) >= k``; -1 when fewer than
  ``k`` keys are ``>= 0`` (``ckey``: int32, -1 for elements that are not candidates)."""
  ans = jnp.int32(0)
  for lo, width in _RADIX_PASSES:
    split = ans | (lax.iota(jnp.int32, (1 << width) - 1) + 1) << lo
    counts = jnp.sum(ckey[:, None] >= split[None, :], axis=0, dtype=jnp.int32)
    # the counts fall as the splitting value rises: those still >= k are a prefix
    ans = ans | jnp.sum(counts >= k, dtype=jnp.int32) << lo
  return jnp.where(jnp.sum(ckey >= 0, dtype=jnp.int32) >= k, ans, -1)


def _select_radix(key, thr, k_sel, k_cap: int):
  """``select_sparse``'s indices (ascending, padded with n) on the "radix" schedule."""
  n = key.shape[0]
  ckey = jnp.where(_above(key, thr), key, -1)
  kth = _kth_largest_radix(ckey, k_sel)
  gt_words = _mask_words(ckey > kth)
  eq_words = _mask_words((ckey == kth) & (kth >= 0))
  pc_gt = lax.population_count(gt_words).astype(jnp.int32)
  pc_eq = lax.population_count(eq_words).astype(jnp.int32)
  incl_gt, incl_eq = lax.associative_scan(  # one scan of both
      lambda a, b: (a[0] + b[0], a[1] + b[1]), (pc_gt, pc_eq))
  # of the keys equal to the k-th, the first r by index: `take` of them in each word
  r = jnp.maximum(k_sel - incl_gt[-1], 0)
  take = jnp.clip(r - (incl_eq - pc_eq), 0, pc_eq)
  last = _bit_of_rank(eq_words, jnp.maximum(take - 1, 0)).astype(jnp.uint32)
  below = (jnp.uint32(2) << last) - jnp.uint32(1)  # bits 0..last (all 32 when last = 31)
  sel_words = gt_words | jnp.where(take > 0, eq_words & below, jnp.uint32(0))
  incl_sel = incl_gt + jnp.minimum(incl_eq, r)
  return _positions_of(sel_words, pc_gt + take, incl_sel, k_cap, n, "gpu")


def _exact_threshold(mag, k: int):
  """A threshold with, very likely, between ``k`` and the returned capacity magnitudes above
  it: a quantile of a fixed spread-out sample of ``m`` magnitudes, 4 standard deviations of
  the sample rank below the ``k/n`` quantile; the capacity is 8 above."""
  n = mag.shape[0]
  m = min(n, max(4096, n // 64))
  r = -(-m * k // n)
  sd = math.isqrt(r) + 1
  r_lo = min(m - 1, r + 4 * sd + 8)
  cap = min(n, -(-n * (r + 8 * sd + 16) // m))
  sidx = fmix32(lax.iota(jnp.uint32, m) ^ jnp.uint32(0x2545F491)) % jnp.uint32(n)
  s = mag[sidx.astype(jnp.int32)]
  # min of the top values, not an element: see sample_threshold
  return jnp.min(lax.top_k(jnp.where(jnp.isnan(s), -jnp.inf, s), r_lo + 1)[0]), cap


def _select_full(values, mag, thr, k_cap: int, k_now):
  n = values.shape[0]
  cand = jnp.where(mag > thr, mag, -1.0)
  top, idx = lax.top_k(cand, k_cap)
  valid = top >= 0
  if k_now is not None:
    valid = valid & (jnp.arange(k_cap) < k_now)
  return jnp.where(valid, idx, n).astype(jnp.int32)


def select_sparse(values, mag, thr, k_cap: int, k_now=None, impl=None):
  """Elements with ``mag > thr``, truncated to the ``k_now`` (<= ``k_cap``) largest magnitudes
  (among equal magnitudes the lower indices, as ``lax.top_k``); a static ``thr < 0`` selects
  the exact top-``k_now`` of all non-NaN magnitudes.

  ``mag`` is ``|values|`` (None: computed here, inside each path, so that it is never
  materialised for the fallback). Returns ``(payload, selected_idx)``; ``selected_idx`` holds
  ``n`` in unused slots. Large leaves take the compaction path described above (the payload's
  pairs then in ascending index order), small ones and the rare overflow the full
  ``lax.top_k`` (descending magnitude); the selected set is the same on either path, except
  for subnormal magnitudes, which XLA:CPU's float ops may flush to zero (the compaction path
  compares them exactly). ``impl``: the schedule of the compaction path (see above; None:
  by platform; "cpu", "gpu" or "radix"), the same selection on each.
  """
  if impl not in _SELECT_IMPLS:
    raise ValueError(f"impl={impl!r} must be one of {_SELECT_IMPLS}")
  n = values.shape[0]

  def mag_of():
    return jnp.abs(values) if mag is None else mag

  k_sel = k_cap if k_now is None else jnp.minimum(k_now, k_cap)
  t = _static_float(thr)
  exact = t is not None and t < 0
  if n < _FAST_MIN or (exact and 8 * k_cap > n):
    idx = _select_full(values, mag_of(), thr, k_cap, k_now)
  elif impl == "radix":
    idx = _select_radix(_mag_key(mag_of()), -1.0 if exact else thr, k_sel, k_cap)
  else:
    key = _mag_key(mag_of())
    if exact:
      lo, cap = _exact_threshold(mag_of(), k_cap)
      cidx, count = _true_positions(_above(key, lo), cap, impl)
      ok = (lo >= 0) & (count >= k_sel) & (count <= cap)
    else:
      cap = min(n, k_cap + max(1024, k_cap // 2))
      cidx, count = _true_positions(_above(key, thr), cap, impl)
      ok = count <= cap
    ckey = key[jnp.minimum(cidx, n - 1)]
    idx = lax.cond(ok, lambda: _largest_of(cidx, ckey, count, k_sel, k_cap, n, impl),
                   lambda: _select_full(values, mag_of(), thr, k_cap, k_now))
  valid = idx < n
  val = jnp.where(valid, values[jnp.minimum(idx, n - 1)], 0.0).astype(jnp.float32)
  count = jnp.sum(valid, dtype=jnp.int32).reshape(1)
  return {"count": count, "idx": idx, "val": val}, idx


def sparse_decode(payload, n: int):
  """Dense ``float32[n]`` with ``payload["val"]`` at ``payload["idx"]`` (indices ``>= n`` dropped).

  The selected indices are distinct, so a scatter *set* gives the sum a scatter-add would, and
  it is deterministic on every backend: XLA:GPU may merge scatter-adds into one with repeated
  indices and sum them with atomics in a run-dependent order (measured on an H100).
  """
  return jnp.zeros((n,), jnp.float32).at[payload["idx"]].set(payload["val"], mode="drop")


def sparse_wire_bytes(k_cap: int) -> int:
  return 4 + 8 * k_cap


def zero_at(x, idx):
  return x.at[idx].set(0.0, mode="drop")
