"""QPyTorch-compatible drop-ins: ``float_quantize``, ``block_quantize``,
``fixed_point_quantize``, ``quantizer`` and the ``Quantizer`` module.

Same signatures and defaults as ``qtorch.quant`` (stochastic rounding by default). Nearest
rounding gives QPyTorch's CPU bits exactly; stochastic rounding has QPyTorch's distribution
with jaxlp's counter-based noise (keys drawn from torch's RNG, see
:func:`jaxlp.torch.quantize`).

References:
  Tiiiger/QPyTorch@f58bba7, ``qtorch/quant/quant_function.py``, ``quant_module.py``.
"""

from __future__ import annotations

import functools

import torch

from jaxlp.formats._block import qpytorch_block
from jaxlp.formats._compat import qpytorch_float
from jaxlp.formats._fixed_point import FixedPoint
from jaxlp.torch._dlpack import check_quantize_dtype
from jaxlp.torch._errors import (
    QUANTIZE_DTYPES,
    BlockDimError,
    QuantizeTypeError,
    QuantizeValueError,
    check_tensor,
)
from jaxlp.torch._formats import QPyTorchFixedPoint
from jaxlp.torch._quantize import (
    TORCH_FORMAT_TYPES,
    check_torch_format,
    quantize_raw,
    quantize_raw_mask,
    resolve_key,
)

_QPT_ROUNDINGS = ("stochastic", "nearest")
_STRIDED = torch.strided


@functools.lru_cache(maxsize=64, typed=True)
def _cached_format(ctor, *args):
  """``ctor(*args)``, the same object again for the same argument values and types (a
  bounded cache: the compiled-executable cache then matches formats by identity, and the
  constructor's checks run once per distinct arguments). Callers catch the ``TypeError`` of
  unhashable arguments and call the constructor (and get its error)."""
  return ctor(*args)


def _check(x, rounding, what):
  # the common case in one test (check_tensor raises the error of any other)
  if not isinstance(x, torch.Tensor) or x.layout is not _STRIDED or x.dtype not in QUANTIZE_DTYPES:
    check_tensor(x, what)
  if rounding not in _QPT_ROUNDINGS:
    raise QuantizeValueError(f"jaxlp.torch.{what}: rounding must be 'stochastic' or "
                             f"'nearest', got rounding={rounding!r}")


def float_quantize(x, exp, man, rounding="stochastic", *, generator=None, seed=None):
  """QPyTorch's ``float_quantize(x, exp, man, rounding)`` (format :func:`qpytorch_float`).

  Nearest: round half away from zero, saturating, QPyTorch's subnormal trick, bit for bit.
  ``man=23`` keeps every fraction bit but still the format's exponent range (overflow
  saturates, small values go to the subnormal grid), as for every other ``man``; ``(8, 23)``
  is the identity. (QPyTorch's ``man=23`` is undefined behaviour: its x86 CPU build flips
  the sign; not reproduced.)

  Args:
    x: float32, float16 or bfloat16 tensor on the CPU or a CUDA device.
    exp: exponent bits (1..8).
    man: mantissa bits (0..23).
    rounding: "stochastic" (default, as QPyTorch) or "nearest".
    generator: optional ``torch.Generator`` for the stochastic key (default: torch's global
      RNG, see :func:`jaxlp.torch.draw_key`).
    seed: optional int seed for the stochastic key (exclusive with ``generator``).

  Returns:
    The quantized tensor: same shape, dtype and device as ``x``.

  Raises:
    QuantizeTypeError: ``x`` is not a tensor (a ``TypeError``; also an ``AssertionError``,
      as QPyTorch's check).
    TensorTypeError: ``x``'s dtype is not float32, float16 or bfloat16, or ``x`` is sparse
      (a ``TypeError``; also a ``RuntimeError``, as QPyTorch's extension).
    QuantizeValueError: ``rounding`` is neither "stochastic" nor "nearest" (a ``ValueError``;
      also an ``AssertionError``).
    TypeError: with stochastic rounding, ``generator`` is not a ``torch.Generator`` or
      ``seed`` is not an int.
    ValueError: both ``generator`` and ``seed`` are given, a stochastic ``seed`` is outside
      ``[0, 2**64)``, or ``exp`` / ``man`` is not an int in range.

  Example:
    >>> import torch
    >>> from jaxlp.torch import float_quantize
    >>> x = torch.tensor([0.1, 1.3, -2.7, 100.0])
    >>> float_quantize(x, exp=5, man=2, rounding="nearest")
    tensor([ 9.3750e-02,  1.2500e+00, -2.5000e+00,  9.6000e+01])
    >>> float_quantize(x, 5, 2, seed=0)  # stochastic, reproducible with a seed
    tensor([ 9.3750e-02,  1.2500e+00, -2.5000e+00,  9.6000e+01])
  """
  _check(x, rounding, "float_quantize")
  try:
    fmt = _cached_format(qpytorch_float, exp, man)
  except TypeError:  # unhashable arguments: the constructor's own error
    fmt = qpytorch_float(exp, man)
  return quantize_raw(x, fmt, rounding, resolve_key(rounding, generator, seed))


