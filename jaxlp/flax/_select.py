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


def check_patterns(paths, include, exclude) -> None:
  """Raise if an ``include`` / ``exclude`` pattern matches none of the layer ``paths``.

  A pattern that matches no layer is almost always a typo (``"Dense_l"`` for ``"Dense_1"``) or
  a pattern written for another model; ignoring it would silently quantize a layer that was
  meant to stay in FP32 (or leave one in FP32 that was meant to be quantized), and nothing in
  the results would show it. So it is an error, not a warning (a warning is easily lost in a
  training log); a configuration shared by several models passes each model the patterns that
  apply to it.

  Args:
    paths: the '/'-joined paths of the model's quantizable layers.
    include, exclude: normalized patterns (tuples of str) or None.

  Raises:
    ValueError: naming each pattern that matches nothing, and listing ``paths``.
  """
  paths = list(dict.fromkeys(paths))
  bad = [f"{name}={p!r}" for name, pats in (("include", include), ("exclude", exclude))
         for p in (pats or ()) if not any(fnmatch.fnmatchcase(path, p) for path in paths)]
  if bad:
    raise ValueError(
        f"quantize_model: pattern {', '.join(bad)} matches no layer of the model (a glob on "
        f"'/'-joined paths, case-sensitive); its Dense/Conv-type layers are: {paths}")
