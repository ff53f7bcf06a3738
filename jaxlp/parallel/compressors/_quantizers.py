"""Dense quantizers: CGX max-min buckets, QSGD, 1-bit (+EF), TBQ (+residual), TernGrad."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp._util import cdiv, check_bool, check_int, check_number
from jaxlp.parallel._aggregate import DENSE_QUANTIZERS
from jaxlp.parallel._arith import sqrt_f32
from jaxlp.parallel.compressors._base import (
  DOWN,
  F32_MAX,
  apart,
  det_sum,
  exact_div,
  flat_in,
  materialize,
  no_fma,
  numel,
  pack_bits,
  pack_bits_vectorized,
  packed_nbytes,
  per_element,
  redo_where,
  safe_mean,
  uniform01,
  unpack_bits,
)

_CGX_EPS = 1e-10


def _flat_f32(g):
  return jnp.ravel(g).astype(jnp.float32)


def _cgx_levels_exact(d, unit, r, top):
  safe = jnp.where(unit < _CGX_EPS, jnp.float32(1.0), unit)
  lev = jnp.floor(exact_div(d, safe) + r)
  return jnp.where(unit < _CGX_EPS, 0.0, jnp.clip(lev, 0.0, top))


def _range_unit(mx, mn, top):
  """``(unit, ovf)``: ``unit = (mx - mn) / top`` correctly rounded (per bucket, or a scalar),
  and where ``mx - mn`` overflows float32 (finite ``mx``, ``mn``: the range reaches
  ``2 * F32_MAX``) ``ovf`` and the unit from the halved range (exact): ``2 * ((mx/2 -
  mn/2) / top)``, kept within ``F32_MAX`` (only ``top == 1`` can exceed it)."""
  d = mx - mn
  ovf = jnp.isinf(d) & jnp.isfinite(mx) & jnp.isfinite(mn)
  half = exact_div(mx * jnp.float32(0.5) - mn * jnp.float32(0.5), top)
  return jnp.where(ovf, jnp.minimum(half * jnp.float32(2.0), F32_MAX), exact_div(d, top)), ovf


def _halve_where(big):
  """``(s, 1/s)``: ``(0.5, 2.0)`` where ``big``, else ``(1.0, 1.0)`` (exact scalings)."""
  return (jnp.where(big, jnp.float32(0.5), jnp.float32(1.0)),
          jnp.where(big, jnp.float32(2.0), jnp.float32(1.0)))


def _hipress_scale(mn, mx):
  """``(s, 1/s)`` of TernGrad's HiPress variant: ``2**-4`` where ``mx - mn >= 2**126`` (or
  overflows) for finite ``mn``, ``mx``: the gap's reciprocal stays normal; else 1."""
  big = ~(mx - mn < jnp.float32(2.0 ** 126)) & jnp.isfinite(mx) & jnp.isfinite(mn)
  return (jnp.where(big, jnp.float32(2.0 ** -4), jnp.float32(1.0)),
          jnp.where(big, jnp.float32(2.0 ** 4), jnp.float32(1.0)))


