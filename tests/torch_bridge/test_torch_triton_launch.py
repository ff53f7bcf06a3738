"""The torch bridge's direct Triton launches (``jaxlp/torch/_triton.py``, :class:`Launcher`),
checked on the CPU with stand-ins for Triton's ``JITFunction`` and ``CompiledKernel``: which
calls go through ``JITFunction.run`` and which launch the compiled kernel, that a new
specialization compiles anew, that the first direct launch is checked and a wrong or failing
one switches the direct path off with a warning and the right result, and that every real
kernel's launch arguments cover its signature in order. On a GPU the CUDA tests
(``test_torch_cuda.py``) run the real launcher against the spec.
"""

import warnings

import pytest
import torch

from jaxlp import formats as F
from jaxlp.torch import _triton as T
from jaxlp.torch._formats import QPyTorchFixedPoint

NAMES = ("x_ptr", "y_ptr", "n", "K0", "K1", "SCALE", "BLOCK")


def affine(grid, a):
  """What the stand-in kernel computes: ``y[:n] = x[:n] * SCALE + K0`` (grid unused)."""
  n = a["n"]
  a["y_ptr"][:n] = a["x_ptr"][:n] * a["SCALE"] + a["K0"]


class FakeCompiled:
  def __init__(self, kernel):
    self.kernel = kernel

  def __getitem__(self, grid):
    def runner(*args):
      # Triton's CompiledKernel reads grid[0], grid[1] and grid[2] (3.6 and 3.9); a 1-tuple
      # raised IndexError on the H200 (2026-11-27) and switched the direct path off
      assert len(grid) == 3, grid
      self.kernel.log.append("direct")
      assert len(args) == len(NAMES), args  # every argument, constexprs included
      self.kernel.compiled_fn(grid, dict(zip(NAMES, args, strict=True)))
    return runner


class FakeKernel:
  """``kernel[grid](*args, **constexprs, num_warps=...)`` as ``JITFunction`` has it: runs
  ``fn`` and returns a compiled kernel (None: as Triton's interpreter)."""

  arg_names = list(NAMES)

  def __init__(self, compiled_fn=affine, returns_compiled=True):
    self.compiled_fn = compiled_fn
    self.returns_compiled = returns_compiled
    self.log = []

  def __getitem__(self, grid):
    def launch(*args, num_warps, **consts):
      assert num_warps == T.NUM_WARPS
      self.log.append("jit")
      affine(grid, dict(zip(NAMES, args)) | consts)
      return FakeCompiled(self) if self.returns_compiled else None
    return launch


def launcher():
  return T.Launcher(compiled_type=FakeCompiled)


def call(lau, kern, x, k0=3, scale=2.0):
  y = torch.full_like(x, -1.0)
  lau(kern, (1,), (x, y, x.numel(), k0, 0), {"SCALE": scale, "BLOCK": 8}, (1,))
  return y


def test_first_call_compiles_second_is_checked_then_direct():
  lau, kern, x = launcher(), FakeKernel(), torch.arange(8.0)
  want = x * 2 + 3
  for _ in range(4):
    assert torch.equal(call(lau, kern, x), want)
  # 1: JITFunction.run (compiles); 2: direct, then the check's JITFunction.run; 3, 4: direct
  assert kern.log == ["jit", "direct", "jit", "direct", "direct"]
  assert lau.disabled is None


@pytest.mark.parametrize("change", ["k0_int64", "k0_one", "k0_multiple_of_16", "misaligned",
                                    "dtype", "constexpr"])
def test_a_new_specialization_goes_through_jitfunction_run(change):
  lau, kern = launcher(), FakeKernel()
  x = torch.arange(16.0)
  call(lau, kern, x[:8])
  call(lau, kern, x[:8])
  kern.log.clear()
  k0, scale, xx = 3, 2.0, x[:8]
  if change == "k0_int64":
    k0 = 2**31 + 5
  elif change == "k0_one":
    k0 = 1
  elif change == "k0_multiple_of_16":
    k0 = 32
  elif change == "misaligned":
    xx = x[1:9]  # 4 bytes past a 16-byte boundary
  elif change == "dtype":
    xx = x[:8].double()
  else:
    scale = 0.5
  y = call(lau, kern, xx, k0=k0, scale=scale)
  assert torch.equal(y, xx * scale + k0)
  assert kern.log == ["jit"]


