"""Tagging the matmuls jaxlp installs, and the census of every matmul in a traced step.

Every matmul :func:`jaxlp.flax.quantize_model` installs (quantized or deliberately left in
FP32) runs under ``jax.named_scope("jaxlp:<kind>:<path>")``. Named scopes are recorded in each
jaxpr equation's ``source_info.name_stack`` (relative to the enclosing equation for
sub-jaxprs) and survive ``custom_vjp`` forward and backward passes, ``jit``, ``scan`` and
``remat``; backward-pass equations carry a ``transpose`` transform in their name stack. While a
report is traced, every module call also runs under ``jaxlp:module:<path>``, so a matmul jaxlp
did not wrap is attributed to the innermost module that performed it.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any

import jax
import jax.extend as jex
import numpy as np
from jax import lax

from jaxlp.ops._conv import conv_general_dilated
from jaxlp.ops._dot_general import dot_general

OP_PREFIX = "jaxlp:"
MODULE_KIND = "module"
PRIMITIVES = ("dot_general", "conv_general_dilated")
STATUSES = ("quantized", "excluded", "unquantized")
_JAXLP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def marker(kind: str, path: str) -> str:
  """The named-scope name of the matmuls of ``kind`` performed by the module at ``path``."""
  return f"{OP_PREFIX}{kind}:{path}"


def parse_marker(name: str):
  """``(kind, path)`` of a jaxlp scope name, else None."""
  if not name.startswith(OP_PREFIX):
    return None
  kind, sep, path = name[len(OP_PREFIX):].partition(":")
  return (kind, path) if sep else None


class TaggedOp:
  """A ``lax.dot_general`` / ``lax.conv_general_dilated`` stand-in that runs ``base`` (the
  policy's jaxlp op, or the layer's own op for a matmul left in FP32) under the matmul's
  named scope. Equal and hashable by value when it holds no key (static jit arguments, nnx
  graph definitions and ``jnp.einsum``'s cache see the same op for the same configuration).

  Attributes:
    op: ``"dot"`` or ``"conv"``.
    kind, path: what the scope names.
    policy: the :class:`DotPolicy`, or None (FP32).
    source: where the policy came from (``"policy['dense']"``, ``"rules[0]"``...).
  """

  def __init__(self, op: str, kind: str, path: str, policy, source: str = "", *, key=None,
               base=None):
    self.op, self.kind, self.path, self.policy, self.source = op, kind, path, policy, source
    self.key, self.base = key, base

  def _fn(self):
    if self.policy is None:
      if self.base is not None:
        return self.base
      return lax.conv_general_dilated if self.op == "conv" else lax.dot_general
    make = conv_general_dilated if self.op == "conv" else dot_general
    return make(self.policy, key=self.key)

  def __call__(self, *args, **kwargs):
    with jax.named_scope(marker(self.kind, self.path)):
      return self._fn()(*args, **kwargs)

  def _id(self):
    return (self.op, self.kind, self.path, self.policy, self.source, self.base)

  def __eq__(self, other):
    if self.key is not None or not isinstance(other, TaggedOp) or other.key is not None:
      return self is other
    return self._id() == other._id()

  def __hash__(self):
    return id(self) if self.key is not None else hash(self._id())

  def __repr__(self):
    return f"TaggedOp({self.op!r}, kind={self.kind!r}, path={self.path!r}, policy={self.policy})"


@dataclasses.dataclass(frozen=True)
class MatmulOp:
  """One ``dot_general`` or ``conv_general_dilated`` equation of a traced step.

  Attributes:
    primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
    path: '/'-joined path of the module that performs it (``""`` = the root module; None =
      not known).
    kind: one of :data:`jaxlp.flax.MATMUL_KINDS` (``"attention"`` for an nnx attention left
      to Flax), or None for a matmul jaxlp did not wrap.
    direction: ``"fwd"``, ``"dlhs"`` (gradient of the left operand), ``"drhs"`` (of the
      right operand), or ``"bwd"`` where the two cannot be told apart.
    lhs_shape, rhs_shape, out_shape: the equation's operand and result shapes.
    status: ``"quantized"`` (a non-identity policy), ``"excluded"`` (left in FP32 by the
      user's choice: include/exclude, a None policy or ``DotPolicy()``) or ``"unquantized"``
      (a raw FP32 matmul jaxlp did not wrap).
    policy: the :class:`jaxlp.DotPolicy` (None unless quantized or an identity policy).
    source: where the policy came from (``"policy['dense']"``, ``"rules[1]"``, ...).
    where: the user source line the equation was traced from (``file:line (function)``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jaxlp
    >>> from jaxlp.formats import E4M3
    >>> qm = jaxlp.flax.quantize_model(nn.Dense(2), jaxlp.float_policy(E4M3))
    >>> x = jnp.ones((1, 3))
    >>> (op,) = qm.matmul_report(qm.init(jax.random.key(0), x), x)
    >>> op.path, op.kind, op.direction, op.lhs_shape, op.rhs_shape, op.status
    ('', 'dense', 'fwd', (1, 3), (3, 2), 'quantized')
    >>> op.policy.lhs.fmt, op.source
    (jaxlp.formats.E4M3, 'policy')
  """

  primitive: str
  path: str | None
  kind: str | None
  direction: str
  lhs_shape: tuple
  rhs_shape: tuple
  out_shape: tuple
  status: str
  policy: Any = None
  source: str = ""
  where: str = ""


class MatmulReport:
  """Every matmul of one traced forward pass or training step, and what jaxlp did with it.

  Built by :meth:`jaxlp.flax.QuantizedModel.matmul_report` and
  :func:`jaxlp.flax.matmul_report`. ``len(report)`` is the number of ``dot_general`` and
  ``conv_general_dilated`` equations in the step's jaxpr, counted through every sub-jaxpr
  (``jit``, ``custom_vjp``, ``scan``, ``remat``, ``cond``...), each once.

  Attributes:
    ops: the :class:`MatmulOp` list, in jaxpr order.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jaxlp
    >>> from jaxlp.formats import BF16
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     x = nn.Dense(4)(x)
    ...     return jnp.einsum("bd,bd->b", x, x)  # a raw matmul jaxlp cannot see into
    >>> qm = jaxlp.flax.quantize_model(Net(), jaxlp.float_policy(BF16))
    >>> x = jnp.ones((2, 3))
    >>> report = qm.matmul_report(qm.init(jax.random.key(0), x), x)
    >>> len(report), report.count(status="quantized")
    (2, 1)
    >>> [(op.path, op.kind) for op in report.unquantized_ops()]
    [('', None)]
  """

  def __init__(self, ops):
    self.ops = tuple(ops)

  def __len__(self):
    return len(self.ops)

  def __iter__(self):
    return iter(self.ops)

  def count(self, **where) -> int:
    """The number of ops whose attributes equal ``where`` (e.g. ``kind="attention_qk"``,
    ``direction="fwd"``, ``status="quantized"``)."""
    for name in where:
      if name not in MatmulOp.__dataclass_fields__:
        raise TypeError(f"MatmulReport.count: unknown field {name!r}")
    return sum(all(getattr(op, k) == v for k, v in where.items()) for op in self.ops)

  def unquantized_ops(self) -> list[MatmulOp]:
    """The matmuls that run in FP32 because jaxlp did not wrap them (status
    ``"unquantized"``); the ones the user left in FP32 are ``excluded_ops()``."""
    return [op for op in self.ops if op.status == "unquantized"]

  def excluded_ops(self) -> list[MatmulOp]:
    """The matmuls left in FP32 by the user's choice (status ``"excluded"``)."""
    return [op for op in self.ops if op.status == "excluded"]

  def summary(self) -> dict:
    """``{(kind, direction, status): count}`` (kind None = not wrapped)."""
    return dict(Counter((op.kind, op.direction, op.status) for op in self.ops))

  def __str__(self):
    rows = [("path", "kind", "dir", "lhs x rhs -> out", "status", "policy from")]
    for op in self.ops:
      shapes = f"{op.lhs_shape} x {op.rhs_shape} -> {op.out_shape}"
      path = "?" if op.path is None else op.path or "(root)"
      rows.append((path, op.kind or "-", op.direction,
                   shapes, op.status, op.source or op.where))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1]
             for r in rows]
    c = Counter(op.status for op in self.ops)
    lines.append(f"{len(self.ops)} matmuls: " + ", ".join(f"{c[s]} {s}" for s in STATUSES))
    return "\n".join(lines)

  def __repr__(self):
    c = Counter(op.status for op in self.ops)
    return (f"MatmulReport({len(self.ops)} matmuls: "
            + ", ".join(f"{c[s]} {s}" for s in STATUSES) + ")")


# ---------------------------------------------------------------------------- the census


def _sub_jaxprs(params):
  for v in params.values():
    for sub in (v if isinstance(v, tuple | list) else (v,)):
      if isinstance(sub, jex.core.ClosedJaxpr):
        yield sub.jaxpr
      elif isinstance(sub, jex.core.Jaxpr):
        yield sub


def _where(source_info) -> str:
  try:
    from jax._src import source_info_util as siu  # noqa: PLC0415  (no public equivalent)
    for frame in siu.user_frames(source_info.traceback):
      if not os.path.abspath(frame.file_name).startswith(_JAXLP_DIR + os.sep):
        return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
  except Exception:  # pragma: no cover - a JAX without the private module
    pass
  return ""


@dataclasses.dataclass
class _Eqn:
  primitive: str
  stack: tuple  # (("scope"|"transform", name), ...) outermost first
  shapes: tuple
  where: str
  order: int


def _stack(eqn) -> tuple:
  out = []
  for el in getattr(eqn.source_info.name_stack, "stack", ()):
    out.append(("transform" if type(el).__name__ == "Transform" else "scope", el.name))
  return tuple(out)


def census(jaxpr) -> list[_Eqn]:
  """Every dot_general / conv_general_dilated equation of ``jaxpr`` (a ClosedJaxpr or Jaxpr),
  recursively, with its full name stack."""
  found: list[_Eqn] = []

  def walk(jp, prefix):
    for eqn in jp.eqns:
      stack = prefix + _stack(eqn)
      if eqn.primitive.name in PRIMITIVES:
        shapes = tuple(tuple(v.aval.shape) for v in eqn.invars[:2]) + (
            tuple(eqn.outvars[0].aval.shape),)
        found.append(_Eqn(eqn.primitive.name, stack, shapes, "", len(found)))
        found[-1].where = _where(eqn.source_info)
      for sub in _sub_jaxprs(eqn.params):
        walk(sub, stack)

  walk(jaxpr.jaxpr if isinstance(jaxpr, jex.core.ClosedJaxpr) else jaxpr, ())
  return found


def _identity(e: _Eqn):
  """(kind, path) from the innermost jaxlp op scope, else (None, innermost module path)."""
  module = None
  for typ, name in reversed(e.stack):
    if typ != "scope":
      continue
    parsed = parse_marker(name)
    if parsed is None:
      continue
    kind, path = parsed
    if kind != MODULE_KIND:
      return kind, path
    if module is None:
      module = path
  return None, module


def _dims(shape):
  return tuple(sorted(shape))


def _directions(eqns, idents, jaxlp_vjp, *, by_shape: bool = True):
  """fwd / dlhs / drhs / bwd of each equation.

  An equation is backward if a ``transpose`` transform is in its name stack. The backward
  GEMMs of ``out = f(lhs, rhs)`` contract the output gradient with rhs (dlhs) or lhs (drhs):
  they are told apart by their operands' shapes (exact, else up to a permutation) against
  the forward equation of the same matmul; where lhs and rhs have the same shape (q.k),
  by their order (jaxlp's backward computes dlhs then drhs; JAX's transpose of a plain
  dot_general, drhs then dlhs). ``jaxlp_vjp(ident)`` says whether a matmul runs through
  jaxlp's custom_vjp. ``by_shape=False`` decides every backward GEMM by order (tests).
  """
  fwd_sig: dict = {}
  for e, ident in zip(eqns, idents, strict=True):
    if not any(t == "transform" and n == "transpose" for t, n in e.stack):
      fwd_sig.setdefault((ident, e.where if ident[0] is None else ""), set()).add(e.shapes)

  def labels(e, sigs, norm):
    ops = sorted((norm(e.shapes[0]), norm(e.shapes[1])))
    found = set()
    for sig in sigs:  # a module may perform several matmuls of one kind (LSTM gates)
      l, r, o = (norm(s) for s in sig)
      is_dl, is_dr = ops == sorted((o, r)), ops == sorted((l, o))
      if (is_dl and is_dr) or ((is_dl or is_dr) and not by_shape):
        found.add("ambiguous")
      elif is_dl or is_dr:
        found.add("dlhs" if is_dl else "drhs")
      elif ops == sorted((l, r)):
        found.add("fwd")  # recomputed in the backward pass (remat)
    return found

  out = []
  pending: dict = {}
  for e, ident in zip(eqns, idents, strict=True):
    if not any(t == "transform" and n == "transpose" for t, n in e.stack):
      out.append("fwd")
      continue
    key = (ident, e.where if ident[0] is None else "")
    sigs = fwd_sig.get(key, set())
    # the backward GEMMs take the output gradient and the operand as they are (exact
    # shapes); where they were transposed or reshaped first, shapes up to a permutation
    found = labels(e, sigs, tuple) or labels(e, sigs, _dims)
    label = found.pop() if len(found) == 1 else "bwd"
    out.append(label)
    if label == "ambiguous":
      pending.setdefault(key, []).append(len(out) - 1)
  for key, idx in pending.items():
    order = ("dlhs", "drhs") if jaxlp_vjp(key[0]) else ("drhs", "dlhs")
    if len(idx) % 2:
      for i in idx:
        out[i] = "bwd"
      continue
    for j, i in enumerate(idx):
      out[i] = order[j % 2]
  return out


def build_report(jaxprs, resolve, path_excluded) -> MatmulReport:
  """A :class:`MatmulReport` of the matmuls of ``jaxprs``.

  Args:
    jaxprs: ClosedJaxprs (e.g. the forward pass, or a loss+grad step).
    resolve: ``(path, kind) -> (policy or None, source)`` for jaxlp-tagged matmuls.
    path_excluded: ``path -> bool``: a matmul jaxlp did not wrap, performed by the module at
      ``path``, was left in FP32 by the user's choice.
  """

  def jaxlp_vjp(ident):
    kind, path = ident
    if kind is None:
      return False
    policy = resolve(path, kind)[0]
    return policy is not None and not policy.is_identity

  ops = []
  for jp in jaxprs:
    eqns = census(jp)
    idents = [_identity(e) for e in eqns]
    dirs = _directions(eqns, idents, jaxlp_vjp)
    for e, (kind, path), d in zip(eqns, idents, dirs, strict=True):
      lhs, rhs, out = e.shapes
      if kind is None:
        status = "excluded" if path is not None and path_excluded(path) else "unquantized"
        ops.append(MatmulOp(e.primitive, path, None, d, lhs, rhs, out, status, None, "",
                            e.where))
        continue
      policy, source = resolve(path, kind)
      status = "quantized" if policy is not None and not policy.is_identity else "excluded"
      ops.append(MatmulOp(e.primitive, path, kind, d, lhs, rhs, out, status, policy, source,
                          e.where))
  return MatmulReport(ops)


def is_array(x) -> bool:
  """Traced by :func:`trace` (arrays and ``jax.ShapeDtypeStruct``); anything else is static."""
  return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def trace(fn, args, kwargs):
  """``jax.make_jaxpr`` of ``fn(args, kwargs)`` with every array (or ShapeDtypeStruct) leaf
  abstract and everything else static (flags such as ``deterministic=True``)."""
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  dyn = [i for i, x in enumerate(leaves) if is_array(x)]

  def f(*vals):
    ls = list(leaves)
    for i, v in zip(dyn, vals, strict=True):
      ls[i] = v
    a, k = jax.tree_util.tree_unflatten(tree, ls)
    return fn(a, k)

  return jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype)
                             for i in dyn])


def strict_error(ops, what: str) -> ValueError:
  lines = [f"  {op.primitive} {op.direction} in "
           f"{'?' if op.path is None else op.path or '(root)'}: "
           f"{op.lhs_shape} x {op.rhs_shape} -> {op.out_shape} at {op.where or '?'}"
           for op in ops]
  return ValueError(
      f"quantize_model(strict=True): {len(ops)} matmul(s) of {what} would stay in FP32 "
      "because jaxlp does not wrap them (a raw jnp.einsum/jnp.dot/lax op in a module, or a "
      "Flax layer jaxlp does not know); quantize them through jaxlp.dot_general, or leave "
      "them in FP32 on purpose with exclude= or a rule whose policy is None:\n"
      + "\n".join(lines))