def _cgx_levels(x, mn, unit, r, top, ovf=None):
  """CGX levels ``floor(div_f32(x - min, unit) + r)`` (clipped; 0 where ``unit < 1e-10``) of
  the flat buckets ``x`` (``nb * B`` elements; per-bucket ``mn``, ``unit`` of shape ``(nb,)``;
  ``r`` a scalar or flat like ``x``), float32 ``(nb*B,)``, with the bits of the correctly
  rounded division.

  A correctly rounded division per element is slow (integer significand arithmetic); only
  the floor of ``q + r`` is needed, and it can change only where ``q + r`` is within a few
  ulps of an integer. So ``q`` is estimated as ``(x - min) * (1/unit)`` (relative error below
  ``2**-22``), and the buckets where some ``q + r`` lies within ``2**-21 * (q + 1)`` of an
  integer are redone with the exact division. The window covers the estimate's error
  (``2**-22 q``), the rounding of ``q + r`` and the rounding boundary around the integer
  (``2**-24 (q + r)`` each), with ``r < 1``; an FMA-contracted ``q + r`` only shrinks the
  error. The ambiguous buckets are gathered and redone ``nb // 16 + 16`` at a time until none
  is left (inputs lying on the level grid make every bucket ambiguous: then about 16 rounds
  redo the whole leaf). A NaN level (an inf/NaN bucket) also marks its bucket, and so do a
  unit of at least ``2**126`` (its reciprocal is subnormal, which XLA:CPU flushes to zero)
  and ``ovf`` (per bucket: ``max - min`` overflows float32), whose levels are redone from the
  halved values: ``(x/2 - min/2) / (unit/2)``, the same quotient without the overflow.

  The elementwise pass runs on the flat vector with the per-bucket values repeated
  (:func:`per_element`): over a conv kernel's 4-D gradient, XLA:CPU emits a
  ``(buckets, B)``-shaped loop with per-element index arithmetic (measured 2x slower on
  ``(512, 512, 3, 3)``).
  """
  nb = mn.shape[0]
  bsz = x.shape[0] // nb
  bad = unit < _CGX_EPS
  # per-bucket values: materialised, not fused (and recomputed) into every element's loop
  inv = materialize(exact_div(jnp.float32(1.0), jnp.where(bad, jnp.float32(1.0), unit)))
  q0 = (x - per_element(mn, bsz, x.shape[0])) * per_element(inv, bsz, x.shape[0])
  z = q0 + r
  fz = jnp.floor(z)
  bad_e = per_element(bad, bsz, x.shape[0])
  lev = jnp.where(bad_e, 0.0, jnp.clip(fz, 0.0, top))
  near = jnp.minimum(z - fz, fz + 1.0 - z) <= jnp.float32(2.0 ** -21) * (q0 + 1.0)
  # one pass: a near-tie element (or a NaN level: an inf/NaN bucket) is marked by the level
  # -1 and a bucket is ambiguous when its smallest level is negative. The marked buckets are
  # all redone exactly, so no mark survives (a fused any() over a boolean mask lowers to a
  # materialised mask and a reduce-window chain on XLA:CPU).
  lev = jnp.where((near & ~bad_e) | jnp.isnan(lev), -1.0, lev)
  amb = jnp.min(lev.reshape(nb, bsz), axis=1) < 0
  if ovf is not None:
    # also every bucket whose 1/unit is subnormal (unit >= 2**126, bits <= 2): XLA:CPU flushes
    # it to zero in the estimate
    amb = amb | ovf | (unit >= jnp.float32(2.0 ** 126))
  xb = x.reshape(nb, bsz)
  rb = jnp.reshape(r, (nb, bsz)) if jnp.ndim(r) else r

  cap = min(nb, nb // 16 + 16)

  def redo(carry):
    lv, todo = carry
    rows = jnp.nonzero(todo, size=cap, fill_value=nb)[0]
    rc = jnp.minimum(rows, nb - 1)
    if ovf is None:
      fixed = _cgx_levels_exact(xb[rc] - mn[rc, None], unit[rc, None],
                                rb[rc] if jnp.ndim(r) else r, top)
    else:  # halved where the range overflows (exact; times 1 elsewhere: the same bits)
      s = _halve_where(ovf[rc])[0][:, None]
      fixed = _cgx_levels_exact(xb[rc] * s - mn[rc, None] * s, unit[rc, None] * s,
                                rb[rc] if jnp.ndim(r) else r, top)
    return lv.at[rows].set(fixed, mode="drop"), todo.at[rows].set(False, mode="drop")

  # a loop, not a switch between "redo a few" and "redo all": under vmap (SRA encodes the W
  # chunks as a batch) a switch becomes a select that computes every branch, the exact
  # division of every element included, fused into the bit packing (measured: 3/4 of CGX's
  # reduction time at W = 4)
  lev, _ = lax.while_loop(lambda c: jnp.any(c[1]), redo, (lev.reshape(nb, bsz), amb))
  return lev.reshape(-1)


@dataclasses.dataclass(frozen=True)
class CGX:
  """CGX bucketed max-min quantization (torch_cgx ``MaxMinEncodeValue``).

  Per bucket of ``bucket_size`` consecutive elements (restarting at every encoded vector):
  ``unit = (max - min)/(2^bits - 1)`` in fp32; ``level = 0`` if ``unit < 1e-10`` else
  ``min(floor((x - min)/unit + r), 2^bits - 1)`` with ``r = 0.5`` (deterministic, CGX's default
  build: round half up in level space) or ``r ~ U[0, 1)`` (``stochastic=True``, QSGD-style
  unbiased; ``r`` of element ``i`` is element ``i`` of ``uniform01(key, (nq,))``, ``nq`` the
  number of quantized elements). Decode ``min + unit*level`` (product rounded separately: no
  FMA). Payload:
  ``meta = [unit_0, min_0, unit_1, min_1, ...]`` (float32) + levels packed LSB-first
  (``ceil(n*bits/8)`` bytes, no alignment padding) + with ``skip_incomplete`` the raw
  ``n mod bucket_size`` tail in fp32. A partial last bucket otherwise has its own min/max.
  A bucket whose ``max - min`` overflows float32 (finite values near ``±F32_MAX``) gets
  ``unit = 2 * ((max/2 - min/2)/(2^bits - 1))`` (at most ``F32_MAX``) and levels from the
  halved values; decode halves ``min`` and ``unit`` where ``min + unit*(2^bits - 1)``
  overflows and doubles the result: the same arithmetic without the overflow (and the same
  bits as before everywhere else).

  References:
    Markov et al., "CGX: Adaptive System Support for Communication-Efficient Deep Learning",
    Middleware 2022; IST-DASLab/torch_cgx ``cuda_compression_operations.cu``.
  """
  bits: int = 4
  bucket_size: int = 512
  stochastic: bool = False
  skip_incomplete: bool = False
  kind = "quantizer"
  aggregation = DENSE_QUANTIZERS
  elementwise_state = True

  def __post_init__(self):
    check_int("cgx", "bits", self.bits)
    check_int("cgx", "bucket_size", self.bucket_size)
    check_bool("cgx", "stochastic", self.stochastic)
    check_bool("cgx", "skip_incomplete", self.skip_incomplete)
    if not 1 <= self.bits <= 8:
      raise ValueError(f"bits={self.bits} must be in 1..8")
    if self.bucket_size < 1:
      raise ValueError(f"bucket_size={self.bucket_size} must be >= 1")

  def init(self, shape, dtype=jnp.float32, key=None):
    del shape, dtype, key
    return ()

  def _split(self, n):
    nq = (n // self.bucket_size) * self.bucket_size if self.skip_incomplete else n
    return nq, cdiv(nq, self.bucket_size)

  def _parts(self, nq):
    """``(full, rem)``: full buckets and the size of the partial last one. The two are
    handled separately (no pad-copy of the gradient); when the full buckets end on a byte
    boundary of the level stream, their levels are packed/unpacked on their own too."""
    full = nq // self.bucket_size
    rem = nq - full * self.bucket_size
    aligned = (full * self.bucket_size * self.bits) % 8 == 0
    return full, rem, aligned

  def _levels(self, x, rows, r):
    """Levels (flat uint32) and ``[[unit, min], ...]`` of ``rows`` equal buckets of flat
    ``x``; ``r`` a scalar or flat like ``x``."""
    top = 2 ** self.bits - 1
    xb = x.reshape(rows, -1)
    mx = jnp.max(xb, axis=1)
    mn = materialize(jnp.min(xb, axis=1))
    unit, ovf = _range_unit(mx, mn, top)
    unit = materialize(unit)
    lev = _cgx_levels(x, mn, unit, r, top, ovf)
    return lev.astype(jnp.uint32), jnp.stack([unit, mn], axis=1)

  def encode(self, g, state, key=None):
    x = _flat_f32(g)
    n = x.shape[0]
    nq, nb = self._split(n)
    if nq == 0:
      meta = jnp.zeros((0,), jnp.float32)
      packed = jnp.zeros((0,), jnp.uint8)
    else:
      if self.stochastic:
        if key is None:
          raise ValueError("cgx(stochastic=True) needs key")
        r = uniform01(key, (nq,))
      else:
        r = None
      full, rem, aligned = self._parts(nq)
      bs = self.bucket_size
      levs, metas = [], []
      for lo, rows, cols in ((0, full, bs), (full * bs, 1 if rem else 0, rem)):
        if rows == 0:
          continue
        sl = slice(lo, lo + rows * cols)
        rr = jnp.float32(0.5) if r is None else r[sl]
        lev, meta = self._levels(x[sl], rows, rr)
        levs.append(lev)
        metas.append(meta)
      if aligned:
        packed = jnp.concatenate([pack_bits(lev, self.bits) for lev in levs])
      else:
        packed = pack_bits(jnp.concatenate(levs), self.bits)
      meta = jnp.concatenate(metas).reshape(-1)
    payload = {"meta": meta, "levels": packed}
    if self.skip_incomplete:
      payload["tail"] = x[nq:]
    return payload, state

  def decode(self, payload, shape):
    n = numel(shape)
    nq, nb = self._split(n)
    # decode is elementwise: keep XLA from fusing (and redoing) the encoder's work into it
    # when both run in one program
    payload = lax.optimization_barrier(payload)
    outs = []
    if nq:
      full, rem, aligned = self._parts(nq)
      bs = self.bucket_size
      meta = payload["meta"].reshape(nb, 2)
      packed = payload["levels"]
      if not aligned:
        every = unpack_bits(packed, self.bits, nq)
      for i, (lo, rows, cols) in enumerate(((0, full, bs), (full * bs, 1 if rem else 0, rem))):
        if rows == 0:
          continue
        if aligned:
          start = lo * self.bits // 8
          lev = unpack_bits(packed[start:start + packed_nbytes(rows * cols, self.bits)],
                            self.bits, rows * cols)
        else:
          lev = every[lo:lo + rows * cols]
        lev = lev.astype(jnp.float32).reshape(rows, cols)
        m = meta[i * full:i * full + rows]
        unit, mn = m[:, 0:1], m[:, 1:2]
        # a bucket whose top level overflows float32 (a range near or beyond F32_MAX) is
        # decoded from the halved min and unit and doubled (exact); elsewhere times 1
        top = no_fma(unit * jnp.float32(2 ** self.bits - 1), anchor=payload["meta"])
        s, inv = _halve_where(jnp.isinf(mn + top) & jnp.isfinite(mn) & jnp.isfinite(unit))
        outs.append(((mn * s + no_fma((unit * s) * lev, anchor=payload["meta"])) * inv)
                    .reshape(-1))
    if self.skip_incomplete:
      outs.append(payload["tail"])
    if not outs:
      return jnp.zeros(shape, jnp.float32)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    return out.reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    del dtype
    n = numel(shape)
    nq, nb = self._split(n)
    return 8 * nb + packed_nbytes(nq, self.bits) + 4 * (n - nq)


def cgx(bits=4, bucket_size=512, stochastic=False, skip_incomplete=False) -> CGX:
  """CGX max-min bucket quantizer: each bucket sends its min, its unit
  ``(max - min)/(2^bits - 1)`` and one ``bits``-bit level per element (the full
  specification is the docstring of the returned object's class).

  Args:
    bits: bits per level, 1 to 8.
    bucket_size: elements per bucket (positive int).
    stochastic: stochastic level rounding (unbiased) instead of round-half-up.
    skip_incomplete: send the last partial bucket raw (float32) instead of quantized.

  Returns:
    The compressor (a frozen dataclass; pass it to :func:`jaxlp.parallel.reduce_gradients`
    or :func:`jaxlp.parallel.compressed_allreduce`).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: a value out of range.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> c = compressors.cgx(bits=4, bucket_size=512)
    >>> c.wire_bytes((1024,))
    528
  """
  return CGX(bits, bucket_size, stochastic, skip_incomplete)


def _big_norm(xb, anchor):
  """Row norms of ``xb`` whose squares overflow float32: from ``xb * 2**-100``, rescaled; a
  norm beyond float32 is replaced by the row's ``max |x|`` (inf or NaN rows stay so)."""
  xs = xb * jnp.float32(DOWN)
  ns = sqrt_f32(det_sum(no_fma(xs * xs, anchor=anchor)))
  big = ns * jnp.float32(1.0 / DOWN)
  return jnp.where(jnp.isfinite(ns) & jnp.isinf(big), jnp.max(jnp.abs(xb), axis=1), big)


def _recip_split(levels: int):
  """``1/levels`` as float32 ``hi + lo``: ``hi`` keeps 16 significant bits (so ``l * hi`` is
  exact for any ``l < 2**8``), ``lo`` is the float32 rounding of the rest."""
  m = 1.0 / levels
  e = math.floor(math.log2(m))
  hi = np.float32(round(m * 2.0 ** (15 - e)) * 2.0 ** (e - 15))
  return hi, np.float32(m - float(hi))


@dataclasses.dataclass(frozen=True)
class QSGD:
  """QSGD: per bucket ``norm = ||x||_2`` (squares summed in a fixed pairwise order, correctly
  rounded square root) and ``r = 1/norm`` (correctly rounded; buckets with ``norm == 0`` send
  level 0); ``level = floor((|x| * r) * levels + u)`` (each product rounded to float32, no
  FMA), ``u ~ U[0,1)`` (unbiased; ``u`` of element ``i`` is element ``i`` of
  ``uniform01(key, (n,))``); decode ``norm*sign*(level/levels)``. Codes = sign bit + level, packed
  (``1 + ceil(log2(levels+1))`` bits); float32 norm per bucket. Where the sum of squares
  overflows float32, the norm is computed from ``x * 2**-100`` and rescaled; a norm beyond
  float32 is replaced by the bucket's ``max |x|`` (the infinity norm: still ``>= |x|``, so the
  levels stay unbiased, and no decoded value exceeds ``max |x|``); where the
  norm is at least ``2**126`` (``1/norm`` subnormal, flushed to zero on CPU) the levels use
  ``(|x| * 2**-64) * (1/(norm * 2**-64))``.

  References:
    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
    Encoding", NeurIPS 2017.
  """
  levels: int = 15
  bucket_size: int = 512
  kind = "quantizer"
  aggregation = DENSE_QUANTIZERS
  elementwise_state = True

  def __post_init__(self):
    check_int("qsgd", "levels", self.levels)
    check_int("qsgd", "bucket_size", self.bucket_size)
    if not 1 <= self.levels <= 127:
      raise ValueError(f"levels={self.levels} must be in 1..127")
    if self.bucket_size < 1:
      raise ValueError(f"bucket_size={self.bucket_size} must be >= 1")

  @property
  def bits(self):
    return 1 + max(1, math.ceil(math.log2(self.levels + 1)))

  def init(self, shape, dtype=jnp.float32, key=None):
    del shape, dtype, key
    return ()

  def encode(self, g, state, key=None):
    if key is None:
      raise ValueError("qsgd needs key")
    x = flat_in(g)
    n = x.shape[0]
    nb = cdiv(n, self.bucket_size)
    m = nb * self.bucket_size
    # every elementwise pass runs over whole buckets (m elements): a partial last bucket made
    # XLA:CPU emit each pass with per-element index arithmetic (a slice of the per-bucket
    # values' broadcast), 6.7x slower. The padding is zeros, whose codes are 0, the value
    # pack_bits fills a partial byte with; the noise of element i does not depend on m.
    xp = jnp.pad(x, (0, m - n)) if m != n else x
    xb = xp.reshape(nb, -1)
    ssq = det_sum(no_fma(xb * xb, anchor=x))
    # where the sum of squares overflows (|x| beyond about 2**64 / sqrt(bucket_size)): the
    # norm of x * 2**-100, rescaled; a norm beyond float32 becomes max |x| (still >= every
    # |x|: the levels stay unbiased and no decoded value exceeds max |x|)
    norm = materialize(redo_where(jnp.isinf(ssq), lambda: _big_norm(xb, x), sqrt_f32(ssq)))
    # 1/norm once per bucket (correctly rounded); the elementwise work is done on the flat
    # vector: XLA:CPU emits a (buckets, bucket_size)-shaped loop over a conv kernel's 4-D
    # gradient with per-element index arithmetic (measured 6x slower on (512, 512, 3, 3))
    # a norm of at least 2**126 has a subnormal reciprocal (flushed to zero on CPU): there
    # |x| * 2**-64 times 1/(norm * 2**-64), the same quotient; elsewhere times 1 (same bits)
    down = materialize(jnp.where(norm >= jnp.float32(2.0 ** 126), jnp.float32(2.0 ** -64),
                                 jnp.float32(1.0)))
    inv = materialize(jnp.where(norm > 0, exact_div(jnp.float32(1.0), norm * down), 0.0))

    def codes(x, inv, down, norm, key):
      inv_e = per_element(inv, self.bucket_size, m)
      ax = jnp.abs(x) * per_element(down, self.bucket_size, m)
      u = uniform01(key, (m,))
      lev = jnp.floor(no_fma(no_fma(ax * inv_e, anchor=norm) * jnp.float32(self.levels),
                             anchor=norm) + u)
      lev = jnp.where(inv_e > 0, jnp.clip(lev, 0, self.levels), 0).astype(jnp.uint32)
      return (lev << 1) | (x < 0).astype(jnp.uint32)

    # on large leaves the quantizer (with its noise) runs in a vectorised loop of its own, not
    # inside the packing reduce (see apart for the threshold)
    code = apart(codes, xp, inv, down, norm, key, min_size=2 ** 19)
    packed = pack_bits(code, self.bits)
    if m != n:
      packed = packed[:packed_nbytes(n, self.bits)]
    return {"norm": norm, "codes": packed}, state

  def decode(self, payload, shape):
    n = numel(shape)
    m = cdiv(n, self.bucket_size) * self.bucket_size  # whole buckets, as in encode
    codes = payload["codes"]
    if m != n:
      codes = jnp.pad(codes, (0, packed_nbytes(m, self.bits) - codes.shape[0]))
    # two vectorised loops (unpack; arithmetic), not one over a (groups, 8) view with the
    # packing fused in when encode runs in the same program, nor one over a conv kernel's
    # shape (measured on 2.36M elements: 2.9 -> 0.7 ms)
    code = apart(lambda c: unpack_bits(c, self.bits, m), codes)
    # level/levels, correctly rounded, without a division or a table gather: 1/levels split
    # into hi (16 significant bits, so level*hi is exact) + lo; level*hi + level*lo rounds to
    # the IEEE quotient for every levels in 1..127 and every level < 2**(bits-1) (checked
    # exhaustively by tests/parallel/compress/test_speed_dense.py, with and without FMA)
    hi, lo = _recip_split(self.levels)

    def values(code, nrm):
      lev = (code >> 1).astype(jnp.float32)
      mag = no_fma(lev * jnp.float32(hi), anchor=nrm) + no_fma(lev * jnp.float32(lo), anchor=nrm)
      return per_element(nrm, self.bucket_size, m) * jnp.where((code & 1) == 1, -mag, mag)

    out = apart(values, code, payload["norm"])
    return (out[:n] if m != n else out).reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    n = numel(shape)
    return 4 * (cdiv(n, self.bucket_size)) + packed_nbytes(n, self.bits)


def qsgd(levels=15, bucket_size=512) -> QSGD:
  """QSGD stochastic quantizer with ``levels`` levels per sign and a float32 norm per bucket.

  Args:
    levels: quantization levels, 1 to 127.
    bucket_size: elements per bucket (positive int).

  Returns:
    The compressor (a frozen dataclass).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: a value out of range.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> compressors.qsgd(levels=15).levels
    15
  """
  return QSGD(levels, bucket_size)


@dataclasses.dataclass(frozen=True)
class OneBit:
  """1-bit quantization with error feedback (residual = input - decoded).

  ``scaling="mean"`` (BytePS onebit): ``scale = mean|x|``, bit = ``x < 0``, decode ``±scale``.
  ``scaling="pos_neg_means"`` (Seide et al. 2014 / GRACE): negatives decode to the mean of the
  negative values, the rest to the mean of the non-negative values. ``x = g + residual``.
  Payload: float32 scales (1 or 2) + bits packed LSB-first. A mean whose sum overflows
  float32 is computed from ``x * 2**-32`` and rescaled (the same bits wherever no sum
  overflows).

  References:
    Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
    Distributed Training of Speech DNNs", Interspeech 2014; bytedance/byteps ``onebit.cc``.
  """
  scaling: str = "mean"
  error_feedback: bool = True
  kind = "quantizer"
  aggregation = DENSE_QUANTIZERS
  elementwise_state = True

  def __post_init__(self):
    check_bool("onebit", "error_feedback", self.error_feedback)
    if self.scaling not in ("mean", "pos_neg_means"):
      raise ValueError(f"scaling={self.scaling!r} must be 'mean' or 'pos_neg_means'")

  def init(self, shape, dtype=jnp.float32, key=None):
    del dtype, key
    return {"residual": jnp.zeros((numel(shape),), jnp.float32)} if self.error_feedback else ()

  def encode(self, g, state, key=None):
    x = _flat_f32(g)
    if self.error_feedback:
      x = x + state["residual"]
    neg = x < 0
    # means of values near F32_MAX: see safe_mean (the same bits where no sum overflows)
    if self.scaling == "mean":
      scales = safe_mean(jnp.abs(x), max(x.shape[0], 1)).reshape(1)
    else:
      nneg = jnp.sum(neg)
      npos = x.shape[0] - nneg
      sneg = safe_mean(jnp.where(neg, x, 0.0), jnp.maximum(nneg, 1).astype(jnp.float32))
      spos = safe_mean(jnp.where(neg, 0.0, x), jnp.maximum(npos, 1).astype(jnp.float32))
      scales = jnp.stack([sneg, spos])
    scales = materialize(scales)  # computed once, not in every element's loop (vmap: per chunk)
    payload = {"scale": scales.astype(jnp.float32), "bits": pack_bits(neg, 1)}
    if self.error_feedback:
      state = {"residual": x - self.decode(payload, x.shape)}
    return payload, state

  def decode(self, payload, shape):
    neg = unpack_bits(payload["bits"], 1, numel(shape)) == 1
    s = payload["scale"]
    if self.scaling == "mean":
      out = jnp.where(neg, -s[0], s[0])
    else:
      out = jnp.where(neg, s[0], s[1])
    return out.reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    return 4 * (1 if self.scaling == "mean" else 2) + packed_nbytes(numel(shape), 1)


def onebit(scaling="mean", error_feedback=True) -> OneBit:
  """1-bit SGD (sign bits and per-tensor scales) with error feedback.

  Args:
    scaling: ``"mean"`` (one scale: the mean magnitude) or ``"pos_neg_means"`` (the means of
      the negative and of the positive elements); the returned object's class has the
      exact rule.
    error_feedback: keep the quantization error and add it to the next gradient.

  Returns:
    The compressor (a frozen dataclass).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: an unknown ``scaling``.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> compressors.onebit().wire_bytes((64,))
    12
  """
  return OneBit(scaling, error_feedback)


@dataclasses.dataclass(frozen=True)
class TBQ:
  """Threshold binary quantization with residual (HiPress ``tbq_body.h``, Strom 2015).

  Per element: ``r += g``; ``r >= tau`` -> code 2, ``r -= tau``; ``r <= -tau`` -> code 0,
  ``r += tau``; else code 1. Decode ``(code - 1)*tau``. 4 codes per byte, LSB first; a
  partial last byte is padded with code 1 (0x55 fill).

  References:
    Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
    Interspeech 2015; Bai et al., HiPress, SOSP 2021.
  """
  threshold: float = 1.0
  kind = "quantizer"
  aggregation = DENSE_QUANTIZERS
  elementwise_state = True

  def __post_init__(self):
    check_number("tbq", "threshold", self.threshold)
    if not self.threshold > 0:
      raise ValueError(f"threshold={self.threshold} must be > 0")

  def init(self, shape, dtype=jnp.float32, key=None):
    del dtype, key
    return {"residual": jnp.zeros((numel(shape),), jnp.float32)}

  def encode(self, g, state, key=None):
    tau = jnp.float32(self.threshold)
    r = state["residual"] + _flat_f32(g)
    pos = r >= tau
    neg = r <= -tau
    code = jnp.where(pos, 2, jnp.where(neg, 0, 1)).astype(jnp.uint32)
    r = jnp.where(pos, r - tau, jnp.where(neg, r + tau, r))
    return {"codes": pack_bits(code, 2, pad_code=1)}, {"residual": r}

  def decode(self, payload, shape):
    code = unpack_bits(payload["codes"], 2, numel(shape)).astype(jnp.int32)
    return ((code - 1).astype(jnp.float32) * jnp.float32(self.threshold)).reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    return packed_nbytes(numel(shape), 2)


def tbq(threshold=1.0) -> TBQ:
  """Threshold binary quantization (HiPress TBQ): elements beyond ``±threshold`` send
  ``±threshold`` as 2-bit codes, the rest stays in the residual.

  Args:
    threshold: the positive threshold; it should exceed the typical gradient magnitude for
      the error feedback to drain the residual.

  Returns:
    The compressor (a frozen dataclass).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: a threshold that is not positive.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> compressors.tbq(threshold=0.5).threshold
    0.5
  """
  return TBQ(threshold)


@dataclasses.dataclass(frozen=True)
class TernGrad:
  """TernGrad.

  ``variant="paper"`` (default; Wen et al. 2017): ``s = max|g|`` (after optional clipping to
  ``clip*std``, the paper's c = 2.5), ``g~ = s*sign(g)*Bernoulli(|g|/s)`` -- unbiased ternary,
  kept where ``u*s < |g|`` with ``u = uniform01(key, (n,))``; 2-bit codes ``sign+1`` + float32
  ``s``.
  ``variant="hipress"`` (HiPress ``terngrad_body.h``, b-bit max-min over the whole tensor):
  ``gap = (mx-mn)/(2^b-1)``, ``level = rne((x-mn)/(gap+1e-8))`` or with a key
  ``trunc((x-mn)/(gap+1e-8) + u)``, ``u = uniform01(key, (n,))`` (the trailing partial byte
  always deterministic, as in
  HiPress; u in [0, 1), so HiPress's u == 1 overflow defect cannot happen); decode
  ``level*gap + mn``. Where ``mx - mn`` is at least ``2**126`` (``1/gap`` subnormal, which
  XLA:CPU flushes to zero) or overflows float32, encode and decode use the values times
  ``2**-4`` (``x``, ``mn``, ``mx``: the same levels, exactly) and decode multiplies its result
  by ``2**4``; elsewhere the bits are HiPress's. Message = 10-byte header
  ``[b:u8][tail:u8][mn:f32 LE][mx:f32 LE]`` + codes packed LSB-first.

  References:
    Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
    Learning", NeurIPS 2017; HiPress SOSP 2021 (torch-hipress-extension ``terngrad_body.h``).
  """
  variant: str = "paper"
  bits: int = 2
  clip: float | None = None
  kind = "quantizer"
  aggregation = DENSE_QUANTIZERS
  elementwise_state = True

  def __post_init__(self):
    check_int("terngrad", "bits", self.bits)
    check_number("terngrad", "clip", self.clip, none_ok=True)
    if self.variant not in ("paper", "hipress"):
      raise ValueError(f"variant={self.variant!r} must be 'paper' or 'hipress'")
    if self.variant == "hipress" and self.bits not in (1, 2, 4, 8):
      raise ValueError(f"bits={self.bits} must be 1, 2, 4 or 8 for variant='hipress'")
    if self.variant == "paper" and self.bits != 2:
      raise ValueError(f"bits={self.bits} must be 2 for variant='paper'")

  def init(self, shape, dtype=jnp.float32, key=None):
    del shape, dtype, key
    return ()

  def encode(self, g, state, key=None):
    x = _flat_f32(g)
    if self.variant == "paper":
      if key is None:
        raise ValueError("terngrad(variant='paper') needs key")
      if self.clip is not None:
        # scalars, each computed once (materialize: not fused into every element's loop)
        n = x.shape[0]
        mu = materialize(safe_mean(x, n))
        var = det_sum(no_fma(jnp.square(x - mu)))
        # where the squares overflow: from x * 2**-100 (std may then be inf: no clipping)
        std = materialize(redo_where(
            jnp.isinf(var),
            lambda: sqrt_f32(exact_div(det_sum(no_fma(jnp.square(
                x * jnp.float32(DOWN) - mu * jnp.float32(DOWN)))), n)) * jnp.float32(1 / DOWN),
            sqrt_f32(exact_div(var, n))))
        c = jnp.float32(self.clip) * std
        x = jnp.clip(x, -c, c)
      # max|x| as max(max x, -min x) (+ 0 turns a -0 into +0, as abs does): two reductions
      # of x itself (XLA:CPU materialises |x| before a reduction)
      s = jnp.maximum(jnp.max(x), -jnp.min(x)) + jnp.float32(0) if x.size else jnp.float32(0)
      u = uniform01(key, x.shape)
      keep = u * s < jnp.abs(x)
      code = jnp.where(keep, jnp.where(x < 0, 0, 2), 1).astype(jnp.uint32)
      return {"scale": s.reshape(1).astype(jnp.float32),
              "codes": pack_bits_vectorized(code, 2, 1)}, state
    n = x.shape[0]
    b = self.bits
    mn, mx = jnp.min(x), jnp.max(x)
    # a range of 2**126 or more (1/gap subnormal, flushed on CPU; or overflowing float32):
    # everything from the values times 2**-4 (exact), see decode
    h, _ = _hipress_scale(mn, mx)
    gap = exact_div(mx * h - mn * h, 2 ** b - 1)
    gap_inv = exact_div(jnp.float32(1.0), gap + jnp.float32(1e-8))
    mn_h, gap_inv, h = materialize(mn * h), materialize(gap_inv), materialize(h)
    t = no_fma((x * h - mn_h) * gap_inv, anchor=gap_inv)
    lev = jnp.round(t)  # round half to even (nearbyint)
    if key is not None:
      per = 8 // b
      full = (n // per) * per
      rnd = jnp.trunc(t + uniform01(key, x.shape))
      lev = jnp.where(jnp.arange(n) < full, rnd, lev)
    lev = jnp.clip(lev, 0, 2 ** b - 1).astype(jnp.uint32)
    per = 8 // b
    tail = (-n) % per
    header = jnp.concatenate([jnp.array([b, tail], jnp.uint8),
                              lax.bitcast_convert_type(mn, jnp.uint8),
                              lax.bitcast_convert_type(mx, jnp.uint8)])
    pack = pack_bits if key is None else pack_bits_vectorized  # see pack_bits_vectorized
    return {"header": header, "codes": pack(lev, b)}, state

  def decode(self, payload, shape):
    n = numel(shape)
    if self.variant == "paper":
      code = unpack_bits(payload["codes"], 2, n).astype(jnp.int32)
      return ((code - 1).astype(jnp.float32) * payload["scale"][0]).reshape(shape)
    hd = payload["header"]
    mn = lax.bitcast_convert_type(hd[2:6], jnp.float32)
    mx = lax.bitcast_convert_type(hd[6:10], jnp.float32)
    h, inv = _hipress_scale(mn, mx)
    gap = materialize(exact_div(mx * h - mn * h, 2 ** self.bits - 1))
    mn_h, inv = materialize(mn * h), materialize(inv)
    lev = unpack_bits(payload["codes"], self.bits, n).astype(jnp.float32)
    return ((no_fma(lev * gap, anchor=mn) + mn_h) * inv).reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    n = numel(shape)
    if self.variant == "paper":
      return 4 + packed_nbytes(n, 2)
    return 10 + packed_nbytes(n, self.bits)


def terngrad(variant="paper", bits=2, clip=None) -> TernGrad:
  """TernGrad: stochastic ternary (``bits=2``) or wider levels with a per-tensor scale.

  Args:
    variant: ``"paper"`` (Wen et al.'s unbiased ternary rule) or ``"hipress"`` (HiPress's
      b-bit max-min rule).
    bits: bits per element: 2 for ``"paper"``; 1, 2, 4 or 8 for ``"hipress"``.
    clip: ``"paper"`` only: clip to ``clip * std`` first (the paper's c = 2.5); None: no
      clipping.

  Returns:
    The compressor (a frozen dataclass).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: an unknown variant or a value out of range.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> compressors.terngrad().bits
    2
  """
  return TernGrad(variant, bits, clip)
