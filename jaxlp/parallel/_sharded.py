"""Sharded collectives with specified bits: ``reduce_scatter`` and ``all_gather``.

Semantics of :func:`reduce_scatter` (per leaf; W workers, worker-major over a tuple
``axis_name``; ``Q``, ``+`` and the noise scheme are those of :func:`jaxlp.parallel.psum`).

The scatter dimension ``d`` of the leaf must have a size that is a multiple of W (no
padding is added: a leaf that is not is refused with a ``ValueError``; pad it yourself, e.g.
flatten it and pad the flat vector to a multiple of W, which keeps psum's ring chunks). Worker
``o`` receives slab ``o``: indices ``o*k .. (o+1)*k - 1`` of dimension ``d`` (``k = size/W``).

* ``"ring"``, ``"chain"``, ``"tree"``, ``"native"``: every element of worker ``o``'s output
  has exactly the bits of the same element of ``psum(x, axis_name, fmt=fmt, order=order,
  kahan=kahan, aps=aps, rounding=rounding, key=key)`` (``fmt=None`` means
  :data:`jaxlp.formats.FP32`), so ``all_gather(reduce_scatter(x, ...), axis=d)`` equals that
  psum bit for bit (``"native"`` excepted: it is not order-faithful, see below).

  - ``"ring"``: psum's ring reduce-scatter (the leaf flattened in C order and cut into W
    chunks; chunk c accumulated starting at worker c; W-1 ``ppermute`` hops of packed partial
    sums), after which worker ``c-1`` holds the finished chunk c. With ``d = 0`` (or every
    dimension before ``d`` of size 1) chunk c is slab c and one more hop moves it to its
    owner (W hops in all). Otherwise psum's chunks are not the slabs: the finished chunks are
    all-gathered (psum's traffic) and each worker keeps its slab.
  - ``"chain"`` / ``"tree"``: every worker sends slab ``o`` of its addends to worker ``o``
    (one ``all_to_all``; bit-packed with APS, where the addends are on the format's grid)
    and worker ``o`` sums them in psum's chain / tree order.
  - ``"native"``: ``Q(g)``, the backend's ``psum_scatter`` in float32, ``Q`` (psum's native
    order: what a collective in the wire dtype does; the addition order is the backend's, so
    the bits may differ from ``psum(order="native")`` and between backends).

* ``"all_to_all"`` (fp32 accumulation, Megatron-Core's scheme; qgZ with a block format):
  each worker rounds its addend once, ``q_r = Q(g_r)`` (noise tag 7, psum's APS pre-cast),
  sends slab ``o`` of it to worker ``o`` in the wire format (bit-packed codes), and worker
  ``o`` sums the W decoded slabs in float32 in ascending rank order
  ``((q_0 + q_1) + q_2) + ...`` (IEEE adds, gradual underflow); the sum is not rounded again.
  ``fmt`` may be an elementwise format or a block format (:class:`~jaxlp.formats.MXFormat`,
  :class:`~jaxlp.formats.BlockFormat` with ``axis=``): a block format is applied to the
  ``(W, k*rest)`` array of the worker's outgoing slabs (row ``o`` = slab ``o`` in C order),
  in blocks of ``block_size`` consecutive elements of a row (the format's ``axis`` is
  replaced by -1). With ``fmt=FP32`` it equals ``psum(order="chain")``.
  APS works as in psum (elementwise formats); ``kahan`` is refused.

Non-finite values follow :func:`jaxlp.parallel.psum`'s policy for elementwise formats: a NaN
or ±inf in any worker's leaf enters as NaN, and if any element of any worker's slab of a leaf
is not finite (also an overflowing sum), the whole leaf is NaN in every slab (one int32 flag
per leaf is max-reduced), so ``all_gather(reduce_scatter(x)) == psum(x)`` holds there too.
With a block wire format (``"all_to_all"``) only the blocks holding a non-finite value are
NaN (in the slab of the worker that owns them).

Stochastic noise (``rounding="stochastic"``): the noise word of an element is psum's,
``hash(fold_in(fold_in(fold_in(key, l), r), tag), i)`` with ``i`` the element's flat C-order
index in the leaf ``x`` (for every order, also for a block format's elements).

:func:`all_gather` rounds each worker's shard once to ``fmt`` (``jaxlp.quantize`` semantics;
a block format uses its own blocks on the shard), sends it in the wire format (packed 8/16-bit
words for elementwise formats that fit, codes + block scales for block formats) and
concatenates (``tiled``) or stacks the W shards along ``axis``. With ``fmt=None`` it is a
plain all-gather (the leaf's own dtype and bits).

Wire formats of block formats (:func:`wire_payload_bytes`): per row (a slab, or a row of the
shard along the block axis) the element codes bit-packed LSB first (``pack_bits``) and one
scale per block. MX: the element format's own codes (``to_codes``; MXINT8: two's complement
bytes, so a ``-0`` element arrives as ``+0``) and the E8M0 scale byte (``0xFF``: the block was
NaN). ``BlockFormat(man_bits=m)``: ``m+1``-bit sign-magnitude integers (-0 kept) and the
shared exponent as an int16 (-32768: the block was NaN).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp._util import cdiv
from jaxlp.formats import _bits as B
from jaxlp.formats._block import BlockFormat, MXFormat, check_block_axis
from jaxlp.formats._codes import from_codes, to_codes
from jaxlp.formats._presets import FP32
from jaxlp.formats._quantize import check_format, is_elementwise, key_words, quantize_f32
from jaxlp.parallel import _axes
from jaxlp.parallel._aggregate import bitwise
from jaxlp.parallel._aps import aps_shift
from jaxlp.parallel._arith import add_f32, scale_pow2
from jaxlp.parallel._codec import bfp_codes, bfp_values, codec_for, max_last
from jaxlp.parallel._psum import (
  _FLOAT_DTYPES,
  TAG_PRE,
  TAG_SUM,
  _Rounder,
  chain_sum,
  ring_gather,
  ring_reduce_scatter,
  tree_sum,
)
from jaxlp.parallel.compressors._base import pack_bits_vectorized, packed_nbytes, unpack_bits

#: The orders :func:`reduce_scatter` accepts.
REDUCE_SCATTER_ORDERS = ("ring", "chain", "tree", "native", "all_to_all")


# ---------------------------------------------------------------------------------------------
# Wire formats: what one row of values travels as

class _F32Wire:
  """float32 values as they are."""
  bits = 32

  def encode(self, q, v):
    del v
    return {"values": q}

  def decode(self, payload, m):
    del m
    return payload["values"]

  def row_bytes(self, m):
    return 4 * m


@dataclasses.dataclass(frozen=True)
class _CodecWire:
  """Values on an elementwise format's grid as packed 8/16-bit words (:mod:`._codec`)."""
  codec: object

  def encode(self, q, v):
    del v
    return {"codes": self.codec.encode(q)}

  def decode(self, payload, m):
    del m
    return self.codec.decode(payload["codes"])

  def row_bytes(self, m):
    return jnp.dtype(self.codec.dtype).itemsize * m


