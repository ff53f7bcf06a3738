"""Quantizing an existing Flax nnx model without editing its code (attribute injection)."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlp.flax import _report as R
from jaxlp.flax._attention import dot_product_attention
from jaxlp.flax._plan import ATTENTION, Plan
from jaxlp.flax._select import check_patterns, unmatched_patterns
from jaxlp.ops._conv import conv_general_dilated
from jaxlp.ops._dot_general import dot_general
from jaxlp.ops._policy import DotPolicy

__all__ = ["StochasticOp", "matmul_report", "quantize_model"]

_PLAN_ATTR = "_jaxlp_plan"


class StochasticOp(nnx.Module):
  """An nnx callable with a lax dot_general / conv signature that draws a fresh key from
  ``rngs[stream]`` on every call (stochastic-rounding policies in nnx).

  :func:`quantize_model` installs these on the layers for stochastic policies.

  Args:
    kind: ``"conv"`` for ``jaxlp.conv_general_dilated(policy)``, ``"einsum"`` for
      ``jnp.einsum`` with ``jaxlp.dot_general(policy)`` as its dot_general, anything else
      for ``jaxlp.dot_general(policy)``.
    policy: the :class:`jaxlp.DotPolicy`.
    rngs: an ``nnx.Rngs`` with the stream ``stream``.
    stream: the stream name.
    scope: optional ``jax.named_scope`` name for the op (``"jaxlp:<kind>:<path>"`` from
      :func:`quantize_model`, which matmul reports read).
    source: where the policy came from (shown by matmul reports).

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

  def __init__(self, kind: str, policy: DotPolicy, rngs: nnx.Rngs, stream: str = "quantize",
               *, scope: str | None = None, source: str = ""):
    self.kind = kind
    self.policy = policy
    self.rngs = rngs
    self.stream = stream
    self.scope = scope
    self.source = source

  def _run(self, *args, **kwargs):
    key = self.rngs[self.stream]()
    if self.kind == "einsum":
      return jnp.einsum(*args, _dot_general=dot_general(self.policy, key=key), **kwargs)
    make = conv_general_dilated if self.kind == "conv" else dot_general
    return make(self.policy, key=key)(*args, **kwargs)

  def __call__(self, *args, **kwargs):
    if self.scope is None:
      return self._run(*args, **kwargs)
    with jax.named_scope(self.scope):
      return self._run(*args, **kwargs)

  def _keyed(self):
    """A :class:`TaggedOp` with a key drawn now (for a call inside ``jnp.einsum``'s jit,
    where the rng counter cannot be updated)."""
    kind, path = R.parse_marker(self.scope) if self.scope else ("", "")
    return R.TaggedOp("dot", kind, path, self.policy, self.source,
                      key=self.rngs[self.stream]())


class _EinsumOp:
  """``einsum_op`` of an nnx ``Einsum``: ``jnp.einsum`` with a tagged dot_general (equal and
  hashable by value: a static attribute)."""

  def __init__(self, dot):
    self.dot = dot

  def __call__(self, *args, **kwargs):
    return jnp.einsum(*args, _dot_general=self.dot, **kwargs)

  def __eq__(self, other):
    return isinstance(other, _EinsumOp) and self.dot == other.dot

  def __hash__(self):
    return hash(("einsum", self.dot))


class _AttentionFn:
  """``attention_fn`` of an nnx ``MultiHeadAttention``: :func:`dot_product_attention` with
  the two tagged dot_generals (static; hashable by value)."""

  def __init__(self, qk, pv):
    self.qk, self.pv = qk, pv

  def __call__(self, *args, **kwargs):
    return dot_product_attention(*args, qk_dot_general=self.qk, pv_dot_general=self.pv,
                                 **kwargs)

  def __eq__(self, other):
    return type(other) is type(self) and (self.qk, self.pv) == (other.qk, other.pv)

  def __hash__(self):
    return hash((self.qk, self.pv))


