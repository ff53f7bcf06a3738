"""`_bits.top_bit` / `floor_log2` / `ldexp_bits`: exact without `clz` (which Triton cannot
compile), checked against numpy on every 24-bit integer and every float32 subnormal."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats import _bits as B


def _np_top_bit(n):
  n = np.asarray(n, np.uint64)
  out = np.full(n.shape, -1, np.int64)
  nz = n != 0
  out[nz] = np.floor(np.log2(n[nz].astype(np.float64))).astype(np.int64)
  # float64 log2 is exact enough below 2**53 except just under powers of two: fix up
  out[nz] -= (np.left_shift(np.uint64(1), out[nz].astype(np.uint64)) > n[nz]).astype(np.int64)
  return out


def test_top_bit_every_24_bit_integer():
  n = np.arange(1 << 24, dtype=np.uint32)
  got = np.asarray(jax.jit(lambda v: B.top_bit(v, max_bits=24))(n))
  np.testing.assert_array_equal(got, _np_top_bit(n))


def test_top_bit_32_bit_edges_and_random():
  p = np.arange(32, dtype=np.uint64)
  edges = np.concatenate([1 << p, (1 << p) - 1, (1 << p) + 1]).astype(np.uint64)
  edges = edges[edges < 2**32].astype(np.uint32)
  rand = np.random.default_rng(0).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
  n = np.concatenate([edges, rand, np.array([0, 2**32 - 1], np.uint32)])
  np.testing.assert_array_equal(np.asarray(jax.jit(B.top_bit)(n)), _np_top_bit(n))


def test_floor_log2_every_subnormal_and_every_binade():
  sub = np.arange(1 << 23, dtype=np.uint32)  # +0 and every float32 subnormal
  normal = (np.arange(1, 255, dtype=np.uint32) << 23)[:, None] | np.array(
      [0, 1, 0x400000, 0x7FFFFF], np.uint32)
  mag = np.concatenate([sub, normal.reshape(-1)])
  got = np.asarray(jax.jit(B.floor_log2)(mag))
  _, e = np.frexp(mag.view(np.float32).astype(np.float64))
  want = np.where(mag == 0, -150, e - 1)
  np.testing.assert_array_equal(got, want)


def test_ldexp_bits_normalises_subnormals_exactly():
  mag = np.concatenate([np.arange(1, 1 << 12, dtype=np.uint32),
                        np.arange(0x7FF000, 0x800010, dtype=np.uint32)])
  for s in (0, 1, 23, 40, 149):
    got = np.asarray(jax.jit(B.ldexp_bits)(mag, jnp.int32(s))).view(np.float32)
    want = (mag.view(np.float32).astype(np.float64) * 2.0**s).astype(np.float32)
    np.testing.assert_array_equal(got, want, err_msg=f"s={s}")
