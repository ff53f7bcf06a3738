"""jaxlp's Pallas kernels compile for an H100 (sm_90) with PyPI Triton, no GPU needed.

Lowers each kernel for CUDA (:mod:`cuda_lowering`), then runs its Triton IR through Triton's
NVIDIA backend down to a cubin (:mod:`triton_compile`). ``triton`` is in the test extras
(Linux x86_64, the only platform PyPI ships it for; elsewhere the module is skipped).
"""

import importlib
import platform
import re
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl

if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
  pytest.skip("PyPI ships triton only for Linux x86_64", allow_module_level=True)

import cuda_lowering as CL  # noqa: E402
import triton_compile as TC  # noqa: E402

assert TC.available(), "triton is missing: pip install -e '.[test]' (it is in the test extras)"

import jaxlp  # noqa: E402
from jaxlp import formats as F  # noqa: E402

PQ = importlib.import_module("jaxlp.pallas._quantize")
PM = importlib.import_module("jaxlp.pallas._matmul")
PB = importlib.import_module("jaxlp.pallas._block_gemm")

KEY = jax.random.key(0)
SQUARE = jax.ShapeDtypeStruct((256, 256), jnp.float32)
# rows and columns are multiples of the hbfp tile (24) and of the MX block (32)
BLOCKY = jax.ShapeDtypeStruct((96, 192), jnp.float32)