class _StochasticAttentionFn(nnx.Module):
  """``attention_fn`` with at least one :class:`StochasticOp` (a graph node: its rng
  counter is model state)."""

  def __init__(self, qk, pv):
    self.qk = nnx.data(qk) if isinstance(qk, nnx.Module) else qk
    self.pv = nnx.data(pv) if isinstance(pv, nnx.Module) else pv

  def __call__(self, *args, **kwargs):
    qk, pv = (op._keyed() if isinstance(op, StochasticOp) else op for op in (self.qk, self.pv))
    return dot_product_attention(*args, qk_dot_general=qk, pv_dot_general=pv, **kwargs)


class _FlaxAttentionFn:
  """Flax's own ``attention_fn`` run under an ``"attention"`` scope (both attention kinds
  left in FP32: reports count them as excluded)."""

  def __init__(self, orig, path):
    self.orig, self.path = orig, path

  def __call__(self, *args, **kwargs):
    with jax.named_scope(R.marker(ATTENTION, self.path)):
      return self.orig(*args, **kwargs)

  def __eq__(self, other):
    return type(other) is type(self) and (self.orig, self.path) == (other.orig, other.path)

  def __hash__(self):
    return hash((self.orig, self.path))


def _attend(self, query, out_sharding=None):
  """``flax.nnx.Embed.attend`` (``jnp.dot(query, embedding.T)``) through ``jaxlp_attend``."""
  del out_sharding  # jaxlp's ops run unsharded-aware lax ops inside
  query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
  return self.jaxlp_attend(query, embedding.T, (((query.ndim - 1,), (0,)), ((), ())))


@functools.cache
def _attend_class(cls):
  """A subclass of the Embed class ``cls`` whose ``attend`` goes through jaxlp."""
  return types.new_class(cls.__name__, (cls,), {},
                         lambda ns: ns.update(attend=_attend, __module__=__name__,
                                              __qualname__=cls.__qualname__))


def _wraps(node) -> bool:
  """True for a module with a matmul :func:`quantize_model` wraps (the cases it installs)."""
  return (isinstance(node, nnx.Linear | nnx.Conv)
          or (isinstance(node, nnx.LinearGeneral) and node.dot_general_cls is None)
          or (isinstance(node, nnx.Einsum) and node.einsum_op is jnp.einsum)
          or (isinstance(node, nnx.MultiHeadAttention)
              and node.attention_fn is nnx.dot_product_attention)
          or (isinstance(node, nnx.Embed) and type(node).attend is nnx.Embed.attend))


def _parent_is_cell(nodes, path):
  return len(path) > 0 and isinstance(nodes.get(path[:-1]), nnx.RNNCellBase)


