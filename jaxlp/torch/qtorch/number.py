"""QPyTorch's number classes (``qtorch.number``): ``FloatingPoint``, ``FixedPoint``,
``BlockFloatingPoint`` and their base ``Number``.

Each is a description of a jaxlp format (its :attr:`Number.format`): wherever QPyTorch takes
a number (``quantizer``, ``Quantizer``, ``auto_low.lower``), so does jaxlp, and every jaxlp
format is accepted there too. Parameters are checked at construction: a value out of range
raises :class:`~jaxlp.torch.QuantizeValueError` (a ``ValueError`` and, as QPyTorch's
``assert``, an ``AssertionError``); jaxlp's ranges are wider in places (``man = 0``, ``fl <=
0``) and narrower where QPyTorch's kernels are undefined (``BlockFloatingPoint`` ``wl`` above
23 or below 2).

References:
  Tiiiger/QPyTorch@f58bba7, ``qtorch/number.py``.
"""

from __future__ import annotations

from jaxlp.formats._block import qpytorch_block
from jaxlp.formats._compat import qpytorch_float
from jaxlp.torch._errors import QuantizeTypeError, QuantizeValueError
from jaxlp.torch._formats import QPyTorchFixedPoint

__all__ = ["BlockFloatingPoint", "FixedPoint", "FloatingPoint", "Number"]


def _int(cls, name, v):
  if not isinstance(v, int) or isinstance(v, bool):
    raise QuantizeValueError(f"{cls}: {name} must be an int, got {name}={v!r}")
  return v


def _format(cls, make, *args):
  try:
    return make(*args)
  except ValueError as e:
    raise QuantizeValueError(f"{cls}: {e}") from None
  except TypeError as e:
    raise QuantizeTypeError(f"{cls}: {e}") from None


class Number:
  """Base class of the number formats (QPyTorch's ``qtorch.Number``).

  Subclasses hold their parameters as QPyTorch's do and the jaxlp format they stand for in
  :attr:`format`; two numbers of the same class and parameters compare equal.

  Example:
    >>> from jaxlp.torch.qtorch import FloatingPoint, Number
    >>> isinstance(FloatingPoint(5, 2), Number)
    True
  """

  format = None  #: the jaxlp format this number stands for (set by subclasses)

  def _key(self):
    return ()

  def __eq__(self, other):
    return type(self) is type(other) and self._key() == other._key()

  def __hash__(self):
    return hash((type(self).__name__, self._key()))


class FloatingPoint(Number):
  """QPyTorch's ``FloatingPoint(exp, man)``: the format of ``float_quantize(x, exp, man)``,
  :func:`jaxlp.formats.qpytorch_float` (QPyTorch's CPU bits for nearest rounding).

  Args:
    exp: exponent bits, 1..8.
    man: mantissa bits without the hidden one, 0..23 (QPyTorch: 1..23).

  Raises:
    QuantizeValueError: ``exp`` or ``man`` is not an int in range.

  Example:
    >>> import torch
    >>> from jaxlp.torch.qtorch import FloatingPoint
    >>> from jaxlp.torch.qtorch.quant import quantizer
    >>> FloatingPoint(exp=5, man=2)
    FloatingPoint (exponent=5, mantissa=2)
    >>> quantizer(FloatingPoint(5, 2), forward_rounding="nearest")(torch.tensor([0.1, 1.3]))
    tensor([0.0938, 1.2500])
  """

  def __init__(self, exp, man):
    self.exp = _int("FloatingPoint", "exp", exp)
    self.man = _int("FloatingPoint", "man", man)
    self.format = _format("FloatingPoint", qpytorch_float, exp, man)

  def _key(self):
    return (self.exp, self.man)

  def __repr__(self):
    return f"FloatingPoint (exponent={self.exp:d}, mantissa={self.man:d})"

  __str__ = __repr__


class FixedPoint(Number):
  """QPyTorch's ``FixedPoint(wl, fl, clamp=True, symmetric=False)``: the format of
  ``fixed_point_quantize``, :class:`jaxlp.torch.QPyTorchFixedPoint` (QPyTorch's CPU bits).

  Args:
    wl: word length including the sign, 1..64.
    fl: fractional bits, -100..149 (QPyTorch: positive); values are multiples of ``2**-fl``.
    clamp: saturate to the range after rounding (a bool).
    symmetric: drop the lowest value so that the range is symmetric (a bool).

  Raises:
    QuantizeValueError: ``wl`` or ``fl`` is not an int in range.
    QuantizeTypeError: ``clamp`` or ``symmetric`` is not a bool.

  Example:
    >>> from jaxlp.torch.qtorch import FixedPoint
    >>> FixedPoint(wl=8, fl=4)
    FixedPoint (wl=8, fl=4)
    >>> FixedPoint(8, 4).format
    QPyTorchFixedPoint(wl=8, fl=4, clamp=True, symmetric=False)
  """

  def __init__(self, wl, fl, clamp=True, symmetric=False):
    self.wl = _int("FixedPoint", "wl", wl)
    self.fl = _int("FixedPoint", "fl", fl)
    self.clamp = clamp
    self.symmetric = symmetric
    self.format = _format("FixedPoint", QPyTorchFixedPoint, wl, fl, clamp, symmetric)

  def _key(self):
    return (self.wl, self.fl, self.clamp, self.symmetric)

  def __repr__(self):
    return f"FixedPoint (wl={self.wl:d}, fl={self.fl:d})"

  __str__ = __repr__


class BlockFloatingPoint(Number):
  """QPyTorch's ``BlockFloatingPoint(wl, dim=-1)``: the format of ``block_quantize``,
  :func:`jaxlp.formats.qpytorch_block`.

  Args:
    wl: word length of each element including the sign, 2..23.
    dim: -1 for one shared exponent over the whole tensor, else the axis whose indices get
      one each.

  Raises:
    QuantizeValueError: ``wl`` is not an int in 2..23, or ``dim`` is not an int >= -1.

  Example:
    >>> import torch
    >>> from jaxlp.torch.qtorch import BlockFloatingPoint
    >>> from jaxlp.torch.qtorch.quant import quantizer
    >>> BlockFloatingPoint(wl=8)
    BlockFloatingPoint (wl=8, dim=-1)
    >>> quantizer(BlockFloatingPoint(4), forward_rounding="nearest")(torch.tensor([3.0, 0.3]))
    tensor([3.0000, 0.5000])
  """

  def __init__(self, wl, dim=-1):
    self.wl = _int("BlockFloatingPoint", "wl", wl)
    self.dim = _int("BlockFloatingPoint", "dim", dim)
    self.format = _format("BlockFloatingPoint", qpytorch_block, wl, dim)

  def _key(self):
    return (self.wl, self.dim)

  def __repr__(self):
    return f"BlockFloatingPoint (wl={self.wl:d}, dim={self.dim:d})"

  __str__ = __repr__
