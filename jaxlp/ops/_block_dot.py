"""Dispatch of the exactly specified block dot products (``DotPolicy(block_dot="exact")``)
and the FP8 fast mode (``block_dot="fp8"``).

The exact bits are defined in ``jaxlp/formats/_block_dot.py`` (K-blocks, block partials
from integer significands rounded once, flush, the declared accumulation), below both this
module and the Pallas kernel. Implementations with those bits: ``block_dot_reference``
there (pure jnp: an int32 dot per K-block in a ``lax.scan``, any backend),
:func:`block_dot_xla_int8` here (one batched XLA int8 x int8 -> int32 ``dot_general`` over
(nblocks, block) batch dims, then the declared accumulation; needs <= 7-bit significands)
and the Pallas kernel in ``jaxlp/pallas/_block_gemm.py``. :func:`block_dot` dispatches on
the platform the computation is compiled for; which implementation a GPU runs is a
:class:`jaxlp.DotPolicy` field (``gpu_impl``, default :data:`GPU_IMPL`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp._util import cdiv
from jaxlp.formats import _bits as B
from jaxlp.formats._block import MXFormat
from jaxlp.formats._block_dot import (
    accumulate,
    block_dot_reference,
    check_exact_formats,
    check_operands,
    int32_exact,
    operand_significands,
    scale_exact,
    tensor_scale,
    two_level_values,
)
from jaxlp.formats._float_format import FloatFormat
from jaxlp.formats._nvfp4 import ScaledBlockFormat
from jaxlp.pallas._block_gemm import block_gemm, fp8_block_gemm
from jaxlp.pallas._limb_gemm import limb_gemm

BLOCK_DOTS = (None, "exact", "fp8")
IMPLS = ("reference", "xla_int8", "pallas")

#: The default implementation :func:`block_dot` runs on a GPU (``DotPolicy.gpu_impl``; every
#: one gives the same bits; CPU always runs the reference): "auto", "pallas", "xla_int8" or
#: "reference". A default, not a switch: choose per policy.
#: "pallas" is the integer-tensor-core kernel. Measured on an H100 (2026-11-26,
#: ``benchmarks/block_gemm.py``) at 4096^3 and 8192^3, before the kernel's fast scaling was
#: added (not measured since):
#: - HBFP8: 11-12 TFLOP/s, against 1.4-1.8 for the reference;
#: - MXINT8: 20-22 TFLOP/s, against 0.7.
#: "xla_int8", the batched XLA int8 dot, needs a (K-blocks, M, N) int32 intermediate (8-86
#: GiB there).
#: "auto": GEMMs with few output tiles and many K-blocks take "xla_int8", the rest "pallas"
#: with the Pallas operand preparation (``PREP`` in ``jaxlp/pallas/_block_gemm.py``). The
#: kernel's parallelism is its output tiles, each looping over every K-block in order: a
#: weight gradient of ResNet-18 (batch 128) such as (576, 131072) x (131072, 64) has 5 tiles
#: of 128 x 128 for 128 K-blocks of 1024, a few programs on a GPU of 132 SMs. "xla_int8"
#: computes every K-block's integer dot at once (one batched int8 GEMM into a (K-blocks, M,
#: N) int32 array, 19 MB there) and then runs the declared accumulation. The rule: fewer
#: than :data:`SPLIT_TILES` tiles of 128 x 128, at least 2 K-blocks and an intermediate of
#: at most :data:`SPLIT_MAX_BYTES`. Measured on an H200 (jax 0.11.2, 2026-11-27,
#: ``benchmarks/layers.py --gpu-impl auto,pallas``, one run): the exact HBFP8 ResNet-18 step
#: (batch 128) took 37.8 ms with "auto" against 53.2 ms with "pallas", the same bits
#: (``tests/ops/test_block_dot_gpu.py`` passed there); its compile took 131 s against 57 s.
GPU_IMPL = "auto"
GPU_IMPLS = ("auto", "pallas", "xla_int8", "reference")
SPLIT_TILES = 32
SPLIT_MAX_BYTES = 256 << 20
#: The default route of the Pallas kernel on a GPU (``DotPolicy.gpu_route``;
#: ``jaxlp/pallas/_block_gemm.py``): "auto" (bf16 tensor
#: cores, with one float32 add per output per K-block instead of an int -> float conversion
#: and scaling, on the tiles whose block exponents allow it; int8 on the others) or "int8"
#: (integer tensor cores everywhere). Both give the reference's bits. Measured on an H100
#: (2026-11-26, ``benchmarks/block_gemm.py`` at 8192^3, plain and 2^U{-12..12}-scaled
#: K-blocks): "auto" gave the reference's bits in every case and ran at 103-115 TFLOP/s
#: (HBFP8) and 172-197 (MXINT8), against 35 and 52 for "int8".
GPU_ROUTE = "auto"
GPU_ROUTES = ("auto", "int8")

#: The default GEMM of the fp8 fast mode on a GPU for per-K-block (MX) scales
#: (``DotPolicy.fp8_gpu_impl``): "pallas" (``fp8_block_gemm``
#: in ``jaxlp/pallas/_block_gemm.py``: the blocks summed inside one kernel) or "xla" (one
#: batched fp8 ``dot_general`` over the K-blocks, then the scaled sum: a (K-blocks, M, N)
#: float32 intermediate, 64 GiB at 8192^3). Neither is bit-exact. Measured on an H100
#: (jax 0.11.2, 2026-11-26): "pallas" ran the 8192^3 MXFP8 GEMM at 102 TFLOP/s, which "xla"
#: cannot hold in memory, and the ResNet-18 ``mxfp8_fp8`` step in 49.8 ms, against 64.8 ms
#: with "xla" in an earlier run on the same kind of machine. Per-tensor scales always take
#: the single XLA fp8 dot.
FP8_GPU_IMPL = "pallas"
FP8_GPU_IMPLS = ("pallas", "xla")


# ---------------------------------------------------------------------------------------
# The fp8 fast mode's formats
# ---------------------------------------------------------------------------------------
_FP8 = {"e4m3fn": (jnp.float8_e4m3fn, 8, 3), "e5m2": (jnp.float8_e5m2, 15, 2)}


def fp8_kind(fmt) -> str | None:
  """The fp8 dtype (``"e4m3fn"`` / ``"e5m2"``) the fp8 fast mode casts ``fmt`` values to, or
  None when ``fmt`` has no fp8 twin: ``mx(FloatFormat)`` with <= 3 mantissa bits (per-block
  scales) or an elementwise ``FloatFormat`` with <= 3 mantissa bits (per-tensor scale);
  <= 2 mantissa bits use e5m2 (wider range), 3 use e4m3fn."""
  elem = fmt.elem if isinstance(fmt, MXFormat) else fmt
  if not isinstance(elem, FloatFormat) or elem.man_bits > 3:
    return None
  return "e5m2" if elem.man_bits <= 2 else "e4m3fn"


# ---------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------
#: K-blocks per step of :func:`_scan_blocks`' loop (the same operations in the same order
#: unrolled: on a GPU each loop step also reads its predicate back to the host)
SCAN_UNROLL = 16


def _scan_blocks(n_blocks, qa, qb):
  """The declared accumulation over K-blocks of int32 partial dots n_blocks (nb, M, N)."""
  def partial(n, qa_b, qb_b):
    return scale_exact(n, qa_b[:, None] + qb_b[None, :])

  def body(s, x):
    return accumulate(s, partial(*x)), None

  s0 = partial(n_blocks[0], qa[:, 0], qb[:, 0])
  s, _ = lax.scan(body, s0, (n_blocks[1:], qa.T[1:], qb.T[1:]),
                  unroll=max(1, min(SCAN_UNROLL, n_blocks.shape[0] - 1)))
  return s


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def block_dot_xla_int8(a, b, g: int, bits_a: int, bits_b: int):
  """The same bits as :func:`block_dot_reference` with ONE XLA int8 x int8 -> int32
  ``dot_general`` batched over the K-blocks ((nb, M, g) x (nb, g, N) -> (nb, M, N)), then the
  declared accumulation. Needs significands of <= 7 bits (int8)."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  check_operands(a, b, g, bits_a, bits_b)
  if max(bits_a, bits_b) > 7:
    raise ValueError(f"block_dot_xla_int8: int8 significands need <= 7 bits, got {bits_a} "
                     f"and {bits_b}")
  M, N = a.shape[0], b.shape[1]
  ka, qa, kb, qb = operand_significands(a, b, g, bits_a, bits_b)
  if ka.shape[1] == 0:
    return jnp.zeros((M, N), jnp.float32)
  # K-blocks zero-padded to a multiple of 4 (exact: zeros add nothing). XLA:GPU (jax 0.11.2,
  # H100, 2026-11-26) returned twice the int32 dot for 2-element K-blocks.
  pad = (0, 0), (0, 0), (0, -g % 4)
  ka, kb = jnp.pad(ka.astype(jnp.int8), pad), jnp.pad(kb.astype(jnp.int8), pad)
  n = lax.dot_general(ka, kb, (((2,), (2,)), ((1,), (1,))),
                      preferred_element_type=jnp.int32)  # (nb, M, N)
  return _scan_blocks(n, qa, qb)


