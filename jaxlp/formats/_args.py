"""Argument checks shared by :func:`jaxlp.formats.quantize` and the formats' own entry points
(below every format module: ``_quantize`` imports the formats, the formats import this)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


class DTypeError(TypeError, ValueError):
  """An array of an unsupported dtype was passed (a TypeError and a ValueError).

  Example:
    >>> import numpy as np
    >>> from jaxlp import formats as F
    >>> try:
    ...   F.quantize(np.zeros(2), F.BF16)  # float64: not accepted (cast explicitly)
    ... except F.DTypeError as e:
    ...   print(isinstance(e, TypeError), isinstance(e, ValueError))
    True True
  """


def key_words(key) -> tuple[jax.Array, jax.Array]:
  """Two uint32 words derived from a PRNG key (typed ``jax.random.key`` or legacy uint32)."""
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"quantize: key must be a single PRNG key, got key shape {key.shape}")
  else:
    try:
      k = jnp.asarray(key)
    except TypeError as e:
      raise ValueError(
          f"quantize: key must be a jax.random.key(...) or a legacy uint32[2] PRNGKey, got "
          f"{key!r}") from e
    if k.dtype != jnp.uint32 or k.shape != (2,):
      raise ValueError(
          "quantize: key must be a jax.random.key(...) or a legacy uint32[2] PRNGKey, got "
          f"dtype={k.dtype}, shape={k.shape}")
    key = k
  w = jax.random.bits(key, (2,), jnp.uint32)
  return w[0], w[1]


def element_index(shape) -> jax.Array:
  """uint32 flat C-order index of every element of ``shape``."""
  size = int(np.prod(shape, dtype=np.int64))
  if size >= 2**32:
    raise ValueError(f"quantize: stochastic rounding supports < 2**32 elements, got {size}")
  return lax.iota(jnp.uint32, size).reshape(shape) if size else jnp.zeros(shape, jnp.uint32)


def prepare_array(x, rounding: str = "nearest", *, key=None, rand_bits=None):
  """:func:`jaxlp.formats._quantize.prepare` after the format check: ``(x, kw)``."""
  # The caller's dtype, before jnp.asarray (which would narrow a numpy float64 array to
  # float32 silently when x64 is off). Python scalars and lists have no dtype and are fine.
  in_dtype = getattr(x, "dtype", None)
  x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
  bad = x.dtype if in_dtype is None else jnp.dtype(in_dtype)
  if bad not in _INPUT_DTYPES or x.dtype not in _INPUT_DTYPES:
    raise DTypeError(
        f"quantize: x must be float32, float16 or bfloat16, got dtype={bad} (cast "
        "explicitly; float64 would be double-rounded through float32)")
  if rand_bits is not None:
    if rounding != "stochastic":
      raise ValueError("quantize: rand_bits applies only to rounding='stochastic'")
    if (not isinstance(rand_bits, int) or isinstance(rand_bits, bool)
        or not 1 <= rand_bits <= 32):
      raise ValueError(f"quantize: rand_bits must be an int in 1..32, got {rand_bits!r}")
  if rounding != "stochastic":
    return x, jnp.zeros((2,), jnp.uint32)
  if key is None:
    raise ValueError(
        "quantize: rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
  if x.size >= 2**32:
    raise ValueError(f"quantize: stochastic rounding supports < 2**32 elements, got {x.size}")
  return x, jnp.stack(key_words(key))
