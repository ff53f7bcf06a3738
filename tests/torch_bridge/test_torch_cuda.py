"""The torch bridge on CUDA tensors (issue 17): every path runs on a GPU, with the parity each
path promises. Skipped, with the reason, where torch or JAX has no GPU.

Parity per path:

* quantizers (``quantize``, the QPyTorch drop-ins, ``Quantizer``, ``OptimLP``): the arithmetic
  is jaxlp's own, so a CUDA tensor gives the bits of the same tensor on the CPU, nearest and
  stochastic (the noise is counter-based, the same words on every device).
* layers (``nn.Linear``, ``nn.Conv2d``) and ``cpd.quant_gemm``: bit-exact against the JAX
  function run on the same GPU (the same GEMM route); against the CPU only within a tolerance,
  since XLA:GPU and XLA:CPU sum fp32 GEMMs in different orders.
"""

import jax
import numpy as np
import pytest
import torch
from _torch_testutil import assert_same_bits, gpu_host, special_data, to_numpy

import jaxlp
import jaxlp.torch as jt
from jaxlp import formats as F

pytestmark = pytest.mark.skipif(
    not gpu_host(),
    reason="needs a CUDA device visible to torch and a JAX GPU backend "
           "(JAX_PLATFORMS=cuda,cpu); this machine has none")

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", [F.E4M3, F.E5M2, F.BF16, F.hbfp(7, 8), F.mx(F.E4M3FN, 32)],
                         ids=str)
def test_quantize_cuda_equals_cpu(fmt, rounding):
  x = torch.tensor(special_data(64 * 64, seed=3)).reshape(64, 64)
  kw = {"seed": 5} if rounding == "stochastic" else {}
  if rounding == "stochastic" and rounding not in fmt.supported_roundings:
    pytest.skip(f"{fmt} has no stochastic rounding")
  cpu = jt.quantize(x, fmt, rounding, **kw)
  gpu = jt.quantize(x.to(CUDA), fmt, rounding, **kw)
  assert gpu.device == CUDA and gpu.dtype == x.dtype
  assert_same_bits(gpu, cpu, f"{fmt} {rounding}")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_qpytorch_drop_ins_cuda_equal_cpu(rounding):
  x = torch.tensor(special_data(4096, seed=4, max_exp=8)).reshape(64, 64)
  calls = {
      "float_quantize": lambda t: jt.float_quantize(t, 5, 2, rounding, seed=1),
      "block_quantize": lambda t: jt.block_quantize(t, 8, -1, rounding, seed=1),
      "fixed_point_quantize": lambda t: jt.fixed_point_quantize(t, 8, 4, rounding=rounding,
                                                                seed=1),
  }
  for name, f in calls.items():
    assert_same_bits(f(x.to(CUDA)), f(x), name)
  q = jt.Quantizer(F.qpytorch_float(5, 2), forward_rounding=rounding)
  torch.manual_seed(0)
  a = q(x.to(CUDA))
  torch.manual_seed(0)
  assert_same_bits(a, q(x), "Quantizer")


def test_optimlp_cuda_equals_cpu():
  q = jt.quantizer(F.qpytorch_float(5, 2), forward_rounding="nearest")
  outs = []
  for dev in ("cpu", CUDA):
    w = torch.nn.Parameter(torch.linspace(-2, 2, 256, device=dev))
    opt = jt.OptimLP(torch.optim.SGD([w], lr=0.1, momentum=0.9), weight_quant=q, grad_quant=q,
                     momentum_quant=q)
    for s in range(3):
      w.grad = torch.linspace(0.3, -0.7, 256, device=dev) * (s + 1)
      opt.step()
    outs.append(w.detach())
  assert_same_bits(outs[1], outs[0], "OptimLP")


def test_linear_cuda_same_bits_as_jax_on_the_gpu():
  policy = jaxlp.float_policy(F.E4M3, F.E5M2)
  layer = jt.nn.Linear(32, 16, bias=False, policy=policy).to(CUDA)
  x = torch.randn(8, 32, device=CUDA, requires_grad=True)
  y = layer(x)
  y.sum().backward()
  dev = jax.devices("gpu")[0]
  xj, wj = (jax.device_put(to_numpy(t), dev) for t in (x, layer.weight))

  def f(a, w):
    return jaxlp.dot_general(policy)(a, w, (((1,), (1,)), ((), ())))
  yj, vjp = jax.vjp(jax.jit(f), xj, wj)
  dx, dw = vjp(jax.numpy.ones_like(yj))
  assert_same_bits(y, yj, "y")
  assert_same_bits(x.grad, dx, "dx")
  assert_same_bits(layer.weight.grad, dw, "dw")
  # against the CPU: the GEMMs sum in another order (documented tolerance)
  cpu = jt.nn.Linear(32, 16, bias=False, policy=policy)
  cpu.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
  np.testing.assert_allclose(to_numpy(cpu(x.detach().cpu())), to_numpy(y), rtol=1e-5,
                             atol=1e-5)