# (id, function, args, num_warps, num_stages as jaxlp passes them: the Triton IR text does
# not carry them; they are taken from the lowered module when jaxlib records them there)
# Quantize kernels not here are compiled by test_every_format_kernel_compiles_for_sm90 (on the
# (100, 96) shape of test_cuda_lowering): E4M3 nearest, cpd_float(5, 2), hbfp(8, 24), mx(E4M3FN,
# 32), mx(E2M1FN, 32, rceil), nvfp4() and stochastic qpytorch_float(5, 2) (rand_bits 7),
# BlockFormat(7, axis=-1, block_size=16) (the layout jaxlp.quantize dispatches to on a GPU,
# KERNEL_IS_FASTER["axis_blocks"]) and nvfp4(tile=16).
KERNELS = [
    ("quantize-E4M3-stochastic",  # the default rand_bits
     lambda x: PQ.quantize(x, F.E4M3, "stochastic", key=KEY), (SQUARE,), 4, 3),
    ("quantize-FixedPoint(8,4)-down", lambda x: PQ.quantize(x, jaxlp.FixedPoint(8, 4), "down"),
     (SQUARE,), 4, 3),
    ("quantize-BF16-bf16-input", lambda x: PQ.quantize(x.astype(jnp.bfloat16), F.BF16),
     (SQUARE,), 4, 3),
    ("quantize-mx(int8,32)-up", lambda x: PQ.quantize(x, F.mx("int8", 32), "up"), (BLOCKY,),
     4, 3),
    ("quantize-mx(E2M1FN,32)-stochastic",
     lambda x: PQ.quantize(x, F.mx(F.E2M1FN, 32), "stochastic", key=KEY), (BLOCKY,), 4, 3),
    ("matmul-naive-accBF16",
     lambda a, b: PM.matmul(a, b, acc=F.BF16, algorithm="naive"), (SQUARE, SQUARE), 4, 1),
    ("matmul-kahan-cpd_float(5,2)",
     lambda a, b: PM.matmul(a, b, mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2),
                            algorithm="kahan"), (SQUARE, SQUARE), 4, 1),
    ("matmul-stochastic-mulE5M2-accFP16",
     lambda a, b: PM.matmul(a, b, mul=F.E5M2, acc=F.FP16, rounding="stochastic", key=KEY),
     (SQUARE, SQUARE), 4, 1),
    ("matmul-naive-accFixedPoint(24,12)",
     lambda a, b: PM.matmul(a, b, acc=jaxlp.FixedPoint(24, 12)), (SQUARE, SQUARE), 4, 1),
    ("matmul-chunked-accBF16-chunk32",
     lambda a, b: PM.matmul(a, b, acc=F.BF16, algorithm="chunked", chunk=32),
     (SQUARE, SQUARE), 4, 1),
    # the fp8 fast mode's per-K-block-scaled GEMM (block_dot="fp8", fp8_gpu_impl="pallas")
    *[(f"fp8_block_gemm-{dt.__name__}", PB.fp8_block_gemm,
       (jax.ShapeDtypeStruct((256, 8, 32), dt), jax.ShapeDtypeStruct((256, 8), jnp.int32),
        jax.ShapeDtypeStruct((256, 8, 32), dt), jax.ShapeDtypeStruct((256, 8), jnp.int32)), 8, 3)
      for dt in (jnp.float8_e4m3fn, jnp.float8_e5m2)],
    ("fp8_block_gemm-g96", PB.fp8_block_gemm,  # a K-block that is not a power of two
     (jax.ShapeDtypeStruct((256, 2, 96), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((256, 2), jnp.int32),
      jax.ShapeDtypeStruct((256, 2, 96), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((256, 2), jnp.int32)), 8, 3),
]

#: num_warps / num_stages of the exact block GEMM's kernels as jaxlp passes them: the bf16
#: route (bf16 wgmma, 128 x 128 tiles, 8 warps), the int8 route (int8 wgmma, 64 x 64) and the
#: operand preparation (prep="pallas").
BLOCK_GEMM_WARPS = {"jaxlp_block_gemm_prep": 4, "jaxlp_block_gemm_bf16": 8, "jaxlp_block_gemm": 4}
BLOCK_GEMM_STAGES = {"jaxlp_block_gemm_prep": 3, "jaxlp_block_gemm_bf16": 3, "jaxlp_block_gemm": 1}

#: (id, K-block g, whether the default route's int8 kernel reads the bf16 operands, variants):
#: "auto" (the default: the bf16 kernel, then the int8 kernel), "int8" (route="int8": the int8
#: kernel on its own int8 copies; with g = 9 and 40 "auto"'s int8 kernel reads such copies
#: too), "prep" (prep="pallas", taken by gpu_impl="auto": the operand preparation as a Pallas
#: kernel, masked power-of-two windows of the K-blocks, 24 in 32, 64 in 64, then the GEMM
#: kernels of "auto", the same modules, compiled once).
BLOCK_GEMMS = [("hbfp8-g24", 24, True, ("auto", "int8", "prep")),
               ("mxint8-g32", 32, True, ("auto", "int8")),
               ("g1", 1, False, ("auto", "int8")), ("g9", 9, False, ("auto",)),
               ("g40", 40, False, ("auto",)),
               ("g64", 64, True, ("prep",)), ("g1024", 1024, True, ("prep",))]


def _lower(fn, args, num_warps, num_stages):
  """[(triton_ir, num_warps, num_stages)] of every pallas_call in ``jit(fn)(*args)``.

  ``num_warps``/``num_stages`` (ints, or dicts by kernel name) are what jaxlp passes: the
  Triton IR text does not carry them; where jaxlib records them in the lowered module
  (jaxlib <= 0.10.2, in the custom call) they must be these."""
  text, modules = CL.lower_for_cuda(fn, *args)
  assert modules, "no pallas_call was lowered"

  def expected(name):
    return (num_warps[name] if isinstance(num_warps, dict) else num_warps,
            num_stages[name] if isinstance(num_stages, dict) else num_stages)

  recorded = TC.launch_params(text)
  if "xla.gpu.triton" in text:
    assert recorded, "launch parameters not found in the lowered text"
  for p in recorded:
    assert (p["num_warps"], p["num_stages"]) == expected(p["name"]), p
  return [(module, *expected(name))
          for name, module in zip(CL.kernel_names(modules), modules)]


@pytest.mark.parametrize("fn,args,num_warps,num_stages",
                         [k[1:] for k in KERNELS], ids=[k[0] for k in KERNELS])
def test_kernel_compiles_for_sm90(fn, args, num_warps, num_stages):
  for module, w, s in _lower(fn, args, num_warps, num_stages):
    ptx = TC.compile_ttir_sm90(module, num_warps=w, num_stages=s)
    assert ".target sm_90" in ptx and ".entry" in ptx


@pytest.mark.parametrize("g,shared,variants", [b[1:] for b in BLOCK_GEMMS],
                         ids=[b[0] for b in BLOCK_GEMMS])
def test_block_gemm_compiles_for_sm90(g, shared, variants):
  """The exact block GEMM's kernels (DotPolicy(block_dot="exact")) compile for sm_90, each
  distinct module once, with the properties its bits rest on:

  * the bf16 route is exact only if each K-block's partial leaves the MMA before it is added
    to the float32 sum (Triton's dot-add combine would turn ``s + dot(a, b)`` into
    ``dot(a, b, s)``, adding s inside the MMA with the hardware's rounding): in the sm_90
    TTGIR of the bf16 kernel every wgmma starts from a zero constant (checked for K-blocks of
    at most 32, one dot each; with g = 40 a K-block is several dots chained in the MMA), and
    the K-loop's loads are pipelined (async copies to shared memory);
  * the int8 route reads the bf16 route's operands where their padded K-blocks are a
    multiple of 32 (``int8_reads_bf16``: it recovers the significands in the kernel, and no
    int8 copy is written), else (and with route="int8") its own int8 copies; either way its
    dots are int8 x int8 -> int32 MMAs in the sm_90 PTX."""
  assert PB.int8_reads_bf16(g, True) == shared and not PB.int8_reads_bf16(g, False)
  compiled = {}
  for variant in variants:
    kw = dict(prep="pallas") if variant == "prep" else dict(route=variant)
    modules = _lower(lambda a, b, kw=kw: PB.block_gemm(a, b, g, 7, 7, **kw), (SQUARE, SQUARE),
                     BLOCK_GEMM_WARPS, BLOCK_GEMM_STAGES)
    names = CL.kernel_names([m for m, _, _ in modules])
    want = {"auto": ["jaxlp_block_gemm_bf16", "jaxlp_block_gemm"], "int8": ["jaxlp_block_gemm"],
            "prep": ["jaxlp_block_gemm_prep", "jaxlp_block_gemm_bf16", "jaxlp_block_gemm"]}
    assert names == want[variant], (variant, names)
    for name, (module, w, stages) in zip(names, modules):
      if (module, w, stages) not in compiled:
        compiled[module, w, stages] = TC.compile_ttir(module, num_warps=w, num_stages=stages)
      out = compiled[module, w, stages]
      assert ".target sm_90" in out["ptx"] and ".entry" in out["ptx"]
      if name == "jaxlp_block_gemm_bf16" and g <= 32:  # (longer K-blocks: several dots each)
        zeros = set(re.findall(
            r"(%[\w#]+) = arith\.constant dense<0\.0+e\+00> : tensor<\d+x\d+xf32", out["ttgir"]))
        accs = re.findall(r"warp_group_dot %[\w#]+, %[\w#]+, (%[\w#]+)", out["ttgir"])
        assert accs and set(accs) <= zeros, (accs, zeros)
        assert "async_copy_global_to_local" in out["ttgir"]
      elif name == "jaxlp_block_gemm":
        reads_bf16 = shared and variant != "int8"
        signature = re.search(r"tt\.func public @jaxlp_block_gemm\((.*)", module).group(1)
        assert ("!tt.ptr<bf16>" in signature) == reads_bf16  # the operands it reads
        assert ("!tt.ptr<i8>" in signature) == (not reads_bf16)
        assert "s32.s8.s8" in out["ptx"]


def _clz_kernel(x_ref, o_ref):
  o_ref[...] = lax.clz(x_ref[...])


def test_clz_kernel_fails_to_compile():
  """``lax.clz`` -> ``math.ctlz``, which the NVIDIA backend refuses (as it did on an H100)."""
  from jax.experimental.pallas import triton as plt

  def f(x):
    return pl.pallas_call(_clz_kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.uint32),
                          compiler_params=plt.CompilerParams())(x)

  _, modules = CL.lower_for_cuda(f, jax.ShapeDtypeStruct((16,), jnp.uint32))
  assert len(modules) == 1 and "math.ctlz" in modules[0]
  with pytest.raises(TC.TritonCompileError, match="failed to legalize operation 'math.ctlz'"):
    TC.compile_ttir_sm90(modules[0])


