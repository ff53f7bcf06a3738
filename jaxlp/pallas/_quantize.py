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
  block_size=b)``, ``BlockFormat(m, tile=(tr, tc))`` / ``hbfp(m, T)`` with finite tiles,
  ``nvfp4()`` / :class:`~jaxlp.formats.ScaledBlockFormat` with 1-D blocks along the last axis
  or 2-D tiles): the array's 2-D view (rows, cols) is zero-padded to whole blocks and
  re-laid out as one block per row of a (num_blocks, P) array, P = next power of two >=
  block elements (zero padding never raises a block's max |x|). Each program handles
  ``block_rows`` such rows, computes every row's shared exponent (or block scale) in the
  kernel and rounds the row. A two-level format's tensor scale (a reduction over the whole
  array) is computed before the kernel by the spec's own function and passed in.

On GPU the kernels compile with the Triton backend (``pl.pallas_call`` with
``compiler_params=plt.CompilerParams(num_warps=...)``); on any backend ``interpret=True``
runs them through the Pallas interpreter (this is how CI tests them on CPU).
"""

from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxlp._util import cdiv, next_pow2, round_up
from jaxlp.formats import _bits as B
from jaxlp.formats._block import BlockFormat, MXFormat, check_block_axis, is_axis_blocked
from jaxlp.formats._nvfp4 import ScaledBlockFormat
from jaxlp.formats._quantize import _INPUT_DTYPES, check_format, is_elementwise, prepare

#: Elements per program of the elementwise kernel (power of two).
DEFAULT_BLOCK_SIZE = 4096
#: Block rows (one BFP/MX block each) per program of the block kernel (power of two).
DEFAULT_BLOCK_ROWS = 64
#: Most elements per program of the block kernel (a power of two; fewer when a program's
#: rows would exceed :data:`DEFAULT_BLOCK_ROWS`).
MAX_PROGRAM_ELEMENTS = 16384
#: The same with stochastic rounding, whose per-element counter hash Triton unrolls for each
#: element a thread holds: sm_90 compile of the ``hbfp(8, 24)`` kernel (Triton 3.9, 2-core
#: CPU) 15.0 s at 16,384 elements per program, 0.9 s at 4,096 (the elementwise kernel's
#: :data:`DEFAULT_BLOCK_SIZE`). GPU throughput of the two: not measured.
MAX_PROGRAM_ELEMENTS_STOCHASTIC = 4096
#: The same for two-level block formats (``nvfp4()``), whose per-element integer multiplies
#: Triton also unrolls for each element a thread holds: sm_90 compile of ``nvfp4(tile=16)``
#: (Triton 3.9, 2-core CPU, loaded) 45 s at 16,384 elements per program. GPU throughput:
#: not measured.
MAX_PROGRAM_ELEMENTS_SCALED = 2048
#: Largest block (elements sharing one exponent) the block kernel handles.
MAX_BLOCK_ELEMENTS = 4096
#: Arrays smaller than this are left to the XLA-fused spec by :func:`can_use_pallas_quantize`.
MIN_PALLAS_SIZE = 1 << 16




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

  Axis-blocked formats (``mx``, ``BlockFormat(axis=...)``, 1-D ``nvfp4()``) along the last
  axis: view (prod(shape[:-1]), shape[-1]), tiles (1, b). ``BlockFormat(tile=(tr, tc))``
  with finite tiles: view (dim0, prod(rest)) as in
  :func:`jaxlp.formats._block.block_max_bits`. :class:`ScaledBlockFormat` tiles of the last
  two axes: view (prod(shape[:-1]), shape[-1]) where tiles do not straddle two leading
  indices (2-D arrays, or ``shape[-2] % tr == 0``; a 1-D array is one row). Other block
  formats (another axis, whole tensor/whole axis blocks, ``qpytorch_block``) return None
  (not supported by the kernel).
  """
  nd = len(shape)
  if is_axis_blocked(fmt):
    if nd == 0 or fmt.axis % nd != nd - 1:
      return None
    bs = fmt.block_size if fmt.block_size is not None else shape[-1]
    if bs is None or bs < 1:
      return None
    return math.prod(shape[:-1]), shape[-1], 1, bs
  if isinstance(fmt, ScaledBlockFormat):
    tr, tc = fmt.tile
    if nd == 0 or (nd > 2 and shape[-2] % tr):
      return None
    return math.prod(shape[:-1]), shape[-1], tr, tc
  if isinstance(fmt, BlockFormat) and fmt.tile is not None:
    tr, tc = fmt.tile
    if tr is None or tc is None:
      return None
    rows = shape[0] if nd >= 1 else 1
    cols = math.prod(shape[1:]) if nd >= 2 else 1
    return rows, cols, tr, tc
  return None


