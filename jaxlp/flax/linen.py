"""Quantizing an existing Flax linen model without editing its code (method interception)."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn

from jaxlp.flax._select import check_patterns, normalize_patterns, selected
from jaxlp.ops._conv import conv_general_dilated
from jaxlp.ops._dot_general import dot_general
from jaxlp.ops._policy import DotPolicy

__all__ = ["QuantizedModel", "quantize_model"]

#: linen layer types rewired, and the attribute (+ its ``_cls`` twin) each one calls.
LINEN_LAYERS = (
    (nn.Dense, "dot_general"),
    (nn.DenseGeneral, "dot_general"),
    (nn.Conv, "conv_general_dilated"),
)


def _layer_attr(module):
  for cls, attr in LINEN_LAYERS:
    if isinstance(module, cls):
      return attr
  return None


class QuantizedModel:
  """A linen model whose Dense/DenseGeneral/Conv layers run under a :class:`DotPolicy`.

  ``init`` / ``apply`` take and return exactly the variables of the original model; every
  selected layer's ``dot_general`` / ``conv_general_dilated`` is replaced, for the duration of
  its ``__call__``, by ``jaxlp.dot_general(policy, key=...)`` /
  ``jaxlp.conv_general_dilated(policy, key=...)`` (through ``flax.linen.intercept_methods``).
  With a stochastic policy each layer call draws its key with ``module.make_rng(rng_stream)``:
  pass ``rngs={"quantize": key}`` (a fresh key per step) to ``apply``.

  Other attributes are forwarded to the wrapped model.

  Args:
    model: an unbound linen module (its code is not modified).
    policy: the :class:`jaxlp.DotPolicy`.
    include: glob pattern(s) on '/'-joined module paths to quantize (None = all).
    exclude: glob pattern(s) of paths left in FP32.
    rng_stream: the rng stream stochastic rounding keys come from.

  Raises:
    TypeError: ``model`` is not a linen ``Module``, ``policy`` is not a
      :class:`jaxlp.DotPolicy`, or ``include`` / ``exclude`` is not a str or a sequence of
      str.
    ValueError: (from the first ``init`` / ``init_with_output`` / ``apply`` /
      ``quantized_paths``) an ``include`` or ``exclude`` pattern matches none of the layers
      the model calls (the message lists their paths; see ``check_patterns`` in
      ``jaxlp/flax/_select.py`` for why this is an error); (from ``apply``) a stochastic
      policy, but no ``rng_stream`` key was passed.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.flax import QuantizedModel
    >>> from jaxlp.flax.models import MLP
    >>> policy = jaxlp.float_policy(E4M3, rounding="stochastic")
    >>> qm = QuantizedModel(MLP(features=(4, 2)), policy)
    >>> x = jnp.ones((1, 3))
    >>> variables = qm.init(jax.random.key(0), x)  # the original model's variables
    >>> jax.tree_util.tree_map(jnp.shape, variables["params"]["Dense_1"])
    {'bias': (2,), 'kernel': (4, 2)}
    >>> qm.apply(variables, x, rngs={"quantize": jax.random.key(1)}).shape
    (1, 2)
  """

  def __init__(self, model: nn.Module, policy: DotPolicy, *, include=None, exclude=None,
               rng_stream: str = "quantize"):
    if not isinstance(model, nn.Module):
      raise TypeError(f"quantize_model: model must be a flax module, got {type(model)}")
    if not isinstance(policy, DotPolicy):
      raise TypeError(f"quantize_model: policy must be a jaxlp.DotPolicy, got {policy!r}")
    self.model = model
    self.policy = policy
    self.include = normalize_patterns(include, "include")
    self.exclude = normalize_patterns(exclude, "exclude")
    self.rng_stream = rng_stream
    # The layer paths exist only once the model runs: the patterns are checked against the
    # layers of the first call (init, apply, ...) that completes, then not again.
    self._patterns_checked = include is None and exclude is None

  def _key(self, module):
    if not self.policy.stochastic:
      return None
    if module.scope is not None and module.scope.has_rng(self.rng_stream):
      return module.make_rng(self.rng_stream)
    if module.is_initializing():
      return module.make_rng("params")
    raise ValueError(
        f"quantize_model: the policy uses stochastic rounding: pass rngs={{"
        f"{self.rng_stream!r}: key}} (a fresh key per step) to apply")

  def _interceptor(self, next_fun, args, kwargs, context, seen=None):
    module = context.module
    attr = _layer_attr(module) if context.method_name == "__call__" else None
    if attr is not None and seen is not None:
      seen.append("/".join(module.path))
    if attr is None or not selected("/".join(module.path), self.include, self.exclude):
      return next_fun(*args, **kwargs)
    make = conv_general_dilated if attr == "conv_general_dilated" else dot_general
    fn = make(self.policy, key=self._key(module))
    saved = (getattr(module, attr), getattr(module, attr + "_cls"))
    # Linen modules are frozen dataclasses; the override lives only for this call.
    object.__setattr__(module, attr, fn)
    object.__setattr__(module, attr + "_cls", None)
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, attr, saved[0])
      object.__setattr__(module, attr + "_cls", saved[1])

  def quantized_paths(self, *args, **kwargs) -> list[str]:
    """The '/'-joined paths of the layers that get quantized on ``init(*args, **kwargs)``."""
    paths, layers = [], []

    def spy(next_fun, a, kw, context):
      m = context.module
      if context.method_name == "__call__" and _layer_attr(m) is not None:
        layers.append("/".join(m.path))
        if selected("/".join(m.path), self.include, self.exclude):
          paths.append("/".join(m.path))
      return next_fun(*a, **kw)

    with nn.intercept_methods(spy):
      import jax  # noqa: PLC0415
      jax.eval_shape(lambda: self.model.init(*args, **kwargs))
    check_patterns(layers, self.include, self.exclude)
    return paths

  def _run(self, fn, *args, **kwargs):
    seen = None if self._patterns_checked else []
    with nn.intercept_methods(functools.partial(self._interceptor, seen=seen)):
      out = fn(*args, **kwargs)
    if seen is not None:
      check_patterns(seen, self.include, self.exclude)
      self._patterns_checked = True
    return out

  def init(self, *args, **kwargs):
    return self._run(self.model.init, *args, **kwargs)

  def init_with_output(self, *args, **kwargs):
    return self._run(self.model.init_with_output, *args, **kwargs)

  def apply(self, variables, *args, **kwargs):
    return self._run(self.model.apply, variables, *args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    if name == "model":
      raise AttributeError(name)
    return getattr(self.model, name)

  def __repr__(self):
    return (f"QuantizedModel({type(self.model).__name__}, policy={self.policy}, "
            f"include={self.include}, exclude={self.exclude})")


def quantize_model(model: nn.Module, policy: DotPolicy, *, include=None, exclude=None,
                   rng_stream: str = "quantize") -> QuantizedModel:
  """Quantize every Dense / DenseGeneral / Conv of a linen model (see :class:`QuantizedModel`).

  Args:
    model: an unbound linen module (its code is not modified).
    policy: the :class:`jaxlp.DotPolicy`.
    include: glob pattern(s) on '/'-joined module paths (e.g. ``"ResNet_0/*"``); None = all.
    exclude: glob pattern(s) of layers left in FP32 (e.g. ``("Conv_0", "Dense_0")`` for the
      usual first/last layer exclusion).
    rng_stream: the rng stream stochastic rounding keys come from.

  Returns:
    The :class:`QuantizedModel` wrapping ``model``.

  Raises:
    TypeError: as :class:`QuantizedModel` (not a linen module, not a ``DotPolicy``, bad
      patterns).

  A pattern that matches none of the model's layers (e.g. ``exclude="Dense_l"`` for
  ``"Dense_1"``) is a ``ValueError`` listing the layer paths; linen builds its layers only
  when the model runs, so it is raised by the first ``init`` / ``apply`` (or
  ``quantized_paths``), not here.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.flax.linen import quantize_model
    >>> from jaxlp.flax.models import MLP
    >>> qm = quantize_model(MLP(features=(4, 2)), jaxlp.float_policy(E4M3), exclude="Dense_1")
    >>> x = jnp.ones((1, 3))
    >>> qm.quantized_paths(jax.random.key(0), x)
    ['Dense_0']
    >>> variables = qm.init(jax.random.key(0), x)
    >>> qm.apply(variables, x).shape
    (1, 2)
  """
  return QuantizedModel(model, policy, include=include, exclude=exclude, rng_stream=rng_stream)
