"""Small integer helpers shared by the package (Python ints, static shapes)."""

from __future__ import annotations

import numbers


def cdiv(n: int, k: int) -> int:
  """``ceil(n / k)`` for ints, ``k > 0``.

  Example:
    >>> cdiv(10, 4), cdiv(8, 4), cdiv(0, 4)
    (3, 2, 0)
  """
  return -(-n // k)


def round_up(n: int, k: int) -> int:
  """The smallest multiple of ``k`` that is ``>= n`` (``k > 0``).

  Example:
    >>> round_up(10, 4), round_up(8, 4)
    (12, 8)
  """
  return cdiv(n, k) * k


def next_pow2(n: int) -> int:
  """The smallest power of two ``>= n`` (1 for ``n <= 1``).

  Example:
    >>> next_pow2(1), next_pow2(5), next_pow2(64)
    (1, 8, 64)
  """
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_int(owner: str, name: str, value) -> None:
  """TypeError unless ``value`` is an int (numpy ints count; bools, floats and strings do not).

  Example:
    >>> check_int("cgx", "bits", 4)
    >>> check_int("cgx", "bits", 4.5)
    Traceback (most recent call last):
    ...
    TypeError: cgx: bits must be an int, got 4.5
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{owner}: {name} must be an int, got {value!r}")


def check_number(owner: str, name: str, value, *, none_ok: bool = False) -> None:
  """TypeError unless ``value`` is a real number (or None with ``none_ok``; not a bool).

  Example:
    >>> check_number("dgc", "ratio", 0.01)
    >>> check_number("dgc", "ratio", "0.01")
    Traceback (most recent call last):
    ...
    TypeError: dgc: ratio must be a number, got '0.01'
  """
  if value is None and none_ok:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{owner}: {name} must be a number, got {value!r}")


def check_bool(owner: str, name: str, value) -> None:
  """TypeError unless ``value`` is True or False.

  Example:
    >>> check_bool("cgx", "stochastic", "yes")
    Traceback (most recent call last):
    ...
    TypeError: cgx: stochastic must be True or False, got 'yes'
  """
  if not isinstance(value, bool):
    raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
