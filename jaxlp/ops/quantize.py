"""Public `jaxlp.quantize`: the spec in `jaxlp.formats`, or a Pallas kernel where it applies."""

from __future__ import annotations

from jaxlp.formats import quantize as _spec


def quantize(x, fmt, rounding: str = "nearest", *, key=None, rand_bits: int | None = None):
  """Round ``x`` to ``fmt``; same semantics and bits as :func:`jaxlp.formats.quantize`.

  See :func:`jaxlp.formats.quantize` for the arguments.
  """
  return _spec.quantize(x, fmt, rounding, key=key, rand_bits=rand_bits)
