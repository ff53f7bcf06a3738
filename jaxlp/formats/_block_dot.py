"""The exact block dot product's definition (``DotPolicy(block_dot="exact")``): the bits
that every implementation must equal, in pure jnp (any backend).

Block formats with integer significands make a dot product over a block of the contraction
axis an integer dot product times a power of two: ``BlockFormat`` / ``hbfp`` /
``hbfp_batched`` (elements ``k * 2**(e - man_bits)``, ``|k| <= 2**man_bits - 1``), MXINT8
(``mx("int8")``, ``k in [-128, 127]`` times ``2**(s - 6)``), the MX float formats MXFP4,
MXFP6 and MXFP8 (``mx(E2M1FN)``, ``mx(E2M3FN / E3M2FN)``, ``mx(E4M3FN / E5M2)``: every value
of a block is a multiple of the element's quantum times the block's power-of-two scale) and
the two-level formats (``nvfp4()`` / :class:`~jaxlp.formats.ScaledBlockFormat` with UE4M3 or
E8M0 block scales: elements ``q`` times block scales ``sb``, plus, with
``tensor_scale=True``, one float32 scale ``g`` per tensor). :func:`significand_spec` gives
each format's significand bits. The "exact" bits of a GEMM ``C = A (M, K) . B (K, N)`` of
quantized operands are defined as:

1. **K-blocks**: K is cut into consecutive blocks of ``g`` elements (the last one may be
   shorter), where ``g`` is the coarsest length both operands' blocks refine: each operand's
   block length along its contraction axis (tile size, ``block_size``, the whole axis, or 1
   when its blocks run along another axis), combined by ``gcd`` (a whole-axis block imposes
   nothing). :func:`contraction_blocks` computes it.
2. **Block partials**: for output (m, n) and K-block b,
   ``p = fl32(G * sum_k a[m, k] * b[k, n])`` over the block: the exact dot product of the
   operands' values, times ``G = ga * gb``, the product of the operands' tensor scales (1
   for an operand without one), rounded ONCE to float32 (round to nearest even). For a
   two-level operand ``a[m, k] = q * sb`` (:func:`two_level_values`: elements times block
   scales, exact in float32) and its value is ``a[m, k] * ga``: the tensor scales multiply
   each block's exact dot before it is rounded, so ``p`` is the rounding of the exact dot of
   the operands' true values (not of their float32 decodings ``fl(q * fl(g * sb))``).
   On every backend it is computed from integer significands: per (row, K-block) of A and
   per (K-block, column) of B, ``x = k * 2**Q`` with ``Q = max(floor(log2 |x|max') -
   (bits - 1), -149)`` (``|x|'``: negative exact powers of two count one binade lower, so
   that ``-2**t`` is ``-2**bits * 2**Q``), ``|k| <= 2**bits``; the dot ``n`` of the
   significands is an exact integer and ``p = fl32(n * ma * mb * 2**(Qa + Qb + ea + eb))``
   with ``ga = ma * 2**ea``, ``gb = mb * 2**eb`` (24-bit ``ma``, ``mb``).
3. **Range**: a partial that overflows is ``±inf``; a partial or running sum below
   ``2**-126`` in magnitude is flushed to zero, keeping its sign (XLA:CPU flushes float32
   subnormals in its arithmetic; flushing explicitly gives the same bits where the hardware
   keeps them). A block holding a non-finite value (the formats turn such blocks into NaN)
   makes its partials NaN; so does a NaN tensor scale (a tensor holding inf or NaN).
4. **Accumulation**: ``s = p_0; for b in 1, 2, ...: s = flush(fl32(s + p_b))``, K-blocks in
   ascending order, sequentially, in float32 (never an FMA: the partials are built from
   integer bits). There is no initial ``+0.0`` (XLA folds ``0 + x`` into ``x``, which
   differs for ``x = -0.0``).

**Why the integer dot is exact, and when float32 holds it.** Two block values are
``ka * 2**Qa`` and ``kb * 2**Qb``: their product is ``ka * kb * 2**(Qa + Qb)``, exact in
float32 when ``ka * kb`` has at most 24 significant bits (always here: at most 8 + 8). Every
partial sum of a K-block is a multiple of ``2**(Qa + Qb)`` below ``g * 2**(bits_a + bits_b)``
of them, so the block sum is exact in float32, in any order and with any alignment that keeps
24 bits, when ``g * 2**(bits_a + bits_b) <= 2**24``, and in int32 when it is ``<= 2**31 -
1``. The significand bits come from the element format's exponent range (``bits = emax -
emin + man_bits + 1``, the span from its quantum to its top binade): MXFP4 (E2M1: 4 bits,
``|k| <= 12``): 32 * 2**8 = 2**13; NVFP4 (E2M1 times 4-bit UE4M3 scales: 8 bits, ``|k| <=
180``): 16 * 2**16 = 2**20; MXFP6 E2M3 (6): 2**17, E3M2 (9): 2**23 -- all exact in float32.
MXFP8's significands are too wide: E4M3FN spans 2**-9 .. 448 (18 bits: 32 * 2**36 = 2**41)
and E5M2 2**-16 .. 57344 (32 bits: 2**69), which neither float32 nor int32 holds. There the
significands are cut into limbs of ``W`` bits (:func:`split_limbs`, ``g * 2**(2W) <=
2**24``: W = 9 for blocks of 32), every limb-pair dot is exact (in int32, or in float32 on a
tensor core: each limb is a window of a significand with at most 4 significant bits, exact in
bfloat16), and the dots are assembled as integer digits of ``W`` bits (:func:`digits_of`),
multiplied by the tensor scales' 48-bit significand product (:func:`tensor_digits`) and
rounded once with a sticky bit for the bits below (:func:`normalize_digits`,
:func:`round_mag`). MXFP8 E4M3 takes 2 x 2 limb dots per K-block, E5M2 4 x 4.

Relation to today's emulation (``block_dot=None``: fp32 products, fp32 sums in XLA's dot):
the products of two block values are exact in float32, and so is every partial sum within a
block of <= 2**(24 - bits_a - bits_b) elements (they are multiples of ``2**(Qa+Qb)`` below
``2**24`` of them). The two differ in how the sums cross block boundaries: XLA's dot adds
products in its own (unspecified, backend- and shape-dependent) order and rounds partial
sums that mix blocks; "exact" rounds each block once and adds the blocks in a declared order.
Two-level formats differ further: the emulation multiplies the decoded values
``fl(q * fl(g * sb))``, which are rounded twice. Measured differences: README, "Block formats
on tensor cores"; ``benchmarks/block_gemm.py``.

**Blackwell's block-scaled MMAs.** NVIDIA Blackwell runs these formats natively:
``tcgen05.mma`` (and ``mma.sync`` on sm_120) with ``.kind::mxf8f6f4``, ``.kind::mxf4`` and
``.kind::mxf4nvf4`` and ``.block_scale`` computes ``D = C + sum_k (A[i, k] * SFA[i, k /
SV]) * (B[j, k] * SFB[j, k / SV])`` with one scale per ``SV = 32`` elements of K (UE8M0, MX)
or ``SV = 16`` (UE4M3, NVFP4; ``scale_vec::4X``), float32 ``C`` and ``D``. That is all the
public documentation defines: the order in which products and scale blocks are added inside
one instruction (K = 32 to 64 per ``mma.sync``), the width and rounding of its internal
alignment and of the addition to ``C``, and the order across instructions (the kernel's K
loop) are not specified, and NVFP4's per-tensor scales are not operands of the instruction:
block-scaled GEMMs apply their product as the epilogue's ``alpha``, once, to the float32
result. Measurements of B200's tensor cores (Khattak and Mikaitis, 2025) model its 8-, 16-
and 19-bit input formats bit-accurately but not the block-scaled kinds; Hopper's fp8 MMA is
known to keep fewer than 24 bits in its accumulation. So these bits are a specification,
not a model of Blackwell: they equal a block-scaled MMA's result exactly where the
hardware's sums are exact -- a GEMM of one K-block without tensor scales whose block dot
the instruction keeps whole (NVFP4 and MXFP4 block dots are integers below ``2**20`` units,
so any accumulator of at least 24 bits does) -- and otherwise differ in the last bits of
the cross-block float32 sums (order, alignment, truncation) and, for NVFP4, in where the
tensor scales are rounded in (here inside each block's rounding, there once at the end).

:func:`block_dot_reference` is this definition in pure jnp (an int32 dot per K-block, or
limb dots and digits, in a ``lax.scan``). The other implementations with the same bits use
its parts (:func:`split_significands`, :func:`split_blocks`, :func:`split_limbs`,
:func:`scale_exact`, :func:`exact_partial`, :func:`accumulate`, :func:`check_operands`): the
batched XLA int8 dot and the dispatch (``block_dot``) in ``jaxlp/ops/_block_dot.py``, the
Pallas kernels in ``jaxlp/pallas/_block_gemm.py`` (significands of <= 7 bits) and
``jaxlp/pallas/_limb_gemm.py`` (wider ones and tensor scales, bf16 tensor cores). This
module sits below them (formats <- pallas <- ops), as ``formats/_quantize.py`` does for the
quantize kernels.

References:
  OCP Microscaling Formats (MX) Specification v1.0, 2023. NVIDIA, "Pretraining Large
  Language Models with NVFP4", arXiv:2509.25149, 2025. NVIDIA PTX ISA (``mma`` with
  ``.block_scale`` and ``.scale_vec_size``; ``tcgen05.mma`` block scaling:
  https://docs.nvidia.com/cuda/parallel-thread-execution/). NVIDIA CUTLASS,
  ``media/docs/cpp/blackwell_functionality.md`` ("Block Scaled GEMMs": the formula above,
  scale-factor vector sizes 16 / 32, UE4M3 / UE8M0 scale types). flashinfer-ai/flashinfer,
  ``flashinfer/gemm/kernels/dense_blockscaled_gemm_sm103.py`` (CUTLASS's block-scaled GEMM
  with the tensor scales as the epilogue's ``alpha``). F. A. Khattak and M.
  Mikaitis, "Accurate Models of NVIDIA Tensor Cores", arXiv:2512.07004, 2025. DeepSeek-AI,
  "DeepSeek-V3 Technical Report", arXiv:2412.19437, 2024 (§3.3: Hopper's fp8 GEMMs keep
  about 14 bits in accumulation).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp._util import cdiv
from jaxlp.formats import _bits as B
from jaxlp.formats._block import BlockFormat, MXFormat
from jaxlp.formats._float_format import FloatFormat
from jaxlp.formats._fparith import normalize
from jaxlp.formats._nvfp4 import ScaledBlockFormat

INT32_MAX = 2**31 - 1
#: Q of a block holding a non-finite value (any Qa + Qb >= NAN_Q // 2 gives NaN partials).
NAN_Q = 1 << 20
#: Limb path bounds (:func:`limb_plan`): limbs of at least one bit, at most 5 x 8 bits.
MAX_LIMB_BLOCK = 1 << 22
MAX_LIMB_BITS = 40


# ---------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------
class SigSpec(NamedTuple):
  """The integer significands of a block format's values (:func:`significand_spec`).

  ``bits``: magnitude bits, ``-2**bits <= k <= 2**bits - 1`` for every significand ``k`` of
  :func:`split_significands` (or ``|k| <= 2**bits`` of :func:`split_limbs`); ``prec``: the
  most significant bits any one ``k`` has (a float element's ``man_bits + 1``, times a
  UE4M3 block scale's 4), so that any window of ``k``'s bits is exact in bfloat16 where
  ``prec <= 8``; ``tensor_scale``: values carry a per-tensor float32 scale on top
  (:func:`two_level_values`)."""

  bits: int
  prec: int
  tensor_scale: bool = False


def _elem_span(elem: FloatFormat) -> int:
  """Bits between a float format's quantum ``2**(emin - man_bits)`` and its top binade."""
  return elem.emax - elem.emin + elem.man_bits + 1


def significand_spec(fmt) -> SigSpec | None:
  """:class:`SigSpec` of ``fmt``'s values in a block dot, or None (no integer significands).

  * ``BlockFormat(man_bits)`` / ``hbfp`` / ``hbfp_batched``: ``man_bits``.
  * MXINT8 (``mx("int8")``): 7 (``k in [-128, 127]`` times ``2**(s - 6)``).
  * ``mx(elem)`` with a float element: every value of a block is a multiple of the element
    quantum times the block scale, ``2**(s + emin - m)``, and below ``2**(s + emax + 1)``, so
    ``bits = emax - emin + m + 1``: 4 (E2M1, MXFP4), 6 (E2M3), 9 (E3M2), 18 (E4M3FN), 32
    (E5M2); ``prec = m + 1``.
  * :class:`~jaxlp.formats.ScaledBlockFormat` (``nvfp4()``) with E8M0 block scales: as
    ``mx``; with UE4M3 block scales ``sb = s4 * 2**(e - 3)`` (``8 <= s4 <= 15``) the values
    ``q * sb`` of a block are multiples of ``2**(e - 3)`` times the element quantum below
    ``2**(e + 1)`` times the element's top binade: four more bits (NVFP4: 8, ``|k| <= 180``),
    ``prec = m + 5`` (NVFP4: 6). With ``tensor_scale=True`` the per-tensor scale is not part
    of the values (:func:`two_level_values`). float32 block scales: None (24-bit scales).
  """
  if isinstance(fmt, BlockFormat):
    return SigSpec(fmt.man_bits, fmt.man_bits)
  if isinstance(fmt, MXFormat):
    if fmt.elem == "int8":
      return SigSpec(7, 7)
    return SigSpec(_elem_span(fmt.elem), fmt.elem.man_bits + 1)
  if isinstance(fmt, ScaledBlockFormat):
    if fmt.scale_fmt == "fp32":
      return None
    extra = 4 if fmt.scale_fmt == "ue4m3" else 0
    return SigSpec(_elem_span(fmt.elem) + extra, fmt.elem.man_bits + 1 + extra,
                   fmt.tensor_scale)
  return None


def significand_bits(fmt) -> int | None:
  """Magnitude bits of the integer significands of a block format (None: not one).

  ``BlockFormat(man_bits)``: ``man_bits``; MXINT8 (``mx("int8")``): 7; MX and two-level
  (``nvfp4()``) float formats: :func:`significand_spec`. Significands ``k`` of
  :func:`split_significands` satisfy ``-2**bits <= k <= 2**bits - 1``.
  """
  spec = significand_spec(fmt)
  return None if spec is None else spec.bits


def contraction_blocks(len_a: int, len_b: int, k: int) -> int:
  """The K-block length ``g`` of a GEMM from its operands' block lengths along K: ``gcd``,
  where a block over the whole axis (``>= k``) imposes nothing."""
  la = None if len_a >= k else len_a
  lb = None if len_b >= k else len_b
  if la is None and lb is None:
    return max(k, 1)
  if la is None or lb is None:
    return la if lb is None else lb
  return math.gcd(la, lb)


def int32_exact(g: int, bits_a: int, bits_b: int) -> bool:
  """Whether one int32 dot holds a K-block's significand dot exactly."""
  return g * (1 << (bits_a + bits_b)) <= INT32_MAX


def check_exact(g: int, bits_a: int, bits_b: int, what: str = "block_dot", *,
                limbs: bool = False):
  """Raise ValueError unless a K-block's significand dot is exact: in one int32 dot
  (:func:`int32_exact`), or, with ``limbs``, as a sum of limb dots (:func:`limb_plan`:
  K-blocks of at most :data:`MAX_LIMB_BLOCK`, significands of at most
  :data:`MAX_LIMB_BITS` bits)."""
  if int32_exact(g, bits_a, bits_b):
    return
  if limbs:
    if g <= MAX_LIMB_BLOCK and max(bits_a, bits_b) <= MAX_LIMB_BITS:
      return
    raise ValueError(
        f"jaxlp {what}: block_dot='exact' splits wide significands into limbs for K-blocks "
        f"of at most {MAX_LIMB_BLOCK} and significands of at most {MAX_LIMB_BITS} bits, got "
        f"K-block {g} with {bits_a}- and {bits_b}-bit significands")
  raise ValueError(
      f"jaxlp {what}: block_dot='exact' needs K-block * 2**(bits_a + bits_b) <= 2**31 - 1 "
      f"for an exact int32 dot, got K-block {g} with {bits_a}- and {bits_b}-bit "
      "significands; use smaller blocks or fewer mantissa bits")


def check_exact_formats(g: int, fmt_a, fmt_b, what: str = "block_dot"):
  """:func:`check_exact` for two formats (ValueError naming a format that has no integer
  significands). Limbs are allowed where both formats' significands have at most 8
  significant bits (MX float elements, ``nvfp4()``, ``BlockFormat`` up to 8 mantissa bits);
  wider ``BlockFormat`` significands keep the one-int32-dot bound."""
  specs = []
  for fmt in (fmt_a, fmt_b):
    spec = significand_spec(fmt)
    if spec is None:
      raise ValueError(f"jaxlp {what}: block_dot='exact' needs block formats with integer "
                       f"significands, got {fmt!r}")
    specs.append(spec)
  check_exact(g, specs[0].bits, specs[1].bits, what,
              limbs=max(specs[0].prec, specs[1].prec) <= 8)


# ---------------------------------------------------------------------------------------
# Two-level formats: the values without the tensor scale
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TwoLevelValues(ScaledBlockFormat):
  """A two-level :class:`~jaxlp.formats.ScaledBlockFormat` (``tensor_scale=True``) whose
  decoded values leave out the tensor scale: ``q * sb`` (elements times block scales, exact
  in float32 for UE4M3 block scales) instead of step 5's ``fl(q * fl(g * sb))``. Elements
  and block scales are the format's own (steps 1-4, the same noise); the exact block dot
  multiplies the tensor scales ``g`` in before it rounds (:func:`block_dot_reference`).
  Built by :func:`two_level_values`; runs wherever the format runs (spec and Pallas quantize
  kernel both call :meth:`round_blocks`)."""

  def __repr__(self):
    return f"two_level_values({super().__repr__()})"

  def round_blocks(self, bits, mxb, tw, rounding, rand, rand_bits, *, fence=None):
    sb, r, _, ok = self.scale_chain(mxb, tw, fence=fence)
    q = self.round_elements(bits, r, rounding, rand, rand_bits)
    out = self.decode_elements(q, normalize(sb))
    return jnp.where(ok, out, B.u32(B.QNAN_BITS))


def two_level_values(fmt: ScaledBlockFormat) -> TwoLevelValues:
  """:class:`TwoLevelValues` of a two-level format (same geometry and scales)."""
  return TwoLevelValues(**{f.name: getattr(fmt, f.name) for f in dataclasses.fields(fmt)})


def tensor_scale(x, fmt: ScaledBlockFormat):
  """The float32 per-tensor scale ``g`` (step 1 of :class:`~jaxlp.formats.ScaledBlockFormat`)
  of ``x``: the ``tensor_scale`` part of ``fmt.encode(x)``, from ``max |x|`` alone."""
  mag = B.to_bits(jnp.asarray(x).astype(jnp.float32)) & B.u32(B.ABS_MASK)
  return B.from_bits(fmt.tensor_words(jnp.max(mag, initial=B.u32(0)))[0])


# ---------------------------------------------------------------------------------------
# Integer significands and exact scaling
# ---------------------------------------------------------------------------------------
def split_significands(x, g: int, bits: int):
  """Integer significands of ``x`` (R, K) (float32 values of a block format) per K-block.

  Returns ``(k, q)``: ``k`` (R, nb, g) int32 with ``x[r, b*g + i] == k[r, b, i] * 2**q[r, b]``
  (K zero-padded to ``nb * g``), ``q`` (R, nb) int32, ``NAN_Q`` for a block holding a
  non-finite value. Exact provided ``x`` lies on its format's block grid (it does after
  quantization with a format of ``bits`` significand bits and blocks that refine ``g``).
  """
  R, K = x.shape
  nb = cdiv(K, g) if K else 0
  x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * g - K))).reshape(R, nb, g)
  k, q, _ = split_blocks(x, bits)
  return k, q


