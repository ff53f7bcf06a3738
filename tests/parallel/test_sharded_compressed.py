"""jaxlp.parallel.compressed_reduce_scatter (qgZ): format wires with error feedback and the
dense-quantizer / cast compressors, against numpy oracles, under vmap and shard_map; the
refusals; the byte count against the traced collectives."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp import parallel as jp
from jaxlp.parallel import compressors as C
from jaxlp.parallel.compressors._base import exact_div

sys.path.insert(0, str(Path(__file__).parent))
import oracle  # noqa: E402
from test_sharded import (  # noqa: E402
  _traced_bytes,
  assert_same_bits,
  run_shard_map,
  run_vmap,
)

W = 4
SHAPES = {"w": ((8, 3), 0), "v": ((2, 4), 1)}  # (leaf shape, scatter dimension)


def grads(seed, w=W):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=(w,) + s).astype(np.float32) for k, (s, _) in SHAPES.items()}


def params():
  return {k: jnp.zeros(s, jnp.float32) for k, (s, _) in SHAPES.items()}


def steps(wire, nsteps, data, *, w=W, error_feedback=False, mean=False, rounding="nearest",
          runner=run_vmap):
  """``nsteps`` compressed reduce-scatters (scatter dimension per leaf) in one program."""
  st0 = jp.init_sharded_state(wire, params(), error_feedback=error_feedback)

  def fn(t):
    st, outs = st0, []
    for s in range(nsteps):
      out = {}
      for k, (_, d) in SHAPES.items():  # one leaf per call: each leaf its own dimension
        o, st1 = jp.compressed_reduce_scatter(
            {k: t[k][s]}, _leaf_state(st, k), "i", wire, scatter_dimension=d, mean=mean,
            rounding=rounding)
        out[k] = o[k]
        st = _merge_state(st, k, st1)
      st = st._replace(count=st.count + 1)
      outs.append(out)
    return outs, st.leaves, st.count  # (the typed key stays out of the outputs)

  return runner(fn, data) if runner is run_vmap else runner(fn, data, w)


KEYS = sorted(SHAPES)  # tree-flatten order of the params dict


def _leaf_state(st, k):
  i = KEYS.index(k)
  return st._replace(leaves=(st.leaves[i],))


def _merge_state(st, k, st1):
  leaves = list(st.leaves)
  leaves[KEYS.index(k)] = st1.leaves[0]
  return st._replace(leaves=tuple(leaves))


def multi_step_data(seed, nsteps, w=W):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=(w, nsteps) + s).astype(np.float32) for k, (s, _) in SHAPES.items()}


def format_oracle(wire, data, nsteps, *, error_feedback, mean, rounding="nearest", w=W):
  """Outputs (per step, leaf: (W, m) rows) and final residuals of the format path."""
  fmt = wire if hasattr(wire, "_round_bits") else _row(wire)
  base = jax.random.key(0)
  res = {k: np.zeros((w,) + s, np.float32) for k, (s, _) in SHAPES.items()}
  outs = []
  for s in range(nsteps):
    key = jax.random.fold_in(base, s) if rounding == "stochastic" else None
    out = {}
    for k, (shape, d) in SHAPES.items():
      g = data[k][:, s].reshape(w, -1)
      if mean:
        g = np.asarray(exact_div(jnp.asarray(g), w))
      x = (g + res[k].reshape(w, -1)).astype(np.float32) if error_feedback else g
      q = oracle.Q(fmt, rounding, key, leaf=0)
      out[k] = oracle.all_to_all_sum(x, shape, d, q)
      if error_feedback:
        idx = oracle.slab_rows(np.arange(x.shape[1]), shape, d, w)
        for r in range(w):
          qr = q(oracle.slab_rows(x[r], shape, d, w), idx, r, 7)
          full = np.zeros(x.shape[1], np.float32)
          full[idx] = qr
          res[k][r] = (x[r] - full).astype(np.float32).reshape(shape)
    outs.append(out)
  return outs, res


def _row(fmt):
  import dataclasses
  return dataclasses.replace(fmt, axis=-1)


def check_steps(got, want, nsteps, w=W):
  outs = got[0]
  for s in range(nsteps):
    for k in SHAPES:
      assert_same_bits(np.asarray(outs[s][k]).reshape(w, -1), want[s][k], f"step {s} leaf {k}")


@pytest.mark.parametrize("wire", [F.mx(F.E2M1FN, 4), F.BlockFormat(3, axis=-1, block_size=3)],
                         ids=["mxfp4", "int4-blocks"])
def test_error_feedback_matches_the_oracle_over_steps(wire, cpu_devices):
  nsteps = 2
  data = multi_step_data(1, nsteps)
  got = steps(wire, nsteps, data, error_feedback=True, mean=True)
  want, res = format_oracle(wire, data, nsteps, error_feedback=True, mean=True)
  check_steps(got, want, nsteps)
  for k in SHAPES:
    assert_same_bits(got[1][KEYS.index(k)]["residual"], res[k], f"residual {k}")
  assert int(got[2][0]) == nsteps
  if isinstance(wire, F.MXFormat):
    sm = steps(wire, nsteps, data, error_feedback=True, mean=True, runner=run_shard_map)
    check_steps(sm, want, nsteps)


def test_without_error_feedback_it_is_reduce_scatter_all_to_all():
  wire = F.mx(F.E4M3FN, 4)
  data = multi_step_data(2, 2)
  key = jax.random.key(0)
  got = steps(F.E5M2, 2, data, rounding="stochastic")
  want, _ = format_oracle(F.E5M2, data, 2, error_feedback=False, mean=False,
                          rounding="stochastic")
  check_steps(got, want, 2)
  # the same bits as reduce_scatter(order="all_to_all") with the step key
  x = data["w"][:, 0]
  a = run_vmap(lambda g: jp.compressed_reduce_scatter(
      g, jp.init_sharded_state(wire, jnp.zeros((8, 3))), "i", wire)[0], x)
  b = run_vmap(lambda g: jp.reduce_scatter(g, "i", fmt=wire, order="all_to_all",
                                           key=jax.random.fold_in(key, 0)), x)
  assert_same_bits(a, b)


# The sharded compressor path (slabs, per-worker keys and state, the owner's rank-order sum) is
# one path for every compressor; each compressor's own encode is compared with its reference,
# compiled normally, in tests/parallel/compress (test_compress_compressors.py). So one of each
# kind runs compiled normally here -- a stateless quantizer (CGX), a stateful one that also runs
# under shard_map (1-bit), a cast -- and the other compressors run with XLA's optimizations off
# (tests/conftest.py, fast_compile; their oracle is compiled in the same test).
COMPRESSORS = {
    "cgx": C.cgx(bits=4, bucket_size=4), "onebit": C.onebit(), "cast-e4m3": C.cast("E4M3FN"),
}
MORE_COMPRESSORS = {
    "cgx-stochastic": C.cgx(bits=3, stochastic=True), "qsgd": C.qsgd(levels=7, bucket_size=4),
    "tbq": C.tbq(0.5), "terngrad": C.terngrad(), "cast-bf16": C.cast("bf16"),
}


def compressor_oracle(comp, data, nsteps, mean, w=W):
  """Every worker encodes each slab with its own key and state; the owner sums in rank order."""
  enc = jax.jit(comp.encode)
  decode = jax.jit(comp.decode, static_argnums=1)
  base = jax.random.key(0)
  states = {k: [comp.init((int(np.prod(s)),), key=jax.random.fold_in(base, 1000003 + KEYS.index(k)))
                for _ in range(w)] for k, (s, _) in SHAPES.items()}
  outs = []
  for s in range(nsteps):
    step_key = jax.random.fold_in(base, s)
    out = {}
    for k, (shape, d) in SHAPES.items():
      n = int(np.prod(shape))
      m = n // w
      dec = np.zeros((w, w, m), np.float32)  # [owner, sender]
      for r in range(w):
        g = data[k][r, s].reshape(-1)
        if mean:
          g = np.asarray(exact_div(jnp.asarray(g), w))
        # the state's flat order is the leaf's with the scatter dimension first
        rows = oracle.slab_rows(g, shape, d, w)
        keys = jax.random.split(jax.random.fold_in(jax.random.fold_in(step_key, r), 0), w)
        st = states[k][r]
        new_rows = []
        for o in range(w):
          st_o = jax.tree_util.tree_map(
              lambda a, o=o, m=m: a[o * m:(o + 1) * m] if a.ndim else a, st)
          p, st_o = enc(jnp.asarray(rows[o]), st_o, keys[o])
          new_rows.append(st_o)
          dec[o, r] = np.asarray(decode(p, (m,)))
        states[k][r] = jax.tree_util.tree_map(
            lambda *a: jnp.concatenate(a) if a[0].ndim else a[0], *new_rows)
      acc = dec[:, 0]
      for r in range(1, w):
        acc = (acc + dec[:, r]).astype(np.float32)
      out[k] = acc
    outs.append(out)
  return outs, states


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_compressors_run_sharded_and_match_the_oracle(name, cpu_devices):
  _compressor_matches_the_oracle(COMPRESSORS[name], name)


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("name", list(MORE_COMPRESSORS))
def test_more_compressors_run_sharded_and_match_the_oracle(name, cpu_devices):
  _compressor_matches_the_oracle(MORE_COMPRESSORS[name], name)


def _compressor_matches_the_oracle(comp, name):
  nsteps = 2 if name in ("onebit", "tbq") else 1  # the two with state: a second step uses it
  data = multi_step_data(3, nsteps)
  got = steps(comp, nsteps, data, mean=True)
  want, states = compressor_oracle(comp, data, nsteps, mean=True)
  check_steps(got, want, nsteps)
  for k in SHAPES:
    for r in range(W):
      for a, b in zip(jax.tree_util.tree_leaves(got[1][KEYS.index(k)]),
                      jax.tree_util.tree_leaves(states[k][r]), strict=True):
        assert_same_bits(np.asarray(a)[r], b, f"state {k} worker {r}")
  if name == "onebit":  # a compressor's path under shard_map (one: the collectives are the
    # same for every compressor, and the per-worker code is each compressor's own vmapped code)
    check_steps(steps(comp, nsteps, data, mean=True, runner=run_shard_map), want, nsteps)


@pytest.mark.parametrize("comp,reason", [
    (C.topk(0.25), "top-k selects"), (C.randomk(0.25), "random-k samples"),
    (C.dgc(0.25), "threshold is sampled"), (C.graddrop(0.25), "GradDrop's drop threshold"),
    (C.powersgd(1), "factorises the whole gradient matrix")], ids=str)
def test_global_compressors_are_refused_with_the_reason(comp, reason):
  ok, why = jp.sharded_support(comp)
  assert not ok and reason in why
  with pytest.raises(ValueError, match="cannot run sharded: .*" + reason):
    jp.init_sharded_state(comp, params())
  with pytest.raises(ValueError, match=reason):
    jax.make_jaxpr(jax.vmap(lambda g: jp.compressed_reduce_scatter(
        g, None, "i", comp), axis_name="i"))(jnp.zeros((W, 4)))
  with pytest.raises(ValueError, match=reason):
    jp.sharded_wire_bytes(params(), W, fmt=comp, order="all_to_all")


def test_errors():
  st = jp.init_sharded_state(F.E4M3, params())
  with pytest.raises(ValueError, match="state has 2 leaves"):
    jax.make_jaxpr(jax.vmap(lambda g: jp.compressed_reduce_scatter(g, st, "i", F.E4M3),
                            axis_name="i"))(jnp.zeros((W, 4)))
  with pytest.raises(ValueError, match="error_feedback=True is for format wires"):
    jp.init_sharded_state(C.cgx(), params(), error_feedback=True)
  with pytest.raises(TypeError, match="jaxlp format or a compressor"):
    jp.init_sharded_state("int8", params())
  with pytest.raises(TypeError, match="blocks along an axis"):
    jp.init_sharded_state(F.hbfp(8), params())
  with pytest.raises(TypeError, match="compressor runs only"):
    jp.sharded_wire_bytes(params(), W, fmt=C.cgx())
  with pytest.raises(ValueError, match="collective must be"):
    jp.sharded_wire_bytes(params(), W, collective="all_reduce")
  st1 = jp.init_sharded_state(C.cgx(), {"w": jnp.zeros(8)})
  with pytest.raises(ValueError, match="rounding='stochastic' is for format wires"):
    jax.make_jaxpr(jax.vmap(lambda g: jp.compressed_reduce_scatter(
        g, st1, "i", C.cgx(), rounding="stochastic"), axis_name="i"))(jnp.zeros((W, 8)))


@pytest.mark.parametrize("wire", [C.cgx(bits=4, bucket_size=4), C.onebit(), C.cast("bf16"),
                                  C.terngrad(), F.mx(F.E2M1FN, 4), F.E4M3], ids=str)
def test_wire_bytes_equal_the_traced_collectives(wire):
  import jax.extend  # noqa: F401
  from test_sharded import cpu_mesh  # noqa: F401

  for k, (shape, d) in SHAPES.items():
    st = jp.init_sharded_state(wire, {k: jnp.zeros(shape)})
    got = _traced_bytes(lambda g, st=st, d=d: jp.compressed_reduce_scatter(
        g, st, "i", wire, scatter_dimension=d)[0], jnp.zeros((W,) + shape), W)
    want = jp.sharded_wire_bytes(jax.ShapeDtypeStruct(shape, jnp.float32), W, fmt=wire,
                                 order="all_to_all", scatter_dimension=d)
    assert got == want, (k, got, want)


# XLA's optimizations off (tests/conftest.py, fast_compile): the finite steps repeat the claims
# of test_error_feedback_matches_the_oracle_over_steps[int4-blocks] (this wire, error feedback,
# vmap == oracle) and [mxfp4] (shard_map), and of test_compressors_run_sharded_and_match_the_
# oracle[onebit] (1-bit, vmap and shard_map), compiled normally; the bad step's leaf is NaN and
# its state is kept at any level.
@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("wire, ef", [(F.BlockFormat(3, axis=-1, block_size=3), True),
                                      (C.onebit(), False)], ids=["int4-blocks-ef", "onebit"])
def test_nonfinite_gradients_nan_the_leaf_and_keep_the_state(wire, ef, cpu_devices):
  """psum's non-finite policy: a NaN or ±inf in any worker's leaf makes the whole leaf NaN in
  every slab at that step (an unrelated leaf is unchanged) and leaves its state (error-feedback
  residual, 1-bit's residual) as before the step, so the next step equals the run without the
  bad step (numpy oracle); vmap and shard_map give the same bits (for the format wire with
  error feedback; 1-bit's path under shard_map: test_compressors_run_sharded_and_match_...)."""
  nsteps = 3
  data = multi_step_data(4, nsteps)
  data["w"][1, 1, 2, 0] = np.inf  # worker 1, step 1, leaf "w"
  data["w"][3, 1, 5, 2] = -np.inf if isinstance(wire, F.BlockFormat) else np.nan
  got = steps(wire, nsteps, data, error_feedback=ef, mean=True)
  finite = {k: v.copy() for k, v in data.items()}
  finite["w"][:, 1] = 0.0
  skipped = {k: np.delete(v, 1, axis=1) for k, v in data.items()}  # "w" without step 1
  if hasattr(wire, "aggregation"):
    want_v, st_v = compressor_oracle(wire, finite, nsteps, mean=True)
    want_w, st_w = compressor_oracle(wire, skipped, nsteps - 1, mean=True)
  else:
    want_v, st_v = format_oracle(wire, finite, nsteps, error_feedback=ef, mean=True)
    want_w, st_w = format_oracle(wire, skipped, nsteps - 1, error_feedback=ef, mean=True)
  outs = got[0]
  for s in range(nsteps):
    assert_same_bits(np.asarray(outs[s]["v"]).reshape(W, -1), want_v[s]["v"], f"v step {s}")
  assert np.all(np.isnan(np.asarray(outs[1]["w"])))
  for s, s_ref in ((0, 0), (2, 1)):
    assert_same_bits(np.asarray(outs[s]["w"]).reshape(W, -1), want_w[s_ref]["w"], f"w step {s}")
  for k, st in (("v", st_v), ("w", st_w)):
    mine = got[1][KEYS.index(k)]
    if ef:
      assert_same_bits(mine["residual"], st[k], f"residual {k}")
    elif hasattr(wire, "aggregation"):
      for r in range(W):
        for a, b in zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(st[k][r]),
                        strict=True):
          assert_same_bits(np.asarray(a)[r], b, f"state {k} worker {r}")
  if ef:
    sm = steps(wire, nsteps, data, error_feedback=ef, mean=True, runner=run_shard_map)
    for a, b in zip(jax.tree_util.tree_leaves(sm[:2]), jax.tree_util.tree_leaves(got[:2]),
                    strict=True):
      assert_same_bits(np.asarray(a), np.asarray(b), "shard_map vs vmap")
