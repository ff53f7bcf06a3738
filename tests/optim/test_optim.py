"""jaxlp.optim: master weights, quantized updates, low-precision optimizer state.

The tests marked ``FAST`` check what holds at any XLA optimization level (finite, representable
in the format, fresh noise, statistics, state types, one trace; two key types compared in the
same test): they compile with XLA's optimizations off (``fast_compile``, tests/conftest.py).
The comparisons with an independent computation and with optax compile normally."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlp.formats import BF16, E4M3, E5M2, hbfp
from jaxlp.formats._quantize import quantize
from jaxlp.optim import master_weights, quantize_updates, scale_by_adam, trace

PARAMS = {"w": jax.random.normal(jax.random.key(0), (30, 20)),
          "b": jax.random.normal(jax.random.key(1), (20,)) * 0.1}
GRADS = jax.tree.map(lambda p: 0.05 * jnp.cos(3 * p), PARAMS)
NARROW, WIDE = hbfp(7, 24), hbfp(15, 24)
FAST = pytest.mark.usefixtures("fast_compile")


def test_master_weights_wide_and_narrow_from_the_same_fp32_update():
  inner = optax.sgd(0.1, momentum=0.9)
  tx = master_weights(inner, fmt=NARROW, wide_fmt=WIDE)
  q = lambda t, f: jax.tree.map(lambda a: quantize(a, f), t)
  p0 = q(PARAMS, NARROW)
  s = jax.jit(tx.init)(p0)
  wide0 = q(p0, WIDE)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), s.wide, wide0))
  u, s1 = jax.jit(tx.update)(GRADS, s, p0)
  p1 = optax.apply_updates(p0, u)
  # independent: the inner optimizer in fp32 on the wide copy, then both roundings
  iu, _ = inner.update(GRADS, inner.init(wide0), wide0)
  new = optax.apply_updates(wide0, iu)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), p1, q(new, NARROW))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), s1.wide, q(new, WIDE))
  assert not np.array_equal(s1.wide["w"], p1["w"])  # wide keeps more bits


def test_fp32_formats_equal_optax():
  for ours, theirs in ((scale_by_adam(), optax.scale_by_adam()),
                       (trace(0.9), optax.trace(0.9)),
                       (trace(0.9, nesterov=True), optax.trace(0.9, nesterov=True))):
    s1, s2 = ours.init(PARAMS), theirs.init(PARAMS)
    for _ in range(3):
      u1, s1 = ours.update(GRADS, s1)
      u2, s2 = theirs.update(GRADS, s2)
      jax.tree.map(np.testing.assert_array_equal, u1, u2)


TRANSFORMS = {
    "master_weights": lambda: master_weights(optax.sgd(0.1, 0.9), fmt=NARROW, wide_fmt=WIDE,
                                             rounding="stochastic", key=jax.random.key(0)),
    "master_lars": lambda: master_weights(optax.lars(0.1), fmt=NARROW, wide_fmt=WIDE),
    "quantize_updates": lambda: quantize_updates(BF16, "stochastic", key=jax.random.key(0)),
    "adam": lambda: optax.chain(scale_by_adam(mu_fmt=BF16, nu_fmt=E5M2,
                                              key=jax.random.PRNGKey(0)), optax.scale(-1e-3)),
    "trace": lambda: trace(0.9, fmt=E4M3, key=jax.random.key(1)),
}


@FAST
def test_master_weights_composes_with_lars_and_is_stochastic_with_key():
  tx = master_weights(optax.lars(0.1, momentum=0.9), fmt=NARROW, wide_fmt=WIDE,
                      rounding="stochastic", key=jax.random.key(0))
  s = tx.init(PARAMS)
  p = PARAMS
  step = jax.jit(tx.update)
  for _ in range(3):
    u, s = step(GRADS, s, p)
    p = optax.apply_updates(p, u)
  for leaf in jax.tree.leaves(p):
    assert np.isfinite(leaf).all()
  with pytest.raises(ValueError, match="key"):
    master_weights(optax.sgd(0.1), fmt=NARROW, rounding="stochastic")
  with pytest.raises(ValueError, match="params"):
    master_weights(optax.sgd(0.1), fmt=NARROW).update(GRADS, s, None)


@FAST
def test_low_precision_moments_are_representable_and_fresh_noise_each_step():
  tx = scale_by_adam(mu_fmt=E4M3, nu_fmt=E5M2, key=jax.random.key(3))
  s = tx.init(PARAMS)
  step = jax.jit(tx.update)
  u1, s1 = step(GRADS, s)
  u2, s2 = step(GRADS, s1)
  for mu, nu in zip(jax.tree.leaves(s2.mu), jax.tree.leaves(s2.nu), strict=True):
    np.testing.assert_array_equal(quantize(mu, E4M3), mu)
    np.testing.assert_array_equal(quantize(nu, E5M2), nu)
  assert not np.array_equal(jax.random.key_data(s1.key), jax.random.key_data(s2.key))
  tr = trace(0.9, fmt=BF16, key=jax.random.key(0))
  _, st = tr.update(GRADS, tr.init(PARAMS))
  for m in jax.tree.leaves(st.trace):
    np.testing.assert_array_equal(quantize(m, BF16), m)
  qu = quantize_updates(E4M3)
  out, _ = qu.update(GRADS, qu.init(PARAMS))
  for g in jax.tree.leaves(out):
    np.testing.assert_array_equal(quantize(g, E4M3), g)


@FAST
def test_stochastic_moments_unbiased_on_average():
  g = {"w": jnp.full((20000,), 0.1)}  # 0.1 is not representable in E4M3
  tr = trace(0.0, fmt=E4M3, key=jax.random.key(0))
  _, st = tr.update(g, tr.init(g))
  m = st.trace["w"]
  assert len(np.unique(m)) == 2 and abs(float(m.mean()) - 0.1) < 2e-3


@FAST
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_state_types_stable_and_no_recompilation(name):
  tx = TRANSFORMS[name]()
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(1)
    u, state = tx.update(GRADS, state, params)
    return optax.apply_updates(params, u), state

  state0 = tx.init(PARAMS)
  params, state1 = step(PARAMS, state0)
  params, state2 = step(params, state1)
  params, state3 = step(params, state2)
  assert len(traces) == 1
  typ = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)
  assert typ(state0) == typ(state1) == typ(state3)
  assert jax.tree.structure(state0) == jax.tree.structure(state3)


@FAST
def test_state_keys_are_typed_and_legacy_keys_give_the_same_bits():
  params = {"w": jnp.linspace(-1.0, 1.0, 16)}
  g = {"w": jnp.linspace(0.3, -0.7, 16)}
  outs = []
  for key in (jax.random.key(5), jax.random.PRNGKey(5)):
    tx = quantize_updates(E4M3, "stochastic", key=key)
    st = tx.init(params)
    assert jnp.issubdtype(st.key.dtype, jax.dtypes.prng_key) and st.key.shape == ()
    u, st = tx.update(g, st)
    u2, _ = tx.update(g, st)
    outs.append((np.asarray(u["w"]), np.asarray(u2["w"])))
  np.testing.assert_array_equal(outs[0][0], outs[1][0])
  np.testing.assert_array_equal(outs[0][1], outs[1][1])
  # no stochastic rounding: no key in the state (not a placeholder array)
  assert quantize_updates(E4M3).init(params).key is None
  assert trace(0.9, fmt=E4M3, rounding="nearest", key=jax.random.key(0)).init(params).key is None
  with pytest.raises(ValueError, match="quantize_updates: key must be a jax.random.key"):
    quantize_updates(E4M3, "stochastic", key=jnp.zeros(3, jnp.int32))
