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