def block_quantize(x, wl, dim=-1, rounding="stochastic", *, generator=None, seed=None):
  """QPyTorch's ``block_quantize(x, wl, dim, rounding)`` (format :func:`qpytorch_block`).

  ``dim=-1``: one shared exponent for the whole tensor; ``dim=d``: one per index of axis d.

  Args:
    x: float32, float16 or bfloat16 tensor on the CPU or a CUDA device.
    wl: word length of each element (sign and mantissa bits, 2..23).
    dim: the axis whose indices get their own shared exponent, or -1 for one exponent.
    rounding: "stochastic" (default, as QPyTorch) or "nearest".
    generator: optional ``torch.Generator`` for the stochastic key (default: torch's global
      RNG, see :func:`jaxlp.torch.draw_key`).
    seed: optional int seed for the stochastic key (exclusive with ``generator``).

  Returns:
    The quantized tensor: same shape, dtype and device as ``x``.

  Raises:
    QuantizeTypeError: ``x`` is not a tensor (a ``TypeError``; also an ``AssertionError``,
      as QPyTorch's check).
    TensorTypeError: ``x``'s dtype is not float32, float16 or bfloat16, or ``x`` is sparse
      (a ``TypeError``; also a ``RuntimeError``, as QPyTorch's extension).
    QuantizeValueError: ``rounding`` is neither "stochastic" nor "nearest" (a ``ValueError``;
      also an ``AssertionError``).
    TypeError: with stochastic rounding, ``generator`` is not a ``torch.Generator`` or
      ``seed`` is not an int.
    BlockDimError: ``dim`` is below -1 or not below ``x.dim()`` (a ``ValueError``; also an
      ``IndexError``, as torch's "Dimension out of range").
    ValueError: both ``generator`` and ``seed`` are given, a stochastic ``seed`` is outside
      ``[0, 2**64)``, or ``wl`` is not an int in 2..23.

  Example:
    >>> import torch
    >>> from jaxlp.torch import block_quantize
    >>> block_quantize(torch.tensor([0.1, 1.3, -2.7, 100.0]), wl=8, rounding="nearest")
    tensor([  0.,   1.,  -3., 100.])
    >>> block_quantize(torch.tensor([[0.1, 1.3], [-2.7, 100.0]]), 4, dim=0, rounding="nearest")
    tensor([[ 0.0000,  1.2500],
            [ 0.0000, 96.0000]])
  """
  _check(x, rounding, "block_quantize")
  if not isinstance(dim, int) or isinstance(dim, bool) or (dim != -1 and not 0 <= dim < x.dim()):
    raise BlockDimError(
        f"jaxlp.torch.block_quantize: dim must be -1 (one exponent for the whole tensor) or "
        f"an axis in 0..{x.dim() - 1} of the {x.dim()}-d tensor, got dim={dim!r}")
  try:
    fmt = _cached_format(qpytorch_block, wl, dim)
  except TypeError:  # unhashable arguments: the constructor's own error
    fmt = qpytorch_block(wl, dim)
  return quantize_raw(x, fmt, rounding, resolve_key(rounding, generator, seed))


