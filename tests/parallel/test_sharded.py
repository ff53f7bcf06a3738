"""Bit-exact tests of jaxlp.parallel.reduce_scatter / all_gather: numpy oracles (oracle.py),
named vmap, shard_map on the forced CPU devices (W = 4 and 8), a (devices, vmap) axis pair and
pmap. One jitted program per case family: every case of a family is an output of it.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlp import formats as F
from jaxlp import parallel as jp

sys.path.insert(0, str(Path(__file__).parent))
import oracle  # noqa: E402
from test_psum import bits, cpu_mesh  # noqa: E402


# Leaves (shape, scatter dimension) for W workers: "a" scatters dimension 0 (slab o is psum's
# ring chunk o), "b" dimension 1 behind a leading dimension > 1 (psum's chunks are not the
# slabs), "c" a 1-D leaf, "d" the middle dimension of a 3-D leaf.
def shapes(w):
  return {"a": ((2 * w, 3), 0), "b": ((3, w), 1), "c": ((w,), 0), "d": ((2, 2 * w, 2), 1)}


def make_data(w, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  return {k: (rng.normal(size=(w,) + s) * scale).astype(np.float32)
          for k, (s, _) in shapes(w).items()}


def assert_same_bits(got, want, what=""):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan, err_msg=what)
  np.testing.assert_array_equal(bits(got)[~nan], bits(want)[~nan], err_msg=what)


def run_vmap(fn, data):
  return jax.device_get(jax.jit(jax.vmap(fn, axis_name="i"))(data))


def run_shard_map(fn, data, w):
  """shard_map over W forced CPU devices (axis name "i"), one worker per device."""
  mesh = cpu_mesh(w, "i")

  def body(t):
    out = fn(jax.tree_util.tree_map(lambda a: a[0], t))
    return jax.tree_util.tree_map(lambda a: a[None], out)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                            check_vma=False))
  sh = jax.sharding.NamedSharding(mesh, P("i"))
  return jax.device_get(f(jax.tree_util.tree_map(lambda a: jax.device_put(jnp.asarray(a), sh),
                                                 data)))


def run_two_level(fn, data, ndev, nemu):
  """devices x emulated workers: shard_map over "dev", vmap over "emu" (device-major)."""
  mesh = cpu_mesh(ndev, "dev")

  def body(t):
    out = jax.vmap(fn, axis_name="emu")(jax.tree_util.tree_map(lambda a: a[0], t))
    return jax.tree_util.tree_map(lambda a: a[None], out)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dev"), out_specs=P("dev"),
                            check_vma=False))
  sh = jax.sharding.NamedSharding(mesh, P("dev"))
  split = jax.tree_util.tree_map(
      lambda a: jax.device_put(jnp.asarray(a).reshape((ndev, nemu) + a.shape[1:]), sh), data)
  out = jax.device_get(f(split))
  return jax.tree_util.tree_map(lambda a: a.reshape((ndev * nemu,) + a.shape[2:]), out)


# ---------------------------------------------------------------------------------------------
# reduce_scatter with psum's orders: oracle = psum's oracle, cut into slabs

def rs_fn(cases, w, ax="i"):
  """fn(data) -> {case: slab} for cases {name: (leaf, kwargs)}."""
  def fn(data):
    return {name: jp.reduce_scatter(data[leaf], ax, scatter_dimension=shapes(w)[leaf][1], **kw)
            for name, (leaf, kw) in cases.items()}
  return fn


def rs_oracle(kw, gs, shape, d, w, key=None):
  fmt = kw.get("fmt") or F.FP32
  order = kw.get("order", "ring")
  q = oracle.Q(fmt, kw.get("rounding", "nearest"), key)
  gs = np.asarray(gs, np.float32).reshape(w, -1)
  if order == "all_to_all":
    if not kw.get("aps"):
      return oracle.all_to_all_sum(gs, shape, d, q, signed_zero=not _is_mxint8(fmt))
    idx = oracle.slab_rows(np.arange(gs.shape[1]), shape, d, w)

    def summer(pre):
      full = np.zeros(gs.shape[1], np.float32)
      full[idx] = oracle.all_to_all_sum(pre, shape, d, q)
      return full

    return oracle.slab_rows(oracle.aps_sum(gs, fmt, summer, q), shape, d, w)
  return oracle.reduce_scatter(order, gs, shape, d, q, kw.get("kahan", False),
                               fmt if kw.get("aps") else None)


def _is_mxint8(fmt):
  return isinstance(fmt, F.MXFormat) and fmt.elem == "int8"


def check_cases(out, cases, data, w, key=None):
  for name, (leaf, kw) in cases.items():
    shape, d = shapes(w)[leaf]
    kw_o = dict(kw)
    if kw.get("fmt") is not None and not hasattr(kw["fmt"], "_round_bits"):
      kw_o["fmt"] = _row(kw["fmt"])
    want = rs_oracle(kw_o, data[leaf], shape, d, w, key)
    fmt = kw.get("fmt")
    if (fmt is None or hasattr(fmt, "_round_bits")) and not (
        np.all(np.isfinite(data[leaf])) and np.all(np.isfinite(want))):
      want = np.full_like(want, np.nan)  # psum's non-finite policy: the whole leaf is NaN
    got = np.asarray(out[name], np.float32)
    k = shape[d] // w
    assert got.shape == (w,) + shape[:d] + (k,) + shape[d + 1:], (name, got.shape)
    assert_same_bits(got.reshape(w, -1), want, f"{name} (leaf {leaf}, W={w})")


def _row(fmt):
  """The block format as reduce_scatter applies it to the (W, m) rows (blocks along rows)."""
  import dataclasses
  return dataclasses.replace(fmt, axis=-1)


E4, CPD = F.E4M3, F.cpd_float(3, 0)
ORDER_CASES = {  # every order/option; the leaves rotate so that each layout is covered
    "ring": ("b", dict(fmt=E4)),
    "ring-d0": ("a", dict(fmt=E4)),
    "ring-kahan": ("d", dict(fmt=E4, kahan=True)),
    "ring-kahan-d0": ("c", dict(fmt=CPD, kahan=True)),
    "chain": ("d", dict(fmt=CPD, order="chain")),
    "chain-kahan": ("a", dict(fmt=E4, order="chain", kahan=True)),
    "tree": ("b", dict(fmt=E4, order="tree")),
    "ring-fp32": ("d", dict()),
    "chain-fp32": ("b", dict(order="chain")),
    "tree-fp32": ("a", dict(order="tree")),
    "ring-aps": ("a", dict(fmt=E4, aps=True)),
    "chain-aps": ("b", dict(fmt=F.E5M2, order="chain", aps=True)),
    "tree-aps": ("d", dict(fmt=CPD, order="tree", aps=True)),
}


def test_every_order_matches_the_oracle_w4():
  w = 4
  data = make_data(w, seed=1)
  data["b"][1, 0, 0] = np.inf  # APS / chain: a non-finite leaf
  check_cases(run_vmap(rs_fn(ORDER_CASES, w), data), ORDER_CASES, data, w)


MODE_CASES = {k: ORDER_CASES[k] for k in ("ring", "ring-d0", "ring-kahan", "chain-kahan", "tree",
                                           "ring-fp32", "ring-aps")}


# (vmap == oracle for these cases: test_every_order_matches_the_oracle_w4, W = 4, and the
# stochastic test below, W = 8; here shard_map == oracle)
@pytest.mark.parametrize("w", [4, 8])
def test_shard_map_gives_the_oracles_bits(w, cpu_devices):
  data = make_data(w, seed=w)
  cases = MODE_CASES if w == 8 else {k: MODE_CASES[k] for k in ("ring", "ring-d0", "tree")}
  check_cases(run_shard_map(rs_fn(cases, w), data, w), cases, data, w)


def test_devices_times_emulated_and_pmap(cpu_devices):
  w = 8
  cases = {k: MODE_CASES[k] for k in ("ring", "ring-kahan", "chain-kahan")}
  cases["a2a-mx"] = ("d", dict(fmt=F.mx(F.E2M1FN, 4), order="all_to_all"))
  data = make_data(w, seed=3)
  check_cases(run_two_level(rs_fn(cases, w, ("dev", "emu")), data, 4, 2), cases, data, w)
  pm = jax.pmap(rs_fn(cases, w, "p"), axis_name="p", devices=cpu_devices[:w])(data)
  check_cases(jax.device_get(pm), cases, data, w)


@pytest.mark.parametrize("w", [1, 3, 6])
def test_other_worker_counts_and_empty_leaves(w):
  data = make_data(w, seed=w)
  data["e"] = np.zeros((w, 0, 2), np.float32)
  cases = {"ring": ("b", dict(fmt=E4)), "ring-d0": ("a", dict(fmt=E4, kahan=True)),
           "chain": ("d", dict(fmt=F.E5M2, order="chain")), "tree": ("a", dict(order="tree")),
           "a2a": ("b", dict(fmt=F.mx(F.E4M3FN, 2), order="all_to_all"))}
  fn = rs_fn(cases, w)

  def with_empty(t):
    out = fn(t)
    out["empty"] = jp.reduce_scatter(t["e"], "i", fmt=E4)
    out["empty-ag"] = jp.all_gather(t["e"], "i", fmt=F.mx(F.E4M3FN, 2), axis=1)
    return out

  out = run_vmap(with_empty, data)
  check_cases(out, cases, data, w)
  assert out["empty"].shape == (w, 0, 2) and out["empty-ag"].shape == (w, 0, 2 * w)


def test_reduce_scatter_then_all_gather_is_psum_bit_for_bit():
  """The FSDP contract: sharded reduction + gather == the unsharded psum, every worker."""
  w = 4
  data = make_data(w, seed=4, scale=1e3)
  data["a"][2, 0, 0] = 3e-39  # a subnormal addend (float32 partial sums keep it)
  cases = {"ring-fp32": ("a", dict()), "ring-e4m3": ("b", dict(fmt=E4)),
           "chain-fp32": ("d", dict(order="chain")), "tree-bf16": ("a", dict(fmt=F.BF16,
                                                                              order="tree")),
           "ring-kahan-bf16": ("d", dict(fmt=F.BF16, kahan=True)),
           "a2a-fp32": ("b", dict(order="all_to_all"))}

  def fn(t):
    out = {}
    for name, (leaf, kw) in cases.items():
      d = shapes(w)[leaf][1]
      back = jp.all_gather(jp.reduce_scatter(t[leaf], "i", scatter_dimension=d, **kw), "i",
                           axis=d)
      ps = jp.psum(t[leaf], "i", **dict(kw, fmt=kw.get("fmt") or F.FP32,
                                        order="chain" if kw.get("order") == "all_to_all"
                                        else kw.get("order", "ring")))
      out[name] = (back, ps)
    return out

  out = run_vmap(fn, data)
  for name, (back, ps) in out.items():
    assert_same_bits(back, ps, name)  # (fp32 all_to_all == fp32 chain)
    assert_same_bits(back[0], back[-1], name)


def test_stochastic_rounding_same_in_oracle_vmap_and_shard_map(cpu_devices):
  w = 8
  key = jax.random.key(11)

  def stochastic_cases(key):
    st = dict(rounding="stochastic", key=key)
    return {"ring-kahan": ("d", dict(fmt=E4, kahan=True, **st)),
            "chain": ("b", dict(fmt=E4, order="chain", **st)),
            "tree": ("a", dict(fmt=E4, order="tree", **st)),
            "a2a-mx": ("a", dict(fmt=F.mx(F.E2M1FN, 4), order="all_to_all", **st))}

  cases = stochastic_cases(key)
  data = make_data(w, seed=5)
  # the key is an input of the vmap program: the check with another key below reuses it
  vm = jax.jit(jax.vmap(lambda t, k: rs_fn(stochastic_cases(k), w)(t), in_axes=(0, None),
                        axis_name="i"))
  ref = jax.device_get(vm(data, key))
  check_cases(ref, cases, data, w, key=key)
  check_cases(run_shard_map(rs_fn(cases, w), data, w), cases, data, w, key=key)
  o = jax.device_get(vm(data, jax.random.key(12)))
  for name in cases:
    assert not np.array_equal(bits(o[name]), bits(ref[name])), name  # the noise matters


# ---------------------------------------------------------------------------------------------
# order="all_to_all": fp32 accumulation of addends rounded once (qgZ with a block format)

A2A_CASES = {
    "e4m3": ("b", dict(fmt=E4)),
    "fp32": ("d", dict()),
    "bf16-aps": ("a", dict(fmt=F.BF16, aps=True)),
    "mxfp4": ("a", dict(fmt=F.mx(F.E2M1FN, 4))),
    "mxfp8": ("d", dict(fmt=F.mx(F.E4M3FN, 8))),
    "mxint8": ("a", dict(fmt=F.mx("int8", 3))),
    "int8-blocks": ("b", dict(fmt=F.BlockFormat(7, axis=-1, block_size=2))),
    "int4-blocks-hbfp": ("d", dict(fmt=F.BlockFormat(3, axis=0, block_size=4, exponent="hbfp"))),
    "bfp12": ("a", dict(fmt=F.BlockFormat(11, axis=-1, block_size=None))),
}
for _v in A2A_CASES.values():
  _v[1]["order"] = "all_to_all"


def test_all_to_all_orders_match_the_oracle_w4_and_shard_map_w8(cpu_devices):
  w = 4
  data = make_data(w, seed=6)
  data["a"][0, 0, 1] = -1e-30  # rounds to -0 in MXINT8 (the wire sends +0)
  data["a"][3, 5, :] = [np.nan, 1.0, 2.0]  # a NaN block in every block format
  check_cases(run_vmap(rs_fn(A2A_CASES, w), data), A2A_CASES, data, w)
  w = 8
  cases = {k: A2A_CASES[k] for k in ("e4m3", "mxfp4", "int8-blocks")}
  data = make_data(w, seed=7)  # (vmap == oracle above; here shard_map == oracle)
  check_cases(run_shard_map(rs_fn(cases, w), data, w), cases, data, w)


def test_native_is_close_and_untiled_output():
  w = 4
  data = make_data(w, seed=8)
  x = data["c"]

  def fn(v):
    return (jp.reduce_scatter(v, "i", fmt=F.BF16, order="native"),
            jp.reduce_scatter(v, "i", fmt=F.BF16, tiled=False),
            jp.reduce_scatter(v.astype(jnp.bfloat16), "i", fmt=F.BF16))

  nat, untiled, half = run_vmap(fn, x)
  assert nat.shape == (w, 1) and untiled.shape == (w,) and half.dtype == jnp.bfloat16
  np.testing.assert_allclose(nat.reshape(-1), x.sum(0), rtol=2e-2, atol=1e-2)
  want = oracle.reduce_scatter("ring", x, (w,), 0, oracle.Q(F.BF16))
  assert_same_bits(untiled, want.reshape(-1))
  hb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
  want16 = oracle.reduce_scatter("ring", hb, (w,), 0, oracle.Q(F.BF16))
  assert_same_bits(np.asarray(half.astype(jnp.float32)).reshape(-1), want16.reshape(-1))


# ---------------------------------------------------------------------------------------------
# all_gather

AG_CASES = {  # name -> (leaf, all_gather kwargs); the gathered axis and tiling vary
    "plain": ("a", dict()),
    "e4m3": ("b", dict(fmt=E4, axis=1)),
    "e4m3-stacked": ("c", dict(fmt=E4, tiled=False)),
    "fixed": ("d", dict(fmt=F.FixedPoint(8, 4), axis=2, tiled=False)),
    "mxfp4": ("a", dict(fmt=F.mx(F.E2M1FN, 3))),  # blocks along the shard's last axis
    "mxint8-axis0": ("d", dict(fmt=F.mx("int8", 2, axis=0), axis=1)),
    "int4-blocks": ("b", dict(fmt=F.BlockFormat(3, axis=0, block_size=2), axis=0)),
    "stochastic": ("d", dict(fmt=F.E5M2, axis=1, rounding="stochastic",
                             key=jax.random.key(3))),
    "stochastic-mx": ("a", dict(fmt=F.mx(F.E4M3FN, 2), rounding="stochastic",
                                key=jax.random.key(4))),
}


def ag_fn(cases, ax="i"):
  def fn(data):
    return {name: jp.all_gather(data[leaf], ax, **kw) for name, (leaf, kw) in cases.items()}
  return fn


def check_ag(out, cases, data, w):
  for name, (leaf, kw) in cases.items():
    fmt = kw.get("fmt")
    want = oracle.all_gather(data[leaf], fmt, kw.get("axis", 0), kw.get("tiled", True),
                             kw.get("rounding", "nearest"), kw.get("key"), 0,
                             signed_zero=not _is_mxint8(fmt))
    for i in range(w):
      assert_same_bits(out[name][i], want, f"{name} worker {i}")


def test_all_gather_matches_the_oracle_vmap_and_shard_map(cpu_devices):
  w = 4
  data = make_data(w, seed=9)
  data["a"][1, 2, 0] = np.inf
  data["d"][0, 0, 0, 0] = -1e-30
  ref = run_vmap(ag_fn(AG_CASES), data)
  check_ag(ref, AG_CASES, data, w)
  sm = {k: AG_CASES[k] for k in ("e4m3", "mxfp4", "stochastic")}
  check_ag(run_shard_map(ag_fn(sm), data, w), sm, data, w)


def test_all_gather_keeps_the_bits_of_any_dtype_and_equals_quantize_of_the_gathered():
  w = 4
  rng = np.random.default_rng(10)
  shards = {"h": jnp.asarray(rng.normal(size=(w, 3)), jnp.bfloat16),
            "i": jnp.arange(w * 2, dtype=jnp.int32).reshape(w, 2)}
  out = run_vmap(lambda t: jp.all_gather(t, "i"), shards)
  assert out["h"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(out["h"][2]).view(np.uint16),
                                np.asarray(shards["h"]).reshape(-1).view(np.uint16))
  np.testing.assert_array_equal(out["i"][0], np.arange(w * 2))
  # stochastic, elementwise: the same noise as quantizing the gathered array (leaf 0's key)
  key = jax.random.key(5)
  x = rng.normal(size=(w, 2, 3)).astype(np.float32)
  got = run_vmap(lambda s: jp.all_gather(s, "i", axis=1, fmt=F.E4M3, rounding="stochastic",
                                         key=key), x)
  gathered = np.concatenate(list(x), axis=1)
  want = F.quantize(jnp.asarray(gathered), F.E4M3, "stochastic",
                    key=jax.random.fold_in(key, 0))
  assert_same_bits(got[1], want)


# ---------------------------------------------------------------------------------------------
# the wire: block formats' codes + scales decode to exactly the quantized values

@pytest.mark.parametrize("fmt", [
    F.mx(F.E2M1FN, 8), F.mx(F.E4M3FN, 8), F.mx(F.E5M2, 8), F.mx(F.E3M2FN, 8), F.mx(F.E2M3FN, 8),
    F.mx("int8", 8), F.BlockFormat(3, axis=-1, block_size=8),
    F.BlockFormat(7, axis=-1, block_size=8, exponent="hbfp"),
    F.BlockFormat(15, axis=-1, block_size=8), F.BlockFormat(24, axis=-1, block_size=8)], ids=str)
def test_block_wire_roundtrip_with_special_values(fmt):
  from jaxlp.parallel._sharded import _wire
  rng = np.random.default_rng(12)
  mags = 10.0 ** rng.integers(-44, 38, size=(40, 1))
  x = (rng.normal(size=(40, 8)) * mags).astype(np.float32)
  x[0] = [np.inf, 1, 2, 3, 4, 5, 6, 7]
  x[1] = [np.nan, 1, 2, 3, 4, 5, 6, 7]
  x[2] = 0.0
  x[3] = [-0.0, 0.0, -1e-45, 1e-45, -3e-39, 2e-39, 0.0, -0.0]  # subnormal block
  x[4] = [3.4e38, -3.4e38, 1.0, -1e-30, 0.5, 2.0, -7.0, 1e-20]
  x = x.reshape(-1)
  wire = _wire(fmt, True)
  q = F.quantize(jnp.asarray(x), fmt)

  @jax.jit
  def roundtrip(q, v):
    p = wire.encode(q, v)
    return wire.decode(p, q.shape[0]), p

  back, payload = roundtrip(q, jnp.asarray(x))
  want = np.asarray(q)
  if _is_mxint8(fmt):
    want = np.where(want == 0, np.float32(0), want)
  assert_same_bits(back, want, str(fmt))
  nbytes = sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(payload))
  assert nbytes == jp.wire_payload_bytes(fmt, x.size)


@pytest.mark.parametrize("fmt", [F.BlockFormat(3, axis=-1, block_size=64), F.mx(F.E2M1FN),
                                 F.mx(F.E3M2FN), F.BlockFormat(7, axis=-1, block_size=64)],
                         ids=str)
def test_block_wire_bytes_are_pack_bits_stream(fmt):
  """The wire packs its codes with pack_bits_vectorized: the bytes of pack_bits (the stream
  the wire is specified by), also for a row that ends in a partial word."""
  import dataclasses

  from jaxlp.parallel._sharded import _BlockWire, _wire
  from jaxlp.parallel.compressors import pack_bits

  @dataclasses.dataclass(frozen=True)
  class Reference(_BlockWire):
    def _pack(self, codes):
      return pack_bits(codes, self.bits)

  wire = _wire(fmt, True)
  ref = Reference(wire.fmt, wire.block_size)
  x = np.random.default_rng(3).normal(size=64 * 9 + 13).astype(np.float32)
  x[5], x[70] = np.nan, -0.0
  q = F.quantize(jnp.asarray(x), fmt)
  got = jax.jit(wire.encode)(q, jnp.asarray(x))
  want = jax.jit(ref.encode)(q, jnp.asarray(x))
  for k in ("codes", "scales"):
    assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k


# ---------------------------------------------------------------------------------------------
# bytes on the wire: the accounting == what the traced collectives carry

def _collective_bytes(jaxpr, w):
  """Bytes one worker sends: all_gather (W-1)*in, all_to_all (W-1)/W*in, ppermute in (scans
  multiply their body); psum_scatter as a float32 ring reduce-scatter, (W-1)/W*in."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    nbytes = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
    if name == "all_gather":
      total += (w - 1) * nbytes
    elif name in ("all_to_all", "reduce_scatter", "psum_scatter"):
      total += (w - 1) * nbytes // w
    elif name == "ppermute":
      total += nbytes
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n = _collective_bytes(sub, w)
      if n and name == "scan":
        n *= eqn.params["length"]
      elif n and name in ("while", "cond"):
        raise AssertionError(f"collectives inside {name}")
      total += n
  return total


