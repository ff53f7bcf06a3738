"""``CPDtorch.utils.dist_util`` on jaxlp: low-precision gradient sums over ``torch.distributed``
ranks (CPD's chain in rank order, with APS and Kahan), and its helpers.

``sum_gradients`` is :func:`jaxlp.torch.ddp.sum_gradients`; ``normal_sum_gradients`` and
``kahan_sum_gradients`` are its two chains under CPD's names and defaults. ``dist_init``
(Slurm host parsing) is not provided: call ``torch.distributed.init_process_group``.

References:
  drcut/CPD@ad66a44, ``CPDtorch/utils/dist_util.py`` (``artifact`` branch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DistModule", "broadcast_params", "kahan_sum_gradients", "normal_sum_gradients",
           "sum_gradients"]


def _require_dist(what):
  if not dist.is_initialized():
    raise ValueError(f"jaxlp.torch.cpdtorch.{what}: torch.distributed is not initialized")


def sum_gradients(model, use_APS=False, grad_exp=5, grad_man=2, use_kahan=False,  # noqa: N803
                  group=None):
  """CPD's ``sum_gradients``: every ``p.grad`` becomes the low-precision SUM over ranks.

  See :func:`jaxlp.torch.ddp.sum_gradients` (the same function).

  Args:
    model: a ``torch.nn.Module`` whose parameters' ``.grad`` are summed in place.
    use_APS: Auto-Precision Scaling (one exponent per parameter).
    grad_exp, grad_man: exponent and mantissa bits of ``cpd_float(grad_exp, grad_man)``.
    use_kahan: Kahan-compensated chain sum.
    group: the process group (None = default group).

  Returns:
    ``model``.

  Raises:
    ValueError: ``torch.distributed`` is not initialized, or the format is out of range.
    TypeError: a gradient is not float32.

  Example:
    Every rank calls it after ``backward()``; without a process group it raises:

    >>> import torch
    >>> from jaxlp.torch.cpdtorch.utils.dist_util import sum_gradients
    >>> sum_gradients(torch.nn.Linear(2, 1))
    Traceback (most recent call last):
    ...
    ValueError: jaxlp.torch.ddp.sum_gradients: torch.distributed is not initialized
  """
  from jaxlp.torch.ddp import sum_gradients as impl  # noqa: PLC0415

  return impl(model, use_APS, grad_exp, grad_man, use_kahan, group)


def normal_sum_gradients(model, grad_exp=8, grad_man=23, group=None):
  """CPD's ``normal_sum_gradients``: per parameter, ``res = Q(res + g_r)`` for ranks r = 0, 1,
  ... (``Q = cpd_float(grad_exp, grad_man)``); ``(8, 23)`` is a plain ``all_reduce``.

  Args:
    model: a ``torch.nn.Module`` whose parameters' ``.grad`` are summed in place.
    grad_exp, grad_man: the format's exponent and mantissa bits.
    group: the process group (None = default group).

  Returns:
    ``model``.

  Raises:
    ValueError: ``torch.distributed`` is not initialized, or the format is out of range.
    TypeError: a gradient is not float32.

  Example:
    >>> import torch
    >>> from jaxlp.torch.cpdtorch.utils.dist_util import normal_sum_gradients
    >>> normal_sum_gradients(torch.nn.Linear(2, 1), grad_exp=5, grad_man=2)
    Traceback (most recent call last):
    ...
    ValueError: jaxlp.torch.ddp.sum_gradients: torch.distributed is not initialized
  """
  return sum_gradients(model, False, grad_exp, grad_man, False, group)


def kahan_sum_gradients(model, grad_exp=8, grad_man=23, group=None):
  """CPD's ``kahan_sum_gradients``: the chain with Kahan compensation, every operation
  rounded to ``cpd_float(grad_exp, grad_man)``; ``(8, 23)`` is a plain ``all_reduce`` (as in
  CPD).

  Args:
    model: a ``torch.nn.Module`` whose parameters' ``.grad`` are summed in place.
    grad_exp, grad_man: the format's exponent and mantissa bits.
    group: the process group (None = default group).

  Returns:
    ``model``.

  Raises:
    ValueError: ``torch.distributed`` is not initialized, or the format is out of range.
    TypeError: a gradient is not float32.

  Example:
    >>> import torch
    >>> from jaxlp.torch.cpdtorch.utils.dist_util import kahan_sum_gradients
    >>> kahan_sum_gradients(torch.nn.Linear(2, 1), grad_exp=4, grad_man=3)
    Traceback (most recent call last):
    ...
    ValueError: jaxlp.torch.ddp.sum_gradients: torch.distributed is not initialized
  """
  return sum_gradients(model, False, grad_exp, grad_man, (grad_exp, grad_man) != (8, 23), group)


def broadcast_params(model, group=None):
  """CPD's ``broadcast_params``: every tensor of ``model.state_dict()`` (parameters and
  buffers) is broadcast from rank 0, in place.

  Args:
    model: a ``torch.nn.Module``.
    group: the process group (None = default group).

  Returns:
    ``model``.

  Raises:
    ValueError: ``torch.distributed`` is not initialized.

  Example:
    >>> import torch
    >>> from jaxlp.torch.cpdtorch.utils.dist_util import broadcast_params
    >>> broadcast_params(torch.nn.Linear(2, 1))
    Traceback (most recent call last):
    ...
    ValueError: jaxlp.torch.cpdtorch.broadcast_params: torch.distributed is not initialized
  """
  _require_dist("broadcast_params")
  src = 0 if group is None else dist.get_global_rank(group, 0)
  for t in model.state_dict().values():
    dist.broadcast(t, src, group=group)
  return model


class DistModule(torch.nn.Module):
  """CPD's ``DistModule``: wraps a module, broadcasting its parameters and buffers from rank 0
  at construction; ``forward`` and ``train`` are the wrapped module's.

  Args:
    module: the ``torch.nn.Module`` to wrap.

  Raises:
    ValueError: ``torch.distributed`` is not initialized.

  Example:
    >>> import torch
    >>> from jaxlp.torch.cpdtorch.utils.dist_util import DistModule
    >>> DistModule(torch.nn.Linear(2, 1))
    Traceback (most recent call last):
    ...
    ValueError: jaxlp.torch.cpdtorch.broadcast_params: torch.distributed is not initialized
  """

  def __init__(self, module):
    super().__init__()
    self.module = module
    broadcast_params(self.module)

  def forward(self, *inputs, **kwargs):
    return self.module(*inputs, **kwargs)

  def train(self, mode=True):
    super().train(mode)
    self.module.train(mode)
    return self