def quantize_model(model: nnx.Module, policy, *, include=None, exclude=None, rules=(),
                   strict: bool = False, example_args=None, rngs: nnx.Rngs | None = None,
                   rng_stream: str = "quantize", copy: bool = True) -> nnx.Module:
  """Quantize the matmuls of an nnx model.

  Walks the graph and installs the policies' ops (the '/'-joined graph path of each module
  is what patterns match):

  * ``Linear`` / ``LinearGeneral`` (kind ``"dense"``; ``"recurrent"`` inside an RNN cell:
    ``LSTMCell``, ``OptimizedLSTMCell``, ``GRUCell``, ``SimpleCell``): their
    ``dot_general``; ``Conv`` (``"conv"``): its ``conv_general_dilated``; ``Einsum``
    (``"einsum"``): its ``einsum_op``.
  * ``MultiHeadAttention`` with Flax's default ``attention_fn``: the logits q.k
    (``"attention_qk"``) and the weighted values p.v (``"attention_pv"``) through an
    ``attention_fn`` that computes Flax's documented dot-product attention (einsum path:
    scaled query, mask, softmax in the input dtype, dropout) with the two matmuls through
    jaxlp. Its q/k/v/out projections are ``LinearGeneral`` (``"dense"``). With both
    attention kinds in FP32 Flax's own function is kept. Without dropout Flax's function takes
    ``jax.nn.dot_product_attention`` (the logits scaled after the matmul), so even
    ``DotPolicy()`` differs from the plain nnx model there by float32 rounding (up to 3.6e-7
    on a 4-head, width-32 layer), while it equals Flax's einsum path bit for bit.
  * ``Embed.attend`` (``"embed_attend"``, tied output logits): the module's class becomes a
    subclass whose ``attend`` does ``query @ embedding.T`` through jaxlp.

  Softmax, normalisation, biases and the residual stream stay in FP32; so does any other
  matmul (a raw ``jnp.einsum`` / ``@`` in a module, ``ConvTranspose``, ``LoRA``, a custom
  ``attention_fn``): :func:`matmul_report` lists every matmul of a step with what it got,
  and ``strict=True`` refuses such a model.

  Args:
    model: an nnx module.
    policy: a :class:`jaxlp.DotPolicy` for every kind, or ``{kind: DotPolicy | None}`` over
      :data:`jaxlp.flax.MATMUL_KINDS` and ``"default"`` (None = FP32; an unlisted kind takes
      ``"default"``, and stays FP32 without one).
    include, exclude: glob pattern(s) on '/'-joined graph paths (e.g. ``"layers/0"``).
    rules: ``[(pattern, policy_or_mapping), ...]`` per path, before ``policy`` (see
      :func:`jaxlp.flax.quantize_model`).
    strict: refuse (``ValueError`` naming each one) a model with a matmul jaxlp does not
      wrap outside the excluded paths, found by tracing ``model(*example_args)``.
    example_args: the positional inputs of one forward call (needed by ``strict``, and by a
      pattern that names only a module with a matmul jaxlp does not wrap).
    rngs: required for stochastic policies: an ``nnx.Rngs`` with stream ``rng_stream``; each
      layer call draws a fresh key from it (its counter is model state).
    rng_stream: the stream name.
    copy: return a quantized clone (default; same weight values) instead of editing
      ``model`` in place.

  Returns:
    The quantized model.

  Raises:
    TypeError: ``policy`` is not a :class:`jaxlp.DotPolicy` or a mapping of them,
      ``include`` / ``exclude`` is not a str or a sequence of str, a malformed rule, or
      ``strict=True`` without ``example_args``.
    ValueError: an unknown kind; a stochastic policy and ``rngs`` is None; an ``include`` /
      ``exclude`` / ``rules`` pattern that matches no path of a module with a matmul: one
      jaxlp wraps or, found by tracing ``example_args`` when given, one with a matmul it does
      not wrap (the message lists the paths; see :func:`jaxlp.flax.quantize_model`); these
      are raised before ``model`` is changed. (``strict``) a matmul jaxlp does not wrap.

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
    >>> qmodel.layers[2].dot_general.policy is None  # excluded: lax's op, tagged for reports
    True
    >>> model.layers[0].dot_general is jax.lax.dot_general  # copy=True: model untouched
    True
    >>> qmodel(jnp.ones((1, 3))).shape
    (1, 2)
  """
  plan = Plan.make(policy, include=include, exclude=exclude, rules=rules)
  if strict and example_args is None:
    raise TypeError("quantize_model(strict=True) on an nnx model needs example_args=(...): "
                    "the inputs of one forward call, to trace")
  if copy:
    model = nnx.clone(model)

  graph = list(nnx.iter_graph(model))
  nodes = {tuple(path): node for path, node in graph}
  stochastic_unkeyed = []

  def op(kind, path, opname="dot", base=None):
    pol, src = plan.resolve(path, kind)
    if pol is not None and pol.stochastic:
      if rngs is None:
        stochastic_unkeyed.append(path or "<root>")
        return None
      return nnx.data(StochasticOp(opname, pol, rngs, rng_stream,
                                   scope=R.marker(kind, path), source=src))
    tagged = R.TaggedOp("dot" if opname == "einsum" else opname, kind, path, pol, src,
                        base=base if pol is None else None)
    return _EinsumOp(tagged) if opname == "einsum" else tagged

  installs, handled = [], []
  for path, node in graph:
    if not isinstance(node, nnx.Module):
      continue
    p = "/".join(str(k) for k in path)
    cell = _parent_is_cell(nodes, tuple(path))
    if _wraps(node):
      handled.append(p)
    if isinstance(node, nnx.Linear):
      installs.append((node, "dot_general",
                       op("recurrent" if cell else "dense", p, base=node.dot_general)))
    elif isinstance(node, nnx.LinearGeneral) and node.dot_general_cls is None:
      installs.append((node, "dot_general", op("recurrent" if cell else "dense", p,
                                               base=node.dot_general)))
    elif isinstance(node, nnx.Conv):
      installs.append((node, "conv_general_dilated",
                       op("recurrent" if cell else "conv", p, "conv",
                          base=node.conv_general_dilated)))
    elif isinstance(node, nnx.Einsum) and node.einsum_op is jnp.einsum:
      installs.append((node, "einsum_op", op("einsum", p, "einsum")))
    elif (isinstance(node, nnx.MultiHeadAttention)
          and node.attention_fn is nnx.dot_product_attention):
      qk, pv = op("attention_qk", p), op("attention_pv", p)
      if qk is None or pv is None:
        continue
      if isinstance(qk, R.TaggedOp) and isinstance(pv, R.TaggedOp):
        fn = (_FlaxAttentionFn(node.attention_fn, p)
              if qk.policy is None and pv.policy is None else _AttentionFn(qk, pv))
      else:
        fn = nnx.data(_StochasticAttentionFn(qk, pv))
      installs.append((node, "attention_fn", fn))
    if isinstance(node, nnx.Embed) and type(node).attend is nnx.Embed.attend:
      installs.append((node, "jaxlp_attend", op("embed_attend", p)))
  if unmatched_patterns(handled, plan.include, plan.exclude, plan.rules):
    # a pattern may name a module with a matmul jaxlp does not wrap: only a trace finds those
    traced = ([] if example_args is None
              else [o.path for o in matmul_report(model, *example_args)])
    check_patterns(handled + traced, plan.include, plan.exclude, plan.rules,
                   note="" if example_args is not None else
                   " (a module with a matmul jaxlp does not wrap is found only by tracing: "
                   "pass example_args=(...) to name one)")
  if stochastic_unkeyed:
    raise ValueError("quantize_model: the policy uses stochastic rounding (at "
                     f"{stochastic_unkeyed[:3]}): pass rngs=nnx.Rngs({rng_stream}=...)")
  for node, attr, value in installs:
    if attr == "jaxlp_attend":
      object.__setattr__(node, "__class__", _attend_class(type(node)))
    setattr(node, attr, value)
    if attr == "dot_general" and isinstance(node, nnx.LinearGeneral):
      node.dot_general_cls = None
  setattr(model, _PLAN_ATTR, plan)
  if strict:
    missing = matmul_report(model, *example_args).unquantized_ops()
    if missing:
      raise R.strict_error(missing, f"{type(model).__name__}(*example_args)")
  return model


