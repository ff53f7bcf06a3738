"""Small integer helpers shared by the package (Python ints, static shapes)."""

from __future__ import annotations


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
