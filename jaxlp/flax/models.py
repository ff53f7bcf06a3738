"""Small reference linen models for tests, benchmarks and examples (plain Flax code, no
jaxlp inside: quantize them with :func:`jaxlp.flax.quantize_model`).

* Classifiers: :class:`MLP`, :class:`ResNet18` (with its :class:`BasicBlock`).
* Language models built from Flax's own recurrent and attention modules, so that
  :func:`jaxlp.flax.quantize_model` reaches every matmul (gates, attention logits and values,
  tied output logits through ``Embed.attend``): :class:`LSTMLM` (HBFPEmulator's LSTM language
  model), :class:`TransformerLM` (GPT-style decoder), :class:`BertMLM` (BERT-style masked LM)
  with :func:`mask_tokens` (BERT's 80/10/10 masking rule), all made of
  :class:`TransformerBlock` where they are transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["MLP", "BasicBlock", "BertMLM", "LSTMLM", "ResNet18", "TransformerBlock",
           "TransformerLM", "mask_tokens"]


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


def _uniform(scale: float):
  """``U(-scale, scale)`` initializer (the AWD-LSTM embedding init)."""
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -scale, scale)
  return init


def _check_tokens(tokens, vocab_size: int, max_len: int | None, who: str):
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{who}: tokens must be an integer array of shape (batch, length), got "
                     f"{tokens.dtype} {tokens.shape}")
  if max_len is not None and tokens.shape[1] > max_len:
    raise ValueError(f"{who}: sequence length {tokens.shape[1]} exceeds max_len={max_len}")


class LSTMLM(nn.Module):
  """HBFPEmulator's LSTM language model (AWD-LSTM's layout, small): embedding, stacked LSTMs,
  dropout, decoder tied to the embedding.

  Tokens ``(batch, length)`` -> logits ``(batch, length, vocab_size)`` for the next token at
  every position. Layers: ``Embed(vocab_size, features)`` (initialised ``U(-0.1, 0.1)`` as in
  AWD-LSTM) -> dropout -> ``num_layers`` x [``nn.RNN(nn.OptimizedLSTMCell(features))`` ->
  dropout] -> logits. Tied (the default): ``embed.attend(h) + bias`` (AWD-LSTM's tied decoder
  with its bias; every LSTM has ``features`` units, so the last one's output can be tied);
  untied: ``Dense(vocab_size)``. Each call starts from a zero state (AWD-LSTM carries the
  state across BPTT windows; here every window is independent, so windows can be batched and
  shuffled freely). The gate matmuls, the decoder (``attend``) and nothing else are matmuls:
  :func:`jaxlp.flax.quantize_model` quantizes them as kind ``"recurrent"`` and
  ``"embed_attend"``.

  Attributes:
    vocab_size: number of token ids.
    features: embedding size = LSTM units of every layer (AWD-LSTM: 400 / 1150; small here).
    num_layers: stacked LSTM layers (AWD-LSTM: 3).
    dropout: dropout rate on the embedding and after every LSTM layer (``train=True`` only;
      needs ``rngs={"dropout": key}``).
    tied: tie the decoder to the embedding (``Embed.attend``).

  ``__call__(tokens, train=False)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.flax.models import LSTMLM
    >>> model = LSTMLM(vocab_size=11, features=8)
    >>> tokens = jnp.zeros((2, 5), jnp.int32)
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> model.apply(variables, tokens).shape
    (2, 5, 11)
    >>> sorted(variables["params"])
    ['decoder_bias', 'embed', 'lstm_0', 'lstm_1']

  References:
    Merity, Keskar, Socher, "Regularizing and Optimizing LSTM Language Models", ICLR 2018
    (AWD-LSTM; HBFPEmulator's ``lstm/`` is adapted from its toolkit); Hochreiter and
    Schmidhuber, "Long Short-Term Memory", 1997.
  """

  vocab_size: int
  features: int = 128
  num_layers: int = 2
  dropout: float = 0.2
  tied: bool = True

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    _check_tokens(tokens, self.vocab_size, None, "LSTMLM")
    embed = nn.Embed(self.vocab_size, self.features, embedding_init=_uniform(0.1),
                     name="embed")
    drop = lambda h: nn.Dropout(self.dropout, deterministic=not train)(h)
    h = drop(embed(tokens))
    for i in range(self.num_layers):
      h = drop(nn.RNN(nn.OptimizedLSTMCell(self.features, name=f"lstm_{i}"),
                        split_rngs={"params": False, "quantize": True})(h))
    if not self.tied:
      return nn.Dense(self.vocab_size, name="decoder")(h)
    bias = self.param("decoder_bias", nn.initializers.zeros_init(), (self.vocab_size,))
    return embed.attend(h) + bias[None, None, :]


class TransformerBlock(nn.Module):
  """A pre-LN transformer block: ``x + Dropout(Attention(LN(x)))``, then
  ``x + Dropout(MLP(LN(x)))`` with a GELU MLP of ``mlp_ratio * features`` hidden units.

  The attention is Flax's ``nn.MultiHeadDotProductAttention`` (self-attention, ``num_heads``
  heads of ``features // num_heads``), so its q.k and p.v einsums are reachable through
  Flax's hooks (:func:`jaxlp.flax.quantize_model`'s ``"attention_qk"`` / ``"attention_pv"``).

  Attributes:
    features: model width (must be divisible by ``num_heads``).
    num_heads: attention heads.
    mlp_ratio: MLP hidden units per model unit.
    dropout: dropout rate of the attention probabilities and of both residual branches.

  ``__call__(x, mask=None, train=False)``: ``x`` is ``(batch, length, features)``, ``mask``
  a boolean attention mask broadcastable to ``(batch, heads, length, length)`` (True =
  attend; e.g. ``nn.make_causal_mask``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.flax.models import TransformerBlock
    >>> block = TransformerBlock(features=8, num_heads=2)
    >>> x = jnp.ones((1, 3, 8))
    >>> y, variables = block.init_with_output(jax.random.key(0), x)
    >>> y.shape, sorted(variables["params"])
    ((1, 3, 8), ['Dense_0', 'Dense_1', 'LayerNorm_0', 'LayerNorm_1', 'attention'])

  References:
    Vaswani et al., "Attention Is All You Need", NeurIPS 2017; Xiong et al., "On Layer
    Normalization in the Transformer Architecture", ICML 2020 (pre-LN).
  """

  features: int
  num_heads: int = 4
  mlp_ratio: int = 4
  dropout: float = 0.1

  @nn.compact
  def __call__(self, x, mask=None, train: bool = False):
    if self.features % self.num_heads:
      raise ValueError(f"TransformerBlock: features={self.features} is not divisible by "
                       f"num_heads={self.num_heads}")
    drop = lambda h: nn.Dropout(self.dropout, deterministic=not train)(h)
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, qkv_features=self.features, dropout_rate=self.dropout,
        deterministic=not train, name="attention")(h, mask=mask)
    x = x + drop(h)
    h = nn.LayerNorm()(x)
    h = nn.gelu(nn.Dense(self.mlp_ratio * self.features)(h))
    return x + drop(nn.Dense(self.features)(h))


class TransformerLM(nn.Module):
  """A GPT-style decoder language model: token + learned position embeddings, pre-LN
  :class:`TransformerBlock` s with causal self-attention, a final LayerNorm, logits.

  Tokens ``(batch, length)`` -> logits ``(batch, length, vocab_size)``; the logits at
  position t depend only on tokens 0..t (``nn.make_causal_mask``). Tied (the default): the
  logits are ``embed.attend(h)`` (GPT-2); untied: ``Dense(vocab_size, use_bias=False)``.
  Embeddings are initialised N(0, 0.02^2) as in GPT-2.

  Attributes:
    vocab_size: number of token ids.
    features: model width (embedding size).
    num_heads: attention heads (``features`` must be divisible by it).
    num_layers: transformer blocks.
    mlp_ratio: MLP hidden units per model unit.
    max_len: the longest sequence (size of the position embedding).
    dropout: dropout rate (embeddings, attention probabilities, residual branches);
      ``train=True`` needs ``rngs={"dropout": key}``.
    tied: tie the output logits to the token embedding.

  ``__call__(tokens, train=False)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.flax.models import TransformerLM
    >>> model = TransformerLM(vocab_size=11, features=8, num_heads=2, max_len=16)
    >>> tokens = jnp.zeros((2, 5), jnp.int32)
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> model.apply(variables, tokens).shape
    (2, 5, 11)

  References:
    Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019.
  """

  vocab_size: int
  features: int = 128
  num_heads: int = 4
  num_layers: int = 2
  mlp_ratio: int = 4
  max_len: int = 512
  dropout: float = 0.1
  tied: bool = True

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    _check_tokens(tokens, self.vocab_size, self.max_len, "TransformerLM")
    embed = nn.Embed(self.vocab_size, self.features,
                     embedding_init=nn.initializers.normal(0.02), name="embed")
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, self.features))
    x = embed(tokens) + pos[None, :tokens.shape[1]]
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    mask = nn.make_causal_mask(tokens)
    for i in range(self.num_layers):
      x = TransformerBlock(self.features, self.num_heads, self.mlp_ratio, self.dropout,
                           name=f"block_{i}")(x, mask, train)
    x = nn.LayerNorm(name="final_norm")(x)
    if self.tied:
      return embed.attend(x)
    return nn.Dense(self.vocab_size, use_bias=False, name="logits")(x)


class BertMLM(nn.Module):
  """A BERT-style masked language model: a bidirectional pre-LN transformer encoder and
  BERT's MLM head (``Dense`` -> GELU -> LayerNorm -> logits tied to the token embedding,
  plus a bias).

  Tokens ``(batch, length)`` (some replaced by :func:`mask_tokens`) -> logits
  ``(batch, length, vocab_size)`` for the original token at every position; the MLM loss
  counts the masked positions only. Every position attends to every other (no mask; the
  sequences have no padding). The layer norm before each sublayer is Megatron-LM's
  arrangement for BERT (the original BERT normalises after); there is no next-sentence
  head.

  Attributes:
    vocab_size: number of token ids (including the mask token).
    features: model width.
    num_heads: attention heads.
    num_layers: transformer blocks.
    mlp_ratio: MLP hidden units per model unit.
    max_len: the longest sequence (size of the position embedding).
    dropout: dropout rate.

  ``__call__(tokens, train=False)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.flax.models import BertMLM
    >>> model = BertMLM(vocab_size=11, features=8, num_heads=2, max_len=16)
    >>> tokens = jnp.zeros((2, 5), jnp.int32)
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> model.apply(variables, tokens).shape
    (2, 5, 11)

  References:
    Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
    Understanding", NAACL 2019; Shoeybi et al., "Megatron-LM: Training Multi-Billion
    Parameter Language Models Using Model Parallelism", arXiv:1909.08053 (pre-LN BERT).
  """

  vocab_size: int
  features: int = 128
  num_heads: int = 4
  num_layers: int = 2
  mlp_ratio: int = 4
  max_len: int = 512
  dropout: float = 0.1

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    _check_tokens(tokens, self.vocab_size, self.max_len, "BertMLM")
    embed = nn.Embed(self.vocab_size, self.features,
                     embedding_init=nn.initializers.normal(0.02), name="embed")
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, self.features))
    x = embed(tokens) + pos[None, :tokens.shape[1]]
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    for i in range(self.num_layers):
      x = TransformerBlock(self.features, self.num_heads, self.mlp_ratio, self.dropout,
                           name=f"block_{i}")(x, None, train)
    x = nn.LayerNorm(name="final_norm")(x)
    h = nn.gelu(nn.Dense(self.features, name="mlm_dense")(x))
    h = nn.LayerNorm(name="mlm_norm")(h)
    bias = self.param("mlm_bias", nn.initializers.zeros_init(), (self.vocab_size,))
    return embed.attend(h) + bias[None, None, :]


def mask_tokens(key, tokens, *, mask_id: int, num_tokens: int, rate: float = 0.15):
  """BERT's masking rule: each position is selected with probability ``rate``; a selected
  position becomes ``mask_id`` with probability 0.8, a token drawn uniformly from
  ``0..num_tokens - 1`` with probability 0.1, and stays itself with probability 0.1.

  Jittable; the same ``key`` gives the same masks. The masked-LM loss is the cross-entropy of
  the original tokens at the selected positions (``weights``), averaged over them.

  Args:
    key: a PRNG key.
    tokens: integer token ids, any shape.
    mask_id: the mask token's id.
    num_tokens: random replacements are drawn from ``0..num_tokens - 1`` (the real tokens,
      without specials such as ``mask_id``).
    rate: the fraction of positions selected (BERT: 0.15).

  Returns:
    ``(inputs, weights)``: the model's input tokens, and float32 weights, 1.0 at the
    selected positions (whose targets are the original ``tokens``) and 0.0 elsewhere.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlp.flax.models import mask_tokens
    >>> tokens = jnp.arange(10000) % 7
    >>> inputs, weights = mask_tokens(jax.random.key(0), tokens, mask_id=7, num_tokens=7)
    >>> 0.13 < float(weights.mean()) < 0.17  # selected
    True
    >>> bool(jnp.all(jnp.where(weights == 0, inputs == tokens, True)))  # others unchanged
    True

  References:
    Devlin et al., "BERT", NAACL 2019, Section 3.1 (the 80/10/10 rule).
  """
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f"mask_tokens: rate must be in [0, 1], got {rate}")
  if num_tokens < 1:
    raise ValueError(f"mask_tokens: num_tokens must be >= 1, got {num_tokens}")
  k_sel, k_how, k_tok = jax.random.split(key, 3)
  selected = jax.random.uniform(k_sel, tokens.shape) < rate
  how = jax.random.uniform(k_how, tokens.shape)
  random_tok = jax.random.randint(k_tok, tokens.shape, 0, num_tokens, tokens.dtype)
  replaced = jnp.where(how < 0.8, jnp.asarray(mask_id, tokens.dtype),
                       jnp.where(how < 0.9, random_tok, tokens))
  return jnp.where(selected, replaced, tokens), selected.astype(jnp.float32)
