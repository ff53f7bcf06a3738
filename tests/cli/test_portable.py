"""``jaxlp.training._portable``: the training-step arithmetic of ``jaxlp train --exact-blocks``
(MLP, fp32 reduction) whose every rounding is specified, so that the run has the same bits on
every backend (issue 18, item 5). Each function is checked against a numpy float32 model of
the same formula (numpy rounds each operation once: no FMA), and for accuracy against float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlp.training import TrainConfig, Trainer, build_model
from jaxlp.training import _portable as PT

f32 = np.float32


def _ulps(a, ref):
  a = np.asarray(a, np.float64)
  return np.abs(a - ref) / np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)


def _fl(x):
  """numpy model of PT.flush: subnormals to a signed zero, NaN to 0x7FC00000."""
  u = np.atleast_1d(np.asarray(x, f32)).copy().view(np.uint32)
  e = u & np.uint32(0x7F800000)
  u = np.where(e == 0, u & np.uint32(0x80000000), u)
  u = np.where((e == 0x7F800000) & ((u & 0x7FFFFF) != 0), np.uint32(0x7FC00000), u)
  return u.astype(np.uint32).view(f32).reshape(np.shape(x))


def _add(a, b):
  with np.errstate(all="ignore"):
    return _fl(_fl(a) + _fl(b))


def _mul(a, b):
  with np.errstate(all="ignore"):
    return _fl(_fl(a) * _fl(b))


def _horner_np(coeffs, r):
  p = np.full_like(r, coeffs[0])
  for c in coeffs[1:]:
    p = _add(_mul(p, r), c)
  return p


def _exp_np(x):
  """numpy float32 model of PT.exp (one rounding per operation, flushed)."""
  x = _fl(x)
  xc = np.clip(x, f32(-104), f32(89))
  k = np.round(_mul(xc, PT._LOG2E)).astype(f32)
  r = _add(_add(xc, -_mul(k, PT._LN2_HI)), -_mul(k, PT._LN2_LO))
  p = _horner_np(PT._EXP_C, r)
  with np.errstate(all="ignore"):
    e = ((p.view(np.uint32) >> 23) & 0xFF).astype(np.int64) + k.astype(np.int64)
  y = ((p.view(np.uint32) & np.uint32(0x807FFFFF))
       | (np.clip(e, 0, 255).astype(np.uint32) << 23)).view(f32)
  y = np.where(e <= 0, f32(0), np.where(e >= 255, f32(np.inf), y))
  return np.where(np.isnan(x), x, y).astype(f32)


def _log_np(x):
  """numpy float32 model of PT.log."""
  x = np.asarray(x, f32)
  bits = x.view(np.uint32)
  j = (bits >> 19) & 0xF
  hi = j >= 8
  e = ((bits >> 23) & 0xFF).astype(np.int64) - 127 + hi
  f = ((bits & 0x7FFFFF) | np.where(hi, 0x3F000000, 0x3F800000)).astype(np.uint32).view(f32)
  r = PT._LOG_R[j]
  f_hi = (f.view(np.uint32) & np.uint32(0xFFFFF000)).view(f32)
  u = _add(_add(_mul(f_hi, r), f32(-1)), _mul(_add(f, -f_hi), r))
  lp = _mul(_horner_np(PT._LOG1P_C, u), u)
  ef = e.astype(f32)
  y = _add(_mul(ef, PT._LN2_HI), _add(PT._LOG_L[j], _add(lp, _mul(ef, PT._LN2_LO))))
  e0 = (bits >> 23) & 0xFF
  ok = ((bits >> 31) == 0) & (e0 > 0) & (e0 < 255)
  return np.where(ok, y, f32(np.nan)).astype(f32)


def _no_float_multiply(f, *args):
  """No float multiply in ``f``'s program: a compiler cannot fuse one with an add (FMA)."""
  lines = [ln for ln in jax.jit(f).lower(*args).as_text().splitlines()
           if "stablehlo.multiply" in ln]
  assert lines and not [ln for ln in lines if "f32" in ln or "f16" in ln or "f64" in ln], lines


def _same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
  assert bad.size == 0, (bad[:5], a.reshape(-1)[bad[:5]], b.reshape(-1)[bad[:5]])


