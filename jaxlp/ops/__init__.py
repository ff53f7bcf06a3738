"""jaxlp.ops: the public compute entry points (quantize dispatch, matmul, quantized layers)."""

from jaxlp.ops.conv import conv_general_dilated as conv_general_dilated
from jaxlp.ops.dot_general import dot_general as dot_general
from jaxlp.ops.dot_general import quantized_bilinear as quantized_bilinear
from jaxlp.ops.matmul import matmul as matmul
from jaxlp.ops.policy import Accum as Accum
from jaxlp.ops.policy import DotPolicy as DotPolicy
from jaxlp.ops.policy import Quant as Quant
from jaxlp.ops.policy import float_policy as float_policy
from jaxlp.ops.policy import hbfp_policy as hbfp_policy
from jaxlp.ops.policy import mx_policy as mx_policy
from jaxlp.ops.quantize import quantize as quantize

__all__ = [
    "Accum", "DotPolicy", "Quant", "conv_general_dilated", "dot_general", "float_policy",
    "hbfp_policy", "matmul", "mx_policy", "quantize", "quantized_bilinear",
]
