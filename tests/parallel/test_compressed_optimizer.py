"""jaxlp.parallel.compressed_optimizer (issue 16, item 2): reduce_gradients chained before an
optimizer, refusing an optimizer momentum stacked on DGC's momentum correction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")

import jaxlp.parallel.compressors as C  # noqa: E402
from jaxlp import parallel as P  # noqa: E402

W = 4
PARAMS = {"w": jnp.zeros((16, 12)), "b": jnp.zeros((12,))}


@pytest.mark.parametrize("optimizer, kind", [
    (optax.sgd(0.1, momentum=0.9), "TraceState.trace"),
    (optax.sgd(0.1, momentum=0.9, nesterov=True), "TraceState.trace"),
    (optax.adam(1e-3), "ScaleByAdamState.mu"),
    (optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9)),
     "[1][0].trace (TraceState.trace"),
    (optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
     "inner_state[0].trace (TraceState.trace"),
])
def test_momentum_stacked_on_dgc_is_refused(optimizer, kind):
  tx = P.compressed_optimizer(optimizer, "w", C.dgc(0.01, momentum=0.9))
  with pytest.raises(ValueError) as e:
    tx.init(PARAMS)
  msg = str(e.value)
  assert kind in msg and "DGC" in msg and "momentum=0.9" in msg and "twice" in msg
  assert "momentum=None" in msg and "dgc(..., momentum=0)" in msg


def test_lars_momentum_is_refused():
  from jaxlp.optim import lars

  with pytest.raises(ValueError, match=r"LarsState\.momentum"):
    P.compressed_optimizer(lars(0.1), "w", C.dgc(0.01)).init(PARAMS)


@pytest.mark.parametrize("optimizer, comp", [
    (optax.sgd(0.1, momentum=0.9), C.dgc(0.01, momentum=0.0)),  # SGD's momentum only
    (optax.adam(1e-3), C.topk(0.1)),  # no momentum correction
    (optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1)), C.dgc(0.01)),
])
def test_one_momentum_is_accepted(optimizer, comp):
  st = P.compressed_optimizer(optimizer, "w", comp).init(PARAMS)
  assert isinstance(st[0], P.ReduceGradientsState)


def test_no_compressor_is_refused():
  with pytest.raises(ValueError, match="compressor is None"):
    P.compressed_optimizer(optax.sgd(0.1), "w", None)


def test_plain_sgd_under_dgc_has_the_bits_of_the_manual_chain():
  comp = C.dgc(0.05, momentum=0.9)
  opts = {"min_size": 64, "mean": True}
  txs = [P.compressed_optimizer(optax.sgd(0.1), "w", comp, **opts),
         optax.chain(P.reduce_gradients("w", compressor=comp, **opts), optax.sgd(0.1))]
  grads = jax.tree_util.tree_map(
      lambda p: jax.random.normal(jax.random.key(p.size), (3, W) + p.shape), PARAMS)
  params = jax.tree_util.tree_map(lambda p: jnp.broadcast_to(p, (W,) + p.shape), PARAMS)
  results = []
  for tx in txs:
    def step(g, state, p, tx=tx):
      u, state = tx.update(g, state, p)
      return optax.apply_updates(p, u), state
    run = jax.jit(jax.vmap(step, axis_name="w"))
    p, state = params, jax.vmap(tx.init, axis_name="w")(params)
    for t in range(3):
      p, state = run(jax.tree_util.tree_map(lambda a, t=t: a[t], grads), state, p)
    results.append((p, state))
  (p0, s0), (p1, s1) = results
  assert jax.tree_util.tree_structure(s0) == jax.tree_util.tree_structure(s1)
  for a, b in zip(jax.tree_util.tree_leaves((p0, s0)), jax.tree_util.tree_leaves((p1, s1)),
                  strict=True):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(s0[0].count[0]) == 3
  assert not np.allclose(np.asarray(p0["w"]), 0.0)  # the compressed updates moved the params


def test_train_check_reads_the_momentum_correction_attribute():
  import types

  from jaxlp.training import TrainConfig
  from jaxlp.training._loop import _check_momentum_correction

  cfg = TrainConfig(momentum=0.9, compress="custom")
  with pytest.raises(ValueError, match="twice"):
    _check_momentum_correction(types.SimpleNamespace(momentum_correction=0.5), cfg)
  _check_momentum_correction(types.SimpleNamespace(momentum=0.5), cfg)  # no correction
  _check_momentum_correction(C.dgc(0.01, momentum=0.0), cfg)
  _check_momentum_correction(C.dgc(0.01), TrainConfig(momentum=0.0))
