"""NVFP4 / ScaledBlockFormat against a numpy float32 step-by-step reference, bit for bit.

The reference (``_scaled_ref.scaled_block_reference``) runs each float32 operation of the
definition in numpy (which keeps float32 subnormals), with ml_dtypes' round-to-nearest-even
casts for the UE4M3 scales and the elements. The exact IEEE arithmetic the spec builds from
integer ops (``jaxlp/formats/_fparith.py``) is checked against numpy's float32 ``*`` and
``/`` directly.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats import _fparith as A

from . import _ref
from ._scaled_ref import scaled_block_reference

F32 = np.float32


@functools.partial(jax.jit, static_argnums=(1, 2))
def _qj(x, fmt, rounding="nearest"):
  return F.quantize(x, fmt, rounding)


def _q(x, fmt, rounding="nearest"):
  return np.asarray(_qj(jnp.asarray(x), fmt, rounding))


def _ref_of(x, fmt):
  kw = dict(elem=fmt.elem.name, elem_max=fmt.elem.max_normal, scale_fmt=fmt.scale_fmt,
            tensor_scale=fmt.tensor_scale)
  if fmt.tile is not None:
    kw["tile"] = fmt.tile
  else:
    kw.update(block_size=fmt.block_size, axis=fmt.axis)
  return scaled_block_reference(x, **kw)


# ---------------------------------------------------------------------------------------
# The exact float32 arithmetic
# ---------------------------------------------------------------------------------------
def _mags(rng, n):
  """Magnitude bit patterns: uniform over finite floats, subnormals, short significands
  (products and quotients that tie), and mid-range values."""
  b = rng.integers(0, 0x7F800000, n, dtype=np.uint64).astype(np.uint32)
  k = n // 4
  b[:k] = rng.integers(0, 1 << 23, k).astype(np.uint32)
  b[k:2 * k] = ((rng.integers(1, 254, k) << 23) | (rng.integers(0, 16, k) << 19)).astype(
      np.uint32)
  b[2 * k:3 * k] = ((rng.integers(100, 160, k) << 23) | rng.integers(0, 1 << 23, k)).astype(
      np.uint32)
  return b


def test_mul_and_div_are_ieee_float32():
  rng = np.random.default_rng(0)
  a, b = _mags(rng, 1 << 17), _mags(rng, 1 << 17)
  b[b == 0] = 1
  with np.errstate(all="ignore"):
    want_mul = (a.view(F32) * b.view(F32)).view(np.uint32)
    want_div = (a.view(F32) / b.view(F32)).view(np.uint32)
  got_mul, got_div = jax.jit(lambda a, b: (A.mul_mag(a, b), A.div_mag(a, b)))(a, b)
  np.testing.assert_array_equal(np.asarray(got_mul), want_mul)
  np.testing.assert_array_equal(np.asarray(got_div), want_div)


@pytest.mark.parametrize("divisor", [6.0, 2688.0, 7.5, 448.0, 1.0, 0.375])
def test_division_by_a_narrow_constant(divisor):
  k = A.narrow_bits(divisor)
  assert k is not None
  a = _mags(np.random.default_rng(1), 1 << 16)
  with np.errstate(all="ignore"):
    want = (a.view(F32) / F32(divisor)).view(np.uint32)
  got = jax.jit(lambda a: A.div_narrow(a, divisor, k))(a)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_narrow_products_and_quotients_by_scales():
  """Decode ``q * t`` with E2M1 values q, and ``(1/g) / sb`` with UE4M3 / E8M0 scales sb."""
  rng = np.random.default_rng(2)
  n = 1 << 16
  a = _mags(rng, n)
  q = rng.choice(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32), n)
  ue4m3 = np.arange(0x08, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
  sb = rng.choice(ue4m3, n)
  p2 = np.ldexp(F32(1), rng.integers(-127, 128, n)).astype(F32)
  with np.errstate(all="ignore"):
    want = [(q * a.view(F32)).view(np.uint32), (a.view(F32) / sb).view(np.uint32),
            (a.view(F32) / p2).view(np.uint32)]
  got = jax.jit(lambda a, q, sb, p2: (
      A.mul_narrow(q, 1, *A.normalize(a)), A.div_narrow(a, sb, 3), A.div_narrow(a, p2, 0)))(
          a, q.view(np.uint32), sb.view(np.uint32), p2.view(np.uint32))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), w)


# ---------------------------------------------------------------------------------------
# The format against the step-by-step reference
# ---------------------------------------------------------------------------------------
def _families():
  """Input families, all of shape (24, 64) (one compiled program per format)."""
  rng = np.random.default_rng(3)
  shape = (24, 64)
  fam = {}
  for scale in (1e-37, 1e-30, 1e-8, 1.0, 3e4, 1e20, 1e37):
    fam[f"normal*{scale:g}"] = (rng.standard_normal(shape) * scale).astype(F32)
  x = rng.standard_normal(shape).astype(F32)
  x[::5, 7] *= 1e5  # outliers: one large element in some blocks
  fam["outliers"] = x
  # values whose scaled images are E2M1 midpoints (ties) with power-of-two block scales
  x = (rng.integers(-24, 25, shape) * 0.25).astype(F32)
  x[:, ::16] = 6.0
  fam["ties"] = x
  x = rng.standard_normal(shape).astype(F32)
  x[2:6] = 0.0
  x[7, :] = -0.0
  x[8:12] *= F32(1e-39)  # float32 subnormal blocks
  x[12, 3] = F32(2.0**-149)
  fam["zeros+subnormals"] = x
  x = rng.standard_normal(shape).astype(F32)
  x[:, 32:48] *= F32(2.0**-60)  # blocks far below the tensor max: UE4M3 scales clamp at 2**-6
  fam["tiny blocks"] = x
  fam["all zero"] = np.zeros(shape, F32)
  fam["below 2688 * 2**-121"] = (rng.standard_normal(shape) * 1e-36).astype(F32)
  fam["all subnormal"] = (rng.standard_normal(shape) * 1e-41).astype(F32)
  m = np.array([6.0, 448.0, 2688.0, 3.4e38, 1.0, 2.0**-126, 5.0, 3.5], F32)
  x = np.tile(np.outer(m, [1.0, -0.75, 0.2578125, 0.5]), (3, 16)).astype(F32)
  fam["maxima"] = x
  assert all(v.shape == shape for v in fam.values())
  return fam


FAMILIES = _families()


@pytest.mark.parametrize("fmt", [
    F.nvfp4(), F.nvfp4(tensor_scale=False), F.nvfp4(axis=0), F.nvfp4(tile=16),
    F.nvfp4(tile=(4, 8)), F.nvfp4(block_size=12),
], ids=repr)
def test_nvfp4_matches_the_reference(fmt):
  for name, x in FAMILIES.items():
    want = _ref_of(x, fmt)[0]
    _ref.assert_same_bits(_q(x, fmt), want, x, f"{fmt!r} on {name}")


@pytest.mark.parametrize("fmt", [
    F.ScaledBlockFormat(F.E2M3FN, block_size=8, tensor_scale=True),
    F.ScaledBlockFormat(F.E4M3FN, block_size=32, tensor_scale=False),
    F.ScaledBlockFormat(F.E2M1FN, block_size=32, scale_fmt="e8m0", tensor_scale=False),
    F.ScaledBlockFormat(F.E3M2FN, tile=(4, 4), scale_fmt="fp32", tensor_scale=False),
], ids=repr)
def test_other_scaled_block_formats_match_the_reference(fmt):
  for name, x in FAMILIES.items():
    want = _ref_of(x, fmt)[0]
    _ref.assert_same_bits(_q(x, fmt), want, x, f"{fmt!r} on {name}")


def test_nonfinite_inputs():
  x = np.ones((2, 32), F32)
  x[1, 5] = np.inf
  assert np.isnan(_q(x, F.nvfp4())).all()  # no tensor scale for a tensor holding inf
  got = _q(x, F.nvfp4(tensor_scale=False))  # one-level: only the block holding it
  assert np.isnan(got[1, :16]).all() and not np.isnan(got[0]).any()
  assert not np.isnan(got[1, 16:]).any()
  x[1, 5] = np.nan
  assert np.isnan(_q(x, F.nvfp4())).all()


def test_zero_and_tiny_tensors_are_finite():
  """The reference formulas divide 0 by 0 (all-zero tensor) and overflow 1/g (amax below
  ~8e-36); jaxlp's lower bound on g keeps them finite: zeros stay (signed) zeros."""
  z = np.zeros((2, 16), F32)
  z[1] = -0.0
  got = _q(z, F.nvfp4())
  np.testing.assert_array_equal(got.view(np.uint32), z.view(np.uint32))
  x = (np.random.default_rng(4).standard_normal((4, 16)) * 1e-36).astype(F32)
  got = _q(x, F.nvfp4())
  assert np.isfinite(got).all() and (np.abs(got) > 0).mean() > 0.8
  # with g >= 2**-121 and block scales >= 2**-6, r <= 2**127: |x| < 2**-129 rounds to 0
  x = np.array([2.0**-129, 2.0**-128, -(2.0**-127)] + [0.0] * 13, F32)
  np.testing.assert_array_equal(_q(x, F.nvfp4())[:3], [0.0, 2.0**-128, -(2.0**-127)])