def test_parse_error_is_reported():
  """A module that does not even parse fails at the 'parse' stage, with MLIR's message."""
  with pytest.raises(TC.TritonCompileError, match="stage 'parse'"):
    TC.compile_ttir_sm90("module {\n  tt.func public @k() {\n    tt.bogus\n  }\n}\n")


#: Formats of test_cuda_lowering.ALL_FORMATS not compiled here: each runs the kernel code of
#: a format kept here with other constants only (the same family, specials, subnormal and
#: overflow rules, block layout and scale rule), and test_cuda_lowering lowers every one of
#: them with every rounding. Kept per family: IEEE-like E4M3 and FP32 (no rounding bits), fn
#: E4M3FN and fn_sat, fnuz E4M3FNUZ, nosub, bias, e1, m0; cpd and qpt (m = 23 too); fixed point
#: (clamped, symmetric, unclamped); hbfp(8,24) (a tile that is no power of two), the BFP tile,
#: axis and whole-axis layouts; MX float (E8M0 floor, rceil, even) and int8; NVFP4 1-D and 2-D;
#: the E8M0-scaled block format.
SAMPLED_OUT = {"E5M2", "E5M2FNUZ", "E2M1FN", "E2M3FN", "E3M2FN", "E3M4", "FP16", "BF16", "TF32",
               "cpd(8,23)", "hbfp(4,16)", "mx_e5m2", "mx_e2m1", "mx_e3m2"}

