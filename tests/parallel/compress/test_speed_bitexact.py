"""The fast compressor paths (issue 14) give the bits of the straightforward ones they replaced.

The references below are the previous implementations (bit-stream packing, jax.random.bits
noise, one IEEE division per CGX element, a division per QSGD element in decode).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.parallel.compressors as C
from jaxlp.parallel.compressors._base import exact_div, no_fma, random_bits32, uniform01
from tests.formats import _ref

KEY = jax.random.key(11)


def _bytes(a):
  a = np.asarray(a)
  return a.dtype, a.shape, a.tobytes()


def _assert_same_bits(got, want):
  """Same dtype and shape, and the bits, NaN-aware (XLA may give a NaN a different payload
  inside a fused program than op by op)."""
  got, want = np.asarray(got), np.asarray(want)
  assert (got.dtype, got.shape) == (want.dtype, want.shape)
  _ref.assert_same_bits(got, want)


@functools.partial(jax.jit, static_argnums=(1, 2))
def ref_pack(codes, bits, pad_code=0):
  codes = jnp.ravel(codes).astype(jnp.uint32)
  n = codes.shape[0]
  nbytes = (n * bits + 7) // 8
  if 8 % bits == 0:
    codes = jnp.pad(codes, (0, nbytes * (8 // bits) - n), constant_values=pad_code)
  stream = (codes[:, None] >> jnp.arange(bits, dtype=jnp.uint32)[None, :]) & 1
  stream = jnp.pad(stream.reshape(-1), (0, nbytes * 8 - stream.size))
  return jnp.sum(stream.reshape(nbytes, 8) << jnp.arange(8, dtype=jnp.uint32)[None, :], axis=1,
                 dtype=jnp.uint32).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnums=(1, 2))
def ref_unpack(packed, bits, n):
  stream = ((packed.astype(jnp.uint32)[:, None] >> jnp.arange(8, dtype=jnp.uint32)[None, :])
            & 1).reshape(-1)
  stream = stream[:n * bits].reshape(n, bits)
  return jnp.sum(stream << jnp.arange(bits, dtype=jnp.uint32)[None, :], axis=1, dtype=jnp.uint32)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_equal_bit_stream_reference(bits):
  rng = np.random.default_rng(bits)
  codes = [jnp.asarray(rng.integers(0, 2 ** bits, n).astype(np.uint32))
           for n in (0, 1, 9, 23, 1001)]
  pads = (0, 2 ** bits - 1) if 8 % bits == 0 else (0,)

  @jax.jit  # every length and pad in one program (one compile)
  def run(codes):
    out = []
    for c in codes:
      n = c.shape[0]
      packed = [(C.pack_bits(c, bits, pad), ref_pack(c, bits, pad)) for pad in pads]
      last = packed[-1][0]
      out.append((packed, C.unpack_bits(last, bits, n),
                  ref_unpack(last, bits, n) if n else None))
    return out

  for c, (packed, unpacked, ref_unpacked) in zip(codes, run(codes), strict=True):
    for pad, (got, want) in zip(pads, packed, strict=True):
      assert _bytes(got) == _bytes(want), (c.shape[0], pad)
    assert _bytes(unpacked) == _bytes(c)
    if c.shape[0]:
      assert _bytes(unpacked) == _bytes(ref_unpacked)


@pytest.mark.parametrize("key", [jax.random.key(3), jax.random.PRNGKey(5),
                                 jax.random.fold_in(jax.random.key(1), 9)],
                         ids=["typed", "raw", "folded"])
def test_random_bits_equal_jax_random_bits(key):
  for shape in [(), (0,), (1,), (3, 5), (1000,)]:
    want = jax.random.bits(key, shape, jnp.uint32)
    assert _bytes(random_bits32(key, shape)) == _bytes(want)
    assert _bytes(jax.jit(random_bits32, static_argnums=1)(key, shape)) == _bytes(want)
  keys = jax.random.split(jax.random.key(0), 3)
  got = jax.vmap(lambda k: uniform01(k, (17,)))(keys)
  want = jax.vmap(lambda k: (jax.random.bits(k, (17,), jnp.uint32) >> 8).astype(jnp.float32)
                  * jnp.float32(2.0 ** -24))(keys)
  assert _bytes(got) == _bytes(want)


@functools.partial(jax.jit, static_argnums=(1, 2))
def ref_cgx(x, bits, bucket, key=None):
  """The previous CGX encode/decode: one IEEE division per element."""
  n = x.shape[0]
  nb = -(-n // bucket)
  xb = jnp.pad(x, (0, nb * bucket - n), mode="edge").reshape(nb, -1)
  mx, mn = jnp.max(xb, axis=1, keepdims=True), jnp.min(xb, axis=1, keepdims=True)
  top = 2 ** bits - 1
  unit = exact_div(mx - mn, top)
  r = jnp.float32(0.5) if key is None else uniform01(key, xb.shape)
  safe = jnp.where(unit < 1e-10, jnp.float32(1.0), unit)
  lev = jnp.floor(exact_div(xb - mn, safe) + r)
  lev = jnp.where(unit < 1e-10, 0.0, jnp.clip(lev, 0.0, top))
  dec = lev.astype(jnp.uint32).astype(jnp.float32)  # what decode reads back
  out = (mn + no_fma(unit * dec)).reshape(-1)[:n]
  return ref_pack(lev.reshape(-1)[:n].astype(jnp.uint32), bits), out


def _cgx_inputs():
  rng = np.random.default_rng(0)
  yield rng.standard_normal(1000).astype(np.float32)
  yield (rng.integers(0, 16, 1200) * 0.5).astype(np.float32)  # q + 0.5 on integers: ties
  yield (rng.standard_normal(600) * 1e-9).astype(np.float32)  # unit near / under 1e-10
  yield np.array([2.5], np.float32)
  x = rng.standard_normal(900).astype(np.float32)
  x[5], x[600] = np.inf, np.nan
  yield x


@pytest.mark.parametrize("bits,bucket,stochastic", [(4, 512, False), (3, 7, True)])
def test_cgx_equals_per_element_division(bits, bucket, stochastic):
  _cgx_equals_per_element_division(bits, bucket, stochastic)


# Other widths (8, 5, 1 bits; buckets of 7, 9, 24, 32: the same code, other constants) are
# compared with numpy's per-element division in test_speed_dense.py's
# test_cgx_other_widths_equal_numpy_division, and 8 bits compiled normally in
# test_compress_compressors.py's test_cgx_deterministic_exact.


def _cgx_equals_per_element_division(bits, bucket, stochastic):
  c = C.cgx(bits, bucket, stochastic)
  key = KEY if stochastic else None
  xs = [jnp.asarray(x) for x in _cgx_inputs()]

  @jax.jit  # every input in one program (one compile), encode and decode together as the
  def run(xs):  # engine runs them
    out = []
    for x in xs:
      p = c.encode(x, (), key)[0]
      out.append((p["levels"], c.decode(p, x.shape)))
    return out

  want = jax.jit(lambda xs: [ref_cgx(x, bits, bucket, key) for x in xs])(xs)
  for (levels, dec), (ref_levels, ref_out) in zip(run(xs), want, strict=True):
    assert _bytes(levels) == _bytes(ref_levels)
    _assert_same_bits(dec, ref_out)


def test_cgx_near_tie_fallback_paths():
  """Every bucket near a tie (more than the gathered capacity): the whole-leaf exact path."""
  x = jnp.asarray((np.arange(64 * 40) % 16 * 0.5).astype(np.float32))
  c = C.cgx(4, 16)
  levels, out = ref_cgx(x, 4, 16)
  payload = jax.jit(lambda x: c.encode(x, ())[0])(x)
  assert _bytes(payload["levels"]) == _bytes(levels)
  _assert_same_bits(jax.jit(c.decode, static_argnums=1)(payload, x.shape), out)
  # vmap (the engine's emulation): same bits per worker
  xs = jnp.stack([x, -x, x * 3])
  got = jax.jit(jax.vmap(lambda x: c.encode(x, ())[0]["levels"]))(xs)
  want = jax.jit(lambda xs: [ref_cgx(xs[i], 4, 16)[0] for i in range(3)])(xs)  # per row
  for i in range(3):
    assert _bytes(got[i]) == _bytes(want[i])


def test_qsgd_decode_equals_per_element_division():
  c = C.qsgd(15, 64)
  x = jnp.asarray(np.random.default_rng(1).standard_normal(1000).astype(np.float32))
  payload, _ = jax.jit(lambda x: c.encode(x, (), KEY))(x)

  @jax.jit
  def want(payload):
    code = C.unpack_bits(payload["codes"], c.bits, 1000)
    code = jnp.pad(code, (0, 1024 - 1000)).reshape(16, -1)
    mag = exact_div((code >> 1).astype(jnp.float32), 15)
    return (payload["norm"][:, None] * jnp.where((code & 1) == 1, -mag, mag)).reshape(-1)[:1000]
  assert _bytes(jax.jit(c.decode, static_argnums=1)(payload, (1000,))) == _bytes(want(payload))
