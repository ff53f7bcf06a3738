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

import torch

from jaxlp.formats._block import qpytorch_block
from jaxlp.formats._compat import qpytorch_float
from jaxlp.formats._fixed_point import FixedPoint
from jaxlp.torch._dlpack import check_quantize_dtype
from jaxlp.torch._formats import QPyTorchFixedPoint
from jaxlp.torch._quantize import (
    TORCH_FORMAT_TYPES,
    check_torch_format,
    quantize_raw,
    quantize_raw_mask,
    resolve_key,
)

_QPT_ROUNDINGS = ("stochastic", "nearest")


def _check(x, rounding, what):
  if not isinstance(x, torch.Tensor):
    raise TypeError(f"jaxlp.torch.{what}: x must be a torch.Tensor, got {type(x).__name__}")
  check_quantize_dtype(x, what)
  if rounding not in _QPT_ROUNDINGS:
    raise ValueError(f"jaxlp.torch.{what}: rounding must be 'stochastic' or 'nearest', "
                     f"got rounding={rounding!r}")


def float_quantize(x, exp, man, rounding="stochastic", *, generator=None, seed=None):
  """QPyTorch's ``float_quantize(x, exp, man, rounding)`` (format :func:`qpytorch_float`).

  Nearest: round half away from zero, saturating, QPyTorch's subnormal trick, bit for bit.
  ``man=23`` is the identity (QPyTorch's x86 CPU build flips the sign there: undefined
  behaviour, not reproduced).
  """
  _check(x, rounding, "float_quantize")
  fmt = qpytorch_float(exp, man)
  return quantize_raw(x, fmt, rounding, resolve_key(rounding, generator, seed))


def block_quantize(x, wl, dim=-1, rounding="stochastic", *, generator=None, seed=None):
  """QPyTorch's ``block_quantize(x, wl, dim, rounding)`` (format :func:`qpytorch_block`).

  ``dim=-1``: one shared exponent for the whole tensor; ``dim=d``: one per index of axis d.
  """
  _check(x, rounding, "block_quantize")
  fmt = qpytorch_block(wl, dim)
  return quantize_raw(x, fmt, rounding, resolve_key(rounding, generator, seed))


def fixed_point_quantize(x, wl, fl, clamp=True, symmetric=False, rounding="stochastic", *,
                         generator=None, seed=None):
  """QPyTorch's ``fixed_point_quantize`` (CPU semantics, :class:`QPyTorchFixedPoint`)."""
  _check(x, rounding, "fixed_point_quantize")
  fmt = QPyTorchFixedPoint(wl, fl, clamp, symmetric)
  return quantize_raw(x, fmt, rounding, resolve_key(rounding, generator, seed))


def as_format(number, what="quantizer"):
  """A jaxlp format from a jaxlp format or a QPyTorch ``Number`` (None stays None).

  ``qtorch.FloatingPoint(exp, man)`` -> ``qpytorch_float(exp, man)``,
  ``qtorch.BlockFloatingPoint(wl, dim)`` -> ``qpytorch_block(wl, dim)``,
  ``qtorch.FixedPoint(wl, fl, clamp, symmetric)`` -> :class:`QPyTorchFixedPoint`.
  QPyTorch objects are recognised by class name and attributes, so qtorch is not needed.
  """
  if number is None or isinstance(number, TORCH_FORMAT_TYPES):
    return number
  name = type(number).__name__
  if name == "FloatingPoint" and hasattr(number, "exp") and hasattr(number, "man"):
    return qpytorch_float(int(number.exp), int(number.man))
  if name == "BlockFloatingPoint" and hasattr(number, "wl") and hasattr(number, "dim"):
    return qpytorch_block(int(number.wl), int(number.dim))
  if name == "FixedPoint" and all(hasattr(number, a) for a in ("wl", "fl", "clamp", "symmetric")):
    return QPyTorchFixedPoint(int(number.wl), int(number.fl), bool(number.clamp),
                              bool(number.symmetric))
  raise TypeError(
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
    A function tensor -> tensor (``torch.autograd.Function.apply``).
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
      raise ValueError("jaxlp.torch.quantizer: clamping_grad_zero=True needs a clamping "
                       f"fixed-point forward_number, got {fwd!r}")
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

  return Rounding.apply


class Quantizer(torch.nn.Module):
  """QPyTorch's ``Quantizer`` module: applies :func:`quantizer` in ``forward``."""

  def __init__(self, forward_number=None, backward_number=None, forward_rounding="stochastic",
               backward_rounding="stochastic", **kwargs):
    super().__init__()
    self.forward_number = forward_number
    self.backward_number = backward_number
    self.quantize = quantizer(forward_number, backward_number, forward_rounding,
                              backward_rounding, **kwargs)

  def forward(self, x):
    return self.quantize(x)
