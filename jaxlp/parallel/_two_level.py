"""CPD's two-level reduction for emulated nodes (drcut/CPD's ``--emulate_node``).

References:
  drcut/CPD ``example/ResNet50/main.py`` (``--emulate-node``) and
  ``example/ResNet18/tools/mix.py`` (``--emulate_node``, master).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlp.formats._quantize import check_format
from jaxlp.parallel import _axes
from jaxlp.parallel._aps import ZERO_EXPONENT, format_emax, local_exponent
from jaxlp.parallel._arith import add_f32, scale_pow2
from jaxlp.parallel._psum import psum

CPD_SENTINEL = -100


def psum_two_level(tree, node_axis, rank_axis, *, fmt, aps: bool = True, kahan: bool = False,
                   combine_single: bool = False):
  """CPD's emulated-node reduction: local combine over ``node_axis``, then across ranks.

  Local combine (per leaf, on each real rank, over its E emulated workers j):
  ``A_loc = max_j ceil(log2(max|g_j| * E))`` where an all-zero ``g_j`` counts as the
  sentinel -100; ``shift = emax(fmt) - A_loc``, but 0 when ``aps`` is False or
  ``A_loc == -100``; ``g'_j = Q(g_j * 2**shift)``; ``r = +0; r = Q(r + g'_j)`` for
  j = 0..E-1 (no Kahan); combined ``= r * 2**-shift``. ``A_loc`` is per rank (not reduced
  across ranks). With E == 1 the raw gradient is used (ResNet18-master) unless
  ``combine_single``. Then :func:`psum` ``(order="chain", aps=aps, kahan=kahan)`` over
  ``rank_axis`` (APS recomputed from the combined gradient, with our all-zero guard).
  Not equal to a flat chain over W*E workers. Non-finite values follow :func:`psum`'s
  policy: a NaN or ±inf in any worker's leaf (it enters the local combine as NaN) makes the
  whole leaf NaN on every worker.

  Args:
    tree: pytree of float32/float16/bfloat16 arrays (this emulated worker's gradients).
    node_axis: the named axis of the E emulated workers of one rank (inner).
    rank_axis: the named axis (or tuple of axes) of the real ranks (outer).
    fmt: elementwise jaxlp format of the partial sums.
    aps: Auto Precision Scaling in both levels (CPD's ``use_APS``).
    kahan: compensated summation in the across-rank chain (not in the local combine).
    combine_single: run the local combine (rounding to ``fmt``) also when E == 1.

  Returns:
    Pytree of the same structure, shapes and dtypes; identical bits on every worker.

  Raises:
    TypeError: ``fmt`` is not a jaxlp format, or not an elementwise one; a leaf is not
      float32/float16/bfloat16.
    ValueError: ``aps=True`` with 65536 or more workers on an axis.

  Example:
    Two ranks of two emulated workers each (nested named ``vmap``), E4M3 partial sums; the
    float32 sum is ``[26.4, 30.8, 35.2, 39.6]``:

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> g = jnp.arange(16.0).reshape(2, 2, 4) * 1.1  # (rank, node, values)
    >>> f = lambda x: P.psum_two_level(x, "node", "rank", fmt=F.E4M3)
    >>> jax.jit(jax.vmap(jax.vmap(f, axis_name="node"), axis_name="rank"))(g)[0, 0]
    Array([26., 30., 36., 40.], dtype=float32)
  """
  check_format(fmt, "nearest")
  e = _axes.axis_size(node_axis)

  def local(g):
    dtype = g.dtype
    x = g.astype(jnp.float32).reshape(-1)
    if e == 1 and not combine_single:
      return g
    # non-finite values as NaN (a saturating format would turn ±inf finite): the final psum
    # then makes the whole leaf NaN on every worker (the policy of every reduction)
    x = jnp.where(jnp.isfinite(x), x, jnp.float32(jnp.nan))
    if aps:
      a, _ = local_exponent(x, e)
      a = jnp.where(a == ZERO_EXPONENT, CPD_SENTINEL, a)
      a = _axes.pmax(a, node_axis)
      shift = jnp.where(a == CPD_SENTINEL, 0, format_emax(fmt) - a)
      x = scale_pow2(x, shift)
    from jaxlp.formats._quantize import quantize_f32
    qz = jnp.zeros((), jnp.uint32)
    x = quantize_f32(x, fmt, "nearest", qz, None)
    gs = _axes.all_gather(x, node_axis)
    r = jnp.zeros_like(x)
    for j in range(e):
      r = quantize_f32(add_f32(r, gs[j]), fmt, "nearest", qz, None)
    if aps:
      r = scale_pow2(r, -shift)
    return r.reshape(g.shape).astype(dtype)

  combined = jax.tree_util.tree_map(local, tree)
  return psum(combined, rank_axis, fmt=fmt, order="chain", aps=aps, kahan=kahan)
