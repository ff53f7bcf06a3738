"""``reduce_gradients``: the data-parallel all-reduce as an optax transformation."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp.parallel import _axes
from jaxlp.parallel._psum import psum


class ReduceGradientsState(NamedTuple):
  """State of :func:`reduce_gradients`: step count, base PRNG key, compressor state.

  Attributes:
    count: int32 number of updates so far (step t rounds with ``fold_in(key, t)``).
    key: the base PRNG key given to :func:`reduce_gradients` (default ``jax.random.key(0)``).
    compressor_state: the :class:`~jaxlp.parallel.CompressionState` (error feedback) when a
      compressor is used, else None.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> st = P.reduce_gradients("w").init(jnp.zeros(3))
    >>> st.count, st.compressor_state
    (Array(0, dtype=int32), None)
  """

  count: jax.Array
  key: Any
  compressor_state: Any


def reduce_gradients(axis_name, *, fmt=None, order: str = "ring", kahan: bool = False,
                     aps: bool = False, rounding: str = "nearest", compressor=None,
                     mean: bool = True, key=None, **compressor_opts):
  """An optax transformation that all-reduces the updates over ``axis_name``.

  Put it first in an optax chain used inside the per-worker step (pmap / shard_map /
  ``jaxlp.parallel.emulate``). With ``mean=True`` each worker's gradient is divided by W
  BEFORE the low-precision sum (CPD's convention: the rounded sum is the mean; dividing
  after the sum would change what underflows). The division is an exact power-of-two
  scaling when W is a power of two, else a float32 division (whose subnormal results
  flush to zero on CPU).

  Args:
    axis_name: worker axis (or tuple of axes).
    fmt: format of the partial sums; ``None`` = plain float32 ``lax.psum``.
    order, kahan, aps, rounding: as in :func:`jaxlp.parallel.psum`.
    compressor: a compressor of ``jaxlp.parallel.compressors``; the reduction is then
      ``jaxlp.parallel.compressed_allreduce(..., mean=mean, **compressor_opts)``
      (which takes the mean itself, as each compressor family defines it) and the state holds
      its :class:`~jaxlp.parallel.CompressionState` (error feedback).
    mean: return the mean instead of the sum.
    key: base PRNG key for stochastic rounding (default ``jax.random.key(0)``); step t
      uses ``fold_in(key, t)``.

    **compressor_opts: with ``compressor`` only: ``min_size``, ``skip_vectors``,
      ``algorithm``, ``bucket_mb``, ``plan`` of :func:`jaxlp.parallel.compressed_allreduce`.

  Returns:
    ``optax.GradientTransformation`` with state :class:`ReduceGradientsState`.

  Raises:
    TypeError: an unknown keyword in ``compressor_opts``.
    ValueError: ``compressor_opts`` without ``compressor``; both ``fmt`` and ``compressor``;
      ``kahan``, ``aps`` or a non-default ``rounding`` with ``fmt=None``. The errors of
      :func:`jaxlp.parallel.psum` / :func:`jaxlp.parallel.compressed_allreduce` are raised
      by ``update``.

  Example:
    The mean of four workers' gradients (a named ``vmap``), each partial sum in E4M3:

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> tx = P.reduce_gradients("w", fmt=F.E4M3)
    >>> def step(g):
    ...   updates, state = tx.update(g, tx.init(g))
    ...   return updates
    >>> g = jnp.array([[1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4],
    ...                [10.0, 20.0, 30.0, 40.0], [0.5, 0.5, 0.5, 0.5]])
    >>> jax.vmap(step, axis_name="w")(g)[0]
    Array([ 3. ,  5.5,  8. , 11. ], dtype=float32)
  """
  import optax

  allowed = ("min_size", "skip_vectors", "algorithm", "bucket_mb", "plan")
  unknown = sorted(set(compressor_opts) - set(allowed))
  if unknown:
    raise TypeError(f"reduce_gradients: unknown option(s) {unknown}; with a compressor the "
                    f"options are {allowed}")
  if compressor_opts and compressor is None:
    raise ValueError(f"reduce_gradients: {sorted(compressor_opts)} apply only with compressor=")
  if compressor is not None and fmt is not None:
    raise ValueError("reduce_gradients: give either fmt= (low-precision sum) or compressor=, "
                     "not both")
  if fmt is None and (kahan or aps or rounding != "nearest"):
    raise ValueError("reduce_gradients: kahan/aps/rounding need a low-precision fmt (fmt=None "
                     "is a plain float32 psum)")

  def init_fn(params):
    k = jax.random.key(0) if key is None else key
    cstate = None
    if compressor is not None:
      from jaxlp.parallel._compressed import init_compression_state
      init_opts = {n: v for n, v in compressor_opts.items()
                   if n in ("min_size", "skip_vectors", "bucket_mb", "plan")}
      cstate = init_compression_state(compressor, params, **init_opts)
    return ReduceGradientsState(jnp.zeros((), jnp.int32), k, cstate)

  def update_fn(updates, state, params=None):
    del params
    cstate = state.compressor_state
    if compressor is not None:  # the mean is taken once, inside (per compressor family)
      from jaxlp.parallel._compressed import compressed_allreduce
      updates, cstate = compressed_allreduce(updates, cstate, axis_name, compressor,
                                             mean=mean, **compressor_opts)
      return updates, ReduceGradientsState(state.count + 1, state.key, cstate)
    w = _axes.axis_size(axis_name)
    if mean:
      updates = jax.tree_util.tree_map(lambda g: _div(g, w), updates)
    if fmt is None:
      updates = lax.psum(updates, _axes.as_tuple(axis_name))
    else:
      step_key = jax.random.fold_in(state.key, state.count)
      updates = psum(updates, axis_name, fmt=fmt, order=order, kahan=kahan, aps=aps,
                     rounding=rounding, key=step_key if rounding == "stochastic" else None)
    return updates, ReduceGradientsState(state.count + 1, state.key, cstate)

  return optax.GradientTransformation(init_fn, update_fn)


def _div(g, w):
  if w & (w - 1) == 0:
    from jaxlp.parallel._arith import scale_pow2
    p = w.bit_length() - 1
    return scale_pow2(g.astype(jnp.float32), -p).astype(g.dtype)
  return (g.astype(jnp.float32) / jnp.float32(w)).astype(g.dtype)
