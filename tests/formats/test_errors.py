"""Every bad input raises a clear error naming the problem."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp import formats as F


def test_int_input_raises():
  with pytest.raises(TypeError, match="dtype=int32"):
    F.quantize(jnp.arange(4, dtype=jnp.int32), F.E4M3)
  with pytest.raises(ValueError, match="dtype"):  # DTypeError is both
    F.quantize(np.arange(4, dtype=np.uint8), F.BF16)
  with pytest.raises(TypeError, match="dtype=bool"):
    F.quantize(jnp.ones(2, bool), F.E4M3)


def test_float64_input_raises_under_x64():
  with jax.enable_x64(True):
    x = jnp.ones(3, jnp.float64)
    assert x.dtype == jnp.float64
    with pytest.raises(F.DTypeError, match="float64"):
      F.quantize(x, F.E4M3)
  # a numpy float64 array (x64 off) is also refused, not silently narrowed
  with pytest.raises(F.DTypeError, match="float64"):
    F.quantize(np.ones(3), F.E4M3)


def test_other_float_dtypes_raise():
  with pytest.raises(F.DTypeError):
    F.quantize(jnp.ones(3, jnp.float8_e4m3fn), F.E4M3)


@pytest.mark.parametrize("rounding", ["nearest_even", "rne", "", None, "Stochastic"])
def test_unknown_rounding(rounding):
  with pytest.raises(ValueError, match="rounding"):
    F.quantize(jnp.ones(3), F.E4M3, rounding)


@pytest.mark.parametrize("fmt, rounding", [
    (F.cpd_float(4, 3), "stochastic"), (F.cpd_float(4, 3), "up"),
    (F.qpytorch_float(4, 3), "toward_zero"), (F.qpytorch_float(4, 3), "nearest_away"),
    (F.qpytorch_block(8), "down"),
])
def test_unsupported_rounding_for_compat(fmt, rounding):
  with pytest.raises(ValueError, match=f"rounding={rounding!r}"):
    F.quantize(jnp.ones(3), fmt, rounding, key=jax.random.key(0))


@pytest.mark.parametrize("fmt", [F.E4M3, F.BlockFormat(4), F.FixedPoint(8, 4), F.mx(F.E2M1FN),
                                 F.qpytorch_float(4, 3), F.qpytorch_block(8)], ids=repr)
def test_missing_key(fmt):
  with pytest.raises(ValueError, match="key"):
    F.quantize(jnp.ones(3), fmt, "stochastic")


@pytest.mark.parametrize("key", [
    jnp.zeros(3, jnp.uint32), jnp.zeros(2, jnp.int32), jnp.zeros((2, 2), jnp.uint32),
    jax.random.split(jax.random.key(0), 2), 0, "key",
], ids=["u32[3]", "i32[2]", "u32[2,2]", "typed[2]", "int", "str"])
def test_bad_key(key):
  with pytest.raises(ValueError, match="key"):
    F.quantize(jnp.ones(3), F.E4M3, "stochastic", key=key)


@pytest.mark.parametrize("rb", [0, 33, -1, 2.5, True])
def test_bad_rand_bits(rb):
  with pytest.raises(ValueError, match="rand_bits"):
    F.quantize(jnp.ones(3), F.E4M3, "stochastic", key=jax.random.key(0), rand_bits=rb)


def test_rand_bits_needs_stochastic():
  with pytest.raises(ValueError, match="rand_bits"):
    F.quantize(jnp.ones(3), F.E4M3, "nearest", rand_bits=8)


@pytest.mark.parametrize("fmt", ["E4M3", None, 8, ml_dtypes.float8_e4m3fn, jnp.bfloat16,
                                 (4, 3)], ids=repr)
def test_non_format(fmt):
  with pytest.raises(TypeError, match="fmt must be a jaxlp format"):
    F.quantize(jnp.ones(3), fmt)
  with pytest.raises(TypeError):
    F.check_format(fmt)


@pytest.mark.parametrize("make, field", [
    (lambda: F.BlockFormat(0), "man_bits"),
    (lambda: F.BlockFormat(25), "man_bits"),
    (lambda: F.BlockFormat(4.0), "man_bits"),
    (lambda: F.BlockFormat(4, exponent="floor"), "exponent"),
    (lambda: F.BlockFormat(4, tile=(2, 2), axis=0), "tile"),
    (lambda: F.BlockFormat(4, axis=1.0), "axis"),
    (lambda: F.BlockFormat(4, axis=0, block_size=0), "block_size"),
    (lambda: F.BlockFormat(4, block_size=4), "block_size"),
    (lambda: F.BlockFormat(4, tile=(0, 3)), "tile"),
    (lambda: F.BlockFormat(4, tile=(3,)), "tile"),
    (lambda: F.BlockFormat(4, tile=[3, 3]), "tile"),
    (lambda: F.BlockFormat(4, eps=-1.0), "eps"),
    (lambda: F.hbfp(8, -1), "tile"),
    (lambda: F.hbfp(8, 2.5), "tile"),
    (lambda: F.mx("fp8"), "elem"),
    (lambda: F.mx(F.E4M3FN, block_size=0), "block_size"),
    (lambda: F.mx(F.E4M3FN, axis=0.5), "axis"),
    (lambda: F.mx(F.E4M3), "E4M3FN"),
    (lambda: F.mx(F.BF16), "OCP MX element"),
    (lambda: F.mx(F.FP32), "OCP MX element"),
    (lambda: F.mx(F.E4M3FNUZ), "OCP MX element"),
    (lambda: F.mx(F.E4M3FN, scale_rule="round"), "scale_rule"),
    (lambda: F.mx("int8", scale_rule="rceil"), "int8|MXINT8"),
    (lambda: F.nvfp4(block_size=0), "block_size"),
    (lambda: F.nvfp4(axis=1.5), "axis"),
    (lambda: F.nvfp4(tile=(16, 0)), "tile"),
    (lambda: F.nvfp4(tile=16, axis=0), "either tile"),
    (lambda: F.ScaledBlockFormat(F.E2M1FN, scale_fmt="e4m3"), "scale_fmt"),
    (lambda: F.ScaledBlockFormat(F.E2M1FN, scale_fmt="e8m0"), "tensor_scale"),
    (lambda: F.ScaledBlockFormat("int8"), "elem"),
    (lambda: F.ScaledBlockFormat(F.BF16), "float32"),
    (lambda: F.ScaledBlockFormat(F.E2M1FN, tensor_scale=1), "tensor_scale"),
    (lambda: F.cpd_float(0, 3), "exp"),
    (lambda: F.cpd_float(9, 3), "exp"),
    (lambda: F.cpd_float(4, 24), "man"),
    (lambda: F.cpd_float(4, -1), "man"),
    (lambda: F.qpytorch_float(0, 3), "exp"),
    (lambda: F.qpytorch_float(4, 24), "man"),
    (lambda: F.qpytorch_float(4.0, 3), "exp"),
    (lambda: F.qpytorch_block(1), "wl"),
    (lambda: F.qpytorch_block(24), "wl"),
    (lambda: F.qpytorch_block(8, -2), "dim"),
    (lambda: F.qpytorch_block(8, 0.0), "dim"),
    (lambda: F.FixedPoint(0, 0), "wl"),
    (lambda: F.FixedPoint(33, 0), "wl"),
    (lambda: F.FixedPoint(8, 1.5), "fl"),
    (lambda: F.FixedPoint(8, 200), "fl"),
    (lambda: F.FixedPoint(8, -130), "fl"),
    (lambda: F.FixedPoint(32, -100), "range"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_format_fields(make, field):
  with pytest.raises(ValueError, match=field):
    make()


def test_qpytorch_block_dim_out_of_range():
  with pytest.raises(ValueError, match="dim"):
    F.quantize(jnp.ones((2, 3)), F.qpytorch_block(8, 2))
