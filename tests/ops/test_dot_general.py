"""jaxlp.ops.dot_general: policies, exactness, custom_vjp wiring, graph checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxlp.formats import E4M3FN, E5M2, hbfp, hbfp_batched, mx
from jaxlp.formats._quantize import quantize
from jaxlp.ops._dot_general import dot_general
from jaxlp.ops._policy import (
    Accum,
    DotPolicy,
    Quant,
    float_policy,
    hbfp_policy,
    mx_policy,
)

DN = (((1,), (0,)), ((), ()))
# Integers whose every row/tile/block maximum (3, 5, 6 or 7) is not a power of two: exactly
# representable in hbfp(7, T), hbfp_batched(7), E4M3FN, E5M2 and MX(E4M3FN) blocks.
VALUES = np.array([-7, -6, -5, -3, 0, 3, 5, 6, 7], np.float32)


def normal(seed, shape):
  """Standard normal float32 data from numpy (jax.random.normal compiles a program per shape:
  seconds of XLA:CPU time each, for data any generator gives)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def representable(seed, shape):
  rng = np.random.default_rng(seed)
  x = rng.choice(VALUES, size=shape)
  x.reshape(-1)[::3] = 7.0  # every row / tile / block holds a 7
  return jnp.asarray(x)


def vjp_all(fn, x, w, dy):
  """(fn(x, w), dx, dw) for cotangent dy, jitted (eager dispatch of the bit ops is slow)."""

  @jax.jit
  def run(x, w, dy):
    y, pull = jax.vjp(fn, x, w)
    return (y, *pull(dy))

  return run(x, w, dy)


def assert_same(a, b):
  for u, v in zip(a, b, strict=True):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


POLICIES = {
    "hbfp_per_sample": hbfp_policy(7, 24),
    "hbfp_per_sample_w": hbfp_policy(7, 4, weight_man_bits=7),
    "hbfp_tiled": hbfp_policy(7, 4, activations="tiled"),
    "mx": mx_policy(E4M3FN, block_size=4),
    "float": float_policy(E4M3FN, E5M2),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_representable_operands_equal_plain(name):
  x, w, dy = representable(0, (6, 12)), representable(1, (12, 5)), representable(2, (6, 5))
  dg = dot_general(POLICIES[name])
  got = vjp_all(lambda a, b: dg(a, b, DN), x, w, dy)
  want = vjp_all(lambda a, b: lax.dot_general(a, b, DN), x, w, dy)
  assert_same(got, want)


def test_identity_policy_is_plain_lax():
  x = normal(0, (3, 4))
  w = normal(1, (4, 2))
  dg = dot_general(DotPolicy())
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda a: dg(a, w, DN).sum()))(x))
  assert "custom_vjp" not in jaxpr
  assert DotPolicy().is_identity and not hbfp_policy().is_identity
  dy = jnp.ones((3, 2))
  assert_same(vjp_all(lambda a, b: dg(a, b, DN), x, w, dy),
              vjp_all(lambda a, b: lax.dot_general(a, b, DN), x, w, dy))


@pytest.mark.parametrize("tile", [4, 24])
def test_hbfp_matches_independent_computation(tile):
  x = normal(0, (10, 30))
  w = normal(1, (30, 7)) * 0.1
  dy = normal(2, (10, 7)) * 1e-3
  dg = dot_general(hbfp_policy(7, tile, weight_man_bits=7))
  got = vjp_all(lambda a, b: dg(a, b, DN), x, w, dy)
  xq, wq = jax.jit(lambda a: quantize(a, hbfp_batched(7)))(x), jax.jit(
      lambda a: quantize(a, hbfp(7, tile)))(w)
  dyq = jax.jit(lambda a: quantize(a, hbfp_batched(7)))(dy)
  want = vjp_all(lambda a, b: lax.dot_general(a, b, DN), xq, wq, dyq)
  assert not np.array_equal(xq, x) and not np.array_equal(dyq, dy)
  assert_same(got, want)


