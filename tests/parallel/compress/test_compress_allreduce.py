"""compressed_allreduce: CGX SRA formula, filters, fusion, identical bits on all workers and
under vmap / shard_map (8 forced CPU devices).

Meshes and pmaps use ``jax.devices("cpu")`` (tests/conftest.py forces 8), never
``jax.devices()``: under ``JAX_PLATFORMS=cuda,cpu`` that is a single GPU. Tests comparing a
mesh/pmap run with a vmap run bit for bit take the ``cpu_devices`` fixture, which pins the
default device to CPU so that the vmap run is XLA:CPU too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxlp.parallel.compressors as C
from jaxlp.parallel._compressed import compressed_allreduce, init_compression_state
from jaxlp.parallel._secopa import secopa_plan

W = 8
# one compressed leaf ("w1": 1920 elements, 240 per worker under SRA, a full and a partial
# bucket of 128), a vector and a leaf under min_size (both fp32). Each compressed leaf is its
# own copy of the compressor's code in the compiled program (compile time grows with the
# number of such leaves, and compile is what these tests cost): leaves are handled one by one
# and the same way, so a second one is in test_allgather_fusion_and_plan only (fusion).
PARAMS = {"w1": jnp.zeros((48, 40)), "b1": jnp.zeros((40,)), "tiny": jnp.zeros((3, 4))}
FUSION_PARAMS = dict(PARAMS, w2=jnp.zeros((40, 35)))


def _grads(seed=0, w=W, params=None):
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda p: jnp.asarray(rng.standard_normal((w,) + p.shape).astype(np.float32)),
      PARAMS if params is None else params)


def _state(comp, w=W, params=None):
  st = init_compression_state(comp, PARAMS if params is None else params)
  return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (w,) + a.shape), st)


def _run_vmap(comp, g=None, st=None, **kw):
  fn = _run_vmap_fn(lambda g, s: compressed_allreduce(g, s, "i", comp, **kw))
  return fn if g is None else fn(g, st)


def _run_vmap_fn(f):
  return jax.jit(jax.vmap(f, axis_name="i"))


def _cpu_mesh(n, name, **kw):
  return jax.make_mesh((n,), (name,), devices=jax.devices("cpu")[:n], **kw)


def _run_shard_map_fn(per_worker):
  """jit(shard_map) over the 8 CPU devices of ``per_worker(g, s)`` (one worker's values)."""
  mesh = _cpu_mesh(W, "i")
  def f(g, s):
    g = jax.tree_util.tree_map(lambda a: a[0], g)
    s = jax.tree_util.tree_map(lambda a: a[0], s)
    return jax.tree_util.tree_map(lambda a: a[None], per_worker(g, s))
  sm = jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i"),
                     check_vma=False)
  shard = jax.sharding.NamedSharding(mesh, P("i"))
  fn = jax.jit(sm)
  return lambda g, st: fn(*jax.device_put((g, st), shard))


# One of each compressor class: variants of a class (CGX stochastic, TernGrad's HiPress mode,
# another cast format) run the same aggregation and collectives (their encodes are compared
# with their references in test_compress_compressors.py); per-worker noise under vmap and
# shard_map is QSGD's and TernGrad's, drawn from the worker key as CGX's stochastic mode.
COMPS = [C.cgx(4, 128), C.qsgd(7, 128), C.onebit(), C.tbq(0.2), C.terngrad(),
         C.dgc(0.05, sample_rate=0.1), C.graddrop(0.9), C.topk(0.05), C.randomk(0.05),
         C.powersgd(2, start_iter=1), C.cast("bf16")]
# The cases run by the `ways` fixture, {key: (compressor, algorithm)}: every compressor of COMPS
# (key: its index) with "auto" (CGX: SRA) and onebit's compressed ring (ppermute), for
# test_ring_vmap_shard_map_and_mixed_axes_identical.
WAYS = dict({str(i): (c, "auto") for i, c in enumerate(COMPS)}, ring=(C.onebit(), "ring"))
WAYS_KW = dict(min_size=100)
# the tests that share the `ways` fixture run in one pytest-xdist worker (it is computed once)
ways_group = pytest.mark.xdist_group("compress_allreduce_ways")


