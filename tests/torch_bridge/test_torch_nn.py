"""jaxlp.torch.nn layers and CPD's quant_gemm / Quant_Linear / Quant_Conv."""

import re

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxlp  # noqa: E402
from jaxlp.formats import E4M3, E4M3FN, E5M2, cpd_float  # noqa: E402
from jaxlp.torch import cpd  # noqa: E402
from jaxlp.torch import nn as jnn  # noqa: E402
from tests.torch_bridge._torch_testutil import assert_same_bits, jax_device_of  # noqa: E402

# Every JAX reference below runs on the JAX device of the layer's tensors (jax_device_of: the
# CPU device for these CPU tensors), which is where jaxlp.torch runs the layer, so layer and
# reference are the same XLA GEMM/convolution and agree bit for bit on any machine. On JAX's
# default device instead (the GPU under JAX_PLATFORMS=cuda,cpu) the reference would be a
# different backend's GEMM, which sums in another order (last-bit differences).

POLICIES = {
    "hbfp_tiled": jaxlp.hbfp_policy(5, tile=4, activations="tiled"),
    "hbfp_per_sample": jaxlp.hbfp_policy(7, weight_man_bits=5, tile=8),
    "mx": jaxlp.mx_policy(E4M3FN, block_size=8, grad_fmt=E5M2),
    "float": jaxlp.float_policy(E4M3, E5M2),
}


def _data(seed, *shapes):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _jax_vjp(f, args, g, device):
  @jax.jit
  def run(args, g):
    y, vjp = jax.vjp(f, *args)
    return y, vjp(g)

  return run(jax.device_put(tuple(args), device), jax.device_put(g, device))


def _torch_run(layer, x, g):
  xt = torch.tensor(x, requires_grad=True)
  y = layer(xt)
  y.backward(torch.tensor(g))
  return y.detach(), xt.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_linear_matches_jax_dot_general(name):
  policy = POLICIES[name]
  x, w, b, g = _data(1, (6, 16), (12, 16), (12,), (6, 12))
  layer = jnn.Linear(16, 12, policy=policy)
  with torch.no_grad():
    layer.weight.copy_(torch.tensor(w))
    layer.bias.copy_(torch.tensor(b))
  y, dx, dw, db = _torch_run(layer, x, g)
  dg = jaxlp.dot_general(policy)

  def f(x_, w_, b_):
    return dg(x_, w_, (((1,), (1,)), ((), ()))) + b_[None, :]

  yj, (dxj, dwj, dbj) = _jax_vjp(f, (x, w, b), g, jax_device_of(layer.weight))
  for a, bb, what in ((y, yj, "y"), (dx, dxj, "dx"), (dw, dwj, "dw"), (db, dbj, "db")):
    assert_same_bits(a, bb, f"{name} {what}")
  # quantization really happened
  assert not np.array_equal(y.cpu().numpy(), x @ w.T + b)


def test_linear_3d_input_and_no_bias():
  policy = POLICIES["float"]
  x, w = _data(2, (2, 3, 8), (5, 8))
  layer = jnn.Linear(8, 5, bias=False, policy=policy)
  with torch.no_grad():
    layer.weight.copy_(torch.tensor(w))
  y = layer(torch.tensor(x))
  dev = jax_device_of(layer.weight)
  yj = jax.jit(lambda a, b: jaxlp.dot_general(policy)(a, b, (((2,), (1,)), ((), ()))))(
      jax.device_put(x, dev), jax.device_put(w, dev))
  assert_same_bits(y, yj, "y")


@pytest.mark.parametrize("name,stride,padding,dilation,groups", [
    ("hbfp_tiled", 1, 1, 1, 1), ("hbfp_tiled", 2, 0, 2, 2), ("mx", 1, 1, 1, 1),
    ("float", 2, 1, 1, 1)])