def block_dot_pallas(a, b, g: int, bits_a: int, bits_b: int, *, interpret: bool = False,
                     route: str = GPU_ROUTE, prep: str | None = None):
  """The same bits with the Pallas tensor-core kernel (``jaxlp/pallas/_block_gemm.py``);
  ``prep`` None: that module's ``PREP``."""
  return block_gemm(a, b, g, bits_a, bits_b, interpret=interpret, route=route, prep=prep)


def splits_k_blocks(M: int, N: int, K: int, g: int) -> bool:
  """Whether ``gpu_impl="auto"`` runs an (M, K) x (K, N) GEMM with K-blocks of ``g`` as
  "xla_int8" (see :data:`SPLIT_TILES`) rather than "pallas"."""
  nb = cdiv(K, g) if K else 0
  return (cdiv(M, 128) * cdiv(N, 128) < SPLIT_TILES and nb >= 2
          and 4 * nb * M * N <= SPLIT_MAX_BYTES)


def block_dot_gpu_auto(a, b, g: int, bits_a: int, bits_b: int, *, interpret: bool = False,
                       route: str = GPU_ROUTE):
  """``gpu_impl="auto"``: "xla_int8" where :func:`splits_k_blocks`, else "pallas" with
  the Pallas operand preparation (``prep="pallas"``)."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  if splits_k_blocks(a.shape[0], b.shape[1], a.shape[1], g):
    return block_dot_xla_int8(a, b, g, bits_a, bits_b)
  return block_dot_pallas(a, b, g, bits_a, bits_b, interpret=interpret, route=route,
                          prep="pallas")


_IMPL_FNS = {"reference": block_dot_reference, "xla_int8": block_dot_xla_int8,
             "pallas": block_dot_pallas, "auto": block_dot_gpu_auto}


def check_gpu_choice(value, allowed, what: str):
  """``value`` if it is one of ``allowed``, else a ValueError naming ``what``."""
  if value not in allowed:
    raise ValueError(f"{what}={value!r} not in {allowed}")
  return value


def narrow(g: int, bits_a: int, bits_b: int, scales=None) -> bool:
  """Whether a GEMM fits the int8 implementations (``xla_int8``, ``block_gemm``): no tensor
  scales, significands of <= 7 bits and one exact int32 dot per K-block. The others (MXFP6
  E3M2, MXFP8, NVFP4, wider ``BlockFormat``) take ``limb_gemm`` on a GPU."""
  return scales is None and max(bits_a, bits_b) <= 7 and int32_exact(g, bits_a, bits_b)


def block_dot(a, b, g: int, bits_a: int, bits_b: int, *, impl: str | None = None,
              gpu_impl: str = GPU_IMPL, gpu_route: str = GPU_ROUTE, prec=None, scales=None):
  """``a`` (M, K) . ``b`` (K, N) with the exact block bits (module docstring).

  ``impl=None`` follows the platform the computation is compiled for
  (``lax.platform_dependent``): every platform but CUDA runs the reference; CUDA runs
  ``gpu_impl`` (:data:`GPU_IMPLS`; the Pallas kernel on ``gpu_route``, :data:`GPU_ROUTES`)
  where the GEMM is :func:`narrow`, else (with ``gpu_impl`` "pallas" or "auto") the limb
  kernel ``limb_gemm`` (``jaxlp/pallas/_limb_gemm.py``, bf16 tensor cores) or the
  reference. All give the same bits.

  ``prec``: ``(prec_a, prec_b)``, the operands' significant bits (``SigSpec.prec``; the
  limb kernel's limb width). ``scales``: ``(sa, sb)``, per-tensor float32 scales of
  two-level operands (None for an operand without one; :func:`two_level_operand`).
  """
  check_gpu_choice(gpu_impl, GPU_IMPLS, "block_dot: gpu_impl")
  check_gpu_choice(gpu_route, GPU_ROUTES, "block_dot: gpu_route")
  if scales is not None:
    scales = tuple(jnp.float32(1.0) if s is None else jnp.asarray(s, jnp.float32)
                   for s in scales)
  is_narrow = narrow(g, bits_a, bits_b, scales)
  if impl is not None:
    if impl not in IMPLS:
      raise ValueError(f"block_dot: impl={impl!r} not in {IMPLS}")
    if is_narrow:
      return _IMPL_FNS[impl](a, b, g, bits_a, bits_b)
    if impl == "xla_int8":
      raise ValueError(f"block_dot: impl='xla_int8' needs <= 7-bit significands, one int32 "
                       f"dot per K-block and no tensor scales, got {bits_a}- and {bits_b}-bit "
                       f"significands, K-block {g}, scales={scales is not None}")
    if impl == "reference":
      return block_dot_reference(a, b, g, bits_a, bits_b, scales)
    return limb_gemm(a, b, g, bits_a, bits_b, scales, prec=prec)
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  check_operands(a, b, g, bits_a, bits_b, limbs=True)
  if is_narrow:
    return _dispatch(a, b, g, bits_a, bits_b, gpu_impl, gpu_route)
  return _dispatch_wide(a, b, scales, g, bits_a, bits_b, prec, gpu_impl)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _dispatch(a, b, g, bits_a, bits_b, gpu_impl, gpu_route):
  def reference(a, b):
    return block_dot_reference(a, b, g, bits_a, bits_b)

  def gpu(a, b):
    if gpu_impl in ("pallas", "auto"):
      return _IMPL_FNS[gpu_impl](a, b, g, bits_a, bits_b, route=gpu_route)
    return _IMPL_FNS[gpu_impl](a, b, g, bits_a, bits_b)

  return lax.platform_dependent(a, b, cuda=gpu, default=reference)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _dispatch_wide(a, b, scales, g, bits_a, bits_b, prec, gpu_impl):
  ops = (a, b) if scales is None else (a, b, *scales)

  def unpack(ops):
    return ops[0], ops[1], (None if len(ops) == 2 else ops[2:])

  def reference(*ops):
    a, b, s = unpack(ops)
    return block_dot_reference(a, b, g, bits_a, bits_b, s)

  def gpu(*ops):
    if gpu_impl not in ("pallas", "auto"):
      return reference(*ops)
    a, b, s = unpack(ops)
    return limb_gemm(a, b, g, bits_a, bits_b, s, prec=prec)

  return lax.platform_dependent(*ops, cuda=gpu, default=reference)


# ---------------------------------------------------------------------------------------
# Two-level (tensor-scaled) operands
# ---------------------------------------------------------------------------------------
class Scaled(NamedTuple):
  """An operand of a two-level format in an exact block dot: ``values`` (the elements times
  their block scales, exact in float32: ``two_level_values``) and the float32 per-tensor
  ``scale``; the operand's value is ``values * scale`` exactly (in general not a float32)."""

  values: jax.Array
  scale: jax.Array


