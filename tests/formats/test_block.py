"""BlockFormat geometry/exponent rules and OCP MX against independent numpy emulations."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp import formats as F

from . import _ref


@functools.partial(jax.jit, static_argnums=(1, 2))
def _qj(x, fmt, rounding):
  return F.quantize(x, fmt, rounding)


def _q(x, fmt, rounding="nearest"):
  return np.asarray(_qj(jnp.asarray(x), fmt, rounding))


def _np_bfp_block(v, m):
  """Exact BFP of one block (float64): e = floor(log2 max) + 1, RNE to 2^(e-m), saturate."""
  mx = np.abs(v).max()
  if mx == 0:
    return np.zeros_like(v)
  e = np.floor(np.log2(mx)) + 1
  step = 2.0 ** (e - m)
  return np.clip(np.round(v / step) * step, -(2.0**e - step), 2.0**e - step)


def _data(rng, shape):
  return (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)


@pytest.mark.parametrize("axis, bs", [(0, None), (1, None), (-1, 5), (0, 3), (2, 4)])
def test_blockformat_axis_blocks(axis, bs):
  rng = np.random.default_rng(abs(axis) * 10 + (bs or 0))
  x = _data(rng, (7, 11, 6))
  m = 5
  got = _q(x, F.BlockFormat(m, axis=axis, block_size=bs))
  xm = np.moveaxis(x, axis, -1).astype(np.float64)
  want = np.empty_like(xm)
  n = xm.shape[-1]
  b = n if bs is None else bs
  for idx in np.ndindex(xm.shape[:-1]):
    for s in range(0, n, b):
      want[idx + (slice(s, s + b),)] = _np_bfp_block(xm[idx + (slice(s, s + b),)], m)
  want = np.moveaxis(want, -1, axis).astype(np.float32)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("tile", [(None, None), (1, None), (2, 3), (4, 4)])
def test_blockformat_tiles(tile):
  rng = np.random.default_rng(5)
  x = _data(rng, (5, 3, 3))
  m = 7
  got = _q(x, F.BlockFormat(m, tile=tile))
  x2 = x.reshape(5, 9).astype(np.float64)
  tr = 5 if tile[0] is None else tile[0]
  tc = 9 if tile[1] is None else tile[1]
  want = np.empty_like(x2)
  for i in range(0, 5, tr):
    for j in range(0, 9, tc):
      want[i:i + tr, j:j + tc] = _np_bfp_block(x2[i:i + tr, j:j + tc], m)
  np.testing.assert_array_equal(got, want.reshape(x.shape).astype(np.float32))


def test_blockformat_negative_zero_and_nonfinite():
  x = np.array([[1.0, -2.0**-12, 0.5], [np.nan, 1.0, 2.0]], np.float32)
  got = _q(x, F.BlockFormat(4, tile=(1, None)))
  assert got.view(np.uint32)[0, 1] == 0x80000000  # -0.0 kept
  assert np.isnan(got[1]).all()
  got = _q(np.array([1.0, np.inf, 2.0], np.float32), F.BlockFormat(4, axis=0, block_size=2))
  assert np.isnan(got[:2]).all() and got[2] == 2.0  # only the block holding inf


def _np_mx(x, elem, bs, emax, maxv, cast):
  xb = x.reshape(-1, bs).astype(np.float64)
  out = np.empty_like(xb)
  for r in range(xb.shape[0]):
    amax = np.abs(xb[r]).max()
    if amax == 0:
      out[r] = 0
      continue
    s = np.clip(np.floor(np.log2(amax)) - emax, -127, 127)
    y = np.clip(xb[r] / 2.0**s, -maxv, maxv)
    out[r] = cast(y) * 2.0**s
  return out.reshape(x.shape).astype(np.float32)


@pytest.mark.parametrize("elem", ["E4M3FN", "E5M2", "E3M2FN", "E2M3FN", "E2M1FN", "int8"])
def test_mx_against_numpy(elem):
  rng = np.random.default_rng(len(elem))
  x = _data(rng, (8, 64))
  x[1] = 0.0
  x[2, :32] *= 2.0**30
  if elem == "int8":
    fmt = F.mx("int8")

    def cast(y):
      return np.clip(np.round(y * 64), -128, 127) / 64

    want = _np_mx(x, elem, 32, 0, 2.0, cast)
  else:
    e = F.PRESETS[elem]
    dt = getattr(ml_dtypes, {"E4M3FN": "float8_e4m3fn", "E5M2": "float8_e5m2",
                             "E3M2FN": "float6_e3m2fn", "E2M3FN": "float6_e2m3fn",
                             "E2M1FN": "float4_e2m1fn"}[elem])
    fmt = F.mx(e)

    def cast(y):
      return y.astype(np.float32).astype(dt).astype(np.float64)

    want = _np_mx(x, elem, 32, e.emax, e.max_normal, cast)
  got = _q(x, fmt)
  _ref.assert_same_bits(np.where(got == 0, 0, got), np.where(want == 0, 0, want), x, elem)
  # nonfinite block -> NaN block; other blocks untouched
  y = x.copy()
  y[0, 3] = np.inf
  g = _q(y, fmt)
  assert np.isnan(g[0, :32]).all() and not np.isnan(g[0, 32:]).any()


def test_mx_block_size_and_axis():
  rng = np.random.default_rng(9)
  x = _data(rng, (16, 6))
  a = _q(x, F.mx(F.E4M3FN, block_size=8, axis=0))
  b = _q(np.ascontiguousarray(x.T), F.mx(F.E4M3FN, block_size=8, axis=-1)).T
  np.testing.assert_array_equal(a, b)
