"""The sparse selection without a full top_k (issue 14, item 5) selects the same elements.

``ref_select`` / ``ref_threshold`` are the previous implementations (a ``lax.top_k`` over all n
elements; a sorted sample). The new path may list the (idx, val) pairs in another order (the
decode is a scatter of distinct indices), so payloads are compared as sets; decoded values and
residuals bit for bit.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxlp.parallel.compressors as C
from jaxlp.parallel.compressors._base import (
  _FAST_MIN,
  sample_threshold,
  select_sparse,
  sparse_decode,
  zero_at,
)

N = _FAST_MIN + 7000  # above the size where the compaction path starts, not a multiple of 32


def ref_threshold(mag, key, keep, sample_rate):
  n = mag.shape[0]
  cnt = max(1, math.ceil(n * sample_rate))
  idx = jax.random.randint(key, (cnt,), 0, n)
  samples = -jnp.sort(-mag[idx])
  pos = jnp.minimum(jnp.floor(cnt * jnp.asarray(keep, jnp.float32)).astype(jnp.int32), cnt - 1)
  return samples[pos]


def ref_select(values, mag, thr, k_cap, k_now=None):
  n = values.shape[0]
  cand = jnp.where(mag > thr, mag, -1.0)
  top, idx = lax.top_k(cand, k_cap)
  valid = top >= 0
  if k_now is not None:
    valid = valid & (jnp.arange(k_cap) < k_now)
  idx = jnp.where(valid, idx, n).astype(jnp.int32)
  val = jnp.where(valid, values[jnp.minimum(idx, n - 1)], 0.0).astype(jnp.float32)
  return {"count": jnp.sum(valid, dtype=jnp.int32).reshape(1), "idx": idx, "val": val}, idx


def _both(v, thr, k_now, k_cap, exact, with_k_now, impl):
  kn = k_now if with_k_now else None
  t = -1.0 if exact else thr
  a = ref_select(v, jnp.abs(v), t, k_cap, kn)
  b = select_sparse(v, None, t, k_cap, kn, impl=impl)
  n = v.shape[0]
  return (a[0], b[0], sparse_decode(a[0], n), sparse_decode(b[0], n), zero_at(v, a[1]),
          zero_at(v, b[1]))


# (k_cap, exact, with k_now): exact top-k (TopK; sample_rate=None) at a small and a large
# k_cap, exact with a k_now (DGC's warm-up, which may keep none), thresholded without and with
# a k_now; all in one jitted program per schedule (one compile: most of the time here is
# XLA's per-program cost), run once per (threshold, k_now) pair
VARIANTS = ((9, True, False), (400, True, False), (400, True, True), (400, False, False),
            (400, False, True))


@functools.partial(jax.jit, static_argnums=4)
def _all(v, thr, k_exact, k_thr, impl):
  return [_both(v, thr, k_exact if exact else k_thr, k_cap, exact, with_k, impl)
          for k_cap, exact, with_k in VARIANTS]


def _pairs(p):
  idx, val = np.asarray(p["idx"]), np.asarray(p["val"])
  o = np.argsort(idx, kind="stable")
  return int(p["count"][0]), idx[o].tobytes(), val[o].tobytes()


def _check_all(v, thr, k_exact, k_thr, impl):
  """Every variant at a threshold, a k_now for the exact and one for the thresholded
  selection; returns the indices the new path selected per variant."""
  got = []
  for (a, b, da, db, ra, rb), var in zip(_all(v, jnp.float32(thr), jnp.int32(k_exact),
                                              jnp.int32(k_thr), impl), VARIANTS, strict=True):
    assert _pairs(a) == _pairs(b), (thr, k_exact, k_thr, var)
    assert np.asarray(da).tobytes() == np.asarray(db).tobytes(), (thr, var)
    assert np.asarray(ra).tobytes() == np.asarray(rb).tobytes(), (thr, var)
    got.append(np.asarray(b["idx"])[:int(b["count"][0])])
  return got


def _inputs():
  rng = np.random.default_rng(0)
  yield "normal", rng.standard_normal(N)
  yield "ints", rng.integers(-5, 6, N)  # massive ties, also at every threshold
  yield "equal", np.full(N, 0.5)
  yield "zeros", np.zeros(N)
  yield "sparse", rng.standard_normal(N) * (rng.random(N) < 0.004)  # fewer nonzeros than k
  yield "nan_inf", np.where(rng.random(N) < 0.01, np.nan,
                            np.where(rng.random(N) < 0.002, -np.inf, rng.standard_normal(N)))


def test_selection_equals_full_top_k():
  """The platform's schedule of the compaction path (on CPU, None is "cpu"), compiled as in
  production, on every input family."""
  _selection_equals_full_top_k(None)


# "gpu": what a GPU compiles (a sort instead of the bisection, no conditional around it);
# "radix": no candidate buffer, no conditional at all. The new path and the full top_k are
# compared within one program (integer selections, no arithmetic that XLA's optimization
# level changes): XLA's optimizations off; the platform's schedule, compiled normally, above
@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("impl", ["gpu", "radix"], ids=["gpu_schedule", "radix_schedule"])
def test_selection_on_the_other_schedules_equals_full_top_k(impl):
  _selection_equals_full_top_k(impl)


def _selection_equals_full_top_k(impl):
  """The schedule ``impl`` of the compaction path on every input family."""
  k_cap = 400
  for name, x in _inputs():
    v = jnp.asarray(x.astype(np.float32))
    mags = np.sort(np.nan_to_num(np.abs(np.asarray(v)), nan=0.0))[::-1]
    key = jax.random.key(k_cap)
    thr = sample_threshold(jnp.abs(v), key, k_cap / N, 0.01)
    want = ref_threshold(jnp.abs(v), key, k_cap / N, 0.01)
    assert np.asarray(thr).tobytes() == np.asarray(want).tobytes() or (
      np.isnan(thr) and np.isnan(want)), name
    # sampled, crafted: at the k-th magnitude (ties at the threshold), just above it (count ==
    # k_cap or fewer), 0, and so low that the candidates overflow the buffer (fallback); the
    # exact selection with k_now = k_cap // 3 and 0 alternating
    for i, t in enumerate((thr, mags[k_cap], mags[k_cap - 1], 0.0,
                           mags[min(N - 1, 5 * k_cap + 2000)])):
      got = _check_all(v, t, (k_cap // 3, 0)[i % 2], k_cap // 2, impl)
      if name == "normal":  # the compaction path was taken: ascending indices
        for g, k in zip(got[:2], (9, k_cap), strict=True):
          assert (np.diff(g) > 0).all() and len(g) == k


def test_sampled_threshold_nan_and_traced_keep():
  x = np.random.default_rng(1).standard_normal(N).astype(np.float32)
  x[::50] = np.nan  # 2% NaN: positions past the non-NaN samples give NaN, as the sort did
  mag, key = jnp.abs(jnp.asarray(x)), jax.random.key(3)
  for keep in (0.01, 0.97, 1.0):
    a, b = sample_threshold(mag, key, keep, 0.01), ref_threshold(mag, key, keep, 0.01)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes() or (np.isnan(a) and np.isnan(b))
  traced = jax.jit(lambda m, k: sample_threshold(m, key, k, 0.01))(mag, jnp.float32(0.25))
  assert traced == ref_threshold(mag, key, 0.25, 0.01)


def test_sparsifiers_under_vmap_match_per_worker():
  """vmap (the engine's emulated workers) turns the lax.cond into a select: same bits."""
  rng = np.random.default_rng(2)
  xs = jnp.asarray(rng.standard_normal((2, N)).astype(np.float32))
  xs = xs.at[1, :N // 2].set(0.0)
  for comp in (C.topk(0.01), C.graddrop(0.99)):  # DGC: the same selection as GradDrop
    st = comp.init((N,))
    key = jax.random.key(5)
    enc = lambda x, comp=comp, st=st, key=key: comp.encode(x, st, key)  # noqa: E731
    # worker i alone and the batch in one program (one compile)
    run = jax.jit(lambda xs, i, enc=enc: (enc(xs[i]), jax.vmap(enc)(xs)))
    for i in range(2):
      (p, s), batched = run(xs, i)
      pb = jax.tree_util.tree_map(lambda a, i=i: a[i], batched)
      assert _pairs(p) == _pairs(pb[0])
      for a, b in zip(jax.tree_util.tree_leaves(s), jax.tree_util.tree_leaves(pb[1]),
                      strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("make", [lambda: C.topk(0.01), lambda: C.dgc(0.01, sample_rate=0.05),
                                  lambda: C.dgc(0.01, sample_rate=0.05, schedule="radix")],
                         ids=["topk", "dgc", "dgc_radix"])
def test_pieces_are_encoded_one_at_a_time_with_the_bits_of_each_piece(make):
  """A SeCoPa plan cuts a leaf into pieces; the sparsifiers (a lax.cond in their encoder) are
  encoded one piece at a time (lax.map) instead of under vmap, which ran both branches; on
  the "radix" schedule (no conditional) under vmap. Each piece's payload and state equal that
  piece encoded on its own. (GradDrop: DGC's thresholded selection without momentum, the same
  lax.map path.)"""
  from jaxlp.parallel import _aggregate as A  # noqa: PLC0415
  comp = make()
  assert comp._encode_branches == (comp.schedule != "radix")
  n, k = 3 * N + 5, 3
  x = jnp.asarray(np.random.default_rng(7).standard_normal(n).astype(np.float32))
  st = comp.init((n,))
  key = jax.random.key(3)

  @jax.jit  # the pieces together and piece i alone in one program (one compile)
  def run(x, st, i):
    payload, new, c = A._encode_pieces(comp, x, st, key, k)  # c: the piece length
    xs = A._pad_edge(x, k * c).reshape(k, c)
    one = jax.tree_util.tree_map(lambda a: a[i], A._split_state(st, k, c, n))
    return payload, new, comp.encode(xs[i], one, jax.random.split(key, k)[i])

  states = []
  for i in range(k):
    payload, new, (p, s) = run(x, st, i)
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(payload), strict=True):
      assert np.asarray(a).tobytes() == np.asarray(b[i]).tobytes()
    states.append(s)
  want = A._join_state(jax.tree_util.tree_map(lambda *a: jnp.stack(a), *states), n)
  for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(new), strict=True):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _data_dependent_conditionals(text):
  """``stablehlo.case`` ops of a lowering less those of ``lax.platform_dependent`` (a case
  on a constant platform index and the case on its result, both folded by XLA)."""
  return text.count("stablehlo.case") - 2 * text.count('stablehlo.case"(%c')


@pytest.mark.parametrize("make", [lambda: C.topk(0.01), lambda: C.dgc(0.01),
                                  lambda: C.graddrop(0.99)], ids=["topk", "dgc", "graddrop"])
def test_the_gpu_schedule_is_what_cuda_compiles(make):
  """Dispatch follows the platform: the CUDA lowering of a sparsifier's round trip has no
  loop and one data-dependent conditional (the rare fallback to the full top_k) and sorts
  the candidates; the CPU lowering keeps the bisection loop and its conditional."""
  comp = make()
  n = 1 << 20
  st = comp.init((n,))
  f = jax.jit(lambda x, st: comp.decode(comp.encode(x, st, jax.random.key(0))[0], (n,)))
  traced = f.trace(jax.ShapeDtypeStruct((n,), jnp.float32), st)
  low = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda")}
  assert low["cuda"].count("stablehlo.while") == 0
  assert _data_dependent_conditionals(low["cuda"]) == 1
  assert low["cuda"].count("stablehlo.sort") == 1
  assert low["cpu"].count("stablehlo.while") >= 1 and "stablehlo.sort" not in low["cpu"]
  assert _data_dependent_conditionals(low["cpu"]) == 2


def test_the_radix_schedule_has_no_loop_no_conditional_no_sort():
  """What "radix" adds: the CUDA lowering of a top-k and a thresholded selection holds no
  data-dependent conditional (the fallback), no loop and no sort, whatever the platform."""
  n = 1 << 20

  def f(x, t, kn):
    return (select_sparse(x, None, -1.0, 10486, impl="radix")[0],
            select_sparse(x, None, t, 10486, kn, impl="radix")[0])

  traced = jax.jit(f).trace(jax.ShapeDtypeStruct((n,), jnp.float32),
                            jax.ShapeDtypeStruct((), jnp.float32),
                            jax.ShapeDtypeStruct((), jnp.int32))
  for p in ("cpu", "cuda"):
    text = traced.lower(lowering_platforms=(p,)).as_text()
    assert _data_dependent_conditionals(text) == 0, p
    assert "stablehlo.while" not in text and "stablehlo.sort" not in text, p


def test_unknown_schedule_is_refused():
  x = jnp.zeros(N, jnp.float32)
  with pytest.raises(ValueError, match="impl='tpu'"):
    select_sparse(x, None, -1.0, 9, impl="tpu")
  for make in (C.topk, C.dgc, C.graddrop):
    with pytest.raises(ValueError, match="schedule='tpu'"):
      make(schedule="tpu")


@pytest.mark.parametrize("make", [lambda s: C.topk(0.01, schedule=s),
                                  lambda s: C.dgc(0.01, sample_rate=0.05, warmup=2, schedule=s),
                                  lambda s: C.graddrop(0.99, sample_rate=0.05, schedule=s)],
                         ids=["topk", "dgc_warmup", "graddrop"])
def test_a_compressor_on_the_radix_schedule_keeps_the_bits(make):
  """Three steps of each sparsifier, default schedule against "radix": the same decoded
  gradients and error-feedback state, bit for bit (DGC's warm-up: a traced k)."""
  x = jnp.asarray(np.random.default_rng(8).standard_normal(N).astype(np.float32))
  comps = [make(sched) for sched in (None, "radix")]

  @jax.jit  # a step of both schedules in one program (one compile)
  def step(x, sts):
    out = []
    for comp, st in zip(comps, sts, strict=True):
      p, st = comp.encode(x, st, jax.random.key(2))
      out.append((comp.decode(p, (N,)), st))
    return out

  sts = [comp.init((N,)) for comp in comps]
  runs = [([], []) for _ in comps]
  for i in range(3):
    res = step(x * (i + 1), sts)
    sts = [st for _, st in res]
    for r, (d, _) in zip(runs, res, strict=True):
      r[0].append(np.asarray(d).tobytes())
  for r, st in zip(runs, sts, strict=True):
    r[1].extend(np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(st))
  assert runs[0] == runs[1]


# integer selections of one program compared with each other (no arithmetic that XLA's
# optimization level changes): XLA's optimizations off; a sparsifier under vmap against its
# per-worker selection, compiled normally: test_sparsifiers_under_vmap_match_per_worker
@pytest.mark.usefixtures("fast_compile")
def test_every_schedule_under_vmap_matches_per_row():
  """Under vmap (the engine's emulated workers) each schedule ("cpu", "gpu", "radix") selects
  per row what it selects alone (the fallback's conditional becomes a select there); every
  schedule and the references in one program (one compile)."""
  rng = np.random.default_rng(4)
  xs = rng.standard_normal((3, N)).astype(np.float32)
  xs[1, : N // 2] = 0.0  # fewer candidates than k above a low threshold
  xs[2] = np.round(xs[2])  # ties at the k-th magnitude
  xs = jnp.asarray(xs)
  thr = jnp.asarray([0.5, 0.0, 1.0], jnp.float32)
  k_now = jnp.asarray([400, 150, 0], jnp.int32)

  def one(x, t, kn, impl):
    return (select_sparse(x, None, -1.0, 400, kn, impl=impl)[0],
            select_sparse(x, None, t, 400, kn, impl=impl)[0])

  def run(xs, thr, k_now):
    batched = {impl: jax.vmap(functools.partial(one, impl=impl))(xs, thr, k_now)
               for impl in ("cpu", "gpu", "radix")}
    want = [[ref_select(xs[i], jnp.abs(xs[i]), t, 400, k_now[i])[0] for t in (-1.0, thr[i])]
            for i in range(3)]
    return batched, want

  batched, want = jax.jit(run)(xs, thr, k_now)
  for impl, b2 in batched.items():
    for i in range(3):
      for b, r in zip(b2, want[i], strict=True):
        assert _pairs(jax.tree_util.tree_map(lambda a, i=i: a[i], b)) == _pairs(r), (impl, i)
