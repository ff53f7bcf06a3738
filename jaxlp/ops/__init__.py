"""jaxlp.ops: the public compute entry points (quantize dispatch, matmul, quantized layers)."""

from jaxlp.ops.matmul import matmul as matmul
from jaxlp.ops.quantize import quantize as quantize

__all__ = ["matmul", "quantize"]