#: Formats kept above whose stochastic kernel is not compiled here, only their first rounding:
#: the stochastic kernel is the rounding kernel of the format's family with the counter hash
#: and the noise added ahead of the same rounding code, compiled here for each family and
#: layout: IEEE-like E4M3 (with quantize-E4M3-stochastic above, the default rand_bits), FP32,
#: m0 (no mantissa: the kept and the random bits compare differently), fixed point (8,4),
#: qpt(5,2), hbfp(8,24), the BFP tile, axis and whole-axis layouts, MX float (E8M0 floor, and
#: E2M1FN above) and int8, NVFP4 1-D and 2-D, the E8M0-scaled block format.
#: test_cuda_lowering lowers all of them with every rounding and rand_bits.
STOCHASTIC_SAMPLED_OUT = {"E4M3FN", "E4M3FNUZ", "fn_sat", "nosub", "bias", "e1",
                          "fixed(16,8,sym)", "fixed(12,3,noclamp)", "qpt(8,7)", "qpt(8,23)",
                          "mx_e4m3_even", "mx_e2m1_rceil"}


def _every_format_case():
  """One kernel per format of test_cuda_lowering.ALL_FORMATS but :data:`SAMPLED_OUT` (its
  first rounding; stochastic with rand_bits too where supported, but for
  :data:`STOCHASTIC_SAMPLED_OUT`)."""
  from test_cuda_lowering import ALL_FORMATS, SHAPE

  for name, fmt in ALL_FORMATS.items():
    if not PQ.supports(fmt, SHAPE) or name in SAMPLED_OUT:
      continue
    rs = [fmt.supported_roundings[0]]
    if ("stochastic" in fmt.supported_roundings and rs[0] != "stochastic"
        and name not in STOCHASTIC_SAMPLED_OUT):
      rs.append("stochastic")
    for r in rs:
      yield pytest.param(fmt, r, SHAPE, id=f"{name}-{r}")


@pytest.mark.parametrize("fmt,rounding,shape", list(_every_format_case()))
def test_every_format_kernel_compiles_for_sm90(fmt, rounding, shape):
  """Beyond the op allow-list of test_cuda_lowering: Triton's NVIDIA backend compiles the
  kernel of every format (types, layouts and conversions included) down to a cubin."""
  key = KEY if rounding == "stochastic" else None
  rb = 7 if rounding == "stochastic" else None

  def fn(x):
    return PQ.quantize(x, fmt, rounding, key=key, rand_bits=rb)

  for module, w, s in _lower(fn, (jax.ShapeDtypeStruct(shape, jnp.float32),), 4, 3):
    assert ".entry" in TC.compile_ttir_sm90(module, num_warps=w, num_stages=s)


# (FP16, IEEE-like as E5M2 and TF32, is the accumulator of matmul-stochastic-mulE5M2-accFP16)
@pytest.mark.parametrize("acc", [F.E5M2, F.E4M3FN, F.E2M1FN, F.TF32, F.qpytorch_float(5, 2),
                                 jaxlp.FixedPoint(16, 8)], ids=str)
def test_every_accumulator_kahan_kernel_compiles_for_sm90(acc):
  def fn(a, b):
    return PM.matmul(a, b, acc=acc, algorithm="kahan")

  for module, w, s in _lower(fn, (SQUARE, SQUARE), 4, 1):
    assert ".entry" in TC.compile_ttir_sm90(module, num_warps=w, num_stages=s)
