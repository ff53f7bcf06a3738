"""``qtorch.auto_low`` on jaxlp: insert a :class:`~jaxlp.torch.Quantizer` after every layer of
the chosen kinds of an existing ``torch.nn`` model.

* :func:`lower` rounds, in place, the output of every module of the given ``layer_types``
  (its ``forward`` is wrapped; keyword arguments are passed through).
* :func:`sequential_lower` returns a copy in which every such leaf module is replaced by
  ``nn.Sequential(module, quantizer)``; the model itself is left untouched.

``layer_types`` name families of ``torch.nn`` layers (:data:`LAYER_TYPES`): ``"conv"``,
``"linear"``, ``"pool"``, ``"pad"``, ``"activation"``, ``"normalization"``, ``"dropout"``,
``"loss"``; a module matches when it is an instance of one of the family's classes
(QPyTorch matches the exact class only, so jaxlp also lowers their subclasses).

References:
  Tiiiger/QPyTorch@f58bba7, ``qtorch/auto_low/auto_low.py`` (names, arguments, the layer
  families).
"""

from __future__ import annotations

import copy
import functools

from torch import nn

from jaxlp.torch._errors import QuantizeTypeError, QuantizeValueError
from jaxlp.torch._qpytorch import Quantizer

__all__ = ["LAYER_TYPES", "lower", "sequential_lower"]


def _classes(*names):
  """The ``torch.nn`` classes of these names this torch has (a missing one is skipped)."""
  return tuple(getattr(nn, n) for n in names if hasattr(nn, n))


