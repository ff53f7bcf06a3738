"""jaxlp: low-precision training research in JAX.

Exact number formats (``jaxlp.formats``), Pallas kernels (``jaxlp.pallas``), quantized
layers (``jaxlp.ops``), data-parallel low-precision / compressed reduction
(``jaxlp.parallel``). Integrations with optional dependencies load on first use:
``jaxlp.flax`` (Flax), ``jaxlp.optim`` (optax), ``jaxlp.torch`` (PyTorch),
``jaxlp.training`` (the training loop of the ``jaxlp`` command, as a library).
"""

import importlib as _importlib

from jaxlp import formats as formats
from jaxlp import ops as ops
from jaxlp import pallas as pallas
from jaxlp import parallel as parallel
from jaxlp.formats import BlockFormat as BlockFormat
from jaxlp.formats import FixedPoint as FixedPoint
from jaxlp.formats import FloatFormat as FloatFormat
from jaxlp.ops import RHT as RHT
from jaxlp.ops import Accum as Accum
from jaxlp.ops import DotPolicy as DotPolicy
from jaxlp.ops import Quant as Quant
from jaxlp.ops import bf16_policy as bf16_policy
from jaxlp.ops import conv_general_dilated as conv_general_dilated
from jaxlp.ops import dot_general as dot_general
from jaxlp.ops import float_policy as float_policy
from jaxlp.ops import hbfp_policy as hbfp_policy
from jaxlp.ops import matmul as matmul
from jaxlp.ops import mx_policy as mx_policy
from jaxlp.ops import mxfp8_recipe as mxfp8_recipe
from jaxlp.ops import nvfp4_recipe as nvfp4_recipe
from jaxlp.ops import quantize as quantize

__version__ = "0.1.0"

_LAZY = ("flax", "optim", "torch", "training", "cli")


def __getattr__(name):
  # Subpackages with optional dependencies are imported on first attribute access.
  if name in _LAZY:
    return _importlib.import_module(f"jaxlp.{name}")
  raise AttributeError(f"module 'jaxlp' has no attribute {name!r}")


__all__ = [
    "Accum",
    "BlockFormat",
    "DotPolicy",
    "FixedPoint",
    "FloatFormat",
    "Quant",
    "RHT",
    "bf16_policy",
    "conv_general_dilated",
    "dot_general",
    "float_policy",
    "formats",
    "hbfp_policy",
    "matmul",
    "mx_policy",
    "mxfp8_recipe",
    "nvfp4_recipe",
    "ops",
    "pallas",
    "parallel",
    "quantize",
]