BYTES_CASES = [
    dict(), dict(fmt=E4), dict(fmt=E4, kahan=True), dict(fmt=F.BF16, order="chain"),
    dict(fmt=E4, order="tree", aps=True), dict(fmt=F.BF16, order="native"),
    dict(fmt=F.mx(F.E2M1FN, 4), order="all_to_all"), dict(fmt=E4, order="all_to_all"),
    dict(fmt=F.BlockFormat(3, axis=-1, block_size=3), order="all_to_all"),
    dict(order="all_to_all"), dict(fmt=F.FixedPoint(8, 4), order="tree")]


def _traced_bytes(fn, x, w):
  """Bytes the collectives of ``fn`` (run on each of W devices by shard_map) carry."""
  mesh = cpu_mesh(w, "i")
  sm = jax.shard_map(lambda v: jax.tree_util.tree_map(lambda a: a[None], fn(v[0])), mesh=mesh,
                     in_specs=P("i"), out_specs=P("i"), check_vma=False)
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("i")))
  return _collective_bytes(jax.make_jaxpr(sm)(x).jaxpr, w)


@pytest.mark.parametrize("leaf", ["a", "b"])
def test_wire_bytes_equal_the_traced_collectives(leaf):
  import jax.extend  # noqa: F401
  w = 4
  shape, d = shapes(w)[leaf]
  x = jnp.zeros((w,) + shape)
  for kw in BYTES_CASES:
    got = _traced_bytes(lambda v, kw=kw: jp.reduce_scatter(v, "i", scatter_dimension=d, **kw),
                        x, w)
    want = jp.sharded_wire_bytes(jax.ShapeDtypeStruct(shape, jnp.float32), w,
                                 scatter_dimension=d, **kw)
    assert got == want, (kw, got, want)
  for fmt in (None, E4, F.mx(F.E4M3FN, 2), F.BlockFormat(7, axis=0, block_size=3)):
    got = _traced_bytes(lambda v, fmt=fmt: jp.all_gather(v, "i", fmt=fmt), x, w)
    want = jp.sharded_wire_bytes(jax.ShapeDtypeStruct(shape, jnp.float32), w,
                                 collective="all_gather", fmt=fmt)
    assert got == want, (fmt, got, want)
  # the ring sends packed words: 3 hops + the delivery hop of 8-bit E4M3 words
  assert jp.sharded_wire_bytes(jax.ShapeDtypeStruct((1024,), jnp.float32), 4, fmt=E4) == 1024