def _tagged_ops(model):
  """``{(kind, path): (policy, source)}`` of the ops :func:`quantize_model` installed, and the
  plans of the quantized subtrees (``[(path prefix, Plan)]``)."""
  table, plans = {}, []
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module):
      continue
    prefix = "/".join(str(k) for k in path)
    plan = vars(node).get(_PLAN_ATTR)
    if plan is not None:
      plans.append((prefix, plan))
    for attr in ("dot_general", "conv_general_dilated", "einsum_op", "attention_fn",
                 "jaxlp_attend"):
      value = vars(node).get(attr)
      for op in (value, getattr(value, "dot", None), getattr(value, "qk", None),
                 getattr(value, "pv", None)):
        if isinstance(op, R.TaggedOp):
          table[(op.kind, op.path)] = (op.policy, op.source)
        elif isinstance(op, StochasticOp) and op.scope is not None:
          table[R.parse_marker(op.scope)] = (op.policy, op.source)
      if isinstance(value, _FlaxAttentionFn):
        table[(ATTENTION, value.path)] = (None, "policy")
  return table, plans


def _scoped(method, name):
  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    with jax.named_scope(name):
      return method(self, *args, **kwargs)

  return wrapped


def _mark_modules(model):
  """Give every module of ``model`` (a clone) a class whose ``__call__`` (and ``attend``) runs
  under its module marker, so matmuls jaxlp did not wrap are attributed to a path."""
  for path, node in list(nnx.iter_graph(model)):
    if not isinstance(node, nnx.Module):
      continue
    cls = type(node)
    name = R.marker(R.MODULE_KIND, "/".join(str(k) for k in path))
    methods = {meth: _scoped(getattr(cls, meth), name) for meth in ("__call__", "attend")
               if callable(getattr(cls, meth, None))}
    if methods:
      sub = types.new_class(cls.__name__, (cls,), {}, lambda ns, m=methods: ns.update(m))
      object.__setattr__(node, "__class__", sub)


