"""``qtorch.quant`` on jaxlp: ``float_quantize``, ``fixed_point_quantize``,
``block_quantize``, ``quantizer`` and ``Quantizer``, with QPyTorch's signatures and defaults
(stochastic rounding by default) and QPyTorch's CPU bits for nearest rounding.

``from jaxlp.torch.qtorch.quant import *`` gives what ``from qtorch.quant import *`` gives.
These are the functions of :mod:`jaxlp.torch` (``jaxlp.torch.float_quantize`` is
``jaxlp.torch.qtorch.quant.float_quantize``).
"""

from jaxlp.torch.qtorch.quant import quant_function as quant_function
from jaxlp.torch.qtorch.quant import quant_module as quant_module
from jaxlp.torch.qtorch.quant.quant_function import block_quantize as block_quantize
from jaxlp.torch.qtorch.quant.quant_function import fixed_point_quantize as fixed_point_quantize
from jaxlp.torch.qtorch.quant.quant_function import float_quantize as float_quantize
from jaxlp.torch.qtorch.quant.quant_function import quantizer as quantizer
from jaxlp.torch.qtorch.quant.quant_module import Quantizer as Quantizer

__all__ = ["fixed_point_quantize", "block_quantize", "float_quantize", "quantizer", "Quantizer",
           "quant_function", "quant_module"]