def test_scale_chain_examples():
  """One block worked by hand: amax 12 -> g = 12 / 2688; s = 2 / g = 448; r = 1/g/448 = 0.5."""
  x = np.zeros(16, F32)
  x[:4] = [0.3, -1.7, 2.9, 12.0]
  q, s, g = F.nvfp4().encode(jnp.asarray(x))
  assert float(g) == float(F32(12.0) / F32(2688.0))
  assert float(s[0]) == 448.0
  np.testing.assert_array_equal(np.asarray(q[:4]), [0.0, -1.0, 1.5, 6.0])


@pytest.mark.parametrize("fmt", [F.nvfp4(), F.nvfp4(tile=16), F.nvfp4(axis=0)], ids=repr)
def test_encode_parts_match_the_reference_and_decode(fmt):
  x = FAMILIES["outliers"]
  q, s, g = fmt.encode(jnp.asarray(x))
  _, q_ref, s_ref, g_ref = _ref_of(x, fmt)
  _ref.assert_same_bits(q, q_ref, x, "elements")
  assert s.shape == fmt.scales_shape(x.shape)
  s_ref = s_ref.reshape(s.shape) if fmt.tile is not None else np.moveaxis(s_ref, -1, fmt.axis)
  _ref.assert_same_bits(s, s_ref, msg="block scales")
  assert float(g) == float(g_ref)
  _ref.assert_same_bits(fmt.decode(q, s, g), _q(x, fmt), x, "decode(encode(x))")
  with pytest.raises(ValueError, match="block_scales has shape"):
    fmt.decode(q, s[..., :1], g)


