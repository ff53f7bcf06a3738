"""Random Hadamard transform (jaxlp.RHT): its definition against numpy references (Hadamard
matrix, SplitMix64 signs, the float32 butterfly bit for bit), the inverse, cancellation in
GEMMs (dot_general and convolutions), reproducibility under jit / vmap / shard_map, and the
DotPolicy option's validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlp
from jaxlp.ops import RHT, hadamard_matrix

RNG = np.random.default_rng(46)
DIMS = (((1,), (0,)), ((), ()))


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _same_bits(a, b):
  """Bit patterns equal, NaN-aware (a NaN's sign and payload are not part of the spec)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
  ok = ~np.isnan(a)
  np.testing.assert_array_equal(_bits(a)[ok], _bits(b)[ok])


# -- references ---------------------------------------------------------------------------
def _sylvester(n):
  h = np.ones((1, 1), np.int64)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def _splitmix64_outputs(seed, count):
  """SplitMix64 (Steele, Lea, Flood 2014) with numpy uint64 wrap-around arithmetic."""
  out, s = [], np.uint64(seed)
  with np.errstate(over="ignore"):
    for _ in range(count):
      s = s + np.uint64(0x9E3779B97F4A7C15)
      z = s
      z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
      z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
      out.append(int(z ^ (z >> np.uint64(31))))
  return out


def _signs_ref(seed, n):
  words = _splitmix64_outputs(seed, (n + 63) // 64)
  return np.array([-1.0 if (words[i // 64] >> (i % 64)) & 1 else 1.0 for i in range(n)],
                  np.float32)


def _fwht_f32(v):
  """The documented butterfly on one chunk, element by element in numpy float32."""
  v = np.array(v, np.float32)
  n, h = len(v), 1
  with np.errstate(over="ignore", invalid="ignore"):
    while h < n:
      for i in range(n):
        if i & h == 0:
          a, b = v[i], v[i + h]
          v[i], v[i + h] = np.float32(a + b), np.float32(a - b)
      h *= 2
  return v


def _apply_ref(x, t: RHT, axis):
  x = np.moveaxis(np.array(x, np.float32), axis, -1).copy()
  s, scale = t.signs, np.float32(1 / np.sqrt(t.size))
  flat = x.reshape(-1, x.shape[-1])
  for row in flat:
    for c in range(x.shape[-1] // t.size):
      sl = slice(c * t.size, (c + 1) * t.size)
      with np.errstate(over="ignore", invalid="ignore"):
        row[sl] = _fwht_f32(row[sl] * s) * scale
  return np.moveaxis(flat.reshape(x.shape), -1, axis)


def _inv_ref(y, t: RHT, axis):
  y = np.moveaxis(np.array(y, np.float32), axis, -1).copy()
  s, scale = t.signs, np.float32(1 / np.sqrt(t.size))
  flat = y.reshape(-1, y.shape[-1])
  for row in flat:
    for c in range(y.shape[-1] // t.size):
      sl = slice(c * t.size, (c + 1) * t.size)
      with np.errstate(over="ignore", invalid="ignore"):
        row[sl] = _fwht_f32(row[sl]) * scale * s
  return np.moveaxis(flat.reshape(y.shape), -1, axis)


# -- the definition -----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4, 16, 64])
def test_hadamard_matrix_is_sylvester_and_orthogonal(n):
  h = hadamard_matrix(n)
  assert h.dtype == np.int8
  np.testing.assert_array_equal(h, _sylvester(n))
  np.testing.assert_array_equal(h.astype(np.int64) @ h.T, n * np.eye(n, dtype=np.int64))
  for bad in (0, 3, 12, -4, 2.0, True):
    with pytest.raises(ValueError, match="power of two"):
      hadamard_matrix(bad)


def test_splitmix64_signs_match_the_reference_and_a_known_vector():
  # SplitMix64 seeded with 0: first output 0xE220A8397B1DCDAF (the published test vector)
  assert _splitmix64_outputs(0, 1)[0] == 0xE220A8397B1DCDAF
  word = 0xE220A8397B1DCDAF
  want = np.array([-1.0 if (word >> i) & 1 else 1.0 for i in range(16)], np.float32)
  np.testing.assert_array_equal(RHT(seed=0).signs, want)
  for seed in (0, 1, 46, 2**32 + 7, 2**64 - 1):
    for size in (4, 16, 64, 256):
      s = RHT(size=size, seed=seed).signs
      assert s.dtype == np.float32 and s.shape == (size,)
      np.testing.assert_array_equal(s, _signs_ref(seed, size))
  # a 256 transform's signs continue the 16's (one stream per seed)
  np.testing.assert_array_equal(RHT(size=256, seed=5).signs[:16], RHT(seed=5).signs)
  assert not np.array_equal(RHT(seed=0).signs, RHT(seed=1).signs)


def test_matrix_is_orthogonal_and_is_what_apply_computes():
  t = RHT(seed=3)
  m = t.matrix
  np.testing.assert_allclose(m @ m.T, np.eye(16), atol=1e-15)
  np.testing.assert_array_equal(m, _sylvester(16) * t.signs[None, :] / 4.0)
  # T(e_i) is column i of M: entries +-1/4, exact in float32
  eye = jnp.eye(16, dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(t.apply(eye, axis=1)), m.T.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(t.invert(eye, axis=1)), m.astype(np.float32))


def _inputs():
  x = RNG.standard_normal((3, 40)).astype(np.float32) * np.float32(2.0) ** RNG.integers(
      -20, 20, (3, 40)).astype(np.float32)
  x[0, :16] = [0.0, -0.0, 1.0, -1.0, 3.0e38, 3.0e38, -3.0e38, 1e-30, 2.0**-100, 7.0, -7.0,
               0.5, 0.25, 1.0 + 2.0**-23, 1.0, 1.0]  # overflow to inf in the sums, ties
  x[1, 16:32] = 1.0 + np.arange(16, dtype=np.float32) * np.float32(2.0**-22)  # rounding
  x[2, 3] = np.inf
  x[2, 20] = np.nan
  return x


@pytest.mark.parametrize("size", [4, 16])
def test_apply_and_invert_equal_the_float32_butterfly_bit_for_bit(size):
  t = RHT(("fwd",), size=size, seed=7)
  x = _inputs()
  f = jax.jit(lambda v: (t.apply(v, axis=1), t.invert(v, axis=1)))
  got_a, got_i = f(jnp.asarray(x))
  _same_bits(got_a, _apply_ref(x, t, 1))
  _same_bits(got_i, _inv_ref(x, t, 1))
  # the last 40 % size elements are untouched
  tail = 40 - 40 % size
  _same_bits(np.asarray(got_a)[:, tail:], x[:, tail:])
  # along axis 0 of the transpose: the same numbers
  _same_bits(t.apply(jnp.asarray(x.T), axis=0), np.asarray(got_a).T)
  # and close to M @ v in float64 where nothing overflows
  ok = np.all(np.isfinite(x) & (np.abs(x) < 1e30), axis=1)
  x64 = x[ok, :tail].reshape(-1, tail // size, size).astype(np.float64)
  want = np.einsum("ij,rcj->rci", t.matrix, x64).reshape(-1, tail)
  got = np.asarray(got_a)[ok, :tail]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(x64).max())


def test_inverse_round_trip():
  t = RHT(seed=11)
  ints = jnp.asarray(RNG.integers(-1000, 1000, (4, 64)).astype(np.float32))
  _same_bits(t.invert(t.apply(ints, axis=1), axis=1), ints)  # every sum exact: exact
  _same_bits(t.apply(t.invert(ints, axis=1), axis=1), ints)
  x = jnp.asarray(RNG.standard_normal((4, 64)).astype(np.float32))
  back = np.asarray(t.invert(t.apply(x, axis=1), axis=1))
  chunk_max = np.abs(np.asarray(x)).reshape(4, 4, 16).max(-1).repeat(16, -1)
  # 4 rounded stages each way: a few ulps of the chunk's largest magnitude
  assert np.all(np.abs(back - np.asarray(x)) <= 16 * 2.0**-24 * 4 * chunk_max)
  assert not np.array_equal(back, np.asarray(x))  # rounding does happen


def test_low_precision_dtypes_are_transformed_in_float32_and_rounded_back():
  t = RHT(seed=2)
  x = RNG.standard_normal((2, 32)).astype(np.float32)
  for dt in (jnp.bfloat16, jnp.float16):
    xl = jnp.asarray(x, dt)
    got = t.apply(xl, axis=1)
    assert got.dtype == dt
    want = t.apply(xl.astype(jnp.float32), axis=1).astype(dt)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))
  with pytest.raises(TypeError, match="float"):
    t.apply(jnp.ones((16,), jnp.int32))
  with pytest.raises(ValueError, match="at least one axis"):
    t.apply(jnp.float32(1.0))


# -- in a GEMM -----------------------------------------------------------------------------
@pytest.mark.parametrize("gemms", [("fwd",), ("dlhs",), ("drhs",), ("fwd", "dlhs", "drhs")])
def test_dot_general_with_rht_only_equals_the_plain_op_up_to_rounding(gemms):
  """No quantization, only the transform: forward and both gradients match the plain lax
  op up to float32 rounding, and the transformed GEMMs differ in their bits (it ran)."""
  pol = jaxlp.DotPolicy(dlhs_rhs=None, drhs_lhs=None, drhs_grad=None, rht=RHT(gemms))
  assert not pol.is_identity
  x = jnp.asarray(RNG.standard_normal((32, 48)).astype(np.float32))
  w = jnp.asarray(RNG.standard_normal((48, 32)).astype(np.float32))
  g = jnp.asarray(RNG.standard_normal((32, 32)).astype(np.float32))
  dg = jaxlp.dot_general(pol)

  def run(f):
    y, vjp = jax.vjp(lambda a, b: f(a, b, DIMS), x, w)
    return (y, *vjp(g))

  got = jax.jit(lambda: run(dg))()
  ref = jax.jit(lambda: run(lax.dot_general))()
  for name, a, b in zip(("fwd", "dlhs", "drhs"), got, ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=5e-5)
    assert (not np.array_equal(np.asarray(a), np.asarray(b))) == (name in gemms), name


@pytest.mark.usefixtures("fast_compile")  # a tolerance: any optimization level
def test_transform_cancels_in_the_product():
  t = RHT(seed=5)
  a = RNG.standard_normal((8, 48)).astype(np.float32)
  b = RNG.standard_normal((48, 6)).astype(np.float32)
  got = np.asarray(t.apply(a, axis=1) @ t.apply(b, axis=0))
  np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=0, atol=1e-5)
  # one operand alone does not cancel
  assert np.abs(np.asarray(t.apply(a, axis=1)) @ b - a @ b).max() > 1.0


@pytest.mark.usefixtures("fast_compile")  # tolerances: any optimization level
def test_rht_on_n_d_dot_general_and_attention_einsum():
  """(batch, seq, features) activations: the weight-gradient GEMM contracts (batch, seq); the
  transform runs along seq (the innermost contracting axis) for every batch index."""
  pol = jaxlp.DotPolicy(dlhs_rhs=None, drhs_lhs=None, drhs_grad=None, rht=RHT(("drhs",)))
  x = jnp.asarray(RNG.standard_normal((2, 32, 24)).astype(np.float32))
  w = jnp.asarray(RNG.standard_normal((24, 8)).astype(np.float32))
  dims = (((2,), (0,)), ((), ()))
  f = lambda a, b: (jaxlp.dot_general(pol)(a, b, dims) ** 2).sum()
  dw = jax.jit(jax.grad(f, argnums=1))(x, w)  # one program (eagerly: one per operation)
  ref = jax.jit(jax.grad(lambda a, b: (lax.dot_general(a, b, dims) ** 2).sum(), argnums=1))(x, w)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(ref), rtol=1e-5, atol=1e-3)
  # einsum with batch dims (attention scores): fwd transform along the head dim
  pol = jaxlp.DotPolicy(dlhs_rhs=None, drhs_lhs=None, drhs_grad=None, rht=RHT(("fwd",)))
  q = jnp.asarray(RNG.standard_normal((2, 8, 3, 16)).astype(np.float32))
  k = jnp.asarray(RNG.standard_normal((2, 8, 3, 16)).astype(np.float32))
  got = jax.jit(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k,
                                        _dot_general=jaxlp.dot_general(pol)))(q, k)
  np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.einsum("bqhd,bkhd->bhqk", q, k)),
                             atol=5e-5)


