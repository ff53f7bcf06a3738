"""Public `jaxlp.quantize`: the spec in `jaxlp.formats`, or a Pallas kernel where it is faster.

Dispatch follows the platform the computation is compiled for, not the default backend:
both implementations are staged with ``lax.platform_dependent`` inside a ``jax.jit``, and
lowering keeps only the one for the platform of the inputs' devices (the CUDA branch runs
the kernel, every other platform the spec). So an array on the CPU device of a GPU host
takes the spec, and a ``jit`` compiled for the GPU takes the kernel. The kernel is staged
only where ``kernel_applies`` (``jaxlp/pallas/_quantize.py``) holds (its family was measured faster
than the XLA-fused spec, and the array is large enough). Both give identical bits.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from jaxlp.formats._block import check_block_axis
from jaxlp.formats._quantize import prepare
from jaxlp.formats._quantize import quantize_words as _spec_words
from jaxlp.pallas._quantize import kernel_applies
from jaxlp.pallas._quantize import quantize_words as _kernel_words


def quantize(x, fmt, rounding: str = "nearest", *, key=None, rand_bits: int | None = None):
  """Round ``x`` to ``fmt``; same semantics and bits as :func:`jaxlp.formats.quantize`.

  Runs the Pallas kernel on a GPU where ``kernel_applies`` (``jaxlp/pallas/_quantize.py``; a
  format family whose kernel was measured faster than the spec, at least
  ``MIN_PALLAS_SIZE`` elements), else the pure-jnp spec (XLA-fused). Both give identical
  bits and the same straight-through gradient. The arguments are those of
  :func:`jaxlp.formats.quantize` (documented there).

  Args:
    x: float32, float16 or bfloat16 array.
    fmt: any jaxlp format.
    rounding: rounding mode (``"nearest"``, ..., ``"stochastic"``).
    key: PRNG key, required for ``rounding="stochastic"``.
    rand_bits: limited-precision stochastic rounding (1..32 random bits).

  Returns:
    Array of x's shape and dtype (straight-through gradient).

  Raises:
    jaxlp.formats.DTypeError: ``x`` is not float32, float16 or bfloat16.
    TypeError: ``fmt`` is not a jaxlp format.
    ValueError: a rounding ``fmt`` does not support, a missing or malformed ``key``, a bad
      ``rand_bits`` (see :func:`jaxlp.formats.quantize`).

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> x = jnp.array([1.0, 1.0625, 1.1875, -3.3])
    >>> jaxlp.quantize(x, F.E4M3)  # ties to even (1.0625 -> 1.0, 1.1875 -> 1.25)
    Array([ 1.  ,  1.  ,  1.25, -3.25], dtype=float32)
    >>> jax.grad(lambda x: jaxlp.quantize(x, F.E4M3).sum())(x)  # straight-through
    Array([1., 1., 1., 1.], dtype=float32)
  """
  x, kw = prepare(x, fmt, rounding, key=key, rand_bits=rand_bits)
  return quantize_words(x, kw, fmt, rounding, rand_bits)


def quantize_words(x, kw, fmt, rounding: str, rand_bits=None):
  """:func:`quantize` on validated arguments: ``kw`` = the (2,) uint32 key words
  (:func:`jaxlp.formats._quantize.prepare`). For callers that derive the words themselves
  (e.g. the torch bridge)."""
  check_block_axis(fmt, x.shape)  # before the kernel choice (it reads the axis modulo ndim)
  if x.size == 0 or not kernel_applies(fmt, x.shape, x.dtype, rounding):
    return _spec_words(x, kw, fmt, rounding, rand_bits)
  return _dispatch(x, kw, fmt, rounding, rand_bits)


#: Platforms whose compiled code runs the Pallas kernel (Triton on NVIDIA GPUs); every other
#: platform runs the pure-jnp version.
_KERNEL_PLATFORMS = ("cuda",)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _dispatch(x, kw, fmt, rounding, rand_bits):
  def spec(x, kw):
    return _spec_words(x, kw, fmt, rounding, rand_bits)

  def kernel(x, kw):
    return _kernel_words(x, kw, fmt, rounding, rand_bits)

  branches = dict.fromkeys(_KERNEL_PLATFORMS, kernel)
  return lax.platform_dependent(x, kw, **branches, default=spec)
