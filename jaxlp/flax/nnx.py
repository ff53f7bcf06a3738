"""Quantizing an existing Flax nnx model without editing its code (attribute injection)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from jaxlp.flax._select import check_patterns, normalize_patterns, selected
from jaxlp.ops._conv import conv_general_dilated
from jaxlp.ops._dot_general import dot_general
from jaxlp.ops._policy import DotPolicy

__all__ = ["StochasticOp", "quantize_model"]


class StochasticOp(nnx.Module):
  """An nnx callable with a lax dot_general / conv signature that draws a fresh key from
  ``rngs[stream]`` on every call (stochastic-rounding policies in nnx).

  :func:`quantize_model` installs these on the layers for stochastic policies.

  Args:
    kind: ``"conv"`` for ``jaxlp.conv_general_dilated(policy)``, anything else for
      ``jaxlp.dot_general(policy)``.
    policy: the :class:`jaxlp.DotPolicy`.
    rngs: an ``nnx.Rngs`` with the stream ``stream``.
    stream: the stream name.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from flax import nnx
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.flax import StochasticOp
    >>> policy = jaxlp.float_policy(E4M3, rounding="stochastic")
    >>> op = StochasticOp("dot", policy, nnx.Rngs(quantize=0))
    >>> lhs, rhs = jnp.array([[0.1, 1.3]]), jnp.ones((2, 1))
    >>> op(lhs, rhs, (((1,), (0,)), ((), ()))).shape  # lax.dot_general's signature
    (1, 1)
  """

  def __init__(self, kind: str, policy: DotPolicy, rngs: nnx.Rngs, stream: str = "quantize"):
    self.kind = kind
    self.policy = policy
    self.rngs = rngs
    self.stream = stream

  def __call__(self, *args, **kwargs):
    key = self.rngs[self.stream]()
    make = conv_general_dilated if self.kind == "conv" else dot_general
    return make(self.policy, key=key)(*args, **kwargs)


def _einsum_op(dg):
  return functools.partial(jnp.einsum, _dot_general=dg)


def quantize_model(model: nnx.Module, policy: DotPolicy, *, include=None, exclude=None,
                   rngs: nnx.Rngs | None = None, rng_stream: str = "quantize",
                   copy: bool = True) -> nnx.Module:
  """Quantize every Linear / LinearGeneral / Einsum / Conv of an nnx model.

  Walks the graph and sets each selected layer's ``dot_general`` / ``conv_general_dilated``
  (``einsum_op`` for ``Einsum``) to the policy's callable.

  Args:
    model: an nnx module.
    policy: the :class:`jaxlp.DotPolicy`.
    include, exclude: glob pattern(s) on '/'-joined graph paths (e.g. ``"layers/0"``).
    rngs: required for stochastic policies: an ``nnx.Rngs`` with stream ``rng_stream``; each
      layer call draws a fresh key from it (its counter is model state).
    rng_stream: the stream name.
    copy: return a quantized clone (default; same weight values) instead of editing
      ``model`` in place.

  Returns:
    The quantized model.

  Raises:
    TypeError: ``policy`` is not a :class:`jaxlp.DotPolicy`, or ``include`` / ``exclude`` is
      not a str or a sequence of str.
    ValueError: the policy uses stochastic rounding and ``rngs`` is None; an ``include`` or
      ``exclude`` pattern matches none of the model's Linear/LinearGeneral/Einsum/Conv
      layers (the message lists their paths; an error rather than a warning, see
      ``check_patterns`` in ``jaxlp/flax/_select.py``). Raised before ``model`` is changed.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from flax import nnx
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.flax.nnx import quantize_model
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    >>> policy = jaxlp.float_policy(E4M3, rounding="stochastic")
    >>> qmodel = quantize_model(model, policy, exclude="layers/2", rngs=nnx.Rngs(quantize=0))
    >>> type(qmodel.layers[0].dot_general).__name__
    'StochasticOp'
    >>> qmodel.layers[2].dot_general is jax.lax.dot_general  # excluded: stays lax's
    True
    >>> model.layers[0].dot_general is jax.lax.dot_general  # copy=True: model untouched
    True
    >>> qmodel(jnp.ones((1, 3))).shape
    (1, 2)
  """
  if not isinstance(policy, DotPolicy):
    raise TypeError(f"quantize_model: policy must be a jaxlp.DotPolicy, got {policy!r}")
  if policy.stochastic and rngs is None:
    raise ValueError("quantize_model: the policy uses stochastic rounding: pass "
                     f"rngs=nnx.Rngs({rng_stream}=...)")
  include = normalize_patterns(include, "include")
  exclude = normalize_patterns(exclude, "exclude")
  if copy:
    model = nnx.clone(model)

  def op(kind):
    if policy.stochastic:  # a graph node (carries the rng counter): marked as nnx data
      return nnx.data(StochasticOp(kind, policy, rngs, rng_stream))
    return conv_general_dilated(policy) if kind == "conv" else dot_general(policy)

  targets, layers = [], []
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv)):
      continue
    layers.append("/".join(str(p) for p in path))
    if selected(layers[-1], include, exclude):
      targets.append(node)
  check_patterns(layers, include, exclude)
  for node in targets:
    if isinstance(node, nnx.Conv):
      node.conv_general_dilated = op("conv")
    elif isinstance(node, nnx.Einsum):
      node.einsum_op = _einsum_op(op("dot"))
    else:
      node.dot_general = op("dot")
      if isinstance(node, nnx.LinearGeneral):
        node.dot_general_cls = None
  return model
