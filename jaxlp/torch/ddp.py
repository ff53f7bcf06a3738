"""DistributedDataParallel communication hooks and CPD's ``sum_gradients`` on jaxlp numerics.

* :class:`CommState` + :func:`comm_hook`: ``ddp.register_comm_hook(CommState(...), comm_hook)``
  reduces each gradient bucket to the MEAN over ranks with either

  - a low-precision reduction (``fmt=``): CPD's chain sum in rank order with ``Q`` after each
    add (optionally Kahan-compensated), with APS per parameter or per bucket, or
  - a compressor from :mod:`jaxlp.parallel.compressors` (``cgx``, ``onebit``, ``powersgd``,
    ``topk``, ``dgc``, ``cast``, ...): pure JAX encode on each rank, one ``all_gather`` of the
    packed payload bytes, decode and sum in rank order; error-feedback state kept per bucket.

* :func:`sum_gradients`: CPD's ``CPDtorch.utils.dist_util.sum_gradients`` for non-DDP loops
  (in place on ``p.grad``, SUM semantics).

Every collective is a plain ``torch.distributed`` call (``all_gather``, ``all_reduce``), so the
hooks work with gloo (CPU) and NCCL. Results are identical on every rank: the sums are computed
redundantly, in rank order, from gathered data (``order="chain"``), by the same JAX code as
:func:`jaxlp.parallel.psum`'s chain (IEEE adds with gradual underflow, the format's rounding
after each add); PowerSGD runs the stages of :mod:`jaxlp.parallel`'s low-rank family
(``powersgd_start`` / ``powersgd_middle`` / ``powersgd_finish``) around its two sums.

Mean convention: the bucket is divided by W BEFORE the reduction (as ``allreduce_hook`` and
CGX, and as CPD's examples pre-scale the loss by 1/W); the fp16/bf16 ``cast`` compressor casts
first and divides the fp32 sum (cast payloads are summed in fp32 here, not in the cast type);
PowerSGD divides only Q (PyTorch's order). APS then sees ``g/W`` and uses ``max|(g/W)*W|`` as CPD.

References:
  drcut/CPD ``CPDtorch/utils/dist_util.py``; IST-DASLab/torch_cgx ``cgx_utils/allreduce_hooks.py``;
  PyTorch ``torch/distributed/algorithms/ddp_comm_hooks`` (default_hooks, powerSGD_hook);
  Han, Demmel, You, "Auto-Precision Scaling for Distributed Deep Learning", arXiv:1911.08907.
"""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from jax import lax

from jaxlp.formats import FP32
from jaxlp.formats._compat import cpd_float
from jaxlp.ops._quantize import quantize
from jaxlp.parallel._aggregate import powersgd_finish, powersgd_middle, powersgd_start
from jaxlp.parallel._aps import format_emax
from jaxlp.parallel._psum import _check, _Rounder
from jaxlp.parallel._psum import chain_sum as _psum_chain
from jaxlp.parallel.compressors._base import exact_div
from jaxlp.torch._dlpack import to_jax, to_torch

__all__ = ["CommState", "chain_sum", "comm_hook", "sum_gradients"]

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
  """``(W, *t.shape)`` stack of every rank's ``t`` in rank order (``dist.all_gather``)."""
  w = dist.get_world_size(group)
  out = [torch.empty_like(t) for _ in range(w)]
  dist.all_gather(out, t.contiguous(), group=group)
  return torch.stack(out)


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


@functools.cache
def _powersgd_fns(comp, shape):
  """The low-rank family's three PowerSGD stages (jitted) for one parameter shape; the hook
  sums the P's and the Q's over ranks in between."""

  def start(x, st, key):
    (mat,), (p,) = powersgd_start(comp, [comp.to_matrix(x, shape)], [st], [key])
    return mat, p

  def middle(mat, p_sum):
    (p,), (q,) = powersgd_middle([mat], [p_sum])
    return p, q

  def finish(mat, p, q_sum, st, w):
    (approx,), (new,) = powersgd_finish(comp, [mat], [p], [q_sum], [st], w, mean=True)
    return approx.reshape(-1), new

  return jax.jit(start), jax.jit(middle), jax.jit(finish, static_argnums=4)


# ---------------------------------------------------------------------------------------------
# DDP hook