def test_conv2d_matches_jax_conv(name, stride, padding, dilation, groups):
  policy = POLICIES[name]
  cin, cout = 4, 8
  x, w, b = _data(3, (2, cin, 9, 9), (cout, cin // groups, 3, 3), (cout,))
  layer = jnn.Conv2d(cin, cout, 3, stride, padding, dilation, groups, policy=policy)
  with torch.no_grad():
    layer.weight.copy_(torch.tensor(w))
    layer.bias.copy_(torch.tensor(b))
  y0 = layer(torch.tensor(x))
  (g,) = _data(4, tuple(y0.shape))
  y, dx, dw, db = _torch_run(layer, x, g)
  cv = jaxlp.conv_general_dilated(policy)

  def f(x_, w_, b_):
    return cv(x_, w_, (stride, stride), ((padding, padding), (padding, padding)),
              rhs_dilation=(dilation, dilation), dimension_numbers=("NCHW", "OIHW", "NCHW"),
              feature_group_count=groups) + b_.reshape(1, -1, 1, 1)

  yj, (dxj, dwj, dbj) = _jax_vjp(f, (x, w, b), g, jax_device_of(layer.weight))
  for a, bb, what in ((y, yj, "y"), (dx, dxj, "dx"), (dw, dwj, "dw"), (db, dbj, "db")):
    assert_same_bits(a, bb, f"{name} {what}")
  ref = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), torch.tensor(b), stride,
                                   padding, dilation, groups)
  assert y.shape == ref.shape
  assert float(torch.linalg.norm(y - ref) / torch.linalg.norm(ref)) < 0.1


def test_conv2d_hbfp_tiles_weights_on_o_by_ikk_view():
  # an HBFP weight tile spans the (O, I*kh*kw) view: quantizing the kernel there (as
  # HBFPEmulator does) gives the forward output of the jaxlp layer
  fmt = jaxlp.formats.hbfp(5, 4)
  policy = jaxlp.DotPolicy(rhs=fmt)
  x, w = _data(5, (1, 3, 6, 6), (6, 3, 3, 3))
  layer = jnn.Conv2d(3, 6, 3, bias=False, policy=policy)
  with torch.no_grad():
    layer.weight.copy_(torch.tensor(w))
  y = layer(torch.tensor(x)).detach()
  dev = jax_device_of(layer.weight)
  wq = jaxlp.quantize(jax.device_put(w.reshape(6, 27), dev), fmt).reshape(w.shape)
  ref = jax.lax.conv_general_dilated(jax.device_put(x, dev), wq, (1, 1), "VALID",
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
  assert_same_bits(y, ref, "hbfp conv y")


def test_stochastic_policy_reproducible_and_matches_jax():
  policy = jaxlp.float_policy(E4M3, E5M2, rounding="stochastic")
  x, w = _data(6, (4, 8), (3, 8))
  layer = jnn.Linear(8, 3, bias=False, policy=policy)
  with torch.no_grad():
    layer.weight.copy_(torch.tensor(w))
  torch.manual_seed(7)
  y1 = layer(torch.tensor(x)).detach()
  torch.manual_seed(7)
  key = jaxlp.torch.draw_key()
  torch.manual_seed(7)
  y2 = layer(torch.tensor(x)).detach()
  assert_same_bits(y1, y2, "reproducible")
  dev = jax_device_of(layer.weight)
  yj = jax.jit(lambda a, b, k: jaxlp.dot_general(policy)(a, b, (((1,), (1,)), ((), ())),
                                                         key=k))(
      jax.device_put(x, dev), jax.device_put(w, dev), jax.device_put(key, dev))
  assert_same_bits(y1, yj, "stochastic y")


def test_quantize_model_swaps_layers_and_keeps_parameters():
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 7),
                              torch.nn.Linear(7, 2))
  params = list(model.parameters())
  x = torch.randn(2, 3, 5, 5)
  ref = model(x).detach()
  policy = POLICIES["float"]
  out = jnn.quantize_model(model, policy, exclude=["4"])
  assert out is model
  assert isinstance(model[0], jnn.Conv2d) and isinstance(model[3], jnn.Linear)
  assert type(model[4]) is torch.nn.Linear
  assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
  y = model(x)
  assert not torch.equal(y, ref) and torch.allclose(y, ref, atol=0.3, rtol=0.2)
  y.sum().backward()
  assert all(p.grad is not None for p in model.parameters())
  # DotPolicy() = the plain lax GEMM
  m2 = jnn.quantize_model(torch.nn.Linear(4, 3), jaxlp.DotPolicy())
  assert isinstance(m2, jnn.Linear)
  with pytest.raises(TypeError, match="policy"):
    jnn.Linear(2, 2, policy="hbfp")


