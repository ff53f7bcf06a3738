"""jaxlp.flax: Flax linen + nnx integration of :class:`jaxlp.DotPolicy` numerics.

* Per layer: ``nn.Dense(dot_general=jaxlp.dot_general(policy))``,
  ``nn.Conv(conv_general_dilated=jaxlp.conv_general_dilated(policy))``,
  ``nnx.Linear(..., dot_general=...)``, ``nnx.Conv(..., conv_general_dilated=...)``.
* Whole model, without editing its code: :func:`quantize_model` (linen or nnx), per kind of
  matmul (:data:`MATMUL_KINDS`) and per module path, and :func:`matmul_report`, which lists
  every matmul of a traced step with the policy it got.
"""

from __future__ import annotations

from jaxlp.flax import linen as linen
from jaxlp.flax import models as models
from jaxlp.flax import nnx as nnx
from jaxlp.flax._plan import KINDS as MATMUL_KINDS
from jaxlp.flax._report import MatmulOp as MatmulOp
from jaxlp.flax._report import MatmulReport as MatmulReport
from jaxlp.flax.linen import QuantizedModel as QuantizedModel
from jaxlp.flax.nnx import StochasticOp as StochasticOp


def quantize_model(model, policy, *, include=None, exclude=None, rules=(), strict=False,
                   **kwargs):
  """Quantize the matmuls of a linen or nnx model, per kind of matmul and per module path.

  Linen (``flax.linen.Module``): returns a :class:`QuantizedModel` whose ``init``/``apply``
  take the original variables (see :func:`jaxlp.flax.linen.quantize_model`). nnx
  (``flax.nnx.Module``): returns a quantized model (see :func:`jaxlp.flax.nnx.quantize_model`).

  The matmuls jaxlp wraps, by kind (:data:`MATMUL_KINDS`):

  ========================  ===============================================================
  ``"dense"``               ``Dense`` / ``DenseGeneral`` (nnx ``Linear`` / ``LinearGeneral``),
                            attention q/k/v/out projections included
  ``"conv"``                ``Conv``
  ``"einsum"``              ``Einsum``
  ``"attention_qk"``        attention logits q.k of ``MultiHeadDotProductAttention`` /
                            ``SelfAttention`` (nnx ``MultiHeadAttention``)
  ``"attention_pv"``        attention-weighted values p.v of the same
  ``"embed_attend"``        ``Embed.attend`` (tied output logits)
  ``"recurrent"``           gate matmuls of ``LSTMCell``, ``OptimizedLSTMCell``, ``GRUCell``,
                            ``MGUCell``, ``SimpleCell`` (linen ``ConvLSTMCell``: its convs)
  ========================  ===============================================================

  Softmax, normalisation, biases and the residual stream stay in FP32. A matmul none of these
  cover (a raw ``jnp.einsum`` / ``@`` in a module, ``ConvTranspose``, ``ConvLocal``, a custom
  attention function) stays in FP32 too: :func:`matmul_report` lists every matmul of a step
  with the policy it got or ``"unquantized"``, and ``strict=True`` refuses such a model.

  Which policy a matmul of kind K in the module at path P gets, first match wins:
  ``include`` / ``exclude`` (P not selected: FP32), then ``rules`` in order (a rule whose
  glob matches P and that gives K: a DotPolicy or None for every kind, or a mapping with K
  or ``"default"``), then ``policy`` (a DotPolicy, or its mapping's K, then ``"default"``;
  a mapping without either: FP32).

  Every ``include`` / ``exclude`` / ``rules`` pattern must match the whole path of at least
  one module with a matmul: one jaxlp wraps (a layer, an attention module, an ``Embed``
  (linen: one whose ``attend`` runs), a cell; whatever policy it ends up with) or one that a
  matmul jaxlp does not wrap is attributed to (as :func:`matmul_report` lists it; there the
  pattern decides whether that matmul counts as excluded, for ``strict`` and the report). A
  pattern that matches none -- a typo, or a parent's path (``"Block_0"`` is not
  ``"Block_0/Dense_0"``; ``"Block_0/*"`` matches it) -- is a ``ValueError`` listing the
  paths. The modules with an unwrapped matmul are found by tracing the model: linen traces
  the call once, and only when a pattern matches no wrapped module; nnx traces
  ``example_args`` when given (without them such a pattern is refused).

  Args:
    model: the model.
    policy: a :class:`jaxlp.DotPolicy`, or a mapping ``{kind: DotPolicy | None}`` with
      optional ``"default"`` (None = FP32).
    include: glob pattern(s) of '/'-joined module paths to quantize (None = all).
    exclude: glob pattern(s) of paths to leave in FP32 (first/last layer exclusion).
    rules: ``[(pattern, DotPolicy | None | mapping), ...]`` per module path.
    strict: refuse (``ValueError`` naming each matmul) a model with a matmul jaxlp does not
      wrap outside the excluded paths (linen: checked when ``init`` / ``apply`` first trace
      an input signature; nnx: on ``example_args``).
    **kwargs: framework-specific options (``rng_stream``; nnx: ``rngs``, ``copy``,
      ``example_args``).

  Returns:
    A :class:`QuantizedModel` for a linen model; the quantized nnx module for an nnx model.

  Raises:
    TypeError: ``model`` is neither a linen nor an nnx ``Module``, ``policy`` is not a
      :class:`jaxlp.DotPolicy` or a mapping of them, ``include`` / ``exclude`` is not a str
      or a sequence of str, or a malformed rule.
    ValueError: an unknown kind; (nnx) a stochastic policy without ``rngs``; ``strict=True``
      and a matmul jaxlp does not wrap; an ``include`` / ``exclude`` / ``rules`` pattern that
      matches no path of a module with a matmul (the message lists them; nnx: here, linen: on
      the first ``init`` / ``apply`` / ``quantized_paths`` / ``matmul_report``, when the
      modules exist).

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
    >>> # per kind: projections E4M3, attention logits BF16, attention values FP32
    >>> mha = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
    >>> q = quantize_model(mha, {"default": policy, "attention_qk": jaxlp.float_policy(
    ...     jaxlp.formats.BF16), "attention_pv": None})
    >>> q.attention_fn.qk.policy.lhs.fmt, q.attention_fn.pv.policy, q.query.dot_general.source
    (jaxlp.formats.BF16, None, "policy['default']")
  """
  import flax.linen as nn  # noqa: PLC0415
  from flax import nnx as fnnx  # noqa: PLC0415
  kw = dict(include=include, exclude=exclude, rules=rules, strict=strict, **kwargs)
  if isinstance(model, nn.Module):
    return linen.quantize_model(model, policy, **kw)
  if isinstance(model, fnnx.Module):
    return nnx.quantize_model(model, policy, **kw)
  raise TypeError(f"quantize_model: model must be a flax linen or nnx Module, got {type(model)}")


