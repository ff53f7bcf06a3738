"""jaxlp: low-precision training research in JAX.

Exact number formats (``jaxlp.formats``), Pallas kernels (``jaxlp.pallas``), quantized
layers (``jaxlp.ops``), data-parallel low-precision / compressed reduction
(``jaxlp.parallel``), Flax/optax integration and a PyTorch bridge.
"""

from jaxlp import formats as formats
from jaxlp import ops as ops
from jaxlp import pallas as pallas
from jaxlp import parallel as parallel
from jaxlp.formats import BlockFormat as BlockFormat
from jaxlp.formats import FixedPoint as FixedPoint
from jaxlp.formats import FloatFormat as FloatFormat
from jaxlp.ops import matmul as matmul
from jaxlp.ops import quantize as quantize

__version__ = "0.1.0"

__all__ = [
    "BlockFormat",
    "FixedPoint",
    "FloatFormat",
    "formats",
    "matmul",
    "ops",
    "pallas",
    "parallel",
    "quantize",
]