@dataclasses.dataclass(frozen=True)
class _BlockWire:
  """A block format's codes + one scale per block of ``block_size`` along a row."""
  fmt: object
  block_size: int | None  # None: the whole row is one block

  @property
  def is_mx(self):
    return isinstance(self.fmt, MXFormat)

  @property
  def bits(self):
    if self.is_mx:
      return 8 if self.fmt.elem == "int8" else self.fmt.elem.bits
    return self.fmt.man_bits + 1

  @property
  def scale_bytes(self):
    return 1 if self.is_mx else 2

  def _bs(self, m):
    return max(m, 1) if self.block_size is None else self.block_size

  def row_bytes(self, m):
    if m == 0:
      return 0
    bits = self.bits
    code = packed_nbytes(m, bits) if bits <= 8 else m * (2 if bits <= 16 else 4)
    return code + cdiv(m, self._bs(m)) * self.scale_bytes

  def _blocks(self, a, m):
    bs = self._bs(m)
    nb = cdiv(m, bs)
    return jnp.pad(a, (0, nb * bs - m)).reshape(nb, bs), nb, bs

  def encode(self, q, v):
    """Codes of one row ``q`` (values of ``Q(v)``) and the scales computed from ``v``."""
    m = q.shape[0]
    if m == 0:
      return {"codes": jnp.zeros((0,), jnp.uint8), "scales": jnp.zeros((0,), self._sdtype())}
    vb, nb, bs = self._blocks(v, m)
    qb, _, _ = self._blocks(q, m)
    mx = jnp.max(B.to_bits(vb) & B.u32(B.ABS_MASK), axis=1)
    finite = B.is_finite_mag(mx)
    mxc = jnp.minimum(mx, B.u32(0x7F7FFFFF))
    if self.is_mx:
      s = jnp.clip(B.floor_log2(mxc) - self.fmt.elem_emax, -127, 127)
      if self.fmt.elem == "int8":
        k = scale_pow2(qb, -(s - 6)[:, None])
        # -128 * 2**121 (scale 2**127) is beyond float32: the spec gives -inf, sent as -128
        k = jnp.where(jnp.isnan(k), 0.0, jnp.maximum(k, -128.0)).astype(jnp.int32)
        codes = (k & 0xFF).astype(jnp.uint32)
      else:
        codes = to_codes(scale_pow2(qb, -s[:, None]), self.fmt.elem)
      scales = jnp.where(finite, s + 127, 255).astype(jnp.uint8)
    else:
      codes, scales = self._bfp_encode(B.to_bits(qb), mxc, finite)
    codes = codes.reshape(-1)[:m]
    return {"codes": self._pack(codes), "scales": scales}

  def _bfp_encode(self, bits, mxc, finite):
    """BlockFormat codes and int16 scales of the blocked bits of values on the grid (or of
    any values, rounded to nearest: the codes of their nearest rounding, :func:`bfp_codes`)."""
    m_bits = self.fmt.man_bits
    e = self.fmt.shared_exponent(mxc)
    k = bfp_codes(bits & B.u32(B.ABS_MASK), (e - m_bits)[:, None], m_bits)
    codes = jnp.where(finite[:, None], ((bits >> 31) << m_bits) | k, B.u32(0))
    return codes, jnp.where(finite, e, -32768).astype(jnp.int16)

  def encode_nearest(self, v):
    """``encode(Q(v), v)`` with ``Q`` the format's nearest rounding, without computing
    ``Q(v)`` (a BlockFormat: the codes come from ``v`` directly, the same bits); other block
    formats round first."""
    m = v.shape[0]
    if self.is_mx or m == 0:
      return self.encode(quantize_f32(v[None], self.fmt, "nearest", jnp.zeros((), jnp.uint32),
                                      None)[0], v)
    vb, nb, bs = self._blocks(v, m)
    bits = B.to_bits(vb)
    mx = max_last(bits & B.u32(B.ABS_MASK))
    codes, scales = self._bfp_encode(bits, jnp.minimum(mx, B.u32(0x7F7FFFFF)),
                                     B.is_finite_mag(mx))
    return {"codes": self._pack(codes.reshape(-1)[:m]), "scales": scales}

  def _sdtype(self):
    return jnp.uint8 if self.is_mx else jnp.int16

  def _pack(self, codes):
    bits = self.bits
    if bits <= 8:
      # pack_bits's bytes; 2- and 4-bit codes OR-ed into words as strided columns, a loop that
      # XLA:CPU vectorises with the quantizer that produces the codes (benchmarks/sharded.py
      # --codec: the 1536 x 1536 int4-block reduce-scatter 161.1 -> 51.8 ms per worker)
      return pack_bits_vectorized(codes, bits)
    return codes.astype(jnp.uint16 if bits <= 16 else jnp.uint32)

  def decode(self, payload, m):
    if m == 0:
      return jnp.zeros((0,), jnp.float32)
    bits = self.bits
    codes = payload["codes"]
    codes = unpack_bits(codes, bits, m) if bits <= 8 else codes.astype(jnp.uint32)
    cb, nb, bs = self._blocks(codes, m)
    sc = payload["scales"].astype(jnp.int32)
    if self.is_mx:
      s = sc - 127
      if self.fmt.elem == "int8":
        k = ((cb ^ 0x80).astype(jnp.int32) - 0x80).astype(jnp.float32)
        out = scale_pow2(k, (s - 6)[:, None])
      else:
        out = scale_pow2(from_codes(cb, self.fmt.elem), s[:, None])
      nan = sc == 255
    else:
      m_bits = self.fmt.man_bits
      mag = bfp_values(cb & B.u32((1 << m_bits) - 1), (sc - m_bits)[:, None])
      out = B.from_bits(mag | ((cb >> m_bits) << 31))
      nan = sc == -32768
    out = jnp.where(nan[:, None], jnp.float32(jnp.nan), out)
    return out.reshape(-1)[:m]


