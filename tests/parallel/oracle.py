"""numpy oracles of jaxlp.parallel.psum (float32 adds in numpy, which never flush subnormals;
Q = jaxlp's bit-level quantize)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats import _bits as B
from jaxlp.formats._quantize import is_elementwise, key_words, quantize_f32
from jaxlp.parallel._aps import format_emax

F32 = np.float32


_qjit = jax.jit(quantize_f32, static_argnums=(1, 2, 4))
_hash = jax.jit(B.hash_bits)


class Q:
  def __init__(self, fmt, rounding="nearest", key=None, leaf=0):
    self.fmt, self.rounding = fmt, rounding
    self.key = None if key is None else jax.random.fold_in(key, leaf)

  def __call__(self, x, idx, r, tag):
    x = np.asarray(x, F32)
    if is_elementwise(self.fmt) and x.size:
      # Elementwise: each element's bits depend only on its value and noise word, so the
      # oracle rounds a zero-padded flat copy whose length is a power of two (>= 256): a few
      # compiled shapes for every call instead of one per chunk/slab shape.
      n = x.size
      m = max(256, 1 << (n - 1).bit_length())
      xp = np.zeros(m, F32)
      xp[:n] = x.reshape(-1)
      ip = np.zeros(m, np.uint32)
      ip[:n] = np.broadcast_to(np.asarray(idx, np.uint32), x.shape).reshape(-1)
      return self._round(xp, ip, r, tag)[:n].reshape(x.shape)
    return self._round(x, idx, r, tag)

  def _round(self, x, idx, r, tag):
    if self.key is None:
      rand = jnp.zeros((), jnp.uint32)
    else:
      k0, k1 = key_words(jax.random.fold_in(jax.random.fold_in(self.key, r), tag))
      rand = _hash(k0, k1, jnp.asarray(idx, jnp.uint32))
    return np.asarray(_qjit(jnp.asarray(x), self.fmt, self.rounding, rand, None))


def _step(s, c, g, idx, r, q, kahan):
  if not kahan:
    return q(F32(s + g) if np.ndim(s) == 0 else (s + g).astype(F32), idx, r, 0), c
  y = q((g - c).astype(F32), idx, r, 1)
  t = q((s + y).astype(F32), idx, r, 0)
  c = q((q((t - s).astype(F32), idx, r, 2) - y).astype(F32), idx, r, 3)
  return t, c


def chain(gs, q, kahan=False):
  idx = np.arange(gs.shape[1], dtype=np.uint32)
  s = q(gs[0], idx, 0, 0)
  c = np.zeros_like(s)
  for r in range(1, len(gs)):
    s, c = _step(s, c, gs[r], idx, r, q, kahan)
  return s


def ring(gs, q, kahan=False):
  w, n = gs.shape
  length = -(-n // w)
  xs = np.zeros((w, w * length), F32)
  xs[:, :n] = gs
  xs = xs.reshape(w, w, length)
  out = []
  for c in range(w):
    idx = np.arange(length, dtype=np.uint32) + c * length
    s = q(xs[c, c], idx, c, 0)
    cc = np.zeros_like(s)
    for k in range(1, w):
      r = (c + k) % w
      s, cc = _step(s, cc, xs[r, c], idx, r, q, kahan)
    out.append(s)
  return np.concatenate(out)[:n]


def tree(gs, q):
  w = len(gs)
  idx = np.arange(gs.shape[1], dtype=np.uint32)
  nodes = list(gs)
  if w == 1:
    return q(nodes[0], idx, 0, 0)
  lv = 0
  while len(nodes) > 1:
    nxt = [q((nodes[p] + nodes[p + 1]).astype(F32), idx, w + lv * w + p // 2, 0)
           for p in range(0, len(nodes) - 1, 2)]
    if len(nodes) % 2:
      nxt.append(nodes[-1])
    nodes, lv = nxt, lv + 1
  return nodes[0]


def ceil_log2_exact(v):
  """ceil(log2(v)) of a positive Python Fraction/float, exactly (float64-free)."""
  from fractions import Fraction
  v = Fraction(v)
  a = v.numerator.bit_length() - v.denominator.bit_length()
  while Fraction(2) ** a < v:
    a += 1
  while Fraction(2) ** (a - 1) >= v:
    a -= 1
  return a


def aps_sum(gs, fmt, summer, q):
  """APS oracle: A = ceil(log2(max|g| W)), shift = emax - A, Q(g 2^shift), sum, unscale."""
  from fractions import Fraction
  w = len(gs)
  if not np.all(np.isfinite(gs)):
    return np.full(gs.shape[1], np.nan, F32)
  m = np.max(np.abs(gs))
  if m == 0:
    return np.zeros(gs.shape[1], F32)
  a = ceil_log2_exact(Fraction(float(m)) * w)
  shift = format_emax(fmt) - a
  scaled = np.stack([(g.astype(np.float64) * 2.0**shift).astype(F32) for g in gs])
  idx = np.arange(gs.shape[1], dtype=np.uint32)
  pre = np.stack([q(scaled[r], idx, r, 7) for r in range(w)])
  s = summer(pre)
  return (s.astype(np.float64) * 2.0**-shift).astype(F32)


# -- sharded collectives (jaxlp.parallel.reduce_scatter / all_gather) -------------------------

def slab_rows(a, shape, d, w):
  """(W, m): row o = slab o (indices o*k..(o+1)*k-1 of dimension d) of the flat leaf ``a``,
  in C order; numpy indexing, independent of jaxlp's reshapes."""
  arr = np.asarray(a).reshape(shape)
  k = shape[d] // w
  rows = []
  for o in range(w):
    sl = [slice(None)] * len(shape)
    sl[d] = slice(o * k, (o + 1) * k)
    rows.append(arr[tuple(sl)].reshape(-1))
  return np.stack(rows)


