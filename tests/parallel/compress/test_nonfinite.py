"""The non-finite policy of every reduction (jaxlp/parallel/_compressed.py's module docstring).

For all 11 compressors (both 16-bit casts), per leaf (fp16 also with ``bucket_mb`` fusion),
under a named ``vmap``, and for variants with their own overflow-free code paths (CGX's 1-bit
ring and stochastic all-gather, 1-bit's two means, TernGrad's clipping and HiPress variant,
DGC's clipping; the all-gather and the two means bucketed); under ``shard_map`` over 4 of the
8 forced CPU devices (W = 4), per leaf and bucketed, for one compressor per collective pattern
(CGX's SRA: all_to_all + all_gather; TopK: all_gather of sparse pairs; bf16: the ring of
ppermutes). The policy's cross-worker step (the finite flags of the units,
all-gathered) is the same code for every compressor, and vmap and shard_map give the same bits
for every compressor in test_compress_allreduce.py::test_identical_on_workers_and_vmap_...:

* a NaN, +inf or -inf in ONE worker's leaf makes the whole unit (the leaf; with
  ``bucket_mb`` the fused bucket) NaN on every worker and leaves the unit's state (random
  non-zero residuals, momenta, PowerSGD's Q and error) bit for bit as it was, with the next
  count; the other leaf's result and state (per leaf) are those of the step without the bad
  value. The next finite step then gives what it gives from the old state: every step is a
  pure function of the state, the count and the gradients.
* finite gradients of ±3e38 (the same on every worker, so the true mean is up to ±3e38; or
  random signs per worker) and of ``2**100`` times normal data give finite, not all-zero
  results and finite states on every worker, the elementwise compressors with the mean's
  sign -- except where a format cannot hold the value (fp16, also for 1e18) or PowerSGD's
  unscaled products overflow: then a NaN unit with its state kept (the policy).
* finite ordinary inputs (normal data, times 1e18 and 1e-30) keep the bits of the code
  before the policy (digests recorded from commit c057d97; see GOLDEN for the entries that
  now run per leaf only).

One jitted program per group of entries (GROUPS) and mode runs every input family (an unnamed
``vmap`` over the cases) for each entry's bucketings. ``psum`` and ``reduce_gradients``
without a compressor follow the same rule (one case each). The state checks of
``compressed_allreduce`` (a state of the wrong type, of another compressor, of other shapes)
raise one clear error.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxlp.parallel.compressors as C
from jaxlp import formats as F
from jaxlp import parallel as PL
from jaxlp.parallel import compressed_allreduce, init_compression_state

W = 4
# name -> (compressor, engine options): the 11 compressors (both 16-bit casts), then variants
# whose overflow-free code paths differ (bucketed when "bucket_mb" is given); the modes and
# bucketings each runs in: SHARD_MAP, BUCKETED and _bucketings below
ENTRIES = {
    "cgx": (C.cgx(4, 64), {}), "qsgd": (C.qsgd(15, 64), {}),
    "onebit": (C.onebit(), {}), "tbq": (C.tbq(0.5), {}),
    "terngrad": (C.terngrad(), {}), "topk": (C.topk(0.1), {}),
    "randomk": (C.randomk(0.25), {}),
    "dgc": (C.dgc(0.1, sample_rate=0.5), {}),
    "graddrop": (C.graddrop(0.8, sample_rate=0.5), {}),
    "powersgd": (C.powersgd(2), {}), "bf16": (C.cast("bf16"), {}),
    "fp16": (C.cast("fp16"), {}),
    "cgx1_ring": (C.cgx(1, 50), dict(algorithm="ring")),
    "cgx3_stochastic_allgather": (C.cgx(3, 50, stochastic=True),
                                  dict(algorithm="allgather", bucket_mb=0.01)),
    "onebit_pos_neg": (C.onebit("pos_neg_means"), dict(bucket_mb=0.01)),
    "terngrad_clip": (C.terngrad(clip=2.5), {}),
    "terngrad_hipress1": (C.terngrad("hipress", 1), dict(algorithm="allgather")),
    "dgc_clip": (C.dgc(0.1, clip=1.0, sample_rate=0.5), {}),
}
# the entries also run under shard_map (module docstring: one per collective pattern)
SHARD_MAP = ("cgx", "topk", "bf16")
# fused into a bucket (bucket_mb) under vmap as well: the unit rule (a bad value or an
# overflow NaNs the whole bucket and keeps its state) is the engine's, the same code for every
# compressor; fp16 is the one entry whose finite inputs overflow the format inside a bucket.
# The other families' buckets: under shard_map (cgx, topk, bf16) and the variants with their
# own bucket_mb (cgx3_stochastic_allgather, onebit_pos_neg); a bucket is one more encode per
# program, most of an entry's compile time
BUCKETED = ("fp16",)
# finite cases that may overflow (then a NaN unit, the policy): fp16 cannot hold 1e18 or
# 3e38; PowerSGD's sums M Q over a row and over the workers are not divided by W
MAY_OVERFLOW = {"fp16": {"large", "big_same", "big_random", "huge"},
                "powersgd": {"big_same", "big_random"}}
# big_random's magnitudes are all 3e38 (+ the state's ~1, lost in rounding): a threshold that
# sends only |v| > thr (DGC's and GradDrop's rule, as HiPress) sends none of the ties
TIES = ("dgc", "graddrop", "dgc_clip")
SHAPES = {"a": (16, 12), "b": (10, 20)}
BAD_AT = (1, 3, 5)  # worker, row, column of leaf "a"
# finite cases (the first three: their bits are compared with the code before the policy;
# 1e18 comes near QSGD's squares' overflow, 1e-30 goes deep into the subnormals), one bad
# value in one worker, ±3e38 (the same on every worker: the true mean is ±3e38; random
# signs per worker), and 2**100 times the data (sums of squares overflow float32)
CASES = ["clean", "large", "small", "nan", "+inf", "-inf", "big_same", "big_random", "huge"]
ORDINARY = ("clean", "large", "small")
SCALED = {"large": 1e18, "small": 1e-30, "huge": 2.0 ** 100}  # both leaves scaled
BAD = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
OPTS = dict(min_size=1, skip_vectors=False)


def _bucketings(name, mode):
  """{label: bucket_mb} of an entry in a mode (0.01 MB holds both leaves): per leaf, and
  fused into one bucket under shard_map and for the entries in BUCKETED (under vmap) or with
  their own ``bucket_mb``."""
  kw = ENTRIES[name][1]
  if "bucket_mb" in kw:
    return {"bucket": kw["bucket_mb"]}
  if mode == "shard_map" or name in BUCKETED:
    return {"per_leaf": None, "bucket": 0.01}
  return {"per_leaf": None}


def _inputs(seed):
  """The gradients per case (case axis first, then workers)."""
  rng = np.random.default_rng(seed)
  g = {k: rng.standard_normal((W,) + s).astype(np.float32) for k, s in SHAPES.items()}
  first = {k: np.repeat(v[None], len(CASES), axis=0) for k, v in g.items()}
  a = first["a"]
  big = np.where(rng.random((W,) + SHAPES["a"]) < 0.5, 3e38, -3e38).astype(np.float32)
  for c, name in enumerate(CASES):
    if name in BAD:
      a[c][BAD_AT] = BAD[name]
    elif name in SCALED:
      a[c] *= np.float32(SCALED[name])
      first["b"][c] *= np.float32(SCALED[name])
    elif name == "big_same":
      a[c] = big[0][None] * np.float32(rng.uniform(0.5, 1.0, SHAPES["a"]))
    elif name == "big_random":
      a[c] = big
  return {k: jnp.asarray(v) for k, v in first.items()}


def _program(names, mode):
  """``run(first, states)`` (dicts by entry name): per entry and bucketing, one step on every
  case (an unnamed vmap) from the same state, all entries in one jitted program (one compile:
  XLA's per-program cost is most of these tests' time). Results have a leading worker axis,
  then the case axis."""

  def worker(first, states):
    res = {}
    for name in names:
      comp, kw = ENTRIES[name]
      kw = {k: v for k, v in kw.items() if k != "bucket_mb"}
      res[name] = {}
      for label, bmb in _bucketings(name, mode).items():
        step = functools.partial(compressed_allreduce, state=states[name][label],
                                 axis_name="w", compressor=comp, bucket_mb=bmb, **OPTS, **kw)
        res[name][label] = jax.vmap(lambda g, step=step: step(g))(first[name])
    return res

  if mode == "vmap":
    return jax.jit(jax.vmap(worker, in_axes=(1, 0), axis_name="w"))
  mesh = jax.make_mesh((W,), ("w",), devices=jax.devices("cpu")[:W])

  def body(first, states):
    first = jax.tree_util.tree_map(lambda a: a[:, 0], first)
    states = jax.tree_util.tree_map(lambda a: a[0], states)
    return jax.tree_util.tree_map(lambda a: a[None], worker(first, states))

  specs = (P(None, "w"), P("w"))
  sm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("w"),
                             check_vma=False))

  def run(*args):
    return sm(*(jax.device_put(a, jax.sharding.NamedSharding(mesh, p))
                for a, p in zip(args, specs, strict=True)))
  return run


def _states(name, mode, seed):
  """Initial states per bucketing, per worker, with random non-zero float arrays (residuals,
  momenta, PowerSGD's Q and error: the error-feedback paths are exercised)."""
  comp = ENTRIES[name][0]
  rng = np.random.default_rng(seed)
  out = {}
  for label, bmb in _bucketings(name, mode).items():
    st = init_compression_state(comp, {k: jnp.zeros(s) for k, s in SHAPES.items()},
                                bucket_mb=bmb, **OPTS)
    st = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (W,) + a.shape), st)

    def rand(a):
      if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.asarray(rng.standard_normal(a.shape).astype(np.float32))
      return a
    out[label] = st._replace(leaves=jax.tree_util.tree_map(rand, st.leaves),
                             buckets=jax.tree_util.tree_map(rand, st.buckets))
  return out


