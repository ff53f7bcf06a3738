"""DistributedDataParallel communication hooks and CPD's ``sum_gradients`` on jaxlp numerics.

* PyTorch's hooks under PyTorch's names, state class and defaults
  (``torch.distributed.algorithms.ddp_comm_hooks``): :func:`allreduce_hook`,
  :func:`fp16_compress_hook`, :func:`bf16_compress_hook`, :func:`fp16_compress_wrapper`,
  :func:`bf16_compress_wrapper`, :class:`PowerSGDState`, :func:`powerSGD_hook`,
  :func:`batched_powerSGD_hook`. Migrating is one import:
  ``from jaxlp.torch.ddp import PowerSGDState, powerSGD_hook``. They compute PyTorch's
  results where PyTorch is right (the fp16/bf16 hooks bit for bit with two ranks, PowerSGD
  with PyTorch's initial Q's to float32 rounding) with the JAX engine's arithmetic (the cast
  family's rounding and ring sum, the low-rank family's stages; the casts and the 16-bit
  rounding of the compress wrappers run as torch ops where those give the engine's bits,
  tested bit for bit against it), and keep PyTorch's state layout. Where they differ is said
  in each docstring (an all-zero gradient gives 0 where PyTorch's PowerSGD gives NaN;
  PyTorch 2.13's ``batched_powerSGD_hook`` fails, jaxlp's runs its definition).

* :class:`CommState` + :func:`comm_hook`: ``ddp.register_comm_hook(CommState(...), comm_hook)``
  reduces each gradient bucket to the MEAN over ranks with either

  - a low-precision reduction (``fmt=``): CPD's chain sum in rank order with ``Q`` after each
    add (optionally Kahan-compensated), with APS per parameter or per bucket, or
  - a compressor from :mod:`jaxlp.parallel.compressors` (``cgx``, ``onebit``, ``powersgd``,
    ``topk``, ``dgc``, ``cast``, ...): pure JAX encode on each rank, one ``all_gather`` of the
    packed payload bytes, decode and sum in rank order; error-feedback state kept per
    parameter (so it survives DDP's bucket rebuild). ``cast("fp16"/"bf16")`` and
    ``powersgd`` run the PyTorch hooks above.

* :func:`sum_gradients`: CPD's ``CPDtorch.utils.dist_util.sum_gradients`` for non-DDP loops
  (in place on ``p.grad``, SUM semantics).

Every collective is a plain ``torch.distributed`` call (``all_gather``, ``all_reduce``), so the
hooks work with gloo (CPU) and NCCL. Results are identical on every rank: :class:`CommState`'s
sums are computed redundantly, in rank order, from gathered data (``order="chain"``), by the
same JAX code as :func:`jaxlp.parallel.psum`'s chain (IEEE adds with gradual underflow, the
format's rounding after each add); the PyTorch hooks' sums are PyTorch's (``all_reduce``).

Mean convention: the bucket is divided by W BEFORE the reduction (as ``allreduce_hook`` and
CGX, and as CPD's examples pre-scale the loss by 1/W); the fp16/bf16 casts divide in the cast
type (PyTorch's order) and sum in it; PowerSGD divides only Q and, in its compressed phase,
the sum of the uncompressed tensors (PyTorch's order). APS then sees ``g/W`` and uses
``max|(g/W)*W|`` as CPD.

References:
  drcut/CPD ``CPDtorch/utils/dist_util.py``; IST-DASLab/torch_cgx ``cgx_utils/allreduce_hooks.py``;
  PyTorch ``torch/distributed/algorithms/ddp_comm_hooks`` (default_hooks, powerSGD_hook);
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization", NeurIPS 2019;
  Han, Demmel, You, "Auto-Precision Scaling for Distributed Deep Learning", arXiv:1911.08907.
"""

import functools
import logging
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from jax import lax
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
  PowerSGDState as _TorchPowerSGDState,
)

from jaxlp.formats import BF16, FP16, FP32
from jaxlp.formats import quantize as spec_quantize
from jaxlp.formats._compat import cpd_float
from jaxlp.ops._quantize import quantize
from jaxlp.parallel._aggregate import (
  _fuse_states,
  _ring_in_narrow_type,
  _unfuse_states,
  cast_gathered_sum,
  cast_share,
  powersgd_finish,
  powersgd_middle,
  powersgd_start,
)
from jaxlp.parallel._aps import format_emax
from jaxlp.parallel._psum import _check, _Rounder
from jaxlp.parallel._psum import chain_sum as _psum_chain
from jaxlp.parallel.compressors._base import exact_div, materialize
from jaxlp.parallel.compressors._cast import cast
from jaxlp.parallel.compressors._powersgd import PowerSGD
from jaxlp.torch._dlpack import to_jax, to_torch

__all__ = [
    "CommState", "PowerSGDState", "allreduce_hook", "batched_powerSGD_hook",
    "bf16_compress_hook", "bf16_compress_wrapper", "chain_sum", "comm_hook",
    "fp16_compress_hook", "fp16_compress_wrapper", "powerSGD_hook", "sum_gradients",
]

_logger = logging.getLogger(__name__)

# How CommState sums its fp32 parts over ranks (not jaxlp.parallel.ORDERS, the summation
# orders of the low-precision psum): gathered + rank-order chain, or dist.all_reduce.
FP32_SUM_MODES = ("chain", "allreduce")
APS_MODES = (False, True, "parameter", "bucket")


