"""Zero-copy exchange of tensors between PyTorch and JAX through DLPack.

``to_jax(t)`` and ``to_torch(a)`` share memory whenever both frameworks can: a contiguous,
suitably aligned CPU tensor becomes a JAX array on the CPU device that reads the same
buffer, and a JAX result becomes a torch tensor that owns the JAX buffer. CUDA tensors go
through the same protocol (``jax.dlpack.from_dlpack(t)`` / ``torch.from_dlpack(array)``,
both framework's documented entry points), which synchronises the producer's stream.

References:
  DLPack specification, https://dmlc.github.io/dlpack/latest/ ;
  ``jax.dlpack.from_dlpack`` and ``torch.from_dlpack`` documentation.
"""

from __future__ import annotations

import functools

import jax
import torch

from jaxlp.torch._errors import DeviceError, check_quantizable

# torch dtypes JAX can import through DLPack.
_EXCHANGE_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)

_X64_DTYPES = (torch.float64, torch.int64, torch.complex128)


def check_quantize_dtype(t, what: str = "quantize") -> None:
  """Raise :class:`~jaxlp.torch.TensorTypeError` (a ``TypeError``) unless tensor ``t`` is
  dense and float32, float16 or bfloat16."""
  check_quantizable(t, what)


@functools.cache
def _jax_device(kind: str, index: int | None):
  """The JAX device for torch device (kind, index), or a clear error (memoized lookup)."""
  if kind == "cpu":
    return jax.devices("cpu")[0]
  if kind == "cuda":
    try:
      gpus = jax.devices("gpu")
    except RuntimeError as e:
      raise DeviceError(
          f"jaxlp.torch: tensor is on device={kind}:{index} but JAX has no GPU backend "
          "(install jax[cuda12] or move the tensor to the CPU)") from e
    for d in gpus:
      if d.id == index or getattr(d, "local_hardware_id", None) == index:
        return d
    raise DeviceError(f"jaxlp.torch: no JAX GPU device matches torch device={kind}:{index}")
  raise DeviceError(
      f"jaxlp.torch: unsupported tensor device={kind}; only 'cpu' and 'cuda' tensors "
      "can be exchanged with JAX")


def jax_device_of(device):
  """The JAX device for torch device ``device`` (or a clear error)."""
  kind = device.type
  index = device.index
  if kind == "cuda" and index is None:
    index = torch.cuda.current_device()
  return _jax_device(kind, index)


def _jax_device_for(t):
  """The JAX device that holds the memory of torch tensor ``t`` (or a clear error)."""
  return jax_device_of(t.device)


@functools.cache
def _buffer_from_capsule():
  """jaxlib's DLPack import entry point, where this jaxlib has the expected one, else None.

  ``jax.dlpack.from_dlpack`` probes the device for an external-ready-events stream on every
  call, which on the CPU raises and catches an error (~55 us of a ~60 us call measured on the
  2-core CI machine, jax 0.10.2). Calling the import directly with the known device and stream
  costs ~6 us. Any mismatch with the private signature falls back to the public function.
  """
  try:
    from jax._src.lib import _jax, jaxlib_extension_version  # noqa: PLC0415
  except ImportError:
    return None
  fn = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
  if fn is None or jaxlib_extension_version < 467:
    return None
  try:  # the signature is private: check it once on a CPU tensor
    probe = torch.arange(4, dtype=torch.float32)
    out = fn(probe.__dlpack__(stream=None), jax.devices("cpu")[0], None, None, 1)
    if not isinstance(out, jax.Array) or out.shape != (4,) or float(out[3]) != 3.0:
      return None
  except Exception:  # noqa: BLE001 -- any failure means: use the public path
    return None
  return fn


def _import(t, device):
  fn = _buffer_from_capsule()
  dl_type = t.__dlpack_device__()[0]
  if fn is None or int(dl_type) not in (1, 2):  # kDLCPU, kDLCUDA (pinned host: public path)
    return jax.dlpack.from_dlpack(t)
  stream = None if int(dl_type) == 1 else device.get_stream_for_external_ready_events()
  return fn(t.__dlpack__(stream=stream), device, stream, None, int(dl_type))


@functools.cache
def _cpu_export():
  """jaxlib's DLPack export entry point and torch's capsule import, where both are as
  expected, else None (checked once on a small array).

  ``torch.from_dlpack(array)`` goes through ``Array.__dlpack__`` (sharding and device checks,
  ``addressable_data``) and torch's protocol negotiation: ~12 us per call on the 2-core CI
  machine, against ~2 us for the two calls below. CPU arrays only (a CUDA export must hand
  torch's current stream to JAX: the public path does that).
  """
  try:
    from jax._src.lib import _jax  # noqa: PLC0415
    to_capsule = _jax.buffer_to_dlpack_managed_tensor
    from_capsule = torch._C._from_dlpack  # noqa: SLF001 -- what torch.from_dlpack ends in
    probe = jax.device_put(jax.numpy.arange(4, dtype=jax.numpy.float32), jax.devices("cpu")[0])
    out = from_capsule(to_capsule(probe, stream=None))
    if not isinstance(out, torch.Tensor) or out.shape != (4,) or float(out[3]) != 3.0:
      return None
  except Exception:  # noqa: BLE001 -- any failure means: use the public path
    return None
  return to_capsule, from_capsule


