"""Hypothesis property tests of FloatFormat rounding (all modes), FixedPoint and blocks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlp import formats as F

N = 64
FMTS = [F.E4M3, F.E5M2, F.BF16, F.E2M1FN, F.E4M3FNUZ, F.FloatFormat(3, 2, subnormals=False),
        F.FixedPoint(8, 3), F.FixedPoint(12, 4, symmetric=True)]
MODES = ("nearest", "nearest_away", "toward_zero", "up", "down")


@functools.cache
def _fn(fmt, mode):
  return jax.jit(lambda v: F.quantize(v, fmt, mode))


def q(x, fmt, mode):
  return np.asarray(_fn(fmt, mode)(jnp.asarray(x)))


floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
arrays = st.lists(floats32, min_size=N, max_size=N).map(lambda v: np.array(v, np.float32))
fmt_st = st.sampled_from(FMTS)
mode_st = st.sampled_from(MODES)
SETTINGS = settings(max_examples=60, deadline=None)


def _range(fmt):
  if isinstance(fmt, F.FixedPoint):
    return fmt.min_value, fmt.max_value
  return -fmt.max_normal, fmt.max_normal


@SETTINGS
@given(arrays, fmt_st, mode_st)
def test_idempotent(x, fmt, mode):
  y = q(x, fmt, mode)
  ok = np.isfinite(y)
  np.testing.assert_array_equal(q(y, fmt, mode)[ok], y[ok])
  # and every finite result is fixed under every other mode too (it is representable)
  for m in MODES:
    np.testing.assert_array_equal(q(y, fmt, m)[ok], y[ok])


@SETTINGS
@given(arrays, fmt_st, st.sampled_from(("nearest", "toward_zero", "up", "down", "nearest_away")))
def test_monotone(x, fmt, mode):
  xs = np.sort(x)
  y = q(xs, fmt, mode)
  ok = ~np.isnan(y)
  yy = y[ok]
  assert np.all(yy[1:] >= yy[:-1]), (xs[ok], yy)


SYMMETRIC = [f for f in FMTS if not (isinstance(f, F.FixedPoint) and not f.symmetric)]


@SETTINGS
@given(arrays, st.sampled_from(SYMMETRIC))
def test_sign_symmetry(x, fmt):
  for mode in ("nearest", "nearest_away", "toward_zero"):
    a, b = q(-x, fmt, mode), -q(x, fmt, mode)
    np.testing.assert_array_equal(a, b)  # values (fnuz/fixed point have no -0 distinction here)
  np.testing.assert_array_equal(q(-x, fmt, "up"), -q(x, fmt, "down"))


def _ulp(fmt, x):
  a = np.abs(x.astype(np.float64))
  if isinstance(fmt, F.FixedPoint):
    return np.full_like(a, 2.0**-fmt.fl)
  with np.errstate(divide="ignore"):
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
  e = np.maximum(e, fmt.emin)
  if not fmt.subnormals:
    return np.where(a < fmt.min_normal, fmt.min_normal, 2.0 ** (e - fmt.man_bits))
  return 2.0 ** (e - fmt.man_bits)


@SETTINGS
@given(arrays, fmt_st)
def test_error_bounds(x, fmt):
  lo, hi = _range(fmt)
  xd = x.astype(np.float64)
  inr = (xd >= lo) & (xd <= hi)
  ulp = _ulp(fmt, x)
  n = q(x, fmt, "nearest").astype(np.float64)
  # strictly inside the range (fixed point clamps; float formats may round to max)
  assert np.all(np.abs(n - xd)[inr] <= ulp[inr] / 2)
  up = q(x, fmt, "up").astype(np.float64)
  dn = q(x, fmt, "down").astype(np.float64)
  tz = q(x, fmt, "toward_zero").astype(np.float64)
  assert np.all(dn[inr] <= xd[inr]) and np.all(up[inr] >= xd[inr])
  assert np.all(up[inr] - dn[inr] <= ulp[inr])
  assert np.all(np.abs(tz[inr]) <= np.abs(xd[inr]))
  # nearest is one of the two directed neighbours
  assert np.all((n[inr] == up[inr]) | (n[inr] == dn[inr]))


@settings(max_examples=40, deadline=None)
@given(st.lists(floats32, min_size=48, max_size=48).map(lambda v: np.array(v, np.float32)),
       st.integers(2, 12))
def test_block_result_on_shared_grid(x, man_bits):
  fmt = F.BlockFormat(man_bits, axis=0, block_size=16)
  y = np.asarray(F.quantize(jnp.asarray(x), fmt)).astype(np.float64).reshape(3, 16)
  xb = np.abs(x.astype(np.float64)).reshape(3, 16)
  for r in range(3):
    mx = xb[r].max()
    if mx == 0:
      assert np.all(y[r] == 0)
      continue
    e = np.floor(np.log2(mx)) + 1
    step = 2.0 ** (e - man_bits)
    k = y[r] / step
    np.testing.assert_array_equal(k, np.round(k))
    assert np.all(np.abs(k) <= 2**man_bits - 1)
    # error at most half a step, except for the saturating top
    err = np.abs(y[r] - x.astype(np.float64).reshape(3, 16)[r])
    assert np.all(err <= step / 2 + (np.abs(y[r]) == (2**man_bits - 1) * step) * step)