def _np(tree):
  return [np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                     else a) for a in jax.tree_util.tree_leaves(tree)]


def _same_bits(x, y, what):
  for a, b in zip(_np(x), _np(y), strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.dtype.kind == "f":
      a, b = a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")
    np.testing.assert_array_equal(a, b, err_msg=what)


def _case(tree, c):
  return jax.tree_util.tree_map(lambda a: a[c], tree)


def _cases_first(tree):
  return jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), tree)


def run_entries(names, mode):
  """Per entry name: the program's results, cases first ({bucketing: (outputs, states)}), the
  inputs and the initial states."""
  first = {n: _inputs(seed=len(n)) for n in names}
  states = {n: _states(n, mode, seed=len(n) + 1) for n in names}
  res = _program(names, mode)(first, states)
  return {n: ({k: tuple(_cases_first(t) for t in v) for k, v in res[n].items()}, first[n],
              states[n]) for n in names}


def finite_digest(name, res):
  """sha256 (16 hex digits) of the results and states of the ordinary finite cases that the
  entry's formats can hold."""
  import hashlib  # noqa: PLC0415

  cases = [CASES.index(c) for c in ORDINARY if c not in MAY_OVERFLOW.get(name, ())]
  h = hashlib.sha256()
  for label in sorted(res):
    for a in _np(jax.tree_util.tree_map(lambda a: a[np.asarray(cases)], res[label])):
      h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()[:16]


