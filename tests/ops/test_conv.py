"""jaxlp.ops.conv_general_dilated: exactness for every conv geometry, HBFP views, MX axes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxlp.formats import E4M3FN, E5M2, BlockFormat, hbfp, hbfp_batched, mx
from jaxlp.formats._quantize import quantize
from jaxlp.ops._conv import conv_general_dilated
from jaxlp.ops._policy import Accum, DotPolicy, float_policy, hbfp_policy, mx_policy

NHWC = ("NHWC", "HWIO", "NHWC")
VALUES = np.array([-7, -6, -5, -3, 0, 3, 5, 6, 7], np.float32)


def normal(seed, shape):
  """Standard normal float32 data from numpy (jax.random.normal compiles a program per shape:
  seconds of XLA:CPU time each, for data any generator gives)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def representable(seed, shape):
  rng = np.random.default_rng(seed)
  x = rng.choice(VALUES, size=shape)
  x.reshape(-1)[::3] = 7.0
  return jnp.asarray(x)


def vjp_all(fn, x, w, dy):
  @jax.jit
  def run(x, w, dy):
    y, pull = jax.vjp(fn, x, w)
    return (y, *pull(dy))

  return run(x, w, dy)


def assert_same(a, b):
  for u, v in zip(a, b, strict=True):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


CASES = {
    # name: (x shape, w shape, kwargs)
    "grouped_dilated_strided": ((2, 9, 8, 4), (3, 3, 2, 6),
                                dict(window_strides=(2, 1), padding="SAME", rhs_dilation=(2, 1),
                                     feature_group_count=2)),
    "lhs_dilation_padding": ((2, 5, 5, 3), (2, 2, 3, 4),
                             dict(window_strides=(1, 1), padding=((1, 2), (0, 1)),
                                  lhs_dilation=(2, 2))),
    "batch_groups": ((4, 6, 6, 3), (3, 3, 3, 4),
                     dict(window_strides=(1, 1), padding="VALID", batch_group_count=2)),
    "depthwise": ((2, 7, 7, 4), (3, 3, 1, 4),
                  dict(window_strides=(2, 2), padding="SAME", feature_group_count=4)),
}


@functools.cache
def _plain_case(case):
  """(x, w, dy, the plain conv's vjp) of a geometry: computed once for the three policies."""
  xs, ws, kw = CASES[case]
  x, w = representable(0, xs), representable(1, ws)
  plain = lambda a, b: lax.conv_general_dilated(a, b, dimension_numbers=NHWC, **kw)
  dy = representable(2, jax.eval_shape(plain, x, w).shape)
  return x, w, dy, tuple(np.asarray(v) for v in vjp_all(plain, x, w, dy))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pol", ["float", "hbfp", "mx"])
def test_representable_operands_equal_plain_conv(case, pol):
  kw = CASES[case][2]
  policy = {"float": float_policy(E4M3FN, E5M2), "hbfp": hbfp_policy(7, 4, "tiled"),
            "mx": mx_policy(E4M3FN, 2)}[pol]
  cg = conv_general_dilated(policy)
  x, w, dy, want = _plain_case(case)
  got = vjp_all(lambda a, b: cg(a, b, dimension_numbers=NHWC, **kw), x, w, dy)
  assert_same(got, want)


def test_identity_policy_is_plain_lax_with_positional_args():
  x = normal(0, (2, 8, 8, 3))
  w = normal(1, (3, 3, 3, 5))
  cg = conv_general_dilated(DotPolicy())
  args = ((1, 1), "SAME", None, (2, 2), NHWC, 1, 1, None, None)
  dy = jnp.ones((2, 8, 8, 5))
  assert_same(vjp_all(lambda a, b: cg(a, b, *args, out_sharding=None), x, w, dy),
              vjp_all(lambda a, b: lax.conv_general_dilated(a, b, *args), x, w, dy))


def _oihw_tiled(w_hwio, fmt):
  """Independent HBFPEmulator-style weight quantization: OIHW view, (O, I*kh*kw) tiles."""
  w = jnp.transpose(w_hwio, (3, 2, 0, 1))
  return jnp.transpose(quantize(w, fmt), (2, 3, 1, 0))


def test_hbfp_conv_matches_independent_computation():
  x = normal(0, (3, 6, 6, 5))
  w = normal(1, (3, 3, 5, 7)) * 0.2
  kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
  dy = normal(2, (3, 6, 6, 7)) * 1e-2
  cg = conv_general_dilated(hbfp_policy(7, 4, weight_man_bits=7))
  got = vjp_all(lambda a, b: cg(a, b, **kw), x, w, dy)

  @jax.jit  # the independent computation as one program
  def want(x, w, dy):
    xq, wq, dyq = quantize(x, hbfp_batched(7)), _oihw_tiled(w, hbfp(7, 4)), quantize(
        dy, hbfp_batched(7))
    y, pull = jax.vjp(lambda a, b: lax.conv_general_dilated(a, b, **kw), xq, wq)
    # the OIHW view matters: tiling the HWIO array as given gives a different weight
    return (y, *pull(dyq)), wq, quantize(w, hbfp(7, 4))

  want_vjp, wq, w_hwio_tiled = want(x, w, dy)
  assert not np.array_equal(wq, w_hwio_tiled)
  assert_same(got, want_vjp)


