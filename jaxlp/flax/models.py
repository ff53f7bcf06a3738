"""Small reference linen models for tests, benchmarks and examples (plain Flax code, no
jaxlp inside: quantize them with :func:`jaxlp.flax.quantize_model`)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["BasicBlock", "MLP", "ResNet18"]


class BasicBlock(nn.Module):
  """ResNet basic block: two 3x3 convs + BN, identity or 1x1-conv shortcut."""

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
  """Multi-layer perceptron with ReLU."""

  features: Sequence[int] = (512, 512, 10)

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for f in self.features[:-1]:
      x = nn.relu(nn.Dense(f)(x))
    return nn.Dense(self.features[-1])(x)