@pytest.mark.usefixtures("fast_compile")  # a tolerance; it ran (bits differ): any level
def test_rht_cancels_in_every_conv_gemm():
  """Convolutions: features (fwd), out-features (dlhs), batch (weight gradient)."""
  pol = jaxlp.DotPolicy(dlhs_rhs=None, drhs_lhs=None, drhs_grad=None,
                        rht=RHT(("fwd", "dlhs", "drhs")))
  x = jnp.asarray(RNG.standard_normal((16, 6, 6, 16)).astype(np.float32))  # NHWC
  k = jnp.asarray(RNG.standard_normal((3, 3, 16, 32)).astype(np.float32))  # HWIO
  dn = lax.conv_dimension_numbers(x.shape, k.shape, ("NHWC", "HWIO", "NHWC"))
  conv = functools.partial(jaxlp.conv_general_dilated(pol), window_strides=(1, 1),
                           padding="SAME", dimension_numbers=dn)
  plain = functools.partial(lax.conv_general_dilated, window_strides=(1, 1), padding="SAME",
                            dimension_numbers=dn)
  g = jnp.asarray(RNG.standard_normal((16, 6, 6, 32)).astype(np.float32))

  def run(f):
    y, vjp = jax.vjp(f, x, k)
    return (y, *vjp(g))

  for a, b in zip(jax.jit(lambda: run(conv))(), jax.jit(lambda: run(plain))(), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=2e-6 * float(jnp.abs(b).max()))
    assert not np.array_equal(np.asarray(a), np.asarray(b))