def _block_exponents(x, bits: int):
  """``(neg, mag, q, top)`` of blocks along the last axis of float32 ``x``: signs, magnitude
  bits, the block exponent ``q`` (before the NaN marking) and the block-max magnitude."""
  bits_ = B.to_bits(x)
  neg = (bits_ & B.u32(B.SIGN_MASK)) != 0
  mag = bits_ & B.u32(B.ABS_MASK)
  adj = jnp.where(neg & (mag != 0), mag - B.u32(1), mag)
  fl = B.floor_log2(jnp.minimum(adj, B.u32(0x7F7FFFFF)))
  q = jnp.maximum(jnp.maximum(jnp.max(fl, axis=-1), -150) - (bits - 1), -149)
  return neg, mag, q, jnp.max(mag, axis=-1)


def split_blocks(x, bits: int):
  """:func:`split_significands` of blocks along the last axis of ``x`` (float32, zero
  padding allowed): ``(k, q, nonzero)``, ``nonzero`` true where a block holds a nonzero
  magnitude (-0.0 is zero). Also the body of the Pallas operand preparation
  (``jaxlp/pallas/_block_gemm.py``): reductions as max only."""
  neg, mag, q, top = _block_exponents(x, bits)
  field = (mag >> 23).astype(jnp.int32)
  m = (mag & B.u32(B.FRAC_MASK)).astype(jnp.int32)
  m = jnp.where(field > 0, m | (1 << 23), m)
  e0 = jnp.where(field > 0, field - 150, -149)
  k = m >> jnp.clip(q[..., None] - e0, 0, 31)
  k = jnp.where(neg, -k, k)
  q = jnp.where(top >= B.u32(B.INF_BITS), NAN_Q, q).astype(jnp.int32)
  return k, q, top != 0


