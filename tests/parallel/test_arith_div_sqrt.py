"""Bit-exact tests of jaxlp.parallel._arith.div_f32 / sqrt_f32 against numpy float32.

numpy's float32 ``/`` and ``sqrt`` on x86 are IEEE 754 (round to nearest even, gradual
underflow), so they are the oracle. Comparisons are on bit patterns, NaN-aware (any NaN
matches any NaN; the sign and payload of a NaN result are unspecified).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.formats import _bits as B
from jaxlp.parallel import _arith
from jaxlp.parallel._arith import div_f32, sqrt_f32
from jaxlp.parallel.compressors._base import exact_div

N_RANDOM = 1 << 20
CHUNK = 1 << 22  # sqrt sweeps run in chunks of this many elements (one compilation)

_div = jax.jit(div_f32)
_sqrt = jax.jit(sqrt_f32)


def f32(bits):
  return np.asarray(bits, np.uint32).view(np.float32)


def np_div(a, b):
  with np.errstate(all="ignore"):
    return np.asarray(np.float32(1) * np.asarray(a, np.float32) / np.asarray(b, np.float32),
                      np.float32)


def np_sqrt(x):
  with np.errstate(all="ignore"):
    return np.sqrt(np.asarray(x, np.float32))


def assert_bits_equal(out, ref, *args):
  out = np.asarray(out)
  ref = np.asarray(ref, np.float32)
  assert out.dtype == np.float32
  assert out.shape == ref.shape
  same = (out.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(out) & np.isnan(ref))
  if not same.all():
    bad = np.flatnonzero(~same.reshape(-1))[:5]
    lines = []
    for i in bad:
      ops = ", ".join(f"{np.broadcast_to(np.asarray(a, np.float32), out.shape).reshape(-1)[i]!r}"
                      for a in args)
      lines.append(f"  [{i}] ({ops}): got {out.reshape(-1)[i]!r} "
                   f"({out.view(np.uint32).reshape(-1)[i]:#010x}), want "
                   f"{ref.reshape(-1)[i]!r} ({ref.view(np.uint32).reshape(-1)[i]:#010x})")
    raise AssertionError(f"{(~same).sum()} of {same.size} differ:\n" + "\n".join(lines))


SPECIAL_BITS = [
  0x00000000,  # 0
  0x7F800000,  # inf
  0x7FC00000,  # quiet NaN
  0x7F800001,  # signalling NaN pattern
  0x00000001,  # min subnormal
  0x00000002,
  0x00000003,
  0x007FFFFF,  # max subnormal
  0x00400000,
  0x00800000,  # min normal
  0x00800001,
  0x7F7FFFFF,  # max normal
  0x3F800000,  # 1
  0x40400000,  # 3
  0x41700000,  # 15
  0x3F7FFFFF,  # 1 - 2^-24
  0x3F800001,  # 1 + 2^-23
  0x34000000,  # 2^-23
  0x4B000000,  # 2^23
]
SPECIALS = f32(SPECIAL_BITS + [b | 0x80000000 for b in SPECIAL_BITS])


def random_patterns(seed, n=N_RANDOM):
  return f32(np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint32))


def random_normalish(seed, n=N_RANDOM, lo=-30, hi=30):
  rng = np.random.default_rng(seed)
  m = rng.uniform(1, 2, n).astype(np.float32)
  e = rng.integers(lo, hi, n)
  s = np.where(rng.random(n) < 0.5, -1, 1).astype(np.float32)
  return (s * np.ldexp(m, e)).astype(np.float32)


# ------------------------------------------------------------------------------------ div_f32


def test_div_specials_all_pairs():
  a, b = np.meshgrid(SPECIALS, SPECIALS, indexing="ij")
  assert_bits_equal(_div(a, b), np_div(a, b), a, b)
  # Eager (no jit) and NaN results are quiet NaNs.
  out = np.asarray(div_f32(a, b))
  assert_bits_equal(out, np_div(a, b), a, b)
  assert (out.view(np.uint32)[np.isnan(out)] & 0x7FFFFFFF == 0x7FC00000).all()


def test_div_ieee_special_rules():
  inf, nan = np.float32(np.inf), np.float32(np.nan)
  cases = [(0.0, 0.0, nan), (inf, -inf, nan), (nan, 1.0, nan), (1.0, nan, nan),
           (-1.0, 0.0, -inf), (1.0, -0.0, -inf), (-0.0, 5.0, -0.0), (0.0, -5.0, -0.0),
           (-inf, 2.0, -inf), (2.0, -inf, -0.0), (-3.0, -inf, 0.0), (-inf, -0.0, inf)]
  a, b, want = (np.array(c, np.float32) for c in zip(*cases))
  assert_bits_equal(_div(a, b), want, a, b)


def test_div_random_bit_patterns():
  a, b = random_patterns(1), random_patterns(2)
  assert_bits_equal(_div(a, b), np_div(a, b), a, b)


def test_div_random_normal_values():
  a, b = random_normalish(3), random_normalish(4)
  assert_bits_equal(_div(a, b), np_div(a, b), a, b)


def test_div_subnormal_and_underflow_quotients():
  rng = np.random.default_rng(5)
  n = N_RANDOM
  a = random_normalish(6, n, -70, -50)
  b = random_normalish(7, n, 40, 110)  # quotients from about 2^-180 to 2^-90
  assert_bits_equal(_div(a, b), np_div(a, b), a, b)
  # Subnormal dividends (every pattern class), normal and subnormal divisors.
  a = f32(rng.integers(1, 0x00800000, n, dtype=np.uint32) | (rng.integers(0, 2, n) << 31)
          .astype(np.uint32))
  b = np.where(rng.random(n) < 0.5, random_normalish(8, n, -10, 30),
               f32(rng.integers(1, 0x00800000, n, dtype=np.uint32)))
  assert_bits_equal(_div(a, b), np_div(a, b), a, b)


def test_div_subnormal_ties_round_to_even():
  # k * 2^-149 / 2^j: exact ties at the subnormal quantum (ties to even), and the rounding
  # that carries from the largest subnormal into the smallest normal.
  k = np.arange(1, 1 << 16, dtype=np.uint32)
  k = np.concatenate([k, 0x007FFFFF - k[:4096], 0x00800000 + k[:4096]])
  a = np.repeat(f32(k), 4)
  b = np.tile(np.float32([2, 4, 8, 1.5]), k.size)
  ref = np_div(a, b)
  assert_bits_equal(_div(a, b), ref, a, b)
  assert np.asarray(_div(f32([1, 3, 5]), np.float32(2))).view(np.uint32).tolist() == [0, 2, 2]
  assert np.asarray(_div(f32(0x00FFFFFF), np.float32(2))).view(np.uint32) == 0x00800000


def test_div_near_overflow():
  rng = np.random.default_rng(9)
  n = N_RANDOM
  a = random_normalish(10, n, 100, 128)
  b = random_normalish(11, n, -28, 2)  # quotients from about 2^98 to 2^156
  assert_bits_equal(_div(a, b), np_div(a, b), a, b)
  big = f32(0x7F7FFFFF - rng.integers(0, 64, 4096, dtype=np.uint32))
  den = f32(0x3F800000 - rng.integers(0, 64, 4096, dtype=np.uint32))  # just below 1
  assert_bits_equal(_div(big, den), np_div(big, den), big, den)
  half = np.float32(0.5)
  assert np.asarray(_div(np.float32(np.finfo(np.float32).max), half)) == np.inf


def test_div_exact_quotients():
  # Exactly representable quotients come back exactly (no ties are possible in the normal
  # range: an inexact quotient of 24-bit significands is never halfway between floats).
  rng = np.random.default_rng(12)
  c = rng.integers(1, 1 << 12, N_RANDOM).astype(np.float32) * np.float32(2.0) ** rng.integers(
    -60, 60, N_RANDOM).astype(np.float32)
  b = rng.integers(1, 1 << 12, N_RANDOM).astype(np.float32)
  a = c * b  # exact: at most 24 significant bits
  assert_bits_equal(_div(a, b), c, a, b)


@pytest.mark.parametrize("d", [3, 15, 255])
def test_div_broadcast_scalar_divisors(d):
  a = np.concatenate([random_normalish(13, N_RANDOM // 2), random_patterns(14, N_RANDOM // 2)])
  ref = np_div(a, np.float32(d))
  assert_bits_equal(jax.jit(lambda x: div_f32(x, d))(a), ref, a)  # Python int, constant
  assert_bits_equal(_div(a, np.float32(d)), ref, a)  # 0-d float32, traced argument
  assert_bits_equal(_div(a, jnp.float32(d)), ref, a)
  assert_bits_equal(_div(np.float32(d), a), np_div(np.float32(d), a), a)  # scalar dividend
  assert_bits_equal(exact_div(a, d), ref, a)


def test_div_python_scalars_and_broadcast():
  out = div_f32(1, 3)
  assert out.shape == () and out.dtype == jnp.float32
  assert_bits_equal(out, np.float32(1) / np.float32(3))
  a = random_normalish(15, 64 * 33).reshape(64, 33)
  b = random_normalish(16, 33)
  assert_bits_equal(div_f32(a, b[None, :]), np_div(a, b[None, :]), a, b[None, :])
  assert_bits_equal(div_f32(a, b[:1].reshape(1, 1)), np_div(a, b[0]), a)


def test_div_vmap_and_jit():
  a = random_normalish(17, 256 * 64).reshape(256, 64)
  b = random_normalish(18, 256)
  want = np_div(a, b[:, None])
  assert_bits_equal(jax.jit(jax.vmap(div_f32))(a, b), want, a, b[:, None])
  assert_bits_equal(jax.vmap(div_f32, in_axes=(0, None))(a, np.float32(15)),
                    np_div(a, np.float32(15)), a)
  assert_bits_equal(jax.jit(jax.vmap(lambda x, y: exact_div(x, y)))(a, b), want, a, b[:, None])
  assert_bits_equal(jax.vmap(jax.vmap(div_f32))(a, a[::-1]), np_div(a, a[::-1]), a, a[::-1])


# ------------------------------------------------------------------- inexact float estimates
# div_f32 / sqrt_f32 start from the backend's float32 division / square root (approximate on
# XLA:GPU) and correct it exactly. On XLA:CPU those are IEEE, so here they are replaced by
# estimates off by up to the documented bound (2^-20 relative for division, 2^-19 for sqrt),
# with the error's size and sign varying per element or pinned at the extremes.


def _perturbed(fn, max_k, mode):
  def est(*args):
    out = fn(*args)
    h = B.to_bits(out)
    for a in args:
      h = B.fmix32(h ^ B.to_bits(jnp.asarray(a, jnp.float32)))
    if mode == "hash":
      k = (h % jnp.uint32(2 * max_k + 1)).astype(jnp.int32) - max_k
    else:  # the extremes: +-max_k, by the hash's low bit
      k = jnp.where((h & jnp.uint32(1)) == 0, -max_k, max_k)
    # out * (1 + k * 2^-23): with the product's rounding, |rel. error| < (max_k + 0.5) * 2^-23.
    return out * (jnp.float32(1) + k.astype(jnp.float32) * jnp.float32(2.0 ** -23))
  return est


# Not the production program (the estimates are patched, and it runs op by op): the claim is
# the correction's, so XLA's optimizations are off here (tests/conftest.py, fast_compile); the
# production div_f32 / sqrt_f32 are compared with numpy compiled normally by the other tests.
@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("mode", ["hash", "extreme"])
def test_exact_with_inexact_estimates(mode, monkeypatch):
  monkeypatch.setattr(_arith, "_div_estimate", _perturbed(_arith._div_estimate, 7, mode))
  monkeypatch.setattr(_arith, "_sqrt_estimate", _perturbed(_arith._sqrt_estimate, 15, mode))
  n = 1 << 18
  a = np.concatenate([random_patterns(30, n), random_normalish(31, n)])
  b = np.concatenate([random_patterns(32, n), random_normalish(33, n)])
  with jax.disable_jit():  # trace nothing: the patched estimates are used
    assert_bits_equal(div_f32(a, b), np_div(a, b), a, b)
    assert_bits_equal(div_f32(a, np.float32(3)), np_div(a, np.float32(3)), a)
    x = np.concatenate([a, f32(np.arange(0x3F800000, 0x40800000, 61, dtype=np.uint32))])
    assert_bits_equal(sqrt_f32(x), np_sqrt(x), x)


# ----------------------------------------------------------------------------------- sqrt_f32


def _sweep_sqrt(lo_bits, hi_bits, step=1):
  for start in range(lo_bits, hi_bits, CHUNK * step):
    bits = np.arange(start, start + CHUNK * step, step, dtype=np.uint64)
    bits = np.minimum(bits, hi_bits - 1).astype(np.uint32)  # last chunk padded with repeats
    x = f32(bits)
    assert_bits_equal(_sqrt(x), np_sqrt(x), x)


def test_sqrt_specials():
  assert_bits_equal(_sqrt(SPECIALS), np_sqrt(SPECIALS), SPECIALS)
  assert_bits_equal(sqrt_f32(SPECIALS), np_sqrt(SPECIALS), SPECIALS)
  out = np.asarray(sqrt_f32(np.float32([-0.0, 0.0, np.inf, -np.inf, -1e-45, np.nan])))
  assert out.view(np.uint32)[:3].tolist() == [0x80000000, 0, 0x7F800000]
  assert np.isnan(out[3:]).all()


def test_sqrt_full_binades():
  _sweep_sqrt(0x3F800000, 0x40800000)  # every float32 in [1, 4)
  _sweep_sqrt(0x00800000, 0x01800000)  # [2^-126, 2^-124)
  _sweep_sqrt(0x7E800000, 0x7F800000)  # [2^126, 2^128)


def test_sqrt_subnormals():
  _sweep_sqrt(0, 0x00800000)  # every subnormal (and +0)


def test_sqrt_random_bit_patterns():
  x = random_patterns(20)
  assert_bits_equal(_sqrt(x), np_sqrt(x), x)


def test_sqrt_python_scalar_vmap_jit():
  out = sqrt_f32(2)
  assert out.shape == () and out.dtype == jnp.float32
  assert_bits_equal(out, np.sqrt(np.float32(2)))
  x = np.abs(random_normalish(21, 128 * 32)).reshape(128, 32)
  assert_bits_equal(jax.jit(jax.vmap(sqrt_f32))(x), np_sqrt(x), x)
  assert_bits_equal(jax.vmap(jax.vmap(sqrt_f32))(x), np_sqrt(x), x)
