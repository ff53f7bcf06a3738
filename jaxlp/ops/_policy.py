"""`DotPolicy`: which operands of each GEMM (forward, dlhs, drhs) are quantized, and how.

A layer's dot product ``y = lhs · rhs`` (a ``dot_general`` or a convolution) involves three
GEMMs during training, named as in aqt:

* **fwd**:  ``y = lhs · rhs`` (operands ``lhs``, ``rhs``);
* **dlhs**: ``dlhs = grad · rhsᵀ`` (operands ``grad`` = the incoming output gradient, and the
  rhs operand ``dlhs_rhs``);
* **drhs**: ``drhs = lhsᵀ · grad`` (operands ``drhs_lhs`` and ``drhs_grad``).

Each operand slot holds ``None`` (use the float32 operand as it is), a jaxlp format (rounded
to nearest), or a :class:`Quant` (format + rounding). The backward operand slots of the
weights/activations also accept ``"fwd"``: reuse the operand exactly as quantized in the
forward pass (what HBFPEmulator and most fake-quant layers do; also the cheapest), and
``drhs_grad`` accepts ``"grad"``: the same quantized output gradient as the dlhs GEMM.

Blocking is part of the format object: ``hbfp_batched(m)`` = one exponent per sample (index of
dim 0), ``hbfp(m, T)`` = T x T tiles, ``mx(elem, block)`` / ``BlockFormat(axis=...)`` = blocks
along one axis. For axis-blocked formats (MX, ``BlockFormat(axis=...)``) the axis given in the
format is REPLACED, per operand and per pass, by that operand's contraction axis in that GEMM
(see :func:`jaxlp.ops.dot_general`), since block dot products share a scale along the
reduction. Tile-blocked formats take their tiles on a 2-D view that the policy's ``layout``
chooses (:class:`DotPolicy`): HBFPEmulator's (dim0, rest) view of the operand as given
(``"hbfp"``; for convolutions PyTorch's channel-first layout: ``NCHW`` activations and
gradients, ``OIHW`` kernels, a Flax ``HWIO`` kernel transposed before tiling and back after),
or the matrix each GEMM multiplies, one token per block for activations (``"contraction"``);
``"auto"`` (the default) takes the first for plain 2-D matrix products and convolutions and
the second for every other ``dot_general`` (sequence models). The table in
:class:`DotPolicy` shows which elements share an exponent.

``mul`` / ``acc`` accumulator emulation (:class:`Accum`) routes a GEMM through
``jaxlp.ops.matmul`` (products rounded to ``mul``, running sum rounded to ``acc``).

``block_dot`` says how the three GEMMs of the quantized operands are computed: None (the
default, today's emulation: the plain float32 lax op -- fp32 products, fp32 sums in XLA's
order), ``"exact"`` (block formats with integer significands: an exact integer dot per
K-block, rounded once to float32, K-blocks summed in float32 in ascending order -- the same
bits on every backend, tensor cores on a GPU; definition in
``jaxlp/formats/_block_dot.py``) or ``"fp8"`` (fast, NOT bit-exact: fp8 tensor-core dots with
power-of-two scales).

Stochastic rounding keys are data, not configuration: the callables returned by
:func:`jaxlp.ops.dot_general` / :func:`jaxlp.ops.conv_general_dilated` take ``key=`` at
construction (a fresh key per step, e.g. from ``module.make_rng``), and each operand slot
draws its noise from ``fold_in(key, slot)``; a stochastic policy without a key raises.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlp._deprecation import renamed_kwargs
from jaxlp.formats import E4M3FN, hbfp, hbfp_batched, mx
from jaxlp.formats._block_dot import significand_bits
from jaxlp.formats._quantize import FORMAT_TYPES, check_format
from jaxlp.ops._block_dot import (
    BLOCK_DOTS,
    FP8_GPU_IMPL,
    FP8_GPU_IMPLS,
    GPU_IMPL,
    GPU_IMPLS,
    GPU_ROUTE,
    GPU_ROUTES,
    check_gpu_choice,
    fp8_kind,
)
from jaxlp.ops._rht import RHT

FWD = "fwd"
GRAD = "grad"
HBFP_ACTIVATIONS = ("per_sample", "tiled")
LAYOUTS = ("auto", "hbfp", "contraction")
ALGORITHMS = ("naive", "kahan", "chunked")


@dataclasses.dataclass(frozen=True)
class Quant:
  """A format and the rounding used to quantize one GEMM operand.

  Attributes:
    fmt: any jaxlp format (``FloatFormat``, ``BlockFormat``, ``mx(...)``, ``FixedPoint``...).
    rounding: a rounding mode supported by ``fmt`` (``"nearest"``, ``"stochastic"``, ...).

  Raises:
    TypeError: ``fmt`` is not a jaxlp format.
    ValueError: ``fmt`` does not support ``rounding`` (or it is unknown).

  Example:
    >>> from jaxlp import formats as F
    >>> from jaxlp.ops import Quant
    >>> q = Quant(F.E5M2, "stochastic")
    >>> q.stochastic
    True
    >>> Quant(F.cpd_float(5, 2), "stochastic")
    Traceback (most recent call last):
      ...
    ValueError: quantize: CPDFloat supports rounding in ('nearest',), got rounding='stochastic'
  """

  fmt: Any
  rounding: str = "nearest"

  def __post_init__(self):
    check_format(self.fmt, self.rounding)

  @property
  def stochastic(self) -> bool:
    return self.rounding == "stochastic"


@dataclasses.dataclass(frozen=True)
class Accum:
  """Accumulator emulation of one GEMM (see ``jaxlp.matmul``).

  Attributes:
    mul: format the products are rounded to (None: the float32 product).
    acc: format the running sum is rounded to after every addition (None: float32).
    algorithm: ``"naive"``, ``"kahan"`` or ``"chunked"``.
    chunk: chunk length for ``"chunked"``.
    rounding: rounding of products and sums.

  Raises:
    TypeError: ``mul`` or ``acc`` is not a jaxlp format.
    ValueError: an unknown ``algorithm``, or a format that does not support ``rounding``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> # a BF16 accumulator in the forward GEMM: 256 + 1 rounds back to 256 (a tie, to
    >>> # even) every step, so the small terms are lost ("swamping")
    >>> policy = jaxlp.DotPolicy(fwd_acc=jaxlp.Accum(acc=F.BF16))
    >>> x, w = jnp.array([[256.0, 1.0, 1.0]]), jnp.ones((3, 1))
    >>> jaxlp.dot_general(policy)(x, w, (((1,), (0,)), ((), ())))
    Array([[256.]], dtype=float32)
  """

  mul: Any = None
  acc: Any = None
  algorithm: str = "naive"
  chunk: int | None = None
  rounding: str = "nearest"

  def __post_init__(self):
    if self.algorithm not in ALGORITHMS:
      raise ValueError(f"Accum: algorithm={self.algorithm!r} not in {ALGORITHMS}")
    for name in ("mul", "acc"):
      f = getattr(self, name)
      if f is not None:
        check_format(f, self.rounding)


def _as_quant(value, name, allowed=()):
  if value is None or value in allowed:
    return value
  if isinstance(value, Quant):
    return value
  if isinstance(value, FORMAT_TYPES):
    return Quant(value)
  raise TypeError(
      f"DotPolicy: {name}={value!r} must be None, a jaxlp format, a Quant(fmt, rounding)"
      + (f" or one of {allowed}" if allowed else ""))


def _as_accum(value, name):
  if value is None or isinstance(value, Accum):
    return value
  raise TypeError(f"DotPolicy: {name}={value!r} must be None or an Accum(mul=..., acc=...)")


@dataclasses.dataclass(frozen=True)
class DotPolicy:
  """Quantization of the forward and backward GEMMs of a dot_general / convolution.

  ``DotPolicy()`` quantizes nothing: the layer is the plain lax op and its backward pass is
  plain autodiff. Frozen and hashable (usable as a static jit argument).

  Attributes:
    lhs: forward lhs operand (activations ``x`` in a Dense/Conv layer).
    rhs: forward rhs operand (the kernel).
    grad: the incoming output gradient, in the dlhs GEMM (and in the drhs GEMM when
      ``drhs_grad="grad"``).
    dlhs_rhs: rhs operand of the dlhs GEMM; ``"fwd"`` (default) = the forward-quantized rhs.
    drhs_lhs: lhs operand of the drhs GEMM; ``"fwd"`` (default) = the forward-quantized lhs.
    drhs_grad: output gradient in the drhs GEMM; ``"grad"`` (default) = the same quantized
      gradient as in the dlhs GEMM (one rounding, one random draw).
    fwd_acc, dlhs_acc, drhs_acc: optional :class:`Accum` accumulator emulation of each GEMM.
    block_dot: how the GEMMs of the quantized operands are computed (all three):

      * None (default): the plain float32 lax op on the quantized operands -- products
        exact in fp32, sums rounded in fp32 in the backend's (unspecified) order.
      * ``"exact"``: for block formats with integer significands (``BlockFormat``,
        ``hbfp``, ``hbfp_batched``, every ``mx(...)``: MXINT8, MXFP4, MXFP6, MXFP8, and
        ``nvfp4()`` / ``ScaledBlockFormat`` with UE4M3 or E8M0 block scales, whose tensor
        scales multiply each block's dot before it is rounded) in every operand of every GEMM:
        K is cut into blocks both operands' blocks refine; per K-block the dot of the
        integer significands is exact (int32; wider ones, MXFP8's, as limbs), scaled by
        ``2**(ea + eb)`` and rounded
        once to float32 (overflow: inf; below ``2**-126``: a signed zero); the block
        results are summed in float32 sequentially, ascending K-block index. The same
        bits on every backend (a pure-jnp reference on CPU; on a GPU a Pallas kernel on
        bf16 tensor cores where the block exponents keep every partial exact, int8 tensor
        cores elsewhere, and GEMMs with few output tiles and many K-blocks as one batched
        int8 dot: ``gpu_impl``). Relative to None only the rounding
        of sums that cross K-blocks differs (within a block both are exact for
        HBFP8-sized blocks); measured in the README ("Block formats on tensor cores").
        Supported for every ``dot_general`` (batch dimensions, several contracting
        dimensions: one 2-D GEMM per batch index, K-blocks = the quantization blocks; see
        :func:`jaxlp.ops.dot_general`) and for ungrouped convolutions (GEMMs on im2col
        matrices: see :func:`jaxlp.ops.conv_general_dilated`); operands whose blocks run
        across the contraction get K-blocks of 1 (valid, slow). Definition:
        ``jaxlp/formats/_block_dot.py``.
      * ``"fp8"``: fast mode for ``mx(E4M3FN/E5M2/...)`` and elementwise float formats
        with <= 3 mantissa bits: operands cast to fp8 dtypes with per-block (MX) or
        per-tensor power-of-two scales, one ``lax.dot_general`` on the fp8 arrays with
        ``preferred_element_type=float32``. NOT bit-exact: GPU fp8 tensor cores (Hopper)
        accumulate in a format narrower than fp32, so results differ from the emulation
        (the error is measured by ``benchmarks/block_gemm.py``). With per-block scales
        that dot is batched over the K-blocks (a (K-blocks, M, N) intermediate), except on
        GPUs, where a Pallas kernel sums the blocks itself
        (``fp8_gpu_impl``; measured faster on an H100).
    gpu_impl: the implementation of ``block_dot="exact"`` GEMMs when compiled for a CUDA
      GPU, all with the same bits: ``"auto"`` (default: one batched XLA int8 dot for GEMMs
      with few output tiles and many K-blocks, the Pallas kernel elsewhere), ``"pallas"``,
      ``"xla_int8"`` or ``"reference"``. Other platforms always run the reference.
    gpu_route: the Pallas kernel's route on a GPU: ``"auto"`` (default: bf16 tensor cores
      on the tiles whose block exponents keep every partial exact, int8 elsewhere) or
      ``"int8"``. The same bits.
    fp8_gpu_impl: the ``block_dot="fp8"`` GEMM with per-block (MX) scales on a GPU:
      ``"pallas"`` (default: the blocks summed in one kernel) or ``"xla"`` (a batched fp8
      dot, then the scaled sum).
    layout: the 2-D view on which tile-blocked formats (``hbfp``, ``hbfp_batched``,
      ``BlockFormat(tile=...)``) take their tiles in a ``dot_general``:

      * ``"hbfp"``: HBFPEmulator's (dim0, rest) view of the operand as given.
      * ``"contraction"``: the matrix the GEMM multiplies: rows = the operand's other axes
        (in its own order), columns = its contracting axes in the GEMM it is quantized for
        (forward lhs / rhs, dlhs grad / rhs, drhs lhs / grad; the K order of
        :func:`jaxlp.ops.dot_general`). A tile ``(tr, tc)`` covers ``tc`` consecutive
        elements of the contraction. Activations and gradients never span two rows (an
        integer ``tr`` counts as 1: one token, sample or head per block; ``None``, the
        whole extent, is kept), so a block never crosses a token or a sequence; a weight
        (the ``rhs`` / ``dlhs_rhs`` slots of a ``dot_general`` without batch dimensions)
        keeps its ``tr x tc`` tiles, and square tiles are then the same blocks in the
        forward and the dlhs GEMM (and the same as HBFPEmulator's for a 2-D weight).
      * ``"auto"`` (default): ``"hbfp"`` for a plain matrix product (2-D operands, one
        contracting dimension, no batch dimensions: every MLP/CNN result of earlier
        versions unchanged) and ``"contraction"`` for every other ``dot_general``
        ((batch, seq, features) activations, attention einsums, ``DenseGeneral``).

      Which elements share an exponent, for ``x`` of shape (batch 2, seq 3, features 48)
      times a (48, 24) weight ``w``, tile 24:

      ======================  =================================  ============================
      format                  ``"hbfp"``                          ``"contraction"``
      ======================  =================================  ============================
      x, ``hbfp(m, 24)``      6 tiles of the (2, 144) view, one  12 blocks, one per token and
                              per token position s and feature   feature block:
                              block, across BOTH sequences:      ``x[b, s, 0:24]``,
                              ``x[:, s, 0:24]``,                 ``x[b, s, 24:48]``
                              ``x[:, s, 24:48]``
      x, ``hbfp_batched(m)``  2: one per sequence, ``x[b]``      6: one per token, ``x[b, s]``
      w, ``hbfp(m, 24)``      2 tiles ``w[0:24]``, ``w[24:48]``  the same 2 tiles
      ``mx(e, 24)``           along each GEMM's contraction in   the same
                              every layout: ``x[b, s, 0:24]``,
                              ``w[0:24, n]``, ...
      ======================  =================================  ============================

      Convolutions: ``"auto"`` and ``"hbfp"`` tile NCHW / OIHW as HBFPEmulator does;
      ``"contraction"`` blocks activations and gradients along their contraction axis, one
      pixel per block (channels in the forward pass, output channels in the dlhs GEMM), and
      keeps the kernels' OIHW tiles. Axis-blocked formats (MX, ``BlockFormat(axis=...)``)
      and elementwise formats do not depend on the layout.

    rht: a :class:`jaxlp.RHT` (random Hadamard transform) or None: both operands of each
      GEMM in ``rht.gemms`` are transformed along their contraction axis, chunk by chunk,
      BEFORE they are quantized (the transform cancels in the product up to rounding; its
      exact float32 definition is in :class:`jaxlp.RHT`). The NVFP4 recipe transforms the
      weight-gradient GEMM's operands: ``rht=RHT(gemms=("drhs",))``. A transformed GEMM's
      operands are its own: for ``"drhs"``, ``drhs_lhs`` and ``drhs_grad`` must be a format
      or None (not ``"fwd"`` / ``"grad"``); for ``"fwd"``, ``dlhs_rhs`` and ``drhs_lhs``
      must not reuse the forward operands; for ``"dlhs"``, ``drhs_grad`` not ``"grad"``.
      Transforming one operand alone is not offered: it would not cancel.

  Each operand is None (float32, unquantized), a format (nearest rounding) or a
  :class:`Quant`; formats are normalised to :class:`Quant` at construction.

  Raises:
    TypeError: an operand slot that is not None, a format, a :class:`Quant` (or its
      allowed ``"fwd"`` / ``"grad"``), an accumulator slot that is not None or an
      :class:`Accum`, or an ``rht`` that is not None or an :class:`jaxlp.RHT`.
    ValueError: an unknown ``block_dot`` or ``layout``; ``block_dot`` together with accumulator
      emulation; ``"exact"`` with an operand of some GEMM that is not a block format with
      integer significands, or ``"fp8"`` with one that has no fp8 twin (the message
      names the GEMM and slot); a ``gpu_impl``, ``gpu_route`` or ``fp8_gpu_impl`` that is
      not one of its choices; an ``rht`` GEMM whose operand slot is shared with another GEMM
      (the message names the slot to set).

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> p = jaxlp.DotPolicy(lhs=F.E4M3, rhs=F.E4M3, grad=jaxlp.Quant(F.E5M2, "stochastic"))
    >>> p.lhs  # formats become Quant(fmt, "nearest")
    Quant(fmt=jaxlp.formats.E4M3, rounding='nearest')
    >>> p.dlhs_rhs, p.drhs_grad, p.stochastic
    ('fwd', 'grad', True)
    >>> jaxlp.DotPolicy().is_identity
    True
    >>> # HBFP8 with exact integer block dots (K-blocks of 24). K-block 0: 1.5 * 2**23 * 0.75
    >>> # = 9437184; K-block 1: 24 * 0.5625 = 13.5 (exact); 9437184 + 13.5 rounds once (a
    >>> # tie, to even). Adding the 48 fp32 products one by one would give 9437208.
    >>> p = jaxlp.hbfp_policy(7, 24, "tiled", block_dot="exact")
    >>> x = jnp.concatenate([jnp.array([1.5 * 2.0**23]), jnp.zeros(23), jnp.full(24, 0.75)])
    >>> y = jaxlp.dot_general(p)(x[None], jnp.full((48, 1), 0.75), (((1,), (0,)), ((), ())))
    >>> int(y[0, 0])
    9437198
    >>> jaxlp.DotPolicy(lhs=F.E4M3, rhs=F.E4M3, block_dot="exact")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    ValueError: DotPolicy: block_dot='exact' needs ... fwd GEMM's slot 'lhs' is jaxlp.formats.E4M3
  """

  lhs: Any = None
  rhs: Any = None
  grad: Any = None
  dlhs_rhs: Any = FWD
  drhs_lhs: Any = FWD
  drhs_grad: Any = GRAD
  fwd_acc: Accum | None = None
  dlhs_acc: Accum | None = None
  drhs_acc: Accum | None = None
  block_dot: str | None = None
  gpu_impl: str = GPU_IMPL
  gpu_route: str = GPU_ROUTE
  fp8_gpu_impl: str = FP8_GPU_IMPL
  layout: str = "auto"
  rht: RHT | None = None

  def __post_init__(self):
    for name in ("lhs", "rhs", "grad"):
      object.__setattr__(self, name, _as_quant(getattr(self, name), name))
    for name in ("dlhs_rhs", "drhs_lhs"):
      object.__setattr__(self, name, _as_quant(getattr(self, name), name, (FWD,)))
    object.__setattr__(self, "drhs_grad", _as_quant(self.drhs_grad, "drhs_grad", (GRAD,)))
    for name in ("fwd_acc", "dlhs_acc", "drhs_acc"):
      _as_accum(getattr(self, name), name)
    self._check_block_dot()
    check_gpu_choice(self.gpu_impl, GPU_IMPLS, "DotPolicy: gpu_impl")
    check_gpu_choice(self.gpu_route, GPU_ROUTES, "DotPolicy: gpu_route")
    check_gpu_choice(self.fp8_gpu_impl, FP8_GPU_IMPLS, "DotPolicy: fp8_gpu_impl")
    if self.layout not in LAYOUTS:
      raise ValueError(f"DotPolicy: layout={self.layout!r} not in {LAYOUTS}")
    self._check_rht()

  def _check_rht(self):
    if self.rht is None:
      return
    if not isinstance(self.rht, RHT):
      raise TypeError(f"DotPolicy: rht={self.rht!r} must be None or a jaxlp.RHT(gemms=...)")
    # a transformed GEMM quantizes its own operands after the transform: no operand shared
    # with another GEMM ("fwd" / "grad" reuse), in either direction
    users: dict[str, list[str]] = {}
    for gemm, pair in self.gemm_operands().items():
      for slot, _ in pair:
        users.setdefault(slot, []).append(gemm)
    for slot, gemms in users.items():
      hit = [g for g in gemms if g in self.rht.gemms]
      if len(gemms) > 1 and hit:
        fix = {"lhs": "drhs_lhs", "rhs": "dlhs_rhs", "grad": "drhs_grad"}[slot]
        raise ValueError(
            f"DotPolicy: rht transforms the operands of the {hit[0]} GEMM before they are "
            f"quantized, but slot {slot!r} is shared by the {' and '.join(gemms)} GEMMs; give "
            f"{fix} its own format (or None) instead of {getattr(self, fix)!r}")

  def gemm_operands(self) -> dict[str, tuple[tuple[str, Quant | None], ...]]:
    """GEMM name -> its two (slot, Quant or None) operands, ``"fwd"``/``"grad"`` resolved
    to the slot whose quantized operand is reused."""
    r_dl = ("rhs", self.rhs) if self.dlhs_rhs == FWD else ("dlhs_rhs", self.dlhs_rhs)
    l_dr = ("lhs", self.lhs) if self.drhs_lhs == FWD else ("drhs_lhs", self.drhs_lhs)
    g_dr = ("grad", self.grad) if self.drhs_grad == GRAD else ("drhs_grad", self.drhs_grad)
    return {"fwd": (("lhs", self.lhs), ("rhs", self.rhs)),
            "dlhs": (("grad", self.grad), r_dl), "drhs": (l_dr, g_dr)}

  def _check_block_dot(self):
    if self.block_dot not in BLOCK_DOTS:
      raise ValueError(f"DotPolicy: block_dot={self.block_dot!r} not in {BLOCK_DOTS}")
    if self.block_dot is None:
      return
    if any(a is not None for a in (self.fwd_acc, self.dlhs_acc, self.drhs_acc)):
      raise ValueError(f"DotPolicy: block_dot={self.block_dot!r} and accumulator emulation "
                       "(fwd_acc/dlhs_acc/drhs_acc) are exclusive")
    ok = significand_bits if self.block_dot == "exact" else fp8_kind
    need = ("a block format with integer significands (BlockFormat, hbfp, hbfp_batched, "
            "mx(...), nvfp4() / ScaledBlockFormat with ue4m3 or e8m0 block scales)"
            if self.block_dot == "exact" else
            "an mx(...) or FloatFormat with <= 3 mantissa bits (an fp8 twin)")
    for gemm, pair in self.gemm_operands().items():
      for slot, q in pair:
        if q is None or ok(q.fmt) is None:
          what = "None (float32)" if q is None else repr(q.fmt)
          raise ValueError(f"DotPolicy: block_dot={self.block_dot!r} needs {need} in every "
                           f"GEMM operand; the {gemm} GEMM's slot {slot!r} is {what}")

  def operands(self) -> dict[str, Quant | None | str]:
    """The six operand slots by name."""
    return {n: getattr(self, n) for n in
            ("lhs", "rhs", "grad", "dlhs_rhs", "drhs_lhs", "drhs_grad")}

  @property
  def is_identity(self) -> bool:
    """True if no operand is quantized or transformed and no accumulator is emulated."""
    return (all(q is None or q in (FWD, GRAD) for q in self.operands().values())
            and self.rht is None
            and self.fwd_acc is None and self.dlhs_acc is None and self.drhs_acc is None)

  @property
  def stochastic(self) -> bool:
    """True if any operand uses stochastic rounding (the callables then need a key)."""
    accs = (self.fwd_acc, self.dlhs_acc, self.drhs_acc)
    return (any(isinstance(q, Quant) and q.stochastic for q in self.operands().values())
            or any(a is not None and a.rounding == "stochastic" for a in accs))


def hbfp_policy(man_bits: int = 7, tile: int = 24, activations: str = "per_sample", *,
                weight_man_bits: int | None = None, rounding: str = "nearest",
                block_dot: str | None = None, layout: str = "auto") -> DotPolicy:
  """HBFP (BFP dot products, FP32 elsewhere), HBFPEmulator's two versions.

  * ``activations="per_sample"`` (HBFPEmulator v1.0, the README/paper description): the
    forward activations and the output gradients get one exponent per sample
    (``hbfp_batched(man_bits)``); weights are used as given (they are stored narrow by the
    optimizer: see :func:`jaxlp.optim.master_weights`) unless ``weight_man_bits`` is set,
    which tiles them with ``hbfp(weight_man_bits, tile)`` in the forward pass.
  * ``activations="tiled"`` (HBFPEmulator main): activations, weights and output gradients
    are tiled ``hbfp(man_bits, tile)`` (weights with ``weight_man_bits`` if given).

  In both, dX = op_backward(Q(dY), W_used) and dW = op_backward(Q(dY), Q(x)) with the
  forward-quantized operands, computed in FP32 and returned unquantized.

  ``layout`` (:class:`DotPolicy`) says what a tile is on N-D operands: with the default
  ``"auto"`` a plain 2-D matrix product or a convolution is tiled as HBFPEmulator tiles it,
  and a sequence model's (batch, seq, features) activations and gradients get one
  exponent per token (``"per_sample"``) or per token and ``tile`` features (``"tiled"``),
  along the contraction of each GEMM, while weights keep ``tile x tile`` tiles.
  ``layout="hbfp"`` keeps HBFPEmulator's (dim0, rest) view everywhere (a tile of a
  (batch, seq, features) activation then spans several sequences and token positions).

  Args:
    man_bits: mantissa bits (sign excluded, no hidden bit): 7 = "HBFP8", 11 = "HBFP12".
    tile: tile size T (T x T tiles of the (dim0, rest) view; 0 = one exponent per tensor).
    activations: ``"per_sample"`` (v1.0) or ``"tiled"`` (main).
    weight_man_bits: mantissa bits of the in-op weight quantization (see above).
    rounding: ``"nearest"`` (HBFPEmulator's ``determ``) or ``"stochastic"`` (``stoc``, its
      CLI default; needs a key).
    block_dot: :class:`DotPolicy`'s ``block_dot``: ``"exact"`` computes every GEMM as exact
      integer dots per K-block (needs quantized weights: ``activations="tiled"`` or
      ``weight_man_bits``).
    layout: :class:`DotPolicy`'s ``layout``: ``"auto"`` (default), ``"hbfp"`` or
      ``"contraction"``.

  References:
    parsa-epfl/HBFPEmulator ``bfp/bfp_ops.py`` (``_gen_bfp_op``, v1.0 tag 69bfdde and main
    b5cdb1d); Drumond et al., "Training DNNs with Hybrid Block Floating Point", NeurIPS 2018.

  Returns:
    The :class:`DotPolicy` (``lhs`` = activations, ``rhs`` = weights, ``grad`` = output
    gradients; the backward GEMMs reuse the forward-quantized operands).

  Raises:
    ValueError: an unknown ``activations`` or ``layout``, a bad ``man_bits``/``tile``, an
      unknown ``rounding``, or a ``block_dot`` the operands do not allow.

  Example:
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> p = jaxlp.hbfp_policy(7)
    >>> p.lhs.fmt == F.hbfp_batched(7), p.rhs
    (True, None)
    >>> jaxlp.hbfp_policy(7, 24, "tiled").rhs.fmt == F.hbfp(7, 24)
    True
    >>> # a (batch, seq, features) activation: one exponent per token and 24 features
    >>> # ("auto" = "contraction" here); HBFPEmulator's tiles span both sequences
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 3, 48)).at[1, 2, 30].set(4096.0)  # one huge value in token (1, 2)
    >>> eye = jnp.eye(48)  # x . I: the quantized x itself
    >>> for layout in ("auto", "hbfp"):
    ...   q = jaxlp.dot_general(jaxlp.hbfp_policy(7, 24, "tiled", layout=layout))
    ...   y = q(x, eye, (((2,), (0,)), ((), ())))
    ...   print(layout, int((y == 0).sum()), "elements flushed to 0 by the huge exponent")
    auto 23 elements flushed to 0 by the huge exponent
    hbfp 47 elements flushed to 0 by the huge exponent
  """
  if activations not in HBFP_ACTIVATIONS:
    raise ValueError(f"hbfp_policy: activations={activations!r} not in {HBFP_ACTIVATIONS}")
  if layout not in LAYOUTS:
    raise ValueError(f"hbfp_policy: layout={layout!r} not in {LAYOUTS}")
  if activations == "per_sample":
    act = Quant(hbfp_batched(man_bits), rounding)
    w = None if weight_man_bits is None else Quant(hbfp(weight_man_bits, tile), rounding)
  else:
    act = Quant(hbfp(man_bits, tile), rounding)
    wm = man_bits if weight_man_bits is None else weight_man_bits
    w = Quant(hbfp(wm, tile), rounding)
  return DotPolicy(lhs=act, rhs=w, grad=act, block_dot=block_dot, layout=layout)


@renamed_kwargs(elem="fmt", grad_elem="grad_fmt")
def mx_policy(fmt=E4M3FN, block_size: int = 32, *, grad_fmt=None,
              rounding: str = "nearest", block_dot: str | None = None) -> DotPolicy:
  """OCP MX dot products: every operand of every GEMM in ``mx(fmt, block_size)``.

  Blocks run along the contraction axis of each operand in each GEMM (the innermost
  contracting axis of an N-D ``dot_general``; in every ``layout``), so the weights and
  activations are re-quantized for the backward GEMMs (their contraction axes differ from
  the forward pass).

  Args:
    fmt: element format of activations and weights (``E4M3FN`` = MXFP8). Formerly ``elem``.
    block_size: elements per shared E8M0 scale (32 in the OCP spec).
    grad_fmt: element format of the output gradients (default ``fmt``; ``E5M2`` is common).
      Formerly ``grad_elem``.
    rounding: rounding of every quantization.
    block_dot: :class:`DotPolicy`'s ``block_dot``: ``"exact"`` (every MX format: MXINT8,
      MXFP4, MXFP6, MXFP8), ``"fp8"`` (fast, not bit-exact) for fp8-like element formats.

  References:
    OCP Microscaling Formats (MX) Specification v1.0; Rouhani et al., "Microscaling Data
    Formats for Deep Learning", arXiv:2310.10537.

  Returns:
    The :class:`DotPolicy`, with every operand slot set explicitly (no ``"fwd"`` reuse).

  Raises:
    ValueError: an element format MX does not define, a bad ``block_size``, a
      ``rounding`` the formats do not support, or a ``block_dot`` they do not allow.

  Example:
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> p = jaxlp.mx_policy(F.E4M3FN, grad_fmt=F.E5M2)  # MXFP8 forward, E5M2 gradients
    >>> p.lhs.fmt == F.mx(F.E4M3FN, 32), p.grad.fmt.elem
    (True, jaxlp.formats.E5M2)
    >>> p.dlhs_rhs == p.rhs  # re-quantized along the dlhs GEMM's contraction axis
    True
  """
  a = Quant(mx(fmt, block_size), rounding)
  g = Quant(mx(fmt if grad_fmt is None else grad_fmt, block_size), rounding)
  return DotPolicy(lhs=a, rhs=a, grad=g, dlhs_rhs=a, drhs_lhs=a, drhs_grad=g,
                   block_dot=block_dot)


def float_policy(fwd=None, bwd=None, *, rounding: str = "nearest",
                 bwd_rounding: str | None = None, block_dot: str | None = None) -> DotPolicy:
  """Element-wise float quantizers on the GEMM operands (QPyTorch / CPD style).

  Forward operands (activations and weights) are rounded to ``fwd``, the output gradient
  to ``bwd``; the backward GEMMs reuse the forward-quantized operands.

  Args:
    fwd: format of the forward operands (e.g. ``E4M3``, ``cpd_float(5, 2)``), None = FP32.
    bwd: format of the output gradient (e.g. ``E5M2``), None = FP32.
    rounding: rounding of the forward operands.
    bwd_rounding: rounding of the gradient (default ``rounding``).
    block_dot: :class:`DotPolicy`'s ``block_dot``: ``"fp8"`` runs the GEMMs as fp8 dots with
      per-tensor scales (fast, not bit-exact; formats with <= 3 mantissa bits).

  References:
    Zhang et al., "QPyTorch: A Low-Precision Arithmetic Simulation Framework", 2019
    (``quantizer(forward_number, backward_number, ...)``); CPD (drcut/CPD).

  Returns:
    The :class:`DotPolicy`.

  Raises:
    TypeError: ``fwd`` or ``bwd`` is not a jaxlp format (or None).
    ValueError: a rounding the format does not support, or a ``block_dot`` the formats
      do not allow.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> dot = jaxlp.dot_general(jaxlp.float_policy(F.E2M1FN, F.E5M2))
    >>> # the operands are rounded to E2M1 first: 1.3 -> 1.5, 2.6 -> 3 (product 4.5 + 1)
    >>> dot(jnp.array([[1.3, 1.0]]), jnp.array([[2.6], [1.0]]), (((1,), (0,)), ((), ())))
    Array([[5.5]], dtype=float32)
  """
  f = None if fwd is None else Quant(fwd, rounding)
  b = None if bwd is None else Quant(bwd, rounding if bwd_rounding is None else bwd_rounding)
  return DotPolicy(lhs=f, rhs=f, grad=b, block_dot=block_dot)