def psum_full(order, gs, q, kahan=False):
  """psum's oracle for one leaf (gs: (W, n) float32)."""
  if order == "chain":
    return chain(gs, q, kahan)
  if order == "ring":
    return ring(gs, q, kahan)
  return tree(gs, q)


def reduce_scatter(order, gs, shape, d, q, kahan=False, aps_fmt=None):
  """Row o = worker o's slab of psum's oracle (the key property of reduce_scatter)."""
  w = len(gs)
  if aps_fmt is None:
    full = psum_full(order, gs, q, kahan)
  else:
    full = aps_sum(gs, aps_fmt, lambda p: psum_full(order, p, q, kahan), q)
  return slab_rows(full, shape, d, w)


def all_to_all_sum(gs, shape, d, q, signed_zero=True):
  """order='all_to_all': worker r rounds its (W, m) slab rows once (Q with tag 7, the noise
  index of every element its flat index in the leaf); worker o sums row o of every worker in
  float32 in rank order. ``signed_zero=False``: the wire maps -0 to +0 (MXINT8)."""
  w, n = gs.shape
  idx = slab_rows(np.arange(n, dtype=np.uint32), shape, d, w)
  qs = []
  for r in range(w):
    qr = q(slab_rows(gs[r], shape, d, w), idx, r, 7)
    if not signed_zero:
      qr = np.where(qr == 0, F32(0), qr)
    qs.append(qr)
  acc = qs[0].copy()
  for r in range(1, w):
    acc = (acc + qs[r]).astype(F32)
  return acc


def gathered_index(gathered_shape):
  return np.arange(int(np.prod(gathered_shape)), dtype=np.uint32).reshape(gathered_shape)


def all_gather(shards, fmt, axis=0, tiled=True, rounding="nearest", key=None, leaf=0,
               signed_zero=True):
  """Every shard rounded once to ``fmt`` (its own blocks; the noise word of an element its
  flat index in the gathered array under key fold_in(key, leaf)), then joined along axis."""
  w = len(shards)
  join = (lambda a: np.concatenate(list(a), axis=axis)) if tiled else (
      lambda a: np.stack(list(a), axis=axis))
  if fmt is None:
    return join(shards)
  gshape = join(np.zeros_like(shards)).shape
  gidx = gathered_index(gshape)
  # each worker's part of the gathered index array, by the same join
  parts = np.stack([np.take(gidx, range(j * (shards.shape[axis + 1] if tiled else 1),
                                        (j + 1) * (shards.shape[axis + 1] if tiled else 1)),
                            axis=axis).reshape(shards.shape[1:]) for j in range(w)])
  if rounding == "stochastic":
    k0, k1 = key_words(jax.random.fold_in(key, leaf))
    rands = [np.asarray(_hash(k0, k1, jnp.asarray(p))) for p in parts]
  else:
    rands = [np.zeros((), np.uint32)] * w
  out = []
  for s, rnd in zip(shards, rands, strict=True):
    v = np.asarray(_qjit(jnp.asarray(s, jnp.float32), fmt, rounding, jnp.asarray(rnd), None))
    if not signed_zero:
      v = np.where(v == 0, F32(0), v)
    out.append(v)
  return join(np.stack(out))
