"""The named recipes (nvfp4_recipe, mxfp8_recipe, bf16_policy): their policy structure, 2-D
weight tiles (W and W^T quantize alike, in dot_general and conv), stochastic rounding only
on the chosen operands (every GEMM output rebuilt bit for bit from explicitly quantized
operands with controlled keys), per-layer BF16 ends through quantize_model, a Flax model
training under the recipe, and the ``jaxlp train --policy`` names."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxlp
from jaxlp import formats as F
from jaxlp.ops import RHT, Quant

RNG = np.random.default_rng(2509)
DIMS = (((1,), (0,)), ((), ()))


def _same_bits(a, b, msg=""):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=msg)
  ok = ~np.isnan(a)
  np.testing.assert_array_equal(a.view(np.uint32)[ok], b.view(np.uint32)[ok], err_msg=msg)


@pytest.mark.parametrize("tiles, sr, rht", list(itertools.product((False, True), repeat=3)))
def test_nvfp4_recipe_structure(tiles, sr, rht):
  p = jaxlp.nvfp4_recipe(weight_tiles=tiles, stochastic_gradients=sr, rht=rht)
  one_d, grad_r = F.nvfp4(), "stochastic" if sr else "nearest"
  assert p.lhs == Quant(one_d) and p.drhs_lhs == Quant(one_d)
  assert p.grad == Quant(one_d, grad_r) and p.drhs_grad == Quant(one_d, grad_r)
  if tiles:
    assert p.rhs == Quant(F.nvfp4(tile=16)) and p.dlhs_rhs == "fwd"
  else:
    assert p.rhs == Quant(one_d) and p.dlhs_rhs == Quant(one_d)
  assert p.rht == (RHT(("drhs",), 16, 0) if rht else None)
  assert p.stochastic == sr and p.block_dot is None and p.layout == "auto"
  assert jaxlp.nvfp4_recipe(rht_seed=5, rht_size=64).rht == RHT(("drhs",), 64, 5)
  with pytest.raises(ValueError, match="size"):
    jaxlp.nvfp4_recipe(rht_size=8)


def test_mxfp8_recipe_and_bf16_policy_structure():
  for rule in ("rceil", "floor", "even", "ceil"):
    p = jaxlp.mxfp8_recipe(rule)
    q = Quant(F.mx(F.E4M3FN, 32, scale_rule=rule))
    assert (p.lhs, p.rhs, p.grad, p.dlhs_rhs, p.drhs_lhs, p.drhs_grad) == (q,) * 6
  assert jaxlp.mxfp8_recipe("floor") == jaxlp.mx_policy(F.E4M3FN)
  assert jaxlp.mxfp8_recipe().lhs.fmt.scale_rule == "rceil"
  assert jaxlp.mxfp8_recipe(grad_fmt=F.E5M2).grad == Quant(F.mx(F.E5M2, 32,
                                                                 scale_rule="rceil"))
  with pytest.raises(ValueError, match="scale_rule"):
    jaxlp.mxfp8_recipe("round")
  b = jaxlp.bf16_policy()
  assert (b.lhs, b.rhs, b.grad) == (Quant(F.BF16),) * 3
  assert (b.dlhs_rhs, b.drhs_lhs, b.drhs_grad) == ("fwd", "fwd", "grad")


# -- 2-D weight tiles ----------------------------------------------------------------------
def test_weight_tiles_quantize_w_and_its_transpose_alike():
  w = jnp.asarray(RNG.standard_normal((48, 40)).astype(np.float32) * 3)
  w = w.at[5, 7].set(900.0)  # an outlier: only its tile gets the large scale
  fmt = F.nvfp4(tile=16)
  _same_bits(F.quantize(w, fmt).T, F.quantize(w.T, fmt))
  # 1-D blocks do not: blocks along rows of W are columns of W^T
  assert not np.array_equal(np.asarray(F.quantize(w, F.nvfp4())).T,
                            np.asarray(F.quantize(w.T, F.nvfp4())))
  # in dot_general: dlhs reuses the forward weight ("fwd"), the same bits as re-quantizing
  # it in 2-D tiles for the dlhs GEMM
  x = jnp.asarray(RNG.standard_normal((8, 48)).astype(np.float32))
  g = jnp.asarray(RNG.standard_normal((8, 40)).astype(np.float32))
  reuse = jaxlp.DotPolicy(rhs=fmt, dlhs_rhs="fwd")
  again = jaxlp.DotPolicy(rhs=fmt, dlhs_rhs=fmt)

  def dx(pol):
    return jax.vjp(lambda a: jaxlp.dot_general(pol)(a, w, DIMS), x)[1](g)[0]

  dx_reuse = dx(reuse)
  _same_bits(dx_reuse, dx(again))
  wq = F.quantize(w, fmt)
  want = jax.linear_transpose(lambda a: lax.dot_general(a, wq, DIMS), x)(g)[0]
  _same_bits(dx_reuse, want)


def test_weight_tiles_of_n_d_and_conv_kernels():
  """A DenseGeneral kernel (F, H, D) contracting F is tiled on (F, D) for each h; a conv
  kernel (HWIO) per tap on its (I, O) matrix, not on the spatial taps."""
  fmt = F.nvfp4(tile=16)
  x = jnp.asarray(RNG.standard_normal((4, 32)).astype(np.float32))
  k = jnp.asarray(RNG.standard_normal((32, 3, 16)).astype(np.float32))
  dims = (((1,), (0,)), ((), ()))
  got = jaxlp.dot_general(jaxlp.DotPolicy(rhs=fmt))(x, k, dims)
  kq = jnp.transpose(F.quantize(jnp.transpose(k, (1, 0, 2)), fmt), (1, 0, 2))
  _same_bits(got, lax.dot_general(x, kq, dims))
  # conv: a 3x3 kernel 32 -> 48, NHWC / HWIO
  xc = jnp.asarray(RNG.standard_normal((2, 5, 5, 32)).astype(np.float32))
  kc = jnp.asarray(RNG.standard_normal((3, 3, 32, 48)).astype(np.float32))
  kc = kc.at[1, 2, 3, 40].set(500.0)
  dn = lax.conv_dimension_numbers(xc.shape, kc.shape, ("NHWC", "HWIO", "NHWC"))
  conv = functools.partial(lax.conv_general_dilated, window_strides=(1, 1), padding="SAME",
                           dimension_numbers=dn)
  pol = jaxlp.DotPolicy(rhs=fmt)
  got = jaxlp.conv_general_dilated(pol)(xc, kc, (1, 1), "SAME", dimension_numbers=dn)
  kq = F.quantize(kc, fmt)  # HWIO: tiles of the last two axes = (I, O) per tap
  _same_bits(got, conv(xc, kq))
  # the dlhs GEMM sees the same kernel values
  g = jnp.asarray(RNG.standard_normal(got.shape).astype(np.float32))
  dx = jax.vjp(lambda a: jaxlp.conv_general_dilated(pol)(a, kc, (1, 1), "SAME",
                                                         dimension_numbers=dn), xc)[1](g)[0]
  _same_bits(dx, jax.linear_transpose(lambda a: conv(a, kq), xc)(g)[0])


# -- stochastic rounding only where chosen --------------------------------------------------
def _recipe_run(pol, x, w, g):
  """key -> (y, dx, dw) of a Dense GEMM under ``pol``, each GEMM summed in jaxlp.matmul's
  specified order (``Accum()``: fp32 products, a sequential fp32 sum over K), so that the
  outputs are a bit-exact function of the quantized operands. One jit for every key (of one
  kind: one trace); the operands are constants of the program."""
  pol = dataclasses.replace(pol, fwd_acc=jaxlp.Accum(), dlhs_acc=jaxlp.Accum(),
                            drhs_acc=jaxlp.Accum())

  @jax.jit
  def run(k):
    y, vjp = jax.vjp(lambda a, b: jaxlp.dot_general(pol, key=k)(a, b, DIMS), x, w)
    return (y, *vjp(g))

  return run


def _rebuilt(x, w, g, key, *, sr, tiles=True, rht=True):
  """The three GEMMs from explicitly quantized operands: slot i's noise from
  fold_in(key, i) (grad = 2, drhs_grad = 5), 1-D blocks along each GEMM's contraction axis,
  the transform along the batch for the weight gradient; jaxlp.matmul as in
  :func:`_recipe_run`."""
  t = RHT(("drhs",))
  r = "stochastic" if sr else "nearest"
  k = lambda i: jax.random.fold_in(key, i) if sr else None
  wfmt = F.nvfp4(tile=16) if tiles else F.nvfp4(axis=0)
  xq, wq = F.quantize(x, F.nvfp4(axis=1)), F.quantize(w, wfmt)
  w_dl = wq if tiles else F.quantize(w, F.nvfp4(axis=1))
  g_dl = F.quantize(g, F.nvfp4(axis=1), r, key=k(2))
  tr = (lambda v: t.apply(v, axis=0)) if rht else (lambda v: v)
  x_dr = F.quantize(tr(x), F.nvfp4(axis=0))
  g_dr = F.quantize(tr(g), F.nvfp4(axis=0), r, key=k(5))
  return jaxlp.matmul(xq, wq), jaxlp.matmul(g_dl, w_dl.T), jaxlp.matmul(x_dr.T, g_dr)


@pytest.mark.parametrize("sr, tiles, rht", [(True, True, True), (False, False, False)],
                         ids=["recipe", "plain-nvfp4"])
def test_stochastic_rounding_only_on_the_gradient_operands(sr, tiles, rht):
  """Every GEMM output equals the one rebuilt from explicitly quantized operands, bit for bit;
  two keys give the same forward GEMM, and different dlhs / drhs GEMMs exactly when the
  gradients round stochastically. Plain NVFP4 (no piece): 1-D weight blocks along each
  GEMM's contraction axis, no transform, no key needed."""
  x = jnp.asarray(RNG.standard_normal((32, 48)).astype(np.float32))
  w = jnp.asarray(RNG.standard_normal((48, 16)).astype(np.float32))
  g = jnp.asarray(RNG.standard_normal((32, 16)).astype(np.float32) * 1e-3)
  pol = jaxlp.nvfp4_recipe(weight_tiles=tiles, stochastic_gradients=sr, rht=rht)
  k1, k2 = jax.random.key(1), jax.random.key(2)
  run = _recipe_run(pol, x, w, g)
  out1, out2 = run(k1), run(k2)
  want = jax.jit(functools.partial(_rebuilt, sr=sr, tiles=tiles, rht=rht))(x, w, g, k1)
  for name, a, b in zip(("fwd", "dlhs", "drhs"), out1, want, strict=True):
    _same_bits(a, b, msg=name)
  _same_bits(out1[0], out2[0], msg="the forward GEMM has no stochastic operand")
  for name, a, b in zip(("dlhs", "drhs"), out1[1:], out2[1:], strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b)) == (not sr), name
  if sr:
    with pytest.raises(ValueError, match="no key"):
      run(None)
  else:  # no stochastic slot: no key needed
    _same_bits(run(None)[2], out1[2])