def _all_ways(axis):
  """Every case of WAYS, each its own compressed_allreduce on the same gradients and its own
  state: {key: (output, state)}."""
  return lambda g, s: {k: compressed_allreduce(g, s[k], axis, comp, algorithm=alg, **WAYS_KW)
                       for k, (comp, alg) in WAYS.items()}


@pytest.fixture(scope="module")
def ways():
  """Two steps (residuals carried) of every case of WAYS under a named vmap and under
  shard_map over the 8 CPU devices: (inputs, vmap results, shard_map results), results as
  {key: (output, state)} of the second step. All cases are ONE vmap program and ONE shard_map
  program (one compile each instead of one per compressor: compile was most of these tests'
  time); the default device is pinned to a CPU device as by the cpu_devices fixture."""
  with jax.default_device(jax.devices("cpu")[0]):
    g = _grads()
    g2 = jax.tree_util.tree_map(lambda a: 0.5 * a, g)
    st = {k: _state(comp) for k, (comp, _) in WAYS.items()}
    res = []
    for f in (_run_vmap_fn(_all_ways("i")), _run_shard_map_fn(_all_ways("i"))):
      o = f(g, st)
      res.append(f(g2, {k: v[1] for k, v in o.items()}))
    return (g, g2, st), res[0], res[1]


@ways_group
@pytest.mark.parametrize("i", range(len(COMPS)), ids=[type(c).__name__ for c in COMPS])
def test_identical_on_workers_and_vmap_equals_shard_map(i, ways):
  (g, _, _), vm, sm = ways
  ov, sv = vm[str(i)]
  os_, ss = sm[str(i)]
  for a, b in zip(jax.tree_util.tree_leaves((ov, sv)), jax.tree_util.tree_leaves((os_, ss)),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a in jax.tree_util.tree_leaves(ov):
    np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(np.asarray(a)[0], a.shape))
  mean = jax.tree_util.tree_map(lambda a: 0.5 * a.mean(0), g)
  # filtered leaves (vector, tiny) are the plain fp32 mean of the pre-divided gradients
  for k in ("b1", "tiny"):
    np.testing.assert_allclose(np.asarray(ov[k][0]), np.asarray(mean[k]), rtol=1e-5, atol=1e-6)


def _np_cgx(x, bits, bucket):
  out = np.empty_like(x)
  for s in range(0, x.size, bucket):
    b = x[s:s + bucket]
    mx, mn = b.max(), b.min()
    unit = np.float32((mx - mn) / np.float32(2 ** bits - 1))
    lev = (np.zeros(b.size, np.float32) if unit < 1e-10 else
           np.minimum(np.floor(np.float32((b - mn) / unit) + np.float32(0.5)), 2 ** bits - 1))
    out[s:s + bucket] = mn + np.float32(unit * lev)
  return out


def test_cgx_sra_matches_formula():
  comp = C.cgx(3, 16)
  w, n = 4, 200
  g = jnp.asarray(np.random.default_rng(1).standard_normal((w, n)).astype(np.float32))
  st = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (w,) + a.shape),
                              init_compression_state(comp, jnp.zeros((n,))))
  out, _ = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "i", comp, min_size=0,
                                                               skip_vectors=False),
                            axis_name="i"))(g, st)
  x = np.asarray(g) / np.float32(w)
  c = n // w
  want = np.empty(n, np.float32)
  for r in range(w):
    acc = x[r, r * c:(r + 1) * c].copy()
    for j in range(w):
      if j != r:
        acc = acc + _np_cgx(x[j, r * c:(r + 1) * c], 3, 16)
    want[r * c:(r + 1) * c] = _np_cgx(acc, 3, 16)
  np.testing.assert_array_equal(np.asarray(out[0]), want)