def matmul_report(model, *args, loss_fn=None, **kwargs) -> MatmulReport:
  """Every matmul (``dot_general`` / ``conv_general_dilated``) of a traced forward pass or
  training step, with its module path, kind, direction and shapes, and the policy it got
  (or ``"unquantized"``: a raw FP32 matmul jaxlp did not wrap).

  Traced with ``jax.make_jaxpr`` (nothing runs); the census goes through every sub-jaxpr
  (``jit``, ``custom_vjp``, ``scan``, ``remat``, ``cond``) and counts each equation once.

  Args:
    model: a :class:`QuantizedModel` (then ``args`` = ``(variables, *inputs)``, as
      :meth:`QuantizedModel.matmul_report`) or an nnx module (``args`` = the call's inputs,
      as :func:`jaxlp.flax.nnx.matmul_report`).
    *args: see ``model``.
    loss_fn: optional ``loss_fn(outputs) -> scalar``: report the loss + gradient step
      (gradients w.r.t. the parameters) instead of the forward pass.
    **kwargs: keywords of the call (linen: ``apply``'s).

  Returns:
    A :class:`MatmulReport`.

  Raises:
    TypeError: ``model`` is neither a :class:`QuantizedModel` nor an nnx module.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from flax import nnx
    >>> from jaxlp.formats import BF16
    >>> mha = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
    >>> q = jaxlp.flax.quantize_model(mha, jaxlp.float_policy(BF16))
    >>> r = jaxlp.flax.matmul_report(q, jnp.ones((1, 4, 8)), loss_fn=jnp.sum)
    >>> len(r), r.count(status="quantized"), r.count(kind="attention_qk")
    (18, 18, 3)
  """
  from flax import nnx as fnnx  # noqa: PLC0415
  if isinstance(model, QuantizedModel):
    return model.matmul_report(*args, loss_fn=loss_fn, **kwargs)
  if isinstance(model, fnnx.Module):
    return nnx.matmul_report(model, *args, loss_fn=loss_fn, **kwargs)
  raise TypeError("matmul_report: model must be a jaxlp.flax.QuantizedModel or an nnx "
                  f"Module, got {type(model)}")


__all__ = ["MATMUL_KINDS", "MatmulOp", "MatmulReport", "QuantizedModel", "StochasticOp",
           "linen", "matmul_report", "models", "nnx", "quantize_model"]
