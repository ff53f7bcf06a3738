"""jaxlp.flax: Flax linen + nnx integration of :class:`jaxlp.DotPolicy` numerics.

* Per layer: ``nn.Dense(dot_general=jaxlp.dot_general(policy))``,
  ``nn.Conv(conv_general_dilated=jaxlp.conv_general_dilated(policy))``,
  ``nnx.Linear(..., dot_general=...)``, ``nnx.Conv(..., conv_general_dilated=...)``.
* Whole model, without editing its code: :func:`quantize_model` (linen or nnx).
"""

from __future__ import annotations

from jaxlp.flax import linen as linen
from jaxlp.flax import models as models
from jaxlp.flax import nnx as nnx
from jaxlp.flax.linen import QuantizedModel as QuantizedModel
from jaxlp.flax.nnx import StochasticOp as StochasticOp


def quantize_model(model, policy, *, include=None, exclude=None, **kwargs):
  """Quantize every dot product / convolution layer of a linen or nnx model.

  Linen (``flax.linen.Module``): returns a :class:`QuantizedModel` whose ``init``/``apply``
  take the original variables (see :func:`jaxlp.flax.linen.quantize_model`). nnx
  (``flax.nnx.Module``): returns a quantized model (see :func:`jaxlp.flax.nnx.quantize_model`).

  Args:
    model: the model.
    policy: a :class:`jaxlp.DotPolicy`.
    include: glob pattern(s) of '/'-joined module paths to quantize (None = all).
    exclude: glob pattern(s) of paths to leave in FP32 (first/last layer exclusion).
    **kwargs: framework-specific options (``rng_stream``; nnx: ``rngs``, ``copy``).
  """
  import flax.linen as nn  # noqa: PLC0415
  from flax import nnx as fnnx  # noqa: PLC0415
  if isinstance(model, nn.Module):
    return linen.quantize_model(model, policy, include=include, exclude=exclude, **kwargs)
  if isinstance(model, fnnx.Module):
    return nnx.quantize_model(model, policy, include=include, exclude=exclude, **kwargs)
  raise TypeError(f"quantize_model: model must be a flax linen or nnx Module, got {type(model)}")


__all__ = ["QuantizedModel", "StochasticOp", "linen", "models", "nnx", "quantize_model"]