# W = 3: hops, an odd W and edge padding (W = 4 was the same hops once more; every hop is one
# more copy of the encoder to compile); W = 1: no hop, the owner's encoding only
@pytest.mark.parametrize("w,n", [(3, 101), (1, 50)])
def test_cgx_ring_matches_formula(w, n):
  """Chunk c gathers x_{c+1}, ..., x_{c+W-1}, x_c, re-quantizing the forwarded partial sum at
  every hop; the owner quantizes the total once more (torch_cgx ring.cc)."""
  comp = C.cgx(3, 16)
  g = jnp.asarray(np.random.default_rng(w).standard_normal((w, n)).astype(np.float32))
  st = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (w,) + a.shape),
                              init_compression_state(comp, jnp.zeros((n,))))
  out, _ = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "i", comp, min_size=0,
                                                               skip_vectors=False,
                                                               algorithm="ring"),
                            axis_name="i"))(g, st)
  x = np.asarray(g) / np.float32(w)
  c = -(-n // w)
  xs = np.concatenate([x, np.repeat(x[:, -1:], w * c - n, axis=1)], axis=1)  # edge padding
  want = np.empty(w * c, np.float32)
  for seg in range(w):
    sl = slice(seg * c, (seg + 1) * c)
    acc = xs[(seg + 1) % w, sl].copy()
    for k in range(2, w + 1):
      acc = xs[(seg + k) % w, sl] + _np_cgx(acc, 3, 16)
    want[sl] = _np_cgx(acc, 3, 16)
  for r in range(w):
    np.testing.assert_array_equal(np.asarray(out[r]), want[:n])


# cgx: COMPS[0] with "auto" (= "sra"); both cases' vmap and shard_map runs are the `ways`
# fixture's (the same gradients, states and min_size)
@ways_group
@pytest.mark.parametrize("key", ["ring", "0"], ids=["onebit-ring", "cgx-sra"])
def test_ring_vmap_shard_map_and_mixed_axes_identical(key, ways, cpu_devices):
  """The ring (ppermute) and SRA (all_to_all) paths give the same bits under vmap, shard_map
  and a (mesh axis, vmap axis) pair, over two steps with residuals."""
  (g, g2, st), vm, sm = ways
  comp, alg = WAYS[key]
  f = _run_mixed(comp, algorithm=alg, **WAYS_KW)
  o, s = f(g, st[key])
  results = [vm[key], sm[key], f(g2, s)]
  for a, b, c in zip(*(jax.tree_util.tree_leaves(r) for r in results), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  ov = results[0][0]
  for a in jax.tree_util.tree_leaves(ov):
    np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(np.asarray(a)[0], a.shape))
  err = np.abs(np.asarray(ov["w1"][0]) - np.asarray(0.5 * g["w1"].mean(0))).max()
  assert err < 1.0, (alg, err)


# One case: pmap is a fourth way to run the same per-device code (its collectives are
# shard_map's, compared with vmap for every compressor above); CGX's SRA uses all_to_all and
# all_gather. The reference is the `ways` fixture's vmap run of COMPS[0] (cgx, "auto" = "sra").
@ways_group
def test_pmap_equals_vmap(ways, cpu_devices):
  """The same code under jax.pmap over 8 CPU devices gives vmap's bits."""
  (g, g2, st), vm, _ = ways
  comp, alg = WAYS["0"]
  f = jax.pmap(lambda g, s: compressed_allreduce(g, s, "i", comp, algorithm=alg, **WAYS_KW),
               axis_name="i", devices=cpu_devices[:W])
  op = f(g2, f(g, st["0"])[1])
  for a, b in zip(jax.tree_util.tree_leaves(vm["0"]), jax.tree_util.tree_leaves(op), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _run_mixed(comp, **kw):
  """2 real devices ("dev") x 4 vmapped workers ("emu") = 8 workers, axis ("dev", "emu")."""
  mesh = _cpu_mesh(2, "dev", axis_types=(jax.sharding.AxisType.Auto,))
  split = lambda t: jax.tree_util.tree_map(lambda a: a.reshape((2, 4) + a.shape[1:]), t)  # noqa
  def f(g, s):
    inner = jax.vmap(lambda g, s: compressed_allreduce(g, s, ("dev", "emu"), comp, **kw),
                     axis_name="emu")
    o = inner(*jax.tree_util.tree_map(lambda a: a[0], (g, s)))
    return jax.tree_util.tree_map(lambda a: a[None], o)
  sm = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("dev"), P("dev")), out_specs=P("dev"),
                             check_vma=False))
  # inputs placed as the outputs come back, so that a second step reuses the executable
  shard = jax.sharding.NamedSharding(mesh, P("dev"))
  def run(g, st):
    out = sm(*jax.device_put((split(g), split(st)), shard))
    return jax.tree_util.tree_map(lambda a: a.reshape((W,) + a.shape[2:]), out)
  return run


