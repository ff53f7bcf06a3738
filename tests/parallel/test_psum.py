"""Bit-exact tests of jaxlp.parallel.psum against numpy oracles in every execution mode."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlp import formats as F
from jaxlp.parallel import _arith, psum
from jaxlp.parallel._codec import codec_for

sys.path.insert(0, str(Path(__file__).parent))
import oracle  # noqa: E402

NOSUB = F.FloatFormat(4, 3, subnormals=False)


def bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def assert_rows_equal(out, ref):
  """Every worker's row equals the oracle bit for bit (NaN-aware: any NaN matches NaN)."""
  out = np.asarray(out, np.float32).reshape(out.shape[0], -1)
  ref = np.asarray(ref, np.float32).reshape(-1)
  for row in out:
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(row), nan)
    np.testing.assert_array_equal(bits(row)[~nan], bits(ref)[~nan])


def vmapped(fn, w):
  return jax.jit(jax.vmap(fn, axis_name="i"))


def cpu_mesh(ndev, name):
  """A 1-D mesh over the first ``ndev`` forced CPU devices (tests/conftest.py forces 8).

  Not ``jax.make_mesh((ndev,), ...)``: that takes the default backend's devices, which is a
  single GPU under ``JAX_PLATFORMS=cuda,cpu`` on a one-GPU machine.
  """
  devs = jax.devices("cpu")
  if len(devs) < ndev:
    pytest.fail(f"need {ndev} CPU devices (tests/conftest.py forces 8), found {len(devs)}")
  return jax.make_mesh((ndev,), (name,), devices=devs[:ndev])


def sharded(fn, ndev=8, name="dev"):
  mesh = cpu_mesh(ndev, name)

  def body(x):
    return jax.tree_util.tree_map(lambda a: a[None], fn(x[0]))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(name), out_specs=P(name),
                            check_vma=False))
  return lambda g: f(_put(g, mesh, name))


def _put(g, mesh, name):
  return jax.device_put(jnp.asarray(g), jax.sharding.NamedSharding(mesh, P(name)))


def two_level(fn, ndev, nemu):
  """devices x emulated nodes: shard_map over 'dev', vmap over 'emu' inside."""
  mesh = cpu_mesh(ndev, "dev")

  def body(x):  # x: [1, nemu, n]
    return jax.tree_util.tree_map(lambda a: a[None], jax.vmap(fn, axis_name="emu")(x[0]))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dev"), out_specs=P("dev"),
                            check_vma=False))
  def run(g):
    out = f(_put(g.reshape((ndev, nemu) + g.shape[1:]), mesh, "dev"))
    return jax.tree_util.tree_map(lambda a: a.reshape(g.shape), out)
  return run


def data(w, n, seed=0, scale=1.0):
  return (np.random.default_rng(seed).normal(size=(w, n)) * scale).astype(np.float32)


def ref_of(order, gs, fmt, kahan=False, rounding="nearest", key=None):
  q = oracle.Q(fmt, rounding, key)
  if order == "chain":
    return oracle.chain(gs, q, kahan)
  if order == "ring":
    return oracle.ring(gs, q, kahan)
  return oracle.tree(gs, q)


CASES = [  # (order, kahan)
    ("chain", False), ("chain", True), ("ring", False), ("ring", True), ("tree", False)]


def check_cases(out, cases, gs):
  """``out[name]`` (every worker's row) == the oracle of ``cases[name]`` = (fmt, order,
  kahan), the case named in the failure message."""
  for name, (fmt, order, kahan) in cases.items():
    try:
      assert_rows_equal(out[name], ref_of(order, gs, fmt, kahan))
    except AssertionError as e:
      raise AssertionError(f"case {name}: {e}") from None


def folded(cases, axis):
  """fn(x) -> {name: psum of x for that case}: every case is an output of one program."""
  return lambda x: {name: psum(x, axis, fmt=fmt, order=order, kahan=kahan)
                    for name, (fmt, order, kahan) in cases.items()}


# one vmap program for every (format, order, kahan) case: W = 6 (padding: n = 17 is not a
# multiple of 6); ring with FNUZ, BF16, E2M1FN (formats without infinities, or with float32's
# exponent range and few mantissa bits, or no subnormal codes)
VMAP_CASES = {f"{fmt}-{order}-{kahan}": (fmt, order, kahan)
              for fmt in (F.E4M3, F.cpd_float(3, 0), NOSUB) for order, kahan in CASES}