def test_quantize_model_refuses_patterns_that_match_no_layer():
  # issue 49: exclude="fc_l" (typo for "fc1") used to be accepted and every layer quantized
  def net():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

  policy = POLICIES["float"]
  for kw, bad in ((dict(exclude="l"), "exclude='l'"), (dict(include=["0", "1"]), "include='1'"),
                  (dict(exclude=["2", "3*"]), "exclude='3*'")):
    model = net()
    with pytest.raises(ValueError, match=f"pattern {re.escape(bad)} matches no nn.Linear"):
      jnn.quantize_model(model, policy, **kw)
    assert all(type(m) is not jnn.Linear for m in model), "nothing swapped before the error"
  with pytest.raises(TypeError, match="exclude"):
    jnn.quantize_model(net(), policy, exclude=[2])
  model = jnn.quantize_model(net(), policy, exclude="2")  # a str is one pattern
  assert isinstance(model[0], jnn.Linear) and type(model[2]) is torch.nn.Linear
  # patterns may name layers that were swapped before
  assert jnn.quantize_model(model, policy, include=["0"]) is model


def _kahan_gemm_ref(a, b, fmt, device):
  def q(v):
    x = jax.device_put(np.float32(v).reshape(1), device)
    return np.asarray(jaxlp.formats.quantize(x, fmt))[0]
  out = np.zeros((a.shape[0], b.shape[1]), np.float32)
  for i in range(a.shape[0]):
    for j in range(b.shape[1]):
      s = c = np.float32(0)
      for k in range(a.shape[1]):
        p = q(np.float32(a[i, k] * b[k, j]))
        y = q(np.float32(p - c))
        t = q(np.float32(s + y))
        c = q(np.float32(q(np.float32(t - s)) - y))
        s = t
      out[i, j] = s
  return out


def test_quant_gemm_is_cpd_kahan():
  a, b = _data(8, (3, 7), (7, 2))
  out = cpd.quant_gemm(torch.tensor(a), torch.tensor(b), man=2, exp=5)
  assert_same_bits(out, _kahan_gemm_ref(a, b, cpd_float(5, 2), jax_device_of(out)),
                   "quant_gemm")
  full = cpd.quant_gemm(torch.tensor(a), torch.tensor(b))
  np.testing.assert_allclose(full.cpu().numpy(), a @ b, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="inner"):
    cpd.quant_gemm(torch.tensor(a), torch.tensor(a))


def test_quant_linear_and_conv():
  torch.manual_seed(0)
  lin = cpd.Quant_Linear(6, 4, exp=5, man=2)
  x = torch.randn(3, 6, requires_grad=True)
  y = lin(x)
  w = lin.weight.detach()
  ref = cpd.quant_gemm(x.detach(), w.t().contiguous(), 2, 5) + lin.bias.detach()
  assert torch.equal(y.detach(), ref)
  g = torch.randn(3, 4)
  y.backward(g)
  assert torch.equal(x.grad, cpd.quant_gemm(g, w, 2, 5))
  assert torch.equal(lin.weight.grad, cpd.quant_gemm(g.t().contiguous(), x.detach(), 2, 5))
  assert torch.equal(lin.bias.grad, cpd.float_quantize(g.sum(0), 5, 2))
  conv = cpd.Quant_Conv(3, 5, 3, stride=2, padding=1)
  xc = torch.randn(2, 3, 7, 7)
  yc = conv(xc)
  ref = torch.nn.functional.conv2d(xc, conv.weight, conv.bias, 2, 1)
  assert yc.shape == ref.shape
  assert torch.allclose(yc, ref, atol=1e-5)
  with pytest.raises(ValueError, match="dilation"):
    cpd.Quant_Conv(3, 5, 3, dilation=2)
