"""Public `jaxlp.quantize`: the spec in `jaxlp.formats`, or a Pallas kernel where it applies."""

from __future__ import annotations

from jaxlp.formats import quantize as _spec
from jaxlp.pallas.quantize import can_use_pallas_quantize
from jaxlp.pallas.quantize import quantize as _pallas_quantize


def quantize(x, fmt, rounding: str = "nearest", *, key=None, rand_bits: int | None = None):
  """Round ``x`` to ``fmt``; same semantics and bits as :func:`jaxlp.formats.quantize`.

  Dispatch: when :func:`jaxlp.pallas.quantize.can_use_pallas_quantize` is true (GPU backend,
  at least ``MIN_PALLAS_SIZE`` elements, a format/layout the kernels implement) the Pallas
  kernel runs; otherwise the pure-jnp spec (XLA-fused). Both give identical bits and the
  same straight-through gradient. See :func:`jaxlp.formats.quantize` for the arguments.
  """
  if can_use_pallas_quantize(x, fmt, rounding):
    return _pallas_quantize(x, fmt, rounding, key=key, rand_bits=rand_bits)
  return _spec(x, fmt, rounding, key=key, rand_bits=rand_bits)
