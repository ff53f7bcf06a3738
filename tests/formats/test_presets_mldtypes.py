"""Presets equal their ml_dtypes twins bit for bit (NaN-aware); TF32 vs an RNE reference."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from jaxlp import formats as F
from jaxlp.formats._presets import ML_DTYPES_NAMES

from . import _ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
TWINS = [n for n in ML_DTYPES_NAMES if n not in ("FP32",)]
N_RANDOM = 1 << 20


def _dtype(name):
  n = ML_DTYPES_NAMES[name]
  return getattr(np, n) if n in ("float16", "float32") else getattr(ml_dtypes, n)


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(1234)
  rand = rng.integers(0, 2**32, N_RANDOM, dtype=np.uint64).astype(np.uint32).view(np.float32)
  h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
  hn = np.concatenate([h, np.nextafter(h, np.float32(np.inf)),
                       np.nextafter(h, np.float32(-np.inf))])
  # midpoints between adjacent float16 values (ties of FP16) and their neighbours
  hs = np.sort(h[np.isfinite(h)].astype(np.float64))
  mids = ((hs[:-1] + hs[1:]) / 2).astype(np.float32)
  extra = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)),
                          np.nextafter(mids, np.float32(-np.inf))])
  return np.concatenate([rand, hn, extra])


@pytest.mark.parametrize("name", TWINS)
def test_preset_equals_ml_dtypes(name, inputs):
  fmt = F.PRESETS[name]
  x = inputs
  if not fmt.has_nan:
    x = x[~np.isnan(x)]
  want = x.astype(_dtype(name)).astype(np.float32)
  got = np.asarray(jax.jit(lambda v: F.quantize(v, fmt))(jnp.asarray(x)))
  _ref.assert_same_bits(got, want, x, name)


def _tf32_reference(x):
  """Independent RNE to 10 fraction bits with float32's exponent range (float64 arithmetic)."""
  x = np.asarray(x, np.float32)
  xd = x.astype(np.float64)
  with np.errstate(all="ignore"):
    _, ex = np.frexp(xd)  # x = f * 2^ex, f in [0.5, 1)
    e = np.maximum(ex - 1, -126)
    q = np.ldexp(1.0, e - 10)
    r = np.round(xd / q) * q  # np.round: ties to even; x/q exact
    r = np.where(np.abs(r) > (2 - 2.0**-10) * 2.0**127, np.copysign(np.inf, xd), r)
    r = np.where(np.isfinite(xd), r, xd)
  return r.astype(np.float32)


def test_tf32_equals_reference_and_reduce_precision(inputs):
  x = inputs
  want = _tf32_reference(x)
  got = np.asarray(jax.jit(lambda v: F.quantize(v, F.TF32))(jnp.asarray(x)))
  _ref.assert_same_bits(got, want, x, "TF32 vs numpy RNE")
  # lax.reduce_precision is RNE too, but XLA's CPU float path may flush subnormal inputs:
  # compare on normal inputs only and report.
  rp = np.asarray(jax.jit(lambda v: lax.reduce_precision(v, 8, 10))(jnp.asarray(x)))
  normal = ~((np.abs(x) < 2.0**-126) & (x != 0))
  _ref.assert_same_bits(got[normal], rp[normal], x[normal], "TF32 vs reduce_precision")


def test_fp32_is_identity_on_everything(inputs):
  got = np.asarray(jax.jit(lambda v: F.quantize(v, F.FP32))(jnp.asarray(inputs)))
  _ref.assert_same_bits(got, inputs, inputs, "FP32")
  # and keeps float32 subnormals bit for bit (no flush)
  sub = np.arange(1, 1000, dtype=np.uint32).view(np.float32)
  _ref.assert_same_bits(np.asarray(F.quantize(jnp.asarray(sub), F.FP32)), sub, sub, "FP32 sub")