def test_encode_scales_layout():
  """Block scales are laid out like the array with the block axis shortened."""
  x = np.zeros((3, 40), F32)
  x[1, 17] = 6.0 * 2  # block (1, 1) of 16 along the last axis
  _, s, _ = F.nvfp4(tensor_scale=False).encode(jnp.asarray(x))
  assert s.shape == (3, 3)
  want = np.full((3, 3), 2.0**-6, F32)
  want[1, 1] = 2.0
  np.testing.assert_array_equal(np.asarray(s), want)
  _, s, _ = F.nvfp4(axis=0, tensor_scale=False).encode(jnp.asarray(x))
  assert s.shape == (1, 40) and float(s[0, 17]) == 2.0
  _, s, _ = F.nvfp4(tile=(2, 16), tensor_scale=False).encode(jnp.asarray(x[None]))
  assert s.shape == (1, 2, 3) and float(s[0, 0, 1]) == 2.0


def test_stochastic_elements_use_the_elementwise_noise():
  """Stochastic rounding acts on the elements only: with the same key, element i's noise is
  that of ``quantize(y, E2M1FN, 'stochastic')`` at index i, y the reference's scaled x."""
  x = FAMILIES["normal*1"]
  fmt = F.nvfp4()
  key = jax.random.key(7)
  q, s, g = fmt.encode(jnp.asarray(x), "stochastic", key=key)
  g32 = F32(g)
  sb = np.repeat(np.asarray(s), 16, axis=-1)
  y = np.clip(x * ((F32(1) / g32) / sb), F32(-6), F32(6))
  want = F.quantize(jnp.asarray(y), F.E2M1FN, "stochastic", key=key)
  _ref.assert_same_bits(q, want, x, "stochastic elements")
  # unbiased: the mean of many draws approaches the scaled value
  xs = jnp.full((4096, 16), 0.7, jnp.float32).at[:, 0].set(6.0)
  outs = F.quantize(xs, F.nvfp4(tensor_scale=False), "stochastic", key=key)
  assert abs(float(outs[:, 1].mean()) - 0.7) < 0.01