# finite_digest under vmap, recorded from the code before the non-finite policy and the
# overflow-free ranges and norms (commit c057d97): where nothing overflows, not a bit changed.
# The entries that are no longer bucketed under vmap (all but fp16 and the variants): the
# digest of their per-leaf results, taken at 853e50f + c547b03 from the program whose per-leaf
# and bucketed results still gave the c057d97 digest
GOLDEN = {
    "cgx": "fb7286e8950a7472",
    "qsgd": "58a88ebb029ea2b7",
    "onebit": "88f6cdb761d700b9",
    "tbq": "f59d234a825b966e",
    "terngrad": "f65452ab613fd279",
    "topk": "f28518950d568254",
    "randomk": "e1c7033a9e06e682",
    "dgc": "ff8e12af35a22f0f",
    "graddrop": "a07b41ecf65d9ee5",
    "powersgd": "5e319d3675e47f12",
    "bf16": "4524c367166f711f",
    "fp16": "9adddfb436027565",
    "cgx1_ring": "337ab90555d54038",
    "cgx3_stochastic_allgather": "02422d9a502915cb",
    "onebit_pos_neg": "73557939cd531710",
    "terngrad_clip": "ff0cc8d89c964ebe",
    "terngrad_hipress1": "da0c73b367676bd7",
    "dgc_clip": "11079031db3636d8",
}


