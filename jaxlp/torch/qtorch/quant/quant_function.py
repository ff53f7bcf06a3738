"""``qtorch.quant.quant_function``: ``float_quantize``, ``fixed_point_quantize``,
``block_quantize`` and ``quantizer`` (the same functions as :mod:`jaxlp.torch`'s)."""

from jaxlp.torch._qpytorch import block_quantize as block_quantize
from jaxlp.torch._qpytorch import fixed_point_quantize as fixed_point_quantize
from jaxlp.torch._qpytorch import float_quantize as float_quantize
from jaxlp.torch._qpytorch import quantizer as quantizer

__all__ = ["block_quantize", "fixed_point_quantize", "float_quantize", "quantizer"]