def test_conv2d_and_quant_gemm_on_cuda():
  conv = jt.nn.Conv2d(3, 4, 3, padding=1, policy=jaxlp.hbfp_policy(7, 8)).to(CUDA)
  out = conv(torch.randn(2, 3, 8, 8, device=CUDA))
  assert out.device == CUDA and out.shape == (2, 4, 8, 8) and torch.isfinite(out).all()
  a = torch.randn(16, 24, device=CUDA)
  b = torch.randn(24, 8, device=CUDA)
  dev = jax.devices("gpu")[0]
  ref = jax.jit(lambda p, q: jaxlp.matmul(p, q, mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2),
                                          algorithm="kahan"))(
      jax.device_put(to_numpy(a), dev), jax.device_put(to_numpy(b), dev))
  got = jt.cpd.quant_gemm(a, b, man=2, exp=5)
  assert got.device == CUDA
  assert_same_bits(got, ref, "quant_gemm")
  # per-MAC rounding in a fixed k order: the same bits as on the CPU as well
  assert_same_bits(got, jt.cpd.quant_gemm(a.cpu(), b.cpu(), man=2, exp=5), "quant_gemm cpu")


def test_triton_kernels_match_the_spec_on_the_gpu():
  """The native path (``jaxlp/torch/_triton.py``) on 1M random and every crafted bit pattern,
  every format of ``_triton_check.FORMATS``, every rounding, float32/float16/bfloat16: the
  bits of the JAX spec on the CPU."""
  pytest.importorskip("triton")
  import _triton_check

  problems = _triton_check.check("cuda", 1 << 20,
                                 (torch.float32, torch.float16, torch.bfloat16))
  assert not problems, "\n".join(problems[:20])


def test_cuda_tensors_take_the_triton_path_where_it_applies(monkeypatch):
  pytest.importorskip("triton")
  from jaxlp.torch import _quantize as Q

  x = torch.randn(64, 64, device=CUDA)
  mx = jt.quantize(x, F.mx(F.E4M3FN, 32))  # no kernel for MX: the JAX route, before the patch

  def jax_route(*args, **kwargs):
    raise AssertionError("the JAX route ran for a format the Triton kernels take")

  monkeypatch.setattr(Q, "executable", jax_route)
  for out in (jt.float_quantize(x, 5, 2, "stochastic", seed=3),
              jt.fixed_point_quantize(x, 8, 4, rounding="nearest"),
              jt.block_quantize(x, 8, 0, "nearest"),
              jt.quantize(x, F.E4M3, "up"),
              jt.Quantizer(F.qpytorch_float(4, 3), forward_rounding="nearest")(x)):
    assert out.device == CUDA and out.shape == x.shape
  assert mx.device == CUDA


def test_direct_triton_launches_keep_the_bits(monkeypatch):
  """The bridge's launcher (``jaxlp/torch/_triton.py``, ``Launcher``): the first call of each
  specialization compiles through ``JITFunction.run``, the second launches the compiled kernel
  directly and is checked against ``JITFunction.run``, later calls launch directly. Four calls
  of every kernel path, stochastic keys whose words are int32 and int64 to Triton: each gives
  the CPU's bits, and the direct launches stay on."""
  pytest.importorskip("triton")
  from jaxlp.torch import _triton as T

  lau = T.Launcher()
  monkeypatch.setattr(T, "LAUNCHER", lau)
  x = torch.tensor(special_data(64 * 64, seed=6, max_exp=8)).reshape(64, 64)
  calls = {
      "quantize": lambda t, s: jt.quantize(t, F.E5M2, "stochastic", seed=s),
      "quantize_nearest": lambda t, s: jt.quantize(t, F.E4M3, "nearest"),
      "float_quantize": lambda t, s: jt.float_quantize(t, 5, 2, "stochastic", seed=s),
      "fixed_point_quantize": lambda t, s: jt.fixed_point_quantize(t, 8, 4, rounding="nearest"),
      "block_whole": lambda t, s: jt.block_quantize(t, 8, -1, "stochastic", seed=s),
      "block_dim": lambda t, s: jt.block_quantize(t, 8, 0, "nearest"),
      "FixedPoint": lambda t, s: jt.quantize(t, F.FixedPoint(8, 4), "stochastic", seed=s),
  }
  for seed in (5, 2**63 + 2**31 + 7):  # key words (0, 5) and (2**31, 2**31 + 7)
    for name, f in calls.items():
      want = f(x, seed)
      for i in range(4):
        assert_same_bits(f(x.to(CUDA), seed), want, f"{name} call {i}")
  assert lau.disabled is None, lau.disabled
  entries = [e for e in lau._cache.values() if e[0] is not None]
  assert entries and all(e[2] for e in entries)  # every specialization checked, then direct