# -- reproducibility -----------------------------------------------------------------------
def test_same_bits_under_jit_vmap_and_shard_map():
  """The signs are a function of the seed only: eager, jit, vmap, a jit of a sharded global
  array (sharded along the transform axis and along another) and shard_map (shards of whole
  chunks) all give the same bits."""
  t = RHT(seed=9)
  x = jnp.asarray(RNG.standard_normal((8, 128)).astype(np.float32))
  want = t.apply(x, axis=1)
  _same_bits(jax.jit(lambda v: t.apply(v, axis=1))(x), want)
  _same_bits(jax.vmap(lambda v: t.apply(v, axis=0))(x), want)
  _same_bits(jax.vmap(lambda v: t.apply(v, axis=0), in_axes=1, out_axes=1)(x.T), want.T)
  n = len(jax.devices())
  assert n == 8, "tests/conftest.py forces 8 CPU devices"
  mesh = Mesh(np.array(jax.devices()), ("d",))  # Auto axes (as jaxlp train's mesh)
  for spec in (P("d", None), P(None, "d")):
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    _same_bits(jax.jit(lambda v: t.apply(v, axis=1))(xs), want)
    # each shard holds whole 16-chunks along the transform axis: local == global chunks
    sm = jax.shard_map(lambda v: t.apply(v, axis=1), mesh=mesh, in_specs=spec, out_specs=spec)
    _same_bits(jax.jit(sm)(xs), want)


