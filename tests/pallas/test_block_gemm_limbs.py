"""The Pallas limb kernel of the exact block GEMM (``jaxlp/pallas/_limb_gemm.py``: MXFP6
E3M2, MXFP8, NVFP4 with tensor scales) gives the reference's bits in interpret mode, lowers
for CUDA without an op Triton cannot compile, compiles for sm_90, and is what an exact
policy of these formats runs when compiled for CUDA. (Not run on a GPU here.)"""

import dataclasses
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp import formats as F
from jaxlp.formats import _block_dot as BS
from jaxlp.pallas import _limb_gemm as PL

_ref = jax.jit(BS.block_dot_reference, static_argnums=(2, 3, 4))


def _same(x, y):
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  nan = np.isnan(x) & np.isnan(y)
  return np.array_equal(np.where(nan, 0, x.view(np.uint32)), np.where(nan, 0, y.view(np.uint32)))


def _operands(rng, fa, fb, M, K, N):
  x = rng.normal(size=(M, K)) * np.exp2(rng.normal(size=(M, K)) * 4)
  x *= np.exp2(rng.integers(-70, 70, size=(M, 1)))  # tiles on the fast and the exact scaling
  x[1, 3], x[2, :] = np.inf, 0.0  # a NaN block, a zero row
  x[0] = rng.normal(size=K) * 2.0**80  # row 0 x column 0: overflowing partials
  y = rng.normal(size=(K, N)) * np.exp2(rng.normal(size=(K, N)) * 4)
  y[:, 0] = rng.normal(size=K) * 2.0**80
  xs, ys = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  if isinstance(fa, F.ScaledBlockFormat) and fa.tensor_scale:
    xs = xs.at[1, 3].set(5.0)  # a NaN block would make the whole tensor NaN: tested below
    return ((F.quantize(xs, BS.two_level_values(fa)), BS.tensor_scale(xs, fa)),
            (F.quantize(ys, BS.two_level_values(fb)), BS.tensor_scale(ys, fb)))
  return (F.quantize(xs, fa), None), (F.quantize(ys, fb), None)


@pytest.mark.parametrize("fa,fb,g,prec", [
    (F.mx(F.E3M2FN, 32, 1), F.mx(F.E3M2FN, 32, 0), 32, True),  # one dot, fast + exact tiles
    (F.mx(F.E5M2, 32, 1), F.mx(F.E4M3FN, 32, 0), 32, True),  # 4 x 2 limbs of 9 bits
    (F.mx(F.E4M3FN, 32, 1), F.mx(F.E4M3FN, 32, 0), 32, False),  # prec unknown: 8-bit limbs
    (F.nvfp4(axis=1), F.nvfp4(axis=0), 16, True),  # tensor scales in the rounding
], ids=["e3m2", "e5m2xe4m3", "e4m3-8bit-limbs", "nvfp4"])
def test_interpret_matches_reference(fa, fb, g, prec):
  (a, sa), (b, sb) = _operands(np.random.default_rng(g), fa, fb, 40, 70, 20)
  spa, spb = BS.significand_spec(fa), BS.significand_spec(fb)
  scales = None if sa is None else (sa, sb)
  ref = _ref(a, b, g, spa.bits, spb.bits, scales)
  kw = dict(interpret=True, block_m=16, block_n=16,
            prec=(spa.prec, spb.prec) if prec else None)
  out = PL.limb_gemm(a, b, g, spa.bits, spb.bits, scales, **kw)
  assert _same(out, ref)
  assert np.isinf(np.asarray(ref)[0, 0]) or scales is not None
  if scales is not None:  # one tensor scale only, then a NaN one
    assert _same(PL.limb_gemm(a, b, g, 8, 8, (sa, None), interpret=True),
                 _ref(a, b, g, 8, 8, (sa, None)))
    # (the program above: NVFP4 has 8 significand bits, the scales are float32 scalars)
    nan = (jnp.full_like(sa, jnp.nan), sb)
    assert np.isnan(np.asarray(PL.limb_gemm(a, b, g, spa.bits, spb.bits, nan, **kw))).all()