def split_limbs(x, bits: int, W: int, nl: int):
  """The significands of :func:`split_blocks` cut into ``nl`` limbs of ``W`` bits, for
  significands too wide for int32 or for one exact dot: ``k = sum_i limbs[i] * 2**(W i)``
  with ``limbs[i] = sign(k) * ((|k| >> W i) mod 2**W)``, the top limb unmasked (``|k| <=
  2**bits <= 2**(W nl)``, so it is at most ``2**W``). Computed from the float32 bits without
  forming ``k`` (``2**bits`` may exceed int32).

  Returns ``(limbs, q, nonzero)``: the limbs as one int32 array ``(nl, *x.shape)`` (limb
  ``i`` is ``limbs[i]``; all limbs in one set of operations over the leading axis), the
  block exponents (``NAN_Q`` for a block holding a non-finite value) and the nonzero mask of
  :func:`split_blocks`."""
  neg, mag, q, top = _block_exponents(x, bits)
  field = (mag >> 23).astype(jnp.int32)
  m = (mag & B.u32(B.FRAC_MASK)) | jnp.where(field > 0, B.u32(1 << 23), B.u32(0))
  e0 = jnp.where(field > 0, field - 150, -149)
  s = e0 - q[..., None]  # |k| = m * 2**s (exact: the low bits of m are zero where s < 0)
  lead = (nl,) + (1,) * x.ndim
  widths = np.full(nl, W)
  widths[-1] = W + 1
  mask = B.u32(((1 << widths) - 1).reshape(lead))
  sh = s[None] - (W * np.arange(nl)).reshape(lead).astype(np.int32)
  m = m[None]
  left = (m << jnp.clip(sh, 0, 31).astype(jnp.uint32)) & mask  # wraps: low bits are right
  right = (m >> jnp.clip(-sh, 0, 31).astype(jnp.uint32)) & mask
  limbs = jnp.where(sh >= 0, left, right).astype(jnp.int32)
  q = jnp.where(top >= B.u32(B.INF_BITS), NAN_Q, q).astype(jnp.int32)
  return jnp.where(neg[None], -limbs, limbs), q, top != 0


