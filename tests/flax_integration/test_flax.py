"""jaxlp.flax: linen + nnx injection, quantize_model, linen == nnx, ResNet-18 training.

The tests marked ``FAST`` check what holds at any XLA optimization level (a loss that falls,
stochastic runs compared with each other, shapes and tolerances, errors): they compile with
XLA's optimizations off (``fast_compile``, tests/conftest.py). The tests that claim bits
(linen == nnx, quantize_model == injection, excluded or identity layers == the plain model)
compile normally."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlp.flax as jf
from jaxlp.flax.models import ResNet18
from jaxlp.ops._conv import conv_general_dilated
from jaxlp.ops._dot_general import dot_general
from jaxlp.ops._policy import DotPolicy, hbfp_policy, mx_policy

FAST = pytest.mark.usefixtures("fast_compile")
POL = hbfp_policy(7, 4, weight_man_bits=7)


def assert_trees_equal(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


class LinenNet(nn.Module):
  dg: object = None
  cg: object = None

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(6, (3, 3), conv_general_dilated=self.cg)(x)
    x = nn.relu(x).reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(16, dot_general=self.dg)(x))
    return nn.Dense(3, dot_general=self.dg)(x)


class NnxNet(nnx.Module):
  def __init__(self, rngs, dg=None, cg=None):
    kw_d = {} if dg is None else {"dot_general": dg}
    kw_c = {} if cg is None else {"conv_general_dilated": cg}
    self.conv = nnx.Conv(4, 6, (3, 3), rngs=rngs, **kw_c)
    self.fc1 = nnx.Linear(6 * 5 * 5, 16, rngs=rngs, **kw_d)
    self.fc2 = nnx.Linear(16, 3, rngs=rngs, **kw_d)

  def __call__(self, x):
    x = nnx.relu(self.conv(x)).reshape(x.shape[0], -1)
    return self.fc2(nnx.relu(self.fc1(x)))


def _copy_linen_to_nnx(params, m):
  p = params["params"]
  for name, layer in (("Conv_0", m.conv), ("Dense_0", m.fc1), ("Dense_1", m.fc2)):
    layer.kernel[...] = p[name]["kernel"]
    layer.bias[...] = p[name]["bias"]
  return m


X = jax.random.normal(jax.random.key(0), (2, 5, 5, 4))


def _linen_vals(model, variables, x, **kw):
  @jax.jit
  def f(v, x):
    loss = lambda v, x: jnp.sum(jnp.sin(model.apply(v, x, **kw)))
    return model.apply(v, x, **kw), jax.grad(loss, (0, 1))(v, x)

  return f(variables, x)


def _nnx_vals(model, x):
  @nnx.jit
  def f(m, x):
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
    gm, gx = nnx.grad(loss, argnums=(0, 1))(m, x)
    return m(x), gm, gx

  return f(model, x)


def _compare(linen_out, nnx_out):
  y, (gv, gx) = linen_out
  y2, gm, gx2 = nnx_out
  np.testing.assert_array_equal(y, y2)
  np.testing.assert_array_equal(gx, gx2)
  p = gv["params"]
  np.testing.assert_array_equal(p["Conv_0"]["kernel"], gm["conv"]["kernel"][...])
  np.testing.assert_array_equal(p["Dense_0"]["kernel"], gm["fc1"]["kernel"][...])
  np.testing.assert_array_equal(p["Dense_1"]["kernel"], gm["fc2"]["kernel"][...])


def test_injected_linen_equals_injected_nnx_bit_for_bit():
  dg, cg = dot_general(POL), conv_general_dilated(POL)
  lin = LinenNet(dg, cg)
  v = lin.init(jax.random.key(1), X)
  m = _copy_linen_to_nnx(v, NnxNet(nnx.Rngs(0), dg, cg))
  out = _linen_vals(lin, v, X)
  _compare(out, _nnx_vals(m, X))
  plain = _linen_vals(LinenNet(), v, X)
  assert not np.array_equal(out[0], plain[0])  # quantization did something


def test_quantize_model_linen_equals_injection_and_nnx():
  v = LinenNet().init(jax.random.key(1), X)
  q = jf.quantize_model(LinenNet(), POL)
  assert jax.tree.structure(q.init(jax.random.key(1), X)) == jax.tree.structure(v)
  out = _linen_vals(q, v, X)
  _compare(out, _linen_vals_as_nnx(_linen_vals(LinenNet(dot_general(POL),
                                                         conv_general_dilated(POL)), v, X)))
  m = jf.quantize_model(_copy_linen_to_nnx(v, NnxNet(nnx.Rngs(0))), POL)
  _compare(out, _nnx_vals(m, X))


def _linen_vals_as_nnx(out):
  y, (gv, gx) = out
  p = gv["params"]
  gm = {"conv": {"kernel": nnx.Param(p["Conv_0"]["kernel"])},
        "fc1": {"kernel": nnx.Param(p["Dense_0"]["kernel"])},
        "fc2": {"kernel": nnx.Param(p["Dense_1"]["kernel"])}}
  return y, gm, gx


def test_include_exclude_by_path():
  v = LinenNet().init(jax.random.key(1), X)
  q = jf.quantize_model(LinenNet(), POL, exclude=("Conv_0", "Dense_1"))
  assert q.quantized_paths(jax.random.key(1), X) == ["Dense_0"]
  assert jf.quantize_model(LinenNet(), POL, include="Dense_*").quantized_paths(
      jax.random.key(1), X) == ["Dense_0", "Dense_1"]
  # excluding every layer gives the plain model exactly
  none = jf.quantize_model(LinenNet(), POL, exclude="*")
  assert_trees_equal(_linen_vals(none, v, X), _linen_vals(LinenNet(), v, X))
  # first/last layer exclusion == injecting only the middle layer, linen and nnx
  mid = _linen_vals(q, v, X)

  class Mid(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(6, (3, 3))(x)).reshape(x.shape[0], -1)
      x = nn.relu(nn.Dense(16, dot_general=dot_general(POL))(x))
      return nn.Dense(3)(x)

  assert_trees_equal(mid, _linen_vals(Mid(), v, X))
  m = jf.quantize_model(_copy_linen_to_nnx(v, NnxNet(nnx.Rngs(0))), POL,
                        exclude=("conv", "fc2"))
  _compare(mid, _nnx_vals(m, X))
  with pytest.raises(TypeError, match="exclude"):
    jf.quantize_model(LinenNet(), POL, exclude=[3])


def numpy_init(model, x, seed=0):
  """He-normal kernels, unit scales, zero biases from the variable shapes (a jitted flax init
  of ResNet-18 takes a minute to compile on a loaded CPU; eval_shape is instant)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)

  def make(path, s):
    name = path[-1].key
    if name == "kernel":
      return jnp.asarray(rng.normal(0, np.sqrt(2 / np.prod(s.shape[:-1])), s.shape), s.dtype)
    return jnp.ones(s.shape, s.dtype) if name in ("scale", "var") else jnp.zeros(s.shape, s.dtype)

  return jax.tree_util.tree_map_with_path(make, shapes)


