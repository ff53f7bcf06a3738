"""CPD's module tree (``CPDtorch``) on jaxlp: migrating is one import prefix.

``from CPDtorch.quant import float_quantize`` becomes ``from jaxlp.torch.cpdtorch.quant import
float_quantize``; ``from CPDtorch.utils.dist_util import sum_gradients`` becomes ``from
jaxlp.torch.cpdtorch.utils.dist_util import sum_gradients``. The names and signatures are
CPD's (``artifact`` branch):

* :mod:`jaxlp.torch.cpdtorch.quant`: ``float_quantize``, ``quantizer``, ``Quantizer``,
  ``quant_gemm``, ``Quant_Linear``, ``Quant_Conv`` (the objects of :mod:`jaxlp.torch.cpd`);
* :mod:`jaxlp.torch.cpdtorch.utils.dist_util`: ``sum_gradients``, ``normal_sum_gradients``,
  ``kahan_sum_gradients``, ``broadcast_params``, ``DistModule``.

CPD's Slurm-specific ``dist_init`` is not provided (a library reads no environment):
initialise ``torch.distributed`` with ``init_process_group`` instead. The cast is CPD's, bit
for bit, on CPU and CUDA tensors (CPD: CUDA only). Errors are instances of what CPD raises
(``AssertionError``, ``RuntimeError``) and of jaxlp's documented types.

Example:
  >>> import torch
  >>> from jaxlp.torch.cpdtorch.quant import float_quantize
  >>> float_quantize(torch.tensor([0.1, 1.3, 1e6]), exp=4, man=3)
  tensor([0.1016, 1.2500,    inf])

References:
  drcut/CPD@ad66a44, ``CPDtorch/quant/__init__.py``, ``CPDtorch/utils/dist_util.py``.
"""

from jaxlp.torch.cpdtorch import quant as quant
from jaxlp.torch.cpdtorch import utils as utils

__all__ = ["quant", "utils"]
