"""jaxlp.torch.quantize == jaxlp.formats.quantize bit for bit; autograd; OptimLP; CPD."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch_testutil import assert_same_bits, special_data

import jaxlp
import jaxlp.torch as jt
from jaxlp import formats as F

X = special_data(2048, seed=3).reshape(32, 64)
_ref = jax.jit(F.quantize, static_argnums=(1, 2))
_ref_sr = jax.jit(lambda x, k, fmt, r: F.quantize(x, fmt, r, key=k), static_argnums=(2, 3))

FORMATS = [getattr(F, n) for n in ("FP32", "TF32", "BF16", "FP16", "E5M2", "E4M3", "E4M3FN",
                                   "E4M3FNUZ", "E5M2FNUZ", "E3M4", "E3M2FN", "E2M3FN", "E2M1FN")]
FORMATS += [F.cpd_float(4, 3), F.qpytorch_float(5, 2), F.qpytorch_block(6, 0),
            F.qpytorch_block(8, -1), F.hbfp(7, 8), F.mx(F.E4M3FN, 32), F.FixedPoint(8, 4)]


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_same_bits_as_jax(fmt):
  x = X.copy()
  if not F.quantize.__module__ or "Block" in type(fmt).__name__ or "MX" in type(fmt).__name__:
    x[~np.isfinite(x)] = 0.0
  t = torch.from_numpy(x)
  assert_same_bits(jt.quantize(t, fmt).numpy(), _ref(jnp.asarray(x), fmt, "nearest"), repr(fmt))
  if "stochastic" in fmt.supported_roundings:
    seed = 12345
    out = jt.quantize(t, fmt, "stochastic", seed=seed).numpy()
    assert_same_bits(out, _ref_sr(jnp.asarray(x), jax.random.PRNGKey(seed), fmt, "stochastic"),
                     f"{fmt!r} stochastic")
    assert_same_bits(out, _ref_sr(jnp.asarray(x), jax.random.key(seed), fmt, "stochastic"),
                     f"{fmt!r} stochastic typed key")


def test_half_dtypes_and_generator_mapping():
  x = torch.from_numpy(special_data(512, seed=4))
  for dt, jdt in ((torch.float16, jnp.float16), (torch.bfloat16, jnp.bfloat16)):
    t = x.to(dt)
    out = jt.quantize(t, F.E4M3)
    assert out.dtype == dt
    ref = _ref(jnp.asarray(t.float().numpy()).astype(jdt), F.E4M3, "nearest")
    assert_same_bits(out.float().numpy(), np.asarray(ref.astype(jnp.float32)), str(dt))
  g = torch.Generator().manual_seed(7)
  words = torch.randint(0, 2**32, (2,), dtype=torch.int64,
                        generator=torch.Generator().manual_seed(7)).numpy().astype(np.uint32)
  out = jt.quantize(x, F.E5M2, "stochastic", generator=g)
  assert_same_bits(out.numpy(), _ref_sr(jnp.asarray(x.numpy()), jnp.asarray(words), F.E5M2,
                                        "stochastic"), "generator key mapping")
  k = jt.seed_to_key(2**31 + 5)
  assert jnp.issubdtype(k.dtype, jax.dtypes.prng_key) and k.shape == ()
  assert np.array_equal(jax.random.key_data(k), jax.random.key_data(jax.random.key(2**31 + 5)))
  assert np.asarray(jax.random.key_data(jt.seed_to_key(2**40 + 5))).tolist() == [256, 5]
  # the typed key and seed= give the same bits
  assert_same_bits(jt.quantize(x, F.E5M2, "stochastic", seed=11).numpy(),
                   np.asarray(jaxlp.quantize(jnp.asarray(x.numpy()), F.E5M2, "stochastic",
                                             key=jt.seed_to_key(11))), "seed_to_key")
  torch.manual_seed(3)
  a = jt.quantize(x, F.E5M2, "stochastic")
  torch.manual_seed(3)
  assert_same_bits(a.numpy(), jt.quantize(x, F.E5M2, "stochastic").numpy(), "manual_seed")


def test_quantize_errors():
  t = torch.ones(4)
  with pytest.raises(TypeError, match="fmt"):
    jt.quantize(t, "e4m3")
  with pytest.raises(ValueError, match="rounding"):
    jt.quantize(t, F.E4M3, "bogus")
  with pytest.raises(ValueError, match="not both"):
    jt.quantize(t, F.E4M3, "stochastic", seed=1, generator=torch.Generator())
  with pytest.raises(ValueError, match="seed"):
    jt.quantize(t, F.E4M3, "stochastic", seed=-1)
  with pytest.raises(ValueError, match="rounding"):
    jt.float_quantize(t, 5, 2, "nearest_away")
  with pytest.raises(ValueError, match="exp"):
    jt.float_quantize(t, 9, 2)


def test_quantize_straight_through_grad():
  t = torch.randn(16, requires_grad=True)
  (jt.quantize(t, F.E4M3) * 3).sum().backward()
  assert torch.equal(t.grad, torch.full((16,), 3.0))


class FakeFloatingPoint:  # duck-typed stand-in for qtorch.FloatingPoint
  def __init__(self, exp, man):
    self.exp, self.man = exp, man


FakeFloatingPoint.__name__ = "FloatingPoint"


def test_quantizer_forward_backward():
  x = torch.randn(64, requires_grad=True)
  w = torch.randn(64)
  q = jt.quantizer(FakeFloatingPoint(5, 2), F.E4M3, "nearest", "nearest")
  y = q(x)
  assert torch.equal(y, jt.float_quantize(x.detach(), 5, 2, "nearest"))
  (y * w).sum().backward()
  assert torch.equal(x.grad, jt.quantize(w, F.E4M3))
  # None numbers: identity both ways
  x.grad = None
  (jt.quantizer()(x) * w).sum().backward()
  assert torch.equal(x.grad, w)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantizer_without_a_gradient_takes_no_graph_node(rounding):
  """A call autograd does not record (no_grad, or an input without requires_grad) returns the
  forward values of a recorded call, bit for bit and drawing the same key, without a
  graph node; a recorded call keeps its backward."""
  x = torch.tensor(special_data(256, seed=7))
  fx = jt.QPyTorchFixedPoint(8, 4)
  for fmt, kw in ((F.qpytorch_float(5, 2), {}), (fx, {"clamping_grad_zero": True})):
    q = jt.quantizer(fmt, F.E4M3, rounding, "nearest", **kw)
    torch.manual_seed(0)
    recorded = q(x.clone().requires_grad_())
    assert recorded.grad_fn is not None and type(recorded.grad_fn).__name__ == "RoundingBackward"
    torch.manual_seed(0)
    plain = q(x)  # grad mode on, input without requires_grad
    torch.manual_seed(0)
    with torch.no_grad():
      quiet = q(x.clone().requires_grad_())
    for y in (plain, quiet):
      assert y.grad_fn is None and not y.requires_grad
      assert_same_bits(y, recorded.detach(), f"{fmt} {rounding}")
  assert jt.quantizer()(x) is x  # no forward number: the input itself
  with pytest.raises(TypeError, match="torch.float32, torch.float16 or torch.bfloat16"):
    jt.quantizer(F.E4M3)(torch.arange(4))


def test_quantizer_clamping_grad_zero_and_hooks():
  x = torch.tensor([0.3, 5.0, -9.0, 1.0], requires_grad=True)
  fx = jt.QPyTorchFixedPoint(4, 1)  # range [-4, 3.5]
  q = jt.quantizer(fx, F.FP32, "nearest", "nearest", clamping_grad_zero=True,
                   backward_hooks=[lambda g: g * 2])
  y = q(x)
  assert y.tolist() == [0.5, 3.5, -4.0, 1.0]
  y.sum().backward()
  assert x.grad.tolist() == [2.0, 0.0, 0.0, 2.0]
  with pytest.raises(ValueError, match="fixed-point"):
    jt.quantizer(F.E4M3, F.E4M3, clamping_grad_zero=True)


def test_quantizer_module_training_step():
  torch.manual_seed(0)
  model = torch.nn.Sequential(
      torch.nn.Linear(8, 16), jt.Quantizer(F.qpytorch_float(5, 2), F.qpytorch_float(5, 2),
                                           "nearest", "nearest"),
      torch.nn.ReLU(), torch.nn.Linear(16, 1))
  opt = torch.optim.SGD(model.parameters(), lr=0.05)
  x, y = torch.randn(32, 8), torch.randn(32, 1)
  losses = []
  for _ in range(20):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
  assert losses[-1] < losses[0]
  h = model[1](model[0](x))
  assert torch.equal(h, jt.float_quantize(model[0](x), 5, 2, "nearest"))


def _q(t):
  return jt.float_quantize(t, 5, 2, "nearest")


@pytest.mark.parametrize("scaling", [2.0, 1.0])
def test_optimlp_sgd_momentum_semantics(scaling):
  torch.manual_seed(1)
  p0 = torch.randn(10)
  grads = [torch.randn(10) for _ in range(3)]
  p = torch.nn.Parameter(p0.clone())
  opt = jt.OptimLP(torch.optim.SGD([p], lr=0.1, momentum=0.9), weight_quant=_q,
                   grad_scaling=scaling, grad_quant=_q, momentum_quant=_q, acc_quant=_q)
  # manual: acc starts at p0; each step g = Q(scaling g); buf = 0.9 buf + g (buf = g first);
  # acc = Q(acc - 0.1 buf); p = Q(acc); buf = Q(buf)
  acc, buf = p0.clone(), None
  for g in grads:
    p.grad = g.clone()
    opt.step()
    gq = _q(g * scaling)
    buf = gq.clone() if buf is None else buf * 0.9 + gq
    acc = _q(acc - 0.1 * buf)
    buf = _q(buf)
    assert torch.equal(p.data, _q(acc))
    assert torch.equal(opt.optim.state[p]["momentum_buffer"], buf)
    assert torch.equal(opt.weight_acc[p], acc)
  # any optimizer is accepted; momentum_quant needs one whose buffers OptimLP knows
  jt.OptimLP(torch.optim.RMSprop([p]), weight_quant=_q)
  with pytest.raises(TypeError, match="SGD") as e:
    jt.OptimLP(torch.optim.RMSprop([p]), momentum_quant=_q)
  assert isinstance(e.value, AssertionError)  # what QPyTorch's assertion raises

  class MySGD(torch.optim.SGD):  # a subclass (QPyTorch accepts those): same semantics
    pass

  p2 = torch.nn.Parameter(p0.clone())
  opt2 = jt.OptimLP(MySGD([p2], lr=0.1, momentum=0.9), weight_quant=_q, momentum_quant=_q)
  p2.grad = grads[0].clone()
  opt2.step()
  assert torch.equal(opt2.optim.state[p2]["momentum_buffer"], _q(grads[0]))
  assert torch.equal(p2.data, _q(p0 - 0.1 * grads[0]))


def test_optimlp_unit_grad_scaling_skips_the_multiply():
  """grad_scaling=1: grad_quant gets the gradient tensor itself (no pass over it); other
  scalings get the product."""
  seen = []

  def spy(t):
    seen.append(t)
    return _q(t)

  for scaling in (1.0, 0.5):
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    grad = p.grad.data
    jt.OptimLP(torch.optim.SGD([p], lr=0.1), grad_scaling=scaling, grad_quant=spy).step()
    assert (seen[-1].data_ptr() == grad.data_ptr()) == (scaling == 1.0)  # same storage
    assert torch.equal(seen[-1], grad * scaling)


def test_cpd_api():
  x = torch.from_numpy(special_data(1024, seed=9))
  out = jt.cpd.float_quantize(x, 4, 3)
  assert_same_bits(out.numpy(), _ref(jnp.asarray(x.numpy()), F.cpd_float(4, 3), "nearest"), "cpd")
  # (8, 23) cast flushes fp32 subnormals to +0 ...
  assert jt.cpd.float_quantize(torch.tensor([-1e-40]), 8, 23).numpy().view(np.uint32)[0] == 0
  # ... but the (8, 23) quantizer is the exact identity
  t = torch.tensor([-1e-40, 1.1], requires_grad=True)
  y = jt.cpd.Quantizer()(t)
  assert torch.equal(y, t)
  q = jt.cpd.quantizer(4, 3, 5, 2)
  t.grad = None
  w = torch.tensor([1.0625, 3.0])
  (q(t) * w).sum().backward()
  assert torch.equal(t.grad, jt.cpd.float_quantize(w, 5, 2))
