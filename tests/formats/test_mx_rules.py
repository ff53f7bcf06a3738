"""MX scale rules on crafted block maxima against an exact-rational oracle; MX validation.

The crafted maxima: every power of two of float32 (2**-149 .. 2**127) and its float32
neighbours, each element format's max (and its neighbours, and times powers of two), just
below the ``even`` rounding boundary, float32 subnormals and FLT_MAX.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F

from . import _ref
from ._scaled_ref import ELEM_DTYPES, mx_scale_exponent

F32 = np.float32
ELEMS = ["E4M3FN", "E5M2", "E3M2FN", "E2M3FN", "E2M1FN"]


def _crafted_maxima():
  vals = []
  for k in range(-149, 128):
    p = np.ldexp(F32(1), k).astype(F32)
    b = p.view(np.uint32).astype(np.int64)
    vals += [b - 2, b - 1, b, b + 1, b + 2]
  for name in ELEMS:
    e = F.PRESETS[name]
    for k in range(-140, 130, 3):
      with np.errstate(over="ignore"):
        m = np.ldexp(F32(e.max_normal), k).astype(F32)
      if not np.isfinite(m) or m == 0:
        continue
      b = m.view(np.uint32).astype(np.int64)
      vals += [b - 1, b, b + 1]
    # just below / at the `even` boundary (2 - 2**-(m+1)) * 2**k, for every man_bits
    for k in (-130, -100, -3, 0, 7, 100, 127):
      for mb in (1, 2, 3):
        v = np.ldexp(F32(2 - 2.0 ** -(mb + 1)), k).astype(F32)
        if np.isfinite(v) and v > 0:
          b = v.view(np.uint32).astype(np.int64)
          vals += [b - 1, b, b + 1]
  vals += [1, 2, 3, 0x7FFFFF, 0x400000, 0x400001, 0x7F7FFFFF, 0x7F7FFFFE]
  b = np.unique(np.clip(np.array(vals), 1, 0x7F7FFFFF)).astype(np.uint32)
  return b.view(F32)


MAXIMA = _crafted_maxima()


@pytest.mark.parametrize("rule", F.SCALE_RULES)
@pytest.mark.parametrize("elem", ELEMS)
def test_scale_exponent_on_crafted_maxima(elem, rule):
  e = F.PRESETS[elem]
  fmt = F.mx(e, 4, scale_rule=rule)
  got = np.asarray(jax.jit(lambda m: jnp.clip(fmt.scale_exponent(m), -127, 127))(
      MAXIMA.view(np.uint32)))
  want = np.array([mx_scale_exponent(a, rule, e.emax, e.man_bits, e.max_normal)
                   for a in MAXIMA])
  bad = got != want
  assert not bad.any(), (f"{bad.sum()} of {len(MAXIMA)}: amax={MAXIMA[bad][:5]} "
                         f"got={got[bad][:5]} want={want[bad][:5]}")


@functools.partial(jax.jit, static_argnums=1)
def _qj(x, fmt):
  return F.quantize(x, fmt)


@pytest.mark.parametrize("rule", F.SCALE_RULES)
@pytest.mark.parametrize("elem", ["E4M3FN", "E2M1FN", "E3M2FN"])
def test_blocks_with_crafted_maxima(elem, rule):
  """Whole blocks [amax, -0.37 amax, 0.61 amax, amax * 2**-9]: every element is the
  saturating cast of x / 2**e (ml_dtypes, nearest-even) times 2**e, e from the oracle."""
  e = F.PRESETS[elem]
  a = MAXIMA.astype(np.float64)
  x = np.stack([a, -0.37 * a, 0.61 * a, a * 2.0**-9], -1).astype(F32)
  got = np.asarray(_qj(jnp.asarray(x), F.mx(e, 4, scale_rule=rule)))
  ex = np.array([mx_scale_exponent(v, rule, e.emax, e.man_bits, e.max_normal)
                 for v in x.max(-1)], np.float64)
  y = np.clip(x.astype(np.float64) / np.exp2(ex)[:, None], -e.max_normal, e.max_normal)
  want = (y.astype(F32).astype(ELEM_DTYPES[elem]).astype(np.float64)
          * np.exp2(ex)[:, None])
  # beyond float32 (scales rounded up near FLT_MAX): the largest float32 on the scaled grid
  top = (2 - 2.0**-e.man_bits) * 2.0**127
  want = np.clip(want, -top, top)
  _ref.assert_same_bits(got, want.astype(F32), x, f"mx({elem}, rule={rule})")
  assert np.isfinite(got).all()


@pytest.mark.parametrize("rule", F.SCALE_RULES)
def test_special_blocks(rule):
  fmt = F.mx(F.E2M1FN, 4, scale_rule=rule)
  x = np.array([[0.0, -0.0, 0.0, 0.0], [np.inf, 1, 2, 3], [np.nan, 1, 2, 3],
                [1e-45, -1e-45, 0, 0], [3.4e38, -3.4e38, 1, 0]], F32)
  got = np.asarray(_qj(jnp.asarray(x), fmt))
  np.testing.assert_array_equal(got[0].view(np.uint32), x[0].view(np.uint32))  # zeros kept
  assert np.isnan(got[1:3]).all()  # a block holding inf or NaN is NaN (OCP MX)
  assert np.isfinite(got[3:]).all()


def test_rules_differ_as_documented():
  x = jnp.array([7.0, 1.2, 0.0, 0.0])
  out = {r: np.asarray(F.quantize(x, F.mx(F.E2M1FN, 4, scale_rule=r))) for r in F.SCALE_RULES}
  # floor: 2**(2 - 2) = 1, 7 saturates to 6; rceil: ceil(log2 7/6) = 1; ceil: 2**(3 - 2);
  # even: 7 rounded to 1 mantissa bit is 8 -> 2**(3 - 2)
  assert out["floor"][0] == 6.0 and out["rceil"][0] == 8.0
  assert out["ceil"][0] == 8.0 and out["even"][0] == 8.0
  y = jnp.array([5.0, 0.0, 0.0, 0.0])  # 5 = 1.25 * 4: even rounds to 4 (floor's scale)
  assert float(F.quantize(y, F.mx(F.E2M1FN, 4, scale_rule="even"))[0]) == 4.0
  assert float(F.quantize(y, F.mx(F.E2M1FN, 4, scale_rule="floor"))[0]) == 4.0


# ---------------------------------------------------------------------------------------
# Validation and MXINT8
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("elem", ELEMS + ["int8"])
def test_ocp_element_types_are_accepted(elem):
  fmt = F.mx(F.PRESETS.get(elem, elem))
  assert fmt.scale_rule == "floor" and fmt.block_size == 32
  assert F.mx(F.FloatFormat(4, 3, specials="fn")) == F.mx(F.E4M3FN)  # by value, not name


@pytest.mark.parametrize("elem", ["E4M3", "BF16", "FP32", "FP16", "E4M3FNUZ", "E5M2FNUZ",
                                  "E3M4", "TF32"])
def test_other_element_types_are_refused(elem):
  with pytest.raises(ValueError, match="E4M3FN" if elem == "E4M3" else "OCP MX element"):
    F.mx(F.PRESETS[elem])
  with pytest.raises(ValueError):
    F.MXFormat(F.PRESETS[elem])


def test_mx_e4m3_message_points_to_e4m3fn():
  with pytest.raises(ValueError, match=r"IEEE-style E4M3 \(max 240.*use jaxlp.formats.E4M3FN"):
    F.mx(F.E4M3)


def test_mxint8_zero_is_positive_and_no_infinity():
  fmt = F.mx("int8", 4)
  x = np.array([[1.0, -1e-3, -0.004, 0.5], [-3.4028235e38, 3.4028235e38, -1.0, 2.0**127]], F32)
  got = np.asarray(_qj(jnp.asarray(x), fmt))
  assert got[0, 1] == 0 and got.view(np.uint32)[0, 1] == 0  # +0, not -0
  assert got.view(np.uint32)[0, 2] == 0
  assert np.isfinite(got).all()
  # scale 2**127: elements k * 2**121; -FLT_MAX saturates at -127 * 2**121 (not -2**128)
  assert got[1, 0] == np.float32(-127.0 * 2.0**121)
  assert got[1, 1] == np.float32(127.0 * 2.0**121)
  with pytest.raises(ValueError, match="MXINT8"):
    F.mx("int8", scale_rule="rceil")
