"""The compressed-reduction engine per compressor family (all 11 compressors):

* the bytes its collectives send (counted from the traced program under ``shard_map`` on 4 CPU
  devices) equal :func:`jaxlp.parallel.compressed_wire_bytes`, for every algorithm,
  ``bucket_mb`` fusion and SeCoPa ``plan``;
* over many steps of a constant gradient (named ``vmap``, W = 4): every worker has the same
  bits; leaves below ``min_size`` and vectors are the divide-first fp32 mean
  (:func:`jaxlp.parallel.ordered_psum`) bit for bit; with error feedback (or unbiased
  stochastic rounding) the running average approaches the true mean;
* the engine dispatches through the typed protocol (no compressor-kind branches);
* typed PRNG keys in the state; legacy keys still work, with a warning, and give the same bits.
"""

import warnings

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxlp.parallel.compressors as C
from jaxlp import formats as F
from jaxlp.parallel import (
  CompressionState,
  compressed_allreduce,
  compressed_wire_bytes,
  init_compression_state,
  ordered_psum,
)

W = 4
# name -> (compressor, "ef" (error feedback / unbiased: the average converges) or None)
COMPRESSORS = {
    "cgx": (C.cgx(4, 64, stochastic=True), "ef"), "qsgd": (C.qsgd(15, 64), "ef"),
    "onebit": (C.onebit(), "ef"), "tbq": (C.tbq(3.0), "ef"), "terngrad": (C.terngrad(), "ef"),
    "topk": (C.topk(0.1), "ef"), "randomk": (C.randomk(0.25), "ef"),
    "dgc": (C.dgc(0.1, momentum=0.0), "ef"), "graddrop": (C.graddrop(0.9), "ef"),
    "powersgd": (C.powersgd(2), "ef"), "cast": (C.cast(F.BF16), None),
}
PARAMS = {"big": jax.ShapeDtypeStruct((24, 40), jnp.float32),
          "small": jax.ShapeDtypeStruct((5, 7), jnp.float32),
          "vec": jax.ShapeDtypeStruct((40,), jnp.float32),
          "mid": jax.ShapeDtypeStruct((16, 12), jnp.float32)}
MIN_SIZE = 64

# Every check holds at any optimization level (bytes counted from traced programs, bits
# compared within one program or among the programs of one test, tolerances): XLA's
# optimizations off. Production bit claims of the engine (vmap == shard_map == pmap, the
# formulas, non-finite digests) are compiled normally in test_compress_allreduce.py and
# test_nonfinite.py
pytestmark = pytest.mark.usefixtures("fast_compile")


def test_every_compressor_is_covered():
  names = {type(c).__name__ for c, _ in COMPRESSORS.values()}
  assert names == {"CGX", "QSGD", "OneBit", "TBQ", "TernGrad", "TopK", "RandomK", "DGC",
                   "GradDrop", "PowerSGD", "Cast"}
  for c, _ in COMPRESSORS.values():
    assert isinstance(c, C.Compressor) and isinstance(c.aggregation, C.Aggregation)


# ---------------------------------------------------------------------------------------------
# bytes sent by the collectives of the traced program == the engine's accounting

