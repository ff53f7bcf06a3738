"""jaxlp.torch: the PyTorch bridge (torch tensors in, torch tensors out, same bits as JAX).

* :func:`to_jax` / :func:`to_torch`: zero-copy DLPack exchange.
* :func:`quantize`: any jaxlp format on a torch tensor, bit-identical to ``jaxlp.quantize``.
  CPU tensors of ``FloatFormat`` (presets), ``qpytorch_float``, ``cpd_float``,
  ``FixedPoint``, ``QPyTorchFixedPoint`` and ``qpytorch_block`` are rounded in NumPy on the
  tensor's memory up to 65536 elements (``jaxlp/torch/_cpu.py``: nothing compiled, no cost
  per new shape), larger ones by the compiled spec with bucketed shapes; CUDA
  tensors of the same formats but ``cpd_float`` run Triton kernels on torch's current stream
  (``jaxlp/torch/_triton.py``; needs the ``triton`` package). Everything else goes through
  JAX.
* QPyTorch drop-ins: :func:`float_quantize`, :func:`block_quantize`,
  :func:`fixed_point_quantize`, :func:`quantizer`, :class:`Quantizer`, :class:`OptimLP`.
* CPD drop-ins: ``jaxlp.torch.cpd.float_quantize``, ``quantizer``, ``Quantizer``,
  ``quant_gemm``, ``Quant_Linear``, ``Quant_Conv``, ``sum_gradients``.
* Migration by one import prefix: :mod:`jaxlp.torch.qtorch` (QPyTorch's module tree:
  ``quant``, ``optim``, ``number``, ``auto_low``, the number classes) and
  :mod:`jaxlp.torch.cpdtorch` (CPD's ``CPDtorch.quant`` and ``CPDtorch.utils.dist_util``).
  Exceptions are also instances of what QPyTorch / CPD raise: :class:`QuantizeValueError`,
  :class:`QuantizeTypeError`, :class:`TensorTypeError`, :class:`BlockDimError`,
  :class:`DeviceError` (``docs/migration.rst``).
* Layers: ``jaxlp.torch.nn.Linear`` / ``Conv2d`` (a :class:`jaxlp.DotPolicy`, same bits as
  ``jaxlp.dot_general`` / ``jaxlp.conv_general_dilated``) and ``nn.quantize_model``.
* DDP: PyTorch's hooks under PyTorch's names on jaxlp's arithmetic
  (``jaxlp.torch.ddp.fp16_compress_hook``, ``PowerSGDState`` + ``powerSGD_hook``, ...),
  ``jaxlp.torch.ddp.CommState`` + ``comm_hook`` (low-precision chain reduction with
  APS/Kahan, or any ``jaxlp.parallel.compressors`` compressor) and ``ddp.sum_gradients``.

torch is imported only inside this subpackage.
"""

from jaxlp.torch import cpd as cpd
from jaxlp.torch import cpdtorch as cpdtorch  # noqa: I001 (after the names they re-export)
from jaxlp.torch import ddp as ddp
from jaxlp.torch import nn as nn
from jaxlp.torch import qtorch as qtorch
from jaxlp.torch._dlpack import to_jax as to_jax
from jaxlp.torch._dlpack import to_torch as to_torch
from jaxlp.torch._errors import BlockDimError as BlockDimError
from jaxlp.torch._errors import DeviceError as DeviceError
from jaxlp.torch._errors import QuantizeTypeError as QuantizeTypeError
from jaxlp.torch._errors import QuantizeValueError as QuantizeValueError
from jaxlp.torch._errors import TensorTypeError as TensorTypeError
from jaxlp.torch._formats import QPyTorchFixedPoint as QPyTorchFixedPoint
from jaxlp.torch._optim import OptimLP as OptimLP
from jaxlp.torch._qpytorch import Quantizer as Quantizer
from jaxlp.torch._qpytorch import as_format as as_format
from jaxlp.torch._qpytorch import block_quantize as block_quantize
from jaxlp.torch._qpytorch import fixed_point_quantize as fixed_point_quantize
from jaxlp.torch._qpytorch import float_quantize as float_quantize
from jaxlp.torch._qpytorch import quantizer as quantizer
from jaxlp.torch._quantize import draw_key as draw_key
from jaxlp.torch._quantize import quantize as quantize
from jaxlp.torch._quantize import seed_to_key as seed_to_key

__all__ = [
    "BlockDimError", "DeviceError", "OptimLP", "QPyTorchFixedPoint", "QuantizeTypeError",
    "QuantizeValueError", "Quantizer", "TensorTypeError", "as_format", "block_quantize", "cpd",
    "cpdtorch", "ddp", "draw_key", "fixed_point_quantize", "float_quantize", "nn", "qtorch",
    "quantize", "quantizer", "seed_to_key", "to_jax", "to_torch",
]
