"""``CPDtorch.quant.quant_function``: ``float_quantize``, ``quantizer``, ``quant_gemm``
(the functions of :mod:`jaxlp.torch.cpd`)."""

from jaxlp.torch.cpd import float_quantize as float_quantize
from jaxlp.torch.cpd import quant_gemm as quant_gemm
from jaxlp.torch.cpd import quantizer as quantizer

__all__ = ["float_quantize", "quant_gemm", "quantizer"]
