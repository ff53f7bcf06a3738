"""The torch bridge's Triton kernels for CUDA tensors (``jaxlp/torch/_triton.py``), checked
without a GPU: in Triton's interpreter against the JAX spec, bit for bit, and compiled for an
H100 (sm_90) with the ``triton`` package. ``test_torch_cuda.py`` runs them on a GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package")

import _triton_check as C  # noqa: E402  (tests/torch_bridge is on sys.path, as for _torch_testutil)

from jaxlp import formats as F  # noqa: E402
from jaxlp.torch import _triton as T  # noqa: E402
from jaxlp.torch._formats import QPyTorchFixedPoint  # noqa: E402

HERE = Path(__file__).resolve().parent

# float16/bfloat16 inputs (the kernels widen and narrow them on the bits): a representative
# subset, nearest and stochastic
HALF_FORMATS = "E4M3,BF16,QPF52,QPF87,QPFX,QPB"


def _interpret(*args, timeout=600):
  env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(HERE / "_triton_check.py"), *args], cwd=HERE,
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_every_kernel_matches_the_spec_in_the_interpreter():
  """Every format family x every rounding it supports (the formats of
  ``_triton_check.INTERPRETER_NEAREST_AND_STOCHASTIC``: those two), float32 inputs: crafted
  patterns (every exponent field x ties, half-ulps and extremes, both signs) and random bit
  patterns; then float16 and bfloat16 inputs for a subset, in the same process. NaN-aware bit
  equality with the JAX spec."""
  r = _interpret("cpu", "1024", "float32", "--then", "cpu", "256", "float16,bfloat16",
                 HALF_FORMATS)  # one process: one start and import
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
  assert f"ok: {sum(map(C.interpretable, C.FORMATS))} formats, cpu float32\n" in r.stdout
  assert "ok: 6 formats, cpu float16,bfloat16\n" in r.stdout


def test_plan_covers_the_qpytorch_formats_and_refuses_the_rest():
  for fmt in C.FORMATS:
    for rounding in fmt.supported_roundings:
      assert T.plan(fmt, rounding) is not None, (fmt, rounding)
  for fmt, rounding in ((F.mx(F.E4M3FN, 32), "nearest"), (F.hbfp(7, 16), "nearest"),
                        (F.cpd_float(5, 2), "nearest"), (F.E4M3, "no_such_rounding")):
    assert T.plan(fmt, rounding) is None, fmt


def test_run_declines_what_it_does_not_handle():
  x = torch.ones(8)
  assert T.run(x.double(), F.E4M3, "nearest", None) is None  # dtype: the JAX route refuses it
  assert T.run(x, F.E4M3, "nearest", None, with_mask=True) is None  # masks: fixed point only
  assert T.run(x, F.mx(F.E4M3FN, 32), "nearest", None) is None
  assert T.run(x.reshape(2, 4), F.qpytorch_block(8, dim=2), "nearest", None) is None


def test_stochastic_needs_the_default_prng():
  words = np.array([1, 2], np.uint32)
  assert T.stochastic_supported()
  with jax.threefry_partitionable(False):
    assert not T.stochastic_supported()
    assert T.run(torch.ones(8), F.E4M3, "stochastic", words) is None
  with jax.default_prng_impl("rbg"):
    assert not T.stochastic_supported()


def _signature(fn, consts, dtype):
  sig = {}
  for a in fn.arg_names:
    if a in consts:
      sig[a] = "constexpr"
    elif a == "mask_ptr":
      sig[a] = "*u8"
    elif a in ("x_ptr", "y_ptr"):
      sig[a] = dtype
    elif a.endswith("_ptr"):
      sig[a] = "*fp32"
    else:
      sig[a] = "i32"
  return sig


@pytest.mark.parametrize("dtype", ["*fp32", "*fp16", "*bf16"])
def test_kernels_compile_for_sm90(dtype):
  """Each kernel (nearest and stochastic, every code path of its family) goes through the
  whole NVIDIA pipeline for an H100 (TTIR -> TTGIR -> LLIR -> PTX -> cubin) with no GPU."""
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  kern = T._k()  # noqa: SLF001
  cases = [(F.E4M3, "nearest"), (F.FloatFormat(4, 3, subnormals=False), "up"),
           (F.E5M2, "stochastic"), (F.qpytorch_float(5, 2), "nearest"),
           (F.qpytorch_float(8, 7), "stochastic"), (F.FixedPoint(8, 4), "down"),
           (QPyTorchFixedPoint(8, 4), "nearest"), (QPyTorchFixedPoint(6, 140), "nearest"),
           (QPyTorchFixedPoint(8, 4), "stochastic"), (QPyTorchFixedPoint(6, 140), "stochastic"),
           (F.FixedPoint(8, 4), "stochastic"), (F.qpytorch_block(8, 0), "nearest"),
           (F.qpytorch_block(4, -1), "stochastic")]
  whole = [("qpytorch_block_whole_kernel", T.plan(F.qpytorch_block(b, -1), r)[1])
           for b, r in ((8, "nearest"), (4, "stochastic"))]
  for fmt, rounding in [*cases, *whole]:
    name, consts = (fmt, rounding) if isinstance(fmt, str) else T.plan(fmt, rounding)
    fn = getattr(kern, name)
    c = dict(consts, BLOCK=T.BLOCK)
    if name == "qpytorch_fixed_kernel":
      c["WITH_MASK"] = True
    src = ASTSource(fn=fn, signature=_signature(fn, c, dtype),
                    constexprs={(fn.arg_names.index(k),): v for k, v in c.items()})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert out.asm["cubin"], (fmt, rounding)