def test_hbfp_v10_uses_weights_as_given_and_main_tiles_everything():
  x = normal(0, (10, 30))
  w = normal(1, (30, 7))
  dy = normal(2, (10, 7))
  f = lambda p: vjp_all(lambda a, b: dot_general(p)(a, b, DN), x, w, dy)
  plain = lambda a, b, g: vjp_all(lambda u, v: lax.dot_general(u, v, DN), a, b, g)
  qb = jax.jit(lambda t: quantize(t, hbfp_batched(7)))
  qt = jax.jit(lambda t: quantize(t, hbfp(7, 4)))
  assert_same(f(hbfp_policy(7, 4)), plain(qb(x), w, qb(dy)))
  assert_same(f(hbfp_policy(7, 4, activations="tiled")), plain(qt(x), qt(w), qt(dy)))


def test_mx_blocks_along_contraction_axis_in_every_gemm():
  x = normal(0, (8, 16))
  w = normal(1, (16, 12))
  dy = normal(2, (8, 12))
  dg = dot_general(mx_policy(E4M3FN, block_size=4, grad_fmt=E5M2))
  got = vjp_all(lambda a, b: dg(a, b, DN), x, w, dy)
  q = lambda t, elem, axis: quantize(t, mx(elem, 4, axis))

  @jax.jit
  def want(x, w, dy):
    y = q(x, E4M3FN, 1) @ q(w, E4M3FN, 0)
    dx = q(dy, E5M2, 1) @ q(w, E4M3FN, 1).T
    dw = q(x, E4M3FN, 0).T @ q(dy, E5M2, 0)
    return y, dx, dw

  assert_same(got, want(x, w, dy))


def test_batched_and_multi_contraction_dimension_numbers():
  dn = (((2, 3), (1, 3)), ((0,), (0,)))
  x, w = representable(0, (2, 3, 4, 5)), representable(1, (2, 4, 6, 5))
  dy = representable(2, (2, 3, 6))
  for pol in (float_policy(E4M3FN, E5M2), mx_policy(E4M3FN, 4), hbfp_policy(7, 4)):
    dg = dot_general(pol)
    assert_same(vjp_all(lambda a, b, dg=dg: dg(a, b, dn), x, w, dy),
                vjp_all(lambda a, b: lax.dot_general(a, b, dn), x, w, dy))


def test_accepts_lax_keywords_and_extra_keywords():
  x, w = representable(0, (4, 6)), representable(1, (6, 3))
  dg = dot_general(float_policy(E4M3FN, E5M2))
  y = jax.jit(lambda a, b: dg(a, b, DN, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32, out_sharding=None))(x, w)
  np.testing.assert_array_equal(y, x @ w)
  x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  y16 = jax.jit(lambda a, b: dg(a, b, DN))(x16, w16)
  assert y16.dtype == jnp.bfloat16
  g = jax.jit(jax.grad(lambda a, b: dg(a, b, DN).astype(jnp.float32).sum()))(x16, w16)
  assert g.dtype == jnp.bfloat16


def test_stochastic_needs_key_and_key_is_data():
  x = normal(0, (8, 16))
  w = normal(1, (16, 4))
  pol = hbfp_policy(3, 4, activations="tiled", rounding="stochastic")
  with pytest.raises(ValueError, match="key"):
    jax.eval_shape(lambda a, b: dot_general(pol)(a, b, DN), x, w)

  @jax.jit
  def grads(key):
    return jax.grad(lambda a, b: dot_general(pol, key=key)(a, b, DN).sum(), (0, 1))(x, w)

  g1, g2, g3 = grads(jax.random.key(1)), grads(jax.random.key(1)), grads(jax.random.key(2))
  assert_same(g1, g2)
  assert not np.array_equal(g1[1], g3[1])
  # the call-time key overrides the construction key; legacy uint32 keys work too
  f_call = jax.jit(lambda a, b, k: dot_general(pol, key=jax.random.key(5))(a, b, DN, key=k))
  f_cons = jax.jit(lambda a, b, k: dot_general(pol, key=k)(a, b, DN))
  np.testing.assert_array_equal(f_call(x, w, jax.random.key(1)), f_cons(x, w, jax.random.key(1)))
  f_cons(x, w, jax.random.PRNGKey(0))


