"""FloatFormat structure, validation, and an exhaustive code-by-code rounding sweep."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats._presets import ML_DTYPES_NAMES
from jaxlp.formats._quantize import quantize_f32

from . import _ref

TWINS = [n for n in ML_DTYPES_NAMES if n != "FP32"] + ["FP32"]
SMALL_PRESETS = [n for n, f in F.PRESETS.items() if f.bits <= 8]


def _dtype(name):
  n = ML_DTYPES_NAMES[name]
  return getattr(np, n) if n in ("float16", "float32") else getattr(ml_dtypes, n)


@pytest.mark.parametrize("name", TWINS)
def test_properties_equal_ml_dtypes_finfo(name):
  fmt = F.PRESETS[name]
  dt = _dtype(name)
  fi = ml_dtypes.finfo(dt)
  assert fmt.bits == fi.bits
  assert fmt.man_bits == fi.nmant
  assert fmt.exp_bits == fi.nexp
  assert fmt.emin == fi.minexp
  assert fmt.bias == 1 - fi.minexp
  assert fmt.emax == fi.maxexp - 1
  assert fmt.max_normal == float(fi.max)
  assert fmt.min_normal == float(fi.tiny)
  assert fmt.min_subnormal == float(fi.smallest_subnormal)
  assert fmt.eps == float(fi.eps)


def test_tf32_properties():
  f = F.TF32
  assert (f.bits, f.bias, f.emin, f.emax, f.eps) == (19, 127, -126, 127, 2.0**-10)
  assert f.max_normal == (2 - 2.0**-10) * 2.0**127
  assert f.min_subnormal == 2.0 ** (-126 - 10)


def test_presets_complete_and_get_format():
  want = {"FP32", "TF32", "BF16", "FP16", "E5M2", "E4M3", "E4M3FN", "E4M3FNUZ", "E5M2FNUZ",
          "E3M4", "E3M2FN", "E2M3FN", "E2M1FN"}
  assert set(F.PRESETS) == want
  for n in want:
    assert F.get_format(n.lower()) is F.PRESETS[n]
    assert getattr(F, n) is F.PRESETS[n]
  with pytest.raises(ValueError, match="unknown format"):
    F.get_format("e9m9")


def test_frozen_hashable_and_equality():
  f = F.FloatFormat(4, 3)
  with pytest.raises(dataclasses.FrozenInstanceError):
    f.man_bits = 2  # type: ignore[misc]
  assert hash(f) == hash(F.FloatFormat(4, 3, bias=7, specials="ieee", overflow="inf"))
  assert f == F.E4M3  # name is not part of equality
  assert f != F.E4M3FN
  assert len({F.E4M3, f, F.E4M3FN, F.FloatFormat(4, 3, subnormals=False)}) == 3
  assert "E4M3" in repr(F.E4M3) and "exp_bits=4" in repr(f)


def test_static_jit_arg_no_retrace():
  traces = []

  @jax.jit
  def _unused(x):
    return x

  def g(x, fmt):
    traces.append(fmt)
    return F.quantize(x, fmt)

  gj = jax.jit(g, static_argnums=1)
  x = jnp.linspace(-3, 3, 17, dtype=jnp.float32)
  gj(x, F.FloatFormat(4, 3))
  gj(x, F.FloatFormat(4, 3))
  gj(x, F.E4M3)  # equal format -> cache hit
  assert len(traces) == 1
  gj(x, F.E4M3FN)
  assert len(traces) == 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(exp_bits=0, man_bits=3), "exp_bits"),
    (dict(exp_bits=9, man_bits=3), "exp_bits"),
    (dict(exp_bits=4.0, man_bits=3), "exp_bits"),
    (dict(exp_bits=True, man_bits=3), "exp_bits"),
    (dict(exp_bits=4, man_bits=-1), "man_bits"),
    (dict(exp_bits=4, man_bits=24), "man_bits"),
    (dict(exp_bits=4, man_bits="3"), "man_bits"),
    (dict(exp_bits=4, man_bits=3, bias=1.5), "bias"),
    (dict(exp_bits=4, man_bits=3, bias=-200), "bias"),
    (dict(exp_bits=8, man_bits=3, bias=0), "bias"),
    (dict(exp_bits=4, man_bits=3, specials="IEEE"), "specials"),
    (dict(exp_bits=4, man_bits=3, overflow="clip"), "overflow"),
    (dict(exp_bits=4, man_bits=3, specials="fn", overflow="inf"), "overflow"),
    (dict(exp_bits=4, man_bits=3, specials="finite", overflow="nan"), "overflow"),
    (dict(exp_bits=4, man_bits=3, subnormals=1), "subnormals"),
    (dict(exp_bits=1, man_bits=3), "exp_bits=1"),
    (dict(exp_bits=1, man_bits=0, specials="fn"), "fn"),
])
def test_bad_fields_raise_naming_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    F.FloatFormat(**kwargs)


# ---------------------------------------------------------------------------------------
# Exhaustive sweep: every code, every tie, +-1 float32 ulp neighbours, all modes.
# ---------------------------------------------------------------------------------------
def _variants():
  out = []
  for e, m in itertools.product(range(1, 8), range(0, 7)):
    if e + m > 7:
      continue
    for specials, overflows in (("ieee", ("inf", "nan", "saturate")), ("fn", ("nan", "saturate")),
                                ("fnuz", ("nan", "saturate")), ("finite", ("saturate",))):
      if specials == "ieee" and e == 1:
        continue
      if specials == "fn" and e == 1 and m == 0:
        continue
      for ov in overflows:
        for sub in (True, False):
          out.append(F.FloatFormat(e, m, specials=specials, overflow=ov, subnormals=sub))
  # a few non-default biases
  out += [F.FloatFormat(4, 3, bias=3), F.FloatFormat(3, 2, bias=0, specials="finite"),
          F.FloatFormat(5, 2, bias=20, specials="fn"), F.FloatFormat(2, 1, bias=-3)]
  return out


_PAD = 4096


def _quantize_eager(x, fmt, mode):
  # Eager, padded to a fixed size so per-op compilation caches are shared across formats.
  n = x.size
  assert n <= _PAD
  xp = np.zeros(_PAD, np.float32)
  xp[:n] = x
  y = quantize_f32(jnp.asarray(xp), fmt, mode)
  return np.asarray(y)[:n]


def _sweep(fmt, modes=_ref.MODES):
  ref = _ref.ref_of(fmt)
  x = _ref.probe_points(ref)
  for mode in modes:
    got = _quantize_eager(x, fmt, mode)
    _ref.assert_same_bits(got, ref.round(x, mode), x, f"{fmt!r} {mode}")
    if mode == "nearest":
      # idempotent on every representable value
      v = ref.values.astype(np.float32)
      _ref.assert_same_bits(_quantize_eager(v, fmt, mode), v, v, f"{fmt!r} idempotent")


@pytest.mark.parametrize("name", SMALL_PRESETS)
def test_preset_every_code_all_modes(name):
  _sweep(F.PRESETS[name])


def test_decoder_matches_ml_dtypes():
  # The independent decoder itself agrees with ml_dtypes on every code (sanity of the oracle).
  for name in SMALL_PRESETS:
    fmt = F.PRESETS[name]
    dt = _dtype(name)
    n = 1 << fmt.bits
    raw = np.arange(n, dtype=np.uint8 if fmt.bits <= 8 else np.uint16)
    ml = raw.view(dt).astype(np.float64) if fmt.bits == 8 else np.array(
        [np.uint8(c).view(dt) for c in raw], dtype=np.float64)
    mine = _ref.decode_codes(fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.specials)
    np.testing.assert_array_equal(np.isnan(ml), np.isnan(mine), err_msg=name)
    ok = ~np.isnan(ml)
    np.testing.assert_array_equal(ml[ok], mine[ok], err_msg=name)
    np.testing.assert_array_equal(np.signbit(ml[ok]), np.signbit(mine[ok]), err_msg=name)


VARIANTS = _variants()


@pytest.mark.parametrize("chunk", range(8))
def test_custom_formats_every_code_all_modes(chunk):
  for fmt in VARIANTS[chunk::8]:
    _sweep(fmt)


def test_variant_count():
  assert len(VARIANTS) > 300