def test_mul_and_add_are_ieee_with_flushed_subnormals_and_one_nan():
  rng = np.random.default_rng(7)
  n = 1 << 20
  rand = lambda: rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(f32)
  near = lambda: (rng.standard_normal(n) * np.exp2(rng.integers(-70, 70, n))).astype(f32)
  special = f32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1.17549435e-38, 3.4e38,
                 -3.4e38, 1.0, -1.5, 2.0**-63, 2.0**-64, 2.0**64, -2.0**-63])
  sa, sb = np.meshgrid(special, special)
  mul, add = jax.jit(PT.mul), jax.jit(PT.add)
  for a, b in ((rand(), rand()), (near(), near()), (sa.ravel(), sb.ravel())):
    prod = mul(a, b)
    _same_bits(prod, _mul(a, b))
    _same_bits(add(a, b), _add(a, b))
  # the grid's products (read from the jitted results: no op-by-op compiles): inf * 0 is the
  # one NaN; -2**-63 * 2**-64 underflows to a signed zero
  prod = np.asarray(prod).view(np.uint32).reshape(sa.shape)  # prod[i, j] = special[j] * [i]
  assert prod[0, 2] == 0x7FC00000 and prod[13, 15] == 0x80000000
  _no_float_multiply(PT.mul, sa, sb)


def test_exp_bits_accuracy_and_edges():
  rng = np.random.default_rng(0)
  edges = f32([0.0, -0.0, np.inf, -np.inf, np.nan, 88.0, 88.5, -87.0, -87.4, -200.0])
  x = np.concatenate([np.linspace(-90, 89, 200_001, dtype=f32),
                      rng.standard_normal(50_000).astype(f32) * 4, edges])
  y = np.asarray(jax.jit(PT.exp)(x))
  _same_bits(y, _exp_np(x))
  ok = (x > -86) & (x < 88)
  assert _ulps(y[ok], np.exp(x[ok].astype(np.float64))).max() < 1.5
  e = y[-len(edges):]  # the edges, from the same jitted call (no op-by-op compiles)
  assert e[[3, 9, 8]].tolist() == [0.0, 0.0, 0.0]  # -inf, -200, -87.4
  assert np.isnan(e[4]) and e[0] == 1.0
  _no_float_multiply(PT.exp, x)


def test_log_bits_accuracy_and_edges():
  rng = np.random.default_rng(1)
  x = np.concatenate([
      np.exp(np.linspace(-85, 85, 200_001)).astype(f32),
      rng.uniform(0.5, 4, 100_000).astype(f32),
      f32(1) + np.arange(1, 4097, dtype=f32) * f32(2**-23),  # just above 1
      f32(1) - np.arange(1, 4097, dtype=f32) * f32(2**-24),  # just below 1
      f32([1.0, 2.0, 0.5, 1.17549435e-38, 3.4028235e38])])
  bad = f32([0.0, -0.0, -1.0, np.inf, np.nan, 1e-40])
  y = np.asarray(jax.jit(PT.log)(np.concatenate([x, bad])))  # one jitted call for both
  y, y_bad = y[:len(x)], y[len(x):]
  _same_bits(y, _log_np(x))
  assert _ulps(y, np.log(x.astype(np.float64))).max() < 2.5
  assert y[-5] == 0.0  # log(1.0)
  assert np.isnan(y_bad).all()
  _no_float_multiply(PT.log, x)


def _tree_np(x):
  x = list(np.asarray(x, f32))
  while len(x) > 1:
    h = len(x) // 2
    x = [_add(x[i], x[h + i]) for i in range(h)] + x[2 * h:]
  return x[0]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 128, 129])
def test_tree_sum_is_the_declared_pairwise_order(n):
  rng = np.random.default_rng(n)
  x = (rng.standard_normal((n, 5)) * np.exp2(rng.integers(-20, 20, (n, 5)))).astype(f32)
  _same_bits(jax.jit(PT.tree_sum)(x), _tree_np(x))
  _same_bits(jax.jit(PT.tree_sum, static_argnames="axis")(x.T, axis=1), _tree_np(x))
  assert PT.tree_sum(np.zeros((0, 3), f32)).shape == (3,)


def _fused_xors(f, *args):
  """How many ``xor`` ops (one per portable multiply: its sign) XLA:CPU's compiled ``f`` holds
  inside its fusions: how often the portable arithmetic is computed."""
  import re

  hlo = jax.jit(f).lower(*args).compile().as_text()
  return len(re.findall(r"= \S+ xor\(", hlo))


