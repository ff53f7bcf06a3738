"""``qtorch.optim.optim_low``: ``OptimLP`` (:class:`jaxlp.torch.OptimLP`)."""

from jaxlp.torch._optim import OptimLP as OptimLP

__all__ = ["OptimLP"]