def _collective_bytes(jaxpr, w):
  """Bytes one worker sends: all_gather (W-1)*in, all_to_all (W-1)/W*in, ppermute in; scans
  multiply their body. Any other collective (psum, ...) or a loop of unknown length fails."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    nbytes = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
    if name == "all_gather":
      total += (w - 1) * nbytes
    elif name == "all_to_all":
      total += (w - 1) * nbytes // w
    elif name == "ppermute":
      total += nbytes
    elif name in ("psum", "pmax", "pmin", "psum_scatter", "reduce_scatter"):
      raise AssertionError(f"unexpected collective {name}")
    for sub in jex.core.jaxprs_in_params(eqn.params):
      n = _collective_bytes(sub, w)
      if n and name == "scan":
        n *= eqn.params["length"]
      elif n and name in ("while", "cond"):
        raise AssertionError(f"collectives inside {name}")
      total += n
  return total


def _measured_bytes(comp, **kw):
  mesh = jax.make_mesh((W,), ("i",), devices=jax.devices("cpu")[:W])
  st = init_compression_state(comp, PARAMS, **{k: v for k, v in kw.items()
                                                if k in ("bucket_mb", "min_size", "plan")})
  g = {k: jnp.zeros(v.shape, v.dtype) for k, v in PARAMS.items()}
  sm = jax.shard_map(lambda g, s: compressed_allreduce(g, s, "i", comp, **kw)[0], mesh=mesh,
                     in_specs=P(), out_specs=P(), check_vma=False)
  return _collective_bytes(jax.make_jaxpr(sm)(g, st).jaxpr, W)


PLAN = [(True, 3), (True, 1), (False, 1), (True, 2)]  # leaf order: big, mid, small, vec
CONFIGS = [dict(), dict(bucket_mb=0.002), dict(plan=PLAN, skip_vectors=False)]
DENSE = [dict(algorithm="ring", bucket_mb=0.002), dict(algorithm="allgather", plan=PLAN)]
EXTRA = [("powersgd_start_batched", C.powersgd(1, start_iter=2, batched=True),
          dict(bucket_mb=0.002)),
         ("cast_e4m3", C.cast("E4M3FN"), dict()),
         ("cast_f33", C.cast(F.FloatFormat(3, 3)), dict(bucket_mb=0.002))]
# every compressor with the defaults and one other configuration (alternating); the dense
# quantizers also with the ring and the all-gather
WIRE_CASES = []
for j, (n, (c, _)) in enumerate(COMPRESSORS.items()):
  WIRE_CASES += [(n, c, CONFIGS[0]), (n, c, CONFIGS[1 + j % 2])]
  if j < 5:  # dense quantizers
    WIRE_CASES.append((n, c, DENSE[j % 2]))
WIRE_CASES += EXTRA


@pytest.mark.parametrize("name,comp,kw", WIRE_CASES,
                         ids=[f"{n}-{'-'.join(f'{k}' for k in kw) or 'default'}"
                              for n, _, kw in WIRE_CASES])
def test_wire_bytes_equal_the_bytes_the_collectives_send(name, comp, kw, cpu_devices):
  kw = dict(kw, min_size=MIN_SIZE)
  want = compressed_wire_bytes(PARAMS, comp, W, **kw)
  assert _measured_bytes(comp, **kw) == want, name
  assert compressed_wire_bytes(PARAMS, comp, 1, **kw) == 0
  assert want < compressed_wire_bytes(PARAMS, comp, W, min_size=10 ** 9) or name.startswith(
      "powersgd_start"), "compression should send fewer bytes than fp32"


def test_wire_bytes_arguments_are_checked():
  with pytest.raises(ValueError, match="algorithm"):
    compressed_wire_bytes(PARAMS, C.topk(), W, algorithm="ring")
  with pytest.raises(ValueError, match="axis_size"):
    compressed_wire_bytes(PARAMS, C.topk(), 0)
  with pytest.raises(ValueError, match="plan"):
    compressed_wire_bytes(PARAMS, C.topk(), W, plan=[(True, 1)])
  with pytest.raises(TypeError, match="aggregation"):
    compressed_wire_bytes(PARAMS, object(), W)


# ---------------------------------------------------------------------------------------------
# many steps of a constant gradient under a named vmap

STEPS = 32
SMALL = {"big": jax.ShapeDtypeStruct((16, 8), jnp.float32)}


def _grads(seed=0, params=None):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.standard_normal((W,) + v.shape).astype(np.float32))
          for k, v in (params or PARAMS).items()}


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_constant_gradient_over_steps(name):
  comp, ef = COMPRESSORS[name]
  params = {k: PARAMS[k] for k in ("big", "small", "vec")}
  g = _grads(0, params)

  def run(g_w):
    st = init_compression_state(comp, params)

    def body(st, _):
      out, st = compressed_allreduce(g_w, st, "w", comp, min_size=MIN_SIZE)
      return st, out

    st, outs = jax.lax.scan(body, st, None, length=STEPS)
    ref = {k: ordered_psum(g_w[k] / jnp.float32(W), "w") for k in ("small", "vec")}
    return outs, st, ref

  outs, st, ref = jax.jit(jax.vmap(run, axis_name="w"))(g)
  assert int(st.count[0]) == STEPS
  assert jnp.issubdtype(st.key.dtype, jax.dtypes.prng_key)
  for k, leaf in outs.items():  # every worker, every step: the same bits
    for r in range(1, W):
      np.testing.assert_array_equal(_bits(leaf[r]), _bits(leaf[0]), err_msg=k)
  for k in ("small", "vec"):  # filtered: the divide-first fp32 mean, bit for bit
    for s in range(STEPS):
      np.testing.assert_array_equal(_bits(outs[k][0, s]), _bits(ref[k][0]), err_msg=k)
  true = np.mean(np.asarray(g["big"], np.float64), axis=0)
  first = np.asarray(outs["big"][0, 0], np.float64)
  avg = np.mean(np.asarray(outs["big"][0], np.float64), axis=0)
  rel = lambda a: float(np.linalg.norm(a - true) / np.linalg.norm(true))  # noqa: E731
  if ef:
    # error feedback sends what the earlier steps left out; unbiased rounding averages out
    assert rel(avg) < 0.4 * max(rel(first), 1e-3) or rel(avg) < 0.02, (rel(first), rel(avg))
    assert rel(avg) < 0.4, rel(avg)  # (not off by a factor: the mean is taken once)
  else:
    assert rel(avg) < 0.01, rel(avg)  # bf16 cast: the mean to bf16 rounding


# ---------------------------------------------------------------------------------------------
# the engine is kind-agnostic, typed keys

def test_engine_reads_no_compressor_kind():
  """A compressor without ``kind`` (or with a made-up one) works: the engine dispatches on
  ``compressor.aggregation`` only."""
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class MyTopK(type(C.topk())):
    kind = "something-else"

  comp, ref = MyTopK(0.1), C.topk(0.1)
  g = _grads(1, SMALL)
  outs = []
  for c in (comp, ref):
    st = jax.tree.map(lambda a: jnp.broadcast_to(a, (W,) + a.shape),
                      init_compression_state(c, SMALL))
    outs.append(jax.jit(jax.vmap(
      lambda g, s, c=c: compressed_allreduce(g, s, "w", c, min_size=MIN_SIZE),
      axis_name="w"))(g, st))
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_state_key_is_typed_and_survives_device_get_and_pickle():
  import pickle

  comp = C.terngrad()  # stochastic rounding: the key decides the bits
  st = init_compression_state(comp, SMALL, seed=5)
  assert jnp.issubdtype(st.key.dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(st.key)),
                                np.asarray(jax.random.PRNGKey(5)))  # threefry: same key data
  leaves = jax.tree.leaves(st)  # the pytree holds the key data: numpy-convertible
  assert all(not jnp.issubdtype(a.dtype, jax.dtypes.prng_key) for a in leaves)
  back = pickle.loads(pickle.dumps(jax.device_get(st)))
  assert jnp.issubdtype(back.key.dtype, jax.dtypes.prng_key)
  g = _grads(2, SMALL)
  f = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "w", comp, min_size=MIN_SIZE),
                       axis_name="w"))
  bcast = lambda s: jax.tree.map(lambda a: jnp.broadcast_to(a, (W,) + a.shape), s)  # noqa
  for a, b in zip(jax.tree.leaves(f(g, bcast(st))), jax.tree.leaves(f(g, bcast(back))),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_legacy_uint32_keys_warn_and_give_the_same_bits():
  comp = C.terngrad()  # stochastic rounding: the key decides the bits
  st = init_compression_state(comp, SMALL)
  g = _grads(3, SMALL)
  bcast = lambda s: jax.tree.map(lambda a: jnp.broadcast_to(a, (W,) + a.shape), s)  # noqa
  run = lambda key: jax.jit(jax.vmap(  # noqa: E731
      lambda g, s, k: compressed_allreduce(g, s, "w", comp, min_size=MIN_SIZE, key=k),
      axis_name="w", in_axes=(0, 0, None)))(g, bcast(st), key)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    typed = run(jax.random.key(9))
  with pytest.warns(DeprecationWarning, match="legacy uint32"):
    legacy = run(jax.random.PRNGKey(9))
  for a, b in zip(jax.tree.leaves(typed), jax.tree.leaves(legacy), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # a state holding a legacy key (an old pickle): its key data is wrapped when the state
  # enters a transformation (it is a pytree of key data), the same bits as the typed state
  old = CompressionState(st.count, jax.random.PRNGKey(0), st.leaves, st.buckets)
  f = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "w", comp, min_size=MIN_SIZE),
                       axis_name="w", in_axes=(0, None)))
  for a, b in zip(jax.tree.leaves(f(g, old)), jax.tree.leaves(f(g, st)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(TypeError, match="typed PRNG key"):
    compressed_allreduce({}, init_compression_state(comp, {}), "w", comp, key=3)