def test_materialize_keeps_bits_and_computes_an_expression_once():
  """``materialize``: every bit pattern comes back unchanged (NaN payloads, -0, inf,
  subnormals), and an expression read by several reductions is compiled once, not once per
  reduction (jax 0.11's CPU backend took > 10 minutes to compile the MLP's exact step
  without it)."""
  u = np.concatenate([np.arange(0, 2**32, 65537, dtype=np.uint64).astype(np.uint32),
                      np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF,
                                1, 0x807FFFFF], np.uint32)])
  got = np.asarray(jax.jit(PT.materialize)(jnp.asarray(u.view(f32)))).view(np.uint32)
  np.testing.assert_array_equal(got, u)

  # three readers (elementwise and a transpose: reductions of an unmaterialized exp are what
  # compiles slowly on jax 0.11, so this test does not build one)
  x = jnp.linspace(-3.0, 3.0, 4 * 10, dtype=jnp.float32).reshape(4, 10)
  readers = lambda g: (g * 2.0, g + 1.0, g.T)
  once = _fused_xors(lambda x: PT.exp(x) * 2.0, x)
  plain = _fused_xors(lambda x: readers(PT.exp(x)), x)
  kept = _fused_xors(lambda x: readers(PT.materialize(PT.exp(x))), x)
  assert kept <= once < plain, (once, plain, kept)  # XLA duplicates; materialize stops it


def test_the_exact_mlp_step_computes_its_portable_arithmetic_about_once():
  """The compiled ``--exact-blocks`` MLP step (XLA:CPU) holds 56 portable multiplies (one
  ``xor`` of an array each); before :func:`~jaxlp.training._portable.materialize` it held
  260, five copies of the cross-entropy's gradient fused into the exact GEMM reference's
  reductions, which jax 0.11's CPU backend took over 10 minutes to compile."""
  import math
  import re

  # width 1 and 16 rows (the count does not depend on them): the model's initialisation is the
  # program of the run below, compiled once
  cfg = TrainConfig(hbfp=8, exact_blocks=True, epochs=1, width=1, batch_size=16,
                    max_steps_per_epoch=1)
  tr = Trainer(cfg)
  assert tr.portable
  step = tr._make_train_step(tr._compressor_at(0))
  x, y = (jnp.asarray(a[:cfg.batch_size]) for a in (tr.ds.x_train, tr.ds.y_train))
  hlo = step.lower(tr.params, tr.batch_stats, tr.opt_state, tr.comp_state, x, y,
                   jax.random.fold_in(tr.step_key, 0)).compile().as_text()
  # xors of more than one element only: the scalar xors of jaxlp.formats._bits.fence (its
  # data-dependent divisor of 1, once per quantize; u32[] or, vmapped over one worker, u32[1])
  # are not portable multiplies
  def n_xor(c):
    dims = re.findall(r"= \w+\[([\d,]*)\]\S* xor\(", c)
    return sum(math.prod(int(d) for d in ds.split(",") if d) > 1 for ds in dims)

  per = [n_xor(c) for c in hlo.split("\n\n")]
  assert sum(per) <= 80 and max(per) <= 16, (sum(per), sorted(per)[-6:])


def test_cross_entropy_value_and_gradient():
  rng = np.random.default_rng(2)
  logits = (rng.standard_normal((32, 10)) * 5).astype(f32)
  labels = rng.integers(0, 10, 32).astype(np.int32)
  scale = f32(1 / 32)
  v, g = jax.jit(jax.value_and_grad(PT.cross_entropy))(logits, labels, scale)
  ref = optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float64),
                                                        labels).mean()
  assert abs(float(v) - float(ref)) <= 4 * np.spacing(f32(ref))
  # the gradient: scale * (softmax - onehot) with the portable exp, bit for bit
  m = logits.max(-1, keepdims=True)
  lse = (m + _log_np(np.stack([_tree_np(r) for r in _exp_np(logits - m)])[:, None])).astype(f32)
  onehot = (np.arange(10)[None, :] == labels[:, None]).astype(f32)
  _same_bits(g, (_exp_np(logits - lse) - onehot) * scale)
  gref = jax.jit(jax.grad(
      lambda z: optax.softmax_cross_entropy_with_integer_labels(z, labels).mean()))(logits)
  np.testing.assert_allclose(g, gref, atol=1e-7)
  _no_float_multiply(jax.value_and_grad(PT.cross_entropy), logits, labels, scale)


