"""jaxlp.formats: number formats and the pure-jnp rounding functions (the numerical spec).

Imports only jax, numpy and ml_dtypes.
"""

from jaxlp.formats._block import SCALE_RULES as SCALE_RULES
from jaxlp.formats._block import BlockFormat as BlockFormat
from jaxlp.formats._block import MXFormat as MXFormat
from jaxlp.formats._block import QPyTorchBlock as QPyTorchBlock
from jaxlp.formats._block import hbfp as hbfp
from jaxlp.formats._block import hbfp_batched as hbfp_batched
from jaxlp.formats._block import mx as mx
from jaxlp.formats._block import qpytorch_block as qpytorch_block
from jaxlp.formats._codes import from_codes as from_codes
from jaxlp.formats._codes import to_codes as to_codes
from jaxlp.formats._compat import CPDFloat as CPDFloat
from jaxlp.formats._compat import QPyTorchFloat as QPyTorchFloat
from jaxlp.formats._compat import cpd_float as cpd_float
from jaxlp.formats._compat import qpytorch_float as qpytorch_float
from jaxlp.formats._fixed_point import FixedPoint as FixedPoint
from jaxlp.formats._float_format import FloatFormat as FloatFormat
from jaxlp.formats._nvfp4 import SCALE_FORMATS as SCALE_FORMATS
from jaxlp.formats._nvfp4 import ScaledBlockFormat as ScaledBlockFormat
from jaxlp.formats._nvfp4 import nvfp4 as nvfp4
from jaxlp.formats._presets import BF16 as BF16
from jaxlp.formats._presets import E2M1FN as E2M1FN
from jaxlp.formats._presets import E2M3FN as E2M3FN
from jaxlp.formats._presets import E3M2FN as E3M2FN
from jaxlp.formats._presets import E3M4 as E3M4
from jaxlp.formats._presets import E4M3 as E4M3
from jaxlp.formats._presets import E4M3FN as E4M3FN
from jaxlp.formats._presets import E4M3FNUZ as E4M3FNUZ
from jaxlp.formats._presets import E5M2 as E5M2
from jaxlp.formats._presets import E5M2FNUZ as E5M2FNUZ
from jaxlp.formats._presets import FP16 as FP16
from jaxlp.formats._presets import FP32 as FP32
from jaxlp.formats._presets import PRESETS as PRESETS
from jaxlp.formats._presets import TF32 as TF32
from jaxlp.formats._presets import get_format as get_format
from jaxlp.formats._quantize import ROUNDINGS as ROUNDINGS
from jaxlp.formats._quantize import DTypeError as DTypeError
from jaxlp.formats._quantize import check_format as check_format
from jaxlp.formats._quantize import quantize as quantize
from jaxlp.formats._quantize import random_bits as random_bits

__all__ = [
    "BF16", "BlockFormat", "CPDFloat", "DTypeError", "E2M1FN", "E2M3FN", "E3M2FN", "E3M4",
    "E4M3", "E4M3FN", "E4M3FNUZ", "E5M2", "E5M2FNUZ", "FP16", "FP32", "FixedPoint",
    "FloatFormat", "MXFormat", "PRESETS", "QPyTorchBlock", "QPyTorchFloat", "ROUNDINGS",
    "SCALE_FORMATS", "SCALE_RULES", "ScaledBlockFormat", "TF32", "check_format", "cpd_float",
    "from_codes", "get_format", "hbfp", "hbfp_batched", "mx", "nvfp4", "qpytorch_block",
    "qpytorch_float", "quantize", "random_bits", "to_codes",
]
