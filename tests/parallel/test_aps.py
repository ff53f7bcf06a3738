"""APS, CPD's two-level emulated-node reduction, emulate, reduce_gradients, lars."""

import sys
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlp import formats as F
from jaxlp.optim import lars
from jaxlp.parallel import emulate, psum, psum_two_level, reduce_gradients
from jaxlp.parallel._aps import ceil_log2_times, format_emax

sys.path.insert(0, str(Path(__file__).parent))
import oracle  # noqa: E402
from test_psum import assert_rows_equal, bits, data, sharded, two_level, vmapped  # noqa: E402


def test_ceil_log2_times_exact():
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.normal(size=300).astype(np.float32),
                      np.float32([1.3333334, 2.0**-149, 3e-39, 1.0, 0.75, 3.4e38 / 7]),
                      rng.integers(1, 2**23, 50).astype(np.uint32).view(np.float32)])
  x = np.abs(x[x != 0])
  for w in (1, 2, 3, 5, 6, 7, 12, 100, 1000, 65535):
    got = np.asarray(jax.jit(ceil_log2_times, static_argnums=1)(
        jnp.asarray(x).view(jnp.uint32), w))
    ref = [oracle.ceil_log2_exact(Fraction(float(v)) * w) for v in x]
    np.testing.assert_array_equal(got, ref, err_msg=f"W={w}")
  # float32 log2 of the rounded product would be wrong here: 1.3333334 * 3 -> 4 in float32.
  assert oracle.ceil_log2_exact(Fraction(float(np.float32(1.3333334))) * 3) == 3


@pytest.mark.parametrize("order,kahan", [("chain", False), ("ring", False), ("ring", True),
                                         ("tree", False)])
@pytest.mark.parametrize("fmt", [F.E4M3, F.cpd_float(3, 0)], ids=str)
def test_aps_matches_oracle(order, kahan, fmt):
  w = 5
  gs = data(w, 23, seed=2, scale=1e-3)
  f = vmapped(lambda x: psum(x, "i", fmt=fmt, order=order, kahan=kahan, aps=True), w)
  q = oracle.Q(fmt)
  summer = {"chain": lambda p: oracle.chain(p, q, kahan),
            "ring": lambda p: oracle.ring(p, q, kahan),
            "tree": lambda p: oracle.tree(p, q)}[order]
  assert_rows_equal(f(gs), oracle.aps_sum(gs, fmt, summer, q))


def test_aps_shard_map_and_two_level():
  gs = data(8, 31, seed=3, scale=1e-5)
  q = oracle.Q(F.E4M3)
  ref = oracle.aps_sum(gs, F.E4M3, lambda p: oracle.ring(p, q), q)
  fn = lambda ax: lambda x: psum(x, ax, fmt=F.E4M3, order="ring", aps=True)  # noqa: E731
  assert_rows_equal(sharded(fn("dev"))(gs), ref)
  assert_rows_equal(two_level(fn(("dev", "emu")), 4, 2)(gs), ref)


@pytest.mark.usefixtures("fast_compile")  # ranges, not bits
@pytest.mark.parametrize("fmt", [F.E4M3, F.FloatFormat(3, 0, subnormals=False),
                                 F.cpd_float(3, 0)], ids=str)
def test_aps_recovers_underflowing_gradients(fmt):
  w = 4
  gs = (np.random.default_rng(4).uniform(0.5, 1.0, size=(w, 50)) * 1e-6).astype(np.float32)
  plain = np.asarray(vmapped(lambda x: psum(x, "i", fmt=fmt, order="chain"), w)(gs))[0]
  scaled = np.asarray(vmapped(lambda x: psum(x, "i", fmt=fmt, order="chain", aps=True), w)(gs))[0]
  assert np.all(plain == 0)
  rel = np.abs(scaled - gs.sum(0)) / gs.sum(0)
  assert np.all(rel < (0.75 if fmt.man_bits == 0 else 0.2)) and np.all(scaled > 0)


@pytest.mark.usefixtures("fast_compile")  # zeros, NaN and finiteness, not bits
def test_aps_zero_leaf_and_nonfinite():
  w = 3
  tree = {"z": np.zeros((w, 4), np.float32), "bad": data(w, 5), "ok": data(w, 6, seed=5)}
  tree["bad"][1, 2] = np.inf
  out = vmapped(lambda t: psum(t, "i", fmt=F.E5M2, order="ring", aps=True), w)(tree)
  assert np.array_equal(bits(out["z"]), np.zeros((w, 4), np.uint32))
  assert np.all(np.isnan(out["bad"]))
  assert np.all(np.isfinite(out["ok"]))


def test_aps_subnormal_gradients_no_subnormal_format():
  # float32-subnormal gradients: exact exponent from the bits, exact scaling.
  w = 2
  gs = (np.random.default_rng(6).integers(1, 2**20, size=(w, 9)).astype(np.uint32)
        .view(np.float32))
  f = vmapped(lambda x: psum(x, "i", fmt=F.FloatFormat(4, 3, subnormals=False),
                             order="chain", aps=True), w)
  q = oracle.Q(F.FloatFormat(4, 3, subnormals=False))
  ref = oracle.aps_sum(gs, F.FloatFormat(4, 3, subnormals=False), lambda p: oracle.chain(p, q), q)
  assert np.count_nonzero(ref) > 5
  assert_rows_equal(f(gs), ref)


