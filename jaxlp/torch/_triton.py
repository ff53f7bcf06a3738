"""The torch bridge's native path for CUDA tensors: Triton kernels with the spec's bits.

Why (measured on one H100, torch 2.11, jax 0.11.2, 2026-11-26; ``benchmarks/RESULTS.md``):
through JAX a call costs a DLPack import (~35 us), the executable's dispatch (~27 us) and an
export (~11 us) before any work, so ``float_quantize`` took ~145 us per call at 4K elements
(QPyTorch: ~14 us) and was host-bound at 16M. A Triton kernel launched on torch's current
stream has none of these costs and reads and writes each element once.

What runs here: :class:`FloatFormat` (every preset, every rounding), :class:`QPyTorchFloat`
(``float_quantize``), :class:`FixedPoint`, :class:`QPyTorchFixedPoint`
(``fixed_point_quantize``, with the clamp mask) and :class:`QPyTorchBlock`
(``block_quantize``: the block maxima by ``torch.amax``, then one kernel; one kernel for a
whole-tensor block of at most :data:`WHOLE_BLOCK_MAX` elements) on float32, float16 and
bfloat16 CUDA tensors below 2**31 elements. Every other format, a JAX configuration whose
``jax.random.bits`` this module does not reproduce (another default PRNG, or
``jax_threefry_partitionable`` off), or a machine without Triton takes the JAX route
(``jaxlp/torch/_quantize.py``), with the same bits.

The kernels are ports of the jnp definitions (``jaxlp/torch/_triton_kernels.py``); this module
computes their constants from the format objects, once per (format, rounding).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import jax
import torch

from jaxlp.formats._bits import INF_BITS, QNAN_BITS, f32_bits
from jaxlp.formats._block import QPyTorchBlock
from jaxlp.formats._compat import QPyTorchFloat
from jaxlp.formats._fixed_point import FixedPoint
from jaxlp.formats._float_format import FloatFormat
from jaxlp.torch._formats import QPyTorchFixedPoint

#: Elements per Triton program, and its warps.
BLOCK = 2048
NUM_WARPS = 4
#: Largest tensor whose whole-tensor ``block_quantize`` (``dim=-1``) runs as one program
#: (its maximum and its rounding in one launch); larger ones take ``torch.amax`` first.
WHOLE_BLOCK_MAX = 32768
#: Largest tensor the kernels take (their offsets are int32).
MAX_ELEMENTS = 2**31 - 1 - BLOCK
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def available() -> bool:
  """Whether Triton is installed (checked once; the kernels' module is imported on first use)."""
  return importlib.util.find_spec("triton") is not None


@functools.cache
def _k():
  from jaxlp.torch import _triton_kernels  # noqa: PLC0415 -- imports triton

  return _triton_kernels


def stochastic_supported() -> bool:
  """Whether the kernels reproduce the spec's noise under the current JAX configuration: the
  spec derives its hash key with ``jax.random.bits`` on the uint32[2] key data, which the
  kernels compute as Threefry-2x32 in JAX's partitionable scheme (the default)."""
  c = jax.config
  return c.jax_default_prng_impl == "threefry2x32" and bool(c.jax_threefry_partitionable)


@functools.lru_cache(maxsize=256)
def plan(fmt, rounding: str):
  """(kernel name, constexpr arguments) for ``fmt`` and ``rounding``, or None where no kernel
  applies. The constants are the format's own (its ``max_normal``, bounds, ...)."""
  codes = _k().ROUND_CODES
  if rounding not in getattr(fmt, "supported_roundings", ()):
    return None
  rc = codes[rounding]
  if type(fmt) is FloatFormat:
    maxb = f32_bits(fmt.max_normal)
    over = {"max": 0, "nan": 1, "inf": 2, "inf_if_positive": 3,
            "inf_if_negative": 4}[fmt._overflow_rule(rounding)]
    infv = {"inf": INF_BITS, "max": maxb, "nan": QNAN_BITS}[fmt._inf_input_rule]
    return "float_kernel", dict(
        ROUND=rc, M=fmt.man_bits, EMIN=fmt.emin, SUBNORMALS=fmt.subnormals,
        BIG=f32_bits(2.0**fmt._quantum_below_normal), MAXB=maxb, OVER=over,
        INFV=infv, NEG_ZERO=fmt.has_negative_zero)
  if type(fmt) is QPyTorchFloat:
    return "qpytorch_float_kernel", dict(ROUND=rc, E=fmt.exp_bits, M=fmt.man_bits,
                                         SAT=fmt._saturation_bits, SMAG=fmt._rebase_bits)
  if type(fmt) is FixedPoint:
    hi, lo = fmt._clamp_bits
    return "fixed_kernel", dict(ROUND=rc, FL=fmt.fl, CLAMP=fmt.clamp, HI=hi, LO=lo)
  if type(fmt) is QPyTorchFixedPoint:
    lo, hi = fmt.bounds_bits
    return "qpytorch_fixed_kernel", dict(ROUND=rc, FL=fmt.fl, CLAMP=fmt.clamp, HI=hi, LO=lo)
  if type(fmt) is QPyTorchBlock:
    return "qpytorch_block_kernel", dict(ROUND=rc, WL=fmt.wl, CLIPV=f32_bits(2 ** (fmt.wl - 1) - 1))
  return None


def _block_max(x, dim: int):
  """(float32 block maxima of |x|, inner, size) for :class:`QPyTorchBlock` along ``dim``."""
  a = x.abs().float()
  if dim == -1:
    return a.amax().reshape(1), 1, 1
  others = tuple(d for d in range(x.dim()) if d != dim)
  mx = a.amax(dim=others) if others else a
  inner = 1
  for s in x.shape[dim + 1:]:
    inner *= s
  return mx.contiguous(), inner, x.shape[dim]


def quantize(t, fmt, rounding: str, words, with_mask: bool = False):
  """``t`` (a CUDA tensor) rounded to ``fmt`` by a Triton kernel: the tensor (or ``(q,
  mask)`` for :class:`QPyTorchFixedPoint` with ``with_mask``), or None where this path does
  not apply (the caller then takes the JAX route). ``words``: the uint32[2] key data of a
  stochastic call, else None."""
  idx = t.device.index
  if idx is None or idx == torch.cuda.current_device():
    return run(t, fmt, rounding, words, with_mask)
  with torch.cuda.device(idx):
    return run(t, fmt, rounding, words, with_mask)


def run(t, fmt, rounding: str, words, with_mask: bool = False):
  """:func:`quantize` on the current device (or, for tests, on CPU tensors in Triton's
  interpreter: ``TRITON_INTERPRET=1`` before this module's kernels are imported)."""
  if t.dtype not in _DTYPES or t.numel() > MAX_ELEMENTS:
    return None
  if with_mask and type(fmt) is not QPyTorchFixedPoint:
    return None
  p = plan(fmt, rounding)
  if p is None:
    return None
  if isinstance(fmt, QPyTorchBlock) and fmt.dim >= t.dim():
    return None  # the JAX route raises the error
  k0 = k1 = 0
  if rounding == "stochastic":
    if not stochastic_supported():
      return None
    k0, k1 = int(words[0]), int(words[1])
  name, consts = p
  x = t.detach()
  if not x.is_contiguous():
    x = x.contiguous()
  n = x.numel()
  y = torch.empty_like(x)
  mask = torch.empty(x.shape, dtype=torch.uint8, device=x.device) if with_mask else None
  if n:
    k = _k()
    grid = ((n + BLOCK - 1) // BLOCK,)
    consts = dict(consts, BLOCK=BLOCK)
    if name == "qpytorch_block_kernel" and fmt.dim == -1 and n <= WHOLE_BLOCK_MAX:
      LAUNCHER(k.qpytorch_block_whole_kernel, (1,), (x, y, n, k0, k1), consts, (1,))
    elif name == "qpytorch_block_kernel":
      mx, inner, size = _block_max(x, fmt.dim)
      LAUNCHER(k.qpytorch_block_kernel, grid, (x, mx, y, n, inner, size, k0, k1), consts, (2,))
    elif name == "qpytorch_fixed_kernel":
      consts["WITH_MASK"] = with_mask
      LAUNCHER(k.qpytorch_fixed_kernel, grid, (x, y, y if mask is None else mask, n, k0, k1),
               consts, (1, 2) if with_mask else (1,))
    else:
      LAUNCHER(getattr(k, name), grid, (x, y, n, k0, k1), consts, (1,))
  if with_mask:
    return y, mask.view(torch.bool)
  return y


def _spec(args) -> tuple:
  """What Triton specializes a compiled kernel on, for these launch arguments (a superset of
  it: one key never maps to two compiled kernels). Tensors: dtype, device and 16-byte
  alignment; ints: the integer type Triton gives them (int32, int64 or uint64 by range), and
  whether they equal 1 or are multiples of 16; bools and others: their type."""
  key = []
  for a in args:
    if isinstance(a, torch.Tensor):
      key.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
    elif isinstance(a, bool):
      key.append(bool)
    elif isinstance(a, int):
      key.append((-(2**31) <= a < 2**31, a < 2**63, a == 1, a % 16 == 0))
    else:
      key.append(type(a))
  return tuple(key)


class Launcher:
  """Launches the kernels without ``triton.JITFunction.run``'s per-call work.

  Why (one H200, Triton 3.6, 2026-11-26; ``benchmarks/RESULTS.md``): at 4K elements a call
  spent 43-63 us of its 79-101 us (under cProfile) in ``JITFunction.run``, which binds and
  specializes the arguments, hashes a cache key and looks the compiled kernel up on every
  call. Here the first call of each specialization (:func:`_spec`, the format's constexprs
  and the device) goes through ``JITFunction.run``, which compiles and returns the compiled
  kernel; later calls launch that kernel directly with ``compiled[grid](*args)``: the grid
  padded to three sizes (``CompiledKernel`` reads ``grid[0..2]``) and every argument in
  signature order, constexprs included, which is how ``JITFunction.run`` passes them to it in
  Triton 3.x (3.6 and 3.9 read). Other Triton versions always take ``JITFunction.run``.

  That calling convention is Triton's, not a public API, so the first direct launch of each
  specialization is checked: it runs into the real outputs, ``JITFunction.run`` into fresh
  ones, and the bits must agree (one synchronisation per specialization). On a difference or
  an exception the direct launch is switched off for this launcher with a warning, the
  ``JITFunction.run`` result is the one returned, and every later call takes
  ``JITFunction.run``. :attr:`disabled` then holds the reason.

  A launcher holds compiled kernels (at most :attr:`MAX_ENTRIES`; the cache is cleared when
  it is full); the module keeps one, :data:`LAUNCHER`.
  """

  MAX_ENTRIES = 1024

  def __init__(self, compiled_type=None):
    self._compiled_type = compiled_type
    self._cache: dict = {}
    self.disabled: str | None = None

  def _compiled_kernel_type(self):
    """Triton's ``CompiledKernel``; outside Triton 3.x, whose calling convention and
    specialization :func:`_spec` follows, ``()`` (``isinstance(x, ())`` is never true: no
    direct launches)."""
    if self._compiled_type is None:
      import triton  # noqa: PLC0415 -- triton is optional
      from triton.compiler import CompiledKernel  # noqa: PLC0415

      self._compiled_type = CompiledKernel if triton.__version__.startswith("3.") else ()
    return self._compiled_type

  def __call__(self, kernel, grid, args: tuple, consts: dict, outs: tuple):
    """Launch ``kernel[grid](*args, **consts, num_warps=NUM_WARPS)``; ``outs``: the indices
    in ``args`` of the tensors the kernel writes."""
    if self.disabled is not None:
      kernel[grid](*args, **consts, num_warps=NUM_WARPS)
      return
    key = (kernel, _spec(args), tuple(consts.items()))
    entry = self._cache.get(key)
    if entry is None:
      compiled = kernel[grid](*args, **consts, num_warps=NUM_WARPS)
      if len(self._cache) >= self.MAX_ENTRIES:
        self._cache.clear()
      if isinstance(compiled, self._compiled_kernel_type()):
        tail = tuple(consts[a] for a in kernel.arg_names[len(args):])
        self._cache[key] = [compiled, tail, False]
      else:  # Triton's interpreter (no compiled kernel), another Triton: JITFunction.run
        self._cache[key] = [None, (), True]
      return
    compiled, tail, checked = entry
    if compiled is None:
      kernel[grid](*args, **consts, num_warps=NUM_WARPS)
      return
    # A compiled kernel reads all three grid sizes (JITFunction.run pads a shorter grid with 1s)
    grid3 = (*grid, 1, 1)[:3]
    if checked:
      compiled[grid3](*args, *tail)
      return
    try:
      compiled[grid3](*args, *tail)
    except Exception as e:  # noqa: BLE001 -- any failure: fall back, and say why
      self._disable(f"the direct launch raised {type(e).__name__}: {e}")
      kernel[grid](*args, **consts, num_warps=NUM_WARPS)
      return
    ref = list(args)
    for i in outs:
      ref[i] = torch.empty_like(args[i])
    kernel[grid](*ref, **consts, num_warps=NUM_WARPS)
    same = all(torch.equal(_raw(args[i]), _raw(ref[i])) for i in outs)
    if not same:
      for i in outs:
        args[i].copy_(ref[i])
      self._disable("the direct launch gave other bits than JITFunction.run")
      return
    entry[2] = True

  def _disable(self, why: str):
    self.disabled = why
    self._cache.clear()
    warnings.warn(f"jaxlp.torch: {why} (Triton {_triton_version()}); every later call "
                  "takes JITFunction.run, with the same bits and more per-call time",
                  RuntimeWarning, stacklevel=3)


def _raw(t):
  """The bytes of a contiguous tensor (a NaN-aware, bit-for-bit comparison)."""
  return t.reshape(-1).view(torch.uint8)


def _triton_version() -> str:
  import triton  # noqa: PLC0415 -- triton is optional

  return triton.__version__


#: The module's launcher (a cache of compiled kernels; see :class:`Launcher`).
LAUNCHER = Launcher()