# Gradients on random data for the policies whose gradients no bit-exact test here computes
# (those do: hbfp_policy(7, 4) per-sample and tiled in test_hbfp_v10_..., float_policy in
# test_representable_operands_equal_plain, stochastic tiled HBFP in
# test_stochastic_needs_key_and_key_is_data, MX E4M3FN/E5M2 in test_mx_blocks_along_...).
ALL = [
    hbfp_policy(11, 24, weight_man_bits=15), mx_policy(E5M2, 32),
    mx_policy(rounding="stochastic"), float_policy(E4M3FN, E5M2, rounding="stochastic"),
]


@pytest.mark.usefixtures("fast_compile")  # finite and nonzero: any optimization level
@pytest.mark.parametrize("i", range(len(ALL)))
def test_grads_finite_on_random_data(i):
  x = normal(0, (16, 48)) * 3
  w = normal(1, (48, 40)) * 0.2
  dg = dot_general(ALL[i], key=jax.random.key(0))
  f = lambda a, b: jnp.sum(jnp.tanh(dg(a, b, DN)) ** 2)
  gx, gw = jax.jit(jax.grad(f, (0, 1)))(x, w)
  assert np.isfinite(gx).all() and np.isfinite(gw).all()
  assert np.abs(gw).sum() > 0


def _hlo_has_quantize(fn, *args):
  """Whether XLA:CPU's compiled HLO of ``jit(fn)(*args)`` contains a quantization.

  A check of CPU HLO text (on XLA:CPU the quantizer's ``bitcast-convert`` survives into the
  optimized module; a GPU backend fuses it into kernels whose text differs), so the inputs
  are committed to the CPU device: the graph is compiled for the CPU whatever the default
  backend is (``JAX_PLATFORMS=cuda,cpu`` included).
  """
  args = jax.device_put(args, jax.devices("cpu")[0])
  txt = jax.jit(fn).lower(*args).compile().as_text()
  return "bitcast-convert" in txt


SLOT_CASES = [
    # slot quantized, function computed, expected in graph?
    ("lhs", "fwd", True), ("rhs", "fwd", True), ("grad", "fwd", False),
    ("grad", "dlhs", True), ("drhs_grad", "dlhs", False),
    ("dlhs_rhs", "dlhs", True), ("drhs_lhs", "dlhs", False),
    ("drhs_grad", "drhs", True), ("grad", "drhs", False),
    ("drhs_lhs", "drhs", True), ("dlhs_rhs", "drhs", False),
]


@pytest.mark.parametrize("slot,which,expected", SLOT_CASES)
def test_quantization_is_in_the_compiled_graph_of_the_right_gemm(slot, which, expected):
  x = normal(0, (8, 16))
  w = normal(1, (16, 4))
  kw = dict(dlhs_rhs=None, drhs_lhs=None, drhs_grad=None)
  kw[slot] = Quant(hbfp(7, 4))
  dy = normal(2, (8, 4))
  dg = dot_general(DotPolicy(**kw))

  def fn(a, b, g):
    y, pull = jax.vjp(lambda u, v: dg(u, v, DN), a, b)
    return {"fwd": y, "dlhs": pull(g)[0], "drhs": pull(g)[1]}[which]

  assert _hlo_has_quantize(fn, x, w, dy) == expected


def test_identity_policy_has_no_quantization_in_graph():
  x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
  plain = dot_general(DotPolicy())
  assert not _hlo_has_quantize(
      lambda a, b: jax.grad(lambda u, v: plain(u, v, DN).sum(), (0, 1))(a, b), x, w)


def test_policy_validation_and_hashing():
  assert hash(hbfp_policy()) == hash(hbfp_policy())
  assert hbfp_policy() == hbfp_policy() and hbfp_policy() != hbfp_policy(activations="tiled")
  assert DotPolicy(lhs=E4M3FN).lhs == Quant(E4M3FN, "nearest")
  with pytest.raises(TypeError, match="lhs"):
    DotPolicy(lhs="e4m3")
  with pytest.raises(ValueError, match="activations"):
    hbfp_policy(activations="rows")
  with pytest.raises(ValueError, match="algorithm"):
    Accum(algorithm="pairwise")
  with pytest.raises(TypeError, match="policy"):
    dot_general(E4M3FN)
