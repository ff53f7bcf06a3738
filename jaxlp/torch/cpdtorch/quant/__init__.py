"""``CPDtorch.quant`` on jaxlp: ``float_quantize``, ``quantizer``, ``Quantizer``,
``quant_gemm``, ``Quant_Linear``, ``Quant_Conv`` with CPD's signatures (the objects of
:mod:`jaxlp.torch.cpd`; CPU tensors work too, where CPD raises ``NotImplementedError``)."""

from jaxlp.torch.cpdtorch.quant import quant_function as quant_function
from jaxlp.torch.cpdtorch.quant import quant_module as quant_module
from jaxlp.torch.cpdtorch.quant.quant_function import float_quantize as float_quantize
from jaxlp.torch.cpdtorch.quant.quant_function import quant_gemm as quant_gemm
from jaxlp.torch.cpdtorch.quant.quant_function import quantizer as quantizer
from jaxlp.torch.cpdtorch.quant.quant_module import Quant_Conv as Quant_Conv
from jaxlp.torch.cpdtorch.quant.quant_module import Quant_Linear as Quant_Linear
from jaxlp.torch.cpdtorch.quant.quant_module import Quantizer as Quantizer

__all__ = ["float_quantize", "quantizer", "Quantizer", "quant_gemm", "Quant_Linear",
           "Quant_Conv", "quant_function", "quant_module"]