# -- per-layer ends and training -----------------------------------------------------------
def test_train_policy_names():
  pytest.importorskip("optax", reason="jaxlp.training needs the examples extra")
  from jaxlp.training._recipes import recipe_policy

  assert recipe_policy("nvfp4-recipe") == (jaxlp.nvfp4_recipe(), True)
  assert recipe_policy("nvfp4") == (jaxlp.nvfp4_recipe(weight_tiles=False,
                                                        stochastic_gradients=False,
                                                        rht=False), False)
  assert recipe_policy("nvfp4+rht+tiles") == (jaxlp.nvfp4_recipe(stochastic_gradients=False),
                                              False)
  assert recipe_policy("nvfp4+ends")[1] is True
  assert recipe_policy("bf16") == (jaxlp.bf16_policy(), False)
  assert recipe_policy("mxfp4") == (jaxlp.mx_policy(F.E2M1FN), False)
  assert recipe_policy("mxfp8-rceil") == (jaxlp.mxfp8_recipe("rceil"), False)
  assert recipe_policy("hbfp8") is None
  for bad in ("nvfp4+tile", "nvfp4+sr+sr", "nvfp4+"):
    with pytest.raises(ValueError, match="pieces of nvfp4"):
      recipe_policy(bad)


@pytest.mark.usefixtures("fast_compile")  # trains and is finite: any optimization level
def test_a_flax_model_trains_under_the_recipe_with_bf16_ends():
  """A 3-layer MLP: first and last layer BF16 via quantize_model's rules, the middle one the
  full NVFP4 recipe; a few SGD steps lower the loss, every step finite, and the middle
  layer's weight gradient depends on the step's quantization key."""
  pytest.importorskip("flax", reason="the Flax model test needs flax")
  from jaxlp.flax import quantize_model
  from jaxlp.flax.models import MLP

  pol = jaxlp.nvfp4_recipe()
  qm = quantize_model(MLP(features=(32, 32, 4)),
                      pol, rules=[("Dense_0", jaxlp.bf16_policy()),
                                  ("Dense_2", jaxlp.bf16_policy())])
  x = jnp.asarray(RNG.standard_normal((64, 16)).astype(np.float32))
  y = jnp.asarray(np.argmax(np.asarray(x)[:, :4], axis=1))
  params = qm.init(jax.random.key(0), x)["params"]
  report = qm.matmul_report({"params": params}, x)
  assert [(op.path, op.source) for op in report] == [
      ("Dense_0", "rules[0]"), ("Dense_1", "policy"), ("Dense_2", "rules[1]")]

  def loss(p, k):
    logits = qm.apply({"params": p}, x, rngs={"quantize": k})
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

  @jax.jit
  def step(p, k):
    val, grads = jax.value_and_grad(loss)(p, k)
    return jax.tree.map(lambda a, b: a - 0.5 * b, p, grads), val, grads

  losses = []
  for i in range(6):
    params, val, grads = step(params, jax.random.key(100 + i))
    losses.append(float(val))
  assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses
  _, _, g_a = step(params, jax.random.key(7))
  _, _, g_b = step(params, jax.random.key(8))
  assert not np.array_equal(np.asarray(g_a["Dense_1"]["kernel"]),
                            np.asarray(g_b["Dense_1"]["kernel"]))


