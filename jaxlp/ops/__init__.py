"""jaxlp.ops: the public compute entry points (quantize dispatch, matmul, quantized layers)."""

from jaxlp.ops._conv import conv_general_dilated as conv_general_dilated
from jaxlp.ops._dot_general import dot_general as dot_general
from jaxlp.ops._dot_general import quantized_bilinear as quantized_bilinear
from jaxlp.ops._matmul import matmul as matmul
from jaxlp.ops._policy import Accum as Accum
from jaxlp.ops._policy import DotPolicy as DotPolicy
from jaxlp.ops._policy import Quant as Quant
from jaxlp.ops._policy import float_policy as float_policy
from jaxlp.ops._policy import hbfp_policy as hbfp_policy
from jaxlp.ops._policy import mx_policy as mx_policy
from jaxlp.ops._quantize import quantize as quantize

__all__ = [
    "Accum", "DotPolicy", "Quant", "conv_general_dilated", "dot_general", "float_policy",
    "hbfp_policy", "matmul", "mx_policy", "quantize", "quantized_bilinear",
]