def test_identity_policy_model_is_plain():
  v = LinenNet().init(jax.random.key(1), X)
  assert_trees_equal(_linen_vals(jf.quantize_model(LinenNet(), DotPolicy()), v, X),
                     _linen_vals(LinenNet(), v, X))


@FAST
def test_stochastic_policy_keys_from_rngs():
  pol = hbfp_policy(3, 4, rounding="stochastic")
  v = LinenNet().init(jax.random.key(1), X)
  q = jf.quantize_model(LinenNet(), pol)
  f = jax.jit(lambda v, x, k: q.apply(v, x, rngs={"quantize": k}))
  y1, y2, y3 = f(v, X, jax.random.key(0)), f(v, X, jax.random.key(0)), f(v, X, jax.random.key(1))
  np.testing.assert_array_equal(y1, y2)
  assert not np.array_equal(y1, y3)
  with pytest.raises(ValueError, match="quantize"):
    jax.eval_shape(lambda v, x: q.apply(v, x), v, X)
  with pytest.raises(ValueError, match="rngs"):
    jf.quantize_model(NnxNet(nnx.Rngs(0)), pol)
  m = jf.quantize_model(NnxNet(nnx.Rngs(0)), pol, rngs=nnx.Rngs(quantize=0))
  step = nnx.jit(lambda m, x: m(x))
  a, b = step(m, X), step(m, X)
  assert not np.array_equal(a, b)  # a fresh key per call, counter in the model state