VMAP_CASES.update({f"{fmt}-ring-False": (fmt, "ring", False)
                   for fmt in (F.E4M3FNUZ, F.BF16, F.E2M1FN)})


def test_vmap_matches_oracle():
  gs = data(6, 17, seed=1)
  check_cases(vmapped(folded(VMAP_CASES, "i"), 6)(gs), VMAP_CASES, gs)


@pytest.mark.parametrize("w", [1, 2, 3, 5])
def test_worker_counts_and_padding(w):
  gs = data(w, 7, seed=w)
  cases = {order: (F.E5M2, order, False) for order in ("chain", "ring", "tree")}
  check_cases(vmapped(folded(cases, "i"), w)(gs), cases, gs)


def test_shard_map_8_devices():
  gs = data(8, 21, seed=3)
  cases = {f"{order}-{kahan}": (F.E4M3, order, kahan) for order, kahan in CASES}
  check_cases(sharded(folded(cases, "dev"))(gs), cases, gs)


def test_devices_times_emulated_nodes():
  ndev, nemu = 4, 3  # W = 12, device-major
  gs = data(ndev * nemu, 29, seed=4)
  cases = {f"{order}-{kahan}": (F.E5M2, order, kahan)
           for order, kahan in [("chain", False), ("ring", False), ("ring", True),
                                ("tree", False)]}
  two = two_level(lambda x: folded(cases, ("dev", "emu"))(x), ndev, nemu)
  check_cases(two(gs), cases, gs)


def test_pmap():
  gs = data(8, 10, seed=5)
  # over the 8 forced CPU devices (jax.pmap's default is the default backend's devices)
  f = jax.pmap(lambda x: psum(x, "p", fmt=F.E4M3, order="ring"), axis_name="p",
               devices=jax.devices("cpu")[:8])
  assert_rows_equal(f(gs), ref_of("ring", gs, F.E4M3))


@pytest.mark.parametrize("order,kahan", [("chain", False), ("ring", True), ("tree", False)])
def test_stochastic_same_in_vmap_shard_map_and_oracle(order, kahan):
  key = jax.random.key(7)
  gs = data(8, 19, seed=6)
  fn = functools.partial(psum, fmt=F.E4M3, order=order, kahan=kahan, rounding="stochastic")
  ref = ref_of(order, gs, F.E4M3, kahan, "stochastic", key)
  # the key is an input of the vmap program: the check with another key below reuses it
  vm = jax.jit(jax.vmap(lambda x, k: fn(x, "i", key=k), in_axes=(0, None), axis_name="i"))
  assert_rows_equal(vm(gs, key), ref)
  if order == "ring":
    assert_rows_equal(sharded(lambda x: fn(x, "dev", key=key))(gs), ref)
    assert_rows_equal(two_level(lambda x: fn(x, ("dev", "emu"), key=key), 2, 4)(gs), ref)
  # The noise matters: a different key changes some bits.
  other = vm(gs, jax.random.key(8))
  assert not np.array_equal(bits(other[0]), bits(ref))


def test_pytree_scalars_and_dtypes():
  w = 3
  rng = np.random.default_rng(8)
  tree = {"s": rng.normal(size=(w,)).astype(np.float32),
          "m": rng.normal(size=(w, 2, 5)).astype(np.float32),
          "h": jnp.asarray(rng.normal(size=(w, 4)), jnp.bfloat16),
          "z": np.zeros((w, 0), np.float32)}
  f = vmapped(lambda t: psum(t, "i", fmt=F.E4M3, order="ring"), w)
  out = f(tree)
  assert out["h"].dtype == jnp.bfloat16 and out["s"].shape == (w,)
  assert out["z"].shape == (w, 0)
  for name in ("s", "m", "h"):
    gs = np.asarray(jnp.asarray(tree[name]).astype(jnp.float32)).reshape(w, -1)
    q = oracle.Q(F.E4M3, leaf=0)
    assert_rows_equal(np.asarray(out[name].astype(jnp.float32)).reshape(w, -1),
                      oracle.ring(gs, q))


@pytest.mark.parametrize("order,kahan,aps,rounding", [
    ("ring", True, True, "stochastic"), ("ring", False, False, "nearest"),
    ("chain", True, True, "stochastic"), ("tree", False, True, "nearest"),
    ("tree", False, False, "stochastic")])
