"""Pallas kernels for `quantize`: elementwise formats and BFP/MX blocks.

The kernels call the same bit-level rounding functions as the pure-jnp specification in
:mod:`jaxlp.formats` (``fmt._round_bits``, ``_bits.round_to_quantum``...) on the loaded
block's float32 bit patterns, so kernel == spec bit for bit by construction. Stochastic noise
is generated in the kernel from the counter-based hash ``_bits.hash_bits(k0, k1, i)`` of the
global C-order flat index ``i`` of each element (computed from ``pl.program_id`` and an iota),
exactly the word ``jaxlp.formats.random_bits(key, x.shape)`` gives element ``i``; no random
tensor is read from memory.

Layouts:

* elementwise formats: x is flattened (C order), zero-padded to a multiple of
  ``block_size`` and processed in 1-D blocks of ``block_size`` elements (a power of two, as
  the Triton backend requires).
* block formats (``mx(elem, b)`` along the last axis, ``BlockFormat(m, axis=-1,
  block_size=b)``, ``BlockFormat(m, tile=(tr, tc))`` / ``hbfp(m, T)`` with finite tiles):
  the array's 2-D view (rows, cols) is zero-padded to whole blocks and re-laid out as one
  block per row of a (num_blocks, P) array, P = next power of two >= block elements (zero
  padding never raises a block's max |x|). Each program handles ``block_rows`` such rows,
  computes every row's shared exponent in the kernel and rounds the row.

On GPU the kernels compile with the Triton backend (``pl.pallas_call`` with
``compiler_params=plt.CompilerParams(num_warps=...)``); on any backend ``interpret=True``
runs them through the Pallas interpreter (this is how CI tests them on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxlp.formats import _bits as B
from jaxlp.formats.block import BlockFormat, MXFormat
from jaxlp.formats.compat import CPDFloat, QPyTorchFloat
from jaxlp.formats.fixed_point import FixedPoint
from jaxlp.formats.float_format import FloatFormat
from jaxlp.formats.quantize import _INPUT_DTYPES, DTypeError, check_format, key_words

#: Elements per program of the elementwise kernel (power of two).
DEFAULT_BLOCK_SIZE = 4096
#: Block rows (one BFP/MX block each) per program of the block kernel (power of two).
DEFAULT_BLOCK_ROWS = 64
#: Largest block (elements sharing one exponent) the block kernel handles.
MAX_BLOCK_ELEMENTS = 4096
#: Arrays smaller than this are left to the XLA-fused spec by :func:`can_use_pallas_quantize`.
MIN_PALLAS_SIZE = 1 << 16

_ELEMENTWISE_TYPES = (FloatFormat, CPDFloat, QPyTorchFloat, FixedPoint)


def _next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _compiler_params(interpret, num_warps=4):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plt  # GPU only
  return plt.CompilerParams(num_warps=num_warps)


# ---------------------------------------------------------------------------------------
# Block geometry
# ---------------------------------------------------------------------------------------
def block_geometry(fmt, shape):
  """(rows, cols, tr, tc) of the 2-D view whose (tr, tc) tiles are ``fmt``'s blocks, or None.

  ``mx``/``BlockFormat(axis=...)`` along the last axis: view (prod(shape[:-1]), shape[-1]),
  tiles (1, b). ``BlockFormat(tile=(tr, tc))`` with finite tiles: view (dim0, prod(rest)) as
  in :func:`jaxlp.formats.block.block_max_bits`. Other block formats (another axis, whole
  tensor/whole axis blocks, ``qpytorch_block``) return None (not supported by the kernel).
  """
  nd = len(shape)
  if isinstance(fmt, MXFormat) or (isinstance(fmt, BlockFormat) and fmt.axis is not None):
    if nd == 0 or fmt.axis % nd != nd - 1:
      return None
    bs = fmt.block_size if fmt.block_size is not None else shape[-1]
    if bs is None or bs < 1:
      return None
    return math.prod(shape[:-1]), shape[-1], 1, bs
  if isinstance(fmt, BlockFormat) and fmt.tile is not None:
    tr, tc = fmt.tile
    if tr is None or tc is None:
      return None
    rows = shape[0] if nd >= 1 else 1
    cols = math.prod(shape[1:]) if nd >= 2 else 1
    return rows, cols, tr, tc
  return None


def supports(fmt, shape) -> bool:
  """True if a Pallas kernel here implements ``fmt`` for arrays of ``shape``."""
  if isinstance(fmt, _ELEMENTWISE_TYPES):
    return True
  g = block_geometry(fmt, tuple(shape))
  return g is not None and g[2] * g[3] <= MAX_BLOCK_ELEMENTS


def can_use_pallas_quantize(x, fmt, rounding: str = "nearest") -> bool:
  """Whether ``jaxlp.quantize`` should run the Pallas kernel for ``x`` (else the jnp spec).

  True iff all of: the default backend is GPU (the kernels target Triton; on CPU/TPU the
  XLA-fused spec is as fast and needs no interpreter), ``x.size >= MIN_PALLAS_SIZE`` (below
  that the launch overhead dominates), ``x.size < 2**32`` (the noise index is 32-bit), the
  dtype is float32/float16/bfloat16, ``fmt`` supports ``rounding``, and :func:`supports`
  (every elementwise format; mx/BlockFormat blocks along the last axis; finite BFP tiles;
  blocks of at most ``MAX_BLOCK_ELEMENTS``). Either way the bits are the same.
  """
  try:
    if jax.default_backend() != "gpu":
      return False
    x_dtype = jnp.dtype(x.dtype)
    size = int(np.prod(x.shape, dtype=np.int64))
    check_format(fmt, rounding)
  except (TypeError, ValueError, AttributeError, RuntimeError):
    return False
  return (x_dtype in _INPUT_DTYPES and MIN_PALLAS_SIZE <= size < 2**32
          and supports(fmt, x.shape))


# ---------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------
def _elementwise_kernel(key_ref, x_ref, o_ref, *, fmt, rounding, rand_bits, block_size):
  x = x_ref[...]
  bits = B.to_bits(x.astype(jnp.float32))
  if rounding == "stochastic":
    base = pl.program_id(0).astype(jnp.uint32) * B.u32(block_size)
    idx = base + lax.iota(jnp.uint32, block_size)
    rand = B.hash_bits(key_ref[0], key_ref[1], idx)
  else:
    rand = B.u32(0)
  out = fmt._round_bits(bits, rounding, rand, rand_bits)
  o_ref[...] = B.from_bits(out).astype(o_ref.dtype)


def _block_round(fmt, bits, mxb, rounding, rand, rand_bits):
  """Round ``bits`` given each element's block max magnitude bits ``mxb`` (as the spec)."""
  return fmt._round_with_block_max(bits, mxb, rounding, rand, rand_bits)


