"""`quantize`: the pure-jnp specification of rounding a float array to a jaxlp format."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxlp.formats import _bits as B
from jaxlp.formats._args import _INPUT_DTYPES as _INPUT_DTYPES
from jaxlp.formats._args import DTypeError as DTypeError
from jaxlp.formats._args import element_index as element_index
from jaxlp.formats._args import key_words as key_words
from jaxlp.formats._args import prepare_array
from jaxlp.formats._block import BlockFormat, MXFormat, QPyTorchBlock
from jaxlp.formats._compat import CPDFloat, QPyTorchFloat
from jaxlp.formats._fixed_point import FixedPoint
from jaxlp.formats._float_format import FloatFormat
from jaxlp.formats._nvfp4 import ScaledBlockFormat

ROUNDINGS = B.ROUNDINGS
FORMAT_TYPES = (FloatFormat, CPDFloat, QPyTorchFloat, FixedPoint, BlockFormat, QPyTorchBlock,
                MXFormat, ScaledBlockFormat)


def is_elementwise(fmt) -> bool:
  """True if ``fmt`` rounds each element independently (no shared block exponent)."""
  return hasattr(fmt, "_round_bits")


def check_format(fmt, rounding: str = "nearest") -> None:
  """Raise a clear error if ``fmt`` is not a jaxlp format or does not support ``rounding``.

  Args:
    fmt: the object to check.
    rounding: the rounding mode to check ``fmt`` against.

  Returns:
    None.

  Raises:
    TypeError: ``fmt`` is not a jaxlp format.
    ValueError: ``rounding`` is not a known mode, or ``fmt`` does not support it.

  Example:
    >>> from jaxlp import formats as F
    >>> F.check_format(F.E4M3, "stochastic")  # fine: returns None
    >>> F.check_format(F.cpd_float(4, 3), "stochastic")
    Traceback (most recent call last):
      ...
    ValueError: quantize: CPDFloat supports rounding in ('nearest',), got rounding='stochastic'
  """
  if not isinstance(fmt, FORMAT_TYPES):
    raise TypeError(
        f"quantize: fmt must be a jaxlp format (FloatFormat, BlockFormat, FixedPoint, mx(...), "
        f"nvfp4(...), cpd_float(...), qpytorch_float(...), ...), got {fmt!r} of type "
        f"{type(fmt).__name__}")
  if rounding not in ROUNDINGS:
    raise ValueError(f"quantize: unknown rounding={rounding!r}; expected one of {ROUNDINGS}")
  if rounding not in fmt.supported_roundings:
    raise ValueError(
        f"quantize: {type(fmt).__name__} supports rounding in {fmt.supported_roundings}, "
        f"got rounding={rounding!r}")


def split_key(key):
  """``(data, impl)`` of a PRNG key (typed or legacy uint32; None gives ``(None, None)``), so
  that it can cross a ``custom_vjp``/``custom_jvp`` boundary as a plain array;
  :func:`join_key` rebuilds it."""
  if key is None:
    return None, None
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key), jax.random.key_impl(key)
  return jnp.asarray(key), None


def join_key(data, impl):
  """The key :func:`split_key` took apart (a typed key, or the legacy uint32 key data)."""
  if data is None:
    return None
  if impl is None:
    return jax.random.wrap_key_data(data)
  return jax.random.wrap_key_data(data, impl=impl)


def typed_key(key, who: str):
  """``key`` as a typed scalar PRNG key: a ``jax.random.key(...)`` passes unchanged; a legacy
  uint32[2] ``PRNGKey`` (which ``jax.random`` still accepts) is wrapped, with the same key data
  and so the same random bits; anything else is a ``ValueError`` naming ``who``."""
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"{who}: key must be a single PRNG key, got key shape {key.shape}")
    return key
  try:
    k = jnp.asarray(key)
  except TypeError as e:
    raise ValueError(f"{who}: key must be a jax.random.key(...), got {key!r}") from e
  if k.dtype != jnp.uint32 or k.shape != (2,):
    raise ValueError(f"{who}: key must be a jax.random.key(...), got dtype={k.dtype}, "
                     f"shape={k.shape}")
  return jax.random.wrap_key_data(k, impl="threefry2x32")


def random_bits(key, shape) -> jax.Array:
  """The uint32 noise word of every element: hash of (key, flat element index).

  These are the words :func:`quantize` uses for ``rounding="stochastic"``: element ``i``
  (flat C-order index) gets a counter-based hash of ``(key, i)``, so the noise of an element
  does not depend on the array's sharding or the backend.

  Args:
    key: a ``jax.random.key(...)`` or a legacy uint32[2] ``PRNGKey``.
    shape: the array shape.

  Returns:
    uint32 array of ``shape``.

  Raises:
    ValueError: ``key`` is not a single PRNG key, or ``shape`` has ``2**32`` elements or
      more.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> r = F.random_bits(jax.random.key(0), (2, 3))
    >>> r.shape, r.dtype
    ((2, 3), dtype('uint32'))
    >>> # element (1, 2) has flat index 5 in any array with 6 or more elements
    >>> bool(r[1, 2] == F.random_bits(jax.random.key(0), (8,))[5])
    True
  """
  k0, k1 = key_words(key)
  return B.hash_bits(k0, k1, element_index(shape))


def quantize_f32(x, fmt, rounding: str = "nearest", rand=None, rand_bits=None):
  """Quantize a float32 array given precomputed noise words (no validation): the core."""
  if is_elementwise(fmt):
    return B.from_bits(fmt._round_bits(B.to_bits(x), rounding, rand, rand_bits))
  return fmt._quantize_f32(x, rounding, rand, rand_bits)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _quantize_ste(x, rand, fmt, rounding, rand_bits):
  xf = x.astype(jnp.float32)
  return quantize_f32(xf, fmt, rounding, rand, rand_bits).astype(x.dtype)


@_quantize_ste.defjvp
def _quantize_ste_jvp(fmt, rounding, rand_bits, primals, tangents):
  x, rand = primals
  x_dot, _ = tangents
  return _quantize_ste(x, rand, fmt, rounding, rand_bits), x_dot


def quantize(x, fmt, rounding: str = "nearest", *, key=None, rand_bits: int | None = None):
  """Round every element of ``x`` to a value representable in ``fmt``.

  This is the pure-jnp specification (any backend). ``jaxlp.quantize`` has the same
  signature and bits, and may dispatch to a Pallas kernel on GPU.

  Args:
    x: float32, float16 or bfloat16 array (other dtypes raise). float16/bfloat16 inputs are
      widened exactly to float32, rounded, and cast back (exact whenever the format fits in
      the input dtype; otherwise the result is rounded once more to the input dtype).
    fmt: a jaxlp format: :class:`FloatFormat` (or a preset such as ``E4M3``),
      :class:`BlockFormat`, :class:`FixedPoint`, ``mx(...)``, ``nvfp4(...)``
      (:class:`ScaledBlockFormat`), ``cpd_float(...)``, ``qpytorch_float(...)``,
      ``qpytorch_block(...)``.
    rounding: ``"nearest"`` (ties to even), ``"nearest_away"``, ``"toward_zero"``,
      ``"up"``, ``"down"`` or ``"stochastic"``. Compatibility formats define their own
      ``"nearest"`` (QPyTorch: ties away) and support fewer modes.
    key: PRNG key for ``"stochastic"`` (required there, ignored otherwise). The noise of
      element i is a counter-based hash of (key, i) with i the flat C-order index, so the
      result is the same under any sharding and on any backend.
    rand_bits: stochastic rounding with only this many random bits (1..32): the dropped
      bits are truncated to ``rand_bits`` bits before comparison with the noise (MPTorch's
      limited-precision SR; slightly biased toward zero by design).

  Returns:
    Array of x's shape and dtype. Gradient: straight-through (identity).

  Raises:
    DTypeError: ``x`` is not float32, float16 or bfloat16 (e.g. float64 or int; a subclass
      of both TypeError and ValueError).
    TypeError: ``fmt`` is not a jaxlp format.
    ValueError: an unknown ``rounding`` or one ``fmt`` does not support; ``rounding=
      "stochastic"`` without ``key``, with a malformed ``key``, or on ``2**32`` elements or
      more; ``rand_bits`` outside 1..32 or given with a non-stochastic rounding; a
      ``qpytorch_block`` ``dim`` out of range for ``x``.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> x = jnp.array([1.0625, 1.1875, 300.0, -0.001])
    >>> # ties to even; 300 > max 240 overflows to inf; -0.001 -> the subnormal -2**-9
    >>> F.quantize(x, F.E4M3)
    Array([ 1.        ,  1.25      ,         inf, -0.00195312], dtype=float32)
    >>> F.quantize(x, F.E4M3, "toward_zero")  # directed rounding: overflow gives max
    Array([ 1.   ,  1.125,  240.  , -0.   ], dtype=float32)
    >>> # stochastic: 1.0625 goes to 1.0 or 1.125, each with probability 1/2
    >>> y = F.quantize(jnp.full(1000, 1.0625), F.E4M3, "stochastic", key=jax.random.key(0))
    >>> sorted(set(y.tolist()))
    [1.0, 1.125]
  """
  x, kw = prepare(x, fmt, rounding, key=key, rand_bits=rand_bits)
  return quantize_words(x, kw, fmt, rounding, rand_bits)


def prepare(x, fmt, rounding: str = "nearest", *, key=None, rand_bits=None):
  """Validate :func:`quantize`'s arguments once for the spec and every kernel.

  Returns ``(x, kw)``: ``x`` as a float32/float16/bfloat16 ``jax.Array`` and ``kw`` the
  (2,) uint32 words of ``key`` (zeros unless ``rounding="stochastic"``).

  Raises:
    TypeError/ValueError naming the problem: bad dtype, format, rounding, ``rand_bits``,
    missing key, too many elements for the 32-bit noise index.
  """
  check_format(fmt, rounding)
  return prepare_array(x, rounding, key=key, rand_bits=rand_bits)


@functools.partial(jax.jit, static_argnames=("fmt", "rounding", "rand_bits"))
def quantize_words(x, kw, fmt, rounding: str, rand_bits=None):
  """The spec on validated arguments (see :func:`prepare`): ``kw`` are the key words.

  Jitted (the format, rounding and ``rand_bits`` static): called eagerly it is one compiled
  program per shape and format instead of one small program per operation, and inside a
  caller's ``jit`` a nested call that XLA inlines."""
  if rounding == "stochastic":
    rand = B.hash_bits(kw[0], kw[1], element_index(x.shape))
  else:
    rand = jnp.zeros((), jnp.uint32)
  return _quantize_ste(x, rand, fmt, rounding, rand_bits)