def test_a_tree_of_leaves_sums_each_leaf_as_alone(order, kahan, aps, rounding):
  # psum sums the leaves side by side in one bucket: every leaf must still have the bits of
  # its own sum (its chunks, noise keys, flat indices, APS shift and non-finite policy),
  # with an empty leaf and leaves shorter than, equal to and longer than W in between
  w, key = 3, jax.random.key(5)
  rng = np.random.default_rng(11)
  sizes = (7, 0, 1, 3, 10, 2)
  gs = [(rng.normal(size=(w, n)) * 10.0 ** rng.integers(-6, 2)).astype(np.float32)
        for n in sizes]
  gs[4][1, 3] = np.inf  # this leaf is NaN everywhere, the others are not
  fn = vmapped(lambda t: psum(t, "i", fmt=F.E4M3, order=order, kahan=kahan, aps=aps,
                              rounding=rounding, key=key), w)
  out = fn(gs)
  for l, g in enumerate(gs):
    if not g.size:
      assert out[l].shape == (w, 0)
      continue
    q = oracle.Q(F.E4M3, rounding, key if rounding == "stochastic" else None, leaf=l)
    summer = functools.partial(oracle.psum_full, order, q=q, kahan=kahan)
    ref = oracle.aps_sum(g, F.E4M3, summer, q) if aps else summer(g)
    if not np.all(np.isfinite(ref)):
      ref = np.full_like(ref, np.nan)
    assert_rows_equal(out[l], ref)
  assert np.isnan(np.asarray(out[4])).all() and not np.isnan(np.asarray(out[0])).any()


def test_native_identical_and_close():
  gs = data(8, 33, seed=9)
  out = np.asarray(sharded(lambda x: psum(x, "dev", fmt=F.BF16, order="native"))(gs))
  for row in out:
    np.testing.assert_array_equal(bits(row), bits(out[0]))
  np.testing.assert_allclose(out[0], gs.sum(0), rtol=2e-2, atol=1e-2)


def test_errors():
  with pytest.raises(ValueError, match="order"):
    vmapped(lambda x: psum(x, "i", fmt=F.E4M3, order="spiral"), 2)(np.ones((2, 3), np.float32))
  with pytest.raises(ValueError, match="kahan"):
    vmapped(lambda x: psum(x, "i", fmt=F.E4M3, order="tree", kahan=True), 2)(
        np.ones((2, 3), np.float32))
  with pytest.raises(ValueError, match="key"):
    vmapped(lambda x: psum(x, "i", fmt=F.E4M3, rounding="stochastic"), 2)(
        np.ones((2, 3), np.float32))
  with pytest.raises(TypeError, match="elementwise"):
    vmapped(lambda x: psum(x, "i", fmt=F.hbfp(8)), 2)(np.ones((2, 3), np.float32))
  with pytest.raises(TypeError, match="dtype"):
    vmapped(lambda x: psum(x, "i", fmt=F.E4M3), 2)(np.ones((2, 3), np.int32))


# -- subnormal float32 arithmetic -----------------------------------------------------------

def _subnormal_pairs():
  rng = np.random.default_rng(10)
  raw = rng.integers(0, 2**32, size=(2, 4000), dtype=np.uint64).astype(np.uint32)
  a, b = raw.view(np.float32)
  # Force many tiny magnitudes (subnormal and near the threshold) of both signs.
  tiny = (rng.integers(0, 2**24, size=(2, 4000)) | (rng.integers(0, 2, size=(2, 4000)) << 31))
  t = tiny.astype(np.uint32).view(np.float32)
  a = np.concatenate([a, t[0], t[0], np.float32([2**-100, -(2**-100), 1e-45, 0.0, -0.0])])
  b = np.concatenate([b, t[1], -t[0], np.float32([-(2**-100) + 2**-120, 3e-39, -1e-45, -0.0,
                                                  -0.0])])
  return a, b


def test_add_f32_is_ieee_with_subnormals():
  a, b = _subnormal_pairs()
  fin = np.isfinite(a) & np.isfinite(b)
  a, b = a[fin], b[fin]
  with np.errstate(over="ignore"):
    ref = a + b
  got = np.asarray(jax.jit(_arith.add_f32)(a, b))
  np.testing.assert_array_equal(bits(got), bits(ref))
  # The plain XLA:CPU add really does flush subnormals (the reason add_f32 exists). A fact
  # about XLA:CPU, so it is checked on the CPU device whatever the default backend is.
  cpu = jax.devices("cpu")[0]
  plain = np.asarray(jax.jit(jnp.add)(jax.device_put(a, cpu), jax.device_put(b, cpu)))
  assert not np.array_equal(bits(plain), bits(ref))