@pytest.mark.usefixtures("fast_compile")
def test_allgather_fusion_and_plan():
  comp = C.cgx(4, 64)
  g = _grads(3, 4, FUSION_PARAMS)
  st = _state(comp, 4, FUSION_PARAMS)
  # fusing changes where buckets start: the fused result is checked against the mean
  fused, _ = _run_vmap(comp, g, st, min_size=100, algorithm="allgather", bucket_mb=1.0)
  for k in ("w1", "w2"):
    err = np.abs(np.asarray(fused[k][0]) - np.asarray(g[k].mean(0))).max()
    assert err < 4 * 2 * 3.0 / 15 / 4 * 4
  plan = secopa_plan([int(np.prod(a.shape[1:])) for a in jax.tree_util.tree_leaves(g)],
                     topology="ps", num_nodes=4)
  assert not any(e.compress for e in plan)  # tiny layers: HiPress would not compress
  # a plan on the 3 leaves of PARAMS (leaf order: b1, tiny, w1) overrides the filters: the
  # vector compressed (one piece), the tiny leaf not (fp32: the mean to rounding), the matrix
  # in 3 pieces. Each compressed leaf is one more copy of CGX's code to compile.
  planned, _ = _run_vmap(comp, _grads(3, 4), _state(comp, 4),
                         plan=[(True, 1), (False, 1), (True, 3)])
  for k in ("w1", "b1"):
    assert 1e-3 < np.abs(np.asarray(planned[k][0]) - np.asarray(g[k].mean(0))).max() < 0.5
  np.testing.assert_allclose(np.asarray(planned["tiny"][0]), np.asarray(g["tiny"].mean(0)),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("fast_compile")
def test_powersgd_allreduce_recovers_low_rank_mean():
  comp = C.powersgd(2)
  w, n, m = 4, 30, 20
  rng = np.random.default_rng(0)
  a = rng.standard_normal((n, 2)).astype(np.float32)
  g = jnp.asarray(np.stack([a @ rng.standard_normal((2, m)).astype(np.float32) for _ in range(w)]))
  st = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (w,) + x.shape),
                              init_compression_state(comp, jnp.zeros((n, m))))
  out, st = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "i", comp, min_size=0),
                             axis_name="i"))(g, st)
  np.testing.assert_allclose(np.asarray(out[0]), np.asarray(g.mean(0)), atol=1e-4)


PSGD_PARAMS = {"a": jnp.zeros((40, 30)), "b": jnp.zeros((30,)), "c": jnp.zeros((16, 8, 3)),
               "d": jnp.zeros((50, 64))}


# two matrices (one 3-D, viewed as 16 x 24) to fuse and a vector in fp32: each compressed leaf
# is one more copy of PowerSGD's code in each of the test's 4 programs (compile is its time)
FUSE_PARAMS = {k: PSGD_PARAMS[k] for k in ("a", "b", "c")}


def _psgd_grads(w, seed=0, params=PSGD_PARAMS):
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda p: jnp.asarray(rng.standard_normal((w,) + p.shape).astype(np.float32)), params)


