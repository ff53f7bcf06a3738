"""Deprecation shims for renamed public keyword arguments."""

from __future__ import annotations

import functools
import warnings


def renamed_kwargs(**renames: str):
  """Decorator: accept each old keyword ``old=new`` under its old name, with a warning.

  ``@renamed_kwargs(format="fmt")`` lets ``f(format=x)`` keep working as ``f(fmt=x)`` and
  emits a ``DeprecationWarning`` naming the new spelling; passing both is a ``TypeError``.

  Example:
    >>> @renamed_kwargs(format="fmt")
    ... def f(*, fmt=None):
    ...   return fmt
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter("ignore")
    ...   f(format="E4M3")
    'E4M3'
  """
  def wrap(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
      for old, new in renames.items():
        if old in kwargs:
          if new in kwargs:
            raise TypeError(f"{fn.__name__}: pass {new}= only ({old}= is its deprecated name)")
          warnings.warn(f"{fn.__name__}({old}=...) is deprecated: use {new}=...",
                        DeprecationWarning, stacklevel=2)
          kwargs[new] = kwargs.pop(old)
      return fn(*args, **kwargs)
    return inner
  return wrap