def test_scale_pow2_matches_float64():
  rng = np.random.default_rng(11)
  x = np.concatenate([rng.normal(size=500).astype(np.float32),
                      (rng.integers(1, 2**23, 500).astype(np.uint32)).view(np.float32)])
  for s in (-150, -100, -30, -1, 0, 1, 40, 150, 270):
    with np.errstate(over="ignore"):
      ref = (x.astype(np.float64) * 2.0**s).astype(np.float32)
    got = np.asarray(jax.jit(_arith.scale_pow2)(x, jnp.int32(s)))
    np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"s={s}")


def test_subnormal_partial_sums_bf16():
  # BF16 keeps float32's exponent range, so partial sums are float32 subnormals.
  w = 4
  gs = (np.random.default_rng(12).normal(size=(w, 40)) * 1e-39).astype(np.float32)
  cases = {order: (F.BF16, order, False) for order in ("chain", "ring", "tree")}
  for name, (fmt, order, _) in cases.items():
    assert np.count_nonzero(ref_of(order, gs, fmt)) > 30, name
  check_cases(vmapped(folded(cases, "i"), w)(gs), cases, gs)


# -- wire payload ---------------------------------------------------------------------------

CODEC_CASES = [
    (F.E4M3, np.uint8), (F.E5M2, np.uint8), (F.E4M3FN, np.uint8), (F.E4M3FNUZ, np.uint8),
    (F.E2M1FN, np.uint8), (F.cpd_float(4, 3), np.uint8), (F.cpd_float(3, 0), np.uint8),
    (NOSUB, np.uint8), (F.BF16, np.uint16), (F.FP16, np.uint16), (F.qpytorch_float(5, 2),
                                                                   np.uint16)]


def test_codec_roundtrip():
  """Every elementwise wire format's codec: its code dtype, and decode(encode(q)) == q bit for
  bit (specials, signed zeros; CPD's finite rounding-overflow value). One program encodes and
  decodes every format."""
  rng = np.random.default_rng(13)
  x = np.concatenate([rng.normal(size=3000) * 10.0 ** rng.integers(-12, 6, size=3000),
                      [0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30, 1e-30]])
  xq = {}
  for fmt, dtype in CODEC_CASES:
    codec = codec_for(fmt)
    assert codec is not None and codec.dtype == dtype, fmt
    q = F.quantize(jnp.asarray(x, jnp.float32), fmt)
    if isinstance(fmt, F.CPDFloat):  # include CPD's finite rounding-overflow value 2^(bias+1)
      q = jnp.concatenate([q, jnp.float32([2.0 ** (fmt.bias + 1), -2.0 ** (fmt.bias + 1)])])
    xq[str(fmt)] = q

  @jax.jit
  def roundtrip(xq):
    out = {}
    for fmt, _ in CODEC_CASES:
      code = codec_for(fmt).encode(xq[str(fmt)])
      out[str(fmt)] = (code, codec_for(fmt).decode(code))
    return out

  out = roundtrip(xq)
  for fmt, dtype in CODEC_CASES:
    code, back = out[str(fmt)]
    assert code.dtype == dtype, fmt
    back, ref = np.asarray(back), np.asarray(xq[str(fmt)])
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(back), nan, err_msg=str(fmt))
    np.testing.assert_array_equal(bits(back)[~nan], bits(ref)[~nan], err_msg=str(fmt))


def test_ring_hlo_sends_bytes():
  # XLA:CPU HLO of a mesh of the 8 forced CPU devices (inputs committed to them)
  mesh = cpu_mesh(8, "dev")
  hlo = jax.jit(jax.shard_map(lambda x: psum(x[0], "dev", fmt=F.E4M3, order="ring")[None],
                              mesh=mesh, in_specs=P("dev"), out_specs=P("dev"),
                              check_vma=False))
  hlo = hlo.lower(_put(data(8, 64), mesh, "dev")).compile().as_text()
  perms = [ln for ln in hlo.splitlines() if "collective-permute" in ln and "=" in ln]
  assert perms and all("u8[" in ln for ln in perms if "start" in ln or "permute(" in ln)
  assert "f32[" not in " ".join(ln.split("=")[1][:30] for ln in perms)
  gathers = [ln for ln in hlo.splitlines() if " all-gather(" in ln]
  assert gathers and all("= u8[" in ln for ln in gathers)
