"""``qtorch.quant.quant_module``: the ``Quantizer`` module (:class:`jaxlp.torch.Quantizer`)."""

from jaxlp.torch._qpytorch import Quantizer as Quantizer

__all__ = ["Quantizer"]
