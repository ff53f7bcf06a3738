"""jaxlp's NVFP4 and MX scale rules against torchao (the PyTorch reference), bit for bit.

torchao (``pip install torchao``, tested with 0.18.0 on torch 2.13 CPU) is an optional test
dependency: without it this module is skipped. Inputs avoid torchao's documented departures
(tensors whose ``max |x|`` is below ``2688 * 2**-121``, where its ``1/g`` overflows or it divides
0 by 0; MX blocks whose scale is ``2**-127``, which it decodes one binade low; blocks holding
inf, which it keeps instead of returning NaN).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torchao", reason="the torchao parity tests need torchao "
                    "(pip install torchao)")

import torch  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import (  # noqa: E402
    NVFP4Tensor,
    per_tensor_amax_to_scale,
)

from jaxlp import formats as F  # noqa: E402

from . import _ref  # noqa: E402

F32 = np.float32


@functools.partial(jax.jit, static_argnums=1)
def _qj(x, fmt):
  return F.quantize(x, fmt)


def _families(shape=(32, 128)):
  rng = np.random.default_rng(21)
  fam = {f"normal*{s:g}": (rng.standard_normal(shape) * s).astype(F32)
         for s in (1e-30, 1e-6, 1.0, 1e4, 1e30, 1e37)}
  x = rng.standard_normal(shape).astype(F32)
  x[::3, 5] *= 3e4
  fam["outliers"] = x
  fam["ties"] = (rng.integers(-24, 25, shape) * 0.25).astype(F32)
  x = rng.standard_normal(shape).astype(F32)
  x[3:9] = 0.0
  x[10:14] *= F32(1e-39)
  x[15, :] = -0.0
  fam["zeros+subnormals"] = x
  x = rng.standard_normal(shape).astype(F32)
  x[:, 16:48] *= F32(2.0**-50)
  fam["tiny blocks"] = x
  return fam


FAMILIES = _families()


def _torchao_nvfp4(x, two_level):
  t = torch.from_numpy(x)
  pts = per_tensor_amax_to_scale(t.abs().max()) if two_level else None
  n = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=pts)
  return n, n.dequantize(torch.float32).numpy()


@pytest.mark.parametrize("two_level", [True, False])
def test_nvfp4_dequantized_values(two_level):
  fmt = F.nvfp4(tensor_scale=two_level)
  for name, x in FAMILIES.items():
    _, want = _torchao_nvfp4(x, two_level)
    _ref.assert_same_bits(_qj(jnp.asarray(x), fmt), want, x, f"nvfp4 {two_level=} {name}")


def test_nvfp4_bfloat16():
  """bfloat16 in, bfloat16 out: both widen to float32 and round the float32 decode back.
  (torchao 0.18 refuses float16 input; jaxlp widens it the same way, tested against the
  step-by-step reference in tests/formats/test_nvfp4.py.)"""
  fmt = F.nvfp4()
  for name in ("normal*1e-06", "normal*1", "normal*10000", "outliers", "zeros+subnormals"):
    t = torch.from_numpy(FAMILIES[name]).to(torch.bfloat16)
    n = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=per_tensor_amax_to_scale(t.abs().max()))
    want = n.dequantize(torch.bfloat16).float().numpy()
    got = _qj(jnp.asarray(t.float().numpy()).astype(jnp.bfloat16), fmt)
    assert got.dtype == jnp.bfloat16
    _ref.assert_same_bits(got.astype(jnp.float32), want, msg=f"bfloat16 {name}")


def test_nvfp4_parts():
  """The block scales (torchao's float8_e4m3fn ``scale``) and tensor scale, and the
  elements (``qdata``, decoded through the dequantization with unit scales)."""
  fmt = F.nvfp4()
  for name, x in FAMILIES.items():
    n, _ = _torchao_nvfp4(x, True)
    q, s, g = fmt.encode(jnp.asarray(x))
    _ref.assert_same_bits(s, n.scale.float().numpy().reshape(s.shape), msg=f"scales {name}")
    assert float(g) == float(n.per_tensor_scale), name
    unit = NVFP4Tensor(n.qdata, torch.ones_like(n.scale.float()).to(torch.float8_e4m3fn), 16,
                       torch.float32)
    _ref.assert_same_bits(q, unit.dequantize(torch.float32).numpy(), x, f"elements {name}")


RULES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL,
         "ceil": ScaleCalculationMode.CEIL, "even": ScaleCalculationMode.EVEN}
ELEMS = {"E4M3FN": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2,
         "E2M1FN": torch.float4_e2m1fn_x2}


@pytest.mark.parametrize("elem", sorted(ELEMS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_mx_scale_rules(rule, elem):
  fmt = F.mx(F.PRESETS[elem], 32, scale_rule=rule)
  for name, x in FAMILIES.items():
    if name in ("normal*1e-30", "zeros+subnormals", "tiny blocks"):
      continue  # blocks with scale 2**-127: torchao decodes them one binade low
    t = MXTensor.to_mx(torch.from_numpy(x), ELEMS[elem], 32, RULES[rule])
    want = t.dequantize(torch.float32).numpy()
    _ref.assert_same_bits(_qj(jnp.asarray(x), fmt), want, x, f"mx({elem}, {rule}) {name}")
