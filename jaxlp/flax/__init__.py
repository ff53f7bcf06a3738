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

  Returns:
    A :class:`QuantizedModel` for a linen model; the quantized nnx module for an nnx model.

  Raises:
    TypeError: ``model`` is neither a linen nor an nnx ``Module``, ``policy`` is not a
      :class:`jaxlp.DotPolicy`, or ``include`` / ``exclude`` is not a str or a sequence of
      str.
    ValueError: (nnx) a stochastic ``policy`` without ``rngs``; an ``include`` / ``exclude``
      pattern that matches none of the model's layers (the message lists their paths;
      nnx: here, linen: on the first ``init`` / ``apply``, when the layers exist).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jaxlp
    >>> from flax import nnx
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.flax import quantize_model
    >>> from jaxlp.flax.models import MLP
    >>> policy = jaxlp.float_policy(E4M3)
    >>> qm = quantize_model(MLP(features=(4, 2)), policy, exclude="Dense_1")  # linen
    >>> qm.quantized_paths(jax.random.key(0), jnp.ones((1, 3)))
    ['Dense_0']
    >>> layer = quantize_model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), policy)  # nnx
    >>> layer(jnp.ones((1, 3))).shape
    (1, 2)
  """
  import flax.linen as nn  # noqa: PLC0415
  from flax import nnx as fnnx  # noqa: PLC0415
  if isinstance(model, nn.Module):
    return linen.quantize_model(model, policy, include=include, exclude=exclude, **kwargs)
  if isinstance(model, fnnx.Module):
    return nnx.quantize_model(model, policy, include=include, exclude=exclude, **kwargs)
  raise TypeError(f"quantize_model: model must be a flax linen or nnx Module, got {type(model)}")


__all__ = ["QuantizedModel", "StochasticOp", "linen", "models", "nnx", "quantize_model"]