def is_two_level(fmt) -> bool:
  """Whether ``fmt`` carries a per-tensor scale (``nvfp4()``: ``tensor_scale=True``)."""
  return isinstance(fmt, ScaledBlockFormat) and fmt.tensor_scale


def two_level_operand(x, fmt, quantize_values) -> Scaled:
  """:class:`Scaled` of ``x`` in the two-level format ``fmt``: ``quantize_values(f)`` quantizes
  float32 ``x`` with ``f = two_level_values(fmt)`` in the operand's own geometry (the same
  elements, block scales and noise as ``fmt``); the tensor scale comes from ``max |x|``."""
  return Scaled(quantize_values(two_level_values(fmt)), tensor_scale(x, fmt))


def split_scaled(x):
  """``(values, scale)`` of a :class:`Scaled` operand, ``(x, None)`` of an array."""
  return (x.values, x.scale) if isinstance(x, Scaled) else (x, None)


def map_values(fn, x):
  """``fn`` applied to an operand's values (a :class:`Scaled` keeps its scale)."""
  return x._replace(values=fn(x.values)) if isinstance(x, Scaled) else fn(x)


def check_exact_operands(g: int, fmt_a, fmt_b, what: str, *, two_level: bool = True):
  """``check_exact_formats`` for a GEMM's operand formats; ``two_level=False`` (convolutions)
  also refuses two-level formats and 2-D tiles of ``ScaledBlockFormat`` with a
  NotImplementedError."""
  if not two_level:
    for fmt in (fmt_a, fmt_b):
      if is_two_level(fmt) or (isinstance(fmt, ScaledBlockFormat) and fmt.tile is not None):
        raise NotImplementedError(
            f"jaxlp {what}: block_dot='exact' supports {fmt!r} (a per-tensor scale or 2-D "
            "tiles) in jaxlp.dot_general only; for convolutions use 1-D blocks with "
            "tensor_scale=False (e.g. nvfp4(tensor_scale=False)) or block_dot=None")
  check_exact_formats(g, fmt_a, fmt_b, what)