def _value_and_vjp(f):
  """``(primals, ct) -> (f(*primals), vjp(ct))``, to be jitted: one compiled program, not the
  op-by-op compiles of an eager ``jax.vjp``."""
  def g(primals, ct):
    out, vjp = jax.vjp(f, *primals)
    return out, vjp(ct)
  return g


def test_bias_add_gradient_is_the_tree_sum():
  rng = np.random.default_rng(3)
  y = rng.standard_normal((4, 3, 6)).astype(f32)
  b = rng.standard_normal(6).astype(f32)
  ct = rng.standard_normal((4, 3, 6)).astype(f32)
  out, (dy, db) = jax.jit(_value_and_vjp(PT.bias_add))((y, b), ct)
  _same_bits(out, y + b)
  _same_bits(dy, ct)
  _same_bits(db, _tree_np(ct.reshape(-1, 6)))


@pytest.mark.parametrize("nesterov,wd", [(False, 0.0), (True, 1e-3)])
def test_sgd_matches_optax_and_rounds_every_product_alone(nesterov, wd):
  rng = np.random.default_rng(4)
  params = {"w": rng.standard_normal((8, 4)).astype(f32), "b": np.zeros(4, f32)}
  table = f32([0.1, 0.05, 0.02])
  tx = PT.sgd(table, 0.9, nesterov=nesterov, weight_decay=wd)
  ref = optax.chain(optax.add_decayed_weights(wd),
                    optax.sgd(lambda c: jnp.asarray(table)[jnp.minimum(c, 2)], momentum=0.9,
                              nesterov=nesterov))
  s, sr, p, pr = tx.init(params), ref.init(params), params, params
  trace = jax.tree_util.tree_map(np.zeros_like, params)
  upd, ref_upd = jax.jit(tx.update), jax.jit(ref.update)
  for step in range(5):  # past the table's end: its last entry repeats
    g = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(f32), params)
    u, s = upd(g, s, p)
    ur, sr = ref_upd(g, sr, pr)
    for k in params:  # numpy model: each product rounded, then added
      lr = table[min(step, 2)]
      gk = g[k] + f32(wd) * np.asarray(p[k]) if wd else g[k]
      trace[k] = gk + f32(0.9) * trace[k]
      d = gk + f32(0.9) * trace[k] if nesterov else trace[k]
      _same_bits(u[k], -lr * d)
      np.testing.assert_allclose(u[k], ur[k], rtol=1e-5, atol=1e-7)
    p, pr = optax.apply_updates(p, u), optax.apply_updates(pr, ur)
  assert int(s["count"]) == 5
  _no_float_multiply(tx.update, g, s, p)


def test_sum_over_a_named_axis_is_the_tree_sum_on_every_worker():
  rng = np.random.default_rng(5)
  x = (rng.standard_normal((5, 7)) * np.exp2(rng.integers(-20, 20, (5, 7)))).astype(f32)
  out = jax.jit(jax.vmap(lambda a: PT.sum_over_axis(a, "w"), axis_name="w"))(x)
  for row in np.asarray(out):
    _same_bits(row, _tree_np(x))


def test_trainer_uses_the_portable_mode_only_where_it_is_complete():
  toy = dict(epochs=1, batch_size=16, width=1, max_steps_per_epoch=1, quiet=True)
  assert Trainer(TrainConfig(hbfp=8, exact_blocks=True, nodes=3, batch_size=48,
                             **{k: v for k, v in toy.items() if k != "batch_size"})).portable
  assert Trainer(TrainConfig(hbfp=8, exact_blocks=True, model="cnn", **toy)).portable
  for extra in ({"lars": True}, {"grad_exp": 5, "grad_man": 2}, {"compress": "onebit"}):
    assert not Trainer(TrainConfig(hbfp=8, exact_blocks=True, **toy, **extra)).portable
  assert not Trainer(TrainConfig(hbfp=8, **toy)).portable
  with pytest.raises(ValueError, match="portable=True is implemented for the mlp and the cnn"):
    build_model("resnet18", 10, portable=True)


def test_spatial_mean_and_its_gradient():
  rng = np.random.default_rng(6)
  x = rng.standard_normal((2, 3, 5, 4)).astype(f32)
  ct = rng.standard_normal((2, 4)).astype(f32)
  y, (dx,) = jax.jit(_value_and_vjp(PT.mean_over_spatial))((x,), ct)
  inv = f32(1 / 15)
  ref = np.stack([np.stack([_mul(_tree_np(x[n].reshape(15, 4)[:, c]), inv) for c in range(4)])
                  for n in range(2)])
  _same_bits(y, ref.astype(f32))
  _same_bits(dx, np.broadcast_to(_mul(ct, inv)[:, None, None, :], x.shape))
  np.testing.assert_allclose(y, x.mean((1, 2)), rtol=1e-6)


