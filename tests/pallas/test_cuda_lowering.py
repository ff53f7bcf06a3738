"""Every kernel configuration the library can dispatch to lowers for CUDA, with only ops the
Triton NVIDIA backend compiles — checked on a CPU (see cuda_lowering.py).

Coverage is automatic: every preset in ``jaxlp.formats``, every format type in
``FORMAT_TYPES`` that has a kernel (a new type without an example here fails
``test_every_format_type_is_covered``), every rounding a format supports (with and without
``rand_bits``, this for :data:`RAND_BITS_FORMATS`), every GEMM algorithm with every preset as
accumulator, and every ``pallas_call`` site in the package
(``test_every_pallas_call_site_is_lowered``).
"""

import dataclasses
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from cuda_lowering import illegal_ops, kernel_names, lower_for_cuda

import jaxlp
from jaxlp import formats as F
from jaxlp.formats._quantize import FORMAT_TYPES
from jaxlp.pallas import _gemm as G
from jaxlp.pallas._block_gemm import block_gemm, fp8_block_gemm
from jaxlp.pallas._limb_gemm import limb_gemm
from jaxlp.pallas._matmul import matmul as kernel_matmul
from jaxlp.pallas._quantize import quantize as kernel_quantize
from jaxlp.pallas._quantize import supports

KEY = jax.random.key(0)
PRESETS = {name: v for name, v in vars(F).items() if isinstance(v, F.FloatFormat)}
SHAPE = (100, 96)  # not a multiple of any tile/block: the padding paths are lowered too

#: Formats beyond the presets: every compatibility/fixed/block type, custom FloatFormats
#: (specials, overflow, no subnormals, biased, e = 1, m = 0), every kernel block layout.
EXTRA_FORMATS = {
    "cpd(5,2)": F.cpd_float(5, 2), "cpd(8,23)": F.cpd_float(8, 23),
    "cpd(3,0)": F.cpd_float(3, 0),
    "qpt(5,2)": F.qpytorch_float(5, 2), "qpt(8,7)": F.qpytorch_float(8, 7),
    "qpt(8,23)": F.qpytorch_float(8, 23),
    "fixed(8,4)": jaxlp.FixedPoint(8, 4),
    "fixed(16,8,sym)": jaxlp.FixedPoint(16, 8, symmetric=True),
    "fixed(12,3,noclamp)": jaxlp.FixedPoint(12, 3, clamp=False),
    "fn_sat": jaxlp.FloatFormat(4, 3, specials="fn", overflow="saturate"),
    "nosub": jaxlp.FloatFormat(5, 2, subnormals=False),
    "bias": jaxlp.FloatFormat(4, 3, bias=3), "e1": jaxlp.FloatFormat(1, 2, specials="finite"),
    "m0": jaxlp.FloatFormat(3, 0),
    "hbfp(8,24)": F.hbfp(8, 24), "hbfp(4,16)": F.hbfp(4, 16),
    "bfp_tile(1,32)": jaxlp.BlockFormat(7, tile=(1, 32)),
    "bfp_axis16": jaxlp.BlockFormat(7, axis=-1, block_size=16),
    "bfp_axis_whole": jaxlp.BlockFormat(12, axis=1),
    "mx_e4m3": F.mx(F.E4M3FN, 32), "mx_e5m2": F.mx(F.E5M2, 32), "mx_e2m1": F.mx(F.E2M1FN, 32),
    "mx_e3m2": F.mx(F.E3M2FN, 32), "mx_int8": F.mx("int8", 32),
    "mx_e2m1_rceil": F.mx(F.E2M1FN, 32, scale_rule="rceil"),
    "mx_e4m3_even": F.mx(F.E4M3FN, 32, scale_rule="even"),
    "nvfp4": F.nvfp4(), "nvfp4_2d": F.nvfp4(tile=16),
    "scaled_e8m0": F.ScaledBlockFormat(F.E2M1FN, 32, scale_fmt="e8m0", tensor_scale=False),
    "qpt_block(8,0)": F.qpytorch_block(8, 0),  # no kernel: always the spec
}
ALL_FORMATS = {**PRESETS, **EXTRA_FORMATS}


#: Formats whose stochastic kernel is lowered with ``rand_bits`` 1 and 13 too (every format is
#: lowered with the default): the first format of each type (the random-bit truncation is the
#: type's code, the same for every format of it), the float formats whose kept rounding bits
#: and ``rand_bits`` compare differently (m = 0; 10 and 23 bits: more than 13 dropped bits or
#: none), and each MX / block layout.
RAND_BITS_FORMATS = {"E4M3", "FP16", "FP32", "m0", "mx_int8", "mx_e2m1_rceil",
                     "bfp_axis16", "bfp_axis_whole", "bfp_tile(1,32)", "nvfp4_2d"}