def __getattr__(name):
  if name == "ORDERS":
    warnings.warn("jaxlp.torch.ddp.ORDERS is deprecated: the CommState(order=...) values are "
                  "jaxlp.torch.ddp.FP32_SUM_MODES (jaxlp.parallel.ORDERS are psum's orders)",
                  DeprecationWarning, stacklevel=2)
    return FP32_SUM_MODES
  raise AttributeError(f"module 'jaxlp.torch.ddp' has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# Low-precision chain sum (CPD normal_sum_gradients / kahan_sum_gradients)

@functools.cache
def _chain_fn(fmt, kahan: bool):
  """jaxlp.parallel.psum's chain (``_chain``: IEEE float32 adds with gradual underflow, ``Q``
  after each op) over the rows of a gathered stack, started from +0 as CPD (``res = 0``):
  a zero row in front makes psum's ``s = Q(g_0)`` CPD's ``Q(0 + g_0)`` (and its Kahan loop
  CPD's, which starts from ``res = c = 0``)."""
  _check(fmt, "chain", kahan, "nearest", None)
  q = _Rounder(fmt, "nearest", None, 0)

  def f(stack):
    flat = stack.reshape(stack.shape[0], -1)
    flat = jnp.concatenate([jnp.zeros((1, flat.shape[1]), jnp.float32), flat])
    return _psum_chain(flat, q, kahan).reshape(stack.shape[1:])

  return jax.jit(f)


def chain_sum(stack, fmt, kahan: bool = False):
  """CPD's chain sum of a gathered ``(W, n)`` float32 stack, rank order, Q after each op.

  ``res = 0; for r: res = Q(res + g_r)``; with ``kahan``: ``y = Q(g_r - c); t = Q(res + y);
  c = Q(Q(t - res) - y); res = t`` (compensation not added back). Returns ``res`` (a SUM).
  Accepts and returns torch tensors (or JAX arrays). The adds are IEEE float32 with gradual
  underflow on every backend (the arithmetic of :func:`jaxlp.parallel.psum`), so subnormal
  partial sums are kept (XLA:CPU's own float adds flush them to zero).

  Args:
    stack: ``(W, ...)`` float32 ``torch.Tensor`` (or array-like, converted to a float32 JAX
      array): one row per rank, in rank order.
    fmt: an elementwise jaxlp format ``Q`` (``cpd_float(5, 2)``, ``E4M3``, ...).
    kahan: Kahan-compensated chain.

  Returns:
    The SUM over the first axis, a torch tensor for a tensor input, else a JAX array.

  Raises:
    TypeError: ``fmt`` is not a jaxlp format, or not an elementwise one.

  Example:
    >>> import torch
    >>> from jaxlp.formats import BF16, cpd_float
    >>> from jaxlp.torch.ddp import chain_sum
    >>> stack = torch.tensor([[1.0], [0.125], [0.125], [0.125], [0.125]])  # W = 5 ranks
    >>> chain_sum(stack, cpd_float(5, 2))  # each 1 + 0.125 rounds back to 1
    tensor([1.])
    >>> chain_sum(stack, cpd_float(5, 2), kahan=True)  # the exact 1.5
    tensor([1.5000])
    >>> chain_sum(torch.tensor([[3e-39], [3e-39]]), BF16)  # subnormals add up
    tensor([6.0611e-39])
  """
  if isinstance(stack, torch.Tensor):
    return to_torch(_chain_fn(fmt, bool(kahan))(to_jax(stack.contiguous())))
  return _chain_fn(fmt, bool(kahan))(jnp.asarray(stack, jnp.float32))


def _gather(t, group):
  """``(W, *t.shape)`` stack of every rank's ``t`` in rank order (``dist.all_gather`` into the
  rows of one tensor: no stacking copy)."""
  w = dist.get_world_size(group)
  out = torch.empty((w,) + tuple(t.shape), dtype=t.dtype, device=t.device)
  dist.all_gather(list(out.unbind(0)), t.contiguous(), group=group)
  return out


def _aps_exponents(pieces, w):
  """Local ``ceil(log2(max|g*W|))`` per piece (float64; -inf for an all-zero piece)."""
  vals = []
  for g in pieces:
    m = (g * w).abs().max().item() if g.numel() else 0.0
    vals.append(math.ceil(math.log2(m)) if m > 0 and math.isfinite(m) else
                (-math.inf if m == 0 else math.inf))
  return torch.tensor(vals, dtype=torch.float64)


def _scale(t, shift):
  """``t * 2**shift`` computed exactly in float64, rounded once to float32."""
  return (t.double() * (2.0 ** shift)).float()


def _low_precision_sum(pieces, fmt, kahan, aps_pieces, group, w):
  """Chain-sum a list of flat fp32 pieces (concatenated); APS exponent per ``aps_pieces``.

  ``aps_pieces``: None (no APS) or a list of (start, stop) ranges sharing one exponent.
  Returns the flat fp32 result (same bits on every rank).
  """
  from jaxlp.torch._quantize import quantize_raw
  x = torch.cat([p.reshape(-1) for p in pieces]) if len(pieces) != 1 else \
      pieces[0].reshape(-1).contiguous()
  shifts = None
  if aps_pieces is not None:
    a = _aps_exponents([x[s:e] for s, e in aps_pieces], w)
    dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    u = format_emax(fmt)
    # guard (CPD gives NaN): an all-zero parameter on every rank gets shift 0
    shifts = [0 if not math.isfinite(v) else int(u - v) for v in a.tolist()]
    x = torch.cat([_scale(x[s:e], sh) for (s, e), sh in zip(aps_pieces, shifts, strict=True)])
    x = quantize_raw(x, fmt, "nearest", None)
  stack = _gather(x, group)
  res = chain_sum(stack, fmt, kahan)
  if shifts is not None:
    res = torch.cat([_scale(res[s:e], -sh) for (s, e), sh in zip(aps_pieces, shifts,
                                                                 strict=True)])
  return res


def sum_gradients(model, use_APS=False, grad_exp=5, grad_man=2, use_kahan=False,  # noqa: N803
                  group=None):
  """CPD's ``sum_gradients``: in place, every ``p.grad`` becomes the SUM over ranks.

  Per parameter (with ``requires_grad`` and a gradient), in ``model.parameters()`` order:
  all-gather, then the chain sum of :func:`chain_sum` with ``Q = cpd_float(grad_exp,
  grad_man)`` (Kahan with ``use_kahan``); with ``use_APS`` the exponent
  ``A = max_ranks ceil(log2(max|g*W|))``, ``g <- Q(g * 2**(U - A))`` first and the sum
  unscaled after (``U = 2**(grad_exp-1) - 1``). ``(8, 23)`` without Kahan is a plain
  ``dist.all_reduce`` (as CPD). Deviation: an all-zero gradient under APS stays zero (CPD
  produces NaN). Scale the loss by ``1/W`` for a mean, as CPD's examples do.

  Args:
    model: a ``torch.nn.Module`` whose parameters' ``.grad`` are summed in place.
    use_APS: Auto-Precision Scaling (one exponent per parameter, Han et al.,
      arXiv:1911.08907).
    grad_exp, grad_man: exponent and mantissa bits of ``Q = cpd_float(grad_exp, grad_man)``.
    use_kahan: Kahan-compensated chain sum.
    group: the process group (None = default group).

  Returns:
    ``model`` (its gradients modified in place).

  Raises:
    ValueError: ``torch.distributed`` is not initialized, or ``grad_exp`` / ``grad_man`` is
      out of range (exponent 1..8, mantissa 0..23).
    TypeError: a gradient is not float32.

  Example:
    Every rank calls it after ``backward()``; this needs an initialised process group
    (``torch.distributed.init_process_group``), so those lines are skipped here. Without
    one it raises:

    >>> import torch
    >>> from jaxlp.torch.ddp import sum_gradients
    >>> model = torch.nn.Linear(2, 1)
    >>> sum_gradients(model)
    Traceback (most recent call last):
    ...
    ValueError: jaxlp.torch.ddp.sum_gradients: torch.distributed is not initialized
    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo")  # doctest: +SKIP
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> sum_gradients(model, grad_exp=5, grad_man=2, use_kahan=True)  # doctest: +SKIP
    Linear(in_features=2, out_features=1, bias=True)
  """
  if not dist.is_initialized():
    raise ValueError("jaxlp.torch.ddp.sum_gradients: torch.distributed is not initialized")
  w = dist.get_world_size(group)
  fmt = cpd_float(grad_exp, grad_man)
  plain = (grad_exp, grad_man) == (8, 23) and not use_kahan
  for p in model.parameters():
    if not p.requires_grad or p.grad is None:
      continue
    g = p.grad
    if g.dtype != torch.float32:
      raise TypeError(f"jaxlp.torch.ddp.sum_gradients: gradients must be float32, got "
                      f"dtype={g.dtype}")
    if plain and not use_APS:
      dist.all_reduce(g, group=group)
      continue
    res = _low_precision_sum([g.detach()], fmt, use_kahan,
                             [(0, g.numel())] if use_APS else None, group, w)
    g.copy_(res.view_as(g))
  return model


# ---------------------------------------------------------------------------------------------
# Compressors: payload bytes on the wire

def _to_bytes(leaf):
  leaf = jnp.ravel(leaf)
  if leaf.dtype.itemsize == 1:
    return lax.bitcast_convert_type(leaf, jnp.uint8)
  return lax.bitcast_convert_type(leaf, jnp.uint8).reshape(-1)


def _from_bytes(buf, spec):
  n = math.prod(spec.shape)
  size = np.dtype(spec.dtype).itemsize
  if size == 1:
    return lax.bitcast_convert_type(buf, spec.dtype).reshape(spec.shape)
  return lax.bitcast_convert_type(buf.reshape(n, size), spec.dtype).reshape(spec.shape)


@functools.cache
def _codec(comp, n: int):
  """Jitted ``encode(x, state, key) -> (bytes, state)`` and ``decode_sum(stack) -> sum``."""
  state0 = comp.init((n,), jnp.float32)
  spec = jax.eval_shape(lambda x, s: comp.encode(x, s, jax.random.key(0))[0],
                        jax.ShapeDtypeStruct((n,), jnp.float32), state0)
  leaves, treedef = jax.tree_util.tree_flatten(spec)
  sizes = [math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in leaves]

  def encode(x, state, key):
    payload, state = comp.encode(x, state, key)
    flat = [_to_bytes(a) for a in jax.tree_util.tree_leaves(payload)]
    return (jnp.concatenate(flat) if flat else jnp.zeros((0,), jnp.uint8)), state

  def decode_sum(stack):
    out = None
    for r in range(stack.shape[0]):
      off, parts = 0, []
      for s, size in zip(leaves, sizes, strict=True):
        parts.append(_from_bytes(stack[r, off:off + size], s))
        off += size
      d = comp.decode(treedef.unflatten(parts), (n,))
      out = d if out is None else out + d
    return out

  return jax.jit(encode), jax.jit(decode_sum), state0


# ---------------------------------------------------------------------------------------------
# fp16 / bf16 casts: the JAX engine's arithmetic (jaxlp.parallel._aggregate.CASTS), in torch
# where torch gives its bits

_HALF = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@functools.cache
def _cast_fns(comp, w: int):
  """Jitted ``share(x) -> narrow addend`` and ``total(stack) -> float32 sum``: the engine's
  :func:`~jaxlp.parallel._aggregate.cast_share` and its ring sum from the gathered addends
  (:func:`~jaxlp.parallel._aggregate.cast_gathered_sum`, the bits of ``cast_ring_sum``)."""
  dt = comp.native_dtype

  def share(x):
    return lax.convert_element_type(cast_share(comp, x.astype(jnp.float32), w), dt)

  def total(stack):
    return cast_gathered_sum(comp, stack)

  return jax.jit(share), jax.jit(total)


def _gather_bits(t, group):
  """``dist.all_gather`` of a 16-bit float tensor as its bytes (gloo gathers neither int16
  nor, in every version, bfloat16), stacked in rank order and viewed back as ``t``'s dtype."""
  return _gather(t.reshape(-1).view(torch.uint8), group).view(t.dtype)


_TORCH_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@functools.cache
def _subnormal_probe():
  return torch.tensor([2.0 ** -149], dtype=torch.float32)


def _torch_keeps_subnormals() -> bool:
  """Whether torch's float32 arithmetic on this thread is IEEE's gradual underflow (not
  ``torch.set_flush_denormal(True)``): ``1.5 * 2**-149`` rounds to ``2**-148``."""
  return (_subnormal_probe() * 1.5).item() == 2.0 ** -148


def _cast_share_torch(flat, dtype, w: int):
  """:func:`~jaxlp.parallel._aggregate.cast_share` for ``fp16`` / ``bf16`` in torch's
  arithmetic (PyTorch's ``buffer.to(dtype).div_(W)``), the same bits.

  Why the bits are the engine's: ``to(dtype)`` rounds float32 to nearest even with gradual
  underflow and overflow to inf (the format's rounding ``comp.round``); the division of a
  16-bit value by an integer ``w`` is evaluated in float32 (IEEE, gradual underflow) and
  rounded to the 16-bit type: float32 has at least ``2p + 2`` significand bits of either
  format (``p`` = 11, 8), so this double rounding equals the correctly rounded quotient
  (Figueroa), and in bfloat16's subnormal range (the same fixed grid step as float32's times
  ``2**16``) a quotient cannot fall within ``2**-150`` of a midpoint it is not on for
  ``w < 2**16``. Tested bit for bit against the engine over every 16-bit value
  (``tests/torch_bridge/test_ddp_torch_casts.py``). Needs IEEE subnormals in torch (see
  :func:`_torch_keeps_subnormals`) and ``w < 2**16``; NaN payloads are torch's.

  Args:
    flat: a float32, float16 or bfloat16 tensor (not modified).
    dtype: ``torch.float16`` or ``torch.bfloat16``.
    w: the number of ranks.

  Returns:
    The addend, a new ``dtype`` tensor.
  """
  return torch.div(flat.to(dtype), w)


def _cast_gathered_sum_torch(stack):
  """:func:`~jaxlp.parallel._aggregate.cast_gathered_sum` in torch's arithmetic: the rows of
  the 16-bit ``(W, n)`` stack summed in psum's ring order (the vector cut into W chunks,
  chunk c accumulated from rank c's chunk on, ``acc = Q(acc + c_r)`` for r = c+1, c+2, ...
  mod W), each add a torch add in the 16-bit dtype: evaluated in float32 (exact or correctly
  rounded, gradual underflow) and rounded once to the 16-bit type, which equals the correctly
  rounded 16-bit sum ``Q(a + b)`` (float32 has ``>= 2p + 2`` bits). For two ranks the one
  add ``c_0 + c_1``. NaN payloads are torch's (:func:`_cast_mean` makes them the
  engine's).

  Args:
    stack: ``(W, n)`` float16 or bfloat16 tensor, one row per rank in rank order.

  Returns:
    The ``(n,)`` sums, in the stack's dtype.
  """
  w, n = stack.shape
  if w == 1:
    return stack[0].clone()
  if w == 2:
    return stack[0] + stack[1]
  size = -(-n // w)
  xs = torch.nn.functional.pad(stack, (0, w * size - n)).reshape(w, w, size)
  chunks = torch.arange(w, device=stack.device)
  acc = xs[chunks, chunks]
  for k in range(1, w):
    acc = acc + xs[(chunks + k) % w, chunks]
  return acc.reshape(-1)[:n]


def _cast_mean(comp, flat, group, w, out=None):
  """PyTorch's cast hook on ``flat`` (any float dtype): the mean, on the cast grid, written
  into ``out`` (any float dtype, ``flat``'s shape; None: a new float32 tensor) and returned.

  fp16 / bf16 run in torch's arithmetic (:func:`_cast_share_torch`,
  :func:`_cast_gathered_sum_torch`: the engine's bits, tested against it) when torch keeps
  subnormals; otherwise, and for other formats, the engine's jitted ``cast_share`` /
  ``cast_gathered_sum``. Either way ``out`` gets the same bits, NaNs included (the engine's
  positive quiet NaN, as torch writes it into ``out``'s dtype)."""
  if out is None:
    out = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
  nd = comp.native_dtype
  dtype = _TORCH_HALF.get(np.dtype(nd).name) if nd is not None else None
  if dtype is not None and w < 2 ** 16 and _torch_keeps_subnormals():
    total = _cast_gathered_sum_torch(_gather_bits(_cast_share_torch(flat, dtype, w), group))
    out.copy_(total.view_as(out))
    if not math.isfinite(out.sum(dtype=torch.float32).item()):  # one pass: any NaN there?
      # as the jitted path: a float32 result with the engine's NaN, copied into ``out``
      # (torch's 16-bit-to-float32 copy does not give that NaN, nor does its float32-to-bf16
      # copy give the NaN of a scalar write)
      total = total.float()
      total[total.isnan()] = math.nan
      out.copy_(total.view_as(out))
    return out
  share, total = _cast_fns(comp, w)
  mine = to_torch(share(to_jax(flat.contiguous())))
  return out.copy_(to_torch(total(to_jax(_gather_bits(mine, group).contiguous()))).view_as(out))


# ---------------------------------------------------------------------------------------------
# PowerSGD: PyTorch's powerSGD_hook / batched_powerSGD_hook around the JAX engine's stages


class _Plan(NamedTuple):
  """How one DDP bucket is compressed.

  ``unc``: (start, stop) of the uncompressed tensors, bucket order. ``mats``: (start, n, m, r)
  of the compressed matrices in PyTorch's order (tensors grouped by their ``(n, m)`` view,
  groups in order of first appearance); their P's and Q's are concatenated in that order.
  ``groups``: the indices into ``mats`` of each group. ``square``: the side of the batched
  hook's zero-padded square (then ``mats`` is that one matrix), else 0.
  """
  numel: int
  unc: tuple
  mats: tuple
  groups: tuple
  square: int


def _layerwise_plan(shapes, rank, min_rate, keep=None):
  """PyTorch's step I (``_should_compress`` per tensor) for a bucket of ``shapes``; ``keep``:
  an extra per-tensor filter (CommState's explicit ``layer_min_size`` / ``skip_vectors``).
  Returns the plan and PyTorch's compression-stats increments (elements before, after)."""
  unc, groups, before, after, off = [], {}, 0, 0, 0
  starts = []
  for shape in shapes:
    size = math.prod(shape)
    n = shape[0] if len(shape) else 1
    m = size // n if n else 0
    r = min(n, m, rank)
    before += n * m
    if size and (n + m) * r * min_rate < n * m and (keep is None or keep(shape)):
      groups.setdefault((n, m), []).append(len(starts))
      starts.append((off, n, m, r))
      after += (n + m) * r
    else:
      unc.append((off, off + size))
      after += n * m
    off += size
  order = [i for idx in groups.values() for i in idx]
  mats = tuple(starts[i] for i in order)
  pos = {i: k for k, i in enumerate(order)}
  grouped = tuple(tuple(pos[i] for i in idx) for idx in groups.values())
  return _Plan(off, tuple(unc), mats, grouped, 0), before, after


def _square_plan(numel, rank):
  s = math.isqrt(numel - 1) + 1 if numel else 0
  return _Plan(numel, (), ((0, s, s, min(s, rank)),), ((0,),), s)


def _q_size(plan):
  return sum(m * r for _, _, m, r in plan.mats)


def _check_memory(state, what, idx, t, want):
  """A state tensor of bucket ``idx`` that does not fit the bucket is refused (PyTorch's hook
  would fail in an ``add_`` or a ``view``; jaxlp's must not silently reset it)."""
  if t.numel() != want:
    raise ValueError(
        f"jaxlp.torch.ddp: {type(state).__name__}.{what}[{idx}] has {t.numel()} elements, "
        f"bucket {idx} needs {want}: the bucket changed since the state was made (state made "
        "before DDP's bucket rebuild, i.e. start_powerSGD_iter < 2, or one state shared by "
        "two models)")


def _draw_q(plan, seed, dtype, batch_same_shape):
  """PyTorch's initial Q's of one bucket: ``torch.manual_seed(seed)`` (here a generator of its
  own, seeded the same way, so the global RNG is untouched as with PyTorch's ``fork_rng``),
  then ``torch.randn`` of each Q in PyTorch's shapes and order (``(1, m, r)`` per matrix, or
  ``(B, m, r)`` per group of B same-shaped matrices with ``batch_tensors_with_same_shape``;
  ``(s, r)`` for the batched hook), concatenated: the flat Q memory."""
  gen = torch.Generator().manual_seed(int(seed))
  parts = []
  if plan.square:
    _, _, m, r = plan.mats[0]
    parts.append(torch.randn(m, r, generator=gen, dtype=dtype))
  else:
    for idx in plan.groups:
      _, _, m, r = plan.mats[idx[0]]
      if batch_same_shape and len(idx) > 1:
        parts.append(torch.randn(len(idx), m, r, generator=gen, dtype=dtype))
      else:
        parts.extend(torch.randn(1, m, r, generator=gen, dtype=dtype) for _ in idx)
  return torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0, dtype=dtype)


def _split(flat, shapes):
  out, off = [], 0
  for shp in shapes:
    k = math.prod(shp)
    out.append(flat[off:off + k].reshape(shp))
    off += k
  return out


def _cat(arrays, dtype=jnp.float32):
  return jnp.concatenate([jnp.ravel(a) for a in arrays]) if arrays else jnp.zeros((0,), dtype)


def _narrow(v, dtype):
  """float32 ``v`` rounded to the 16-bit ``dtype`` (float16 or bfloat16) by XLA's conversion:
  the bits of ``jaxlp.formats.quantize(v, FP16 / BF16).astype(dtype)`` (nearest even, overflow
  to inf, NaN as the spec's positive quiet NaN), tested in
  ``tests/torch_bridge/test_ddp_powersgd_pieces.py``; without the spec's integer rounding,
  which fused into the products of ``P Q^T`` cost 6x the stage (2-core CPU, 2026-11-29). Only
  for values that leave the program in ``dtype`` (a float32 -> 16-bit -> float32 conversion
  pair may be removed by XLA as excess precision)."""
  return jnp.where(jnp.isnan(v), jnp.float32(jnp.nan), v).astype(dtype)


def _segments(plan):
  """(start, stop) of the pieces :func:`_powersgd_stages`' ``finish_pieces`` returns, in
  bucket order: the uncompressed tensors and the matrices (the batched hook: one piece)."""
  if plan.square:
    return ((0, plan.numel),)
  return tuple(sorted(list(plan.unc) + [(s, s + n * m) for s, n, m, _ in plan.mats]))


@functools.cache
def _stage_fns(plan, comp, w: int, half_fmt, error_feedback: bool):
  """The stages of one bucket (Python functions, see :func:`_powersgd_stages`)."""
  return _define_stages(plan, comp, w, half_fmt, error_feedback)


@functools.cache
def _powersgd_stages(plan, comp, w: int, half_fmt, error_feedback: bool):
  """Jitted ``(start, middle, finish)`` of :func:`_define_stages`."""
  f = _stage_fns(plan, comp, w, half_fmt, error_feedback)
  return jax.jit(f["start"]), jax.jit(f["middle"]), jax.jit(f["finish"])


@functools.cache
def _powersgd_hook_stages(plan, comp, w: int, half_fmt, error_feedback: bool):
  """Jitted stages of :func:`_define_stages` that the hooks run: for a float32 bucket
  ``(start, middle, finish_pieces, errors)``, else ``(half_round, half_start, half_middle,
  half_finish_pieces, half_errors)``."""
  f = _stage_fns(plan, comp, w, half_fmt, error_feedback)
  if half_fmt is None:
    return (jax.jit(f["start"]), jax.jit(f["middle"]), jax.jit(f["finish_pieces"]),
            jax.jit(f["errors"]))
  return (jax.jit(f["half_round"]), jax.jit(f["half_start"]), jax.jit(f["half_middle"]),
          jax.jit(f["half_finish_pieces"]), jax.jit(f["half_errors"]))


def _define_stages(plan, comp, w: int, half_fmt, error_feedback: bool):
  """The stages of one bucket: the JAX engine's ``powersgd_start`` /
  ``powersgd_middle`` / ``powersgd_finish`` (``comp``: without error feedback, warm start:
  the Q given is orthogonalized), with PyTorch's bucket-level error feedback around them.
  ``half_fmt``: None for a float32 bucket, else its 16-bit format (the fp16/bf16 wrappers):
  the values PyTorch holds in the bucket's dtype are rounded to it (bucket + error, P and Q
  as sent, the output, the error).

  ``start(x, e, q) -> (xe, unc, p)``: ``xe = x + e`` (the batched hook: zero-padded to
  ``s*s`` first), the uncompressed tensors of ``xe`` concatenated, the local P's.
  ``middle(xe, p_sum) -> (p, q)``: ``P = orth(sum P)``, the local ``Q = M^T P``.
  ``finish(xe, p, q_sum, unc_sum) -> (out, err, q)``: the bucket (``unc_sum / W`` for the
  uncompressed tensors, ``P (sum Q / W)^T`` for the others), ``err = xe - out`` (None
  without error feedback) and the new Q memory ``sum Q / W``.
  ``finish_pieces(xe, p, q_sum, unc_sum) -> (outs, q)``: the same values with ``out`` as
  the list of the pieces of :func:`_segments` (a compressed matrix's piece as its ``(n, m)``
  matrix, row-major; the batched hook: one piece, the ``s x s`` matrix, the bucket is the
  first ``numel`` of it flattened), which the hook writes into the bucket with torch;
  ``errors(xe, out) -> err`` from the assembled bucket (the batched hook: from the ``s*s``
  piece). XLA:CPU assembling the whole bucket from the pieces took most of the stage's time,
  and computing ``err`` in the same program recomputed every product ``P Q^T`` (2-core CPU,
  2026-11-29). ``finish`` assembles the same pieces in JAX.

  Tried for a float32 bucket and not kept: ``x + e`` computed again inside every loop that
  reads it (no ``xe`` buffer) and the error's pieces computed with the approximation in the
  last stage (no ``errors`` stage, torch copying the pieces into the error): as fast within
  the noise of a loaded 2-core CPU, slower at rank 1, and more bytes read per step (the
  error's loop reads the approximation back, ``x`` and ``e`` are read twice more).

  A 16-bit bucket's hook runs ``half_round(x, e) -> (xe16, unc)``: ``xe`` rounded to the
  bucket's dtype by XLA's conversion (:func:`_narrow`: the bits of ``rnd``), half the bytes
  of the float32 ``xe``; then ``half_start(xe16, q) -> p`` and ``middle`` /
  ``finish_pieces`` / ``errors`` on ``xe16`` widened (exact) at their start. In one program
  the products would compute the rounding again for every column (a float32 -> 16-bit ->
  float32 pair may also be removed by XLA), so it is a stage of its own: the old ``start``
  (spec rounding, a materialized float32 ``xe``) took 1.8 ms on the 128 x 9216 bucket at rank
  2, ``half_round`` + ``half_start`` 1.2 ms (min of 80, 2-core CPU, loaded, 2026-11-29).
  """
  rnd = (lambda v: v) if half_fmt is None else (lambda v: spec_quantize(v, half_fmt))
  out_dt = jnp.float32 if half_fmt is None else (
      jnp.float16 if half_fmt == FP16 else jnp.bfloat16)
  q_shapes = [(m, r) for _, _, m, r in plan.mats]
  p_shapes = [(n, r) for _, n, _, r in plan.mats]
  segments = _segments(plan)

  def matrices(xe):
    if plan.square:
      return [xe.reshape(plan.square, plan.square)]
    return [xe[s:s + n * m].reshape(n, m) for s, n, m, _ in plan.mats]

  def combined(x, e):
    """The float32 bucket + error as the matrices read it (before ``rnd``)."""
    xe = x.astype(jnp.float32)
    if plan.square:
      xe = jnp.pad(xe, (0, plan.square * plan.square - plan.numel))
    return xe + e.astype(jnp.float32) if error_feedback else xe

  def products(xe, q):
    """The local P of every matrix of float32 ``xe`` (concatenated, in ``out_dt``)."""
    qs = _split(q.astype(jnp.float32), q_shapes)
    _, ps = powersgd_start(comp, matrices(xe), [{"q": qi} for qi in qs], None)
    return _cat(ps).astype(out_dt)

  def start(x, e, q):
    xe = combined(x, e)
    if error_feedback:
      xe = rnd(xe)
      if half_fmt is not None:  # computed once, not inside every product (the same bits)
        # the barrier reads q, not xe's first element (which XLA:CPU computed again, rounding
        # included, for every element)
        xe = materialize(xe, anchor=q)
    unc = _cat([xe[a:b] for a, b in plan.unc])
    return xe, unc.astype(out_dt), products(xe, q)

  def middle(xe, p_sum):
    ps, qs = powersgd_middle(comp, matrices(xe), _split(p_sum.astype(jnp.float32), p_shapes))
    return rnd(_cat(ps)), _cat(qs).astype(out_dt)

  def narrow(v):  # rnd(v).astype(out_dt), the same bits (see _narrow)
    return v if half_fmt is None else _narrow(v, out_dt)

  def finish_pieces(xe, p, q_sum, unc_sum):
    qs = _split(q_sum.astype(jnp.float32), q_shapes)
    sts = [{"q": qi, "iter": jnp.zeros((), jnp.int32)} for qi in qs]
    approx, news = powersgd_finish(comp, matrices(xe), _split(p, p_shapes), qs, sts, w,
                                   mean=True)
    q_new = narrow(_cat([st["q"] for st in news]))
    # the matrices' pieces leave as (n, m) matrices (row-major: the bucket's order; the hook
    # flattens them with torch): a flattened (n*m,) output made XLA:CPU compute every
    # element's (row, column) with a division and a remainder, 3.5x the products' time
    # (128 x 9216 at rank 2: 1.4 ms against 0.4 ms, 2-core CPU, 2026-11-29)
    if plan.square:
      return [narrow(approx[0])], q_new
    sums = _split(exact_div(unc_sum.astype(jnp.float32), w), [(b - a,) for a, b in plan.unc])
    piece = dict(zip(plan.unc, sums, strict=True))  # (start, stop) -> values
    piece.update(((s, s + n * m), v) for (s, n, m, _), v in zip(plan.mats, approx,
                                                                strict=True))
    return [narrow(piece[ab]) for ab in segments], q_new

  def errors(xe, out):
    """``xe - out`` in the bucket's dtype; ``out``: the assembled bucket (float32 or the
    bucket's dtype), or for the batched hook the ``s*s`` piece of ``finish_pieces``, flattened."""
    return narrow(xe - out.astype(jnp.float32))

  def finish(xe, p, q_sum, unc_sum):
    outs, q_new = finish_pieces(xe, p, q_sum, unc_sum)
    outs = [v.reshape(-1) for v in outs]
    if plan.square:
      err = errors(xe, outs[0]) if error_feedback else None
      return outs[0][:plan.numel], err, q_new
    out = jnp.zeros((plan.numel,), out_dt)
    for i, (a, b) in enumerate(segments):
      out = out.at[a:b].set(outs[i])
    return out, errors(xe, out) if error_feedback else None, q_new

  def half_round(x, e):
    xe = combined(x, e)
    xe16 = _narrow(xe, out_dt) if error_feedback else xe.astype(out_dt)
    return xe16, _cat([xe16[a:b] for a, b in plan.unc], out_dt)

  def half_start(xe16, q):
    return products(xe16.astype(jnp.float32), q)

  def wide(fn):
    return lambda xe16, *args: fn(xe16.astype(jnp.float32), *args)

  return {"start": start, "middle": middle, "finish": finish, "finish_pieces": finish_pieces,
          "errors": errors, "half_round": half_round, "half_start": half_start,
          "half_middle": wide(middle), "half_finish_pieces": wide(finish_pieces),
          "half_errors": wide(errors)}


def _hook_comp(rank, min_rate, eps, half, method="auto"):
  """The low-rank compressor whose stages a hook runs (error feedback and the choice of Q are
  the hook's): PyTorch's orthogonalization rule, Gram-Schmidt at every rank for
  half-precision buckets as PyTorch (QR has no half-precision kernel there)."""
  return PowerSGD(rank=rank, min_compression_rate=float(min_rate), warm_start=True,
                  error_feedback=False,
                  orthogonalization="gram_schmidt" if half and method == "auto" else method,
                  orthogonalization_epsilon=float(eps))


def _powersgd_bucket(flat, plan, *, comp, w, error, q, sum_fn, error_feedback, out=None):
  """One PowerSGD step of a bucket: the three stages and the three sums over ranks.

  ``flat``: the bucket (float32, float16 or bfloat16). ``error``: the bucket's error (its
  dtype, ``plan``'s length; ignored without error feedback). ``q``: the Q memory (flat, in
  ``plan``'s order; orthogonalized here, as PyTorch does for a warm or a fresh Q).
  ``sum_fn(t)``: the SUM over ranks of a tensor (in its dtype). ``out``: where to write the
  result (``flat``'s length and dtype; may be the bucket itself); None: a new tensor.
  Returns ``(out, err, p, q)`` as torch tensors of the bucket's dtype (``err`` None without
  error feedback).
  """
  dt = flat.dtype
  half_fmt = {torch.float16: FP16, torch.bfloat16: BF16}.get(dt)
  stages = _powersgd_hook_stages(plan, comp, w, half_fmt, bool(error_feedback))
  x = to_jax(flat.contiguous())
  e = to_jax(error.contiguous()) if error_feedback else jnp.zeros((0,), jnp.float32)
  if half_fmt is None:
    start, middle, finish, errors = stages
    xe, unc, p_loc = start(x, e, to_jax(q.contiguous()))
  else:
    round_, start, middle, finish, errors = stages
    xe, unc = round_(x, e)  # the bucket + error rounded to its dtype, as PyTorch holds it
    p_loc = start(xe, to_jax(q.contiguous()))
  unc_sum = sum_fn(to_torch(unc).clone()) if plan.unc else to_torch(unc)
  p_sum = sum_fn(to_torch(p_loc).clone())
  p, q_loc = middle(xe, to_jax(p_sum.contiguous()))
  q_sum = sum_fn(to_torch(q_loc).clone())
  outs, q_new = finish(xe, p, to_jax(q_sum.contiguous()), to_jax(unc_sum.contiguous()))
  # to_torch waits for the stage: every read of ``xe`` (which may alias ``flat``) is done
  # before ``out`` (which may be ``flat``) is written
  pieces = [to_torch(v).reshape(-1) for v in outs]  # row-major (n, m) matrices: views
  if out is None:
    out = torch.empty(plan.numel, dtype=dt, device=flat.device)
  if plan.square:
    out.copy_(pieces[0][:plan.numel])
  else:
    for (a, b), v in zip(_segments(plan), pieces, strict=True):
      out[a:b].copy_(v)
  err = None
  if error_feedback:
    err = to_torch(errors(xe, to_jax(pieces[0] if plan.square else out)))
  return out, err, to_torch(p if p.dtype == q_new.dtype else p.astype(q_new.dtype)), \
      to_torch(q_new)


def _allreduce_sum(group):
  def f(t):
    dist.all_reduce(t, group=group)
    return t
  return f


def _done(buf):
  fut = torch.futures.Future()
  fut.set_result(buf)
  return fut


def _world(process_group):
  return process_group if process_group is not None else dist.group.WORLD


# ---------------------------------------------------------------------------------------------
# PyTorch's hooks (torch.distributed.algorithms.ddp_comm_hooks) on jaxlp's arithmetic


class PowerSGDState(_TorchPowerSGDState):
  r"""PyTorch's ``PowerSGDState``, for :func:`powerSGD_hook` and :func:`batched_powerSGD_hook`.

  A subclass of ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``
  with its signature, defaults, checks and fields: ``matrix_approximation_rank=1``,
  ``start_powerSGD_iter=1_000``, ``min_compression_rate=2``, ``use_error_feedback=True``,
  ``warm_start=True``, ``orthogonalization_epsilon=0``, ``random_seed=0``,
  ``compression_stats_logging_frequency=10_000``, ``batch_tensors_with_same_shape=False``.
  ``start_powerSGD_iter <= 1`` with error feedback or warm start raises PyTorch's
  ``ValueError``: DDP rebuilds its buckets after the first iteration, so a state made
  before would belong to buckets that no longer exist; from iteration 2 on the bucket
  indices and layouts stay fixed, which is how PyTorch's per-bucket state (and this one,
  keyed the same way) is kept across the rebuild. The internal state is PyTorch's, in its
  layout: ``error_dict`` / ``p_memory_dict`` / ``q_memory_dict`` (flat tensors per bucket
  index, P's and Q's concatenated in PyTorch's order), ``rng`` (the ``numpy`` generator whose
  draws seed the initial Q's), ``iter``, the compression statistics; a state can be pickled,
  and moves between PyTorch's hooks and jaxlp's.

  Args:
    process_group: the process group (None: the default group).
    matrix_approximation_rank: the rank of the factors.
    start_powerSGD_iter: iterations of plain all-reduce before compression.
    min_compression_rate: a tensor is compressed iff
      ``(n + m) * r * min_compression_rate < n * m``.
    use_error_feedback: keep the local compression error and add it to the next bucket.
    warm_start: reuse the last Q (else a fresh random Q every step).
    orthogonalization_epsilon: added to each column norm in Gram-Schmidt.
    random_seed: seed of the ``numpy`` generator that seeds the initial Q's.
    compression_stats_logging_frequency: iterations between the statistics log lines.
    batch_tensors_with_same_shape: draw (and, in PyTorch, compute) same-shaped tensors as
      one batch.

  Raises:
    ValueError: ``start_powerSGD_iter <= 1`` with ``use_error_feedback`` or ``warm_start``.

  Example:
    >>> from jaxlp.torch.ddp import PowerSGDState
    >>> state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
    >>> state.matrix_approximation_rank, state.start_powerSGD_iter, state.iter
    (2, 10, 0)
    >>> PowerSGDState(None, start_powerSGD_iter=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` ...
  """

  __slots__ = ()

  def __getstate__(self):
    return {slot: getattr(self, slot) for slot in _TorchPowerSGDState.__slots__
            if slot != "process_group"}


def _check_bucket(what, bucket):
  buf = bucket.buffer()
  if buf.dtype not in (torch.float32, torch.float16, torch.bfloat16):
    raise TypeError(f"jaxlp.torch.ddp.{what}: bucket dtype must be float32, float16 or "
                    f"bfloat16, got dtype={buf.dtype}")
  return buf


def _check_powersgd_state(what, state):
  if not isinstance(state, _TorchPowerSGDState):
    raise TypeError(f"jaxlp.torch.ddp.{what}: state must be a PowerSGDState (jaxlp's or "
                    f"PyTorch's), got {state!r}")


def _vanilla(state, group, bucket):
  """PyTorch's hooks before ``start_powerSGD_iter``: :func:`allreduce_hook`."""
  state.maybe_increase_iter(bucket)
  return allreduce_hook(group, bucket)


def _report_stats(bucket, state):
  if bucket.is_last() and state.iter >= state.next_stats_report:
    rate, before, after = state.compression_stats()
    _logger.info("Compression stats: iter %s, total before compression %s, total after "
                 "compression %s, rate %s", state.iter, before, after, rate)
    state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _powersgd_hook(state, bucket, square):
  group = _world(state.process_group)
  w = group.size()
  buf = bucket.buffer()
  if state.iter < state.start_powerSGD_iter:
    return _vanilla(state, group, bucket)
  flat = buf.reshape(-1)
  idx = bucket.index()
  rank = state.matrix_approximation_rank
  if square:
    plan = _square_plan(flat.numel(), rank)
    s = plan.square
    state.total_numel_before_compression += plan.numel
    state.total_numel_after_compression += s * rank * 2
  else:
    plan, before, after = _layerwise_plan([tuple(g.shape) for g in bucket.gradients()], rank,
                                          state.min_compression_rate)
    state.total_numel_before_compression += before
    state.total_numel_after_compression += after
  _report_stats(bucket, state)
  n_err = plan.square * plan.square if square else plan.numel
  error = None
  if state.use_error_feedback:
    error = state.error_dict.get(idx)
    if error is None:
      error = torch.zeros(n_err, dtype=buf.dtype, device=buf.device)
    _check_memory(state, "error_dict", idx, error, n_err)
  if not state.warm_start or idx not in state.p_memory_dict:
    q = _draw_q(plan, state.rng.randint(1_000_000_000), buf.dtype,
                bool(state.batch_tensors_with_same_shape)).to(buf.device)
  else:
    q = state.q_memory_dict[idx].reshape(-1)
    _check_memory(state, "q_memory_dict", idx, q, _q_size(plan))
  comp = _hook_comp(rank, state.min_compression_rate, state.orthogonalization_epsilon,
                    buf.dtype != torch.float32)
  in_place = buf.is_contiguous()  # then ``flat`` is a view of the bucket: written in place
  out, err, p, q = _powersgd_bucket(flat, plan, comp=comp, w=w, error=error, q=q,
                                    sum_fn=_allreduce_sum(group),
                                    error_feedback=state.use_error_feedback,
                                    out=flat if in_place else None)
  if state.use_error_feedback:
    state.error_dict[idx] = err
  if square:  # PyTorch's layout: P and Q of the batched hook are (s, r) matrices
    r = plan.mats[0][3]
    p, q = p.reshape(-1, r), q.reshape(-1, r)
  state.p_memory_dict[idx] = p
  state.q_memory_dict[idx] = q
  if not state.warm_start:
    state.p_memory_dict.clear()
    state.q_memory_dict.clear()
  if not in_place:
    buf.copy_(out.view_as(buf))
  state.maybe_increase_iter(bucket)
  return _done(buf)


def powerSGD_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:  # noqa: N802
  """PyTorch's ``powerSGD_hook`` (layer-wise PowerSGD) on jaxlp's PowerSGD stages.

  PyTorch's algorithm step by step: plain :func:`allreduce_hook` for the first
  ``start_powerSGD_iter`` iterations; then error feedback over the whole bucket
  (``x = bucket + error``); the tensors that pass ``_should_compress`` are viewed as
  ``(shape[0], -1)`` matrices and compressed, the others (biases, small tensors) are
  all-reduced together, then divided by W; the initial Q's are ``torch.randn`` draws seeded
  by ``state.rng.randint(1_000_000_000)`` in PyTorch's shapes and order (so the same
  ``random_seed`` gives PyTorch's Q's), reused afterwards with warm start; per matrix
  ``orth(Q)``, ``P = M Q``, all-reduce of the bucket's P's, ``orth(P)``, ``Q = M^T P``,
  all-reduce of the Q's, ``Q /= W``, ``M~ = P Q^T``; error ``x - out`` for the whole bucket.
  ``orth`` is PyTorch's: Gram-Schmidt for rank <= 2 (and for float16/bfloat16 buckets),
  Householder QR above (:func:`jaxlp.parallel.compressors.orthogonalize`). The sums are
  ``dist.all_reduce`` in the bucket's dtype, as PyTorch's.

  Agreement with PyTorch's own hook (2 ranks, gloo, the same state arguments and buckets;
  ``tests/torch_bridge/test_ddp_hooks.py``): the uncompressed tensors' bits, and the
  compressed ones to float32 rounding (jaxlp's products are fixed pairwise sums, PyTorch's
  BLAS's: about 1e-6 relative per step); the initial Q's bit for bit. Deviation: with
  ``orthogonalization_epsilon=0`` an all-zero column (an all-zero gradient) gives 0 where
  PyTorch gives NaN. The work is done synchronously and an already completed future is
  returned (the result is identical on every rank).

  Args:
    state: a :class:`PowerSGDState` (or PyTorch's own).
    bucket: the ``torch.distributed.GradBucket`` DDP passes in.

  Returns:
    A completed ``torch.futures.Future`` holding the bucket buffer, overwritten with the
    (approximate) mean over ranks.

  Raises:
    TypeError: ``state`` is not a PowerSGDState; the bucket is not float32, float16 or
      bfloat16.

  Example:
    Registered like PyTorch's (the lines that need a process group are skipped here):

    >>> from jaxlp.torch.ddp import PowerSGDState, powerSGD_hook
    >>> state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
    >>> ddp_model.register_comm_hook(state, powerSGD_hook)  # doctest: +SKIP
  """
  _check_powersgd_state("powerSGD_hook", state)
  _check_bucket("powerSGD_hook", bucket)
  return _powersgd_hook(state, bucket, square=False)


def batched_powerSGD_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:  # noqa: N802
  """PyTorch's ``batched_powerSGD_hook``: the whole bucket as one zero-padded square matrix.

  As PyTorch defines it: plain :func:`allreduce_hook` for the first ``start_powerSGD_iter``
  iterations; then the flat bucket is zero-padded to ``s * s`` (``s = ceil(sqrt(numel))``),
  the error (``s * s`` long) added, viewed as ``s x s``, compressed with one rank-``r``
  PowerSGD step (Q drawn as ``torch.randn(s, r)`` seeded by ``state.rng``, warm start, the
  all-reduces of P and Q, Q divided by W) and cut back to ``numel``. Differences: PyTorch
  2.13's own hook raises ``AssertionError`` at its first compressed step (its
  ``_orthogonalize`` wants a batch of matrices, the batched hook passes one matrix); the
  tests compare with it with that call given the 3-D view it expects. ``r = min(s, rank)``
  (PyTorch would fail for ``rank > s``). An all-zero bucket gives 0, not NaN.

  Args:
    state: a :class:`PowerSGDState` (or PyTorch's own).
    bucket: the ``torch.distributed.GradBucket`` DDP passes in.

  Returns:
    A completed ``torch.futures.Future`` holding the bucket buffer, overwritten with the
    (approximate) mean over ranks.

  Raises:
    TypeError: ``state`` is not a PowerSGDState; the bucket is not float32, float16 or
      bfloat16.

  Example:
    >>> from jaxlp.torch.ddp import PowerSGDState, batched_powerSGD_hook
    >>> state = PowerSGDState(None, matrix_approximation_rank=1)
    >>> ddp_model.register_comm_hook(state, batched_powerSGD_hook)  # doctest: +SKIP
  """
  _check_powersgd_state("batched_powerSGD_hook", state)
  _check_bucket("batched_powerSGD_hook", bucket)
  return _powersgd_hook(state, bucket, square=True)


def allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
  """PyTorch's ``allreduce_hook``: the bucket divided by W, then summed over ranks.

  A float32 bucket: ``x / W`` (IEEE division) and ``dist.all_reduce`` (float32 adds), PyTorch's
  arithmetic. A float16/bfloat16 bucket (inside :func:`fp16_compress_wrapper` /
  :func:`bf16_compress_wrapper`): the cast hooks' arithmetic (divided by W in the bucket's
  dtype, summed in it, see :func:`fp16_compress_hook`), so
  ``fp16_compress_wrapper(allreduce_hook)`` equals :func:`fp16_compress_hook`, as in PyTorch.

  Args:
    process_group: the process group (None: the default group).
    bucket: the ``torch.distributed.GradBucket`` DDP passes in.

  Returns:
    A completed future holding the bucket buffer, overwritten with the mean over ranks.

  Raises:
    TypeError: the bucket is not float32, float16 or bfloat16.

  Example:
    >>> from jaxlp.torch.ddp import allreduce_hook
    >>> ddp_model.register_comm_hook(None, allreduce_hook)  # doctest: +SKIP
  """
  buf = _check_bucket("allreduce_hook", bucket)
  group = _world(process_group)
  if buf.dtype in _HALF:
    _cast_mean(cast(_HALF[buf.dtype]), buf.reshape(-1), group, group.size(), out=buf)
    return _done(buf)
  x = to_torch(_div_fn(group.size())(to_jax(buf.reshape(-1).contiguous()))).clone()
  dist.all_reduce(x, group=group)
  buf.copy_(x.view_as(buf))
  return _done(buf)


@functools.cache
def _div_fn(w):
  return jax.jit(lambda x: exact_div(x, w))


def _compress_hook(name, dtype, process_group, bucket):
  buf = _check_bucket(name, bucket)
  group = _world(process_group)
  _cast_mean(cast(dtype), buf.reshape(-1), group, group.size(), out=buf)
  return _done(buf)


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
  """PyTorch's ``fp16_compress_hook``, bit for bit: ``fp16(x) / W`` summed in float16.

  Each rank rounds its bucket to float16 and divides by W in float16 (PyTorch's
  ``buffer.to(torch.float16).div_(W)``); the float16 addends are all-gathered (2 bytes per
  element) and summed in float16 by :func:`jaxlp.parallel.psum`'s ring (each partial sum rounded
  to float16): the JAX engine's own arithmetic for ``compressors.cast("fp16")``
  (``jaxlp.parallel._aggregate.cast_share`` / ``cast_ring_sum``), so the bridge and
  ``reduce_gradients`` agree. It runs as torch ops (the rounding, division and adds in float16
  give the engine's bits, tested over every float16 value) unless torch flushes subnormals
  (``torch.set_flush_denormal``): then as the engine's jitted code. With two ranks that is the one
  correctly rounded float16 add of PyTorch's float16 all-reduce: the same bits as PyTorch's hook
  (a 3e-8 gradient becomes 0 in both). With more ranks PyTorch sums in the backend's order (gloo's
  or NCCL's ring), jaxlp in psum's declared ring order (chunk c starts at rank c), so elements may
  differ in their last float16 bit. The result is identical on every rank. An element that
  overflows float16 (its value, its quotient or its sum) is inf alone, as in PyTorch; the engine's
  non-finite policy (a whole leaf NaN) is not applied in the hooks.

  Args:
    process_group: the process group (None: the default group).
    bucket: the ``torch.distributed.GradBucket`` DDP passes in.

  Returns:
    A completed future holding the bucket buffer, overwritten with the mean over ranks (on the
    float16 grid).

  Raises:
    TypeError: the bucket is not float32, float16 or bfloat16.

  Example:
    >>> from jaxlp.torch.ddp import fp16_compress_hook
    >>> ddp_model.register_comm_hook(None, fp16_compress_hook)  # doctest: +SKIP
  """
  return _compress_hook("fp16_compress_hook", "fp16", process_group, bucket)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
  """PyTorch's ``bf16_compress_hook``, bit for bit: :func:`fp16_compress_hook` in bfloat16.

  Args:
    process_group: the process group (None: the default group).
    bucket: the ``torch.distributed.GradBucket`` DDP passes in.

  Returns:
    A completed future holding the bucket buffer, overwritten with the mean over ranks (on the
    bfloat16 grid).

  Raises:
    TypeError: the bucket is not float32, float16 or bfloat16.

  Example:
    >>> from jaxlp.torch.ddp import bf16_compress_hook
    >>> ddp_model.register_comm_hook(None, bf16_compress_hook)  # doctest: +SKIP
  """
  return _compress_hook("bf16_compress_hook", "bf16", process_group, bucket)


def _compress_wrapper(name, dtype, fmt, hook):
  if not callable(hook):
    raise TypeError(f"jaxlp.torch.ddp.{name}: hook must be a communication hook (a callable "
                    f"(state, bucket) -> Future), got {hook!r}")

  def wrapped(hook_state, bucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if buf.dtype != torch.float32:
      raise TypeError(f"jaxlp.torch.ddp.{name}: bucket dtype must be float32, got "
                      f"dtype={buf.dtype}")
    bucket.set_buffer(_round_to_half(buf.reshape(-1), fmt, dtype).view_as(buf))
    fut = hook(hook_state, bucket)

    def decompress(f):
      out = bucket.buffer()
      out.copy_(f.value())
      return out

    return fut.then(decompress)

  wrapped.__name__ = f"{name}_hook"
  wrapped.__qualname__ = wrapped.__name__
  return wrapped


@functools.cache
def _round_fn(fmt, dtype):
  return jax.jit(lambda x: lax.convert_element_type(spec_quantize(x, fmt), dtype))


def _round_to_half(flat, fmt, dtype):
  """A new 16-bit tensor: float32 ``flat`` rounded to ``fmt`` (FP16 / BF16, ``dtype`` its JAX
  dtype) as :func:`jaxlp.formats.quantize` rounds, bits included. torch's ``to(dtype)``
  (nearest even, gradual underflow, overflow to inf: tested against it in
  ``tests/torch_bridge/test_ddp_torch_casts.py``) when every element is finite and torch
  keeps subnormals; else the jitted spec (which also gives its own NaN)."""
  tdt = _TORCH_HALF[np.dtype(dtype).name]
  if _torch_keeps_subnormals() and math.isfinite(flat.sum().item()):
    return flat.to(tdt)
  return to_torch(_round_fn(fmt, dtype)(to_jax(flat.contiguous()))).clone()


def fp16_compress_wrapper(hook):
  """PyTorch's ``fp16_compress_wrapper``: run ``hook`` on the bucket rounded to float16.

  The bucket buffer is replaced by its float16 rounding (nearest even, jaxlp's FP16), ``hook``
  runs on it (its ``bucket.gradients()`` are float16 views of it, as in PyTorch), and its
  float16 result is what DDP writes back into the float32 gradients. Works around any hook:
  PyTorch's, :func:`powerSGD_hook` (P and Q all-reduced in float16, Gram-Schmidt at every
  rank as PyTorch for half precision), :func:`comm_hook`. ``fp16_compress_wrapper(
  allreduce_hook)`` is :func:`fp16_compress_hook`.

  Args:
    hook: a communication hook ``(state, bucket) -> Future``.

  Returns:
    The wrapped hook (register it with the state ``hook`` takes).

  Raises:
    TypeError: ``hook`` is not callable; at run time, a bucket that is not float32.

  Example:
    >>> from jaxlp.torch.ddp import PowerSGDState, fp16_compress_wrapper, powerSGD_hook
    >>> hook = fp16_compress_wrapper(powerSGD_hook)
    >>> hook.__name__
    'fp16_compress_wrapper_hook'
    >>> state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=10)
    >>> ddp_model.register_comm_hook(state, hook)  # doctest: +SKIP
  """
  return _compress_wrapper("fp16_compress_wrapper", jnp.float16, FP16, hook)


def bf16_compress_wrapper(hook):
  """PyTorch's ``bf16_compress_wrapper``: :func:`fp16_compress_wrapper` in bfloat16.

  Args:
    hook: a communication hook ``(state, bucket) -> Future``.

  Returns:
    The wrapped hook.

  Raises:
    TypeError: ``hook`` is not callable; at run time, a bucket that is not float32.

  Example:
    >>> from jaxlp.torch.ddp import bf16_compress_wrapper, powerSGD_hook
    >>> bf16_compress_wrapper(powerSGD_hook).__name__
    'bf16_compress_wrapper_hook'
  """
  return _compress_wrapper("bf16_compress_wrapper", jnp.bfloat16, BF16, hook)


# ---------------------------------------------------------------------------------------------
# jaxlp's hook: CommState + comm_hook


class CommState:
  """State of :func:`comm_hook` (mutable: per-parameter compressor state and a step counter).

  Args:
    compressor: a compressor from :mod:`jaxlp.parallel.compressors` (exclusive with ``fmt``).
    fmt: an elementwise jaxlp format for CPD's low-precision chain reduction
      (``E4M3``, ``cpd_float(5, 2)``, ...).
    aps: APS for ``fmt``: False, True / ``"parameter"`` (one exponent per parameter, as CPD)
      or ``"bucket"`` (one per DDP bucket).
    kahan: Kahan-compensated chain (``fmt`` only).
    layer_min_size: parameters with fewer elements are reduced in fp32 (compressors only; CGX's
      ``layer_min_size``). None: 1024 for quantizers and sparsifiers (CGX's default), 0 for
      ``powersgd`` and ``cast`` (PyTorch's hooks compress every layer: PowerSGD every tensor
      its ``_should_compress`` test accepts, the fp16/bf16 hooks the whole bucket).
    skip_vectors: reduce parameters with ``ndim <= 1`` (biases, norms) in fp32 (compressors;
      CGX's ``should_compress_``). None: True for quantizers and sparsifiers, False for
      ``powersgd`` (its own test never compresses a vector) and ``cast``.
    order: how the fp32 parts and PowerSGD's P/Q sums are summed over ranks
      (:data:`FP32_SUM_MODES`): ``"chain"`` (all-gather + rank-order IEEE sum, identical bits
      on every backend) or ``"allreduce"`` (``dist.all_reduce``).
    seed: seed of the per-step compressor noise keys, and of PowerSGD's initial Q's (drawn as
      PyTorch's ``PowerSGDState(random_seed=seed)`` draws them).
    process_group: the process group (None = default group).

  With neither ``compressor`` nor ``fmt`` the hook is PyTorch's ``allreduce_hook`` (divide by
  W, fp32 sum).

  State across DDP's bucket rebuild (after the first iteration DDP regroups the parameters
  into new buckets): the compressor state (error feedback, warm-start Q) is kept per
  parameter, so it moves with each parameter into its new bucket and a compressor may start
  at step 0. Batched PowerSGD's state belongs to a whole bucket, so there, as in PyTorch,
  ``start_iter`` must be at least 2 when error feedback or warm start is on.

  Raises:
    ValueError: both ``compressor`` and ``fmt`` are given; ``aps`` is not one of False,
      True, "parameter", "bucket"; ``aps`` or ``kahan`` is set without ``fmt``; ``order`` is
      not "chain" or "allreduce"; ``layer_min_size`` is negative; batched PowerSGD with
      error feedback or warm start and ``start_iter < 2``; or ``fmt`` is a format whose
      parameters or roundings are invalid.
    TypeError: ``compressor`` lacks the compressor interface (``init``, ``encode``,
      ``decode``, ``kind``), or ``fmt`` is not a jaxlp format.

  Example:
    Construction needs no process group (registering the hook on a DDP model does; see
    :func:`comm_hook`):

    >>> from jaxlp.formats import cpd_float
    >>> from jaxlp.parallel.compressors import powersgd, topk
    >>> from jaxlp.torch.ddp import CommState
    >>> state = CommState(fmt=cpd_float(5, 2), aps=True, kahan=True)
    >>> state.fmt, state.aps, state.kahan, state.order, state.step
    (CPDFloat(exp_bits=5, man_bits=2), 'parameter', True, 'chain', 0)
    >>> st = CommState(compressor=topk(0.1))
    >>> st.compressor, st.layer_min_size, st.skip_vectors
    (TopK(ratio=0.1, error_feedback=True, schedule=None), 1024, True)
    >>> st = CommState(compressor=powersgd(2))
    >>> st.layer_min_size, st.skip_vectors
    (0, False)
  """

  def __init__(self, compressor=None, fmt=None, aps=False, kahan=False, layer_min_size=None,
               skip_vectors=None, order="chain", seed=0, process_group=None):
    if compressor is not None and fmt is not None:
      raise ValueError("jaxlp.torch.ddp.CommState: give compressor= or fmt=, not both")
    if compressor is not None and not all(hasattr(compressor, a) for a in
                                          ("init", "encode", "decode", "kind")):
      raise TypeError(f"jaxlp.torch.ddp.CommState: compressor must be a jaxlp.parallel."
                      f"compressors object, got {compressor!r}")
    if aps not in APS_MODES:
      raise ValueError(f"jaxlp.torch.ddp.CommState: aps={aps!r} must be one of {APS_MODES}")
    if (aps or kahan) and fmt is None:
      raise ValueError(f"jaxlp.torch.ddp.CommState: {aps=} / {kahan=} need fmt=")
    if fmt is not None:
      quantize(jnp.zeros((1,), jnp.float32), fmt)  # validates the format
    if order not in FP32_SUM_MODES:
      raise ValueError(f"jaxlp.torch.ddp.CommState: {order=} must be one of {FP32_SUM_MODES}")
    if layer_min_size is not None and layer_min_size < 0:
      raise ValueError(f"jaxlp.torch.ddp.CommState: {layer_min_size=} must be >= 0")
    kind = getattr(compressor, "kind", None)
    if (kind == "lowrank" and compressor.batched and compressor.start_iter < 2
        and (compressor.error_feedback or compressor.warm_start)):
      raise ValueError(
          f"jaxlp.torch.ddp.CommState: batched PowerSGD keeps its error feedback and warm-start "
          f"Q per DDP bucket, and DDP rebuilds its buckets after the first iteration; as "
          f"PyTorch's PowerSGDState, it needs start_iter >= 2 (got start_iter="
          f"{compressor.start_iter}); use powersgd(..., batched=True, start_iter=2)")
    pytorch_like = kind in ("lowrank", "cast")
    self._explicit_filter = layer_min_size is not None or skip_vectors is not None
    self.compressor = compressor
    self.fmt = fmt
    self.aps = "parameter" if aps is True else aps
    self.kahan = bool(kahan)
    self.layer_min_size = int(layer_min_size if layer_min_size is not None else
                              (0 if pytorch_like else 1024))
    self.skip_vectors = bool(skip_vectors if skip_vectors is not None else not pytorch_like)
    self.order = order
    self.seed = int(seed)
    self.process_group = process_group
    self.step = 0
    self.rng = np.random.RandomState(self.seed)  # PowerSGD's Q seeds, as PyTorch's state
    self.param_states = {}   # id(parameter) -> that parameter's compressor state
    self.bucket_states = {}  # bucket index -> (parameter ids, state): batched PowerSGD

  def __repr__(self):
    return (f"CommState(compressor={self.compressor!r}, fmt={self.fmt!r}, aps={self.aps!r}, "
            f"kahan={self.kahan}, layer_min_size={self.layer_min_size}, order={self.order!r}, "
            f"step={self.step})")

  def _sum(self, x):
    """fp32 SUM over ranks: rank-order chain (:func:`chain_sum` in FP32: IEEE adds) or
    ``all_reduce``."""
    if self.order == "allreduce":
      x = x.clone()
      dist.all_reduce(x, group=self.process_group)
      return x
    return chain_sum(_gather(x, self.process_group), FP32)

  def _step_key(self):
    return jax.random.fold_in(jax.random.key(self.seed), self.step)

  def _key(self, rank, index):
    return jax.random.fold_in(jax.random.fold_in(self._step_key(), rank), index)


def _bucket_layout(bucket, flat):
  """(start, stop, shape) of each parameter's gradient inside the flat bucket buffer."""
  grads = bucket.gradients()
  out, off = [], 0
  for g in grads:
    n = g.numel()
    out.append((off, off + n, tuple(g.shape)))
    off += n
  if off != flat.numel():
    out = [(0, flat.numel(), (flat.numel(),))]
  return out


def _param_keys(bucket, layout):
  """A key per layout entry that follows the parameter across DDP's bucket rebuild."""
  params = bucket.parameters()
  if len(params) == len(layout):
    return [id(p) for p in params]
  return [("bucket", bucket.index(), i) for i in range(len(layout))]


def _fmt_bucket(state, flat, layout, w):
  x = flat / w
  if state.aps == "parameter":
    pieces = [(s, e) for s, e, _ in layout]
  elif state.aps == "bucket":
    pieces = [(0, x.numel())]
  else:
    pieces = None
  return _low_precision_sum([x], state.fmt, state.kahan, pieces, state.process_group, w)


def _passes_filter(state, shape):
  n = math.prod(shape)
  return n > 0 and n >= state.layer_min_size and not (state.skip_vectors and len(shape) <= 1)


def _compressible(state, shape):
  comp = state.compressor
  return _passes_filter(state, shape) and comp.aggregation.compresses(comp, shape)


def _comm_powersgd(state, bucket, flat, layout, w):
  """:func:`powerSGD_hook` / :func:`batched_powerSGD_hook` for a ``powersgd`` compressor, its
  state kept per parameter (per bucket when batched)."""
  comp = state.compressor
  if state.step < comp.start_iter:
    return state._sum(flat / w)
  keys = _param_keys(bucket, layout)
  method = comp.orthogonalization
  hcomp = _hook_comp(comp.rank, comp.min_compression_rate, comp.orthogonalization_epsilon,
                     False, method)
  if comp.batched:
    plan = _square_plan(flat.numel(), comp.rank)
    entry = state.bucket_states.get(bucket.index())
    if entry is None or entry[0] != keys:
      entry = (keys, {})
      state.bucket_states[bucket.index()] = entry
    st = entry[1]
    n_err = plan.square * plan.square
    error = st.get("error") if comp.error_feedback else None
    if comp.error_feedback and error is None:
      error = torch.zeros(n_err, dtype=torch.float32, device=flat.device)
    q = st.get("q") if comp.warm_start else None
    if q is None:
      q = _draw_q(plan, state.rng.randint(1_000_000_000), torch.float32, False).to(flat.device)
    out, err, _, q = _powersgd_bucket(flat, plan, comp=hcomp, w=w, error=error, q=q,
                                      sum_fn=state._sum, error_feedback=comp.error_feedback)
    st["error"], st["q"] = err, q
    return out
  keep = (lambda shape: _passes_filter(state, shape)) if state._explicit_filter else None
  plan, _, _ = _layerwise_plan([shape for _, _, shape in layout], comp.rank,
                               comp.min_compression_rate, keep)
  by_start = {s: i for i, (s, _, _) in enumerate(layout)}
  mat_params = [by_start[s] for s, _, _, _ in plan.mats]
  store = state.param_states
  error = None
  if comp.error_feedback:
    error = torch.cat([store.get(k, {}).get("error", torch.zeros(e - s, device=flat.device))
                       for k, (s, e, _) in zip(keys, layout, strict=True)])
  qs = [store.get(keys[i], {}).get("q") for i in mat_params]
  if comp.warm_start and all(q is not None for q in qs):
    q = torch.cat(qs) if qs else torch.zeros(0, device=flat.device)
  else:
    q = _draw_q(plan, state.rng.randint(1_000_000_000), torch.float32, False).to(flat.device)
  out, err, _, q = _powersgd_bucket(flat, plan, comp=hcomp, w=w, error=error, q=q,
                                    sum_fn=state._sum, error_feedback=comp.error_feedback)
  if comp.error_feedback:
    for k, (s, e, _) in zip(keys, layout, strict=True):
      store.setdefault(k, {})["error"] = err[s:e]
  if comp.warm_start:
    off = 0
    for i, (_, _, m, r) in zip(mat_params, plan.mats, strict=True):
      store.setdefault(keys[i], {})["q"] = q[off:off + m * r]
      off += m * r
  return out


def _fused_state(comp, store, keys, sizes, state0):
  """The codec state of the concatenation of the given parameters (each one's own state, or
  a fresh one), as ``state0`` is shaped; None when the compressor's state is not
  elementwise."""
  if not getattr(comp, "elementwise_state", False):
    return None
  parts = [store[k] if k in store else comp.init((n,), jnp.float32)
           for k, n in zip(keys, sizes, strict=True)]
  fused = _fuse_states(parts)
  same = jax.tree_util.tree_structure(fused) == jax.tree_util.tree_structure(state0) and all(
      a.shape == b.shape for a, b in zip(jax.tree_util.tree_leaves(fused),
                                         jax.tree_util.tree_leaves(state0), strict=True))
  return fused if same else None


def _compressor_bucket(state, bucket, flat, layout, w):
  comp, group = state.compressor, state.process_group
  if comp.kind == "lowrank":
    return _comm_powersgd(state, bucket, flat, layout, w)
  rank = dist.get_rank(group)
  index = bucket.index()
  out = torch.empty_like(flat)
  comp_idx = [i for i, (_, _, shape) in enumerate(layout) if _compressible(state, shape)]
  plain = [i for i in range(len(layout)) if i not in comp_idx]
  if plain:
    x = torch.cat([flat[layout[i][0]:layout[i][1]] for i in plain]) / w
    r = state._sum(x)
    off = 0
    for i in plain:
      s, e, _ = layout[i]
      out[s:e] = r[off:off + e - s]
      off += e - s
  if not comp_idx:
    return out
  x = torch.cat([flat[layout[i][0]:layout[i][1]] for i in comp_idx])
  if comp.kind == "cast" and _ring_in_narrow_type(comp):
    r = _cast_mean(comp, x, group, w)   # PyTorch's fp16/bf16 hook, the engine's arithmetic
  else:
    n = x.numel()
    keys = _param_keys(bucket, layout)
    ckeys = [keys[i] for i in comp_idx]
    sizes = [layout[i][1] - layout[i][0] for i in comp_idx]
    encode, decode_sum, state0 = _codec(comp, n)
    store = state.param_states
    cst = _fused_state(comp, store, ckeys, sizes, state0)
    per_param = cst is not None
    if not per_param:  # state not elementwise: kept per bucket (reset if the bucket changes)
      entry = state.bucket_states.get(index)
      cst = entry[1] if entry is not None and entry[0] == ckeys else state0
    xj = to_jax(x)
    if comp.kind != "cast":
      xj = exact_div(xj, w)
    payload, cst = encode(xj, cst, state._key(rank, index))
    if per_param:
      for k, st in zip(ckeys, _unfuse_states(cst, sizes), strict=True):
        store[k] = st
    else:
      state.bucket_states[index] = (ckeys, cst)
    stack = _gather(to_torch(payload), group)
    r = decode_sum(to_jax(stack))
    if comp.kind == "cast":
      r = exact_div(r, w)
    r = to_torch(r)
  off = 0
  for i in comp_idx:
    s, e, _ = layout[i]
    out[s:e] = r[off:off + e - s]
    off += e - s
  return out


def comm_hook(state: CommState, bucket) -> torch.futures.Future[torch.Tensor]:
  """DDP communication hook: the bucket's gradients reduced to the MEAN over ranks.

  Register with ``ddp_model.register_comm_hook(CommState(...), comm_hook)``. The work is
  done synchronously (gathers, JAX encode/decode, rank-order sums) and an already completed
  future is returned; the result is bit-identical on every rank. (This module deliberately
  has no ``from __future__ import annotations``: DDP checks the return annotation object.)

  A ``cast("fp16")`` / ``cast("bf16")`` compressor is :func:`fp16_compress_hook` /
  :func:`bf16_compress_hook` (the same bits); a ``powersgd`` compressor is
  :func:`powerSGD_hook` (``batched=True``: :func:`batched_powerSGD_hook`) with
  ``matrix_approximation_rank=rank``, ``start_powerSGD_iter=start_iter``, the sums in
  ``order``, and its state kept per parameter. A float16/bfloat16 bucket (inside
  :func:`fp16_compress_wrapper`) is reduced as float32 values and the result rounded to the
  bucket's dtype.

  Args:
    state: the :class:`CommState` given to ``register_comm_hook``.
    bucket: the ``torch.distributed.GradBucket`` DDP passes in.

  Returns:
    A completed ``torch.futures.Future`` holding the bucket buffer, overwritten with the
    mean over ranks.

  Raises:
    TypeError: ``state`` is not a :class:`CommState`, or the bucket is not float32, float16
      or bfloat16.

  Example:
    The hook runs inside DDP's backward, which needs an initialised process group, so the
    lines that need one are skipped here:

    >>> import torch
    >>> from jaxlp.formats import cpd_float
    >>> from jaxlp.torch.ddp import CommState, comm_hook
    >>> state = CommState(fmt=cpd_float(5, 2), aps=True)
    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo")  # doctest: +SKIP
    >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))  # doctest: +SKIP
    >>> ddp.register_comm_hook(state, comm_hook)  # doctest: +SKIP
    >>> ddp(torch.ones(1, 2)).sum().backward()  # doctest: +SKIP
    >>> state.step  # doctest: +SKIP
    1
  """
  if not isinstance(state, CommState):
    raise TypeError(f"jaxlp.torch.ddp.comm_hook: state must be a CommState, got {state!r}")
  buf = _check_bucket("comm_hook", bucket)
  group = state.process_group
  w = dist.get_world_size(group)
  flat = buf.detach().reshape(-1)
  if flat.dtype != torch.float32:
    flat = flat.float()
  layout = _bucket_layout(bucket, flat)
  if state.fmt is not None:
    res = _fmt_bucket(state, flat, layout, w)
  elif state.compressor is not None:
    res = _compressor_bucket(state, bucket, flat, layout, w)
  else:
    res = state._sum(flat / w)
  if bucket.is_last():
    state.step += 1
  buf.copy_(res.view_as(buf))
  return _done(buf)
