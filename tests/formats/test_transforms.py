"""quantize under jit, vmap, grad (straight-through), shard_map; half-precision inputs; HLO."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlp import formats as F

from . import _ref

FMTS = [F.E4M3, F.BF16, F.E2M1FN, F.FixedPoint(8, 4), F.BlockFormat(4, axis=-1, block_size=8),
        F.mx(F.E4M3FN, block_size=8), F.qpytorch_float(5, 2), F.cpd_float(4, 3),
        F.qpytorch_block(6), F.hbfp(6, 4)]


@pytest.fixture(scope="module")
def x():
  return jax.random.normal(jax.random.key(0), (16, 32)) * 3


def test_jit_equals_eager(x):
  for fmt in FMTS[:4]:
    _ref.assert_same_bits(jax.jit(lambda v, f=fmt: F.quantize(v, f))(x), F.quantize(x, fmt),
                          msg=repr(fmt))


def test_vmap_elementwise_equals_direct(x):
  for fmt in (F.E4M3, F.FixedPoint(8, 4), F.qpytorch_float(5, 2)):
    got = jax.jit(jax.vmap(lambda r, f=fmt: F.quantize(r, f)))(x)
    _ref.assert_same_bits(got, F.quantize(x, fmt), msg=repr(fmt))


def test_vmap_block_is_per_row(x):
  fmt = F.BlockFormat(4)  # one exponent per (vmapped) tensor = per row
  got = jax.jit(jax.vmap(lambda r: F.quantize(r, fmt)))(x)
  want = F.quantize(x, F.BlockFormat(4, tile=(1, None)))
  _ref.assert_same_bits(got, want)


@pytest.mark.parametrize("fmt", FMTS, ids=repr)
def test_grad_straight_through(fmt, x):
  g = jax.jit(jax.grad(lambda v: jnp.sum(F.quantize(v, fmt))))(x)
  np.testing.assert_array_equal(np.asarray(g), np.ones(x.shape, np.float32))
  if "stochastic" in fmt.supported_roundings:
    gs = jax.grad(lambda v: jnp.sum(F.quantize(v, fmt, "stochastic", key=jax.random.key(1)) * 2))(x)
    np.testing.assert_array_equal(np.asarray(gs), np.full(x.shape, 2, np.float32))


def test_jvp_and_value_and_grad(x):
  y, t = jax.jvp(lambda v: F.quantize(v, F.E4M3), (x,), (jnp.ones_like(x),))
  _ref.assert_same_bits(y, F.quantize(x, F.E4M3))
  np.testing.assert_array_equal(np.asarray(t), 1.0)


def test_shard_map_nearest_equals_global(x, cpu_devices):
  # mesh over the 8 forced CPU devices (not jax.devices(): one GPU on a GPU machine); the
  # cpu_devices fixture pins the default device, so the global reference runs on XLA:CPU too
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=cpu_devices[:8])
  for fmt in (F.E4M3, F.FixedPoint(8, 4), F.BlockFormat(4, axis=1, block_size=8)):
    f = jax.shard_map(lambda v, f=fmt: F.quantize(v, f), mesh=mesh, in_specs=P("x"),
                      out_specs=P("x"))
    _ref.assert_same_bits(jax.jit(f)(x), F.quantize(x, fmt), msg=repr(fmt))


@pytest.mark.parametrize("dt", [jnp.float16, jnp.bfloat16])
def test_half_inputs_exact(dt):
  n = np.arange(1 << 16, dtype=np.uint16)
  npdt = np.float16 if dt == jnp.float16 else ml_dtypes.bfloat16
  xh = jnp.asarray(n.view(npdt))
  for fmt in (F.E4M3, F.E5M2, F.BF16, F.FP16, F.E2M1FN, F.qpytorch_float(4, 3), F.cpd_float(5, 2),
              F.FixedPoint(8, 3), F.BlockFormat(5, axis=0, block_size=64), F.FP32):
    f = jax.jit(lambda v, f=fmt: F.quantize(v, f))
    got = f(xh)
    assert got.dtype == dt
    want = f(xh.astype(jnp.float32)).astype(dt)
    a = np.asarray(got.astype(jnp.float32))
    b = np.asarray(want.astype(jnp.float32))
    _ref.assert_same_bits(a, b, msg=f"{fmt!r} {dt}")
  # stochastic: same noise (index-based) -> same bits as the f32 path
  key = jax.random.key(3)
  got = F.quantize(xh, F.E4M3, "stochastic", key=key)
  want = F.quantize(xh.astype(jnp.float32), F.E4M3, "stochastic", key=key).astype(dt)
  _ref.assert_same_bits(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("fmt", [F.BF16, F.E4M3], ids=repr)
def test_hlo_keeps_integer_rounding(fmt):
  # A check of XLA:CPU's optimized HLO (op names as the CPU compiler leaves them; other
  # backends fuse differently): the input is committed to the CPU device so the graph is
  # compiled for the CPU whatever the default backend is.
  cpu = jax.devices("cpu")[0]
  x = jax.device_put(jnp.ones((1024,), jnp.float32), cpu)
  with jax.default_device(cpu):
    key = jax.random.key(0)
  txt = jax.jit(lambda v: F.quantize(v, fmt)).lower(x).compile().as_text()
  assert "shift-right-logical" in txt or " and(" in txt, txt[:2000]
  assert "bitcast-convert" in txt or "bitcast" in txt
  for mode in ("toward_zero", "stochastic"):
    f = functools.partial(F.quantize, fmt=fmt, rounding=mode, key=key)
    txt = jax.jit(f).lower(x).compile().as_text()
    assert "and(" in txt or "shift-right-logical" in txt
