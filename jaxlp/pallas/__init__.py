"""jaxlp.pallas: Pallas kernels (Triton backend on GPU; ``interpret=True`` anywhere).

* :func:`quantize` — elementwise formats and BFP/MX blocks, in-kernel stochastic noise.
* :func:`matmul` — low-precision-accumulator GEMM (naive / kahan / chunked), the same bits
  as the reference :func:`jaxlp.ops.matmul`.
"""

from jaxlp.pallas._matmul import can_use_pallas_matmul as can_use_pallas_matmul
from jaxlp.pallas._matmul import matmul as matmul
from jaxlp.pallas._quantize import can_use_pallas_quantize as can_use_pallas_quantize
from jaxlp.pallas._quantize import quantize as quantize

__all__ = ["can_use_pallas_matmul", "can_use_pallas_quantize", "matmul", "quantize"]