def fixed_point_quantize(x, wl, fl, clamp=True, symmetric=False, rounding="stochastic", *,
                         generator=None, seed=None):
  """QPyTorch's ``fixed_point_quantize`` (CPU semantics, :class:`QPyTorchFixedPoint`).

  Args:
    x: float32, float16 or bfloat16 tensor on the CPU or a CUDA device.
    wl: word length, total bits including the sign (1..64).
    fl: fractional bits (-100..149): values are multiples of ``2**-fl``.
    clamp: saturate to the representable range after rounding.
    symmetric: make the range symmetric (lower bound ``-2**(wl-fl-1) + 2**-fl``).
    rounding: "stochastic" (default, as QPyTorch) or "nearest".
    generator: optional ``torch.Generator`` for the stochastic key (default: torch's global
      RNG, see :func:`jaxlp.torch.draw_key`).
    seed: optional int seed for the stochastic key (exclusive with ``generator``).

  Returns:
    The quantized tensor: same shape, dtype and device as ``x``.

  Raises:
    QuantizeTypeError: ``x`` is not a tensor (a ``TypeError``; also an ``AssertionError``,
      as QPyTorch's check).
    TensorTypeError: ``x``'s dtype is not float32, float16 or bfloat16, or ``x`` is sparse
      (a ``TypeError``; also a ``RuntimeError``, as QPyTorch's extension).
    QuantizeValueError: ``rounding`` is neither "stochastic" nor "nearest" (a ``ValueError``;
      also an ``AssertionError``).
    TypeError: with stochastic rounding, ``generator`` is not a ``torch.Generator`` or
      ``seed`` is not an int.
    ValueError: both ``generator`` and ``seed`` are given, a stochastic ``seed`` is outside
      ``[0, 2**64)``, or ``wl`` / ``fl`` is out of range (see :class:`QPyTorchFixedPoint`);
      TypeError also when ``clamp`` or ``symmetric`` is not a bool.

  Example:
    >>> import torch
    >>> from jaxlp.torch import fixed_point_quantize
    >>> x = torch.tensor([0.1, 1.3, -2.7, 100.0])
    >>> fixed_point_quantize(x, wl=8, fl=4, rounding="nearest")  # 100 clamps to 7.9375
    tensor([ 0.1250,  1.3125, -2.6875,  7.9375])
    >>> fixed_point_quantize(x, 8, 4, clamp=False, rounding="nearest")
    tensor([  0.1250,   1.3125,  -2.6875, 100.0000])
  """
  _check(x, rounding, "fixed_point_quantize")
  try:
    fmt = _cached_format(QPyTorchFixedPoint, wl, fl, clamp, symmetric)
  except TypeError:  # unhashable arguments (or a bad type): the constructor's own error
    fmt = QPyTorchFixedPoint(wl, fl, clamp, symmetric)
  return quantize_raw(x, fmt, rounding, resolve_key(rounding, generator, seed))


