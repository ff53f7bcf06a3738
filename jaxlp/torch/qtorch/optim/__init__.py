"""``qtorch.optim`` on jaxlp: ``OptimLP`` (:class:`jaxlp.torch.OptimLP`, which also accepts
optimizers QPyTorch rejects when no momentum quantizer is given)."""

from jaxlp.torch.qtorch.optim import optim_low as optim_low
from jaxlp.torch.qtorch.optim.optim_low import OptimLP as OptimLP

__all__ = ["OptimLP", "optim_low"]