@FAST
def test_mx_policy_in_dense_general_and_einsum():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8))
  dg = nn.DenseGeneral((2, 4), axis=-1)
  v = dg.init(jax.random.key(1), x)
  q = jf.quantize_model(dg, mx_policy(block_size=4))
  y = jax.jit(q.apply)(v, x)
  assert y.shape == (2, 3, 2, 4) and not np.array_equal(y, dg.apply(v, x))
  e = nnx.Einsum("btd,dh->bth", (8, 5), rngs=nnx.Rngs(0))
  qe = jf.quantize_model(e, mx_policy(block_size=4))
  ye = nnx.jit(lambda m, x: m(x))(qe, x)
  want = jnp.einsum("btd,dh->bth", x, e.kernel[...])
  assert ye.shape == want.shape and not np.array_equal(ye, want)
  np.testing.assert_allclose(ye, want, rtol=0.2, atol=0.2)


@pytest.mark.slow
@FAST
def test_resnet18_trains_under_hbfp():
  model = ResNet18(num_classes=10, width=4)
  q = jf.quantize_model(model, hbfp_policy(7, 24))
  x = jax.random.normal(jax.random.key(0), (8, 32, 32, 3))
  labels = jnp.arange(8) % 10
  v = numpy_init(model, x)
  params, stats = v["params"], v["batch_stats"]
  tx = optax.sgd(0.1, momentum=0.9)
  opt = tx.init(params)

  @jax.jit
  def step(params, stats, opt, x):  # x as an argument: no constant folding of its rounding
    def loss_fn(p):
      logits, upd = q.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd

    (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), upd["batch_stats"], opt, loss

  losses = []
  for _ in range(5):
    params, stats, opt, loss = step(params, stats, opt, x)
    losses.append(float(loss))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
  assert len(q.quantized_paths(jax.random.key(1), x)) == 21  # 17 3x3 + 3 shortcut + fc
  assert jax.tree.structure(v) == jax.tree.structure(jax.eval_shape(q.init, jax.random.key(0), x))


@FAST
def test_patterns_that_match_no_layer_are_errors():
  """Issue 49: ``exclude="Dense_l"`` (a typo for ``Dense_1``) was accepted and ignored."""
  v = LinenNet().init(jax.random.key(1), X)
  msg = r"exclude='Dense_l' matches no layer.*\['Conv_0', 'Dense_0', 'Dense_1'\]"
  for call in (lambda q: q.apply(v, X), lambda q: q.init(jax.random.key(1), X),
               lambda q: q.init_with_output(jax.random.key(1), X),
               lambda q: q.quantized_paths(jax.random.key(1), X),
               lambda q: jax.jit(q.apply)(v, X)):
    q = jf.quantize_model(LinenNet(), POL, exclude="Dense_l")  # accepted: paths not known yet
    with pytest.raises(ValueError, match=msg):
      call(q)
    with pytest.raises(ValueError, match=msg):  # still refused: it never ran to the end
      call(q)
  q = jf.quantize_model(LinenNet(), POL, include=("Dense_*", "dense_0"), exclude="Conv_0")
  with pytest.raises(ValueError, match=r"include='dense_0' matches no layer"):
    q.apply(v, X)
  # Patterns that match: checked on the first call, then not again (a later call may run
  # a subset of the layers, e.g. another method).
  q = jf.quantize_model(LinenNet(), POL, exclude="Dense_1")
  assert_trees_equal(q.apply(v, X), q.apply(v, X))
  assert q._patterns_checked
  # nnx: the graph is known at once, so quantize_model itself refuses, before any change.
  m = NnxNet(nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"exclude='fc_2' matches no layer.*"
                                       r"\['conv', 'fc1', 'fc2'\]"):
    jf.quantize_model(m, POL, exclude=("conv", "fc_2"), copy=False)
  assert m.fc1.dot_general is jax.lax.dot_general and m.conv.conv_general_dilated is \
      jax.lax.conv_general_dilated
  with pytest.raises(ValueError, match=r"include='layers/9' matches no layer"):
    jf.quantize_model(nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0))), POL,
                      include="layers/9")
