"""Small reference linen models for tests, benchmarks and examples (plain Flax code, no
jaxlp inside: quantize them with :func:`jaxlp.flax.quantize_model`)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["BasicBlock", "MLP", "ResNet18"]


class BasicBlock(nn.Module):
  """ResNet basic block: two 3x3 convs + BN, identity or 1x1-conv shortcut.

  Attributes:
    features: output channels of both convs (and of the shortcut).
    strides: stride of the first conv and of the 1x1 shortcut conv.

  ``__call__(x, train=True)`` takes NHWC inputs; ``train`` selects batch statistics (True)
  or the running averages (False) in the BatchNorms.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.flax.models import BasicBlock
    >>> block = BasicBlock(features=8, strides=2)
    >>> x = jnp.ones((1, 8, 8, 4))
    >>> y, variables = jax.eval_shape(lambda: block.init_with_output(jax.random.key(0), x))
    >>> y.shape, sorted(variables)
    ((1, 4, 4, 8), ['batch_stats', 'params'])
  """

  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
    y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), padding=1,
                use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.features, (3, 3), padding=1, use_bias=False)(y)
    y = norm()(y)
    if x.shape[-1] != self.features or self.strides != 1:
      x = nn.Conv(self.features, (1, 1), (self.strides, self.strides), use_bias=False)(x)
      x = norm()(x)
    return nn.relu(x + y)


class ResNet18(nn.Module):
  """ResNet-18 for 32x32 inputs (CIFAR): 3x3 stem, stages [2, 2, 2, 2] of basic blocks with
  widths (w, 2w, 4w, 8w) (w = 64 is the standard model), global average pool, Dense.

  Attributes:
    num_classes: outputs of the final Dense layer.
    width: channels of the first stage (w).
    stages: number of basic blocks per stage.

  ``__call__(x, train=True)`` takes NHWC inputs and returns ``(N, num_classes)`` logits.

  Example:
    ``jax.eval_shape`` traces ``init`` without computing anything (shapes only):

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.flax.models import ResNet18
    >>> model = ResNet18(num_classes=10, width=2)
    >>> x = jnp.ones((1, 8, 8, 3))
    >>> logits, variables = jax.eval_shape(
    ...     lambda: model.init_with_output(jax.random.key(0), x, train=False))
    >>> logits.shape, sorted(variables)
    ((1, 10), ['batch_stats', 'params'])

  References:
    He et al., "Deep Residual Learning for Image Recognition", CVPR 2016 (CIFAR variant
    with a 3x3 stem as in kuangliu/pytorch-cifar and HBFPEmulator's cnn models).
  """

  num_classes: int = 10
  width: int = 64
  stages: Sequence[int] = (2, 2, 2, 2)

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.width, (3, 3), padding=1, use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for i, n in enumerate(self.stages):
      for j in range(n):
        x = BasicBlock(self.width * 2**i, 2 if (i > 0 and j == 0) else 1)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


class MLP(nn.Module):
  """Multi-layer perceptron with ReLU.

  Attributes:
    features: widths of the Dense layers; the last one is the output size (no ReLU).

  ``__call__(x)`` flattens every axis after the first (the batch).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.flax.models import MLP
    >>> model = MLP(features=(16, 10))
    >>> x = jnp.ones((2, 4, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> model.apply(variables, x).shape
    (2, 10)
    >>> variables["params"]["Dense_0"]["kernel"].shape
    (16, 16)
  """

  features: Sequence[int] = (512, 512, 10)

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for f in self.features[:-1]:
      x = nn.relu(nn.Dense(f)(x))
    return nn.Dense(self.features[-1])(x)