def _row_format(fmt, who):
  """The block format applied along the last axis of a 2-D array of rows, or a TypeError."""
  if isinstance(fmt, MXFormat):
    return dataclasses.replace(fmt, axis=-1)
  if isinstance(fmt, BlockFormat) and fmt.axis is not None:
    return dataclasses.replace(fmt, axis=-1)
  raise TypeError(
      f"{who}: fmt={fmt!r} has no wire format: block formats on the wire must have blocks "
      "along an axis (jaxlp.formats.mx(...) or BlockFormat(man_bits, axis=..., "
      "block_size=...)); tiled, per-tensor and QPyTorch block formats are not supported")


def _wire(fmt, pack, who="all_gather"):
  """The wire of values already rounded to ``fmt`` (None: float32)."""
  if fmt is None:
    return _F32Wire()
  if is_elementwise(fmt):
    codec = codec_for(fmt) if pack else None
    return _F32Wire() if codec is None else _CodecWire(codec)
  fmt = _row_format(fmt, who)
  return _BlockWire(fmt, fmt.block_size)


def wire_payload_bytes(fmt, m: int, *, pack: bool = True) -> int:
  """Bytes of one row of ``m`` values rounded to ``fmt`` on the wire of the sharded collectives.

  Args:
    fmt: ``None`` (float32), an elementwise jaxlp format (packed 8/16-bit words when the
      format fits, else float32; ``pack=False``: float32) or an axis-blocked block format
      (``mx(...)``, ``BlockFormat(man_bits, axis=..., block_size=...)``): bit-packed element
      codes + one scale per block of ``block_size`` (E8M0 byte for MX, int16 exponent for
      BlockFormat).
    m: number of values in the row (a slab of :func:`reduce_scatter`, a row of the shard
      along the block axis for :func:`all_gather`).
    pack: bit-pack elementwise formats (as the collectives' ``pack``).

  Returns:
    The number of bytes (an int).

  Raises:
    TypeError: ``fmt`` is a block format without axis blocks, or not a jaxlp format.

  Example:
    >>> from jaxlp import formats as F
    >>> from jaxlp import parallel as P
    >>> P.wire_payload_bytes(F.mx(F.E2M1FN, 32), 256)  # 128 B of 4-bit codes + 8 scales
    136
    >>> P.wire_payload_bytes(F.BlockFormat(7, axis=-1, block_size=64), 256)  # int8 + int16
    264
    >>> P.wire_payload_bytes(F.BF16, 256), P.wire_payload_bytes(None, 256)
    (512, 1024)
  """
  if fmt is not None:
    check_format(fmt)
  return int(_wire(fmt, pack, "wire_payload_bytes").row_bytes(int(m)))


