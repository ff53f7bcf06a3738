"""``CPDtorch.utils`` on jaxlp: :mod:`jaxlp.torch.cpdtorch.utils.dist_util`."""

from jaxlp.torch.cpdtorch.utils import dist_util as dist_util

__all__ = ["dist_util"]