@pytest.mark.parametrize("rounding", ["toward_zero", "up", "down", "nearest_away"])
def test_directed_element_roundings(rounding):
  x = FAMILIES["zeros+subnormals"]
  fmt = F.nvfp4()
  q, s, g = fmt.encode(jnp.asarray(x), rounding)
  sb = np.repeat(np.asarray(s), 16, axis=-1)
  with np.errstate(all="ignore"):
    y = np.clip(x * ((F32(1) / F32(g)) / sb), F32(-6), F32(6))
  _ref.assert_same_bits(q, F.quantize(jnp.asarray(y), F.E2M1FN, rounding), x, rounding)


def _half_families(dt):
  """Half-precision inputs: normal values, the dtype's largest finite values, its
  subnormals and signed zeros (float16's range is the one that can overflow on the way
  back)."""
  info = jnp.finfo(dt)
  x = FAMILIES["normal*1"].copy()
  x[0, :16] = float(info.max) * np.linspace(-1.0, 1.0, 16)
  x[1, :16] = float(info.max)
  x[2, :16] = float(info.smallest_subnormal) * np.arange(16)
  x[3, :8] = -0.0
  return jnp.asarray(x).astype(dt)


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", [F.nvfp4(), F.nvfp4(tensor_scale=False)], ids=repr)
def test_half_inputs_are_widened_quantized_and_cast_back(dt, fmt):
  """float16/bfloat16: widened exactly, quantized in float32, the float32 result rounded to
  the input dtype (torchao's bfloat16 path; torchao refuses float16). Finite stays finite."""
  xh = _half_families(dt)
  got = F.quantize(xh, fmt)
  assert got.dtype == dt
  x32 = np.asarray(xh.astype(jnp.float32))
  want = _ref_of(x32, fmt)[0].astype(np.dtype(dt)).astype(F32)
  _ref.assert_same_bits(got.astype(jnp.float32), want, x32, f"{dt}")
  assert bool(jnp.isfinite(got).all())
  # negative zeros stay negative zeros
  assert bool(jnp.signbit(got[3, :8]).all())


def test_jit_vmap_grad():
  x = FAMILIES["normal*1"]
  fmt = F.nvfp4()
  rows = jax.jit(jax.vmap(lambda r: F.quantize(r, fmt)))(jnp.asarray(x))  # a tensor scale/row
  assert rows.shape == x.shape
  # row 3 alone has the bits of the step-by-step reference of that row (its own tensor scale;
  # the numpy reference instead of a second compiled quantize of the row's shape)
  _ref.assert_same_bits(rows[3], _ref_of(x[3], fmt)[0], x[3], "vmap row")
  g = jax.jit(jax.grad(lambda v: jnp.sum(F.quantize(v, fmt) * 2.0)))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 2.0, F32))


def test_sharded_input_has_the_unsharded_bits(cpu_devices):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  x = FAMILIES["outliers"]
  mesh = Mesh(np.array(cpu_devices[:4]), ("d",))
  xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, PartitionSpec("d")))
  got = jax.jit(lambda v: F.quantize(v, F.nvfp4()))(xs)
  _ref.assert_same_bits(got, _q(x, F.nvfp4()), x, "sharded")


def test_empty_and_scalar_and_partial_blocks():
  assert _q(np.zeros((0, 16), F32), F.nvfp4()).shape == (0, 16)
  for fmt in (F.nvfp4(), F.nvfp4(tile=16)):
    x = F32(3.3)
    _ref.assert_same_bits(_q(x, fmt), _ref_of(x, fmt)[0], x, "scalar")
    x = np.linspace(-2, 5, 21, dtype=F32)
    _ref.assert_same_bits(_q(x, fmt), _ref_of(x, fmt)[0], x, "1-D partial")


def test_block_axis_out_of_range():
  with pytest.raises(ValueError, match="out of range"):
    F.quantize(jnp.ones((4, 4)), F.nvfp4(axis=2))


def test_repr_and_hash():
  fmt = F.nvfp4(tile=16)
  assert fmt.tile == (16, 16) and fmt.axis is None and fmt.block_size is None
  assert "tile=(16, 16)" in repr(fmt) and hash(fmt) == hash(F.nvfp4(tile=(16, 16)))
  assert F.nvfp4() == F.ScaledBlockFormat()