def import_fast(t, device):
  """:func:`to_jax` of a tensor whose dtype and device were already checked (``device``: the
  JAX device of ``t``, see :func:`jax_device_of`): no re-validation.

  A contiguous CPU tensor (not pinned, no negative bit) goes straight to jaxlib's DLPack
  import through torch's legacy capsule export (``torch.utils.dlpack.to_dlpack``, a C
  function); anything else takes :func:`to_jax`'s route. Same buffer, same zero-copy rules.
  """
  fn = _buffer_from_capsule()
  if (fn is not None and t.device.type == "cpu" and t.is_contiguous() and not t.is_neg()
      and not t.is_pinned()):
    if t.requires_grad:
      t = t.detach()
    return fn(torch.utils.dlpack.to_dlpack(t), device, None, None, 1)
  t = t.detach()
  if t.is_neg():
    t = t.resolve_neg()
  if not t.is_contiguous():
    t = t.contiguous()
  return _import(t, device)


def export_fast(a, on_cpu: bool) -> torch.Tensor:
  """:func:`to_torch` of a single-device ``jax.Array`` (not re-checked; ``on_cpu``: whether
  it lives on JAX's CPU device): the direct export for CPU arrays (see :func:`_cpu_export`),
  ``torch.from_dlpack`` otherwise."""
  fns = _cpu_export()
  if on_cpu and fns is not None:
    to_capsule, from_capsule = fns
    return from_capsule(to_capsule(a, stream=None))
  return torch.from_dlpack(a)


def to_jax(t) -> jax.Array:
  """Share torch tensor ``t`` with JAX (zero-copy where possible).

  The tensor is detached (autograd is torch's business); a non-contiguous tensor is first
  made contiguous (one copy) so the JAX array has the default row-major layout. A tensor
  whose data pointer is not aligned as XLA requires (e.g. a view starting one element into
  its storage) is copied by JAX; otherwise no data moves. The JAX array aliases the tensor:
  do not modify the tensor in place while the array is in use.

  Args:
    t: a ``torch.Tensor`` on the CPU or a CUDA device.

  Returns:
    A ``jax.Array`` of the same shape and dtype on the matching JAX device.

  Raises:
    TypeError: ``t`` is not a tensor or has a dtype JAX cannot import (64-bit dtypes need
      ``jax_enable_x64``).
    ValueError: ``t`` lives on a device JAX cannot read (e.g. 'mps', 'meta'), or on a CUDA
      device while JAX has no GPU backend (or no matching GPU).

  Example:
    >>> import torch
    >>> from jaxlp.torch import to_jax
    >>> a = to_jax(torch.tensor([1.0, 2.0, 3.0]))
    >>> a.shape, a.dtype
    ((3,), dtype('float32'))
    >>> print(a)
    [1. 2. 3.]
  """
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"jaxlp.torch.to_jax: expected a torch.Tensor, got {type(t).__name__}")
  if t.dtype not in _EXCHANGE_DTYPES:
    raise TypeError(f"jaxlp.torch.to_jax: dtype={t.dtype} cannot be exchanged with JAX")
  if t.dtype in _X64_DTYPES and not jax.config.jax_enable_x64:
    raise TypeError(
        f"jaxlp.torch.to_jax: dtype={t.dtype} needs jax_enable_x64 (JAX would silently "
        "narrow it to 32 bits); enable it or cast the tensor first")
  device = _jax_device_for(t)  # device check with a clear message
  if t.is_conj():
    t = t.detach().resolve_conj()
  return import_fast(t, device)


def to_torch(a) -> torch.Tensor:
  """Share a single-device JAX array with torch (zero-copy).

  The returned tensor owns a reference to the JAX buffer. JAX treats arrays as immutable:
  modify the tensor in place only if nothing else uses the array.

  Args:
    a: a ``jax.Array`` committed to one device (CPU or GPU).

  Returns:
    A ``torch.Tensor`` of the same shape and dtype on the matching torch device.

  Raises:
    TypeError: ``a`` is not a ``jax.Array``.
    ValueError: ``a`` is sharded over several devices (gather it first).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp.torch import to_torch
    >>> to_torch(jnp.arange(3.0))
    tensor([0., 1., 2.])
  """
  if not isinstance(a, jax.Array):
    raise TypeError(f"jaxlp.torch.to_torch: expected a jax.Array, got {type(a).__name__}")
  devices = a.devices()
  if len(devices) != 1:
    raise ValueError(
        f"jaxlp.torch.to_torch: array is sharded over {len(devices)} devices; DLPack "
        "exchanges single-device arrays only (use jax.device_put(a, device) first)")
  (device,) = devices
  return export_fast(a, device.platform == "cpu")