def test_powersgd_bucket_fusion_same_bits_fewer_collectives():
  """bucket_mb fuses the P's (and the Q's) of a bucket into one all-reduce, as PyTorch's hook:
  identical results to per-leaf reduction, 2 collectives per bucket instead of per leaf.

  Rank 2, warm start after start_iter's plain mean (3 steps: the mean, a step from the
  initial Q, a step warm-started from the last Q). Cold start differs only before the first
  sum (Q drawn from the leaf's key, the same keys fused or not, in powersgd_start, which
  jaxlp.torch.ddp shares): it is compared with PyTorch's powerSGD_hook on a bucket of several
  tensors in tests/torch_bridge/test_ddp_hooks.py (psgd_r2_noef_cold)."""
  comp = C.powersgd(2, start_iter=1)
  w = 4
  g = _psgd_grads(w, params=FUSE_PARAMS)
  res = []
  for bmb in (None, 1.0):
    st = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (w,) + a.shape),
                                init_compression_state(comp, FUSE_PARAMS))
    f = jax.jit(jax.vmap(lambda g, s, bmb=bmb: compressed_allreduce(
        g, s, "i", comp, min_size=100, bucket_mb=bmb), axis_name="i"))
    outs = []
    for scale in (1.0, 0.5, 0.25):  # one program: the later steps cost no compile
      o, st = f(jax.tree_util.tree_map(lambda a, scale=scale: scale * a, g), st)
      outs.append(o)
    res.append((outs, st))
  for a, b in zip(*(jax.tree_util.tree_leaves(r) for r in res), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # step 0, before start_iter: the plain mean; the compressed leaves' step counters advance at
  # every step, that one included
  for k in FUSE_PARAMS:
    np.testing.assert_allclose(np.asarray(res[1][0][0][k][0]), np.asarray(g[k].mean(0)),
                               rtol=1e-5, atol=1e-6)
  iters = [int(leaf["iter"][0]) for leaf in res[1][1].leaves if "iter" in leaf]
  assert len(iters) == 2 and all(i == 3 for i in iters), iters
  one = jax.tree_util.tree_map(lambda a: a[0], g)
  st1 = init_compression_state(comp, FUSE_PARAMS)
  def n_gathers(bmb):
    mesh = _cpu_mesh(w, "i")
    sm = jax.shard_map(lambda g, s: compressed_allreduce(g, s, "i", comp, min_size=100,
                                                         bucket_mb=bmb),
                       mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return str(jax.make_jaxpr(sm)(one, st1)).count("all_gather[")
  extra = 1  # the plain mean before start_iter
  # 2 matrices; the vector "b" in fp32; the finite flags of the compressed units (one
  # all-gather per call, the non-finite policy)
  assert n_gathers(None) == 2 * (2 + extra) + 1 + 1
  assert n_gathers(1.0) == 2 + extra + 1 + 1


def _np_orth(x):
  q, r = np.linalg.qr(x.astype(np.float64))
  return q * np.where(np.diag(r) < 0, -1.0, 1.0)


@pytest.mark.usefixtures("fast_compile")
def test_powersgd_batched_bucket_matches_reference():
  """batched=True + bucket_mb: the bucket (a, c, d concatenated; b is a filtered vector) is
  one zero-padded s x s matrix with EF on the padded vector (batched_powerSGD_hook)."""
  comp = C.powersgd(3, batched=True)
  w = 4
  g = _psgd_grads(w, 1)
  st = init_compression_state(comp, PSGD_PARAMS, bucket_mb=1.0, min_size=100)
  assert len(st.buckets) == 1 and st.leaves[0] == {}
  q0 = np.asarray(st.buckets[0]["q"], np.float64)
  stw = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (w,) + a.shape), st)
  f = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "i", comp, min_size=100,
                                                         bucket_mb=1.0), axis_name="i"))
  steps = [g, jax.tree_util.tree_map(lambda a: 0.5 * a, g)]
  keys = ("a", "c", "d")
  n = sum(int(np.prod(PSGD_PARAMS[k].shape)) for k in keys)
  s_ = int(np.ceil(np.sqrt(n)))
  err = np.zeros((w, s_ * s_))
  q = q0
  for gs in steps:
    out, stw = f(gs, stw)
    xs = np.concatenate([np.asarray(gs[k]).reshape(w, -1) for k in keys], 1)  # no /W: Q only
    ms = np.pad(xs, ((0, 0), (0, s_ * s_ - n))) + err
    qo = _np_orth(q)
    p = _np_orth(sum(ms[r].reshape(s_, s_) @ qo for r in range(w)))
    q = sum(ms[r].reshape(s_, s_).T @ p for r in range(w)) / w
    approx = (p @ q.T).reshape(-1)
    err = ms - approx[None]
    got = np.concatenate([np.asarray(out[k][0]).reshape(-1) for k in keys])
    np.testing.assert_allclose(got, approx[:n], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out["b"][0]), np.asarray(gs["b"]).mean(0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(stw.buckets[0]["error"][0]), err[0], rtol=1e-3,
                             atol=1e-5)
  with pytest.raises(ValueError, match="bucket states"):
    bad = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (w,) + a.shape),
                                 init_compression_state(comp, PSGD_PARAMS))
    jax.vmap(lambda g, s: compressed_allreduce(g, s, "i", comp, min_size=100, bucket_mb=1.0),
             axis_name="i")(g, bad)