def as_format(number, what="quantizer"):
  """A jaxlp format from a jaxlp format or a QPyTorch ``Number`` (None stays None).

  ``qtorch.FloatingPoint(exp, man)`` -> ``qpytorch_float(exp, man)``,
  ``qtorch.BlockFloatingPoint(wl, dim)`` -> ``qpytorch_block(wl, dim)``,
  ``qtorch.FixedPoint(wl, fl, clamp, symmetric)`` -> :class:`QPyTorchFixedPoint`.
  QPyTorch objects are recognised by class name and attributes, so qtorch is not needed.

  Args:
    number: None, a jaxlp format, or a QPyTorch ``FloatingPoint``, ``BlockFloatingPoint``
      or ``FixedPoint`` (or any object of that class name with the same attributes).
    what: the function name used in error messages.

  Returns:
    The jaxlp format (``number`` itself when it already is one), or None.

  Raises:
    QuantizeTypeError: ``number`` is none of the above (a ``TypeError`` and an
      ``AssertionError``, as QPyTorch's check).
    ValueError: the QPyTorch number's parameters are out of range for the jaxlp format.

  Example:
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.torch import as_format
    >>> as_format(None) is None, as_format(E4M3) is E4M3
    (True, True)
    >>> class FixedPoint:  # stands in for qtorch.FixedPoint(8, 4)
    ...   wl, fl, clamp, symmetric = 8, 4, True, False
    >>> as_format(FixedPoint())
    QPyTorchFixedPoint(wl=8, fl=4, clamp=True, symmetric=False)
  """
  if number is None or isinstance(number, TORCH_FORMAT_TYPES):
    return number
  fmt = getattr(number, "format", None)  # jaxlp.torch.qtorch's numbers carry their format
  if isinstance(fmt, TORCH_FORMAT_TYPES) and type(number).__module__.startswith("jaxlp."):
    return fmt
  name = type(number).__name__
  if name == "FloatingPoint" and hasattr(number, "exp") and hasattr(number, "man"):
    return qpytorch_float(int(number.exp), int(number.man))
  if name == "BlockFloatingPoint" and hasattr(number, "wl") and hasattr(number, "dim"):
    return qpytorch_block(int(number.wl), int(number.dim))
  if name == "FixedPoint" and all(hasattr(number, a) for a in ("wl", "fl", "clamp", "symmetric")):
    return QPyTorchFixedPoint(int(number.wl), int(number.fl), bool(number.clamp),
                              bool(number.symmetric))
  raise QuantizeTypeError(
      f"jaxlp.torch.{what}: a number must be None, a jaxlp format or a qtorch Number "
      f"(FloatingPoint, BlockFloatingPoint, FixedPoint), got {number!r}")


def _unclamped(fmt):
  if isinstance(fmt, (QPyTorchFixedPoint, FixedPoint)):
    return type(fmt)(fmt.wl, fmt.fl, False, fmt.symmetric)
  raise ValueError("jaxlp.torch.quantizer: clamping_grad_zero=True needs a fixed-point "
                   f"forward_number, got {fmt!r}")


