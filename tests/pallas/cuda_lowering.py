"""Lower jaxlp's Pallas kernels for CUDA on a CPU-only machine and inspect the Triton IR.

Two failure classes broke every kernel on the first H100 (see benchmarks/RESULTS.md)
and both are visible without a GPU:

* errors raised by the Pallas->Triton lowering itself (a bitcast of a trace-time constant:
  ``'TypedNdArray' object has no attribute 'type'``): :func:`lower_for_cuda` runs the
  lowering for platform ``cuda`` and lets them raise;
* ops in the emitted Triton IR that the NVIDIA backend cannot legalize (``lax.clz`` ->
  ``math.ctlz``): :func:`lower_for_cuda` records the Triton module of every ``pallas_call``
  and :func:`illegal_ops` lists the ops it contains that are not on :data:`ALLOWED_OPS`.

The Triton modules are recorded by wrapping ``jax._src.pallas.triton.lowering.
lower_jaxpr_to_triton_module`` for the duration of one lowering (a private JAX function:
if it moves, :func:`lower_for_cuda` fails loudly rather than checking nothing).
"""

from __future__ import annotations

import contextlib
import re
from unittest import mock

import jax

#: Every Triton-IR op the kernels may use. Ops outside this set fail the check: a new op
#: must first be compiled on a GPU (``benchmarks/kernels.py --check``) and then added here.
#: ``math.ctlz`` (from ``lax.clz``) is deliberately absent: the NVIDIA backend rejects it
#: ("failed to legalize operation 'math.ctlz' that was explicitly marked illegal").
ALLOWED_OPS = frozenset({
    # integer/float arithmetic, compares, selects and conversions
    "arith.addf", "arith.addi", "arith.andi", "arith.bitcast", "arith.cmpf", "arith.cmpi",
    "arith.constant", "arith.divsi", "arith.divui", "arith.extf", "arith.extsi", "arith.extui",
    "arith.fptosi", "arith.fptoui", "arith.maximumf", "arith.maxnumf", "arith.maxsi",
    "arith.maxui", "arith.minimumf", "arith.minnumf", "arith.minsi", "arith.minui",
    "arith.mulf", "arith.muli", "arith.negf", "arith.ori", "arith.remsi", "arith.remui",
    "arith.select", "arith.shli", "arith.shrsi", "arith.shrui", "arith.sitofp", "arith.subf",
    "arith.subi", "arith.truncf", "arith.trunci", "arith.uitofp", "arith.xori",
    # structured control flow (fori_loop, cond)
    "scf.for", "scf.if", "scf.yield", "scf.while", "scf.condition",
    # Triton memory, layout and program ops
    "tt.addptr", "tt.bitcast", "tt.broadcast", "tt.dot", "tt.expand_dims", "tt.func",
    "tt.get_num_programs", "tt.get_program_id", "tt.load", "tt.make_range", "tt.reduce",
    "tt.reduce.return", "tt.reshape", "tt.return", "tt.splat", "tt.store", "tt.trans",
})

_OP_RE = re.compile(
    r"(?:^|[\s=(])\"?((?:arith|math|scf|cf|tt|ttg|llvm|gpu)\.[A-Za-z_.]+)\"?[\s(<{]", re.M)


@contextlib.contextmanager
def _record_triton_modules():
  from jax._src.pallas.triton import lowering as triton_lowering

  modules: list[str] = []
  original = triton_lowering.lower_jaxpr_to_triton_module

  def recording(*args, **kwargs):
    result = original(*args, **kwargs)
    modules.append(result.module.operation.get_asm())
    return result

  with mock.patch.object(triton_lowering, "lower_jaxpr_to_triton_module", recording):
    yield modules


def lower_for_cuda(fn, *args, **kwargs):
  """Lower ``jax.jit(fn)(*args, **kwargs)`` for platform ``cuda``.

  ``args`` may be arrays or ``jax.ShapeDtypeStruct``. Returns ``(stablehlo_text,
  triton_modules)``: the lowered module's text and the Triton IR (text) of every
  ``pallas_call`` that was lowered for the GPU. Lowering errors propagate.
  """
  with _gpu_target(), _record_triton_modules() as modules:
    lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
  return text, list(modules)


#: The GPU the kernels are lowered for where no GPU is attached (Triton targets sm_90).
TARGET_DEVICE_KIND = "NVIDIA H100"


def _gpu_target():
  """A context naming an H100 as the lowering target when no GPU device is attached.

  From jax 0.11 the Pallas Triton lowering reads the GPU's compute capability from the
  default device and, on a CPU-only machine, raises "No supported GPU devices found, please
  specify an abstract GPU device using AbstractDevice". An abstract mesh whose abstract
  device is an H100 supplies it; with a GPU attached (or on older jax, which did not ask)
  nothing is set.
  """
  if any(d.platform == "gpu" for d in jax.devices()) or not hasattr(
      jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(
      device_kind=TARGET_DEVICE_KIND, num_cores=None, platform="cuda")
  # Auto axes: values carry no sharding, as on a GPU where no mesh is set. With Explicit
  # axes (the default) jax 0.11.2's Pallas lowering of a reduction over two axes fails ("Length
  # of sharding.spec (2) must be equal to aval's ndim (1)"), a failure no GPU run would see.
  mesh = jax.sharding.AbstractMesh((1,), ("_lowering",), abstract_device=device,
                                   axis_types=(jax.sharding.AxisType.Auto,))
  return jax.sharding.use_abstract_mesh(mesh)


def ops_in(triton_ir: str) -> set[str]:
  """Names of the dialect ops in a Triton module's text."""
  return set(_OP_RE.findall(triton_ir))


def illegal_ops(triton_ir: str) -> set[str]:
  """Ops in ``triton_ir`` outside :data:`ALLOWED_OPS` (e.g. ``math.ctlz``)."""
  return ops_in(triton_ir) - ALLOWED_OPS


def kernel_names(triton_modules) -> list[str]:
  """The ``tt.func`` names of the recorded Triton modules (the ``pallas_call`` names)."""
  names = []
  for m in triton_modules:
    names += re.findall(r"tt\.func (?:public )?@([\w$.]+)", m)
  return names