@pytest.mark.parametrize("name,fmt", [("bf16", "BF16"), ("fp16", "FP16")])
def test_cast_16bit_is_a_ring_allreduce_in_the_narrow_type(name, fmt):
  """PyTorch's order: cast (RNE), divide by W in the narrow type, then a ring all-reduce whose
  every partial sum is rounded to the type (NCCL's ring), here bit for bit against the ring
  oracle; the payloads are 16-bit words."""
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).parents[1]))
  import oracle

  from jaxlp import formats as F
  comp = C.cast(name)
  w = 4
  g = _grads(2, w)
  out, _ = _run_vmap(comp, g, _state(comp, w), min_size=0)
  dt = jnp.bfloat16 if name == "bf16" else jnp.float16
  parts = np.asarray((g["w1"].astype(dt) / jnp.asarray(4, dt)).astype(jnp.float32))
  want = oracle.ring(parts.reshape(w, -1), oracle.Q(getattr(F, fmt))).reshape(parts.shape[1:])
  for r in range(w):
    np.testing.assert_array_equal(np.asarray(out["w1"][r]), want)
  assert out["w1"].dtype == jnp.float32


def test_errors():
  for alg in ("sra", "ring", "tree"):
    with pytest.raises(ValueError, match="algorithm"):
      compressed_allreduce({}, init_compression_state(C.topk(), {}), "i", C.topk(),
                           algorithm=alg)
  with pytest.raises(ValueError, match="bits"):
    C.cgx(bits=9)


@pytest.mark.parametrize("fmt,wire", [("E4M3FN", "u8"), ("bf16", "u16"), ("fp16", "u16")])
def test_narrow_payloads_are_not_widened_on_the_wire(fmt, wire, cpu_devices):
  """XLA:CPU widens bf16/fp8 collectives (to f32/f16); payloads travel as their bits.

  A check of XLA:CPU's compiled HLO: the mesh is of CPU devices, so the module is compiled
  for the CPU whatever the default backend is."""
  comp = C.cast(fmt)
  mesh = _cpu_mesh(2, "i", axis_types=(jax.sharding.AxisType.Auto,))
  st = init_compression_state(comp, jnp.zeros((64, 32)))
  f = jax.jit(jax.shard_map(
      lambda g, s: compressed_allreduce(g[0], s, "i", comp, min_size=0)[0][None], mesh=mesh,
      in_specs=(P("i"), P()), out_specs=P("i"), check_vma=False))
  txt = f.lower(jnp.zeros((2, 64, 32)), st).compile().as_text()
  ops = [ln.split("=", 1)[1].split()[0] for ln in txt.splitlines()
         if "all-gather(" in ln or "collective-permute(" in ln]
  # the finite flags of the non-finite policy: one all-gather of one byte (one unit)
  assert ops.count("u8[2,1]{1,0}") == 1, ops
  ops.remove("u8[2,1]{1,0}")
  assert ops and all(o.startswith(wire + "[") for o in ops), ops
