"""Pallas quantize kernels (interpret mode on CPU) == the jnp spec, bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.pallas._quantize import can_use_pallas_quantize, supports
from jaxlp.pallas._quantize import quantize as pq

ROUNDINGS = F.ROUNDINGS
KEY = jax.random.key(1234)


def _awkward(shape, seed=0):
  """Normal values over a wide exponent range plus specials, float32."""
  n = int(np.prod(shape))
  rng = np.random.default_rng(seed)
  v = rng.standard_normal(n).astype(np.float32) * np.exp2(
      rng.integers(-140, 125, n)).astype(np.float32)
  specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 1.0625, -2.5, 448.0,
                       240.0, 65504.0, 3.4e38, 1.5 * 2**-126, 0.09375], np.float32)
  k = min(n, len(specials))
  v[:k] = specials[:k]
  # Mid-range values (where low-precision formats actually round) for the rest of the head.
  m = min(n, 600)
  v[k:m] = (rng.standard_normal(m - k) * 8).astype(np.float32)
  return jnp.asarray(v.reshape(shape))


def _same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  u = {4: np.uint32, 2: np.uint16}[a.dtype.itemsize]
  av, bv = a.view(u), b.view(u)
  # NaN payloads may differ only if both are NaN (the spec returns canonical NaN codes too).
  both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
  bad = (av != bv) & ~both_nan
  assert not bad.any(), f"{bad.sum()} mismatches, first at {np.argwhere(bad)[:3].tolist()}"
  np.testing.assert_array_equal(np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _both(x, fmt, roundings, block_size):
  """Kernel and spec results for each rounding (one compilation per format)."""
  outs = []
  for r in roundings:
    outs.append(pq(x, fmt, r, key=KEY, interpret=True, block_size=block_size))
    outs.append(F.quantize(x, fmt, r, key=KEY))
  return outs


def _check(x, fmt, roundings=None, block_size=None):
  roundings = tuple(r for r in (roundings or ROUNDINGS) if r in fmt.supported_roundings)
  outs = _both(x, fmt, roundings, block_size)
  for i, r in enumerate(roundings):
    try:
      _same_bits(outs[2 * i], outs[2 * i + 1])
    except AssertionError as e:
      raise AssertionError(f"{fmt!r} rounding={r}: {e}") from None


#: Presets checked with nearest, stochastic and down: one per family of specials (IEEE-like
#: BF16, fn E4M3FN, fnuz E4M3FNUZ) and the no-rounding-bits / 10-bit cases (FP32, TF32); the
#: other presets of those families with nearest only (the same kernel code with other
#: constants); E4M3, FP16 and E2M1FN: every rounding in test_all_roundings (same data).
PRESET_ROUNDINGS = {
    **{name: ("nearest", "stochastic", "down")
       for name in ("BF16", "FP32", "TF32", "E4M3FN", "E4M3FNUZ")},
    **{name: ("nearest",) for name in ("E5M2", "E3M4", "E2M3FN", "E3M2FN", "E5M2FNUZ")},
}


def test_presets_are_all_checked():
  assert set(PRESET_ROUNDINGS) | {"E4M3", "FP16", "E2M1FN"} == set(F.PRESETS)


@pytest.mark.parametrize("name", sorted(PRESET_ROUNDINGS))
def test_presets(name):
  _check(_awkward((37, 53)), F.PRESETS[name], PRESET_ROUNDINGS[name], block_size=512)


@pytest.mark.parametrize("fmt", [F.E4M3, F.FP16, F.E2M1FN], ids=repr)
def test_all_roundings(fmt):
  _check(_awkward((37, 53)), fmt, ROUNDINGS, block_size=512)


# (cpd and qpytorch floats of other widths: the same code with other constants)
@pytest.mark.parametrize("fmt", [
    F.cpd_float(4, 3), F.cpd_float(8, 23), F.qpytorch_float(4, 3),
    F.FixedPoint(8, 4), F.FixedPoint(16, 8, clamp=False),
    F.FixedPoint(6, 2, symmetric=True),
    F.FloatFormat(3, 2, subnormals=False), F.FloatFormat(4, 3, bias=5, overflow="saturate"),
], ids=repr)
def test_other_elementwise_formats(fmt):
  _check(_awkward((3, 301), seed=1), fmt, block_size=256)


# (the kernel sees x flattened: (1, 1, 1) runs as (1,) does)
@pytest.mark.parametrize("shape", [(), (1,), (0,), (4, 0, 3), (5, 1, 7), (1025,)])
def test_elementwise_awkward_shapes(shape):
  _check(_awkward(shape, seed=2), F.E4M3, ("nearest", "stochastic"), block_size=128)


def test_rand_bits_and_default_block_size():
  x = _awkward((300,), seed=3)
  a, b = jax.jit(lambda x: (pq(x, F.BF16, "stochastic", key=KEY, rand_bits=5, interpret=True),
                            F.quantize(x, F.BF16, "stochastic", key=KEY, rand_bits=5)))(x)
  _same_bits(a, b)


def test_stochastic_legacy_key_and_key_dependence():
  x = _awkward((200,), seed=4)

  @jax.jit
  def f(x, k1, k2):
    return (pq(x, F.E5M2, "stochastic", key=k1, interpret=True),
            F.quantize(x, F.E5M2, "stochastic", key=k1),
            pq(x, F.E5M2, "stochastic", key=k2, interpret=True))

  a, a_ref, b = f(x, jax.random.PRNGKey(7), jax.random.PRNGKey(8))
  _same_bits(a, a_ref)
  assert not np.array_equal(np.asarray(a), np.asarray(b))  # the noise really is used


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_inputs(dtype):
  x = (_awkward((9, 40), seed=5) * 1e-30).astype(dtype) if dtype == jnp.bfloat16 else \
      jnp.clip(_awkward((9, 40), seed=5), -7e4, 7e4).astype(dtype)
  _check(x, F.E4M3, ("nearest", "stochastic", "toward_zero"))
  _check(x, F.mx(F.E2M1FN, 8), ("nearest", "stochastic"))


@pytest.mark.parametrize("fmt,shape", [
    # (MX elements E4M3FN, E2M1FN, E5M2 and int8: E3M2FN is the same code, other constants)
    (F.mx(F.E4M3FN), (5, 70)), (F.mx(F.E2M1FN, 16), (3, 2, 33)),
    (F.mx("int8", 32), (4, 31)), (F.mx(F.E5M2, 1), (3, 5)),
    (F.BlockFormat(5, axis=-1, block_size=7), (6, 30)),
    (F.BlockFormat(3, axis=1, block_size=4, exponent="hbfp"), (2, 9)),
    (F.hbfp(7, 5), (11, 3, 4)), (F.hbfp(4, 24), (30, 50)),
    (F.BlockFormat(6, tile=(2, 3)), (7,)), (F.BlockFormat(6, tile=(1, 16)), (5, 17)),
], ids=repr)
def test_block_formats(fmt, shape):
  _check(_awkward(shape, seed=6), fmt, ("nearest", "stochastic"), block_size=4)


def test_stochastic_block_programs_hold_at_most_4096_elements():
  """With stochastic rounding the block kernel's default program holds at most 4,096
  elements (16,384 with the other roundings; Triton's compile time grows steeply with the
  unrolled per-element hash), and a grid of such programs gives the spec's bits.
  ``hbfp(4, 16)`` on (64, 80): 20 tiles in rows of 256, 16 rows per program (2 programs)."""
  from jaxlp.pallas import _quantize as PQ

  assert PQ.MAX_PROGRAM_ELEMENTS_STOCHASTIC == 4096 and PQ.MAX_PROGRAM_ELEMENTS == 16384
  calls = []
  real = PQ.pl.pallas_call

  def spy(kernel, **kw):
    calls.append((kw["grid"], kw["in_specs"][-1].block_shape))
    return real(kernel, **kw)

  x = _awkward((64, 80), seed=11)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(PQ.pl, "pallas_call", spy)
    got = {r: pq(x, F.hbfp(4, 16), r, key=KEY, interpret=True) for r in ("stochastic", "nearest")}
  assert calls == [((2,), (16, 256)), ((1,), (32, 256))]
  for r, out in got.items():
    _same_bits(out, F.quantize(x, F.hbfp(4, 16), r, key=KEY))


@pytest.mark.parametrize("fmt,shape,roundings", [
    (F.nvfp4(), (5, 70), ("nearest", "stochastic")),
    (F.nvfp4(tensor_scale=False), (3, 2, 33), ("nearest",)),
    # 2-D tiles: (4, 8) over a leading axis, stochastic; 4 x 4 of a 1-D tensor (the
    # kernel's tile code is the same for 16 x 16, compiled in test_triton_compile)
    (F.nvfp4(tile=(4, 8)), (2, 8, 19), ("stochastic",)),
    (F.nvfp4(tile=4), (9,), ("nearest",)),
    (F.ScaledBlockFormat(F.E2M3FN, block_size=8, scale_fmt="e8m0", tensor_scale=False),
     (6, 20), ("nearest",)),
    (F.ScaledBlockFormat(F.E4M3FN, block_size=4, scale_fmt="fp32", tensor_scale=False),
     (3, 9), ("toward_zero",)),
], ids=repr)
def test_scaled_block_formats(fmt, shape, roundings):
  """The two-level kernel (tensor scale computed before it, block scales in it) == the spec
  (finite inputs: a two-level tensor holding inf or NaN is all NaN, checked below)."""
  x = _awkward(shape, seed=12)
  _check(jnp.where(jnp.isfinite(x), x, 0.5), fmt, roundings, block_size=2)


def test_scaled_block_kernel_special_tensors():
  """Non-finite input, and tensors whose scale chain underflows (amax 1e-38, subnormal) or
  is zero; all of shape (4, 32): one compiled program per format. ``"up"`` turns any
  non-zero scaled element into a non-zero result."""
  x = _awkward((4, 32), seed=13)
  # (float32, not weakly typed: a weak type would trace and compile both programs again)
  for v in (x, jnp.zeros((4, 32)), jnp.where(jnp.isfinite(x), x, 0.0) * 1e-38,
            jnp.full((4, 32), 1e-40, jnp.float32).at[0, 0].set(-3e-39)):
    for fmt in (F.nvfp4(), F.nvfp4(tensor_scale=False)):
      _check(v, fmt, ("up",), block_size=2)


@pytest.mark.parametrize("rule", F.SCALE_RULES)
def test_mx_scale_rules(rule):
  """Each rule's block scales (computed before the elements are rounded, the same for every
  rounding): nearest; stochastic with rceil (and floor, the default, in test_block_formats)."""
  _check(_awkward((9, 40), seed=14), F.mx(F.E2M1FN, 8, scale_rule=rule),
         ("nearest", "stochastic") if rule == "rceil" else ("nearest",), block_size=2)


@pytest.mark.parametrize("fmt", [F.mx(F.E4M3FN, 8), F.hbfp(6, 4)], ids=repr)
def test_block_all_roundings(fmt):
  _check(_awkward((9, 20), seed=10), fmt, ROUNDINGS, block_size=2)


@pytest.mark.parametrize("shape", [(0, 32), (1,), (1, 1), (3, 0)])
def test_block_awkward_shapes(shape):
  _check(_awkward(shape, seed=7), F.mx(F.E4M3FN, 32), ("nearest", "stochastic"))


def test_unsupported_and_errors():
  x = jnp.ones((4, 8))
  assert not supports(F.mx(F.E4M3FN, axis=0), x.shape)
  assert not supports(F.nvfp4(axis=0), x.shape)
  assert not supports(F.nvfp4(tile=3), (2, 4, 8))  # tiles would straddle two leading indices
  assert supports(F.nvfp4(tile=2), (2, 4, 8)) and supports(F.nvfp4(tile=16), (4, 8))
  with pytest.raises(ValueError, match="out of range"):
    pq(x, F.nvfp4(axis=3), interpret=True)
  assert not supports(F.BlockFormat(4), x.shape)  # whole-tensor block
  assert not supports(F.qpytorch_block(8), x.shape)
  with pytest.raises(ValueError, match="no kernel"):
    pq(x, F.BlockFormat(4), interpret=True)
  with pytest.raises(ValueError, match="PRNG key"):
    pq(x, F.E4M3, "stochastic", interpret=True)
  with pytest.raises(TypeError):
    pq(x.astype(jnp.int32), F.E4M3, interpret=True)
  with pytest.raises(ValueError, match="supports rounding"):
    pq(x, F.cpd_float(4, 3), "stochastic", key=KEY, interpret=True)


def test_can_use_is_false_for_cpu_arrays():
  x = jax.device_put(jnp.zeros((1 << 20,)), jax.devices("cpu")[0])
  assert not can_use_pallas_quantize(x, F.E4M3, "nearest")
  assert not can_use_pallas_quantize(x, F.BlockFormat(7, axis=-1, block_size=16), "nearest")


def test_straight_through_gradient():
  x = _awkward((64,), seed=8)
  x = jnp.where(jnp.isfinite(x), x, 0.0)
  g = jax.grad(lambda x: jnp.sum(pq(x, F.E4M3, interpret=True) * 3.0))(x)
  np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0, np.float32))


@pytest.mark.parametrize("bad,match", [
    (dict(rounding="stochastic", rand_bits=True), "rand_bits must be an int"),
    (dict(rounding="stochastic", rand_bits=0), "rand_bits must be an int"),
    (dict(rounding="nearest", rand_bits=8), "applies only to rounding='stochastic'"),
    (dict(rounding="stochastic"), "needs a PRNG key"),
    (dict(rounding="sideways"), "unknown rounding"),
])
def test_kernel_spec_and_dispatch_refuse_bad_input_alike(bad, match):
  """One validation (formats.quantize.prepare) serves the spec, the kernel and jaxlp.quantize:
  the same bad input gets the same error from each (the kernel used to accept
  rand_bits=True)."""
  import jaxlp

  x = jnp.ones((8,), jnp.float32)
  bad = dict(bad)
  rounding = bad.pop("rounding")
  for fn in (F.quantize, jaxlp.quantize, functools.partial(pq, interpret=True)):
    with pytest.raises((TypeError, ValueError), match=match):
      fn(x, F.E4M3, rounding, **bad)
  for fn in (F.quantize, jaxlp.quantize, functools.partial(pq, interpret=True)):
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
      fn(np.ones(8), F.E4M3)