# ---------------------------------------------------------------------------------------------
# errors

def _trace(fn, x):
  return jax.make_jaxpr(jax.vmap(fn, axis_name="i"))(x)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(order="spiral"), ValueError, "order must be one of"),
    (dict(fmt=E4, order="tree", kahan=True), ValueError, "kahan=True needs"),
    (dict(fmt=E4, order="all_to_all", kahan=True), ValueError, "kahan=True needs"),
    (dict(fmt=E4, rounding="stochastic"), ValueError, "needs key"),
    (dict(fmt=F.mx(F.E4M3FN)), TypeError, "block format"),
    (dict(fmt=F.mx(F.E4M3FN), order="all_to_all", aps=True), TypeError, "aps=True needs"),
    (dict(fmt=F.hbfp(8), order="all_to_all"), TypeError, "blocks along an axis"),
    (dict(fmt="e4m3"), TypeError, "jaxlp format"),
    (dict(scatter_dimension=2), ValueError, "out of range"),
    (dict(scatter_dimension=1), ValueError, "not a multiple of the 4 workers"),
    (dict(tiled=False), ValueError, "tiled=False needs"),
])
def test_reduce_scatter_errors(kw, exc, match):
  with pytest.raises(exc, match=match):
    _trace(lambda v: jp.reduce_scatter(v, "i", **kw), jnp.zeros((4, 8, 3)))