def scaled_tile_blocks(fmt: ScaledBlockFormat, perm, ndim: int):
  """The blocks of ``ScaledBlockFormat`` 2-D tiles of the array ``transpose(x, perm)``'s
  last two axes (``perm`` None: as given) in ``jaxlp.dot_general``'s ``(rows, cols, tile)``
  form, one entry per axis of ``x``: tile rows along the second-last axis, tile columns
  along the last, one block per index of every leading axis (a list: each entry's changes
  along K are K-block boundaries)."""
  if ndim == 0:
    return []
  lay = tuple(range(ndim)) if perm is None else tuple(perm)
  tr, tc = fmt.tile
  if ndim == 1:
    return [((lay[0],), (), (tc, None))]
  return ([((a,), (), (1, None)) for a in lay[:-2]]
          + [((lay[-2],), (), (tr, None)), ((lay[-1],), (), (tc, None))])


# ---------------------------------------------------------------------------------------
# FP8 fast mode
# ---------------------------------------------------------------------------------------
def _fp8_scaled(x, kind: str, g: int | None, exact_scale: bool):
  """``x`` (R, K) -> (fp8 values (R, nb, g'), scale exponents (R, nb)): per K-block (g) or
  per tensor (g None: one block of K). ``exact_scale``: MX's own scale (max exponent ->
  emax), else one binade of headroom (no overflow whatever the mantissa of the max)."""
  dtype, emax, _ = _FP8[kind]
  R, K = x.shape
  gg = max(K, 1) if g is None else g
  nb = cdiv(K, gg) if K else 0
  x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * gg - K))).reshape(R, nb, gg)
  mag = B.to_bits(x) & B.u32(B.ABS_MASK)
  if g is None:
    mx = jnp.max(mag, initial=B.u32(0), keepdims=True).reshape(1, 1, 1)
    mx = jnp.broadcast_to(mx, (R, nb, 1))
  else:
    mx = jnp.max(mag, axis=-1, keepdims=True, initial=B.u32(0))
  fl = B.floor_log2(jnp.minimum(mx, B.u32(0x7F7FFFFF)))
  s = jnp.where(fl < -149, 0, fl - (emax if exact_scale else emax - 1))
  s = jnp.clip(s, -127, 127)
  return jnp.ldexp(x, -s).astype(dtype), s[..., 0]


