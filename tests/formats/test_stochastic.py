"""Stochastic rounding: exact expectations with enumerated noise, statistics, keys, sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlp import formats as F
from jaxlp.formats._quantize import quantize_f32, random_bits

from . import _ref


def _grid_inputs(rng, n, lo_exp, hi_exp, keep_bits):
  """Random float32 values in [2^lo, 2^hi) whose fraction has only `keep_bits` top bits."""
  e = rng.integers(lo_exp, hi_exp, n)
  frac = rng.integers(0, 1 << keep_bits, n) << (23 - keep_bits)
  b = ((e + 127).astype(np.uint32) << 23) | frac.astype(np.uint32)
  sgn = rng.integers(0, 2, n).astype(np.uint32) << 31
  return (b | sgn).view(np.float32)


def _enumerated_mean(x, fmt, d, rand_bits=None):
  """Mean of quantize_f32 over rand = j << (32 - d), j = 0..2^d-1 (float64, exact)."""
  j = np.arange(1 << d, dtype=np.uint32) << np.uint32(32 - d)
  rand = np.broadcast_to(j[:, None], (1 << d, x.size))
  xb = np.broadcast_to(x[None, :], rand.shape)
  f = jax.jit(lambda a, r: quantize_f32(a, fmt, "stochastic", r, rand_bits))
  q = np.asarray(f(jnp.asarray(xb), jnp.asarray(rand))).astype(np.float64)
  return q.mean(axis=0), q


ELEMENTWISE = [
    (F.E4M3, 3), (F.BF16, 7), (F.FP16, 10), (F.E2M1FN, 1), (F.E5M2, 2),
    (F.FloatFormat(3, 0, specials="finite"), 0), (F.FloatFormat(4, 3, subnormals=False), 3),
]


@pytest.mark.parametrize("fmt, m", ELEMENTWISE, ids=lambda v: repr(v))
def test_exact_expectation_float_format(fmt, m):
  d = 10
  rng = np.random.default_rng(m)
  # normal range, well inside [min_normal, max_normal / 2)
  lo = fmt.emin
  hi = max(lo + 1, fmt.emax)
  x = _grid_inputs(rng, 257, lo, hi, m + d)
  if fmt.subnormals:  # subnormal range: the quantum is 2^(emin - m): keep m + d bits below it
    k = rng.integers(1, 1 << (m + d), 64) * rng.choice([-1.0, 1.0], 64)
    xs = (k * 2.0 ** (fmt.emin - m - d)).astype(np.float32)
    x = np.concatenate([x, xs])
  mean, q = _enumerated_mean(x, fmt, d)
  np.testing.assert_array_equal(mean, x.astype(np.float64))
  # every draw is one of the two neighbours (nearest-down / up)
  down = _ref.ref_of(fmt).round(x, "toward_zero").astype(np.float64)
  assert np.all((q == down) | (np.abs(q) > np.abs(down)))


def test_exact_expectation_fixed_point_block_mx_qpytorch():
  rng = np.random.default_rng(7)
  d = 8
  # FixedPoint: grid 2^-4, x with 4 + d fractional bits, inside range
  x = (rng.integers(-(1 << 14), 1 << 14, 300) / 2.0 ** (4 + d)).astype(np.float32)
  mean, _ = _enumerated_mean(x, F.FixedPoint(16, 4), d)
  np.testing.assert_array_equal(mean, x.astype(np.float64))
  # BlockFormat over the whole tensor: max |x| = 1.5 -> e = 1, grid 2^(1-6); keep d more bits
  x = (rng.integers(-(1 << 13), 1 << 13, 300) / 2.0 ** (5 + d)).astype(np.float32)
  x[0] = 1.5
  mean, _ = _enumerated_mean(x, F.BlockFormat(6), d)
  np.testing.assert_array_equal(mean, x.astype(np.float64))
  # MX with E4M3FN elements, one block of 32: amax = 1.5 -> scale 2^(0-8); grid of elements
  x = _grid_inputs(rng, 32, -3, 0, 3 + d)
  x[0] = 1.5
  mean, _ = _enumerated_mean(x, F.mx(F.E4M3FN), d)
  np.testing.assert_array_equal(mean, x.astype(np.float64))
  # MXINT8: grid 2^(s-6) with s = floor(log2 amax) = 0
  x = (rng.integers(-(1 << 13), 1 << 13, 32) / 2.0 ** (6 + d)).astype(np.float32)
  x[0] = 1.5
  mean, _ = _enumerated_mean(x, F.mx("int8"), d)
  np.testing.assert_array_equal(mean, x.astype(np.float64))
  # QPyTorch float (adds the top bits of the noise then truncates)
  x = _grid_inputs(rng, 300, -5, 5, 3 + d)
  mean, _ = _enumerated_mean(x, F.qpytorch_float(5, 3), d)
  np.testing.assert_array_equal(mean, x.astype(np.float64))


@pytest.mark.parametrize("rand_bits", [1, 3, 6])
def test_rand_bits_truncation_expectation(rand_bits):
  fmt = F.E4M3
  d = 10
  rng = np.random.default_rng(rand_bits)
  x = _grid_inputs(rng, 200, -3, 5, 3 + d)
  mean, _ = _enumerated_mean(x, fmt, d, rand_bits)
  xd = x.astype(np.float64)
  down = _ref.ref_of(fmt).round(x, "toward_zero").astype(np.float64)
  e = np.floor(np.log2(np.abs(xd)))
  ulp = 2.0 ** (e - 3)
  r = np.round((np.abs(xd) - np.abs(down)) / ulp * 2**d)  # dropped bits as a d-bit integer
  p = np.floor(r / 2 ** (d - rand_bits)) * 2 ** (d - rand_bits) / 2**d
  want = np.sign(xd) * (np.abs(down) + p * ulp)
  np.testing.assert_array_equal(mean, want)
  # rand_bits=32 is plain stochastic rounding
  m32, _ = _enumerated_mean(x, fmt, d, 32)
  np.testing.assert_array_equal(m32, xd)


Z = 5.33  # two-sided p ~ 1e-7 per check


def _z_unbiased(q, x, step):
  q = np.asarray(q, np.float64)
  n = q.size
  p = (x - np.floor(x / step) * step) / step
  sd = step * np.sqrt(p * (1 - p) / n)
  z = (q.mean() - x) / sd
  assert abs(z) < Z, (q.mean(), x, z)


@pytest.mark.parametrize("case", ["float", "block", "fixed", "mx"])
def test_statistical_unbiasedness(case):
  n = 1 << 20
  key = jax.random.key(42)
  if case == "float":
    x, fmt, step = 1.0 + 0.3 * 2**-3, F.E4M3, 2**-3
    arr = jnp.full((n,), x, jnp.float32)
  elif case == "fixed":
    x, fmt, step = 0.7, F.FixedPoint(8, 2), 0.25
    arr = jnp.full((n,), x, jnp.float32)
  elif case == "block":  # blocks of 2 along the last axis: [1.5, x] -> e = 1, step 2^(1-4)
    x, fmt, step = 0.3, F.BlockFormat(4, axis=-1, block_size=2), 2.0**-3
    arr = jnp.tile(jnp.array([1.5, x], jnp.float32), (n,)).reshape(n, 2)
  else:  # mx E2M1FN, blocks of 32 with a 6.0 (emax 2 -> scale 2^0); x in [1,2) -> step 0.5
    x, fmt, step = 1.3, F.mx(F.E2M1FN), 0.5
    row = jnp.full((32,), x, jnp.float32).at[0].set(6.0)
    arr = jnp.tile(row, (n // 32,))
  q = np.asarray(jax.jit(lambda a: F.quantize(a, fmt, "stochastic", key=key))(arr))
  if case == "block":
    q = q[:, 1]
  elif case == "mx":
    q = q.reshape(-1, 32)[:, 1:]
  x32 = float(np.float32(x))
  _z_unbiased(q.ravel(), x32, step)
  assert set(np.unique(q)) <= {np.float32(np.floor(x32 / step) * step),
                               np.float32((np.floor(x32 / step) + 1) * step)}


def test_missing_key_raises():
  with pytest.raises(ValueError, match="key"):
    F.quantize(jnp.ones(4), F.E4M3, "stochastic")


def test_typed_and_legacy_keys_identical():
  x = jax.random.normal(jax.random.key(0), (64, 33))
  typed = jax.random.key(123)
  legacy = jax.random.PRNGKey(123)
  np.testing.assert_array_equal(jax.random.key_data(typed), legacy)
  q = jax.jit(lambda v, k: F.quantize(v, F.E4M3, "stochastic", key=k))
  a = q(x, typed)
  b = q(x, legacy)
  _ref.assert_same_bits(a, b)
  c = q(x, jax.random.key(124))
  assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_jit_equals_eager_and_noise_depends_on_index_only():
  x = jax.random.normal(jax.random.key(1), (40, 25))
  key = jax.random.key(5)
  for fmt in (F.E4M3, F.BlockFormat(5, axis=1, block_size=8), F.qpytorch_float(4, 3)):
    eager = F.quantize(x, fmt, "stochastic", key=key)
    jitted = jax.jit(lambda v, k, fmt=fmt: F.quantize(v, fmt, "stochastic", key=k))(x, key)
    _ref.assert_same_bits(eager, jitted, msg=repr(fmt))
  # noise word of element i = hash(key, flat C index): reshape does not change it
  r1 = random_bits(key, (40, 25))
  r2 = random_bits(key, (1000,))
  np.testing.assert_array_equal(np.asarray(r1).ravel(), np.asarray(r2))
  assert len(np.unique(np.asarray(r2))) == 1000


def _mesh(devices, explicit=False):
  """A 1-D mesh over the 8 forced CPU devices (``cpu_devices`` fixture of tests/conftest.py,
  which also pins the default device to CPU so the unsharded reference runs on XLA:CPU)."""
  t = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh((8,), ("x",), axis_types=(t,), devices=devices[:8])


@pytest.mark.parametrize(
    "fmt", [F.E4M3, F.FixedPoint(8, 3), F.BlockFormat(4, axis=1, block_size=4)], ids=repr)
def test_sharded_sr_equals_unsharded(fmt, cpu_devices):
  mesh = _mesh(cpu_devices)
  x = jax.random.normal(jax.random.key(2), (64, 24))
  key = jax.random.key(9)
  f = jax.jit(lambda v, k: F.quantize(v, fmt, "stochastic", key=k))
  want = f(x, key)
  xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
  got = f(xs, key)
  assert len(got.sharding.device_set) == 8 or len(xs.sharding.device_set) == 8
  _ref.assert_same_bits(got, want, msg=repr(fmt))
  xs2 = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
  _ref.assert_same_bits(f(xs2, key), want, msg=repr(fmt) + " cols")


def test_shard_map_local_index_semantics(cpu_devices):
  mesh = _mesh(cpu_devices)
  x = jax.random.normal(jax.random.key(3), (64, 16))
  key = jax.random.key(11)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
  def local(v, k):
    return F.quantize(v, F.E4M3, "stochastic", key=k)

  got = np.asarray(jax.jit(local)(x, key))
  alone = jax.jit(lambda v, k: F.quantize(v, F.E4M3, "stochastic", key=k))
  for i in range(8):
    blk = x[i * 8:(i + 1) * 8]
    want = alone(blk, key)
    _ref.assert_same_bits(got[i * 8:(i + 1) * 8], want, msg=f"shard {i}")


def test_explicit_mesh_elementwise_sr_equals_unsharded(cpu_devices):
  mesh = _mesh(cpu_devices, explicit=True)
  x = jax.random.normal(jax.random.key(2), (64, 24))
  key = jax.random.key(9)
  f = jax.jit(lambda v, k: F.quantize(v, F.E4M3, "stochastic", key=k))
  want = f(x, key)
  xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
  _ref.assert_same_bits(f(xs, key), want)