def _block_kernel(key_ref, x_ref, o_ref, *, fmt, rounding, rand_bits, geom, block_rows, width):
  rows, cols, tr, tc = geom
  x = x_ref[...]
  bits = B.to_bits(x.astype(jnp.float32))
  # |x| bits compared as int32 (same order: sign bit cleared); max over the block row.
  mag_i = (bits & B.u32(B.ABS_MASK)).astype(jnp.int32)
  mxb = jnp.max(mag_i, axis=1, keepdims=True).astype(jnp.uint32)
  mxb = jnp.broadcast_to(mxb, bits.shape)
  if rounding == "stochastic":
    nct = -(-cols // tc)
    r = (pl.program_id(0) * block_rows).astype(jnp.uint32) + lax.broadcasted_iota(
        jnp.uint32, (block_rows, width), 0)
    lane = lax.broadcasted_iota(jnp.uint32, (block_rows, width), 1)
    ti, tj = r // B.u32(nct), r % B.u32(nct)
    u, v = lane // B.u32(tc), lane % B.u32(tc)
    row = ti * B.u32(tr) + u
    col = tj * B.u32(tc) + v
    idx = row * B.u32(cols) + col  # C-order flat index in the original array (mod 2^32)
    rand = B.hash_bits(key_ref[0], key_ref[1], idx)
  else:
    rand = B.u32(0)
  out = _block_round(fmt, bits, mxb, rounding, rand, rand_bits)
  o_ref[...] = B.from_bits(out).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------
def _run_elementwise(x, kw, fmt, rounding, rand_bits, interpret, block_size):
  n = x.size
  bs = block_size or min(DEFAULT_BLOCK_SIZE, _next_pow2(n))
  nblk = -(-n // bs)
  flat = jnp.pad(x.reshape(-1), (0, nblk * bs - n))
  kernel = functools.partial(_elementwise_kernel, fmt=fmt, rounding=rounding,
                             rand_bits=rand_bits, block_size=bs)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(flat.shape, x.dtype),
      grid=(nblk,),
      in_specs=[pl.BlockSpec((2,), lambda i: (0,)), pl.BlockSpec((bs,), lambda i: (i,))],
      out_specs=pl.BlockSpec((bs,), lambda i: (i,)),
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
      name="jaxlp_quantize_elementwise",
  )(kw, flat)
  return out[:n].reshape(x.shape)


def _run_block(x, kw, fmt, rounding, rand_bits, interpret, block_rows):
  rows, cols, tr, tc = geom = block_geometry(fmt, x.shape)
  R, C = -(-rows // tr) * tr, -(-cols // tc) * tc
  x2 = jnp.pad(x.reshape(rows, cols), ((0, R - rows), (0, C - cols)))
  nb = (R // tr) * (C // tc)
  blocks = x2.reshape(R // tr, tr, C // tc, tc).transpose(0, 2, 1, 3).reshape(nb, tr * tc)
  width = _next_pow2(tr * tc)
  br = block_rows or max(1, min(DEFAULT_BLOCK_ROWS, _next_pow2(nb), 16384 // width))
  nbp = -(-nb // br) * br
  blocks = jnp.pad(blocks, ((0, nbp - nb), (0, width - tr * tc)))
  kernel = functools.partial(_block_kernel, fmt=fmt, rounding=rounding, rand_bits=rand_bits,
                             geom=geom, block_rows=br, width=width)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(blocks.shape, x.dtype),
      grid=(nbp // br,),
      in_specs=[pl.BlockSpec((2,), lambda i: (0,)),
                pl.BlockSpec((br, width), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((br, width), lambda i: (i, 0)),
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
      name="jaxlp_quantize_block",
  )(kw, blocks)
  out = out[:nb, :tr * tc].reshape(R // tr, C // tc, tr, tc).transpose(0, 2, 1, 3)
  return out.reshape(R, C)[:rows, :cols].reshape(x.shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4, 5, 6))
def _quantize_ste(x, kw, fmt, rounding, rand_bits, interpret, block_size):
  if x.size == 0:
    return x
  if isinstance(fmt, _ELEMENTWISE_TYPES):
    return _run_elementwise(x, kw, fmt, rounding, rand_bits, interpret, block_size)
  return _run_block(x, kw, fmt, rounding, rand_bits, interpret, block_size)


@_quantize_ste.defjvp
def _quantize_ste_jvp(fmt, rounding, rand_bits, interpret, block_size, primals, tangents):
  x, kw = primals
  return _quantize_ste(x, kw, fmt, rounding, rand_bits, interpret, block_size), tangents[0]


def quantize(x, fmt, rounding: str = "nearest", *, key=None, rand_bits: int | None = None,
             interpret: bool = False, block_size: int | None = None):
  """Pallas-kernel version of :func:`jaxlp.formats.quantize` (same arguments, same bits).

  Args:
    x, fmt, rounding, key, rand_bits: as :func:`jaxlp.formats.quantize`.
    interpret: run the kernel in the Pallas interpreter (any backend; used on CPU).
    block_size: elementwise formats: elements per program (a power of two for GPU; default
      ``min(4096, next_pow2(size))``). Block formats: block rows per program (default up to
      64). Does not change the result.

  Raises:
    ValueError: ``fmt`` is a block layout the kernels do not implement (see
      :func:`supports`), plus every error :func:`jaxlp.formats.quantize` raises.
  """
  check_format(fmt, rounding)
  x = x if isinstance(x, jax.Array) else jnp.asarray(x)
  if x.dtype not in _INPUT_DTYPES:
    raise DTypeError(
        f"quantize: x must be float32, float16 or bfloat16, got dtype={x.dtype}")
  if not supports(fmt, x.shape):
    raise ValueError(f"pallas.quantize: no kernel for fmt={fmt!r} on shape {x.shape}; use "
                     "jaxlp.quantize (which falls back to the spec)")
  if rand_bits is not None:
    if rounding != "stochastic":
      raise ValueError("quantize: rand_bits applies only to rounding='stochastic'")
    if not isinstance(rand_bits, int) or not 1 <= rand_bits <= 32:
      raise ValueError(f"quantize: rand_bits must be an int in 1..32, got {rand_bits!r}")
  if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
    raise ValueError(f"pallas.quantize: block_size must be a positive int, got {block_size!r}")
  if rounding == "stochastic":
    if key is None:
      raise ValueError(
          "quantize: rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
    if x.size >= 2**32:
      raise ValueError(f"quantize: stochastic rounding supports < 2**32 elements, got {x.size}")
    kw = jnp.stack(key_words(key))
  else:
    kw = jnp.zeros((2,), jnp.uint32)
  return _quantize_ste(x, kw, fmt, rounding, rand_bits, interpret, block_size)
