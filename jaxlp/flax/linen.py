"""Quantizing an existing Flax linen model without editing its code (method interception)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import attention as _linen_attention
from flax.linen import dtypes as _linen_dtypes
from flax.linen import recurrent as _linen_recurrent

from jaxlp.flax import _report as R
from jaxlp.flax._plan import Plan
from jaxlp.flax._select import check_patterns, unmatched_patterns

__all__ = ["QuantizedModel", "quantize_model"]

#: linen layer types rewired through an attribute (+ its ``_cls`` twin) they call.
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


def _not_overridden(module, base, name):
  return getattr(type(module), name) is getattr(base, name)


def _accepts_attention_hooks(fn) -> bool:
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return "qk_attn_weights_einsum" in params and "attn_weights_value_einsum" in params


def _handled(module, method: str):
  """``(handler name, kinds)`` for a module method jaxlp rewires, else None."""
  recurrent = isinstance(module.parent, nn.RNNCellBase)
  if method == "__call__":
    attr = _layer_attr(module)
    if attr == "dot_general":
      return "layer", ("recurrent" if recurrent else "dense",)
    if attr == "conv_general_dilated":
      return "layer", ("recurrent" if recurrent else "conv",)
    if isinstance(module, nn.Einsum) and _not_overridden(module, nn.Einsum, "__call__"):
      return "einsum", ("einsum",)
    if isinstance(module, nn.MultiHeadDotProductAttention):
      if isinstance(module.attention_fn, _AttentionFn):
        return None  # SelfAttention.__call__ -> MultiHeadDotProductAttention.__call__
      if _accepts_attention_hooks(module.attention_fn):
        return "attention", ("attention_qk", "attention_pv")
      return None
    if (isinstance(module, nn.OptimizedLSTMCell)
        and _not_overridden(module, nn.OptimizedLSTMCell, "__call__")):
      return "optimized_lstm", ("recurrent",)
  elif (method == "attend" and isinstance(module, nn.Embed)
        and _not_overridden(module, nn.Embed, "attend")):
    return "attend", ("embed_attend",)
  return None


class _AttentionFn:
  """``attention_fn`` of a MultiHeadDotProductAttention for one call: Flax's (or the user's)
  function, with the q.k and p.v einsums through jaxlp (Flax's ``qk_attn_weights_einsum`` /
  ``attn_weights_value_einsum`` hooks)."""

  def __init__(self, orig, qk, pv):
    self.orig, self.qk, self.pv = orig, qk, pv
    self.__signature__ = inspect.signature(orig)  # MultiHeadDotProductAttention filters by it

  def __call__(self, *args, **kwargs):
    precision = kwargs.get("precision")
    if self.orig is _linen_attention.dot_product_attention:
      kwargs.pop("precision", None)  # Flax refuses precision together with the hooks
    kwargs["qk_attn_weights_einsum"] = functools.partial(jnp.einsum, precision=precision,
                                                         _dot_general=self.qk)
    kwargs["attn_weights_value_einsum"] = functools.partial(jnp.einsum, precision=precision,
                                                            _dot_general=self.pv)
    return self.orig(*args, **kwargs)


def _marked(kind, path, fn, args, kwargs):
  with jax.named_scope(R.marker(kind, path)):
    return fn(*args, **kwargs)


class QuantizedModel:
  """A linen model whose matmuls run under :class:`jaxlp.DotPolicy` policies.

  ``init`` / ``apply`` take and return exactly the variables of the original model. Through
  ``flax.linen.intercept_methods``, for the duration of each call:

  * ``Dense``, ``DenseGeneral`` (kind ``"dense"``) and ``Conv`` (``"conv"``): their
    ``dot_general`` / ``conv_general_dilated`` is replaced by ``jaxlp.dot_general(policy)`` /
    ``jaxlp.conv_general_dilated(policy)``; inside a recurrent cell (``LSTMCell``,
    ``GRUCell``, ``MGUCell``, ``SimpleCell``, ``ConvLSTMCell``) their kind is
    ``"recurrent"``.
  * ``Einsum`` (``"einsum"``), ``Embed.attend`` (``"embed_attend"``: tied output logits) and
    ``OptimizedLSTMCell`` (``"recurrent"``; its gate matmuls on the concatenated kernels) run
    the same computation as Flax's with the matmul through jaxlp.
  * ``MultiHeadDotProductAttention`` / ``SelfAttention`` / ``MultiHeadAttention``: the
    attention logits q.k (``"attention_qk"``) and the attention-weighted values p.v
    (``"attention_pv"``) go through Flax's ``qk_attn_weights_einsum`` /
    ``attn_weights_value_einsum`` hooks of ``attention_fn`` (Flax's
    ``dot_product_attention`` or any function that accepts them); the q/k/v/out projections
    are ``DenseGeneral`` layers (``"dense"``).

  Softmax, normalisation, biases and the residual stream stay in FP32. Anything else -- a
  raw ``jnp.einsum`` / ``jnp.dot`` / ``@`` in a module, ``ConvTranspose``, ``ConvLocal``, an
  ``attention_fn`` without the hooks, a subclass that overrides the method -- stays in
  FP32: :meth:`matmul_report` lists every matmul of a step with what it got, and
  ``strict=True`` refuses such a model.

  With a stochastic policy each module call draws its key with ``module.make_rng(rng_stream)``:
  pass ``rngs={"quantize": key}`` (a fresh key per step) to ``apply``.

  Other attributes are forwarded to the wrapped model.

  Args:
    model: an unbound linen module (its code is not modified).
    policy: a :class:`jaxlp.DotPolicy` for every kind, or a mapping ``{kind: DotPolicy |
      None}`` over :data:`jaxlp.flax.MATMUL_KINDS` and ``"default"`` (None = FP32; a kind
      not listed takes ``"default"``, and stays FP32 without one).
    include: glob pattern(s) on '/'-joined module paths to quantize (None = all).
    exclude: glob pattern(s) of paths left in FP32.
    rules: ``[(pattern, policy), ...]``: per path, before ``policy``; the first rule whose
      glob matches the module path and gives the kind (a DotPolicy or None for every kind, or
      a mapping like ``policy``'s, whose unlisted kinds fall through) wins.
    strict: refuse (``ValueError`` naming each one) to run a model with a matmul jaxlp does
      not wrap outside the excluded paths; checked on the forward pass of every new input
      signature of ``init`` / ``apply`` (one extra trace).
    rng_stream: the rng stream stochastic rounding keys come from.

  Raises:
    TypeError: ``model`` is not a linen ``Module``; ``policy`` is not a DotPolicy or a
      mapping of them; ``include`` / ``exclude`` is not a str or a sequence of str; a
      malformed rule.
    ValueError: an unknown kind; (from the first ``init`` / ``init_with_output`` /
      ``apply`` / ``quantized_paths`` / ``matmul_report`` that completes) an ``include`` /
      ``exclude`` / ``rules`` pattern matches no path of a module with a matmul (see
      :func:`jaxlp.flax.quantize_model`; the message lists the paths); (from ``apply``) a
      stochastic policy, but no ``rng_stream`` key was passed; (``strict=True``) a matmul
      jaxlp does not wrap.

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

  def __init__(self, model: nn.Module, policy, *, include=None, exclude=None, rules=(),
               strict: bool = False, rng_stream: str = "quantize"):
    if not isinstance(model, nn.Module):
      raise TypeError(f"quantize_model: model must be a flax module, got {type(model)}")
    self.model = model
    self.policy = policy
    self.plan = Plan.make(policy, include=include, exclude=exclude, rules=rules)
    self.include = self.plan.include
    self.exclude = self.plan.exclude
    self.rules = self.plan.rules
    self.strict = bool(strict)
    self.rng_stream = rng_stream
    self._strict_checked: set = set()
    # The module paths exist only once the model runs: the patterns are checked against the
    # modules of the first call (init, apply, ...) that completes, then not again; a call
    # that raised is checked again next time.
    self._patterns_checked = (self.include is None and self.exclude is None
                              and not self.rules)

  # ------------------------------------------------------------------ interception

  def _key(self, module, policies):
    if not any(p is not None and p.stochastic for p in policies):
      return None
    if module.scope is not None and module.scope.has_rng(self.rng_stream):
      return module.make_rng(self.rng_stream)
    if module.is_initializing():
      return module.make_rng("params")
    raise ValueError(
        f"quantize_model: the policy uses stochastic rounding: pass rngs={{"
        f"{self.rng_stream!r}: key}} (a fresh key per step) to apply; inside nn.RNN / "
        f"nn.scan also list the stream: split_rngs={{'params': False, "
        f"{self.rng_stream!r}: True}} (module {'/'.join(module.path) or 'the model'})")

  def _ops(self, module, path, kinds, op="dot"):
    """One TaggedOp per kind; a stochastic call draws one key, folded per kind."""
    resolved = [self.plan.resolve(path, k) for k in kinds]
    key = self._key(module, [p for p, _ in resolved])
    ops = []
    for i, (kind, (pol, src)) in enumerate(zip(kinds, resolved, strict=True)):
      k = None
      if key is not None and pol is not None and pol.stochastic:
        k = key if len(kinds) == 1 else jax.random.fold_in(key, i)
      ops.append(R.TaggedOp(op, kind, path, pol, src, key=k))
    return ops

  def _interceptor(self, next_fun, args, kwargs, context, seen=None):
    module = context.module
    handled = _handled(module, context.method_name)
    if handled is None:
      return next_fun(*args, **kwargs)
    how, kinds = handled
    path = "/".join(module.path)
    if seen is not None:
      seen.append(path)
    return getattr(self, "_run_" + how)(module, path, kinds, next_fun, args, kwargs)

  def _run_layer(self, module, path, kinds, next_fun, args, kwargs):
    attr = _layer_attr(module)
    op = "conv" if attr == "conv_general_dilated" else "dot"
    (tagged,) = self._ops(module, path, kinds, op)
    saved = (getattr(module, attr), getattr(module, attr + "_cls"))
    if tagged.policy is None:  # FP32 by choice: the layer's own op, tagged
      tagged.base = saved[1]() if saved[1] is not None else saved[0]
    # Linen modules are frozen dataclasses; the override lives only for this call.
    object.__setattr__(module, attr, tagged)
    object.__setattr__(module, attr + "_cls", None)
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, attr, saved[0])
      object.__setattr__(module, attr + "_cls", saved[1])

  def _run_attention(self, module, path, kinds, next_fun, args, kwargs):
    qk, pv = self._ops(module, path, kinds)
    orig = module.attention_fn
    object.__setattr__(module, "attention_fn", _AttentionFn(orig, qk, pv))
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, "attention_fn", orig)

  def _run_einsum(self, module, path, kinds, next_fun, args, kwargs):
    (tagged,) = self._ops(module, path, kinds)
    bound = inspect.signature(nn.Einsum.__call__).bind(module, *args, **kwargs)
    inputs = bound.arguments["inputs"]
    einsum_str = nn.merge_param("einsum_str", module.einsum_str,
                                bound.arguments.get("einsum_str"))
    einsum_str = einsum_str.replace(" ", "")
    if tagged.policy is None or "->" not in einsum_str or einsum_str.count(",") != 1:
      return _marked("einsum", path, next_fun, args, kwargs)  # Flax's own (and its errors)
    # flax.linen.Einsum.__call__ (flax 0.12), with the einsum's dot_general through jaxlp
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias = bias_shape = None
    if module.use_bias:
      shape, bias_shape = module._get_bias_shape(einsum_str, inputs, kernel)
      bias = module.param("bias", module.bias_init, shape, module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    y = jnp.einsum(einsum_str, inputs, kernel, precision=module.precision,
                   preferred_element_type=module.preferred_element_type, _dot_general=tagged)
    if bias is not None:
      y += jnp.reshape(bias, bias_shape)
    return y

  def _run_attend(self, module, path, kinds, next_fun, args, kwargs):
    (tagged,) = self._ops(module, path, kinds)
    if tagged.policy is None:
      return _marked("embed_attend", path, next_fun, args, kwargs)
    query = args[0] if args else kwargs["query"]
    # flax.linen.Embed.attend: jnp.dot(query, embedding.T)
    query, embedding = module.promote_dtype(query, module.embedding, dtype=module.dtype)
    return tagged(query, embedding.T, (((query.ndim - 1,), (0,)), ((), ())))

  def _run_optimized_lstm(self, module, path, kinds, next_fun, args, kwargs):
    pol = self.plan.resolve(path, kinds[0])[0]
    if pol is None:
      return _marked("recurrent", path, next_fun, args, kwargs)
    bound = inspect.signature(nn.OptimizedLSTMCell.__call__).bind(module, *args, **kwargs)
    (c, h), inputs = bound.arguments["carry"], bound.arguments["inputs"]
    # flax.linen.OptimizedLSTMCell.__call__ (flax 0.12): the same parameters (created in the
    # same order), gates i, f, g, o from one matmul of the input and one of the hidden state
    # with the four kernels concatenated, here through jaxlp.
    feats = h.shape[-1]
    params_i, params_h = {}, {}
    for comp in ("i", "f", "g", "o"):
      params_i[comp] = _linen_recurrent.DenseParams(
          features=feats, use_bias=False, param_dtype=module.param_dtype,
          kernel_init=module.kernel_init, bias_init=module.bias_init, name=f"i{comp}")(inputs)
      params_h[comp] = _linen_recurrent.DenseParams(
          features=feats, use_bias=True, param_dtype=module.param_dtype,
          kernel_init=module.recurrent_kernel_init, bias_init=module.bias_init,
          name=f"h{comp}")(h)
    ops = iter(self._ops(module, path, kinds * 2))

    def concat_dense(x, params, use_bias):
      kernels = [k for k, _ in params.values()]
      kernel = jnp.concatenate(kernels, axis=-1)
      bias = jnp.concatenate([b for _, b in params.values()], axis=-1) if use_bias else None
      x, kernel, bias = _linen_dtypes.promote_dtype(x, kernel, bias, dtype=module.dtype)
      y = next(ops)(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
      if use_bias:
        y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
      split = np.cumsum([k.shape[-1] for k in kernels[:-1]])
      return dict(zip(params, jnp.split(y, split, axis=-1), strict=True))

    dh = concat_dense(h, params_h, True)
    di = concat_dense(inputs, params_i, False)
    i = module.gate_fn(dh["i"] + di["i"])
    f = module.gate_fn(dh["f"] + di["f"])
    g = module.activation_fn(dh["g"] + di["g"])
    o = module.gate_fn(dh["o"] + di["o"])
    new_c = f * c + i * g
    new_h = o * module.activation_fn(new_c)
    return (new_c, new_h), new_h

  @staticmethod
  def _module_marker(next_fun, args, kwargs, context):
    return _marked(R.MODULE_KIND, "/".join(context.module.path), next_fun, args, kwargs)

  # ------------------------------------------------------------------ checks and reports

  def _call(self, method: str, args, kwargs, *, marked: bool = False, seen=None):
    fn = getattr(self.model, method)
    interceptor = (self._interceptor if seen is None
                   else functools.partial(self._interceptor, seen=seen))
    if marked:  # module markers outermost, so every module call is attributed
      with nn.intercept_methods(self._module_marker), nn.intercept_methods(interceptor):
        return fn(*args, **kwargs)
    with nn.intercept_methods(interceptor):
      return fn(*args, **kwargs)

  def _check_patterns(self, handled, method, args, kwargs, report=None):
    """Check the patterns against the ``handled`` module paths of a completed call; if one
    matches none of them, against the paths of every matmul of the call too (``report``, or
    one marked trace of ``method(*args, **kwargs)``), then raise or mark them checked."""
    paths = list(handled)
    if unmatched_patterns(paths, self.include, self.exclude, self.rules):
      if report is None:
        report = self._report([R.trace(
            lambda a, k: self._call(method, a, k, marked=True), args, kwargs)])
      paths += [op.path for op in report]
      check_patterns(paths, self.include, self.exclude, self.rules)
    self._patterns_checked = True

  def _run(self, method: str, args, kwargs):
    self._check_strict(method, args, kwargs)
    seen = None if self._patterns_checked else []
    out = self._call(method, args, kwargs, seen=seen)
    if seen is not None:
      self._check_patterns(seen, method, args, kwargs)
    return out

  def _report(self, jaxprs) -> R.MatmulReport:
    return R.build_report(jaxprs, self.plan.resolve, self.plan.path_excluded)

  def _check_strict(self, method: str, args, kwargs):
    if not self.strict:
      return
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dyn = [i for i, x in enumerate(leaves) if R.is_array(x)]
    static = tuple(x for i, x in enumerate(leaves) if i not in set(dyn))
    sig = (method, tree, tuple((leaves[i].shape, str(leaves[i].dtype)) for i in dyn))
    try:
      sig = (sig, static)
      hash(sig)
    except TypeError:
      sig = None
    if sig is not None and sig in self._strict_checked:
      return
    jaxpr = R.trace(lambda a, k: self._call(method, a, k, marked=True), args, kwargs)
    missing = self._report([jaxpr]).unquantized_ops()
    if missing:
      raise R.strict_error(missing, f"{type(self.model).__name__}.{method}")
    if sig is not None:
      self._strict_checked.add(sig)

  def matmul_report(self, variables, *args, loss_fn=None, **kwargs) -> R.MatmulReport:
    """Every matmul of ``apply(variables, *args, **kwargs)`` -- and, with ``loss_fn``, of the
    loss + gradient (w.r.t. ``variables["params"]``) step -- with its kind, direction, shapes
    and the policy it got, or ``"unquantized"`` for a raw FP32 matmul jaxlp did not wrap
    (traced with ``jax.make_jaxpr``; nothing is computed).

    Args:
      variables: the model's variables.
      *args: ``apply``'s positional inputs.
      loss_fn: optional ``loss_fn(outputs) -> scalar``; then the step is
        ``jax.grad(lambda p: loss_fn(apply({..., "params": p}, *args, **kwargs)))``.
      **kwargs: ``apply``'s keywords (``rngs``, ``mutable``, ``deterministic``...); a
        stochastic policy's rng stream gets a fixed key when missing.

    Returns:
      A :class:`jaxlp.flax.MatmulReport`.

    Raises:
      ValueError: ``loss_fn`` is given but ``variables`` has no ``"params"``; a pattern that
        matches no module with a matmul (as ``apply``, if not checked yet).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jaxlp
      >>> from jaxlp.formats import BF16
      >>> from jaxlp.flax.models import MLP
      >>> qm = jaxlp.flax.quantize_model(MLP(features=(4, 2)), jaxlp.float_policy(BF16),
      ...                                exclude="Dense_1")
      >>> x = jnp.ones((8, 3))
      >>> r = qm.matmul_report(qm.init(jax.random.key(0), x), x, loss_fn=jnp.sum)
      >>> [(op.path, op.direction, op.status) for op in r]  # doctest: +NORMALIZE_WHITESPACE
      [('Dense_0', 'fwd', 'quantized'), ('Dense_1', 'fwd', 'excluded'),
       ('Dense_1', 'drhs', 'excluded'), ('Dense_1', 'dlhs', 'excluded'),
       ('Dense_0', 'dlhs', 'quantized'), ('Dense_0', 'drhs', 'quantized')]
      >>> # (jaxlp's backward pass forms Dense_0's dlhs too, although x needs no gradient;
      >>> # XLA removes it when compiling)
    """
    kwargs = dict(kwargs)
    if any(p.stochastic for p in self.plan.policies()):
      rngs = dict(kwargs.get("rngs") or {})
      rngs.setdefault(self.rng_stream, jax.random.key(0))
      kwargs["rngs"] = rngs

    seen = None if self._patterns_checked else []

    def fwd(v, a, k):
      return self._call("apply", (v, *a), k, marked=True, seen=seen)

    if loss_fn is None:
      jaxpr = R.trace(lambda a, k: fwd(*a, k), (variables, args), kwargs)
      return self._checked_report(jaxpr, seen)
    if "params" not in variables:
      raise ValueError("matmul_report: loss_fn needs variables with a 'params' collection, "
                       f"got {list(variables)}")

    def step(a, k):
      v, inputs = a

      def loss(p):
        return loss_fn(fwd({**v, "params": p}, inputs, k))

      return jax.grad(loss)(v["params"])

    return self._checked_report(R.trace(step, (variables, args), kwargs), seen)

  def _checked_report(self, jaxpr, seen):
    report = self._report([jaxpr])
    if seen is not None:
      self._check_patterns(seen, None, None, None, report=report)
    return report

  def quantized_paths(self, *args, **kwargs) -> list[str]:
    """The '/'-joined paths of the modules with at least one matmul that gets a policy on
    ``init(*args, **kwargs)`` (layers -- Dense, attention, Embed.attend, cells... -- each
    once, in call order; not the matmuls: see :meth:`matmul_report`).

    Raises:
      ValueError: a pattern that matches no module with a matmul (as ``init``)."""
    paths, handled = [], []

    def spy(next_fun, a, kw, context):
      m = context.module
      kinds = _handled(m, context.method_name)
      if kinds is not None:
        path = "/".join(m.path)
        handled.append(path)
        if path not in paths and any(self.plan.resolve(path, k)[0] is not None
                                     for k in kinds[1]):
          paths.append(path)
      return next_fun(*a, **kw)

    with nn.intercept_methods(spy):
      jax.eval_shape(lambda: self.model.init(*args, **kwargs))
    self._check_patterns(handled, "init", args, kwargs)
    return paths

  def init(self, *args, **kwargs):
    return self._run("init", args, kwargs)

  def init_with_output(self, *args, **kwargs):
    return self._run("init_with_output", args, kwargs)

  def apply(self, variables, *args, **kwargs):
    return self._run("apply", (variables, *args), kwargs)

  def __getattr__(self, name: str) -> Any:
    if name == "model":
      raise AttributeError(name)
    return getattr(self.model, name)

  def __repr__(self):
    return (f"QuantizedModel({type(self.model).__name__}, policy={self.policy}, "
            f"include={self.include}, exclude={self.exclude}, rules={self.rules})")


def quantize_model(model: nn.Module, policy, *, include=None, exclude=None, rules=(),
                   strict: bool = False, rng_stream: str = "quantize") -> QuantizedModel:
  """Quantize the matmuls of a linen model (see :class:`QuantizedModel` for what is covered).

  Args:
    model: an unbound linen module (its code is not modified).
    policy: a :class:`jaxlp.DotPolicy`, or ``{kind: DotPolicy | None}`` over
      :data:`jaxlp.flax.MATMUL_KINDS` and ``"default"``.
    include: glob pattern(s) on '/'-joined module paths (e.g. ``"ResNet_0/*"``); None = all.
    exclude: glob pattern(s) of modules left in FP32 (e.g. ``("Conv_0", "Dense_0")`` for the
      usual first/last layer exclusion).
    rules: ``[(pattern, policy_or_mapping), ...]`` per module path, before ``policy``.
    strict: refuse a model with a matmul jaxlp does not wrap (see :class:`QuantizedModel`).
    rng_stream: the rng stream stochastic rounding keys come from.

  Returns:
    The :class:`QuantizedModel` wrapping ``model``.

  Raises:
    TypeError: as :class:`QuantizedModel` (not a linen module, not a ``DotPolicy`` or
      mapping, bad patterns or rules).
    ValueError: an unknown kind.

  A pattern that matches no module with a matmul (e.g. ``exclude="Dense_l"`` for
  ``"Dense_1"``) is a ``ValueError`` listing the paths; linen builds its modules only when
  the model runs, so it is raised by the first ``init`` / ``apply`` (or ``quantized_paths``,
  ``matmul_report``) that completes, not here.

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
  return QuantizedModel(model, policy, include=include, exclude=exclude, rules=rules,
                        strict=strict, rng_stream=rng_stream)