class CommState:
  """State of :func:`comm_hook` (mutable: per-bucket compressor state and a step counter).

  Args:
    compressor: a compressor from :mod:`jaxlp.parallel.compressors` (exclusive with ``fmt``).
    fmt: an elementwise jaxlp format for CPD's low-precision chain reduction
      (``E4M3``, ``cpd_float(5, 2)``, ...).
    aps: APS for ``fmt``: False, True / ``"parameter"`` (one exponent per parameter, as CPD)
      or ``"bucket"`` (one per DDP bucket).
    kahan: Kahan-compensated chain (``fmt`` only).
    layer_min_size: parameters with fewer elements are reduced in fp32 (compressors only; CGX's
      ``layer_min_size``).
    skip_vectors: reduce parameters with ``ndim <= 1`` (biases, norms) in fp32 (compressors;
      CGX's ``should_compress_``).
    order: how the fp32 parts and PowerSGD's P/Q sums are summed over ranks
      (:data:`FP32_SUM_MODES`): ``"chain"`` (all-gather + rank-order IEEE sum, identical bits
      on every backend) or ``"allreduce"`` (``dist.all_reduce``).
    seed: seed of the per-step compressor noise keys and PowerSGD's initial Q (same on every
      rank).
    process_group: the process group (None = default group).

  With neither ``compressor`` nor ``fmt`` the hook is PyTorch's ``allreduce_hook`` (divide by
  W, fp32 sum).

  Raises:
    ValueError: both ``compressor`` and ``fmt`` are given; ``aps`` is not one of False,
      True, "parameter", "bucket"; ``aps`` or ``kahan`` is set without ``fmt``; ``order`` is
      not "chain" or "allreduce"; ``layer_min_size`` is negative; or ``fmt`` is a format
      whose parameters or roundings are invalid.
    TypeError: ``compressor`` lacks the compressor interface (``init``, ``encode``,
      ``decode``, ``kind``), or ``fmt`` is not a jaxlp format.

  Example:
    Construction needs no process group (registering the hook on a DDP model does; see
    :func:`comm_hook`):

    >>> from jaxlp.formats import cpd_float
    >>> from jaxlp.parallel.compressors import topk
    >>> from jaxlp.torch.ddp import CommState
    >>> state = CommState(fmt=cpd_float(5, 2), aps=True, kahan=True)
    >>> state.fmt, state.aps, state.kahan, state.order, state.step
    (CPDFloat(exp_bits=5, man_bits=2), 'parameter', True, 'chain', 0)
    >>> CommState(compressor=topk(0.1)).compressor
    TopK(ratio=0.1, error_feedback=True, schedule=None)
  """

  def __init__(self, compressor=None, fmt=None, aps=False, kahan=False, layer_min_size=1024,
               skip_vectors=True, order="chain", seed=0, process_group=None):
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
    if layer_min_size < 0:
      raise ValueError(f"jaxlp.torch.ddp.CommState: {layer_min_size=} must be >= 0")
    self.compressor = compressor
    self.fmt = fmt
    self.aps = "parameter" if aps is True else aps
    self.kahan = bool(kahan)
    self.layer_min_size = int(layer_min_size)
    self.skip_vectors = bool(skip_vectors)
    self.order = order
    self.seed = int(seed)
    self.process_group = process_group
    self.step = 0
    self.buckets = {}   # bucket index -> (layout, per-bucket compressor state)

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


def _fmt_bucket(state, flat, layout, w):
  x = flat / w
  if state.aps == "parameter":
    pieces = [(s, e) for s, e, _ in layout]
  elif state.aps == "bucket":
    pieces = [(0, x.numel())]
  else:
    pieces = None
  return _low_precision_sum([x], state.fmt, state.kahan, pieces, state.process_group, w)


def _compressible(state, shape):
  comp = state.compressor
  n = math.prod(shape)
  if n == 0 or n < state.layer_min_size or (state.skip_vectors and len(shape) <= 1):
    return False
  return comp.aggregation.compresses(comp, shape)


def _compressor_bucket(state, bucket, flat, layout, w):
  comp, group = state.compressor, state.process_group
  rank = dist.get_rank(group)
  index = bucket.index()
  sig = tuple(shape for _, _, shape in layout)
  entry = state.buckets.get(index)
  if entry is None or entry[0] != sig:
    entry = (sig, {})
    state.buckets[index] = entry
  store = entry[1]
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

  if comp.kind == "lowrank":
    warm = state.step < comp.start_iter
    for i in comp_idx:
      s, e, shape = layout[i]
      if warm:
        out[s:e] = state._sum(flat[s:e] / w)
        continue
      n, m, r = comp.matrix_shape(shape)
      if i not in store:
        store[i] = comp.init(shape, jnp.float32,
                             key=jax.random.fold_in(jax.random.key(state.seed),
                                                    1000003 + 1000 * index + i))
      start, middle, finish = _powersgd_fns(comp, shape)
      # the cold-start (warm_start=False) random Q: the same key on every rank
      key = jax.random.fold_in(state._step_key(), 1000 * index + i)
      mat, p = start(to_jax(flat[s:e].contiguous()), store[i], key)
      p_sum = to_jax(state._sum(to_torch(p).reshape(-1)).reshape(n, r))
      p, qloc = middle(mat, p_sum)
      q_sum = to_jax(state._sum(to_torch(qloc).reshape(-1)).reshape(m, r))
      approx, store[i] = finish(mat, p, q_sum, store[i], w)
      out[s:e] = to_torch(approx)[:e - s]
    return out

  x = torch.cat([flat[layout[i][0]:layout[i][1]] for i in comp_idx])
  n = x.numel()
  encode, decode_sum, state0 = _codec(comp, n)
  cst = store.get("codec", state0)
  xj = to_jax(x)
  if comp.kind != "cast":
    xj = exact_div(xj, w)
  payload, cst = encode(xj, cst, state._key(rank, index))
  store["codec"] = cst
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

  Args:
    state: the :class:`CommState` given to ``register_comm_hook``.
    bucket: the ``torch.distributed.GradBucket`` DDP passes in.

  Returns:
    A completed ``torch.futures.Future`` holding the bucket buffer, overwritten with the
    mean over ranks.

  Raises:
    TypeError: ``state`` is not a :class:`CommState`, or the bucket is not float32.

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
  buf = bucket.buffer()
  group = state.process_group
  w = dist.get_world_size(group)
  if buf.dtype != torch.float32:
    raise TypeError(f"jaxlp.torch.ddp.comm_hook: bucket dtype must be float32, got "
                    f"dtype={buf.dtype}")
  flat = buf.detach().reshape(-1)
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
  fut = torch.futures.Future()
  fut.set_result(buf)
  return fut