def _cases():
  first_of_type = set()
  for name, fmt in ALL_FORMATS.items():
    if not supports(fmt, SHAPE):
      continue
    extra = name in RAND_BITS_FORMATS or type(fmt) not in first_of_type
    first_of_type.add(type(fmt))
    for r in fmt.supported_roundings:
      for rb in ((None, 1, 13) if r == "stochastic" and extra else (None,)):
        yield pytest.param(fmt, r, rb, id=f"{name}-{r}-{rb}")


def _assert_clean(mods, what):
  assert mods, f"{what}: no Pallas kernel was lowered"
  for m in mods:
    bad = illegal_ops(m)
    assert not bad, f"{what}: ops the Triton NVIDIA backend may not compile: {sorted(bad)}"


def test_every_format_type_is_covered():
  for t in FORMAT_TYPES:
    example = next((f for f in ALL_FORMATS.values() if isinstance(f, t)), None)
    assert example is not None, f"no lowering case for format type {t.__name__}"


@pytest.mark.parametrize("fmt,rounding,rand_bits", list(_cases()))
def test_quantize_kernel_lowers_for_cuda(fmt, rounding, rand_bits):
  key = KEY if rounding == "stochastic" else None
  f = functools.partial(kernel_quantize, fmt=fmt, rounding=rounding, key=key,
                        rand_bits=rand_bits)
  _, mods = lower_for_cuda(f, jax.ShapeDtypeStruct(SHAPE, jnp.float32))
  _assert_clean(mods, f"quantize {fmt} {rounding} rand_bits={rand_bits}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", [F.E4M3, F.hbfp(8, 24), F.mx(F.E4M3FN, 32)], ids=str)
def test_quantize_kernel_lowers_for_narrow_inputs(fmt, dtype):
  f = functools.partial(kernel_quantize, fmt=fmt, rounding="stochastic", key=KEY)
  _, mods = lower_for_cuda(f, jax.ShapeDtypeStruct(SHAPE, dtype))
  _assert_clean(mods, f"quantize {fmt} {dtype}")


def _gemm_cases():
  accs = {**PRESETS, "cpd(5,2)": F.cpd_float(5, 2), "qpt(5,2)": F.qpytorch_float(5, 2),
          "fixed(16,8)": jaxlp.FixedPoint(16, 8)}
  for alg in G.ALGORITHMS:
    for name, acc in accs.items():
      mul = None if alg == "chunked" else (acc if name.startswith("cpd") else F.BF16)
      yield pytest.param(alg, acc, mul, "nearest", id=f"{alg}-{name}-nearest")
    for r in ("stochastic", "toward_zero"):
      yield pytest.param(alg, F.FP16, None if alg == "chunked" else F.E5M2, r,
                         id=f"{alg}-FP16-{r}")
    yield pytest.param(alg, None, None, "nearest", id=f"{alg}-fp32")


@pytest.mark.parametrize("alg,acc,mul,rounding", list(_gemm_cases()))
def test_matmul_kernel_lowers_for_cuda(alg, acc, mul, rounding):
  kw = dict(acc=acc, mul=mul, algorithm=alg, rounding=rounding,
            key=KEY if rounding == "stochastic" else None, chunk=32 if alg == "chunked" else None)
  a = jax.ShapeDtypeStruct((2, 100, 70), jnp.float32)
  b = jax.ShapeDtypeStruct((2, 70, 40), jnp.float32)
  bias = jax.ShapeDtypeStruct((40,), jnp.float32)
  _, mods = lower_for_cuda(lambda a, b, c: kernel_matmul(a, b, bias=c, **kw), a, b, bias)
  _assert_clean(mods, f"matmul {alg} acc={acc} mul={mul} {rounding}")


@pytest.mark.parametrize("g,bits", [(24, (7, 7)), (32, (7, 7)), (1, (6, 7)), (96, (7, 5))],
                         ids=["hbfp8", "mxint8", "g1", "whole"])
def test_block_gemm_kernel_lowers_for_cuda(g, bits):
  """The exact block GEMM (int8 x int8 -> int32 dots, exact scaling) on (100, 96) x (96, 70)."""
  a = jax.ShapeDtypeStruct((100, 96), jnp.float32)
  b = jax.ShapeDtypeStruct((96, 70), jnp.float32)
  _, mods = lower_for_cuda(lambda a, b: block_gemm(a, b, g, *bits), a, b)
  _assert_clean(mods, f"block_gemm g={g} bits={bits}")
  assert "tt.dot" in mods[0]