def fp8_dot(a, b, fmt_a, fmt_b, g: int | None, *, gpu_impl: str = FP8_GPU_IMPL):
  """FP8 fast mode: ``a`` (M, K) . ``b`` (K, N) of ``fmt_a`` / ``fmt_b`` values cast to fp8
  (:func:`fp8_kind`) with power-of-two scales -- per K-block of ``g`` for MX operands, per
  tensor otherwise -- one ``lax.dot_general`` on the fp8 arrays (batched over the K-blocks)
  with ``preferred_element_type=float32``, scaled back and summed over the blocks.

  NOT bit-exact: the cast is exact for MX values and for float values whose range fits
  the fp8 type under one scale, but the dot's accumulation is the hardware's (Hopper's fp8
  tensor cores accumulate in a format narrower than fp32), and the sum over K-blocks is
  XLA's ``sum``. Its error against the exact emulation is measured by
  ``benchmarks/block_gemm.py``. ``gpu_impl`` (:data:`FP8_GPU_IMPLS`): the GEMM a GPU runs
  for per-K-block scales (see :data:`FP8_GPU_IMPL`).
  """
  check_gpu_choice(gpu_impl, FP8_GPU_IMPLS, "fp8_dot: gpu_impl")
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  ka, kb = fp8_kind(fmt_a), fp8_kind(fmt_b)
  if ka is None or kb is None:
    raise ValueError(f"fp8_dot: {fmt_a!r} / {fmt_b!r} have no fp8 twin (fp8 mode takes mx "
                     "or FloatFormat values with <= 3 mantissa bits)")
  blocked = isinstance(fmt_a, MXFormat) or isinstance(fmt_b, MXFormat)
  gg = g if blocked else None
  a8, sa = _fp8_scaled(a, ka, gg, isinstance(fmt_a, MXFormat))
  b8, sb = _fp8_scaled(b.T, kb, gg, isinstance(fmt_b, MXFormat))
  if not blocked or gpu_impl == "xla" or a8.shape[1] == 0:
    return _fp8_xla(a8, sa, b8, sb)

  def pallas(a8, sa, b8, sb):
    return fp8_block_gemm(a8, sa, b8, sb)

  return lax.platform_dependent(a8, sa, b8, sb, cuda=pallas, default=_fp8_xla)


def _fp8_xla(a8, sa, b8, sb):
  d = lax.dot_general(a8, b8, (((2,), (2,)), ((1,), (1,))),
                      preferred_element_type=jnp.float32)  # (nb, M, N)
  e = sa.T[:, :, None] + sb.T[:, None, :]
  return jnp.sum(jnp.ldexp(d, e), axis=0)
