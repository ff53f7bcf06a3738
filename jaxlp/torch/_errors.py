"""Exception types of the torch bridge that also match what QPyTorch and CPD raise.

A migrating user's ``except`` clauses name QPyTorch's or CPD's exception types (they check
arguments with ``assert``, their C++ extensions raise ``RuntimeError``, torch raises
``IndexError`` for a bad dimension); jaxlp documents ``TypeError`` and ``ValueError``. Each
class below derives from both, so an ``except`` clause written for either catches it.

References:
  Tiiiger/QPyTorch@f58bba7 ``qtorch/number.py``, ``qtorch/quant/quant_function.py``,
  ``qtorch/optim/optim_low.py``; drcut/CPD ``CPDtorch/quant/quant_function.py`` (what each
  raises, also checked against qtorch 0.3.0 in ``tests/torch_bridge/test_qtorch_tree.py``).
"""

from __future__ import annotations

import torch

from jaxlp.formats._quantize import DTypeError

#: The tensor dtypes the bridge rounds.
QUANTIZE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class QuantizeValueError(ValueError, AssertionError):
  """A bad argument value that QPyTorch or CPD reject with ``assert``: an unknown rounding
  mode, a number format's parameters out of range (``FloatingPoint(9, 2)``), a
  ``grad_scaling`` that is not positive, ``clamping_grad_zero`` with a fixed point that does
  not clamp. A ``ValueError`` and an ``AssertionError``.

  Example:
    >>> import torch
    >>> from jaxlp.torch import QuantizeValueError, float_quantize
    >>> try:
    ...   float_quantize(torch.ones(2), 5, 2, rounding="nearst")
    ... except AssertionError as e:  # QPyTorch's type; ValueError catches it too
    ...   print(isinstance(e, ValueError), isinstance(e, QuantizeValueError))
    True True
  """


class QuantizeTypeError(TypeError, AssertionError):
  """An argument of a type that QPyTorch or CPD reject with ``assert``: ``x`` is not a
  tensor, a number is neither a number class nor a jaxlp format, ``OptimLP`` gets an
  optimizer it cannot handle, ``quant_gemm`` gets an operand that is not 2-D. A
  ``TypeError`` and an ``AssertionError``.

  Example:
    >>> from jaxlp.torch import QuantizeTypeError, float_quantize
    >>> try:
    ...   float_quantize([1.0], 5, 2)
    ... except TypeError as e:
    ...   print(isinstance(e, AssertionError))
    True
  """


class TensorTypeError(DTypeError, RuntimeError):
  """A tensor the bridge cannot round: a dtype other than float32, float16 and bfloat16, or
  a sparse (non-strided) layout. QPyTorch's and CPD's C++ extensions raise ``RuntimeError``
  there ("expected scalar type Float", "unsupported memory format"); jaxlp's JAX side raises
  :class:`jaxlp.formats.DTypeError`. A ``TypeError``, a ``ValueError`` (as ``DTypeError``)
  and a ``RuntimeError``.

  Example:
    >>> import torch
    >>> from jaxlp.torch import TensorTypeError, quantize
    >>> from jaxlp.formats import E4M3
    >>> try:
    ...   quantize(torch.ones(2, dtype=torch.float64), E4M3)
    ... except RuntimeError as e:
    ...   print(type(e).__name__, isinstance(e, TypeError))
    TensorTypeError True
  """


class BlockDimError(ValueError, IndexError):
  """``block_quantize``'s ``dim`` outside the tensor's dimensions (or below -1): torch (and
  so QPyTorch) raises ``IndexError`` ("Dimension out of range"), jaxlp ``ValueError``.
  Both catch it.

  Example:
    >>> import torch
    >>> from jaxlp.torch import block_quantize
    >>> try:
    ...   block_quantize(torch.ones(4), 8, dim=1)
    ... except IndexError as e:
    ...   print(isinstance(e, ValueError))
    True
  """


class DeviceError(ValueError, RuntimeError):
  """A tensor on a device the bridge cannot read (``meta``, ``mps``, a CUDA tensor without
  a JAX GPU backend). Torch's kernels raise ``RuntimeError`` there; jaxlp ``ValueError``.

  Example:
    >>> import torch
    >>> from jaxlp.torch import DeviceError, to_jax
    >>> try:
    ...   to_jax(torch.ones(2, device="meta"))
    ... except RuntimeError as e:
    ...   print(isinstance(e, ValueError), isinstance(e, DeviceError))
    True True
  """


def check_tensor(t, what: str) -> None:
  """:class:`QuantizeTypeError` unless ``t`` is a tensor; then :func:`check_quantizable`."""
  if not isinstance(t, torch.Tensor):
    raise QuantizeTypeError(
        f"jaxlp.torch.{what}: x must be a torch.Tensor, got {type(t).__name__}")
  check_quantizable(t, what)


def check_quantizable(t, what: str) -> None:
  """:class:`TensorTypeError` unless tensor ``t`` is strided (dense) and float32, float16 or
  bfloat16."""
  if t.layout is not torch.strided:
    raise TensorTypeError(
        f"jaxlp.torch.{what}: tensor layout must be torch.strided (dense), got "
        f"layout={t.layout}; call .to_dense() first")
  if t.dtype not in QUANTIZE_DTYPES:
    raise TensorTypeError(
        f"jaxlp.torch.{what}: tensor dtype must be torch.float32, torch.float16 or "
        f"torch.bfloat16, got dtype={t.dtype} (cast explicitly; float64 would be rounded "
        "twice through float32)")