@pytest.mark.parametrize("g", [24, 32, 96])
def test_block_gemm_with_the_pallas_operand_preparation_lowers_for_cuda(g):
  """prep="pallas" (gpu_impl="auto"): the preparation kernel, then the GEMM kernels, on
  (100, 96) x (96, 70); K-blocks of 24 and 96 in masked power-of-two windows."""
  a = jax.ShapeDtypeStruct((100, 96), jnp.float32)
  b = jax.ShapeDtypeStruct((96, 70), jnp.float32)
  _, mods = lower_for_cuda(lambda a, b: block_gemm(a, b, g, 7, 7, prep="pallas"), a, b)
  _assert_clean(mods, f"block_gemm g={g} prep=pallas")
  assert kernel_names(mods)[0] == "jaxlp_block_gemm_prep"


def _fp8_operands(M, N, nb, g, dtype):
  return (jax.ShapeDtypeStruct((M, nb, g), dtype), jax.ShapeDtypeStruct((M, nb), jnp.int32),
          jax.ShapeDtypeStruct((N, nb, g), dtype), jax.ShapeDtypeStruct((N, nb), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_block_gemm_kernel_lowers_for_cuda(dtype):
  """The fp8 fast mode's per-K-block-scaled GEMM on (100, 3 x 32) x (70, 3 x 32)."""
  _, mods = lower_for_cuda(fp8_block_gemm, *_fp8_operands(100, 70, 3, 32, dtype))
  _assert_clean(mods, f"fp8_block_gemm {dtype.__name__}")
  assert "tt.dot" in mods[0]


def test_fp8_policy_dispatches_to_the_fp8_kernel_when_selected():
  """``block_dot="fp8"`` with MX operands lowers to the fp8 kernel on CUDA where
  ``fp8_gpu_impl="pallas"`` (the default), and to no kernel (XLA's batched fp8 dot) with
  ``"xla"``, in the same process (the choice is part of the policy, not traced state)."""
  policy = jaxlp.mx_policy(F.E4M3FN, 32, block_dot="fp8")
  assert policy.fp8_gpu_impl == "pallas"
  x = jax.ShapeDtypeStruct((64, 96), jnp.float32)
  w = jax.ShapeDtypeStruct((96, 48), jnp.float32)

  def grads(policy):
    dot = jaxlp.dot_general(policy)

    def loss(x, w):
      return jnp.sum(dot(x, w, (((1,), (0,)), ((), ()))))

    return jax.value_and_grad(loss, argnums=(0, 1))

  _, mods = lower_for_cuda(grads(policy), x, w)
  _assert_clean(mods, "dot_general block_dot='fp8'")
  assert kernel_names(mods).count("jaxlp_fp8_block_gemm") == 3
  xla = dataclasses.replace(policy, fp8_gpu_impl="xla")
  assert not lower_for_cuda(grads(xla), x, w)[1]
  assert kernel_names(lower_for_cuda(grads(policy), x, w)[1]).count(
    "jaxlp_fp8_block_gemm") == 3  # and back: nothing stale


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_exact_block_dot_policy_dispatches_to_the_gpu_impl_for_cuda(impl):
  """``DotPolicy(block_dot="exact")`` under value_and_grad: fwd, dlhs and drhs GEMMs all
  lower to the policy's ``gpu_impl`` on CUDA: three block GEMM kernels with "pallas"; with
  "auto" (the default) these one-tile GEMMs of four K-blocks are batched int8 dots, no
  kernel."""
  policy = jaxlp.hbfp_policy(7, 24, "tiled", block_dot="exact")
  assert policy.gpu_impl == "auto"  # the default
  dot = jaxlp.dot_general(dataclasses.replace(policy, gpu_impl=impl))

  def loss(x, w):
    return jnp.sum(dot(x, w, (((1,), (0,)), ((), ()))))

  x = jax.ShapeDtypeStruct((64, 96), jnp.float32)
  w = jax.ShapeDtypeStruct((96, 48), jnp.float32)
  text, mods = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
  if impl == "pallas":
    _assert_clean(mods, "dot_general block_dot='exact'")
    assert kernel_names(mods).count("jaxlp_block_gemm") == 3
  else:
    assert not mods
    assert len(re.findall(r"stablehlo.dot_general[^\n]*xi8>", text)) == 3


def test_every_pallas_call_site_is_lowered():
  """Each ``pallas_call(..., name=...)`` in the package is one of the kernels lowered above
  (a new kernel must be added to this file)."""
  root = pathlib.Path(jaxlp.__file__).parent
  sites = []
  for path in root.rglob("*.py"):
    src = path.read_text()
    n_calls = len(re.findall(r"pallas_call\(", src))
    names = re.findall(r"name=f?\"(jaxlp_[\w{}]+)\"", src)
    assert len(names) >= n_calls, f"{path}: a pallas_call without a literal name= jaxlp_..."
    sites += names
  lowered = set()
  x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
  for fmt in (F.E4M3, F.hbfp(8, 24)):
    lowered |= set(kernel_names(lower_for_cuda(functools.partial(kernel_quantize, fmt=fmt), x)[1]))
  for alg in G.ALGORITHMS:
    f = functools.partial(kernel_matmul, acc=F.BF16, algorithm=alg,
                          chunk=32 if alg == "chunked" else None)
    lowered |= set(kernel_names(lower_for_cuda(f, x, jax.ShapeDtypeStruct(SHAPE[::-1],
                                                                         jnp.float32))[1]))
  for prep in ("jnp", "pallas"):
    lowered |= set(kernel_names(lower_for_cuda(
        lambda a, b, prep=prep: block_gemm(a, b, 24, 7, 7, prep=prep), x,
        jax.ShapeDtypeStruct(SHAPE[::-1], jnp.float32))[1]))
  lowered |= set(kernel_names(lower_for_cuda(
      fp8_block_gemm, *_fp8_operands(64, 64, 2, 32, jnp.float8_e4m3fn))[1]))
  lowered |= set(kernel_names(lower_for_cuda(  # MXFP8 limbs (tests/pallas/test_block_gemm_limbs)
      lambda a, b: limb_gemm(a, b, 32, 18, 18, prec=(4, 4)), x,
      jax.ShapeDtypeStruct(SHAPE[::-1], jnp.float32))[1]))
  assert sites
  for site in sites:
    pattern = re.escape(site).replace(r"\{", "{").replace(r"\}", "}")
    pattern = re.sub(r"{\w+}", r"\\w+", pattern)
    assert any(re.fullmatch(pattern, n) for n in lowered), (site, lowered)


def test_the_guard_catches_both_gpu_failure_classes():
  """The two failures of the first H100 run are caught: clz -> math.ctlz in the IR, and a
  bitcast of a trace-time constant raising in the lowering."""
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  def clz_kernel(x_ref, o_ref):
    o_ref[...] = lax.clz(x_ref[...])

  def const_bitcast_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] | lax.bitcast_convert_type(jnp.float32(1.5), jnp.uint32)

  spec = jax.ShapeDtypeStruct((16,), jnp.uint32)
  for kernel in (clz_kernel, const_bitcast_kernel):
    f = pl.pallas_call(kernel, out_shape=spec, compiler_params=plt.CompilerParams())
    if kernel is clz_kernel:
      _, mods = lower_for_cuda(f, spec)
      assert "math.ctlz" in illegal_ops(mods[0])
    else:
      with pytest.raises(AttributeError, match="TypedNdArray"):
        lower_for_cuda(f, spec)


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_exact_block_conv_lowers_for_cuda(impl):
  """``block_dot="exact"`` convolutions (im2col + the exact block GEMM) under value_and_grad
  lower for CUDA with no op Triton cannot compile: every GEMM through the block GEMM kernel
  with "pallas"; with "auto" (the default) at batch 64 the forward and input-gradient GEMMs
  (32 tiles; 1 K-block) through the kernel with the Pallas operand preparation, and the
  weight gradient (5 tiles, 128 K-blocks) as one batched int8 dot."""
  policy = jaxlp.mx_policy("int8", block_dot="exact")
  conv = jaxlp.conv_general_dilated(dataclasses.replace(policy, gpu_impl=impl))

  def loss(x, w):
    return jnp.sum(conv(x, w, (1, 1), "SAME"))

  x = jax.ShapeDtypeStruct((2 if impl == "pallas" else 64, 64, 8, 8), jnp.float32)
  w = jax.ShapeDtypeStruct((32, 64, 3, 3), jnp.float32)
  text, mods = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
  _assert_clean(mods, "conv_general_dilated block_dot='exact'")
  names = kernel_names(mods)
  if impl == "pallas":
    assert names.count("jaxlp_block_gemm") == 3
  else:
    assert names.count("jaxlp_block_gemm") == names.count("jaxlp_block_gemm_prep") == 2
    assert len(re.findall(r"stablehlo.dot_general[^\n]*xi8>", text)) == 1