# ---------------------------------------------------------------------------------------------
# Layout helpers

def _iota(n):
  return lax.iota(jnp.uint32, n)


def _slab_rows(flat, shape, d, w):
  """(W, m): row o = slab o of the leaf (indices o*k..(o+1)*k-1 of dimension d), C order."""
  k = shape[d] // w
  v = flat.reshape(shape[:d] + (w, k) + shape[d + 1:])
  return jnp.moveaxis(v, d, 0).reshape(w, -1)


def _unslab(rows, shape, d, w):
  """Inverse of :func:`_slab_rows`."""
  k = shape[d] // w
  v = rows.reshape((w,) + shape[:d] + (k,) + shape[d + 1:])
  return jnp.moveaxis(v, 0, d).reshape(-1)


def _take_row(a, i):
  return lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _check_common(who, fmt, rounding, key):
  check_format(fmt, rounding)
  if rounding == "stochastic" and key is None:
    raise ValueError(f"{who}: rounding='stochastic' needs key=jax.random.key(...)")


def _check_rs(fmt, order, kahan, aps, rounding, key):
  who = "reduce_scatter"
  _check_common(who, fmt, rounding, key)
  if order not in REDUCE_SCATTER_ORDERS:
    raise ValueError(f"{who}: order must be one of {REDUCE_SCATTER_ORDERS}, got order={order!r}")
  if not is_elementwise(fmt):
    if order != "all_to_all":
      raise TypeError(
          f"{who}: fmt={fmt!r} is a block format: it is a wire format of order='all_to_all' "
          "(quantize once, all-to-all, float32 sum); a per-hop rounding of partial sums to a "
          f"block format is not defined (order={order!r})")
    _row_format(fmt, who)
    if aps:
      raise TypeError(f"{who}: aps=True needs an elementwise fmt (APS scales to the format's "
                      f"largest exponent), got the block format {fmt!r}")
  if kahan and order not in ("chain", "ring"):
    raise ValueError(f"{who}: kahan=True needs order='chain' or 'ring', got order={order!r}")


def _scatter_dim(who, l, shape, d, w, tiled):
  nd = len(shape)
  if nd == 0:
    raise ValueError(f"{who}: leaf {l} is a scalar: there is no dimension to scatter")
  if not isinstance(d, int) or isinstance(d, bool) or not -nd <= d < nd:
    raise ValueError(f"{who}: scatter_dimension={d!r} is out of range for leaf {l} of shape "
                     f"{shape}")
  d %= nd
  if not tiled and shape[d] != w:
    raise ValueError(f"{who}: tiled=False needs dimension {d} of leaf {l} (shape {shape}) to "
                     f"have size W={w}, got {shape[d]}")
  if shape[d] % w:
    raise ValueError(
        f"{who}: dimension {d} of leaf {l} (shape {shape}) has size {shape[d]}, not a multiple "
        f"of the {w} workers; pad it first (e.g. flatten the leaf and pad the flat vector to a "
        f"multiple of {w}: that keeps psum's ring chunks)")
  return d


# ---------------------------------------------------------------------------------------------
# reduce_scatter

