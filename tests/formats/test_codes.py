"""FloatFormat storage codes: every code of every format up to 16 bits against an
independent float64 formula, ml_dtypes bit patterns for the presets, and round trips."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.formats import PRESETS, FloatFormat, mx, quantize
from jaxlp.formats._codes import from_codes, to_codes
from jaxlp.formats._presets import ML_DTYPES_NAMES

CUSTOM = [
    FloatFormat(3, 3), FloatFormat(4, 2, specials="finite"), FloatFormat(2, 2, specials="fn"),
    FloatFormat(5, 3, subnormals=False), FloatFormat(3, 0, specials="finite"),
    FloatFormat(1, 3, specials="finite"), FloatFormat(4, 3, specials="fnuz"),
    FloatFormat(6, 9, bias=40), FloatFormat(5, 0), FloatFormat(3, 1, specials="fn"),
    FloatFormat(8, 7, subnormals=False), FloatFormat(2, 0, specials="fnuz"),
]
SMALL_PRESETS = [f for f in PRESETS.values() if f.bits <= 16]


def _oracle(fmt, codes):
  """float64 values and NaN mask from the textbook definition of each code."""
  e, m = fmt.exp_bits, fmt.man_bits
  s = (codes >> (e + m)) & 1
  field = (codes >> m) & (2 ** e - 1)
  frac = codes & (2 ** m - 1)
  emin = 1 - fmt.bias
  sub = frac * 2.0 ** (emin - m) if fmt.subnormals else np.zeros(codes.shape)
  val = np.where(field == 0, sub, (1 + frac / 2.0 ** m) * 2.0 ** (field.astype(np.int64)
                                                                   - fmt.bias))
  top = field == 2 ** e - 1
  nan = np.zeros(codes.shape, bool)
  if fmt.specials == "ieee":
    val = np.where(top & (frac == 0), np.inf, val)
    nan = top & (frac != 0)
  elif fmt.specials == "fn":
    nan = top & (frac == 2 ** m - 1)
  elif fmt.specials == "fnuz":
    nan = (s == 1) & (field == 0) & (frac == 0)
  val = np.where(s == 1, -val, val)
  return val, nan


@pytest.mark.parametrize("fmt", SMALL_PRESETS + CUSTOM, ids=repr)
def test_every_code_against_formula_and_round_trip(fmt):
  codes = np.arange(2 ** fmt.bits, dtype=np.uint32)
  want, nan = _oracle(fmt, codes.astype(np.int64))
  got = np.asarray(from_codes(jnp.asarray(codes), fmt))
  np.testing.assert_array_equal(np.isnan(got), nan)
  assert np.array_equal(got[~nan].astype(np.float64), want[~nan])
  np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))
  # every value is on the format's grid
  q = np.asarray(quantize(jnp.asarray(got), fmt))
  np.testing.assert_array_equal(q[~nan].view(np.uint32), got[~nan].view(np.uint32))
  # encode(decode(c)) == c for canonical codes (not NaN; with subnormals off, field 0 means 0)
  e, m = fmt.exp_bits, fmt.man_bits
  canon = ~nan
  if not fmt.subnormals:
    canon &= ~((((codes >> m) & (2 ** e - 1)) == 0) & ((codes & (2 ** m - 1)) != 0))
  back = np.asarray(to_codes(jnp.asarray(got), fmt))
  np.testing.assert_array_equal(back[canon], codes[canon])
  # NaN encodes to a code that decodes to NaN where the format has one
  nan_code = np.asarray(to_codes(jnp.asarray([np.nan], jnp.float32), fmt))
  if fmt.has_nan and not (fmt.specials == "ieee" and m == 0):
    assert np.isnan(np.asarray(from_codes(jnp.asarray(nan_code), fmt)))[0]
  assert int(back.max()) < 2 ** fmt.bits


@pytest.mark.parametrize("name", [n for n, f in PRESETS.items() if f.bits <= 16
                                  and n in ML_DTYPES_NAMES])
def test_codes_are_ml_dtypes_bit_patterns(name):
  fmt = PRESETS[name]
  dt = np.dtype(getattr(ml_dtypes, ML_DTYPES_NAMES[name], None) or ML_DTYPES_NAMES[name])
  x = np.random.default_rng(0).standard_normal(20000).astype(np.float32) * 4.0 ** \
      np.random.default_rng(1).integers(-12, 12, 20000)
  x = np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, 1e30, -1e-30]]).astype(np.float32)
  ref = x.astype(dt)
  ref_codes = ref.view(np.uint8 if dt.itemsize == 1 else np.uint16).astype(np.uint32)
  got = np.asarray(to_codes(jnp.asarray(x), fmt))
  vals = ref.astype(np.float32)
  ok = ~np.isnan(vals)
  np.testing.assert_array_equal(got[ok], ref_codes[ok])


@pytest.mark.parametrize("fmt", [FloatFormat(8, 23), FloatFormat(8, 10), FloatFormat(7, 14),
                                 FloatFormat(5, 20, bias=3)], ids=repr)
def test_wide_formats_round_trip_random_patterns(fmt):
  bits = np.random.default_rng(2).integers(0, 2 ** 32, 200000, dtype=np.uint64).astype(np.uint32)
  x = bits.view(np.float32)
  q = np.asarray(quantize(jnp.asarray(x), fmt))
  c = to_codes(jnp.asarray(x), fmt)
  assert int(np.asarray(c).max()) < 2 ** fmt.bits
  back = np.asarray(from_codes(c, fmt))
  nan = np.isnan(q)
  np.testing.assert_array_equal(np.isnan(back), nan)
  np.testing.assert_array_equal(back[~nan].view(np.uint32), q[~nan].view(np.uint32))


@pytest.mark.parametrize("fn", [to_codes, from_codes], ids=lambda f: f.__name__)
@pytest.mark.parametrize("fmt", [mx(PRESETS["E4M3FN"]), "E4M3", None], ids=repr)
def test_a_format_without_codes_is_refused(fn, fmt):
  with pytest.raises(TypeError, match=f"{fn.__name__}: fmt must be a FloatFormat"):
    fn(jnp.ones(3), fmt)