# the entries in one program per group (families with shared code together, the groups of
# about equal compile time): every entry and mode as before, 5 compiles instead of 21
GROUPS = {
    "cgx": ("cgx", "cgx1_ring", "cgx3_stochastic_allgather"),
    "qsgd_powersgd": ("qsgd", "powersgd"),
    "onebit_tbq_terngrad": ("onebit", "onebit_pos_neg", "tbq", "terngrad", "terngrad_clip",
                            "terngrad_hipress1"),
    "sparse_casts": ("topk", "randomk", "dgc", "dgc_clip", "graddrop", "bf16", "fp16"),
}


def test_groups_hold_every_entry_once():
  assert sorted(n for g in GROUPS.values() for n in g) == sorted(ENTRIES)


@pytest.mark.parametrize("group", list(GROUPS))
def test_nonfinite_policy(group, cpu_devices):
  """Under vmap, compiled normally: the GOLDEN digests are of normally compiled programs."""
  del cpu_devices
  for name, (res, first, states) in run_entries(GROUPS[group], "vmap").items():
    _check_entry(name, "vmap", res, first, states)


# under shard_map: no digest; every check compares results and states of the same program
# (or with the initial states, or NaN and finiteness): XLA's optimizations off (vmap ==
# shard_map for every compressor, compiled normally: test_compress_allreduce.py)
@pytest.mark.usefixtures("fast_compile")
def test_nonfinite_policy_under_shard_map(cpu_devices):
  del cpu_devices
  for name, (res, first, states) in run_entries(SHARD_MAP, "shard_map").items():
    _check_entry(name, "shard_map", res, first, states)


def _check_entry(name, mode, res, first, states):
  if mode == "vmap":
    assert finite_digest(name, res) == GOLDEN[name], "ordinary finite inputs changed bits"
  ia, ib = 0, 1  # leaf numbers (tree order)
  for label, (o1, s1) in res.items():
    s0 = states[label]
    clean_out, clean_st = _case(o1, 0), _case(s1, 0)
    for a in _np(o1):  # every worker holds the same bits
      for c in range(len(CASES)):
        _same_bits(a[c], np.broadcast_to(a[c][0], a[c].shape), f"{name} {label} workers")
    for c, case in enumerate(CASES):
      what = f"{name} {mode} {label} {case}"
      out, st = _case(o1, c), _case(s1, c)
      out = {k: np.asarray(v) for k, v in out.items()}
      _same_bits(st.count, s0.count + 1, what + " count")
      _same_bits(st.key, s0.key, what + " key")
      if case in BAD or (case in MAY_OVERFLOW.get(name, ()) and not np.isfinite(out["a"]).all()):
        # the unit is NaN everywhere and its state the old one (so is the next step's result)
        assert np.isnan(out["a"]).all(), what
        if label == "bucket" or case in SCALED:  # (SCALED scales both leaves)
          assert np.isnan(out["b"]).all(), what
          _same_bits(st.leaves, s0.leaves, what + " state")
          _same_bits(st.buckets, s0.buckets, what + " bucket state")
        else:  # leaf "b" as in the clean step, leaf "a"'s state unchanged
          _same_bits(out["b"], clean_out["b"], what + " other leaf")
          _same_bits(st.leaves[ib], clean_st.leaves[ib], what + " other state")
          _same_bits(st.leaves[ia], s0.leaves[ia], what + " state")
      else:
        for k in ("a", "b"):
          assert np.isfinite(out[k]).all(), what
        for a in _np(st):  # no residual overflowed
          if a.dtype.kind == "f":
            assert np.isfinite(a).all(), what
        if case in ("big_same", "huge") or (case == "big_random" and name not in TIES):
          assert (out["a"] != 0).any(), what  # no range or norm lost the values
        if case == "big_same" and name not in ("dgc_clip", "powersgd"):  # (dgc_clip: clipped
          # to norm 1, the momentum of the random initial state decides the signs; PowerSGD:
          # a rank-2 approximation)
          # the true mean is up to ±3e38: what is sent has the mean's sign
          got, want = out["a"][0], np.asarray(first["a"][c][0])
          nz = got != 0
          assert nz.any() and (np.sign(got[nz]) == np.sign(want[nz])).mean() > 0.9, what


