"""Flax linen models for the ``jaxlp`` command: MLP, small CNN, ResNet-9/18 (CIFAR), VGG-19,
and the language models of :mod:`jaxlp.flax.models` (LSTM, GPT-style transformer, BERT)."""

from __future__ import annotations

from typing import Any

LM_MODELS = ("lstm", "transformer", "bert")
MODELS = ("mlp", "cnn", "resnet9", "resnet18", "vgg19") + LM_MODELS


def build(name: str, num_classes: int, *, dot_general=None, conv_general_dilated=None,
          width: int | None = None, portable: bool = False, layers: int | None = None,
          dropout: float | None = None, seq_len: int | None = None) -> Any:
  """A built-in model (exported as ``jaxlp.training.build_model``).

  The language models (``LM_MODELS``) are :class:`jaxlp.flax.models.LSTMLM`,
  :class:`~jaxlp.flax.models.TransformerLM` (4 heads, tied logits) and
  :class:`~jaxlp.flax.models.BertMLM` (4 heads) of width ``8 * width``; quantize them with
  :func:`jaxlp.flax.quantize_model` (it reaches their attention and recurrent matmuls),
  not with ``dot_general``.

  Args:
    name: one of ``MODELS`` (``"mlp"``, ``"cnn"``, ``"resnet9"``, ``"resnet18"``, ``"vgg19"``,
      ``"lstm"``, ``"transformer"``, ``"bert"``).
    num_classes: outputs of the last layer (the language models: the vocabulary size).
    dot_general, conv_general_dilated: passed to every Dense / Conv (e.g.
      ``jaxlp.dot_general(policy)``); None: the Flax defaults.
    width: the model's width: MLP hidden units ``8 * width``, CNN channels ``2 * width`` and
      ``4 * width``, ResNet/VGG base channels ``width``. None: 16 for the MLP and the CNN
      (128 hidden units; 32 and 64 channels), 64 for the others.
    portable: bias adds, their gradients and the CNN's spatial mean in portable arithmetic
      (the same bits on every backend; ``jaxlp.training._portable``). The parameters (names,
      shapes, init) are those of the default. Only the MLP and the CNN have this mode.
    layers: the language models' LSTM layers / transformer blocks (None: 2).
    dropout: the language models' dropout rate (None: 0.1).
    seq_len: the transformers' longest sequence (position embeddings; None: 64).

  Returns:
    A ``flax.linen.Module``.

  Raises:
    ValueError: an unknown name, or ``width`` < 1; ``dot_general`` /
      ``conv_general_dilated`` / ``portable`` for a language model, or ``layers`` /
      ``dropout`` / ``seq_len`` for a classifier.
    TypeError: ``width`` or ``num_classes`` is not an int.

  Example:
    >>> from jaxlp.training import build_model
    >>> type(build_model("mlp", 10)).__name__
    'MLP'
    >>> lm = build_model("transformer", 257, width=4)
    >>> type(lm).__name__, lm.features, lm.num_heads, lm.max_len
    ('TransformerLM', 32, 4, 64)
  """
  import flax.linen as nn
  import jax.numpy as jnp

  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
  for arg, v in (("num_classes", num_classes), ("width", width)):
    if v is None and arg == "width":
      continue
    if isinstance(v, bool) or not isinstance(v, int):
      raise TypeError(f"build_model: {arg} must be an int, got {v!r}")
    if v < 1:
      raise ValueError(f"build_model: {arg} must be >= 1, got {v}")
  if portable and name not in ("mlp", "cnn"):
    raise ValueError(f"build_model: portable=True is implemented for the mlp and the cnn, not "
                     f"{name!r}")
  if name in LM_MODELS:
    return _language_model(name, num_classes, width=16 if width is None else width,
                           layers=layers, dropout=dropout, seq_len=seq_len,
                           plain=dot_general is None and conv_general_dilated is None
                           and not portable)
  for arg, v in (("layers", layers), ("dropout", dropout), ("seq_len", seq_len)):
    if v is not None:
      raise ValueError(f"build_model: {arg} applies only to the language models {LM_MODELS}")
  if width is None:
    width = 16 if name in ("mlp", "cnn") else 64
  dkw = {} if dot_general is None else {"dot_general": dot_general}
  ckw = {} if conv_general_dilated is None else {"conv_general_dilated": conv_general_dilated}

  dense = nn.Dense
  if portable:
    import jax

    from jaxlp.training import _portable

    class Dense(nn.Module):  # flax's Dense (same names, shapes, init) with a portable bias
      features: int
      dot_general: Any = None

      @nn.compact
      def __call__(self, x):
        k = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        b = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        dg = self.dot_general or jax.lax.dot_general
        y = dg(x, k, (((x.ndim - 1,), (0,)), ((), ())))
        return _portable.bias_add(y, b)

    class Conv(nn.Module):  # flax's Conv ('SAME', NHWC; same names, shapes, init), portable bias
      features: int
      kernel_size: tuple
      strides: tuple = (1, 1)
      conv_general_dilated: Any = None

      @nn.compact
      def __call__(self, x):
        shape = (*self.kernel_size, x.shape[-1], self.features)
        k = self.param("kernel", nn.initializers.lecun_normal(), shape)
        b = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        conv = self.conv_general_dilated or jax.lax.conv_general_dilated
        dn = jax.lax.conv_dimension_numbers(x.shape, k.shape, ("NHWC", "HWIO", "NHWC"))
        y = conv(x, k, tuple(self.strides), "SAME", lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                 dimension_numbers=dn, feature_group_count=1, precision=None)
        return _portable.bias_add(y, b)

    dense, conv2d, spatial_mean = Dense, Conv, _portable.mean_over_spatial
  else:
    conv2d = nn.Conv
    spatial_mean = lambda x: jnp.mean(x, axis=(1, 2))

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      x = x.reshape((x.shape[0], -1))
      x = nn.relu(dense(8 * width, **dkw)(x))
      x = nn.relu(dense(8 * width, **dkw)(x))
      return dense(num_classes, **dkw)(x)

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      x = nn.relu(conv2d(2 * width, (3, 3), **ckw)(x))
      x = nn.relu(conv2d(4 * width, (3, 3), strides=(2, 2), **ckw)(x))
      x = spatial_mean(x)
      x = nn.relu(dense(128, **dkw)(x))
      return dense(num_classes, **dkw)(x)

  class Block(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
      norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
      y = nn.Conv(self.features, (3, 3), (self.strides,) * 2, use_bias=False, **ckw)(x)
      y = nn.relu(norm()(y))
      y = nn.Conv(self.features, (3, 3), use_bias=False, **ckw)(y)
      y = norm()(y)
      if self.strides != 1 or x.shape[-1] != self.features:
        x = nn.Conv(self.features, (1, 1), (self.strides,) * 2, use_bias=False, **ckw)(x)
        x = norm()(x)
      return nn.relu(x + y)

  class ResNet18(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      x = nn.Conv(width, (3, 3), use_bias=False, **ckw)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      for i, f in enumerate([width, 2 * width, 4 * width, 8 * width]):
        for j in range(2):
          x = Block(f, strides=2 if (i > 0 and j == 0) else 1)(x, train)
      x = jnp.mean(x, axis=(1, 2))
      return nn.Dense(num_classes, **dkw)(x)

  class VGG19(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      cfg = [1, 1, "M", 2, 2, "M", 4, 4, 4, 4, "M", 8, 8, 8, 8, "M", 8, 8, 8, 8]
      for c in cfg:
        if c == "M":
          if x.shape[1] > 1:
            x = nn.max_pool(x, (2, 2), (2, 2))
        else:
          x = nn.Conv(c * width, (3, 3), **ckw)(x)
          x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      x = jnp.mean(x, axis=(1, 2))
      return nn.Dense(num_classes, **dkw)(x)

  class ResNet9(nn.Module):
    """DavidNet (Page's fast CIFAR-10 ResNet): prep, 3 pooled stages, 2 residual blocks."""

    @nn.compact
    def __call__(self, x, train: bool = False):
      def conv_bn(x, f):
        x = nn.Conv(f, (3, 3), use_bias=False, **ckw)(x)
        return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))

      def pool(x):
        return nn.max_pool(x, (2, 2), (2, 2)) if x.shape[1] > 1 else x

      x = conv_bn(x, width)
      x = pool(conv_bn(x, 2 * width))
      x = x + conv_bn(conv_bn(x, 2 * width), 2 * width)
      x = pool(conv_bn(x, 4 * width))
      x = pool(conv_bn(x, 8 * width))
      x = x + conv_bn(conv_bn(x, 8 * width), 8 * width)
      x = jnp.max(x, axis=(1, 2))
      return nn.Dense(num_classes, use_bias=False, **dkw)(x) * 0.125

  table = {"mlp": MLP, "cnn": CNN, "resnet9": ResNet9, "resnet18": ResNet18, "vgg19": VGG19}
  if name not in table:
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
  return table[name]()


def _language_model(name, vocab_size, *, width, layers, dropout, seq_len, plain):
  from jaxlp.flax import models as LM

  if not plain:
    raise ValueError(f"build_model: --model {name} is quantized with "
                     "jaxlp.flax.quantize_model (which reaches its attention and recurrent "
                     "matmuls), not with dot_general / conv_general_dilated / portable")
  layers = 2 if layers is None else layers
  dropout = 0.1 if dropout is None else dropout
  seq_len = 64 if seq_len is None else seq_len
  features = 8 * width
  if name == "lstm":
    return LM.LSTMLM(vocab_size, features=features, num_layers=layers, dropout=dropout)
  kw = dict(features=features, num_heads=4, num_layers=layers, max_len=seq_len,
            dropout=dropout)
  if name == "transformer":
    return LM.TransformerLM(vocab_size, **kw)
  return LM.BertMLM(vocab_size, **kw)