def test_plans():
  """Whole significands where bf16 and float32 hold them (NVFP4, MXFP4/6), limbs of up to
  10 bits (8 without a known precision) otherwise."""
  assert PL.kernel_plan(16, 8, 8, (6, 6))[1:3] == (1, 1)
  assert PL.kernel_plan(32, 9, 9, (3, 3))[1:3] == (1, 1)
  assert PL.kernel_plan(32, 18, 18, (4, 4))[:3] == (9, 2, 2)
  assert PL.kernel_plan(32, 32, 32, (3, 3))[:3] == (9, 4, 4)
  assert PL.kernel_plan(32, 18, 18)[:3] == (8, 3, 3)
  assert PL.kernel_plan(16, 18, 4, (4, 2))[:3] == (10, 2, 1)
  with pytest.raises(ValueError, match="block_m must be a power of two"):
    PL.limb_gemm(jnp.ones((4, 32)), jnp.ones((32, 4)), 32, 9, 9, block_m=24, interpret=True)


def _cuda_tools():
  if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
    pytest.skip("PyPI ships triton only for Linux x86_64")
  import cuda_lowering as CL  # noqa: PLC0415
  import triton_compile as TC  # noqa: PLC0415

  assert TC.available(), "triton is missing: pip install -e '.[test]' (in the test extras)"
  return CL, TC


A = jax.ShapeDtypeStruct((128, 96), jnp.float32)
B = jax.ShapeDtypeStruct((96, 64), jnp.float32)
S = jax.ShapeDtypeStruct((), jnp.float32)


@pytest.mark.parametrize("fn,args", [
    (lambda a, b: PL.limb_gemm(a, b, 32, 9, 9, prec=(3, 3)), (A, B)),
    (lambda a, b: PL.limb_gemm(a, b, 32, 18, 32, prec=(4, 3)), (A, B)),
    (lambda a, b, sa, sb: PL.limb_gemm(a, b, 16, 8, 8, (sa, sb), prec=(6, 6)), (A, B, S, S)),
], ids=["e3m2-one-dot", "e4m3xe5m2-limbs", "nvfp4-tensor-scales"])
def test_lowers_and_compiles_for_sm90(fn, args):
  CL, TC = _cuda_tools()
  _, mods = CL.lower_for_cuda(fn, *args)
  assert CL.kernel_names(mods) == ["jaxlp_limb_gemm"] and not CL.illegal_ops(mods[0])
  ptx = TC.compile_ttir_sm90(mods[0], num_warps=4, num_stages=1)
  assert ".target sm_90" in ptx and ".entry" in ptx


@pytest.mark.parametrize("policy,kernel", [
    (jaxlp.DotPolicy(lhs=F.nvfp4(), rhs=F.nvfp4(tile=16), grad=F.nvfp4(), block_dot="exact"),
     "jaxlp_limb_gemm"),
    (jaxlp.mx_policy(F.E4M3FN, 32, grad_fmt=F.E5M2, block_dot="exact"), "jaxlp_limb_gemm"),
    (dataclasses.replace(jaxlp.mx_policy(F.E2M1FN, 32, block_dot="exact"), gpu_impl="pallas"),
     "jaxlp_block_gemm"),
], ids=["nvfp4", "mxfp8", "mxfp4"])
def test_exact_policy_runs_the_kernels_for_cuda(policy, kernel):
  """value_and_grad of an exact dot_general compiled for CUDA: MXFP8 and NVFP4 GEMMs run
  the limb kernel (three GEMMs), MXFP4 the int8/bf16 block kernel (``gpu_impl="pallas"``;
  "auto" runs these small GEMMs as batched XLA int8 dots), no illegal op."""
  CL, _ = _cuda_tools()
  dot = jaxlp.dot_general(policy)
  x, w = jax.ShapeDtypeStruct((64, 96), jnp.float32), jax.ShapeDtypeStruct((96, 64), jnp.float32)
  loss = lambda x, w: jnp.sum(dot(x, w, (((1,), (0,)), ((), ()))))
  _, mods = CL.lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
  assert all(not CL.illegal_ops(m) for m in mods)
  assert CL.kernel_names(mods).count(kernel) == 3
