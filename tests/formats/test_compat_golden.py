"""Golden vectors of the originals' casts: CPD ``float_kernel_nearest``, QPyTorch
``float_quantize`` / ``block_quantize`` / ``fixed_point_quantize`` and HBFPEmulator
``_float_to_bfp`` / tiling (values worked out from their published source code)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F

from . import _ref

NAN = float("nan")
INF = float("inf")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _qj(x, fmt, rounding):
  return F.quantize(x, fmt, rounding)


def _q(x, fmt, rounding="nearest"):
  return np.asarray(_qj(jnp.asarray(np.asarray(x, np.float32)), fmt, rounding))


def _check(fmt, pairs):
  x = np.array([p[0] for p in pairs], np.float32)
  want = np.array([p[1] for p in pairs], np.float32)
  _ref.assert_same_bits(_q(x, fmt), want, x, repr(fmt))


# ---- CPD float_kernel_nearest ----------------------------------------------------------------
def test_cpd_e4m3_golden():
  _check(F.cpd_float(4, 3), [
      (240, 240), (247, 240), (248, 256), (255.9, 256), (256, INF), (1e6, INF), (-300, -INF),
      (2**-6, 2**-6), (2**-9, 2**-9), (2**-10, 0.0), (2**-10 * (1 + 2**-20), 0.0),
      (3 * 2**-10, 2**-8), (1.0625, 1.0), (1.1875, 1.25), (-1.0625, -1.0), (1e-40, 0.0),
      (-1e-40, 0.0), (-0.0, -0.0), (INF, INF), (NAN, NAN), (-INF, -INF)])


def test_cpd_e3m0_golden():
  _check(F.cpd_float(3, 0), [(1.5, 2), (3, 4), (0.1875, 0.25), (0.125, 0.0), (0.13, 0.25),
                             (8, 8), (15.9, 16), (16, INF), (12, 16)])


def test_cpd_e5m2_golden():
  _check(F.cpd_float(5, 2), [(57344, 57344), (61439, 57344), (61440, 65536), (65535, 65536),
                             (65536, INF)])


def test_cpd_e8m23_golden():
  _check(F.cpd_float(8, 23), [(1.0000001, 1.0000001), (3.4e38, 3.4e38), (1e-39, 0.0),
                              (-1e-45, 0.0), (-0.0, -0.0)])


def test_cpd_sign_of_fp32_subnormal_dropped_and_negative_zero_kept():
  x = np.array([-1e-40, -2**-12], np.float32)  # -2^-12 rounds to -0 for E4M3 (below half min)
  got = _q(x, F.cpd_float(4, 3))
  assert got.view(np.uint32).tolist() == [0, 0x80000000]


def test_cpd_e8m7_equals_bf16_except_fp32_subnormals():
  import ml_dtypes
  rng = np.random.default_rng(0)
  x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
  x = x[~np.isnan(x)]
  got = _q(x, F.cpd_float(8, 7))
  want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  sub = (np.abs(x) < 2.0**-126) & (x != 0)
  want[sub] = 0.0
  _ref.assert_same_bits(got, want, x, "cpd(8,7)")


def test_cpd_only_nearest():
  with pytest.raises(ValueError, match="rounding"):
    F.quantize(jnp.ones(3), F.cpd_float(4, 3), "stochastic", key=jnp.zeros(2, jnp.uint32))
  with pytest.raises(ValueError, match="rounding"):
    F.quantize(jnp.ones(3), F.cpd_float(4, 3), "toward_zero")


# ---- QPyTorch float_quantize ---------------------------------------------
def test_qpytorch_e5m2_golden():
  _check(F.qpytorch_float(5, 2), [
      (1.125, 1.25), (-1.125, -1.25), (1.375, 1.5), (1e9, 114688), (-1e9, -114688),
      (INF, 114688), (-INF, -114688), (2**-16, 2**-16), (1.5 * 2**-16, 2**-15),
      (2**-17, 2**-16), (1e-30, 0.0), (NAN, 114688)])


def test_qpytorch_e4m3_golden():
  _check(F.qpytorch_float(4, 3), [(256, 256), (480, 480), (500, 480), (1.0625, 1.125),
                                  (2**-10, 2**-9)])


def test_qpytorch_nan_sign_gives_signed_max():
  x = np.array([0x7FC00000, 0xFFC00000], np.uint32).view(np.float32)
  got = _q(x, F.qpytorch_float(5, 2))
  np.testing.assert_array_equal(got, [114688, -114688])


def test_qpytorch_exp8_behaviour():
  f = F.qpytorch_float(8, 3)
  _check(f, [(3.4e38, INF), (INF, INF), (-INF, -INF), (NAN, NAN), (1.0625, 1.125)])
  # man = 0: NaN's carry reaches the sign bit -> -0.0
  got = _q(np.array([NAN], np.float32), F.qpytorch_float(8, 0))
  assert got.view(np.uint32)[0] == 0x80000000


def test_qpytorch_man23_exp8_identity():
  # (8, 23) is float32 itself; man = 23 with exp < 8 keeps the exponent range (below)
  rng = np.random.default_rng(1)
  x = rng.integers(0, 2**32, 10_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
  _ref.assert_same_bits(_q(x, F.qpytorch_float(8, 23)), x, x, "qpytorch(8,23)")


def test_qpytorch_negative_zero_to_positive():
  got = _q(np.array([-0.0], np.float32), F.qpytorch_float(4, 3))
  assert got.view(np.uint32)[0] == 0


# ---- HBFP _float_to_bfp and tiling --------------------------------------------------------------
def test_hbfp_rows_golden():
  x = np.array([[1.0, 0.3, -0.3, 0.01], [2**-10, 2**-11, 3 * 2**-12, 0], [0, 0, 0, 0]],
               np.float32)
  want = np.array([[0.9921875, 0.296875, -0.296875, 0.0078125], [2**-10, 2**-11, 3 * 2**-12, 0],
                   [0, 0, 0, 0]], np.float32)
  _ref.assert_same_bits(_q(x, F.hbfp_batched(7)), want, x, "hbfp_batched(7)")
  for r in range(3):  # one exponent per tensor == per row when the tensor is one row
    _ref.assert_same_bits(_q(x[r:r + 1], F.hbfp(7)), want[r:r + 1], x[r], "hbfp(7)")


@pytest.mark.parametrize("mx, e", [(1.0, 0), (0.5, -1), (0.25, -2), (0.125, -2), (0.0625, -3),
                                   (2**-10, -9), (1 + 2**-23, 1)])
def test_hbfp_eps_absorption(mx, e):
  fmt = F.hbfp(7)
  mxb = np.array([mx], np.float32).view(np.uint32)
  got = int(np.asarray(fmt.shared_exponent(jnp.asarray(mxb)))[0])
  assert got == e
  # and through quantize: the max element lands on the grid 2^(e-7), clamped to 2^e - 2^(e-7)
  step = 2.0 ** (e - 7)
  want = min(np.round(np.float64(np.float32(mx)) / step) * step, 2.0**e - step)
  assert _q(np.array([[mx, 0.0]], np.float32), fmt)[0, 0] == np.float32(want)


def test_hbfp_zero_row_and_nonfinite_tile():
  x = np.zeros((2, 4), np.float32)
  x[1] = [1.0, np.inf, 2.0, 3.0]
  got = _q(x, F.hbfp_batched(7))
  _ref.assert_same_bits(got[0], np.zeros(4, np.float32))
  assert np.isnan(got[1]).all()
  x[1] = [1.0, np.nan, 2.0, 3.0]
  assert np.isnan(_q(x, F.hbfp_batched(7))[1]).all()
  assert np.isnan(_q(x, F.hbfp(7))).all()


def _np_tensor_to_tiled_quant(x, m, t, eps=1e-8):
  """Numpy emulation of HBFPEmulator float_to_bfp_tiled: pad, T x T tiles, per-tile BFP."""
  shape = x.shape
  x2 = x.reshape(shape[0], -1).astype(np.float32)
  r, c = x2.shape
  R, C = -(-r // t) * t, -(-c // t) * t
  xp = np.zeros((R, C), np.float32)
  xp[:r, :c] = x2
  out = np.zeros_like(xp)
  for i in range(0, R, t):
    for j in range(0, C, t):
      tile = xp[i:i + t, j:j + t].astype(np.float64)
      mxv = np.float32(np.abs(tile).max()) + np.float32(eps)  # float32 add
      e = int(np.ceil(np.log2(np.float64(mxv))))
      step = 2.0 ** (e - m)
      q = np.clip(np.round(tile / step) * step, -(2.0**e - step), 2.0**e - step)
      out[i:i + t, j:j + t] = q
  return out[:r, :c].reshape(shape)


def test_hbfp_tiled_layout_5x7_t3():
  rng = np.random.default_rng(3)
  x = (rng.standard_normal((5, 7)) * np.exp2(rng.integers(-6, 6, (5, 7)))).astype(np.float32)
  want = _np_tensor_to_tiled_quant(x, 4, 3)
  _ref.assert_same_bits(_q(x, F.hbfp(4, 3)), want, x, "hbfp(4, tile=3)")
  # and the tile geometry: one huge value only affects its own 3x3 tile
  y = np.full((5, 7), 0.3, np.float32)
  y[4, 6] = 1000.0
  g = _q(y, F.hbfp(4, 3))
  assert (g[:3] != 0).all() and (g[3:, :6] != 0).all()
  assert (g[3:, 6][:-1] == 0).all()
  # 4-D (conv weight) view: (O, I*kh*kw)
  w = rng.standard_normal((5, 2, 2, 2)).astype(np.float32)
  _ref.assert_same_bits(_q(w, F.hbfp(4, 3)), _np_tensor_to_tiled_quant(w, 4, 3), w, "4d")


def test_hbfp_batched_is_per_dim0():
  rng = np.random.default_rng(4)
  x = rng.standard_normal((3, 2, 5)).astype(np.float32)
  x[1] *= 1000
  got = _q(x, F.hbfp_batched(6))
  for i in range(3):
    _ref.assert_same_bits(got[i], _q(x[i:i + 1], F.hbfp(6))[0], x[i], f"row {i}")


# ---- QPyTorch block_quantize -----------------------------------------------
def test_qpytorch_block_golden():
  pairs = [(1.0, 1.0), (0.3, 0.296875), (-0.3, -0.296875), (0.01, 0.015625), (2**-7, 2**-6),
           (-2**-7, 0.0), (3 * 2**-7, 2**-5), (-3 * 2**-7, -2**-6), (0.999, 1.0)]
  x = np.array([p[0] for p in pairs], np.float32)
  want = np.array([p[1] for p in pairs], np.float32)
  got = _q(x, F.qpytorch_block(8))
  np.testing.assert_array_equal(got, want)  # (-2^-7 -> 0: sign of zero not pinned)


def test_qpytorch_block_dim_semantics():
  x = np.array([[1.0, 0.3], [100.0, 0.3]], np.float32)
  whole = _q(x, F.qpytorch_block(8, -1))
  per_row = _q(x, F.qpytorch_block(8, 0))
  per_col = _q(x, F.qpytorch_block(8, 1))
  # dim=-1: one exponent for the whole tensor (max 100 -> step 2^(6+2-8) = 1)
  np.testing.assert_array_equal(whole, [[1.0, 0.0], [100.0, 0.0]])
  np.testing.assert_array_equal(per_row, [[1.0, 0.296875], [100.0, 0.0]])
  np.testing.assert_array_equal(per_col, [[1.0, 0.30078125], [100.0, 0.30078125]])  # E=-2
  with pytest.raises(ValueError, match="dim"):
    F.qpytorch_block(8, -2)


# ---- QPyTorch fixed_point_quantize ------------------------------------------------------------
def test_fixed_point_range_and_clamp_after_rounding():
  f = F.FixedPoint(4, 2)  # grid 0.25, range [-2, 1.75]
  assert (f.max_value, f.min_value) == (1.75, -2.0)
  x = np.array([1.8, 1.87, 1.875, 5.0, -2.1, -2.125, -9.0, 0.125, 0.375, -0.125, INF, -INF, NAN],
               np.float32)
  want = np.array([1.75, 1.75, 1.75, 1.75, -2.0, -2.0, -2.0, 0.0, 0.5, -0.0, 1.75, -2.0, NAN],
                  np.float32)
  _ref.assert_same_bits(_q(x, f), want, x, "FixedPoint(4,2)")
  fs = F.FixedPoint(4, 2, symmetric=True)
  assert fs.min_value == -1.75
  np.testing.assert_array_equal(_q(np.array([-5.0, -1.9], np.float32), fs), [-1.75, -1.75])
  fn = F.FixedPoint(4, 2, clamp=False)
  _ref.assert_same_bits(_q(np.array([5.1, INF], np.float32), fn), np.array([5.0, INF], np.float32))


def test_fixed_point_rounding_modes_on_ties():
  f = F.FixedPoint(8, 1)  # grid 0.5
  x = np.array([0.25, 0.75, -0.25, -0.75, 0.3, -0.3], np.float32)
  np.testing.assert_array_equal(_q(x, f, "nearest"), [0.0, 1.0, -0.0, -1.0, 0.5, -0.5])
  np.testing.assert_array_equal(_q(x, f, "nearest_away"), [0.5, 1.0, -0.5, -1.0, 0.5, -0.5])
  np.testing.assert_array_equal(_q(x, f, "toward_zero"), [0.0, 0.5, 0.0, -0.5, 0.0, 0.0])
  np.testing.assert_array_equal(_q(x, f, "up"), [0.5, 1.0, 0.0, -0.5, 0.5, 0.0])
  np.testing.assert_array_equal(_q(x, f, "down"), [0.0, 0.5, -0.5, -1.0, 0.0, -0.5])


def _crafted_patterns(n_random=20000, seed=0):
  fr = {0, 1, 0x7FFFFF, 0x400000}
  for d in range(1, 24):
    t = 1 << (d - 1)
    fr |= {t, t - 1, t + 1, t | (1 << d), (t | (1 << d)) + 1}
  fr = np.array(sorted(v & 0x7FFFFF for v in fr), np.uint32)
  mags = ((np.arange(256, dtype=np.uint32)[:, None] << 23) | fr[None, :]).reshape(-1)
  rand = np.random.default_rng(seed).integers(0, 2**32, n_random, dtype=np.uint64)
  return np.concatenate([mags, mags | np.uint32(0x80000000),
                         rand.astype(np.uint32)]).view(np.float32)


@pytest.mark.parametrize("E", range(1, 9))
def test_cpd_every_exp_man_against_the_stepwise_reference(E):
  """Every (E, M) against an independent transliteration of CPD's kernel, on every exponent
  field x tie/neighbour fractions x both signs, specials and random bit patterns."""
  x = _crafted_patterns()
  xj = jnp.asarray(x)
  # one program for the 24 formats (compile time); each format's quantize is traced as is
  gots = jax.jit(lambda v: [F.quantize(v, F.cpd_float(E, M)) for M in range(24)])(xj)
  for M, got in enumerate(gots):
    _ref.assert_same_bits(np.asarray(got), _ref.cpd_float_reference(x, E, M), x,
                          f"cpd({E},{M})")


# ---- QPyTorch float_quantize with man = 23 (issue 50) -----------------------------------------
def _qpytorch_man23_reference(x, e):
  """``qpytorch_float(e, 23)`` by its definition, in float64: no fraction bit is dropped, so
  only the exponent range acts, as for every other man: |x| above the largest value
  ``(2 - 2**-23) * 2**(2**(e-1))`` saturates (inf and NaN too, with their sign bit); |x| below
  ``2**min_exp`` (``min_exp = 2 - 2**(e-1)``) is rounded to nearest even onto the subnormal
  grid ``2**(min_exp - 23)``; zeros give +0.0."""
  min_exp, max_exp = 2 - 2 ** (e - 1), 2 ** (e - 1)
  big = (2 - 2.0**-23) * 2.0**max_exp
  step = 2.0 ** (min_exp - 23)
  with np.errstate(invalid="ignore"):  # signalling NaNs
    xd = x.astype(np.float64)
    q = np.where(np.abs(xd) < 2.0**min_exp, np.round(xd / step) * step, xd)
    over = np.isnan(xd) | (np.abs(xd) > big)
  q = np.where(over, np.where(np.signbit(x), -big, big), q)
  return (q + 0.0).astype(np.float32)  # -0.0 + 0.0 = +0.0


def test_qpytorch_man23_honours_the_exponent_range():
  rng = np.random.default_rng(23)
  bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
  for e in (1, 2, 3, 4, 5, 6, 7):
    min_exp, max_exp = 2 - 2 ** (e - 1), 2 ** (e - 1)
    edges = np.array([2.0**max_exp, (2 - 2.0**-23) * 2.0**max_exp, 2.0 ** (max_exp + 1), 1e6,
                      2.0**min_exp, 2.0**min_exp * (1 - 2.0**-24), 2.0 ** (min_exp - 24),
                      1.5 * 2.0 ** (min_exp - 23), 2.5 * 2.0 ** (min_exp - 23), 1e-40, 0.0,
                      np.inf, np.nan, 1.1], np.float32)
    # random patterns (every exponent), the edges, and values of the format's own scale
    scale = (rng.standard_normal(2000) * np.exp2(rng.integers(min_exp - 26, max_exp + 2,
                                                              2000))).astype(np.float32)
    x = np.concatenate([bits.view(np.float32), edges, -edges, scale])
    want = _qpytorch_man23_reference(x, e)
    _ref.assert_same_bits(_q(x, F.qpytorch_float(e, 23)), want, x, f"qpytorch({e},23)")
  # the issue's case: 1e6 is beyond exp = 5's range (largest finite about 131072)
  got = _q(np.array([1e6, -1e6, 1.1], np.float32), F.qpytorch_float(5, 23))
  np.testing.assert_array_equal(got, [(2 - 2.0**-23) * 2.0**16, -(2 - 2.0**-23) * 2.0**16,
                                      np.float32(1.1)])


def test_qpytorch_man23_is_continuous_with_man22():
  # every man = 22 value is a man = 23 value: quantizing it again to man = 23 changes nothing
  rng = np.random.default_rng(3)
  x = (rng.standard_normal(50_000) * np.exp2(rng.integers(-20, 20, 50_000))).astype(np.float32)
  for e in (4, 5, 6):
    q22 = _q(x, F.qpytorch_float(e, 22))
    _ref.assert_same_bits(_q(q22, F.qpytorch_float(e, 23)), q22, q22, f"({e},22)->({e},23)")
