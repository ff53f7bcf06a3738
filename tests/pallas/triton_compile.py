"""Compile Pallas-emitted Triton IR for an H100 (sm_90) on a machine without a GPU.

:mod:`cuda_lowering` gets the Triton IR (``tt`` dialect text) of every ``pallas_call`` and
checks its ops against an allow-list. This module goes further: it runs that IR through the
NVIDIA backend of the ``triton`` package from PyPI (``pip install triton``), calling the same
stage functions as ``triton.compile`` for an sm_90 target (``CUDABackend.add_stages``), but
with an explicit target so that no CUDA driver or device is ever queried, and also running
the TTIR stage (``triton.compile`` skips it for ``.ttir`` input; Pallas's IR is unoptimised):

1. ``ttir``  -- Triton's TTIR cleanup pipeline (inliner, canonicalize, combine, CSE, ...);
2. ``ttgir`` -- ``convert-triton-to-tritongpu`` and the sm_90 TritonGPU passes (layouts,
   ``tt.dot`` -> MMA, software pipelining with ``num_stages``, ...). Ops the backend cannot
   legalize fail here, e.g. ``math.ctlz`` from ``lax.clz``: "failed to legalize operation
   'math.ctlz' that was explicitly marked illegal" -- the same message an H100 printed;
3. ``llir``  -- lowering to the LLVM dialect / LLVM IR (NVVM);
4. ``ptx``   -- LLVM's NVPTX backend;
5. ``cubin`` -- ``ptxas --gpu-name=sm_90a`` (the ``ptxas`` shipped inside the triton wheel),
   which catches invalid PTX and, with :data:`SM90_MAX_SHARED_BYTES`, shared-memory needs
   that no H100 can satisfy.

Any failure raises :class:`TritonCompileError`, whose message names the stage and carries
the MLIR diagnostics / ptxas log (MLIR prints those on the C++ side to file descriptor 2, so
the compile runs with fd 2 redirected to a temporary file).

What it cannot catch:

* differences between the PyPI ``triton`` used here and the Triton that actually compiles
  the kernel on a GPU machine (the one built into jaxlib / the XLA CUDA plugin, a pinned
  openxla/triton commit with XLA's own pass pipeline): an op or pattern accepted by one
  and rejected by the other will be missed or falsely reported. Keep the versions close;
* anything that happens at load or run time: wrong results, out-of-bounds accesses,
  races, launch-configuration errors (grid limits), the driver refusing the cubin,
  performance problems (spills, bank conflicts are only visible in ``ptxas -v`` output);
* errors in the Pallas -> Triton lowering itself (those already raise in
  :func:`cuda_lowering.lower_for_cuda`, before this module sees any IR);
* ``num_warps``/``num_stages`` other than the ones passed in: they are launch parameters
  that the Triton IR text does not contain (see :func:`launch_params`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

#: Largest dynamic shared memory one CTA may use on sm_90 (227 KiB, opt-in).
SM90_MAX_SHARED_BYTES = 232448

_STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")


class TritonCompileError(RuntimeError):
  """The NVIDIA backend of Triton rejected a module (message: stage and Triton's log)."""

  def __init__(self, stage: str, detail: str, log: str = "", arch: int = 90):
    self.stage = stage
    self.log = log
    msg = (f"Triton ({_triton_version()}) failed to compile for sm_{arch} at stage {stage!r}: "
           f"{detail}")
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    if errors:
      msg += "\n" + "\n".join(errors)
    if log:
      msg += "\n--- Triton output ---\n" + log
    super().__init__(msg)


def available() -> bool:
  """Whether the ``triton`` package and its NVIDIA backend can be imported."""
  try:
    import triton.backends.nvidia.compiler  # noqa: F401
    from triton._C.libtriton import ir  # noqa: F401
  except Exception:  # ImportError, or a broken install (missing shared libraries)
    return False
  return True


def _triton_version() -> str:
  try:
    import triton
    return f"triton {triton.__version__}"
  except Exception:
    return "triton ?"


@contextlib.contextmanager
def _stderr_to(path):
  """Redirect file descriptor 2 (where MLIR's C++ diagnostics go) to ``path``."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(path, "wb") as f:
      os.dup2(f.fileno(), 2)
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def compile_ttir(ttir_text: str, *, arch: int = 90, num_warps: int = 4, num_stages: int = 3,
                 cubin: bool = True) -> dict:
  """Compile Triton IR text for ``sm_<arch>`` through every NVIDIA backend stage.

  Returns ``{"ptx": str, "cubin": bytes | None, "shared": int, "name": str, "ttgir": str}``
  (``ttgir``: the TritonGPU module after the sm_90 passes, as text). Raises
  :class:`TritonCompileError` when parsing, a pass pipeline or ptxas fails.
  """
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget, Language
  from triton.backends.nvidia.compiler import CUDABackend

  # An explicit target: nothing below asks triton.runtime.driver for the current device.
  backend = CUDABackend(GPUTarget("cuda", arch, 32))
  # fp fusion (a*b+c -> fma) on: the default of Triton <= 3.9 (explicit, to silence its warning)
  options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages,
                                   "num_ctas": 1, "enable_fp_fusion": True})
  stages: dict = {}
  backend.add_stages(stages, options, Language.TRITON)
  unknown = [s for s in stages if s not in _STAGES]
  if unknown or list(stages)[:4] != list(_STAGES[:4]):
    raise RuntimeError(f"unexpected Triton NVIDIA stages {list(stages)}; update {__name__}")
  if not cubin:
    stages.pop("cubin")

  with tempfile.TemporaryDirectory(prefix="ttir_") as tmp:
    src = os.path.join(tmp, "kernel.ttir")
    log_path = os.path.join(tmp, "stderr.log")
    with open(src, "w") as f:
      f.write(ttir_text)

    def read_log():
      with open(log_path, errors="replace") as f:
        return f.read()

    stage = "parse"
    metadata: dict = {}
    outputs: dict = {}
    try:
      with _stderr_to(log_path):
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = ir.parse_mlir_module(src, context)
        module.context = context
        for stage, run_stage in stages.items():  # noqa: B007 (stage is reported on failure)
          module = outputs[stage] = run_stage(module, metadata)
          if stage == "ttgir":  # as text now: the next stage lowers the module in place
            outputs["ttgir"] = str(module)
    except Exception as e:  # pass-manager failure, parse error or ptxas error
      raise TritonCompileError(stage, f"{type(e).__name__}: {e}", read_log(), arch) from e

  shared = int(metadata.get("shared", 0))
  if arch == 90 and shared > SM90_MAX_SHARED_BYTES:
    raise TritonCompileError(
        "shared", f"needs {shared} bytes of shared memory, sm_90 allows {SM90_MAX_SHARED_BYTES}")
  return {"ptx": outputs["ptx"], "cubin": outputs.get("cubin"), "shared": shared,
          "name": metadata.get("name", ""), "ttgir": outputs["ttgir"]}


def compile_ttir_sm90(ttir_text: str, *, num_warps: int = 4, num_stages: int = 3) -> str:
  """Compile one Triton module (text) for sm_90 down to a cubin; return the PTX.

  ``num_warps``/``num_stages`` default to Pallas's defaults (``plt.CompilerParams()``).
  Raises :class:`TritonCompileError` (message includes Triton's error) on failure.
  """
  return compile_ttir(ttir_text, arch=90, num_warps=num_warps, num_stages=num_stages)["ptx"]


# the tail of the backend config of a ``__gpu$xla.gpu.triton`` custom call (keys sorted)
_LAUNCH_RE = re.compile(r'\bname = "([^"]*)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


def launch_params(stablehlo_text: str) -> list[dict]:
  """``num_warps``/``num_stages`` of each ``pallas_call`` in a lowered module's text.

  Read from the ``__gpu$xla.gpu.triton`` custom calls that jaxlib <= 0.10.2 emits (in the
  order of the text, which need not be the lowering order). Newer JAX compiles the kernel
  at lowering time instead and this returns ``[]``; callers then fall back to known values.
  """
  return [dict(name=m[0], num_stages=int(m[1]), num_warps=int(m[2]))
          for m in _LAUNCH_RE.findall(stablehlo_text)]