def reduce_scatter(x, axis_name, *, scatter_dimension: int = 0, fmt=None, order: str = "ring",
                   kahan: bool = False, aps: bool = False, rounding: str = "nearest", key=None,
                   tiled: bool = True, pack: bool = True):
  """Sum ``x`` over ``axis_name`` and give worker ``o`` slab ``o`` of the sum, every rounding
  specified (the module docstring of :mod:`jaxlp.parallel._sharded` has the full semantics).

  For the orders ``"ring"``, ``"chain"`` and ``"tree"`` (any elementwise ``fmt``, also
  ``None`` = float32) each output element has exactly the bits of the same element of
  :func:`jaxlp.parallel.psum` with the same arguments: ``all_gather(reduce_scatter(x, a,
  ...), a, axis=scatter_dimension)`` equals ``psum(x, a, ...)`` bit for bit.
  ``order="all_to_all"`` rounds each addend once to ``fmt`` (elementwise or a block format:
  MX, int blocks), sends it bit-packed and sums the decoded slabs in float32 in rank order.

  Args:
    x: pytree of float32/float16/bfloat16 arrays (this worker's addends; the same shapes on
      every worker).
    axis_name: a named axis of pmap / shard_map / vmap, or a tuple of them (worker-major).
    scatter_dimension: the dimension cut into W slabs (its size must be a multiple of W).
    fmt: ``None`` (float32 partial sums, :data:`jaxlp.formats.FP32`), an elementwise jaxlp
      format, or (``order="all_to_all"`` only) an axis-blocked block format.
    order: ``"ring"`` | ``"chain"`` | ``"tree"`` | ``"native"`` | ``"all_to_all"``.
    kahan: compensated summation (chain, ring), as in psum.
    aps: Auto Precision Scaling per leaf (the shift from the whole leaf, as in psum).
    rounding: rounding mode of every ``Q``.
    key: PRNG key for stochastic rounding (the same on every worker).
    tiled: keep the scatter dimension (size/W); ``False`` needs size W and removes it.
    pack: send packed 8/16-bit words when the format fits (as in psum).

  Returns:
    Pytree of slabs: each leaf has its shape with dimension ``scatter_dimension`` divided by
    W (or removed), and its dtype.

  Raises:
    TypeError: ``fmt`` is not a jaxlp format; a block ``fmt`` with an order other than
      ``"all_to_all"``, without axis blocks, or with ``aps``; a leaf that is not
      float32/float16/bfloat16.
    ValueError: an unknown ``order`` or ``rounding``; ``kahan`` with tree, native or
      all_to_all; stochastic rounding without ``key``; a scalar leaf; ``scatter_dimension``
      out of range; a scatter dimension whose size is not a multiple of W (or not W with
      ``tiled=False``).

  Example:
    Four workers (a named ``vmap``) with a vector of four each; worker ``o`` gets element
    ``o`` of the E4M3 ring sum, which is :func:`jaxlp.parallel.psum`'s:

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> g = jnp.array([[1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4],
    ...                [10.0, 20.0, 30.0, 40.0], [0.5, 0.5, 0.5, 0.5]])
    >>> rs = lambda x: P.reduce_scatter(x, "w", fmt=F.E4M3)
    >>> jax.jit(jax.vmap(rs, axis_name="w"))(g)
    Array([[12.],
           [22.],
           [32.],
           [44.]], dtype=float32)
    >>> jax.jit(jax.vmap(lambda x: P.psum(x, "w", fmt=F.E4M3), axis_name="w"))(g)[0]
    Array([12., 22., 32., 44.], dtype=float32)
  """
  fmt = FP32 if fmt is None else fmt
  _check_rs(fmt, order, kahan, aps, rounding, key)
  if not is_elementwise(fmt):
    fmt = _row_format(fmt, "reduce_scatter")
  w = _axes.axis_size(axis_name)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  out = []
  for l, leaf in enumerate(leaves):
    leaf = jnp.asarray(leaf)
    if leaf.dtype not in _FLOAT_DTYPES:
      raise TypeError(f"reduce_scatter: leaves must be float32/float16/bfloat16, got leaf {l} "
                      f"of dtype={leaf.dtype}")
    d = _scatter_dim("reduce_scatter", l, leaf.shape, scatter_dimension, w, tiled)
    q = _Rounder(fmt, rounding, key, l)
    res = _rs_leaf(leaf, axis_name, w, q, order, kahan, aps, pack, d)
    out.append(_slab_shape(res, leaf.shape, d, w, tiled).astype(leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def _slab_shape(flat, shape, d, w, tiled):
  k = shape[d] // w
  if tiled:
    return flat.reshape(shape[:d] + (k,) + shape[d + 1:])
  return flat.reshape(shape[:d] + shape[d + 1:])


def _rs_leaf(leaf, axis_name, w, q, order, kahan, aps, pack, d):
  """This worker's slab (flat, float32) of one leaf."""
  shape = leaf.shape
  x = leaf.astype(jnp.float32).reshape(-1)
  # psum's non-finite policy: non-finite addends enter as NaN (see the end for the leaf)
  x = jnp.where(jnp.isfinite(x), x, jnp.float32(jnp.nan))
  n = x.size
  me = _axes.axis_index(axis_name)
  elementwise = is_elementwise(q.fmt)
  codec = codec_for(q.fmt) if (pack and elementwise) else None
  if n == 0:
    return x
  if aps:
    shift, _, bad = aps_shift(x, axis_name, q.fmt, w)
    x = q(scale_pow2(x, shift), _iota(n), me, TAG_PRE)
  idx_rows = _slab_rows(_iota(n), shape, d, w)
  my_idx = _take_row(idx_rows, me)
  if order == "ring":
    aligned = math.prod(shape[:d]) == 1
    res = _ring_rs(x, axis_name, w, me, q, kahan, codec, None if aligned else my_idx)
  elif order == "native":
    xq = x if aps else q(x, _iota(n), me, TAG_PRE)
    red = _psum_scatter_rows(_slab_rows(xq, shape, d, w), axis_name)
    res = q(red, my_idx, w, TAG_SUM)
  elif order == "all_to_all":
    rows = _slab_rows(x, shape, d, w)
    qr = rows if aps else q(rows, idx_rows, me, TAG_PRE)
    wire = _wire(q.fmt, pack, "reduce_scatter")
    res = _alltoall_sum(wire, qr, rows, axis_name, w)
  else:
    rows = _slab_rows(x, shape, d, w)
    use = codec if aps else None
    payload = rows if use is None else use.encode(rows)
    recv = _axes.all_to_all(payload, axis_name)
    g = recv if use is None else use.decode(recv)
    res = chain_sum(g, q, kahan, my_idx) if order == "chain" else tree_sum(g, q, w, my_idx)
  if aps:
    res = scale_pow2(res, -shift)
    res = jnp.where(bad, jnp.float32(jnp.nan), res)
  if not elementwise:  # block wire formats: a non-finite block arrives as a NaN block
    return res
  # a leaf with a non-finite value in any worker's slab is NaN in every slab (as in psum: one
  # flag per leaf, max-reduced over the workers)
  nonfinite = _axes.pmax(jnp.any(~jnp.isfinite(res)).astype(jnp.int32), axis_name)
  return jnp.where(nonfinite > 0, jnp.float32(jnp.nan), res)


def _encode_rows(wire, q_rows, v_rows):
  return jax.vmap(wire.encode)(q_rows, v_rows)


def _decode_rows(wire, payload, m):
  return jax.vmap(lambda p: wire.decode(p, m))(payload)


def _alltoall_sum(wire, q_rows, v_rows, axis_name, w):
  """Rows ``q_rows`` (W, m) sent row o to worker o in the wire format; the received rows
  decoded and summed in float32 in rank order."""
  m = q_rows.shape[1]
  payload = _encode_rows(wire, q_rows, v_rows)
  recv = fused_collective(lambda b: _axes.all_to_all(b, axis_name), payload, 1)
  return rank_sum(_decode_rows(wire, recv, m))


def fused_collective(collective, payload, lead: int):
  """Run ``collective`` ONCE on every array of the pytree ``payload`` (the codes and scales of
  a wire payload): each array's bits as bytes (its first ``lead`` dimensions kept, the rest
  flattened), concatenated along the last axis into one uint8 buffer; the result is split and
  bitcast back (``collective`` adds or keeps leading dimensions; the bits are unchanged).
  One collective instead of one per array: each is a rendezvous of every worker, whose fixed
  cost (milliseconds between processes) outweighs the bytes of small payloads. A payload of
  one array, or with a dtype that has no byte view (bool), runs the collectives as before."""
  leaves, treedef = jax.tree_util.tree_flatten(payload)
  arrs = [jnp.asarray(a) for a in leaves]
  if len(arrs) < 2 or any(not jnp.issubdtype(a.dtype, jnp.number) for a in arrs):
    return jax.tree_util.tree_map(lambda a: bitwise(collective, a), payload)
  parts, sizes = [], []
  for a in arrs:
    b = a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)
    b = b.reshape(a.shape[:lead] + (-1,))
    parts.append(b)
    sizes.append(b.shape[-1])
  got = collective(jnp.concatenate(parts, axis=-1))
  out_lead = got.shape[:-1]
  out, off = [], 0
  for a, k in zip(arrs, sizes, strict=True):
    piece = got[..., off:off + k]
    off += k
    isz = a.dtype.itemsize
    if a.dtype == jnp.uint8:
      out.append(piece.reshape(out_lead + a.shape[lead:]))
    elif isz == 1:
      out.append(lax.bitcast_convert_type(piece.reshape(out_lead + a.shape[lead:]), a.dtype))
    else:
      out.append(lax.bitcast_convert_type(piece.reshape(out_lead + a.shape[lead:] + (isz,)),
                                          a.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def rank_sum(rows):
  """``((rows[0] + rows[1]) + rows[2]) + ...`` in IEEE float32 (gradual underflow).

  The rows are materialised first (``optimization_barrier``, an identity): otherwise XLA:CPU
  fuses the rows' producer (the wire decode) into the chain of adds and, since the exact add
  reads each operand several times, recomputes the decode once per read -- in the
  per-device program of ``shard_map`` (one worker per process) the int4-block decode + sum of
  a 1536 x 1536 leaf took 274 ms of CPU for 4 workers instead of 36 (a named ``vmap``
  happened not to fuse it). The adds are :func:`~jaxlp.parallel._arith.add_f32` (branch-free: a
  ``lax.cond`` on "no subnormal in sight" would run both chains under the Trainer's ``vmap``).
  """
  rows = lax.optimization_barrier(rows)
  acc = rows[0]
  for r in range(1, rows.shape[0]):
    acc = add_f32(acc, rows[r])
  return acc


def _psum_scatter_rows(rows, axis_name):
  """Row ``me`` of the backend's sum of ``rows`` (W, m): one ``psum_scatter`` per axis name."""
  axes = _axes.as_tuple(axis_name)
  sizes = tuple(int(lax.axis_size(a)) for a in axes)
  out = rows.reshape(sizes + rows.shape[1:])
  for a in axes:
    out = lax.psum_scatter(out, a, scatter_dimension=0, tiled=False)
  return out


def _ring_rs(x, axis_name, w, me, q, kahan, codec, my_idx):
  """psum's ring reduce-scatter, then each finished chunk to its owner (``my_idx`` None:
  chunk c is slab c, one hop; else the chunks are all-gathered and slab ``my_idx`` taken)."""
  s = ring_reduce_scatter(x.reshape(w, x.size // w), axis_name, w, me, q, kahan, codec)
  if w == 1:
    return s
  # Worker i now holds the finished chunk (i + 1) mod W.
  if my_idx is None:
    if codec is None:
      return _axes.ring_shift(s, axis_name)
    return codec.decode(_axes.ring_shift(codec.encode(s), axis_name))
  return jnp.take(ring_gather(s, axis_name, codec), my_idx.astype(jnp.int32))


# ---------------------------------------------------------------------------------------------
# all_gather

def all_gather(x, axis_name, *, axis: int = 0, fmt=None, tiled: bool = True,
               rounding: str = "nearest", key=None, pack: bool = True):
  """Gather every worker's shard along ``axis``, optionally rounded once to ``fmt`` for the wire.

  With ``fmt`` each worker rounds its shard once (``jaxlp.quantize`` semantics; a block format
  uses its own blocks on the shard) and sends it in the wire format (packed 8/16-bit words for
  elementwise formats that fit, bit-packed codes + block scales for ``mx(...)`` /
  ``BlockFormat(axis=...)``: ZeRO++'s qwZ); every worker decodes the same bits. Stochastic
  noise: element ``i`` (flat C-order index in the gathered leaf ``l``) gets the noise word of
  ``jaxlp.quantize(gathered, fmt, "stochastic", key=jax.random.fold_in(key, l))``, so for an
  elementwise ``fmt`` the result equals quantizing the gathered array with that key.

  Args:
    x: pytree of float32/float16/bfloat16 arrays (this worker's shard; ``fmt=None`` takes any
      dtype).
    axis_name: a named axis of pmap / shard_map / vmap, or a tuple of them (worker-major).
    axis: where the shards are joined (``tiled``) or stacked (``tiled=False``: a new axis).
    fmt: ``None`` (the shard's own bits), an elementwise jaxlp format or an axis-blocked
      block format.
    tiled: concatenate along ``axis`` (True) or stack along a new ``axis``.
    rounding: rounding mode of the one rounding.
    key: PRNG key for stochastic rounding (the same on every worker).
    pack: send packed 8/16-bit words when an elementwise format fits.

  Returns:
    Pytree of gathered arrays (W times the shard along ``axis``, or stacked), each in its
    shard's dtype, identical on every worker.

  Raises:
    TypeError: ``fmt`` is not a jaxlp format, or a block format without axis blocks; with
      ``fmt``, a leaf that is not float32/float16/bfloat16.
    ValueError: ``axis`` out of range; an unknown ``rounding``; stochastic rounding without
      ``key``.

  Example:
    Two workers each hold two values; they travel as 8-bit E4M3 words:

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> shards = jnp.array([[1.0, 0.3], [100.0, -7.1]])
    >>> ag = lambda s: P.all_gather(s, "w", fmt=F.E4M3)
    >>> jax.jit(jax.vmap(ag, axis_name="w"))(shards)[0]
    Array([ 1.    ,  0.3125, 96.    , -7.    ], dtype=float32)
  """
  if fmt is not None:
    _check_common("all_gather", fmt, rounding, key)
    if not is_elementwise(fmt):
      _row_format(fmt, "all_gather")
  w = _axes.axis_size(axis_name)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  items = []
  for l, leaf in enumerate(leaves):
    leaf = jnp.asarray(leaf)
    shape = leaf.shape
    nd = len(shape)
    lim = nd if tiled else nd + 1
    if not isinstance(axis, int) or isinstance(axis, bool) or not -max(lim, 1) <= axis < lim \
        or (tiled and nd == 0):
      raise ValueError(f"all_gather: axis={axis!r} is out of range for leaf {l} of shape "
                       f"{shape} (tiled={tiled})")
    if fmt is not None and leaf.dtype not in _FLOAT_DTYPES:
      raise TypeError(f"all_gather: with fmt, leaves must be float32/float16/bfloat16, got "
                      f"leaf {l} of dtype={leaf.dtype}")
    items.append((leaf, fmt, l, axis % lim))
  stacked = gather_jobs(items, axis_name, w, rounding=rounding, key=key, pack=pack)
  out = [_join(st, it[0].shape, it[3], w, tiled) for st, it in zip(stacked, items, strict=True)]
  return jax.tree_util.tree_unflatten(treedef, out)


def gather_jobs(items, axis_name, w, *, rounding="nearest", key=None, pack=True):
  """Every worker's copy of several leaves with ONE all-gather: ``items`` are ``(leaf, fmt,
  l, a)`` (``fmt`` None: the leaf's own bits; else rounded once to ``fmt`` as in
  :func:`all_gather`, leaf number ``l``, gathered along ``a``); the payloads of all leaves are
  concatenated into one uint8 buffer (:func:`fused_collective`) and each leaf is decoded from
  its part, with the bits of one all-gather per leaf. Returns the ``(W,) + shape`` stacks."""
  sends, ctxs = [], []
  for leaf, fmt, l, a in items:
    if fmt is None:
      sends.append(leaf)
      ctxs.append(None)
    else:
      p, c = _gather_encode(leaf, axis_name, w, fmt, rounding, key, l, a, pack)
      sends.append(p)
      ctxs.append(c)
  got = fused_collective(lambda b: _axes.all_gather(b, axis_name), sends, 0) if sends else []
  out = []
  for (leaf, fmt, _, _), g, c in zip(items, got, ctxs, strict=True):
    out.append(g if fmt is None else _gather_decode(g, c, w).astype(leaf.dtype))
  return out


def _join(stacked, shape, a, w, tiled):
  moved = jnp.moveaxis(stacked, 0, a)
  if not tiled:
    return moved
  return moved.reshape(shape[:a] + (w * shape[a],) + shape[a + 1:])


def _gathered_index(shape, a, me, w):
  """uint32 flat index, in the gathered array, of every element of this worker's shard."""
  n = math.prod(shape)
  if n * w >= 2**32:
    raise ValueError(f"all_gather: stochastic rounding supports < 2**32 gathered elements, got "
                     f"{n * w}")
  inner = math.prod(shape[a:])  # elements per index of the leading dims
  loc = _iota(n)
  if inner == 0:
    return loc.reshape(shape)
  p = loc // jnp.uint32(inner)
  rest = loc % jnp.uint32(inner)
  g = p * jnp.uint32(w * inner) + me.astype(jnp.uint32) * jnp.uint32(inner) + rest
  return g.reshape(shape)


def _gather_encode(leaf, axis_name, w, fmt, rounding, key, l, a, pack):
  """(payload, context): this worker's shard rounded once to ``fmt``, in the wire format."""
  shape = leaf.shape
  x = leaf.astype(jnp.float32)
  me = _axes.axis_index(axis_name)
  if rounding == "stochastic":
    k0, k1 = key_words(jax.random.fold_in(key, l))
    rand = B.hash_bits(k0, k1, _gathered_index(shape, a, me, w))
  else:
    rand = jnp.zeros((), jnp.uint32)
  if is_elementwise(fmt):
    q = quantize_f32(x, fmt, rounding, rand, None)
    wire = _wire(fmt, pack)
    flat = q.reshape(-1)
    return wire.encode(flat, flat), (wire, shape, None, None)
  # block format: rows along its block axis
  check_block_axis(fmt, shape)
  ax = (fmt.axis % len(shape)) if shape else 0
  vm = jnp.moveaxis(x.reshape(shape or (1,)), ax, -1)
  m = vm.shape[-1]
  rows_v = vm.reshape(-1, m)
  wire = _wire(fmt, pack)
  if rounding == "nearest":  # the codes of Q(x) straight from x (the same bits)
    payload = jax.vmap(wire.encode_nearest)(rows_v)
  else:
    q = quantize_f32(x, fmt, rounding, rand, None)
    rows_q = jnp.moveaxis(q.reshape(shape or (1,)), ax, -1).reshape(-1, m)
    payload = _encode_rows(wire, rows_q, rows_v)
  return payload, (wire, shape, vm.shape, ax)


def _gather_decode(got, ctx, w):
  """(W,) + shape float32 from the gathered payloads of :func:`_gather_encode`."""
  wire, shape, mshape, ax = ctx
  if mshape is None:
    n = math.prod(shape)
    return jax.vmap(lambda p: wire.decode(p, n))(got).reshape((w,) + shape)
  m = mshape[-1]
  # materialised (an identity; see rank_sum): not re-decoded inside every consumer's fusion
  vals = lax.optimization_barrier(jax.vmap(lambda p: _decode_rows(wire, p, m))(got))  # (W,R,m)
  vals = jnp.moveaxis(vals.reshape((w,) + mshape), -1, ax + 1)
  return vals.reshape((w,) + shape)
