"""`dot_general(policy)`: a `lax.dot_general` whose forward and backward GEMMs follow a policy.

The engine (:func:`quantized_bilinear`) is shared with :func:`jaxlp.ops.conv_general_dilated`: a
``jax.custom_vjp`` whose forward pass quantizes the operands and runs the plain lax op, and
whose backward pass quantizes the output gradient (and, per the policy, re-quantizes or
reuses the operands) and runs the TRANSPOSE of the same plain lax op
(``jax.linear_transpose``), so every dimension-number / grouping / dilation case is exactly
what autodiff of the lax op would compute on the quantized operands.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp.formats._block import MXFormat, is_axis_blocked
from jaxlp.formats._block_dot import (
    block_length,
    check_exact,
    contraction_blocks,
    significand_bits,
)
from jaxlp.formats._quantize import is_elementwise, join_key, split_key
from jaxlp.ops import _block_dot as BD
from jaxlp.ops._policy import FWD, GRAD, Accum, DotPolicy, Quant
from jaxlp.ops._quantize import quantize  # kernel on a GPU where it is faster

SLOTS = ("lhs", "rhs", "grad", "dlhs_rhs", "drhs_lhs", "drhs_grad")


class SlotGeometry(NamedTuple):
  """How an operand slot is blocked: ``perm`` = transpose to the tiling view (None = as
  given); ``axis`` = contraction axis for axis-blocked formats (None = the format's own)."""

  perm: tuple[int, ...] | None = None
  axis: int | None = None


def _is_axis_blocked(fmt) -> bool:
  return is_axis_blocked(fmt)  # mx, BlockFormat(axis=...), 1-D nvfp4 (the formats' protocol)


def quantize_operand(x, quant: Quant | None, key, slot: str, geom: SlotGeometry):
  """Quantize one GEMM operand per its slot's :class:`Quant` and geometry (None: as is)."""
  if quant is None:
    return x
  fmt = quant.fmt
  perm = geom.perm
  if _is_axis_blocked(fmt):
    if geom.axis is not None:
      fmt = dataclasses.replace(fmt, axis=geom.axis)
    perm = None
  elif is_elementwise(fmt):
    perm = None
  k = None
  if quant.stochastic:
    if key is None:
      raise ValueError(
          f"jaxlp: operand {slot!r} uses rounding='stochastic' but no key was given: pass "
          "key=jax.random.key(...) to jaxlp.dot_general / conv_general_dilated (a fresh one "
          "per step), or rngs={'quantize': key} to a model from jaxlp.flax.quantize_model")
    k = jax.random.fold_in(key, SLOTS.index(slot))
  if perm is None or perm == tuple(range(x.ndim)):
    return quantize(x, fmt, quant.rounding, key=k)
  inv = tuple(int(i) for i in np.argsort(perm))
  q = quantize(jnp.transpose(x, perm), fmt, quant.rounding, key=k)
  return jnp.transpose(q, inv)


def quantized_bilinear(op, lhs, rhs, policy: DotPolicy, geometry: dict[str, SlotGeometry],
                       key=None, gemms: dict[str, Any] | None = None):
  """Apply the bilinear lax op ``op(lhs, rhs)`` with the policy's quantization (custom_vjp).

  Args:
    op: ``(lhs, rhs) -> out``, bilinear (a closed-over lax.dot_general / conv).
    lhs, rhs: operands.
    policy: the :class:`DotPolicy`.
    geometry: slot name -> :class:`SlotGeometry`.
    key: PRNG key for stochastic slots (slot i draws from ``fold_in(key, i)``).
    gemms: optional replacements of the three GEMMs, ``{"fwd": f(l, r), "dlhs": f(g, r),
      "drhs": f(l, g)}`` (accumulator emulation); missing ones use ``op`` / its transpose.

  Returns:
    ``op`` of the quantized operands, with the policy's backward pass.

  Raises:
    ValueError: the policy is stochastic and ``key`` is None.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> from jaxlp.ops import quantized_bilinear
    >>> from jaxlp.ops._dot_general import SLOTS, SlotGeometry
    >>> geometry = {slot: SlotGeometry() for slot in SLOTS}  # elementwise: no blocking
    >>> policy = jaxlp.DotPolicy(lhs=F.E2M1FN, grad=F.E2M1FN)
    >>> f = lambda l, r: quantized_bilinear(jnp.multiply, l, r, policy, geometry)
    >>> f(jnp.array([1.3]), jnp.array([2.0]))  # lhs 1.3 -> 1.5
    Array([3.], dtype=float32)
    >>> # d/dr = Q(grad) * Q(l) = 1 * 1.5; d/dl = Q(grad) * r = 2
    >>> jax.grad(lambda l, r: f(l, r).sum(), argnums=(0, 1))(jnp.array([1.3]), jnp.array([2.0]))
    (Array([2.], dtype=float32), Array([1.5], dtype=float32))
  """
  gemms = gemms or {}
  if policy.block_dot is not None and len(gemms) != 3:
    raise NotImplementedError(
        f"jaxlp: block_dot={policy.block_dot!r} is implemented for jaxlp.dot_general "
        "(2-D operands, one contracting dimension, no batch dimensions) and "
        "jaxlp.conv_general_dilated only, not for this op; use block_dot=None there")
  if policy.stochastic and key is None:
    raise ValueError(
        "jaxlp: the policy uses rounding='stochastic' but no key was given: pass "
        "key=jax.random.key(...) (a fresh one per step)")
  kdata, kimpl = split_key(key)
  out_aval = jax.eval_shape(op, lhs, rhs)
  lhs_aval = jax.ShapeDtypeStruct(lhs.shape, lhs.dtype)
  rhs_aval = jax.ShapeDtypeStruct(rhs.shape, rhs.dtype)

  def q(x, slot, k):
    return quantize_operand(x, getattr(policy, slot), k, slot, geometry[slot])

  def fwd(l, r, kd):
    k = join_key(kd, kimpl)
    lq, rq = q(l, "lhs", k), q(r, "rhs", k)
    out = gemms["fwd"](lq, rq) if "fwd" in gemms else op(lq, rq)
    out = out.astype(out_aval.dtype)
    res = (lq if policy.drhs_lhs == FWD else l, rq if policy.dlhs_rhs == FWD else r, kd)
    return out, res

  def bwd(res, g):
    l_res, r_res, kd = res
    k = join_key(kd, kimpl)
    r_dl = r_res if policy.dlhs_rhs == FWD else q(r_res, "dlhs_rhs", k)
    l_dr = l_res if policy.drhs_lhs == FWD else q(l_res, "drhs_lhs", k)
    g_dl = q(g, "grad", k)
    g_dr = g_dl if policy.drhs_grad == GRAD else q(g, "drhs_grad", k)
    if "dlhs" in gemms:
      dl = gemms["dlhs"](g_dl, r_dl)
    else:
      (dl,) = jax.linear_transpose(lambda x: op(x, r_dl), lhs_aval)(g_dl)
    if "drhs" in gemms:
      dr = gemms["drhs"](l_dr, g_dr)
    else:
      (dr,) = jax.linear_transpose(lambda w: op(l_dr, w), rhs_aval)(g_dr)
    kd_ct = None
    return dl.astype(lhs.dtype), dr.astype(rhs.dtype), kd_ct

  @jax.custom_vjp
  def f(l, r, kd):
    return fwd(l, r, kd)[0]

  f.defvjp(fwd, bwd)
  return f(lhs, rhs, kdata)


def _dot_geometry(dimension_numbers, lhs_ndim, rhs_ndim) -> dict[str, SlotGeometry]:
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
  lfree = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
  rfree = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
  nb = len(lb)
  geo = {s: SlotGeometry() for s in SLOTS}
  if lc:
    i = max(range(len(lc)), key=lambda j: lc[j])
    geo["lhs"] = SlotGeometry(axis=lc[i])
    geo["rhs"] = SlotGeometry(axis=rc[i])
  if rfree:
    geo["dlhs_rhs"] = SlotGeometry(axis=rfree[-1])
    geo["grad"] = SlotGeometry(axis=nb + len(lfree) + len(rfree) - 1)
  if lfree:
    geo["drhs_lhs"] = SlotGeometry(axis=lfree[-1])
    geo["drhs_grad"] = SlotGeometry(axis=nb + len(lfree) - 1)
  return geo


def _accum_gemms(policy: DotPolicy, dimension_numbers, lhs, rhs):
  """GEMM replacements routing accumulator-emulated GEMMs through ``jaxlp.ops.matmul``."""
  accs = {"fwd": policy.fwd_acc, "dlhs": policy.dlhs_acc, "drhs": policy.drhs_acc}
  if all(a is None for a in accs.values()):
    return {}
  (lc, rc), (lb, rb) = dimension_numbers
  if not (lhs.ndim == 2 and rhs.ndim == 2 and len(lc) == 1 and len(rc) == 1 and not lb
          and not rb):
    raise NotImplementedError(
        "jaxlp.dot_general: accumulator emulation (fwd_acc/dlhs_acc/drhs_acc) supports only "
        "2-D operands with one contracting dimension and no batch dimensions, got "
        f"lhs.ndim={lhs.ndim}, rhs.ndim={rhs.ndim}, dimension_numbers={dimension_numbers}")
  lt = int(lc[0]) == 0  # lhs stored as (K, M)
  rt = int(rc[0]) == 1  # rhs stored as (N, K)

  def mm(a, b, acc: Accum):
    from jaxlp.ops._matmul import matmul  # noqa: PLC0415  (import cycle)
    return matmul(a.astype(jnp.float32), b.astype(jnp.float32), mul=acc.mul, acc=acc.acc,
                  algorithm=acc.algorithm, chunk=acc.chunk, rounding=acc.rounding)

  def canon_l(x):
    return x.T if lt else x

  def canon_r(x):
    return x.T if rt else x

  gemms = {}
  if accs["fwd"] is not None:
    gemms["fwd"] = lambda l, r: mm(canon_l(l), canon_r(r), accs["fwd"])
  if accs["dlhs"] is not None:
    gemms["dlhs"] = lambda g, r: canon_l(mm(g, canon_r(r).T, accs["dlhs"]))
  if accs["drhs"] is not None:
    gemms["drhs"] = lambda l, g: canon_r(mm(canon_l(l).T, g, accs["drhs"]))
  return gemms


def _block_gemms(policy: DotPolicy, dimension_numbers, lhs, rhs, geo):
  """GEMM replacements for ``policy.block_dot`` (``"exact"``: integer block dots with the
  bits of ``jaxlp/ops/_block_dot.py``; ``"fp8"``: the fp8 fast mode)."""
  mode = policy.block_dot
  if mode is None:
    return {}
  (lc, rc), (lb, rb) = dimension_numbers
  if not (lhs.ndim == 2 and rhs.ndim == 2 and len(lc) == 1 and len(rc) == 1 and not lb
          and not rb):
    raise NotImplementedError(
        f"jaxlp.dot_general: block_dot={mode!r} supports only 2-D operands with one "
        f"contracting dimension and no batch dimensions, got lhs.ndim={lhs.ndim}, "
        f"rhs.ndim={rhs.ndim}, dimension_numbers={dimension_numbers}")
  lc, rc = int(lc[0]) % 2, int(rc[0]) % 2
  grad_shape = (lhs.shape[1 - lc], rhs.shape[1 - rc])
  shapes = {"lhs": lhs.shape, "rhs": rhs.shape, "grad": grad_shape, "dlhs_rhs": rhs.shape,
            "drhs_lhs": lhs.shape, "drhs_grad": grad_shape}
  # the contraction axis of each GEMM's two operands, in the operands' stored layout
  axes = {"fwd": (lc, rc), "dlhs": (1, 1 - rc), "drhs": (1 - lc, 0)}
  plan = {}
  for gemm, ((sa, qa), (sb, qb)) in policy.gemm_operands().items():
    ax_a, ax_b = axes[gemm]
    k = shapes[sa][ax_a]

    def length(slot, q, ax, k=k):
      if mode == "fp8" and not isinstance(q.fmt, MXFormat):
        return k  # per-tensor scale: no blocks
      return block_length(q.fmt, shapes[slot], ax, geo[slot].axis)

    g = contraction_blocks(length(sa, qa, ax_a), length(sb, qb, ax_b), k)
    if mode == "exact":
      bits = (significand_bits(qa.fmt), significand_bits(qb.fmt))
      check_exact(g, *bits, what=f"dot_general ({gemm} GEMM)")
      plan[gemm] = functools.partial(_exact_gemm, g=g, bits=bits, policy=policy)
    else:
      plan[gemm] = functools.partial(_fp8_gemm, g=g, fmts=(qa.fmt, qb.fmt), policy=policy)
  lt = lc == 0  # lhs stored as (K, M)
  rt = rc == 1  # rhs stored as (N, K)

  def canon_l(x):
    return x.T if lt else x

  def canon_r(x):
    return x.T if rt else x

  return {
      "fwd": lambda l, r: plan["fwd"](canon_l(l), canon_r(r)),
      "dlhs": lambda g, r: canon_l(plan["dlhs"](g, canon_r(r).T)),
      "drhs": lambda l, g: canon_r(plan["drhs"](canon_l(l).T, g)),
  }


def _exact_gemm(a, b, *, g, bits, policy):
  return BD.block_dot(a.astype(jnp.float32), b.astype(jnp.float32), g, *bits,
                      gpu_impl=policy.gpu_impl, gpu_route=policy.gpu_route)


def _fp8_gemm(a, b, *, g, fmts, policy):
  return BD.fp8_dot(a, b, *fmts, g, gpu_impl=policy.fp8_gpu_impl)


def dot_general(policy: DotPolicy | None = None, *, key=None):
  """A ``lax.dot_general`` replacement that quantizes its GEMMs per ``policy``.

  The returned callable has ``lax.dot_general``'s signature
  ``(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None)``, accepts and
  ignores extra keywords (``out_sharding``, ...), and takes an optional keyword ``key`` that
  overrides the construction key. It plugs into ``flax.linen.Dense(dot_general=...)``,
  ``nnx.Linear(..., dot_general=...)`` and ``jnp.einsum(..., _dot_general=...)``.

  Any dimension numbers and batch dimensions are supported. Axis-blocked formats (MX) are
  blocked along each operand's contraction axis in each GEMM: forward lhs/rhs along the
  (paired) contracting dimension with the largest lhs index; in the dlhs GEMM the rhs and the
  gradient along the last rhs free dimension; in the drhs GEMM the lhs and the gradient along
  the last lhs free dimension. Tile-blocked formats see the operands as given.

  ``DotPolicy()`` (or None) returns the plain ``lax.dot_general`` computation (backward =
  plain autodiff).

  Args:
    policy: a :class:`jaxlp.DotPolicy` (``hbfp_policy(...)``, ``mx_policy(...)``, ...).
    key: PRNG key for stochastic rounding (required if the policy is stochastic); use a
      fresh key per training step.

  Returns:
    The dot_general callable (its ``policy`` attribute holds the policy). Calling it raises
    ``ValueError`` if the policy is stochastic and no key was given (or, with
    ``block_dot="exact"``, if a K-block is too long for an exact int32 dot), and
    ``NotImplementedError`` for accumulator emulation or ``block_dot`` on anything but a
    2-D GEMM with one contracting dimension and no batch dimensions.

  Raises:
    TypeError: ``policy`` is not a :class:`jaxlp.DotPolicy` (or None).

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> dot = jaxlp.dot_general(jaxlp.mx_policy(F.E2M1FN, block_size=2))
    >>> x = jnp.array([[1.0, 0.3]])  # one MXFP4 block: scale 2**(0 - 2), 0.3 -> 0.25
    >>> w = jnp.array([[1.0], [1.0]])
    >>> dot(x, w, (((1,), (0,)), ((), ())))
    Array([[1.25]], dtype=float32)
    >>> sr = jaxlp.dot_general(jaxlp.mx_policy(rounding="stochastic"), key=jax.random.key(0))
    >>> sr(x, w, (((1,), (0,)), ((), ()))).shape
    (1, 1)
  """
  policy = DotPolicy() if policy is None else policy
  if not isinstance(policy, DotPolicy):
    raise TypeError(f"jaxlp.dot_general: policy must be a DotPolicy, got {policy!r}")
  default_key = key

  def jaxlp_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, *, key=None, **unused):
    del unused
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)

    def op(l, r):
      return lax.dot_general(l, r, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type)

    if policy.is_identity:
      return op(lhs, rhs)
    geo = _dot_geometry(dimension_numbers, lhs.ndim, rhs.ndim)
    gemms = (_block_gemms(policy, dimension_numbers, lhs, rhs, geo) if policy.block_dot
             else _accum_gemms(policy, dimension_numbers, lhs, rhs))
    k = default_key if key is None else key
    return quantized_bilinear(op, lhs, rhs, policy, geo, key=k, gemms=gemms)

  jaxlp_dot_general.policy = policy
  return jaxlp_dot_general