@pytest.mark.usefixtures("fast_compile")  # runs, routes and is finite: any optimization level
def test_jaxlp_train_runs_the_recipe_with_keys_and_bf16_ends(tmp_path):
  """``jaxlp train --policy nvfp4-recipe``: the trainer routes the model through
  quantize_model (BF16 on its first and last layer), one key per step and worker."""
  pytest.importorskip("optax", reason="jaxlp.training needs the examples extra")
  from jaxlp.training import TrainConfig, Trainer

  t = Trainer(TrainConfig(model="mlp", width=2, nodes=2, batch_size=32, policy="nvfp4-recipe",
                          max_steps_per_epoch=2, epochs=1, quiet=True))
  assert t.qmodel is not None
  x0 = jnp.asarray(t.ds.x_train[:2])
  paths = [(op.path, op.source) for op in t.qmodel.matmul_report({"params": t.params}, x0)]
  assert paths == [("Dense_0", "rules[0]"), ("Dense_1", "policy"), ("Dense_2", "rules[1]")]
  m = t.run_epoch()
  assert np.isfinite(m["train_loss"]) and m["nonfinite_steps"] == 0
  with pytest.raises(ValueError, match="pieces of nvfp4"):
    Trainer(TrainConfig(policy="nvfp4+tile", quiet=True))
  with pytest.raises(ValueError, match="unknown --policy 'fp4'"):
    Trainer(TrainConfig(policy="fp4", quiet=True))