#: The layer families ``layer_types`` may name, as tuples of ``torch.nn`` classes.
LAYER_TYPES = {
    "conv": _classes("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                     "ConvTranspose3d", "Unfold", "Fold"),
    "linear": _classes("Linear", "Bilinear"),
    "pool": _classes("MaxPool1d", "MaxPool2d", "MaxPool3d", "MaxUnpool1d", "MaxUnpool2d",
                     "MaxUnpool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
                     "FractionalMaxPool2d", "LPPool1d", "LPPool2d", "AdaptiveMaxPool1d",
                     "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "AdaptiveAvgPool1d",
                     "AdaptiveAvgPool2d", "AdaptiveAvgPool3d"),
    "pad": _classes("ReflectionPad1d", "ReflectionPad2d", "ReplicationPad1d",
                    "ReplicationPad2d", "ZeroPad2d", "ConstantPad1d", "ConstantPad2d",
                    "ConstantPad3d"),
    "activation": _classes("ELU", "Hardshrink", "Hardtanh", "LeakyReLU", "LogSigmoid", "PReLU",
                           "ReLU", "ReLU6", "RReLU", "SELU", "Sigmoid", "Softplus",
                           "Softshrink", "Softsign", "Tanh", "Tanhshrink", "Threshold",
                           "Softmin", "Softmax", "Softmax2d", "LogSoftmax"),
    "normalization": _classes("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm",
                              "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
                              "LayerNorm", "LocalResponseNorm"),
    "dropout": _classes("Dropout", "Dropout2d", "Dropout3d", "AlphaDropout"),
    "loss": _classes("L1Loss", "MSELoss", "CrossEntropyLoss", "NLLLoss", "PoissonNLLLoss",
                     "KLDivLoss", "BCELoss", "BCEWithLogitsLoss", "MarginRankingLoss",
                     "HingeEmbeddingLoss", "MultiLabelMarginLoss", "SmoothL1Loss",
                     "SoftMarginLoss", "MultiLabelSoftMarginLoss", "MultiMarginLoss",
                     "TripletMarginLoss"),
}


def _selected(layer_types, what):
  if isinstance(layer_types, str):
    layer_types = [layer_types]
  classes = ()
  for t in layer_types:
    if t not in LAYER_TYPES:
      raise QuantizeValueError(f"jaxlp.torch.qtorch.auto_low.{what}: unknown layer type "
                               f"{t!r}; expected some of {sorted(LAYER_TYPES)}")
    classes += LAYER_TYPES[t]
  return classes


def _check_model(model, what):
  if not isinstance(model, nn.Module):
    raise QuantizeTypeError(f"jaxlp.torch.qtorch.auto_low.{what}: model must be a "
                            f"torch.nn.Module, got {type(model).__name__}")


def _quantized_forward(forward, quant):
  @functools.wraps(forward)
  def wrapped(*args, **kwargs):
    return quant(forward(*args, **kwargs))
  return wrapped


def lower(model, layer_types=(), forward_number=None, backward_number=None,
          forward_rounding="stochastic", backward_rounding="stochastic"):
  """Round, in place, the output (and its gradient) of every layer of ``layer_types``.

  One :class:`~jaxlp.torch.Quantizer` is shared by the layers; each matching module's
  ``forward`` becomes ``quantizer(forward(...))``.

  Args:
    model: a ``torch.nn.Module`` (modified in place).
    layer_types: names of :data:`LAYER_TYPES` families (a list, or one name).
    forward_number, backward_number: number formats (``qtorch`` numbers or jaxlp formats;
      None: identity), as :func:`jaxlp.torch.quantizer`.
    forward_rounding, backward_rounding: "stochastic" (default) or "nearest".

  Returns:
    ``model`` (QPyTorch returns None).

  Raises:
    QuantizeValueError: an unknown layer type, or as :func:`jaxlp.torch.quantizer`.
    QuantizeTypeError: ``model`` is not a ``torch.nn.Module``, or as
      :func:`jaxlp.torch.quantizer`.

  Example:
    >>> import torch
    >>> from jaxlp.torch.qtorch import FloatingPoint
    >>> from jaxlp.torch.qtorch.auto_low import lower
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> with torch.no_grad():
    ...   _ = net[0].weight.copy_(torch.eye(2)); _ = net[0].bias.zero_()
    >>> _ = lower(net, ["linear"], FloatingPoint(5, 2), forward_rounding="nearest")
    >>> net(torch.tensor([[0.1, 1.3]])).detach()
    tensor([[0.0938, 1.2500]])
  """
  _check_model(model, "lower")
  classes = _selected(layer_types, "lower")
  quant = Quantizer(forward_number, backward_number, forward_rounding, backward_rounding)
  for module in model.modules():
    if isinstance(module, classes):
      module.forward = _quantized_forward(module.forward, quant)
  return model


def sequential_lower(model, layer_types=(), forward_number=None, backward_number=None,
                     forward_rounding="stochastic", backward_rounding="stochastic"):
  """A copy of ``model`` in which every leaf layer of ``layer_types`` is followed by a
  quantizer: the layer is replaced by ``nn.Sequential(layer, quantizer)``.

  Args:
    model: a ``torch.nn.Module`` (not modified: it is deep-copied).
    layer_types: names of :data:`LAYER_TYPES` families (a list, or one name).
    forward_number, backward_number, forward_rounding, backward_rounding: as :func:`lower`.

  Returns:
    The new model.

  Raises:
    QuantizeValueError: an unknown layer type, or as :func:`jaxlp.torch.quantizer`.
    QuantizeTypeError: ``model`` is not a ``torch.nn.Module``, or as
      :func:`jaxlp.torch.quantizer`.

  Example:
    >>> import torch
    >>> from jaxlp.torch.qtorch import FixedPoint
    >>> from jaxlp.torch.qtorch.auto_low import sequential_lower
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> low = sequential_lower(net, ["activation"], FixedPoint(8, 4), forward_rounding="nearest")
    >>> low
    Sequential(
      (0): Linear(in_features=2, out_features=2, bias=True)
      (1): Sequential(
        (0): ReLU()
        (1): Quantizer()
      )
    )
    >>> type(net[1]).__name__  # the original is unchanged
    'ReLU'
  """
  _check_model(model, "sequential_lower")
  classes = _selected(layer_types, "sequential_lower")
  quant = Quantizer(forward_number, backward_number, forward_rounding, backward_rounding)

  def replace(module):
    if isinstance(module, classes) and not any(True for _ in module.children()):
      return nn.Sequential(module, quant)
    for name, child in list(module.named_children()):
      setattr(module, name, replace(child))
    return module

  return replace(copy.deepcopy(model))