def swapped(grid, a):
  """A compiled kernel that received its arguments in another order."""
  affine(grid, dict(a, K0=a["K1"]))


def raises(grid, a):
  raise TypeError("launcher signature changed")


@pytest.mark.parametrize("bad", [swapped, raises], ids=["other_bits", "raises"])
def test_a_wrong_direct_launch_falls_back_with_a_warning(bad):
  lau, kern, x = launcher(), FakeKernel(compiled_fn=bad), torch.arange(8.0)
  call(lau, kern, x)
  with pytest.warns(RuntimeWarning, match="JITFunction.run"):
    y = call(lau, kern, x)
  assert torch.equal(y, x * 2 + 3)  # the JITFunction.run result
  assert lau.disabled is not None
  kern.log.clear()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert torch.equal(call(lau, kern, x), x * 2 + 3)
  assert kern.log == ["jit"]


def test_nan_payloads_are_compared_bit_for_bit():
  """Two NaNs with different payloads are different bits: the check catches them."""
  def nan_payload(grid, a):
    affine(grid, a)
    a["y_ptr"].view(torch.int32)[0] = 0x7FC00001

  lau = launcher()
  kern = FakeKernel(compiled_fn=nan_payload)
  x = torch.full((8,), float("nan"))
  call(lau, kern, x)
  with pytest.warns(RuntimeWarning):
    y = call(lau, kern, x)
  assert y.view(torch.int32)[0] != 0x7FC00001


def test_without_a_compiled_kernel_every_call_takes_jitfunction_run():
  """Triton's interpreter returns no compiled kernel."""
  lau, kern, x = launcher(), FakeKernel(returns_compiled=False), torch.arange(8.0)
  for _ in range(3):
    assert torch.equal(call(lau, kern, x), x * 2 + 3)
  assert kern.log == ["jit"] * 3


def test_the_cache_is_bounded():
  lau, kern, x = launcher(), FakeKernel(), torch.arange(8.0)
  lau.MAX_ENTRIES = 4
  for s in range(10):
    call(lau, kern, x, scale=float(s))
  assert len(lau._cache) <= 4


# The real kernels: run() hands the launcher arguments that cover each signature in order
def _cases():
  fp = QPyTorchFixedPoint(8, 4)
  yield "float", F.E5M2, False, torch.randn(64)
  yield "qpytorch_float", F.qpytorch_float(5, 2), False, torch.randn(64)
  yield "fixed", F.FixedPoint(8, 4), False, torch.randn(64)
  yield "qpytorch_fixed", fp, False, torch.randn(64)
  yield "qpytorch_fixed_mask", fp, True, torch.randn(64)
  yield "block_whole", F.qpytorch_block(8, -1), False, torch.randn(64)
  yield "block_dim", F.qpytorch_block(8, 0), False, torch.randn(4, 16)


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_run_passes_every_kernel_argument(case, rounding, monkeypatch):
  pytest.importorskip("triton", reason="the kernels' signatures need the triton package")
  _, fmt, with_mask, x = case
  seen = []

  def record(kernel, grid, args, consts, outs):
    seen.append(kernel)
    names = kernel.arg_names
    assert set(names[len(args):]) == set(consts), (names, consts)
    assert all(isinstance(args[i], torch.Tensor) for i in outs)
    assert all(names[i].endswith("_ptr") for i in outs)
    assert [names[i] for i in outs] == (["y_ptr", "mask_ptr"] if with_mask else ["y_ptr"])
    tail = [names.index(c) for c in consts]
    assert min(tail) == len(args)  # constexprs follow the runtime arguments

  monkeypatch.setattr(T, "LAUNCHER", record)
  words = [7, 2**32 - 3] if rounding == "stochastic" else None
  T.run(x, fmt, rounding, words, with_mask)
  assert len(seen) == 1


def test_only_triton_3_gets_direct_launches(monkeypatch):
  """The calling convention and specialization the launcher follows are Triton 3.x's: under
  another version every call takes JITFunction.run."""
  triton = pytest.importorskip("triton")
  monkeypatch.setattr(triton, "__version__", "4.0.0")
  lau, kern, x = T.Launcher(), FakeKernel(), torch.arange(8.0)
  for _ in range(3):
    assert torch.equal(call(lau, kern, x), x * 2 + 3)
  assert kern.log == ["jit"] * 3