@pytest.mark.usefixtures("fast_compile")
def test_powersgd_normalizes_without_overflow():
  """PowerSGD is scale-equivariant, so gradients times ``2**100`` (the sums of squares of the
  P and Q columns overflow float32; ``orthogonalize`` scales such a column by ``2**-100``)
  give the results and states of the plain gradients times ``2**100``, bit for bit, over two
  steps (the second warm-starts from the scaled Q). Before, the overflowing norms made P
  zero: a finite, all-zero result."""
  s = np.float32(2.0 ** 100)
  rng = np.random.default_rng(7)
  g = [rng.standard_normal((W,) + SHAPES["a"]).astype(np.float32) for _ in range(2)]
  comp = C.powersgd(2)

  def worker(g1, g2):
    st = init_compression_state(comp, jnp.zeros(SHAPES["a"]), **OPTS)
    for g in (g1, g2):
      out, st = compressed_allreduce(g, st, "w", comp, **OPTS)
    return out, st.leaves

  # the case axis (plain, scaled) outside the worker axis
  run = jax.jit(jax.vmap(jax.vmap(worker, axis_name="w")))
  res = run(*[jnp.asarray(np.stack([v, v * s])) for v in g])
  for a, b in zip(_np(_case(res, 0)), _np(_case(res, 1)), strict=True):
    if a.dtype.kind == "f":  # the result, the error, Q
      assert np.isfinite(a).all() and (a != 0).any()
      _same_bits(b, a * s, "scaled")
    else:  # the iteration count
      _same_bits(b, a, "count")


@pytest.mark.usefixtures("fast_compile")
def test_orthogonalize_keeps_nan_and_scales_huge_columns():
  """A column with a NaN or inf gives NaN (it used to become a zero column when its norm was
  NaN); a finite column whose sum of squares overflows is normalised as the same column
  times ``2**-100`` (so columns times ``2**100`` give the plain columns' bits); a zero column
  stays zero."""
  x = np.array([[3.0, 1.0], [-3.0, 2.0], [1.0, 0.5]], np.float32)
  s = np.float32(2.0 ** 100)
  cases = np.stack([x, x * np.array([s, 1], np.float32), x * s, x, x, x])
  cases[3, :, 0] = np.nan
  cases[4, 1, 1] = np.inf
  cases[5, :, 1] = 0
  o = np.asarray(jax.jit(jax.vmap(C.orthogonalize))(cases))
  for c in (1, 2):  # the columns times 2**100 are scaled back exactly: the same bits
    _same_bits(o[c], o[0], "scaled columns")
  assert np.isfinite(o[:3]).all() and np.isnan(o[3]).all()
  assert np.isnan(o[4][:, 1]).all() and np.isfinite(o[4][:, 0]).all()
  _same_bits(o[5][:, 0], o[0][:, 0], "first column")
  assert (o[5][:, 1] == 0).all()