def test_recipe_gemm_bits_do_not_depend_on_sharding():
  """The NVFP4 recipe (RHT on the weight gradient, stochastic gradients) on a jit of operands
  sharded along the batch: the forward and dlhs GEMMs (which do not contract the batch) have
  the bits of the unsharded run, and so have the weight-gradient GEMM's transformed and
  quantized operands (its float32 sum over the sharded batch is then the backend's: XLA
  adds per-shard partial sums)."""
  from jaxlp import formats as F

  pol = jaxlp.nvfp4_recipe()
  x = jnp.asarray(RNG.standard_normal((64, 32)).astype(np.float32))
  w = jnp.asarray(RNG.standard_normal((32, 16)).astype(np.float32))
  g = jnp.asarray(RNG.standard_normal((64, 16)).astype(np.float32))
  key = jax.random.key(3)
  t = pol.rht

  def step(a, b, c):
    y, vjp = jax.vjp(lambda a, b: jaxlp.dot_general(pol, key=key)(a, b, DIMS), a, b)
    dx, _ = vjp(c)
    # the weight-gradient GEMM's operands, as the policy makes them (slots 4 and 5)
    lq = F.quantize(t.apply(a, axis=0), F.nvfp4(axis=0))
    gq = F.quantize(t.apply(c, axis=0), F.nvfp4(axis=0), "stochastic",
                    key=jax.random.fold_in(key, 5))
    return y, dx, lq, gq

  want = jax.jit(step)(x, w, g)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  rows = NamedSharding(mesh, P("d", None))
  got = jax.jit(step)(jax.device_put(x, rows), w, jax.device_put(g, rows))
  for a, b in zip(got, want, strict=True):
    _same_bits(a, b)


# -- the policy option ---------------------------------------------------------------------
def test_rht_validation():
  for kw, msg in (({"gemms": ("wgrad",)}, "gemms"), ({"gemms": ()}, "gemms"),
                  ({"gemms": ("fwd", "fwd")}, "gemms"), ({"size": 8}, "size"),
                  ({"size": 32}, "size"), ({"size": True}, "size"), ({"seed": -1}, "seed"),
                  ({"seed": 2**64}, "seed"), ({"seed": 1.0}, "seed")):
    with pytest.raises(ValueError, match=msg):
      RHT(**kw)
  assert RHT("drhs").gemms == ("drhs",)
  assert hash(RHT()) == hash(RHT(("drhs",), 16, 0))
  with pytest.raises(TypeError, match="rht"):
    jaxlp.DotPolicy(rht=("drhs",))


@pytest.mark.parametrize("gemms, kw, slot", [
    (("drhs",), {}, "drhs_lhs"),  # default drhs_lhs="fwd": the untransformed forward lhs
    (("drhs",), {"drhs_lhs": None}, "drhs_grad"),  # default drhs_grad="grad"
    (("fwd",), {"drhs_lhs": None, "drhs_grad": None}, "dlhs_rhs"),
    (("fwd",), {"dlhs_rhs": None, "drhs_grad": None}, "drhs_lhs"),
    (("dlhs",), {"dlhs_rhs": None, "drhs_lhs": None}, "drhs_grad"),
])
def test_shared_operands_of_a_transformed_gemm_are_refused(gemms, kw, slot):
  with pytest.raises(ValueError, match=f"give {slot} its own format"):
    jaxlp.DotPolicy(rht=RHT(gemms), **kw)
