"""Which policy each matmul of a model gets: kinds, path rules, include/exclude.

Shared by the linen and nnx wrappers. A matmul is identified by the '/'-joined path of the
module that performs it and its *kind* (:data:`KINDS`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

from jaxlp.flax._select import normalize_patterns, selected
from jaxlp.ops._policy import DotPolicy

#: The kinds of matmul :func:`jaxlp.flax.quantize_model` knows, in the order reports list them.
KINDS = ("dense", "conv", "einsum", "attention_qk", "attention_pv", "embed_attend", "recurrent")

#: Kind of the matmuls of an nnx attention whose ``attention_fn`` is left as Flax's (both
#: attention kinds in FP32): logits and weighted values are not told apart.
ATTENTION = "attention"


def _check_policy(value, where):
  if value is not None and not isinstance(value, DotPolicy):
    raise TypeError(f"quantize_model: {where} must be a jaxlp.DotPolicy or None, got {value!r}")


def _normalize_mapping(value, where, *, allow_none_policy: bool):
  """A DotPolicy (or None where allowed) -> itself; a mapping -> a sorted tuple of items."""
  if isinstance(value, DotPolicy) or (value is None and allow_none_policy):
    return value
  if not isinstance(value, Mapping):
    raise TypeError(
        f"quantize_model: {where} must be a jaxlp.DotPolicy"
        + (", None" if allow_none_policy else "")
        + f" or a mapping {{kind: DotPolicy | None}}, got {value!r}")
  items = []
  for k, v in value.items():
    if k != "default" and k not in KINDS:
      raise ValueError(f"quantize_model: {where} has an unknown kind {k!r}; the kinds are "
                       f"{KINDS} and 'default'")
    _check_policy(v, f"{where}[{k!r}]")
    items.append((k, v))
  return tuple(sorted(items))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The resolved configuration of :func:`jaxlp.flax.quantize_model` (frozen, hashable).

  ``policy`` is a :class:`DotPolicy` or a sorted tuple of ``(kind, DotPolicy | None)``;
  ``rules`` a tuple of ``(pattern, DotPolicy | None | sorted tuple)``.
  """

  policy: object
  include: tuple[str, ...] | None = None
  exclude: tuple[str, ...] | None = None
  rules: tuple = ()

  @classmethod
  def make(cls, policy, *, include=None, exclude=None, rules=()) -> Plan:
    """Validate the user's arguments (TypeError / ValueError naming the bad one)."""
    pol = _normalize_mapping(policy, "policy", allow_none_policy=False)
    if rules is None:
      rules = ()
    if isinstance(rules, (str, bytes)) or not hasattr(rules, "__iter__"):
      raise TypeError(f"quantize_model: rules={rules!r} must be a sequence of "
                      "(pattern, policy) pairs")
    norm = []
    for i, rule in enumerate(rules):
      if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
        raise TypeError(f"quantize_model: rules[{i}]={rule!r} must be a (pattern, policy) pair "
                        "with a str glob pattern")
      norm.append((rule[0], _normalize_mapping(rule[1], f"rules[{i}] policy",
                                               allow_none_policy=True)))
    return cls(pol, normalize_patterns(include, "include"),
               normalize_patterns(exclude, "exclude"), tuple(norm))

  def selected(self, path: str) -> bool:
    """True if ``include`` / ``exclude`` leave the module at ``path`` to the policies."""
    return selected(path, self.include, self.exclude)

  def resolve(self, path: str, kind: str) -> tuple[DotPolicy | None, str]:
    """``(policy or None, where it came from)`` for the matmul ``kind`` of module ``path``.

    Precedence: include/exclude, then the first rule whose pattern matches ``path`` and that
    names ``kind`` (or ``'default'``, or is a plain policy), then ``policy[kind]``, then
    ``policy['default']``; a mapping without either leaves the matmul in FP32.
    """
    if not self.selected(path):
      return None, "include/exclude"
    for i, (pattern, pol) in enumerate(self.rules):
      if not fnmatch.fnmatchcase(path, pattern):
        continue
      if pol is None or isinstance(pol, DotPolicy):
        return pol, f"rules[{i}]"
      found = _lookup(pol, kind)
      if found is not None:
        return found[0], f"rules[{i}][{found[1]!r}]"
    if isinstance(self.policy, DotPolicy):
      return self.policy, "policy"
    found = _lookup(self.policy, kind)
    if found is not None:
      return found[0], f"policy[{found[1]!r}]"
    return None, "policy (kind not listed)"

  def path_excluded(self, path: str) -> bool:
    """True if every matmul of the module at ``path`` is left in FP32 by the user's choice
    (include/exclude, or a matching rule whose policy is None): decides whether a matmul
    jaxlp did not wrap counts as excluded or as unquantized."""
    if not self.selected(path):
      return True
    for pattern, pol in self.rules:
      if fnmatch.fnmatchcase(path, pattern):
        if pol is None:
          return True
        if isinstance(pol, DotPolicy):
          return False
    return False

  def policies(self) -> list[DotPolicy]:
    """Every DotPolicy the plan can hand out."""
    out = [self.policy] if isinstance(self.policy, DotPolicy) else [v for _, v in self.policy]
    for _, pol in self.rules:
      out += [pol] if isinstance(pol, DotPolicy) or pol is None else [v for _, v in pol]
    return [p for p in out if p is not None]


def _lookup(items, kind):
  d = dict(items)
  kinds = (kind, "default") if kind != ATTENTION else ("attention_qk", "attention_pv",
                                                       "default")
  for k in kinds:
    if k in d:
      return d[k], k
  return None