@pytest.mark.usefixtures("fast_compile")
def test_apply_if_finite_skips_the_step_on_every_worker():
  """``reduce_gradients(compressor=...)`` chained before ``optax.apply_if_finite``: a NaN in
  one worker's gradient makes every worker skip the step (parameters and compressor state
  kept, the non-finite count 1 everywhere); the next finite step updates every worker alike."""
  import optax  # noqa: PLC0415

  params = {"w": jnp.zeros((8, 6)), "b": jnp.zeros(6)}
  tx = optax.chain(PL.reduce_gradients("w", compressor=C.topk(0.25), min_size=1),
                   optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5))
  rng = np.random.default_rng(3)
  g = {k: rng.standard_normal((2, W) + v.shape).astype(np.float32) for k, v in params.items()}
  g["w"][0, 2, 3, 1] = np.nan  # step 0, worker 2

  def worker(g):
    p, st = params, tx.init(params)
    seen = []
    for t in range(2):
      u, st = tx.update({k: v[t] for k, v in g.items()}, st, p)
      p = optax.apply_updates(p, u)
      seen.append((p, st[1].notfinite_count, st[0].compressor_state))
    return seen

  (p0, bad0, cs0), (p1, bad1, _) = jax.jit(jax.vmap(worker, axis_name="w", in_axes=1))(g)
  init = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (W,) + a.shape),
                                tx.init(params)[0].compressor_state)
  _same_bits(p0, jax.tree_util.tree_map(lambda a: jnp.zeros((W,) + a.shape), params), "skip")
  _same_bits(cs0.leaves, init.leaves, "compressor state kept")
  np.testing.assert_array_equal(np.asarray(bad0), 1)
  np.testing.assert_array_equal(np.asarray(bad1), 0)
  for a in _np(p1):
    assert np.isfinite(a).all() and (a != 0).any()
    _same_bits(a, np.broadcast_to(a[0], a.shape), "every worker alike")


# ---------------------------------------------------------------------------------------------
# low-precision and float32 reductions without a compressor

@pytest.mark.usefixtures("fast_compile")
def test_psum_and_reduce_gradients_follow_the_policy():
  """NaN or ±inf in one worker's leaf: that leaf NaN on every worker, the other leaf exact;
  ±inf in a format that saturates it (FixedPoint, E4M3 with saturation) is not hidden;
  ``psum_two_level`` likewise. (``psum(aps=True)``: tests/parallel/test_aps.py.)"""
  rng = np.random.default_rng(0)
  base = {"a": rng.standard_normal((W, 5, 6)).astype(np.float32),
          "b": rng.standard_normal((W, 7)).astype(np.float32)}
  cases = []
  for bad in (np.nan, np.inf, -np.inf):
    a = base["a"].copy()
    a[2, 1, 4] = bad
    cases.append({"a": a, "b": base["b"]})
  cases.append(base)
  g = {k: jnp.asarray(np.stack([c[k] for c in cases])) for k in base}
  sat = F.FloatFormat(4, 3, specials="fn", overflow="saturate")  # saturates ±inf to ±448
  fp32, bf16 = PL.reduce_gradients("w"), PL.reduce_gradients("w", fmt=F.BF16)
  reducers = {
      "psum_ring_sat": lambda x: PL.psum(x, "w", fmt=sat, order="ring"),
      "psum_chain_fixed": lambda x: PL.psum(x, "w", fmt=F.FixedPoint(12, 6), order="chain"),
      "reduce_fp32": lambda x: fp32.update(x, fp32.init(x))[0],
      "reduce_bf16": lambda x: bf16.update(x, bf16.init(x))[0],
  }

  def run(x):
    return {n: f(x) for n, f in reducers.items()}

  out = jax.jit(jax.vmap(jax.vmap(run, axis_name="w")))(g)
  # CPD's two-level reduction (2 ranks x 2 emulated nodes), in the saturating format
  two = jax.vmap(jax.vmap(lambda x: PL.psum_two_level(x, "node", "rank", fmt=sat),
                          axis_name="node"), axis_name="rank")
  g2 = jax.tree_util.tree_map(lambda a: a.reshape((a.shape[0], 2, 2) + a.shape[2:]), g)
  out["psum_two_level_sat"] = jax.tree_util.tree_map(
      lambda a: a.reshape((a.shape[0], W) + a.shape[3:]), jax.jit(jax.vmap(two))(g2))
  for n, o in out.items():
    a, b = np.asarray(o["a"]), np.asarray(o["b"])
    for c in range(3):
      assert np.isnan(a[c]).all(), (n, c)
      _same_bits(b[c], b[3], n)
    assert np.isfinite(a[3]).all() and np.isfinite(b[3]).all(), n