def test_hbfp_main_tiles_activations_in_nchw_view():
  x = normal(0, (5, 4, 4, 6))
  w = normal(1, (3, 3, 6, 4))
  kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
  dy = normal(2, (5, 4, 4, 4))
  cg = conv_general_dilated(hbfp_policy(5, 3, activations="tiled"))
  got = vjp_all(lambda a, b: cg(a, b, **kw), x, w, dy)
  nchw = lambda t: jnp.transpose(quantize(jnp.transpose(t, (0, 3, 1, 2)), hbfp(5, 3)),
                                 (0, 2, 3, 1))
  conv = lambda a, b: lax.conv_general_dilated(a, b, **kw)

  @jax.jit  # the independent computation as one program
  def want_vjp(x, w, dy):
    y, pull = jax.vjp(conv, nchw(x), _oihw_tiled(w, hbfp(5, 3)))
    return (y, *pull(nchw(dy)))

  assert_same(got, want_vjp(x, w, dy))


def test_mx_conv_blocks_along_channels_then_batch():
  x = normal(0, (4, 5, 5, 8))
  w = normal(1, (3, 3, 8, 6))
  kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
  dy = normal(2, (4, 5, 5, 6))
  cg = conv_general_dilated(mx_policy(E4M3FN, 2))
  got = vjp_all(lambda a, b: cg(a, b, **kw), x, w, dy)
  conv = lambda a, b: lax.conv_general_dilated(a, b, **kw)

  @jax.jit
  def want(x, w, dy):
    q = lambda t, axis: quantize(t, mx(E4M3FN, 2, axis))
    y = conv(q(x, 3), q(w, 2))
    _, pull_x = jax.vjp(conv, x, q(w, 3))
    _, pull_w = jax.vjp(conv, q(x, 0), w)
    return y, pull_x(q(dy, 3))[0], pull_w(q(dy, 0))[1]

  assert_same(got, want(x, w, dy))


# Gradients on random data for the policies whose conv gradients no bit-exact test here
# computes (those do: per-sample HBFP in test_hbfp_conv_matches_independent_computation, tiled
# HBFP in test_hbfp_main_tiles_activations_in_nchw_view, float_policy in
# test_representable_operands_equal_plain_conv).
@pytest.mark.usefixtures("fast_compile")  # finite and nonzero: any optimization level
@pytest.mark.parametrize("pol", [mx_policy(), hbfp_policy(rounding="stochastic")])
def test_conv_grads_finite(pol):
  x = normal(0, (4, 8, 8, 16)) * 3
  w = normal(1, (3, 3, 16, 32)) * 0.1
  cg = conv_general_dilated(pol, key=jax.random.key(0))
  f = lambda a, b: jnp.sum(jnp.tanh(cg(a, b, (1, 1), "SAME", dimension_numbers=NHWC)) ** 2)
  gx, gw = jax.jit(jax.grad(f, (0, 1)))(x, w)
  assert np.isfinite(gx).all() and np.isfinite(gw).all() and np.abs(gw).sum() > 0


def test_conv_rejects_accumulator_emulation():
  with pytest.raises(NotImplementedError, match="conv"):
    conv_general_dilated(DotPolicy(fwd_acc=Accum(acc=E5M2)))


def test_contraction_layout_blocks_activations_per_pixel_along_channels():
  """layout="contraction": activations and gradients in blocks of 4 channels of one pixel
  (hbfp tiles (3, 4): the row extent counts as 1), the kernel in its OIHW tiles; "auto" is
  HBFPEmulator's NCHW view (the existing numbers)."""
  x = normal(0, (3, 4, 4, 8))
  w = normal(1, (3, 3, 8, 8))
  kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
  dy = normal(2, (3, 4, 4, 8))
  fmt = BlockFormat(5, tile=(3, 4), exponent="hbfp")
  pol = DotPolicy(lhs=fmt, rhs=fmt, grad=fmt, layout="contraction")
  got = vjp_all(lambda a, b: conv_general_dilated(pol)(a, b, **kw), x, w, dy)
  per_pixel = BlockFormat(5, axis=3, block_size=4, exponent="hbfp")

  @jax.jit  # the independent computation as one program
  def want(x, w, dy):
    y, pull = jax.vjp(lambda a, b: lax.conv_general_dilated(a, b, **kw), quantize(x, per_pixel),
                      _oihw_tiled(w, fmt))
    return (y, *pull(quantize(dy, per_pixel)))

  assert_same(got, want(x, w, dy))
  # "auto" differs (the forward GEMM shows it)
  auto = jax.jit(lambda a, b: conv_general_dilated(dataclasses.replace(pol, layout="auto"))(
      a, b, **kw))(x, w)
  assert not np.array_equal(auto, got[0])
  bad = DotPolicy(lhs=BlockFormat(5, tile=(None, 4)), layout="contraction")
  with pytest.raises(NotImplementedError, match=r"'lhs'.*tiles \(None, 4\)"):
    conv_general_dilated(bad)