def program_rows(fmt, shape, max_elements: int) -> int:
  """Block rows per program of the block kernel for ``fmt`` on ``shape`` (a layout
  :func:`block_geometry` supports): a power of two, at most :data:`DEFAULT_BLOCK_ROWS`, no
  more than the padded number of blocks needs, and at most ``max_elements`` elements (one
  block per row, padded to a power of two)."""
  rows, cols, tr, tc = block_geometry(fmt, shape)
  nb = cdiv(rows, tr) * cdiv(cols, tc)
  return max(1, min(DEFAULT_BLOCK_ROWS, next_pow2(nb), max_elements // next_pow2(tr * tc)))


def supports(fmt, shape) -> bool:
  """True if a Pallas kernel here implements ``fmt`` for arrays of ``shape``."""
  return family(fmt, shape) is not None


def family(fmt, shape) -> str | None:
  """The kernel family of ``fmt`` on arrays of ``shape`` (a key of :data:`KERNEL_IS_FASTER`),
  or None where no kernel implements it.

  ``"elementwise"``: FloatFormat, cpd_float, qpytorch_float, FixedPoint. ``"axis_blocks"``:
  ``BlockFormat(axis=last, block_size=b)``. ``"mx"``: ``mx(...)`` along the last axis.
  ``"tiles"``: ``BlockFormat(tile=(tr, tc))``/``hbfp(m, T)`` with finite tiles.
  ``"scaled_blocks"``: ``nvfp4()``/:class:`ScaledBlockFormat` (1-D blocks along the last axis
  or 2-D tiles). Blocks of more than ``MAX_BLOCK_ELEMENTS`` elements have no kernel.
  """
  if is_elementwise(fmt):
    return "elementwise"
  g = block_geometry(fmt, tuple(shape))
  if g is None or g[2] * g[3] > MAX_BLOCK_ELEMENTS:
    return None
  if isinstance(fmt, ScaledBlockFormat):
    return "scaled_blocks"
  if isinstance(fmt, MXFormat):
    return "mx"
  return "axis_blocks" if fmt.axis is not None else "tiles"


#: Whether, on a GPU, the kernel of a family is faster than the XLA-fused spec (then
#: :func:`jaxlp.quantize` runs the kernel there). Measured on one H100 80GB HBM3 (jax 0.11.2,
#: float32, n = 2**26, time in ms; ``benchmarks/RESULTS.md``, 2026-11-23). Re-measure with
#: ``python benchmarks/kernels.py --check`` and update.
KERNEL_IS_FASTER = types.MappingProxyType({
    # spec / kernel: E4M3 RN 0.274 / 0.300, E4M3 SR 0.327 / 0.318, BF16 SR 0.321 / 0.293,
    # cpd_float(5, 2) RN 0.283 / 0.300: within 10% either way; the spec is kept
    "elementwise": False,
    # BlockFormat(7, blocks of 16 along the last axis): spec 0.448, kernel 0.279
    "axis_blocks": True,
    # hbfp(7, 16): spec 0.435, kernel 1.059
    "tiles": False,
    # mx(E4M3FN) RN: spec 0.482, kernel 0.301; mx(E2M1FN) SR: spec 0.533, kernel 0.389
    "mx": True,
    # nvfp4() and the other ScaledBlockFormats: not measured on a GPU; the spec is kept
    "scaled_blocks": False,
})


def kernel_applies(fmt, shape, dtype, rounding: str = "nearest") -> bool:
  """Whether ``jaxlp.quantize`` runs the kernel for arrays of this shape/dtype on a GPU.

  True iff ``fmt`` supports ``rounding``, the dtype is float32/float16/bfloat16,
  ``MIN_PALLAS_SIZE <= size < 2**32`` (below that the launch overhead dominates; the noise
  index is 32-bit), a kernel implements the layout (:func:`family`) and that family's kernel
  was measured faster than the spec (:data:`KERNEL_IS_FASTER`). Static: shapes only.
  """
  try:
    check_format(fmt, rounding)
    dt = jnp.dtype(dtype)
  except (TypeError, ValueError):
    return False
  size = math.prod(shape)
  fam = family(fmt, shape)
  return (dt in _INPUT_DTYPES and MIN_PALLAS_SIZE <= size < 2**32 and fam is not None
          and KERNEL_IS_FASTER[fam])


def on_gpu(x) -> bool:
  """True if a computation on ``x`` runs on a GPU: a concrete ``jax.Array`` on GPU devices,
  or a non-JAX array (numpy, lists) where JAX's default device is a GPU. A tracer has no
  device (its platform is known only when the enclosing computation is lowered): False."""
  if isinstance(x, jax.Array):
    try:
      devices = x.devices()
    except jax.errors.ConcretizationTypeError:  # a tracer
      return False
  else:
    default = jax.config.jax_default_device
    if isinstance(default, str):
      devices = jax.devices(default)[:1]
    elif default is not None:
      devices = [default]
    else:
      devices = jax.devices()[:1]
  return bool(devices) and all(d.platform == "gpu" for d in devices)


def can_use_pallas_quantize(x, fmt, rounding: str = "nearest") -> bool:
  """Whether ``jaxlp.quantize(x, fmt, rounding)`` runs the Pallas kernel for the array ``x``.

  True iff ``x`` lives on a GPU device (not merely on a host whose default backend is a GPU)
  and :func:`kernel_applies`. Under ``jit`` (``x`` a tracer) the device is decided when the
  computation is lowered: ``jaxlp.quantize`` stages both the kernel and the spec with
  ``lax.platform_dependent`` and the platform the computation is compiled for picks one,
  so this returns False for tracers. Either way the bits are the same.

  Args:
    x: the array (or array-like) to be quantized.
    fmt: the format.
    rounding: the rounding mode.

  Returns:
    bool (False, not an error, for an unsupported format, rounding or dtype).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp import pallas
    >>> # small arrays (fewer than MIN_PALLAS_SIZE elements) always take the spec
    >>> pallas.can_use_pallas_quantize(jnp.ones(8), F.mx(F.E4M3FN))
    False
  """
  return on_gpu(x) and kernel_applies(fmt, jnp.shape(x), jnp.result_type(x), rounding)


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


def _block_kernel(key_ref, tw_ref, x_ref, o_ref, *, fmt, rounding, rand_bits, geom, block_rows,
                  width):
  rows, cols, tr, tc = geom
  x = x_ref[...]
  bits = B.to_bits(x.astype(jnp.float32))
  # |x| bits compared as int32 (same order: sign bit cleared); max over the block row.
  mag_i = (bits & B.u32(B.ABS_MASK)).astype(jnp.int32)
  mxb = jnp.max(mag_i, axis=1, keepdims=True).astype(jnp.uint32)
  scaled = isinstance(fmt, ScaledBlockFormat)
  if not scaled:
    mxb = jnp.broadcast_to(mxb, bits.shape)
  if rounding == "stochastic":
    nct = cdiv(cols, tc)
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
  if scaled:  # the block scales of a row's (block_rows, 1) maxima, then the elements
    out = fmt.round_blocks(bits, mxb, (tw_ref[0], tw_ref[1]), rounding, rand, rand_bits)
  else:
    out = _block_round(fmt, bits, mxb, rounding, rand, rand_bits)
  o_ref[...] = B.from_bits(out).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------
def _run_elementwise(x, kw, fmt, rounding, rand_bits, interpret, block_size):
  n = x.size
  bs = block_size or min(DEFAULT_BLOCK_SIZE, next_pow2(n))
  nblk = cdiv(n, bs)
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
  R, C = round_up(rows, tr), round_up(cols, tc)
  x2 = jnp.pad(x.reshape(rows, cols), ((0, R - rows), (0, C - cols)))
  nb = (R // tr) * (C // tc)
  blocks = x2.reshape(R // tr, tr, C // tc, tc).transpose(0, 2, 1, 3).reshape(nb, tr * tc)
  width = next_pow2(tr * tc)
  cap = MAX_PROGRAM_ELEMENTS_STOCHASTIC if rounding == "stochastic" else MAX_PROGRAM_ELEMENTS
  if isinstance(fmt, ScaledBlockFormat):
    cap = MAX_PROGRAM_ELEMENTS_SCALED
  br = block_rows or program_rows(fmt, x.shape, cap)
  nbp = round_up(nb, br)
  blocks = jnp.pad(blocks, ((0, nbp - nb), (0, width - tr * tc)))
  if isinstance(fmt, ScaledBlockFormat):  # the tensor scale: the spec's function, whole array
    mag = B.to_bits(x.astype(jnp.float32)) & B.u32(B.ABS_MASK)
    tw = fmt.tensor_words(jnp.max(mag, initial=B.u32(0)))
  else:
    tw = jnp.zeros((2,), jnp.uint32)
  kernel = functools.partial(_block_kernel, fmt=fmt, rounding=rounding, rand_bits=rand_bits,
                             geom=geom, block_rows=br, width=width)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(blocks.shape, x.dtype),
      grid=(nbp // br,),
      in_specs=[pl.BlockSpec((2,), lambda i: (0,)), pl.BlockSpec((2,), lambda i: (0,)),
                pl.BlockSpec((br, width), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((br, width), lambda i: (i, 0)),
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
      name="jaxlp_quantize_block",
  )(kw, tw, blocks)
  out = out[:nb, :tr * tc].reshape(R // tr, C // tc, tr, tc).transpose(0, 2, 1, 3)
  return out.reshape(R, C)[:rows, :cols].reshape(x.shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4, 5, 6))
def _quantize_ste(x, kw, fmt, rounding, rand_bits, interpret, block_size):
  if x.size == 0:
    return x
  if is_elementwise(fmt):
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

  Returns:
    Array of x's shape and dtype, bit-identical to :func:`jaxlp.formats.quantize`
    (straight-through gradient).

  Raises:
    ValueError: ``fmt`` is a block layout the kernels do not implement (see
      :func:`supports`: e.g. blocks along another axis than the last, whole-tensor blocks,
      ``qpytorch_block``), or ``block_size`` is not a positive int; and the rounding, key
      and ``rand_bits`` errors of :func:`jaxlp.formats.quantize`.
    jaxlp.formats.DTypeError: ``x`` is not float32, float16 or bfloat16.
    TypeError: ``fmt`` is not a jaxlp format.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp import pallas
    >>> x = jnp.array([[1.0, 0.3, -2.5, 3.0]])
    >>> # MXFP4 block of 4: scale 0.5; -2.5 / 0.5 = -5 is a tie between -4 and -6: to even
    >>> pallas.quantize(x, F.mx(F.E2M1FN, 4), interpret=True)
    Array([[ 1.  ,  0.25, -2.  ,  3.  ]], dtype=float32)
    >>> pallas.quantize(jnp.array([1.0625, 1.1875]), F.E4M3, interpret=True)
    Array([1.  , 1.25], dtype=float32)
  """
  x, kw = prepare(x, fmt, rounding, key=key, rand_bits=rand_bits)
  check_block_axis(fmt, x.shape)  # supports() reads the axis modulo ndim
  if not supports(fmt, x.shape):
    raise ValueError(f"pallas.quantize: no kernel for fmt={fmt!r} on shape {x.shape}; use "
                     "jaxlp.quantize (which falls back to the spec)")
  if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool)
                                 or block_size < 1):
    raise ValueError(f"pallas.quantize: block_size must be a positive int, got {block_size!r}")
  return quantize_words(x, kw, fmt, rounding, rand_bits, interpret=interpret,
                        block_size=block_size)


def quantize_words(x, kw, fmt, rounding: str, rand_bits=None, *, interpret=False,
                   block_size=None):
  """The kernel on validated arguments (see :func:`jaxlp.formats._quantize.prepare`)."""
  return _quantize_ste(x, kw, fmt, rounding, rand_bits, interpret, block_size)