def matmul_report(model: nnx.Module, *args, loss_fn=None, **kwargs) -> R.MatmulReport:
  """Every matmul of ``model(*args, **kwargs)`` -- and, with ``loss_fn``, of the loss +
  gradient (w.r.t. the ``nnx.Param`` s) step -- with its kind, direction, shapes and the
  policy it got, or ``"unquantized"`` for a raw FP32 matmul jaxlp did not wrap (traced with
  ``jax.make_jaxpr`` on a clone; nothing is computed, ``model`` is not changed).

  Args:
    model: an nnx module (quantized by :func:`quantize_model`, or not).
    *args: the call's positional inputs (arrays or ``jax.ShapeDtypeStruct``).
    loss_fn: optional ``loss_fn(outputs) -> scalar``.
    **kwargs: the call's keywords.

  Returns:
    A :class:`jaxlp.flax.MatmulReport`.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from flax import nnx
    >>> from jaxlp.formats import BF16
    >>> from jaxlp.flax.nnx import matmul_report, quantize_model
    >>> mha = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
    >>> q = quantize_model(mha, {"dense": None, "attention_qk": jaxlp.float_policy(BF16)})
    >>> r = matmul_report(q, jnp.ones((1, 4, 8)))
    >>> [(op.path, op.kind, op.status) for op in r]  # doctest: +NORMALIZE_WHITESPACE
    [('query', 'dense', 'excluded'), ('key', 'dense', 'excluded'),
     ('value', 'dense', 'excluded'), ('', 'attention_qk', 'quantized'),
     ('', 'attention_pv', 'excluded'), ('out', 'dense', 'excluded')]
  """
  table, plans = _tagged_ops(model)
  clone = nnx.clone(model)
  _mark_modules(clone)
  graphdef, state = nnx.split(clone)

  def step(a, k):
    m = nnx.merge(graphdef, a[0])
    if loss_fn is None:
      return m(*a[1:], **k)
    return nnx.grad(lambda m: loss_fn(m(*a[1:], **k)))(m)

  jaxpr = R.trace(step, (state, *args), kwargs)

  def resolve(path, kind):
    return table.get((kind, path), (None, "?"))

  def path_excluded(path):
    best = None
    for prefix, plan in plans:
      if prefix == "" or path == prefix or path.startswith(prefix + "/"):
        if best is None or len(prefix) > len(best[0]):
          best = (prefix, plan)
    if best is None:
      return False
    rel = path[len(best[0]):].lstrip("/") if best[0] else path
    return best[1].path_excluded(rel)

  return R.build_report([jaxpr], resolve, path_excluded)