def test_more_errors():
  with pytest.raises(ValueError, match="scalar"):
    _trace(lambda v: jp.reduce_scatter(v, "i"), jnp.zeros((4,)))
  with pytest.raises(TypeError, match="dtype"):
    _trace(lambda v: jp.reduce_scatter(v, "i"), jnp.zeros((4, 4), jnp.int32))
  with pytest.raises(ValueError, match="axis=3 is out of range"):
    _trace(lambda v: jp.all_gather(v, "i", axis=3), jnp.zeros((4, 2, 2)))
  with pytest.raises(TypeError, match="blocks along an axis"):
    _trace(lambda v: jp.all_gather(v, "i", fmt=F.qpytorch_block(8)), jnp.zeros((4, 2)))
  with pytest.raises(ValueError, match="needs key"):
    _trace(lambda v: jp.all_gather(v, "i", fmt=E4, rounding="stochastic"), jnp.zeros((4, 2)))
  with pytest.raises(TypeError, match="float32/float16/bfloat16"):
    _trace(lambda v: jp.all_gather(v, "i", fmt=E4), jnp.zeros((4, 2), jnp.int32))
  with pytest.raises(ValueError, match="block axis"):
    _trace(lambda v: jp.all_gather(v, "i", fmt=F.mx(F.E4M3FN, 2, axis=1)), jnp.zeros((4, 2)))
