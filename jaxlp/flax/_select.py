"""Module-path selection shared by the linen and nnx wrappers."""

from __future__ import annotations

import fnmatch


def normalize_patterns(patterns, name):
  if patterns is None:
    return None
  if isinstance(patterns, str):
    return (patterns,)
  try:
    pats = tuple(patterns)
  except TypeError:
    raise TypeError(
        f"quantize_model: {name}={patterns!r} must be a str or a sequence of str") from None
  for p in pats:
    if not isinstance(p, str):
      raise TypeError(f"quantize_model: {name} entries must be str patterns, got {p!r}")
  return pats


def selected(path: str, include, exclude) -> bool:
  """``fnmatch`` glob selection of a '/'-joined module path: included (all if ``include`` is
  None) and not excluded."""
  if include is not None and not any(fnmatch.fnmatchcase(path, p) for p in include):
    return False
  return not (exclude is not None and any(fnmatch.fnmatchcase(path, p) for p in exclude))


def unmatched_patterns(paths, include, exclude, rules=()) -> list[str]:
  """The ``include`` / ``exclude`` / ``rules`` patterns that match none of ``paths``, each as
  ``"include='x'"`` / ``"rules[2]='x'"`` (in argument order)."""
  paths = list(paths)
  pats = [(f"{name}={p!r}", p) for name, ps in (("include", include), ("exclude", exclude))
          for p in (ps or ())]
  pats += [(f"rules[{i}]={rule[0]!r}", rule[0]) for i, rule in enumerate(rules or ())]
  return [label for label, p in pats if not any(fnmatch.fnmatchcase(x, p) for x in paths)]


def check_patterns(paths, include, exclude, rules=(), *, note: str = "") -> None:
  """Raise if an ``include`` / ``exclude`` pattern or a ``rules`` pattern matches none of
  ``paths``.

  A pattern that matches nothing is almost always a typo (``"Dense_l"`` for ``"Dense_1"``), a
  pattern written for another model, or a parent's path meant to cover its children (patterns
  match whole paths: ``"Block_0"`` is not ``"Block_0/Dense_0"``; ``"Block_0/*"`` is). Ignoring
  it would silently quantize a layer that was meant to stay in FP32 (or leave one in FP32 that
  was meant to be quantized, or give it another rule's policy), and nothing in the results
  would show it. So it is an error, not a warning (a warning is easily lost in a training
  log); a configuration shared by several models passes each model the patterns that apply to
  it.

  Args:
    paths: the '/'-joined paths a pattern may name: those of the modules with a matmul the
      wrapper handles (whatever policy it ends up with) and, where the caller traced the
      model, those of the modules a matmul it does not wrap is attributed to (the paths
      ``matmul_report`` lists; a pattern there decides whether that matmul counts as
      excluded).
    include, exclude: normalized patterns (tuples of str) or None.
    rules: normalized ``(pattern, policy)`` pairs.
    note: appended to the message.

  Raises:
    ValueError: naming each pattern that matches nothing, and listing ``paths``.
  """
  paths = list(dict.fromkeys(paths))
  bad = unmatched_patterns(paths, include, exclude, rules)
  if bad:
    raise ValueError(
        f"quantize_model: pattern {', '.join(bad)} matches no layer of the model (a glob on "
        f"the whole '/'-joined module path, case-sensitive); the paths of its modules with a "
        f"matmul are: {paths}{note}")