def plan_limbs(x, bits: int, W: int, nl: int):
  """:func:`split_limbs` of an operand in a :class:`LimbPlan`: ``nl`` limbs of ``W`` bits,
  or, for one limb, the whole significand."""
  return split_limbs(x, bits, W if nl > 1 else bits, nl)


# ---------------------------------------------------------------------------------------
# Wide exact values: digits (limb dots, tensor scales) rounded once
# ---------------------------------------------------------------------------------------
def clog2(n: int) -> int:
  """``ceil(log2 n)`` for ints ``n >= 1``."""
  return max(n - 1, 0).bit_length()


def limb_width(g: int, prec: int | None = None) -> int:
  """``W``: the width of the limbs (and of the digits the exact partial is assembled in) of
  K-blocks of ``g``: the dot of two limbs of at most ``2**W`` over a K-block is at most
  ``g * 2**(2W) <= 2**24`` (exact in float32 and int32), capped at 10 bits; at most 8 bits
  where a significand has more than 8 significant bits (``prec``), so that every limb is
  exact in bfloat16."""
  W = min(10, (24 - clog2(g)) // 2)
  if prec is not None and prec > 8:
    W = min(W, 8)
  return W


class LimbPlan(NamedTuple):
  """How an exact K-block partial is computed (:func:`limb_plan`): ``na`` / ``nb`` limbs
  of ``W`` bits per operand (1 and 1: one dot of the whole significands), ``T`` digits of
  ``W`` bits that hold the exact block dot."""

  W: int
  na: int
  nb: int
  T: int


def limb_plan(g: int, bits_a: int, bits_b: int, *, whole: bool,
              W: int | None = None) -> LimbPlan:
  """:class:`LimbPlan` of K-blocks of ``g``: one dot of the whole significands where
  ``whole`` (the caller's bound: an int32 dot, or a float32 one of at most ``2**24``),
  else limbs of ``W`` bits (default :func:`limb_width` of ``g``)."""
  W = limb_width(g) if W is None else W
  T = cdiv(bits_a + bits_b + clog2(g) + 2, W)
  if whole:
    return LimbPlan(W, 1, 1, max(T, cdiv(32, W)))
  return LimbPlan(W, cdiv(bits_a, W), cdiv(bits_b, W), T)


def _chunk_bits(W: int) -> int:
  """Bits per step of :func:`normalize_digits`: ``W`` or its largest divisor <= 7."""
  return max(c for c in range(1, min(W, 7) + 1) if W % c == 0)


def digits_of(D, W: int, T: int):
  """``(neg, u)``: the sign and the ``T`` magnitude digits (base ``2**W``, each in ``[0,
  2**W)``, least significant first) of ``sum_t D[t] * 2**(W t)`` for int32 arrays ``D``
  (``|D[t]| < 2**30``, ``D[0]`` any int32); the value must fit ``W T - 1`` bits."""
  mask = (1 << W) - 1
  u, c = [], 0
  for t in range(T):
    v = (D[t] if t < len(D) else 0) + c
    u.append(v & mask)
    c = v >> W  # arithmetic: floor division
  neg = c < 0
  # a negative value is 2**(W T) * c + digits with c = -1: its magnitude is 2**(W T) minus
  # the digits (ones' complement plus one)
  out, carry = [], 1
  for t in range(T):
    v = (mask - u[t]) + carry
    out.append(v & mask)
    carry = v >> W
  return neg, [jnp.where(neg, o, d) for o, d in zip(out, u, strict=True)]


def mul_digits(u, G, W: int):
  """The digits (base ``2**W``) of the product of two digit lists (non-negative; ``W <= 10``
  and at most 16 digits in the shorter list keep every column below ``2**31``)."""
  mask = (1 << W) - 1
  out, c = [], 0
  for k in range(len(u) + len(G)):
    col = c
    for t in range(max(0, k - len(G) + 1), min(k, len(u) - 1) + 1):
      col = col + u[t] * G[k - t]
    out.append(col & mask)
    c = col >> W
  return out


def normalize_digits(u, W: int):
  """``(h, e, sticky)`` of a non-negative value given by its digits ``u`` (base ``2**W``,
  least significant first): ``value = (h + f) * 2**e`` with ``0 <= f < 1``, ``f > 0`` exactly
  where ``sticky``, ``h < 2**31`` and ``h >= 2**24`` where ``sticky`` (the value's top 25 to
  31 bits, for :func:`round_mag`). Bits are taken from the top in chunks of
  :func:`_chunk_bits` while ``h < 2**24``; fixed shifts only."""
  c = _chunk_bits(W)
  cmask = (1 << c) - 1
  h = jnp.zeros_like(u[0])
  e = jnp.full_like(u[0], W * len(u))
  sticky = jnp.zeros(u[0].shape, bool)
  for t in reversed(range(len(u))):
    for j in reversed(range(W // c)):
      ch = (u[t] >> (j * c)) & cmask
      take = h < (1 << 24)
      h = jnp.where(take, (h << c) | ch, h)
      e = jnp.where(take, e - c, e)
      sticky = sticky | (~take & (ch != 0))
  return h, e, sticky


def round_digits(neg, u, W: int, q, nan=None):
  """``fl32(value * 2**q)`` (correctly rounded, overflow ``±inf``, flushed below
  ``2**-126``, sign ``neg``) of the magnitude digits ``u`` (:func:`digits_of`); NaN where
  ``q >= NAN_Q // 2`` or ``nan``."""
  h, e, sticky = normalize_digits(u, W)
  bad = q >= NAN_Q // 2
  if nan is not None:
    bad = bad | nan
  return round_mag(h, q + e, neg=neg, sticky=sticky, nan=bad)


def scale_parts(s):
  """``(m, e)`` int32 of float32 ``s`` (normal, positive): ``s = m * 2**e``, ``2**23 <= m <
  2**24``; and ``bad``, true where ``s`` is not a positive normal finite number."""
  bits = B.to_bits(jnp.asarray(s, jnp.float32))
  field = ((bits >> 23) & B.u32(0xFF)).astype(jnp.int32)
  m = ((bits & B.u32(B.FRAC_MASK)) | B.u32(1 << 23)).astype(jnp.int32)
  bad = (field == 0) | (field == 255) | ((bits & B.u32(B.SIGN_MASK)) != 0)
  return m, field - 150, bad


def tensor_digits(ma, mb, W: int):
  """The digits (base ``2**W``) of ``ma * mb`` for 24-bit significands ``ma``, ``mb``
  (int32 scalars or arrays): the tensor scales' product, exact (48 bits)."""
  n = cdiv(24, W)
  mask = (1 << W) - 1
  da = [(ma >> (W * i)) & mask for i in range(n)]
  db = [(mb >> (W * i)) & mask for i in range(n)]
  return mul_digits(da, db, W)[:cdiv(48, W)]


def exact_partial(D, q, plan: LimbPlan, G=None, nan=None):
  """A K-block's partial, rounded once: ``fl32(sum_t D[t] 2**(W t) * G * 2**q)`` from the
  diagonal sums ``D`` of the limb dots, the digits ``G`` of the tensor scales' product
  (:func:`tensor_digits`; None: 1) and the exponents ``q`` (int32, broadcastable)."""
  neg, u = digits_of(D, plan.W, plan.T)
  if G is not None:
    u = mul_digits(u, G, plan.W)
  return round_digits(neg, u, plan.W, q, nan)


def limb_diagonals(dot, na: int, nb: int):
  """``D[s] = sum_{i + j = s} dot(i, j)`` over the limb pairs (int32 dots)."""
  D = [None] * (na + nb - 1)
  for i in range(na):
    for j in range(nb):
      d = dot(i, j)
      D[i + j] = d if D[i + j] is None else D[i + j] + d
  return D


def limb_diagonal_dots(la, lb):
  """:func:`limb_diagonals` of the int32 dots of stacked limbs ``la`` (na, M, g) and ``lb``
  (nb, N, g) as one int32 ``dot``: ``D`` (na + nb - 1, M, N), ``D[s] = sum_i la[i] .
  lb[s - i]^T``, the contraction over ``(i, k)`` against ``lb`` shifted by ``i`` along its
  limb axis (zero limbs outside). Exact: the same integers (``|D[s]| < 2**30``)."""
  na, nb = la.shape[0], lb.shape[0]
  M, g = la.shape[1], la.shape[2]
  N = lb.shape[1]
  S = na + nb - 1
  lhs = jnp.moveaxis(la, 0, 1).reshape(M, na * g)
  rhs = jnp.stack([jnp.pad(lb, ((i, na - 1 - i), (0, 0), (0, 0))) for i in range(na)],
                  axis=2)  # (S, N, na, g): [s, :, i] = lb[s - i]
  rhs = rhs.reshape(S, N, na * g)
  D = lax.dot_general(lhs, rhs, (((1,), (2,)), ((), ())), preferred_element_type=jnp.int32)
  return jnp.moveaxis(D, 1, 0)


def _f32_from_int_bits(bits):
  return lax.bitcast_convert_type(bits, jnp.float32)


def scale_exact(n, q, sticky=None):
  """``fl32(n * 2**q)`` of int32 ``n`` (``|n| <= 2**31 - 1``) and int32 ``q``, correctly
  rounded (nearest even), ``±inf`` on overflow, flushed to a signed zero below ``2**-126``;
  NaN where ``q >= NAN_Q // 2``. Integer operations only (the same bits in XLA and in a
  Triton kernel, with or without hardware subnormals): no clz (the NVIDIA Triton backend
  rejects it), no bitcast of constants.

  ``sticky`` (bool, optional): the exact value is ``(n + f) * 2**q`` with ``0 < f < 1`` where
  it is true (bits of a wider integer that were cut off below ``n``); allowed only where
  ``|n| >= 2**24``, so that they lie below the rounding position."""
  neg = n < 0
  return round_mag(jnp.where(neg, -n, n), q, neg=neg, sticky=sticky, nan=q >= NAN_Q // 2)


def round_mag(a, q, *, neg, sticky=None, nan=None):
  """:func:`scale_exact` of a magnitude: ``fl32((a + f) * 2**q)`` negated where ``neg``, for
  int32 ``a >= 0`` (``f`` as ``sticky`` there), NaN where ``nan``."""
  # floor(log2 a): the exponent of the (rounded) conversion, one less if it rounded up.
  fb = lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
  l0 = jnp.clip((fb >> 23) - 127, 0, 31)
  lg = l0 - ((a >> l0) == 0).astype(jnp.int32)
  qexp = jnp.maximum(lg + q - 23, -149)
  sh = qexp - q
  shr = jnp.clip(sh, 1, 31)
  r0 = a >> shr
  rem = a - (r0 << shr)
  half = 1 << (shr - 1)
  odd = (r0 & 1) == 1
  up = (rem > half) | ((rem == half) & (odd if sticky is None else odd | sticky))
  r_right = jnp.where(sh >= 32, 0, r0 + up.astype(jnp.int32))
  r = jnp.where(sh > 0, r_right, a << jnp.clip(-sh, 0, 23))
  field = qexp + 149 + (r >> 23)
  mant = r & 0x7FFFFF
  bits = (jnp.clip(field, 0, 254) << 23) | mant
  bits = jnp.where(field >= 255, 0x7F800000, bits)
  bits = jnp.where((field <= 0) | (a == 0), 0, bits)  # zero, or flushed below 2**-126
  if nan is not None:
    bits = jnp.where(nan, 0x7FC00000, bits)
  p = _f32_from_int_bits(bits)
  return jnp.where(neg, -p, p)


def flush(x):
  """``x`` (float32) with magnitudes below ``2**-126`` replaced by a zero of the same sign."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  tiny = (bits & 0x7FFFFFFF) < 0x00800000
  return _f32_from_int_bits(jnp.where(tiny, bits & jnp.int32(-(2**31)), bits))


def accumulate(s, p):
  """One step of the declared accumulation: ``flush(fl32(s + p))``."""
  return flush(s + p)


# ---------------------------------------------------------------------------------------
# The definition in pure jnp
# ---------------------------------------------------------------------------------------
def check_operands(a, b, g, bits_a, bits_b, *, limbs: bool = False):
  """Raise ValueError unless ``a`` (M, K), ``b`` (K, N), the K-block length ``g`` and the
  significand bits make an exact block dot (:func:`check_exact`)."""
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
    raise ValueError(f"block_dot: operands must be (M, K) and (K, N), got a.shape={a.shape}, "
                     f"b.shape={b.shape}")
  if not (isinstance(g, int) and g >= 1):
    raise ValueError(f"block_dot: the K-block length must be a positive int, got {g!r}")
  check_exact(g, bits_a, bits_b, limbs=limbs)


def operand_significands(a, b, g, bits_a, bits_b):
  """:func:`split_significands` of ``a`` (M, K) and of ``b.T`` (N, K): ``(ka, qa, kb, qb)``."""
  ka, qa = split_significands(a, g, bits_a)  # (M, nb, g), (M, nb)
  kb, qb = split_significands(b.T, g, bits_b)  # (N, nb, g), (N, nb)
  return ka, qa, kb, qb


def _int_dot(x, y):
  """int32 ``x`` (M, g) . ``y`` (N, g)^T."""
  return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def scale_operands(scales):
  """``(G, ea, eb, bad)`` of the tensor scales ``(sa, sb)`` (float32 scalars or None = 1):
  the exponents to add to each operand's block exponents, and the significands' product as
  digits of :func:`limb_width` bits (a function of W: ``G(W)``); ``bad``: a scale that is
  NaN (a tensor holding inf or NaN) or not a positive normal number."""
  if scales is None:
    return None, 0, 0, None
  parts = [scale_parts(1.0 if s is None else s) for s in scales]
  (ma, ea, bad_a), (mb, eb, bad_b) = parts
  return (lambda W: tensor_digits(ma, mb, W)), ea, eb, bad_a | bad_b


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def block_dot_reference(a, b, g: int, bits_a: int, bits_b: int, scales=None):
  """The definition (module docstring) in pure jnp: ``a`` (M, K) . ``b`` (K, N) float32
  block-format values, K-blocks of ``g``, significands of ``bits_a`` / ``bits_b`` bits, and
  optional per-tensor scales ``scales = (sa, sb)`` (float32 scalars or None; two-level
  formats, :func:`two_level_values`) that multiply every partial before its rounding.

  Per K-block, inside a ``lax.scan`` over the K-blocks: where one int32 dot holds the
  significands' dot (:func:`int32_exact`) and there are no tensor scales, that dot scaled
  exactly (:func:`scale_exact`); otherwise the dots of limbs of the significands
  (:func:`split_limbs`, :func:`limb_plan`; one int32 dot per K-block,
  :func:`limb_diagonal_dots`), assembled as digits, multiplied by the tensor scales'
  significands and rounded once (:func:`exact_partial`). Any backend.

  Compile cost (XLA:CPU spends most of it per kernel, in LLVM): the first K-block's
  partial is the scan's first step, selected instead of added (one compiled copy of the
  partial); operands with the same significand bits are split in one pass (their rows
  concatenated); the digit arithmetic stays unrolled and elementwise, which XLA fuses into
  one kernel (loops and reductions over a stacked digit axis compiled slower).
  """
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  check_operands(a, b, g, bits_a, bits_b, limbs=True)
  M, N = a.shape[0], b.shape[1]
  nblk = cdiv(a.shape[1], g) if a.shape[1] else 0
  if nblk == 0:
    return jnp.zeros((M, N), jnp.float32)
  if scales is None and int32_exact(g, bits_a, bits_b):
    if bits_a == bits_b:
      k, q = split_significands(jnp.concatenate([a, b.T]), g, bits_a)
      ka, qa, kb, qb = k[:M], q[:M], k[M:], q[M:]
    else:
      ka, qa, kb, qb = operand_significands(a, b, g, bits_a, bits_b)

    def partial(ka_b, kb_b, qa_b, qb_b):
      return scale_exact(_int_dot(ka_b, kb_b), qa_b[:, None] + qb_b[None, :])

    xs = (jnp.moveaxis(ka, 1, 0), jnp.moveaxis(kb, 1, 0), qa.T, qb.T)
  else:
    plan = limb_plan(g, bits_a, bits_b, whole=int32_exact(g, bits_a, bits_b))
    Gf, ea, eb, bad = scale_operands(scales)
    G = None if Gf is None else Gf(plan.W)
    if bits_a == bits_b:
      lab, qab, _ = plan_limbs(_blocks(jnp.concatenate([a, b.T]), g), bits_a, plan.W, plan.na)
      la, qa, lb, qb = lab[:, :M], qab[:M], lab[:, M:], qab[M:]
    else:
      la, qa, _ = plan_limbs(_blocks(a, g), bits_a, plan.W, plan.na)  # (na, M, nblk, g)
      lb, qb, _ = plan_limbs(_blocks(b.T, g), bits_b, plan.W, plan.nb)
    qa, qb = qa + ea, qb + eb

    def partial(la_b, lb_b, qa_b, qb_b):
      D = list(limb_diagonal_dots(la_b, lb_b))  # unrolled digits: one fused kernel
      return exact_partial(D, qa_b[:, None] + qb_b[None, :], plan, G, bad)

    xs = (jnp.moveaxis(la, 2, 0), jnp.moveaxis(lb, 2, 0), qa.T, qb.T)

  def body(s, x):
    i, x = x
    p = partial(*x)
    # s = p_0 (no initial +0.0), then flush(fl32(s + p_b))
    return jnp.where(i == 0, p, accumulate(s, p)), None

  s, _ = lax.scan(body, jnp.zeros((M, N), jnp.float32), (jnp.arange(nblk), xs))
  return s


def _blocks(x, g: int):
  """``x`` (R, K) as (R, nb, g) K-blocks, zero-padded."""
  R, K = x.shape
  nb = cdiv(K, g)
  return jnp.pad(x, ((0, 0), (0, nb * g - K))).reshape(R, nb, g)
