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
from jaxlp.ops._recipes import bf16_policy as bf16_policy
from jaxlp.ops._recipes import mxfp8_recipe as mxfp8_recipe
from jaxlp.ops._recipes import nvfp4_recipe as nvfp4_recipe
from jaxlp.ops._rht import RHT as RHT
from jaxlp.ops._rht import hadamard_matrix as hadamard_matrix

__all__ = [
    "RHT", "Accum", "DotPolicy", "Quant", "bf16_policy", "conv_general_dilated", "dot_general",
    "float_policy", "hadamard_matrix", "hbfp_policy", "matmul", "mx_policy", "mxfp8_recipe",
    "nvfp4_recipe", "quantize", "quantized_bilinear",
]