def test_portable_cnn_has_flax_params_and_the_exact_logits():
  """The portable CNN (its own Conv/Dense with portable bias adds, the portable spatial mean)
  has the parameters of the flax CNN and, with the exact block policy, the same logits."""
  import jaxlp
  from jaxlp.training._loop import _policy

  pol = _policy(TrainConfig(hbfp=8, exact_blocks=True))
  kw = dict(dot_general=jaxlp.dot_general(pol),
            conv_general_dilated=jaxlp.conv_general_dilated(pol))
  a = build_model("cnn", 10, width=2, **kw)
  b = build_model("cnn", 10, width=2, portable=True, **kw)
  x = jnp.asarray(np.random.default_rng(0).uniform(0, 1, (4, 8, 8, 1)).astype(f32))
  # initialised without the policy (a dot_general/conv hook makes no parameter; the Trainer
  # initialises the plain model too): init traces the forward pass, and the quantized one
  # costs as much as the apply below
  pa, pb = (jax.jit(build_model("cnn", 10, width=2, portable=p).init)(jax.random.key(0), x)
            for p in (False, True))
  assert jax.tree_util.tree_structure(pa) == jax.tree_util.tree_structure(pb)
  for u, v in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)):
    _same_bits(u, v)
  _same_bits(jax.jit(b.apply)(pb, x), jax.jit(a.apply)(pa, x))


# XLA's optimizations off (tests/conftest.py, ``fast_compile``): both runs compiled alike, and
# compared with each other only. The exact block dots' bits against the emulation's from a
# normally compiled program: tests/cli/test_exact_blocks.py
# (test_mlp_exact_blocks_matches_the_emulation_on_the_toy_run); the portable arithmetic
# against its numpy model, normally compiled: the tests above.
@pytest.mark.usefixtures("fast_compile")
def test_portable_run_with_workers_schedule_and_decay_agrees_with_optax_closely():
  """3 workers (tree sum over the worker axis), the triangle schedule (a learning-rate
  table) with nesterov momentum, weight decay: the portable run (``--hbfp 8 --exact-blocks``)
  and the XLA run of the same configuration, whose GEMMs are the same. Documented (README,
  "Block formats on tensor cores"): on the digits MLP every sum of block products fits
  float32's 24 bits, so the exact block dots give the emulation's bits: the same initial
  parameters and the same logits from them. The portable loss, softmax, sums and update stay
  within a few ulps of XLA's over the first epoch, with the same accuracy, and within float32
  rounding after the second. (``--policy mxint8``'s init and logits:
  tests/cli/test_exact_blocks.py.)"""
  from jaxlp.training._loop import _policy

  cfg = dict(hbfp=8, nodes=3, batch_size=48, epochs=2, width=1, max_steps_per_epoch=3,
             schedule="triangle", warmup_epochs=1, weight_decay=1e-3, quiet=True)
  assert _policy(TrainConfig(exact_blocks=True, **cfg)).block_dot == "exact"
  tp = Trainer(TrainConfig(exact_blocks=True, **cfg))
  te = Trainer(TrainConfig(**cfg))
  assert tp.portable and not te.portable
  for a, b in zip(jax.tree_util.tree_leaves(tp.params), jax.tree_util.tree_leaves(te.params),
                  strict=True):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()  # the same init
  x = te.ds.x_train[:128]
  lp = np.asarray(jax.jit(tp.model.apply)({"params": tp.params}, x))
  le = np.asarray(jax.jit(te.model.apply)({"params": te.params}, x))
  assert lp.tobytes() == le.tobytes()
  mp, me = tp.run_epoch(), te.run_epoch()
  np.testing.assert_allclose(mp["train_loss"], me["train_loss"], rtol=2e-6)
  assert mp["test_accuracy"] == me["test_accuracy"]
  mp, me = tp.run_epoch(), te.run_epoch()
  np.testing.assert_allclose(mp["train_loss"], me["train_loss"], rtol=1e-4)
  for a, b in zip(jax.tree_util.tree_leaves(tp.params), jax.tree_util.tree_leaves(te.params)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