# ---------------------------------------------------------------------------------------------
# a state that does not fit: one clear error naming the state

def _trace(comp, state, g=None, **kw):
  g = {"w": jnp.ones((4, 8, 6)), "b": jnp.ones((4, 5, 4))} if g is None else g
  f = jax.vmap(lambda g, s: compressed_allreduce(g, s, "w", comp, min_size=1, **kw),
               axis_name="w", in_axes=(0, None))
  return jax.eval_shape(f, g, state)


def test_state_of_the_wrong_type_is_refused():
  comp = C.topk(0.5)
  for bad in [(), {}, None, init_compression_state(comp, {"w": jnp.zeros(3)}).leaves]:
    with pytest.raises(TypeError, match="state must be the CompressionState"):
      _trace(comp, bad)
  tx = PL.reduce_gradients("w", compressor=comp)
  with pytest.raises(TypeError, match="ReduceGradientsState"):
    jax.vmap(lambda g: tx.update(g, ()), axis_name="w")(jnp.ones((4, 8)))
  plain = PL.reduce_gradients("w").init(jnp.zeros(8))
  with pytest.raises(TypeError, match="compressor_state is None"):
    jax.vmap(lambda g: tx.update(g, plain), axis_name="w")(jnp.ones((4, 8)))


def test_state_of_another_compressor_or_shape_is_refused():
  params = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((5, 4))}
  with pytest.raises(ValueError, match=r"state.leaves\[0\].*\['b'\].*TopK needs "
                                       r"\{'residual': float32\[20\]\}.*'u': float32\[20\]"):
    _trace(C.topk(0.5), init_compression_state(C.dgc(0.5), params))
  with pytest.raises(ValueError, match=r"\['b'\].*\(a state made for another compressor"):
    _trace(C.tbq(), init_compression_state(C.cgx(), params))
  with pytest.raises(ValueError, match=r"state.leaves\[0\].*\['b'\].*float32\[20\].*"
                                       r"float32\[6\]"):
    _trace(C.topk(0.5), init_compression_state(C.topk(0.5), {"w": jnp.zeros((8, 6)),
                                                             "b": jnp.zeros(6)}))
  with pytest.raises(ValueError, match=r"state.leaves has 1 per-leaf states, the gradient "
                                       r"tree has 2"):
    _trace(C.topk(0.5), init_compression_state(C.topk(0.5), {"w": jnp.zeros((8, 6))}))
  st = init_compression_state(C.topk(0.5), params)
  with pytest.raises(ValueError, match="state.count must be an integer scalar"):
    _trace(C.topk(0.5), st._replace(count=jnp.zeros(3)))
  # through reduce_gradients: the same message
  tx = PL.reduce_gradients("w", compressor=C.topk(0.5), min_size=1)
  wrong = tx.init(params)._replace(compressor_state=init_compression_state(C.onebit(), params))
  with pytest.raises(ValueError, match="OneBit|TopK needs"):
    jax.eval_shape(jax.vmap(lambda g: tx.update(g, wrong)[0], axis_name="w"),
                   {"w": jnp.ones((4, 8, 6)), "b": jnp.ones((4, 5, 4))})
  # a fitting state (states of cgx and qsgd are alike: both stateless) is accepted
  _trace(C.qsgd(), init_compression_state(C.cgx(), params))
