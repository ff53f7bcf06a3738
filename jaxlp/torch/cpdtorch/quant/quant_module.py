"""``CPDtorch.quant.quant_module``: ``Quantizer``, ``Quant_Linear``, ``Quant_Conv`` (the
modules of :mod:`jaxlp.torch.cpd`)."""

from jaxlp.torch.cpd import Quant_Conv as Quant_Conv
from jaxlp.torch.cpd import Quant_Linear as Quant_Linear
from jaxlp.torch.cpd import Quantizer as Quantizer

__all__ = ["Quant_Conv", "Quant_Linear", "Quantizer"]