def quantizer(forward_number=None, backward_number=None, forward_rounding="stochastic",
              backward_rounding="stochastic", clamping_grad_zero=False, backward_hooks=(), *,
              generator=None):
  """QPyTorch's ``quantizer``: an autograd function quantizing forward values and gradients.

  Args:
    forward_number: format of the forward output (None = identity): a jaxlp format or a
      QPyTorch ``Number`` (see :func:`as_format`).
    backward_number: format of the gradient (None = identity).
    forward_rounding, backward_rounding: any rounding the format supports (QPyTorch:
      "stochastic" or "nearest"); default "stochastic".
    clamping_grad_zero: zero the gradient of elements the (fixed-point, clamping) forward
      quantization clamped. As in QPyTorch, the mask and ``backward_hooks`` are applied
      only when ``backward_number`` is not None (hooks before the backward quantization),
      and ``backward_hooks`` are ignored when ``clamping_grad_zero`` is False.
    backward_hooks: functions tensor -> tensor.
    generator: optional ``torch.Generator`` for stochastic keys (default: global RNG).

  Returns:
    A function tensor -> tensor. A call autograd records (grad mode on, an input that
    requires grad) goes through a ``torch.autograd.Function``, whose backward quantizes the
    gradient; any other call returns the same forward values without a graph node. Calling it
    raises a ``TypeError`` when a quantized tensor is not float32, float16 or bfloat16.

  Raises:
    QuantizeTypeError: a number is not None, a jaxlp format or a QPyTorch number (see
      :func:`as_format`; a ``TypeError`` and an ``AssertionError``).
    TypeError: ``generator`` is not a ``torch.Generator`` (raised on the first stochastic
      call).
    QuantizeValueError: a rounding is unknown or unsupported by its format, or
      ``clamping_grad_zero=True`` with a forward number that is not a clamping fixed-point
      format (a ``ValueError`` and an ``AssertionError``).
    ValueError: a number's parameters are out of range.

  Example:
    >>> import torch
    >>> from jaxlp.formats import qpytorch_float
    >>> from jaxlp.torch import quantizer
    >>> q = quantizer(qpytorch_float(5, 2), qpytorch_float(5, 2), "nearest", "nearest")
    >>> t = torch.tensor([0.1, 1.3], requires_grad=True)
    >>> y = q(t)
    >>> y
    tensor([0.0938, 1.2500], grad_fn=<RoundingBackward>)
    >>> y.backward(torch.tensor([0.3, 3.3]))
    >>> t.grad  # the gradient is quantized too
    tensor([0.3125, 3.5000])
  """
  fwd = as_format(forward_number)
  bwd = as_format(backward_number)
  if fwd is not None:
    check_torch_format(fwd, forward_rounding, "quantizer")
  if bwd is not None:
    check_torch_format(bwd, backward_rounding, "quantizer")
  hooks = tuple(backward_hooks)
  if clamping_grad_zero and fwd is not None:
    if not getattr(fwd, "clamp", False):
      raise QuantizeValueError("jaxlp.torch.quantizer: clamping_grad_zero=True needs a "
                               f"clamping fixed-point forward_number, got {fwd!r}")
    fwd_unclamped = _unclamped(fwd)

  def _fwd(x):
    key = resolve_key(forward_rounding, generator, None)
    if not clamping_grad_zero:
      return quantize_raw(x, fwd, forward_rounding, key), None
    if isinstance(fwd, QPyTorchFixedPoint):
      return quantize_raw_mask(x, fwd, forward_rounding, key)
    q = quantize_raw(x, fwd, forward_rounding, key)
    qu = quantize_raw(x, fwd_unclamped, forward_rounding, key)
    return q, (q != qu) & ~torch.isnan(q)

  class Rounding(torch.autograd.Function):
    """Forward/backward quantization (generated by :func:`jaxlp.torch.quantizer`)."""

    @staticmethod
    def forward(ctx, x):
      if fwd is None:
        ctx.mask = None
        return x
      check_quantize_dtype(x, "quantizer")
      out, ctx.mask = _fwd(x.contiguous())
      return out

    @staticmethod
    def backward(ctx, grad_output):
      if not ctx.needs_input_grad[0]:
        return None
      if bwd is None:
        return grad_output
      if clamping_grad_zero:
        for f in hooks:
          grad_output = f(grad_output)
      key = resolve_key(backward_rounding, generator, None)
      g = quantize_raw(grad_output.contiguous(), bwd, backward_rounding, key)
      if clamping_grad_zero and ctx.mask is not None:
        g = g.masked_fill(ctx.mask.bool(), 0)
      return g

  def quantize(x):
    # autograd.Function.apply costs a graph node per call (about 15-25 us on a GPU host):
    # only a call whose gradient is wanted pays it; the others get the same forward
    if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
      return Rounding.apply(x)
    if fwd is None:
      return x
    check_tensor(x, "quantizer")
    return _fwd(x.contiguous())[0]

  return quantize


class Quantizer(torch.nn.Module):
  """QPyTorch's ``Quantizer`` module: applies :func:`quantizer` in ``forward``.

  Args:
    forward_number, backward_number, forward_rounding, backward_rounding: as
      :func:`quantizer`.
    **kwargs: the other keyword arguments of :func:`quantizer` (``clamping_grad_zero``,
      ``backward_hooks``, ``generator``).

  Raises:
    QuantizeTypeError, QuantizeValueError, TypeError, ValueError: as :func:`quantizer`.

  Example:
    >>> import torch
    >>> from jaxlp.formats import qpytorch_float
    >>> from jaxlp.torch import Quantizer
    >>> layer = Quantizer(forward_number=qpytorch_float(5, 2), forward_rounding="nearest")
    >>> layer(torch.tensor([0.1, 1.3]))
    tensor([0.0938, 1.2500])
  """

  def __init__(self, forward_number=None, backward_number=None, forward_rounding="stochastic",
               backward_rounding="stochastic", **kwargs):
    super().__init__()
    self.forward_number = forward_number
    self.backward_number = backward_number
    self.quantize = quantizer(forward_number, backward_number, forward_rounding,
                              backward_rounding, **kwargs)

  def forward(self, x):
    return self.quantize(x)
