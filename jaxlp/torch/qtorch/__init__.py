"""QPyTorch's module tree on jaxlp: migrating is one import prefix.

``import qtorch`` becomes ``import jaxlp.torch.qtorch as qtorch``, and ``from qtorch.quant
import float_quantize`` becomes ``from jaxlp.torch.qtorch.quant import float_quantize``; the
names, signatures and defaults are QPyTorch 0.3.0's:

* ``jaxlp.torch.qtorch``: the number classes ``FloatingPoint``, ``FixedPoint``,
  ``BlockFloatingPoint`` (and ``Number``), also in :mod:`jaxlp.torch.qtorch.number`;
* :mod:`jaxlp.torch.qtorch.quant`: ``float_quantize``, ``fixed_point_quantize``,
  ``block_quantize``, ``quantizer``, ``Quantizer``;
* :mod:`jaxlp.torch.qtorch.optim`: ``OptimLP``;
* :mod:`jaxlp.torch.qtorch.auto_low`: ``lower``, ``sequential_lower``.

Nearest rounding gives QPyTorch's CPU bits (where QPyTorch's result is defined: see
``docs/migration.rst``); stochastic rounding has QPyTorch's distribution with jaxlp's
counter-based noise. Errors are instances of what QPyTorch raises for the same mistake and of
jaxlp's documented types (:class:`~jaxlp.torch.QuantizeValueError`, ...). Nothing here needs
QPyTorch or a compiler.

Example:
  >>> import torch
  >>> import jaxlp.torch.qtorch as qtorch
  >>> from jaxlp.torch.qtorch.quant import float_quantize
  >>> float_quantize(torch.tensor([0.1, 1.3]), exp=5, man=2, rounding="nearest")
  tensor([0.0938, 1.2500])
  >>> qtorch.FloatingPoint(exp=5, man=2)
  FloatingPoint (exponent=5, mantissa=2)
"""

from jaxlp.torch.qtorch import auto_low as auto_low
from jaxlp.torch.qtorch import number as number
from jaxlp.torch.qtorch import optim as optim
from jaxlp.torch.qtorch import quant as quant
from jaxlp.torch.qtorch.number import BlockFloatingPoint as BlockFloatingPoint
from jaxlp.torch.qtorch.number import FixedPoint as FixedPoint
from jaxlp.torch.qtorch.number import FloatingPoint as FloatingPoint
from jaxlp.torch.qtorch.number import Number as Number

__all__ = ["FixedPoint", "BlockFloatingPoint", "FloatingPoint", "Number", "auto_low", "number",
           "optim", "quant"]
