"""DGC's warm-up with a per-stage payload capacity (issue 16, item 2): a compressor specialised
to one warm-up stage (DGC.at_stage) selects the same bits as the unspecialised one, sends that
stage's bytes, and jaxlp train sends the target's bytes once the warm-up is over."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.parallel.compressors as C
from jaxlp import parallel as P

W = 8


def test_stages_and_their_capacities():
  comp = C.dgc(0.01, warmup=3)
  assert comp.stages == 3  # 75%, 93.75%, 98.4% sparsity, then the target (99%)
  assert [comp.stage_at(s) for s in (0, 2, 3, 8, 9, 10**6)] == [0, 0, 1, 2, 3, 3]
  assert comp.at_stage(7) == comp.at_stage(3) and comp.at_stage(3).stage == 3
  assert C.dgc(0.01).at_stage(2) == C.dgc(0.01) and C.dgc(0.01).stages == 0
  n = 10_000
  assert [comp.at_stage(s).capacity(n) for s in range(4)] == [2500, 625, 157, 100]
  # bound to W workers: never above the dense all-reduce (floor(n/W - 1/2)), never below target
  assert [comp.at_stage(s).for_workers(W).capacity(n) for s in range(4)] == [1249, 625, 157, 100]
  assert comp.for_workers(W).capacity(n) == 1249  # unspecialised: the first stage, every step
  # after the warm-up: the bytes of DGC without warm-up
  assert comp.at_stage(3).for_workers(W).wire_bytes((n,)) == C.dgc(0.01).wire_bytes((n,))
  with pytest.raises(ValueError, match="stage=-1"):
    comp.at_stage(-1)
  with pytest.raises(TypeError, match="stage"):
    comp.at_stage(1.0)


@pytest.mark.usefixtures("fast_compile")  # counts, not bits (tests/conftest.py, fast_compile)
def test_stage_capacity_is_the_count_encode_selects():
  n = 4099
  comp = C.dgc(0.01, momentum=0.0, sample_rate=None, warmup=1)
  g = jax.random.normal(jax.random.key(0), (n,))  # no ties: exact top-k keeps k_now values
  for s in range(comp.stages + 1):
    st = dict(comp.init((n,)), step=jnp.int32(s))
    staged = comp.at_stage(comp.stage_at(s))
    payload, _ = jax.jit(staged.encode)(g, st)
    assert int(payload["count"][0]) == staged.capacity(n)


def _run(tx_at, g, steps):
  """``steps`` updates of the transform ``tx_at(step)`` under a named vmap over W workers,
  each transform jitted once; returns the updates and states of every step."""
  tx0 = tx_at(0)
  state = jax.vmap(tx0.init, axis_name="w")(g[0])
  compiled, outs = {}, []
  for t in range(steps):
    tx = tx_at(t)
    if tx not in compiled:
      compiled[tx] = jax.jit(jax.vmap(tx.update, axis_name="w"))
    u, state = compiled[tx](g[t], state)
    outs.append((u, state))
  return outs


def test_per_stage_transforms_give_the_bits_of_the_single_one():
  # the optax path: one reduce_gradients per stage, sharing the state, against the one with
  # the first stage's capacity for every step (W=8: that capacity is capped at dense, which
  # binds in stage 0 for both); sampled thresholds, 2 steps per stage, past the warm-up
  comp = C.dgc(0.05, momentum=0.9, warmup=2)
  steps = 2 * comp.stages + 1
  g = {"w": jax.random.normal(jax.random.key(1), (steps, W, 24, 40))}
  g = [jax.tree_util.tree_map(lambda a, t=t: a[t], g) for t in range(steps)]
  one = P.reduce_gradients("w", compressor=comp, min_size=0)
  per_stage = {s: P.reduce_gradients("w", compressor=comp.at_stage(s), min_size=0)
               for s in range(comp.stages + 1)}
  ref = _run(lambda t: one, g, steps)
  got = _run(lambda t: per_stage[comp.stage_at(t)], g, steps)
  for (ur, sr), (ug, sg) in zip(ref, got, strict=True):
    for a, b in zip(jax.tree_util.tree_leaves((ur, sr.compressor_state)),
                    jax.tree_util.tree_leaves((ug, sg.compressor_state)), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # the staged bytes fall to the target's; the single transform's stay at the first stage's
  n = 24 * 40
  first = P.compressed_wire_bytes({"w": g[0]["w"][0]}, comp, W, min_size=0)
  last = P.compressed_wire_bytes({"w": g[0]["w"][0]}, comp.at_stage(comp.stages), W, min_size=0)
  # the payload (capped at the dense all-reduce's bytes) and the leaf's finite flag (a byte)
  assert first == (W - 1) * (4 + 8 * ((2 * n - W) // (2 * W))) + (W - 1)
  assert last == P.compressed_wire_bytes({"w": g[0]["w"][0]}, C.dgc(0.05), W, min_size=0)


@pytest.mark.usefixtures("fast_compile")  # bytes and counts, not bits: XLA's optimizations off
def test_train_sends_the_target_bytes_after_the_warm_up():
  pytest.importorskip("optax", reason="jaxlp.training needs the examples extra")
  from jaxlp.training import TrainConfig, Trainer

  t = Trainer(TrainConfig(model="mlp", width=4, nodes=4, batch_size=64, momentum=0.0,
                          compress="dgc:ratio=0.05,warmup=1", max_steps_per_epoch=2,
                          epochs=2, quiet=True))
  comp = t.compressor
  assert comp.stages == 2
  hist = [t.run_epoch() for _ in range(2)]
  target = P.compressed_wire_bytes(t.params, C.dgc(0.05), 4, min_size=1024)
  stage = lambda s: P.compressed_wire_bytes(t.params, comp.at_stage(s), 4,  # noqa: E731
                                            min_size=1024)
  assert [h["wire_bytes"] for h in hist] == [stage(0) + stage(1), 2 * target]
  assert stage(0) > stage(1) > target
  assert t.wire_per_step == target
  assert sorted(t._train_steps) == [0, 1, 2]  # one compiled step per stage
  assert all(h["nonfinite_steps"] == 0 for h in hist)