def test_format_emax():
  assert format_emax(F.E4M3) == 7 and format_emax(F.E4M3FN) == 8
  assert format_emax(F.cpd_float(3, 0)) == 3 and format_emax(F.cpd_float(5, 2)) == 15


# -- CPD two-level (emulated nodes) ----------------------------------------------------------

def _two_level_oracle(gs, ndev, nemu, fmt, aps):
  q = oracle.Q(fmt)
  idx = None
  combined = []
  for d in range(ndev):
    sub = gs[d * nemu:(d + 1) * nemu]
    idx = np.arange(sub.shape[1], dtype=np.uint32)
    shift = 0
    if aps:
      a = [oracle.ceil_log2_exact(Fraction(float(np.max(np.abs(g)))) * nemu)
           if np.any(g) else -100 for g in sub]
      amax = max(a)
      shift = 0 if amax == -100 else format_emax(fmt) - amax
    pre = [q((g.astype(np.float64) * 2.0**shift).astype(np.float32), idx, 0, 0) for g in sub]
    r = np.zeros_like(pre[0])
    for p in pre:
      r = q((r + p).astype(np.float32), idx, 0, 0)
    combined.append((r.astype(np.float64) * 2.0**-shift).astype(np.float32))
  combined = np.stack(combined)
  if aps:
    return oracle.aps_sum(combined, fmt, lambda p: oracle.chain(p, q), q)
  return oracle.chain(combined, q)


@pytest.mark.parametrize("aps", [False, True])
def test_two_level_matches_cpd_oracle(aps):
  ndev, nemu = 4, 2
  gs = data(ndev * nemu, 15, seed=7, scale=1e-4)
  gs[0:2, :3] = 0.0  # all-zero sub-gradients on one rank's elements -> sentinel path
  f = two_level(lambda x: psum_two_level(x, "emu", "dev", fmt=F.cpd_float(4, 3), aps=aps),
                ndev, nemu)
  assert_rows_equal(f(gs), _two_level_oracle(gs, ndev, nemu, F.cpd_float(4, 3), aps))


# -- emulate / reduce_gradients / lars -------------------------------------------------------

def _loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


def test_emulate_reduce_gradients_equals_full_batch_mean():
  rng = np.random.default_rng(8)
  x = rng.normal(size=(32, 3)).astype(np.float32)
  y = rng.normal(size=(32,)).astype(np.float32)
  w = np.float32([0.5, -1.0, 2.0])
  tx = reduce_gradients("node", fmt=None)

  def step(w, batch):
    g = jax.grad(_loss)(w, batch)
    upd, _ = tx.update(g, tx.init(w))
    return upd

  out = jax.jit(emulate(step, 4, "node"))(w, (x, y))
  full = jax.grad(_loss)(w, (x, y))
  assert out.shape == (4, 3)
  np.testing.assert_allclose(out[0], full, rtol=1e-5, atol=1e-6)
  for row in np.asarray(out):
    np.testing.assert_array_equal(bits(row), bits(out[0]))


def test_reduce_gradients_mean_divides_before_sum():
  w = 4
  gs = data(w, 11, seed=9, scale=1e-2)
  tx = reduce_gradients("i", fmt=F.E5M2, order="chain")
  f = vmapped(lambda g: tx.update({"g": g}, tx.init({"g": g}))[0]["g"], w)
  q = oracle.Q(F.E5M2)
  assert_rows_equal(f(gs), oracle.chain(gs / np.float32(w), q))


@pytest.mark.usefixtures("fast_compile")  # a count and a difference, not bits
def test_reduce_gradients_stochastic_state_advances():
  w = 2
  gs = data(w, 64, seed=10)
  tx = reduce_gradients("i", fmt=F.E4M3, rounding="stochastic", key=jax.random.key(1))

  def two_steps(g):
    st = tx.init(g)
    a, st = tx.update(g, st)
    b, st = tx.update(g, st)
    return a, b, st.count

  a, b, count = vmapped(two_steps, w)(gs)
  assert int(count[0]) == 2
  assert not np.array_equal(bits(a[0]), bits(b[0]))


def _lars_ref(w, g, buf, lr, mom=0.9, wd=1e-4, eta=0.001):
  wn, gn = np.linalg.norm(w), np.linalg.norm(g)
  local = eta * wn / (gn + wd * wn)
  buf = mom * buf + lr * local * (g + wd * w)
  return w - buf, buf


@pytest.mark.usefixtures("fast_compile")  # a tolerance, not bits
def test_lars_matches_cpd_and_guards_zero():
  rng = np.random.default_rng(11)
  params = {"a": rng.normal(size=(4, 3)).astype(np.float32), "z": np.zeros(3, np.float32)}
  tx = lars(0.1)
  st = tx.init(params)
  p = params
  wa, ba = params["a"].astype(np.float64), np.zeros((4, 3))
  for _ in range(3):
    g = {"a": rng.normal(size=(4, 3)).astype(np.float32), "z": np.zeros(3, np.float32)}
    upd, st = tx.update(g, st, p)
    p = optax.apply_updates(p, upd)
    wa, ba = _lars_ref(wa, g["a"].astype(np.float64), ba, 0.1)
  np.testing.assert_allclose(p["a"], wa, rtol=1e-5)
  assert np.array_equal(p["z"], np.zeros(3, np.float32))  # 0/0 guarded: no NaN
