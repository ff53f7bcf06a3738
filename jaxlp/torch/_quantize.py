"""``jaxlp.torch.quantize``: torch tensors through the JAX spec, same bits, zero-copy."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxlp.formats._quantize import FORMAT_TYPES, ROUNDINGS, key_words, random_bits
from jaxlp.ops._quantize import quantize_words
from jaxlp.torch import _cpu, _triton
from jaxlp.torch._dlpack import export_fast, import_fast, jax_device_of
from jaxlp.torch._errors import QUANTIZE_DTYPES, QuantizeValueError, TensorTypeError, check_tensor
from jaxlp.torch._formats import QPyTorchFixedPoint

TORCH_FORMAT_TYPES = (*FORMAT_TYPES, QPyTorchFixedPoint)
_STRIDED = torch.strided


def check_torch_format(fmt, rounding: str, what: str = "quantize") -> None:
  """Like ``jaxlp.formats.check_format`` but also accepting the torch-side formats."""
  if not isinstance(fmt, TORCH_FORMAT_TYPES):
    raise TypeError(
        f"jaxlp.torch.{what}: fmt must be a jaxlp format (FloatFormat, BlockFormat, "
        f"FixedPoint, mx(...), cpd_float(...), qpytorch_float(...), QPyTorchFixedPoint, ...), "
        f"got {fmt!r} of type {type(fmt).__name__}")
  if rounding not in ROUNDINGS:
    raise QuantizeValueError(f"jaxlp.torch.{what}: unknown rounding={rounding!r}; expected "
                             f"one of {ROUNDINGS}")
  if rounding not in fmt.supported_roundings:
    raise QuantizeValueError(
        f"jaxlp.torch.{what}: {type(fmt).__name__} supports rounding in "
        f"{fmt.supported_roundings}, got rounding={rounding!r}")


def seed_words(seed: int) -> np.ndarray:
  """The key data of ``jax.random.key(seed)`` as numpy: uint32 ``[seed >> 32, seed & 0xFFFFFFFF]``.

  What the bridge passes to its jitted functions (a host array moves to the tensor's device
  with the data; a typed key would first be placed on JAX's default device).
  """
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise TypeError(f"jaxlp.torch: seed must be an int, got seed={seed!r}")
  seed = int(seed)
  if not 0 <= seed < 2**64:
    raise ValueError(f"jaxlp.torch: seed must be in [0, 2**64), got seed={seed}")
  return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


_DRAW = threading.local()  # a per-thread int64[2] buffer for the draws below, and its numpy view


def draw_ints(generator=None) -> tuple[int, int]:
  """Two uint32 words drawn from a torch RNG (see :func:`draw_key`), as Python ints.

  The draw is ``torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator)``'s,
  made into a per-thread buffer (``Tensor.random_``: the same values, the same advance of
  the generator, without allocating a tensor)."""
  if generator is not None:
    if not isinstance(generator, torch.Generator):
      raise TypeError(f"jaxlp.torch: generator must be a torch.Generator, got {generator!r}")
    if generator.device.type != "cpu":
      w = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator,
                        device=generator.device)
      return tuple(w.tolist())
  bufs = getattr(_DRAW, "bufs", None)
  if bufs is None:
    buf = torch.empty(2, dtype=torch.int64)
    bufs = _DRAW.bufs = (buf, buf.numpy())
  bufs[0].random_(0, 2**32, generator=generator)
  return tuple(bufs[1].tolist())


def draw_words(generator=None) -> np.ndarray:
  """Two uint32 words drawn from a torch RNG (see :func:`draw_key`), as numpy."""
  return np.array(draw_ints(generator), np.uint32)


def _typed(words: np.ndarray):
  return jax.random.wrap_key_data(jnp.asarray(words), impl="threefry2x32")


def seed_to_key(seed: int):
  """The typed JAX key that ``seed=`` stands for in the torch bridge.

  Its key data is ``[seed >> 32, seed & 0xFFFFFFFF]`` (threefry), so it equals
  ``jax.random.key(seed)`` for ``0 <= seed < 2**32`` (and up to ``2**64`` with
  ``jax_enable_x64``): ``jaxlp.torch.quantize(t, fmt, "stochastic", seed=s)`` has the same bits
  as ``jaxlp.quantize(to_jax(t), fmt, "stochastic", key=jax.random.key(s))``.

  Args:
    seed: a Python or NumPy integer in ``[0, 2**64)``.

  Returns:
    A typed PRNG key (``jax.random.key``-style, scalar, threefry2x32).

  Raises:
    TypeError: ``seed`` is not an integer (bools are rejected).
    ValueError: ``seed`` is negative or not below ``2**64``.

  Example:
    >>> import jax
    >>> from jaxlp.torch import seed_to_key
    >>> k = seed_to_key(42)
    >>> bool((jax.random.key_data(k) == jax.random.key_data(jax.random.key(42))).all())
    True
    >>> jax.random.key_data(seed_to_key(2**32 + 7))
    Array([1, 7], dtype=uint32)
  """
  return _typed(seed_words(seed))


def draw_key(generator=None):
  """A typed JAX key drawn from a torch RNG (the global one when ``generator`` is None).

  The two key-data words are ``torch.randint(0, 2**32, (2,), dtype=torch.int64,
  generator=generator)`` (one draw, advancing the generator), so ``torch.manual_seed(s)`` makes
  stochastic rounding reproducible exactly as it does for torch's own random ops.

  Args:
    generator: optional ``torch.Generator`` (CPU or CUDA); None uses torch's global RNG.

  Returns:
    A typed PRNG key (scalar, threefry2x32).

  Raises:
    TypeError: ``generator`` is neither None nor a ``torch.Generator``.

  Example:
    >>> import jax, torch
    >>> from jaxlp.torch import draw_key
    >>> jax.random.key_data(draw_key(torch.Generator().manual_seed(0)))
    Array([2546248239, 3626093760], dtype=uint32)
    >>> _ = torch.manual_seed(0)
    >>> jax.random.key_data(draw_key())  # the global RNG, same seed, same words
    Array([2546248239, 3626093760], dtype=uint32)
  """
  return _typed(draw_words(generator))


def resolve_key(rounding, generator, seed):
  """The key data of one stochastic call (None when not stochastic): two uint32 words, as a
  numpy array (``seed``) or a tuple of ints (a draw)."""
  if generator is not None and seed is not None:
    raise ValueError("jaxlp.torch: pass either generator= or seed=, not both")
  if rounding != "stochastic":
    return None
  if seed is not None:
    return seed_words(seed)
  return draw_ints(generator)


def _kernel(fmt, rounding, with_mask, x, key):
  xf = x.astype(jnp.float32)
  if with_mask:
    rand = random_bits(key, x.shape) if rounding == "stochastic" else jnp.zeros((), jnp.uint32)
    q, mask = fmt.quantize_with_mask(xf, rounding, rand)
    return q.astype(x.dtype), mask
  kw = jnp.stack(key_words(key)) if rounding == "stochastic" else jnp.zeros((2,), jnp.uint32)
  # jaxlp.quantize's dispatch: the Pallas kernel on a GPU where it is faster, else the spec
  return quantize_words(xf, kw, fmt, rounding).astype(x.dtype)


#: Most compiled executables :func:`executable` keeps (least recently used ones go first).
CACHE_SIZE = 256

_JAX_DTYPES = {torch.float32: jnp.float32, torch.float16: jnp.float16,
               torch.bfloat16: jnp.bfloat16}

# The key words of a call that takes none (read-only: shared by every call).
_NO_KEY = np.zeros(2, np.uint32)
_NO_KEY.setflags(write=False)


def _config():
  """The JAX settings a trace of :func:`_kernel` reads (part of :func:`executable`'s key, so a
  changed setting compiles anew, as ``jax.jit`` would)."""
  c = jax.config
  return c.jax_enable_x64, c.jax_default_prng_impl, c.jax_threefry_partitionable


@functools.lru_cache(maxsize=CACHE_SIZE)
def executable(fmt, rounding: str, with_mask: bool, dtype, shape, device, config):
  """The compiled ``(x, key words) -> q`` (or ``(q, mask)``) for one torch dtype, shape and
  device: ``(executable, JAX device, on_cpu)``.

  One ``jax.jit(...).lower(...).compile()`` per key, kept in this bounded LRU cache (thread
  safe; a race compiles twice and keeps one). Calling the executable skips ``jax.jit``'s
  per-call signature and static-argument hashing; everything a call could get wrong is part of
  the key (a new dtype, shape or device builds and checks anew). ``config`` is
  :func:`_config` at the call.

  Raises:
    TypeError: ``dtype`` is not float32, float16 or bfloat16.
    ValueError: the device cannot be shared with JAX (as :func:`jaxlp.torch.to_jax`).
  """
  del config  # only a cache key: the trace below reads the live settings
  if dtype not in _JAX_DTYPES:
    raise TensorTypeError(f"jaxlp.torch.quantize: tensor dtype must be torch.float32, "
                          f"torch.float16 or torch.bfloat16, got dtype={dtype}")
  jdev = jax_device_of(device)
  sharding = jax.sharding.SingleDeviceSharding(jdev)
  x = jax.ShapeDtypeStruct(tuple(shape), _JAX_DTYPES[dtype], sharding=sharding)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding)
  exe = jax.jit(functools.partial(_kernel, fmt, rounding, with_mask)).lower(x, key).compile()
  return exe, jdev, jdev.platform == "cpu"


#: CPU tensors of the NumPy path's formats with more elements than this take the compiled JAX
#: spec instead (XLA's fused, multi-threaded loop is faster there: at 16M elements 84-360 ms
#: against 100-2200 ms for NumPy on the 2-core CI machine, 2026-11-29), their flat length
#: padded to a size class (:func:`bucket`) so that a new shape compiles only when it opens a
#: new class.
NATIVE_MAX = 2**16


def bucket(n: int) -> int:
  """The flat length a CPU tensor of ``n > NATIVE_MAX`` elements is padded to: the smallest
  ``c * 2**e`` (c in 4..8) not below ``n``, so at most 25% more and four classes per power
  of two."""
  e = n.bit_length() - 3
  return next(c << e for c in (4, 5, 6, 7, 8) if c << e >= n)


def _bucketable(t, fmt, rounding, with_mask):
  """Whether a large CPU tensor can take the bucketed JAX route: an elementwise format of the
  NumPy path (padding leaves every element's result and noise index alone), or
  ``qpytorch_block`` with one block (zero padding leaves the block maximum alone)."""
  p = _cpu.plan(fmt, rounding)
  if p is None or t.dtype not in _JAX_DTYPES:
    return False
  kind = p[0]
  if kind == "block":
    return fmt.dim == -1 and not with_mask
  return kind == "mask" or not with_mask


def _bucketed(t, fmt, rounding, key, with_mask):
  """:func:`jax_route` on ``t``'s flat, zero-padded copy of length :func:`bucket`; the
  result is the first ``t.numel()`` elements, viewed in ``t``'s shape (its storage is the
  padded buffer)."""
  n = t.numel()
  flat = t.detach().reshape(-1)
  b = bucket(n)
  if b > n:
    flat = torch.cat([flat, flat.new_zeros(b - n)])
  out = jax_route(flat, fmt, rounding, key, with_mask)
  if with_mask:
    return out[0][:n].view(t.shape), out[1][:n].view(t.shape)
  return out[:n].view(t.shape)


def quantize_raw(t, fmt, rounding, key, with_mask=False):
  """Quantize tensor ``t`` (no autograd) with an explicit uint32[2] key (or None); with
  ``with_mask``: ``(q, clamp mask)`` for :class:`QPyTorchFixedPoint`."""
  # the native paths (the spec's bits), where they apply
  if t.is_cpu:
    if t.numel() > NATIVE_MAX and _bucketable(t, fmt, rounding, with_mask):
      return _bucketed(t, fmt, rounding, key, with_mask)
    out = _cpu.quantize(t, fmt, rounding, key, with_mask)
    if out is not None:
      return out
  elif t.is_cuda and _triton.available():
    out = _triton.quantize(t, fmt, rounding, key, with_mask)
    if out is not None:
      return out
  return jax_route(t, fmt, rounding, key, with_mask)


def jax_route(t, fmt, rounding, key, with_mask=False):
  """``t`` quantized by the compiled JAX spec (what :func:`quantize` does where no native
  path applies; tests use it as the reference of the native paths)."""
  exe, jdev, on_cpu = executable(fmt, rounding, with_mask, t.dtype, t.shape, t.device,
                                 _config())
  out = exe(import_fast(t, jdev), _NO_KEY if key is None else np.asarray(key, np.uint32))
  if with_mask:
    return export_fast(out[0], on_cpu), export_fast(out[1], on_cpu)
  return export_fast(out, on_cpu)


def quantize_raw_mask(t, fmt, rounding, key):
  """(q, clamp mask) for :class:`QPyTorchFixedPoint` (QPyTorch's ``_mask`` kernels)."""
  return quantize_raw(t, fmt, rounding, key, True)


class _StraightThrough(torch.autograd.Function):
  """Quantize in the forward pass, identity gradient (as ``jaxlp.quantize`` under grad)."""

  @staticmethod
  def forward(ctx, t, fmt, rounding, key):
    del ctx
    return quantize_raw(t, fmt, rounding, key)

  @staticmethod
  def backward(ctx, g):
    del ctx
    return g, None, None, None


def quantize(t, fmt, rounding: str = "nearest", *, generator=None, seed=None):
  """Round every element of torch tensor ``t`` to ``fmt``: the same bits as ``jaxlp.quantize``.

  Where each tensor goes (every route gives the bits of ``jaxlp.quantize``):

  * CPU tensors of ``FloatFormat`` (and its presets), ``qpytorch_float``, ``cpd_float``,
    ``FixedPoint``, ``QPyTorchFixedPoint`` and ``qpytorch_block`` with at most
    ``NATIVE_MAX = 65536`` elements are rounded in NumPy on the tensor's memory
    (``jaxlp/torch/_cpu.py``): nothing is compiled, a new shape costs what a known one does.
    Larger ones (but ``qpytorch_block`` with ``dim >= 0``, which stays in NumPy) go to the
    compiled JAX function below with their flat length padded to one of four size classes
    per power of two, so a new shape compiles only when it opens a new class.
  * CUDA tensors of the same formats but ``cpd_float`` are rounded by Triton kernels on
    torch's current stream (``jaxlp/torch/_triton.py``).
  * Every other tensor is shared with JAX through DLPack (no copy for contiguous CPU/CUDA
    tensors), quantized by a compiled JAX function cached per (format, rounding, dtype,
    shape, device; at most 256 kept, least recently used dropped first), and the result
    comes back as a tensor of the same shape, dtype and device.

  Stochastic rounding: the JAX key is ``jax.random.key(seed)`` when ``seed`` is given
  (i.e. uint32 words ``[seed >> 32, seed & 0xFFFFFFFF]``), else two uint32 words drawn
  with ``torch.randint(0, 2**32, (2,), generator=generator)`` — from torch's global RNG
  when ``generator`` is None, so ``torch.manual_seed`` makes results reproducible.

  Args:
    t: float32, float16 or bfloat16 tensor on the CPU or a CUDA device.
    fmt: any jaxlp format (``FloatFormat``/presets, ``BlockFormat``, ``FixedPoint``,
      ``mx``, ``cpd_float``, ``qpytorch_float``, ``qpytorch_block``, ...) or
      :class:`jaxlp.torch.QPyTorchFixedPoint`.
    rounding: as in :func:`jaxlp.quantize`.
    generator: optional ``torch.Generator`` for stochastic rounding.
    seed: optional int seed for stochastic rounding (exclusive with ``generator``).

  Returns:
    The quantized tensor. Under autograd the gradient is the identity (straight-through).

  Raises:
    QuantizeTypeError: ``t`` is not a tensor (a ``TypeError``).
    TensorTypeError: ``t``'s dtype is not float32, float16 or bfloat16, or ``t`` is sparse
      (a ``TypeError``; the message names the layout and suggests ``.to_dense()``).
    TypeError: ``fmt`` is not a jaxlp format, or (stochastic rounding) ``generator`` is not
      a ``torch.Generator`` or ``seed`` is not an int.
    QuantizeValueError: ``rounding`` is unknown or not supported by ``fmt`` (a
      ``ValueError``).
    ValueError: both ``generator`` and ``seed`` are given, or a stochastic ``seed`` is
      outside ``[0, 2**64)``.
    DeviceError: the tensor's device cannot be shared with JAX (see :func:`to_jax`; a
      ``ValueError``).

  Example:
    >>> import torch
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.torch import quantize
    >>> quantize(torch.tensor([0.1, 1.3, -2.7]), E4M3)
    tensor([ 0.1016,  1.2500, -2.7500])
    >>> quantize(torch.tensor([0.1, 1.3]), E4M3, "stochastic", seed=0)
    tensor([0.1016, 1.2500])
  """
  # the common case in one test (check_tensor raises the error of any other)
  if not isinstance(t, torch.Tensor) or t.layout is not _STRIDED or t.dtype not in QUANTIZE_DTYPES:
    check_tensor(t, "quantize")
  check_torch_format(fmt, rounding)
  key = resolve_key(rounding, generator, seed)
  if torch.is_grad_enabled() and t.requires_grad:
    return _StraightThrough.apply(t, fmt, rounding, key)
  return quantize_raw(t, fmt, rounding, key)
