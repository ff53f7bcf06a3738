"""The fast dense-quantizer paths (issue 14 item 5) keep the bits of the plain definitions.

CGX splits full buckets from the partial last one (no pad-copy), redoes near-tie buckets in
tiers, and guards its decode against FMA with one XOR; QSGD decodes level/levels with a
two-term reciprocal instead of a table gather; TernGrad takes max|x| as max(max, -min).
The oracles are numpy (IEEE float32 division, no FMA).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.parallel.compressors as C
from jaxlp.parallel.compressors._base import no_fma, uniform01
from jaxlp.parallel.compressors._quantizers import _recip_split


def _bytes(a):
  a = np.asarray(a)
  return a.dtype, a.shape, a.tobytes()


def np_pack(codes, bits):
  stream = np.array([(int(c) >> k) & 1 for c in codes for k in range(bits)] + [0] * 7, np.uint32)
  nbytes = (len(codes) * bits + 7) // 8
  return (stream[:8 * nbytes].reshape(nbytes, 8) << np.arange(8, dtype=np.uint32)).sum(
    1).astype(np.uint8)


def np_cgx(x, bits, bucket, r=None, nq=None):
  """CGX levels and decode, one IEEE division per element (numpy float32)."""
  x = np.asarray(x, np.float32).ravel()
  nq = x.size if nq is None else nq
  out = np.empty(nq, np.float32)
  levels, meta = [], []
  top = np.float32(2 ** bits - 1)
  for s in range(0, nq, bucket):
    b = x[s:min(s + bucket, nq)]
    mx, mn = b.max(), b.min()
    unit = np.float32((mx - mn) / top)
    if unit < 1e-10:
      lev = np.zeros(b.size, np.float32)
    else:
      rr = np.float32(0.5) if r is None else r[s:s + b.size]
      lev = np.minimum(np.maximum(np.floor(np.float32((b - mn) / unit) + rr), 0), top)
    levels.append(lev)
    meta += [unit, mn]
    out[s:s + b.size] = mn + np.float32(unit * lev)
  lev = np.concatenate(levels).astype(np.uint32) if levels else np.zeros(0, np.uint32)
  return out, np_pack(lev, bits), np.array(meta, np.float32)


def _crafted(rng):
  yield "random", rng.standard_normal(1000).astype(np.float32)
  yield "grid ties", (rng.integers(0, 16, 1031) * 0.5).astype(np.float32)
  yield "single", np.array([-2.5], np.float32)
  yield "zeros", np.zeros(77, np.float32)
  yield "tiny", (rng.standard_normal(300) * 1e-9).astype(np.float32)
  yield "n < bucket", rng.standard_normal(45).astype(np.float32)


@pytest.mark.parametrize("bits,bucket", [(4, 64), (8, 32), (3, 7), (5, 24), (1, 9)])
def test_cgx_equals_numpy_division(bits, bucket):
  rng = np.random.default_rng(bits)
  for skip in (False, True):
    c = C.cgx(bits, bucket, skip_incomplete=skip)
    enc = jax.jit(lambda x, c=c: c.encode(x, ())[0])
    for name, x in _crafted(rng):
      p = enc(jnp.asarray(x))
      nq = (x.size // bucket) * bucket if skip else x.size
      out, packed, meta = np_cgx(x, bits, bucket, nq=nq)
      assert _bytes(p["levels"]) == _bytes(packed), (name, skip)
      assert _bytes(p["meta"]) == _bytes(meta), (name, skip)
      dec = np.asarray(jax.jit(lambda p, c=c, n=x.size: c.decode(p, (n,)))(p))
      want = np.concatenate([out, x[nq:]])
      assert _bytes(dec) == _bytes(want), (name, skip)


def test_cgx_stochastic_noise_is_uniform01_over_the_quantized_elements():
  x = np.random.default_rng(3).standard_normal(333).astype(np.float32)
  key = jax.random.key(4)
  c = C.cgx(3, 50, stochastic=True)
  p = c.encode(jnp.asarray(x), (), key)[0]
  out, packed, _ = np_cgx(x, 3, 50, r=np.asarray(uniform01(key, (333,))))
  assert _bytes(p["levels"]) == _bytes(packed)
  assert _bytes(c.decode(p, (333,))) == _bytes(out)


def test_cgx_middle_tier_of_near_tie_buckets():
  """64 buckets of 16: 25 on the level grid (every element a tie) -- more than the first
  tier (nb // 16 + 16 = 20), fewer than the second (32); then 40 (the whole-leaf path)."""
  rng = np.random.default_rng(5)
  for ties in (25, 40):
    x = rng.standard_normal((64, 16)).astype(np.float32)
    x[:ties] = rng.integers(0, 16, (ties, 16)) * np.float32(0.5)
    x[:ties, 0], x[:ties, 1] = 0.0, 7.5
    x = x.ravel()
    p = jax.jit(lambda x: C.cgx(4, 16).encode(x, ())[0])(jnp.asarray(x))
    out, packed, _ = np_cgx(x, 4, 16)
    assert _bytes(p["levels"]) == _bytes(packed), ties
    assert _bytes(C.cgx(4, 16).decode(p, x.shape)) == _bytes(out), ties


def test_recip_split_gives_ieee_quotients_with_and_without_fma():
  for levels in range(1, 128):
    bits = 1 + max(1, int(np.ceil(np.log2(levels + 1))))
    lev = np.arange(2 ** (bits - 1), dtype=np.float32)
    want = lev / np.float32(levels)
    hi, lo = _recip_split(levels)
    assert (lev.astype(np.float64) * float(hi) == (lev * hi).astype(np.float64)).all()
    assert _bytes(lev * hi + lev * lo) == _bytes(want), levels
    fused = (lev.astype(np.float64) * float(lo) + (lev * hi).astype(np.float64))
    assert _bytes(fused.astype(np.float32)) == _bytes(want), levels


@pytest.mark.parametrize("levels", [1, 7, 15, 127])
def test_qsgd_decode_every_code_equals_division(levels):
  c = C.qsgd(levels, 8)
  n = 2 ** c.bits * 3
  codes = np.arange(n, dtype=np.uint32) % (2 ** c.bits)
  norm = np.array([1.5, 3e-3, 7.0] * (n // 24 + 1), np.float32)[:-(-n // 8)]
  payload = {"norm": jnp.asarray(norm), "codes": C.pack_bits(jnp.asarray(codes), c.bits)}
  mag = (codes >> 1).astype(np.float32) / np.float32(levels)
  want = np.repeat(norm, 8)[:n] * np.where(codes & 1, -mag, mag)
  assert _bytes(c.decode(payload, (n,))) == _bytes(want)


def test_terngrad_scale_is_max_abs_on_signed_zeros_and_nan():
  key = jax.random.key(0)
  for x in ([-0.0, -0.0], [0.0, -0.0, -3.0], [np.nan, 1.0], [-np.inf, 2.0], [1.0, -1.0]):
    x = np.array(x, np.float32)
    s = C.terngrad().encode(jnp.asarray(x), (), key)[0]["scale"]
    assert _bytes(s) == _bytes(np.max(np.abs(x)).reshape(1)), x


def test_no_fma_anchor_keeps_the_rounded_product():
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
  want = a + b * c  # numpy: the product rounded, then the add
  got = jax.jit(lambda a, b, c: a + no_fma(b * c, anchor=a))(a, b, c)
  assert _bytes(got) == _bytes(want)
  got = jax.jit(jax.vmap(lambda a, b, c: a + no_fma(b * c, anchor=a)))(
    a.reshape(4, -1), b.reshape(4, -1), c.reshape(4, -1))
  assert _bytes(got) == _bytes(want.reshape(4, -1))
