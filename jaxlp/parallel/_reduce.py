"""``reduce_gradients``: the data-parallel all-reduce as an optax transformation;
``compressed_optimizer``: it chained before an optimizer, refusing a stacked momentum."""

from __future__ import annotations

import dataclasses
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
  ``jaxlp.parallel.emulate``), before ``optax.apply_if_finite`` if you use it: every
  reduction follows one non-finite policy (a leaf in which any worker's gradient holds a NaN
  or ±inf, or whose sum overflows, is NaN on every worker; with a compressor its
  error-feedback state is kept; see :func:`jaxlp.parallel.compressed_allreduce`), so every
  worker skips the same steps. With ``mean=True`` each worker's gradient is divided by W
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
      its :class:`~jaxlp.parallel.CompressionState` (error feedback). Shapes are static, so
      ``dgc(..., warmup=...)`` sends every step with the capacity of its FIRST warm-up stage
      (``ceil(n/4)`` values per leaf or bucket, capped at ``floor(n/W - 1/2)``, the dense
      all-reduce's bytes), also after the warm-up; its selection still follows the stage of
      the state's step. To send each stage's own capacity, build one transform per stage with
      ``compressor=comp.at_stage(s)`` and update with the one of ``comp.stage_at(step)``
      (a jitted step each; the transforms share the state, and the bits equal this one's).
      DGC's momentum correction replaces the optimizer's momentum: chain the optimizer with
      :func:`compressed_optimizer`, which refuses a stacked momentum.
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
      by ``update`` (a compressor state that does not fit the compressor or the gradients
      included), and ``update`` raises TypeError for a state that is not this transform's
      :class:`ReduceGradientsState`.

  Example:
    The mean of four workers' gradients (a named ``vmap``, under ``jit`` as a training step
    runs it), each partial sum in E4M3:

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> from jaxlp import formats as F
    >>> tx = P.reduce_gradients("w", fmt=F.E4M3)
    >>> def step(g):
    ...   updates, state = tx.update(g, tx.init(g))
    ...   return updates
    >>> g = jnp.array([[1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4],
    ...                [10.0, 20.0, 30.0, 40.0], [0.5, 0.5, 0.5, 0.5]])
    >>> jax.jit(jax.vmap(step, axis_name="w"))(g)[0]
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
    if not isinstance(state, ReduceGradientsState):
      raise TypeError(f"reduce_gradients(...).update: state must be the ReduceGradientsState "
                      f"that this transform's init(params) returns, got {type(state).__name__}")
    cstate = state.compressor_state
    if compressor is not None and cstate is None:
      raise TypeError("reduce_gradients(...).update: state.compressor_state is None (a state "
                      "made by a reduce_gradients without compressor=); use this transform's "
                      "init(params)")
    if compressor is not None:  # the mean is taken once, inside (per compressor family)
      from jaxlp.parallel._compressed import compressed_allreduce
      updates, cstate = compressed_allreduce(updates, cstate, axis_name, compressor,
                                             mean=mean, **compressor_opts)
      return updates, ReduceGradientsState(state.count + 1, state.key, cstate)
    w = _axes.axis_size(axis_name)
    if mean:
      updates = jax.tree_util.tree_map(lambda g: _div(g, w), updates)
    if fmt is None:
      updates = jax.tree_util.tree_map(_nan_unless_finite,
                                       lax.psum(updates, _axes.as_tuple(axis_name)))
    else:
      step_key = jax.random.fold_in(state.key, state.count)
      updates = psum(updates, axis_name, fmt=fmt, order=order, kahan=kahan, aps=aps,
                     rounding=rounding, key=step_key if rounding == "stochastic" else None)
    return updates, ReduceGradientsState(state.count + 1, state.key, cstate)

  return optax.GradientTransformation(init_fn, update_fn)


_MOMENTUM_FIELDS = {  # state field -> the transforms that keep it
    "trace": "optax.trace: optax.sgd(..., momentum=m), optax.rmsprop(..., momentum=m), "
             "jaxlp.optim.trace",
    "mu": "a first moment: optax.adam/adamw/lamb/lion/..., jaxlp.optim.scale_by_adam",
    "momentum": "momentum buffers: jaxlp.optim.lars",
    "ema": "optax.ema, an exponential moving average of the updates",
}


def _momentum_states(state, path):
  """``(path, state type, field)`` of every optimizer-state field that holds momentum."""
  found = []
  if dataclasses.is_dataclass(state) and not isinstance(state, type):
    items = [(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)]
    named = True
  elif isinstance(state, tuple) and hasattr(state, "_fields"):
    items, named = list(zip(state._fields, state, strict=True)), True
  elif isinstance(state, (tuple, list)):
    items, named = [(f"[{i}]", v) for i, v in enumerate(state)], False
  elif isinstance(state, dict):
    items, named = [(f"[{k!r}]", v) for k, v in state.items()], False
  else:
    return found
  for name, value in items:
    sub = f"{path}.{name}" if named else f"{path}{name}"
    if named and name in _MOMENTUM_FIELDS and jax.tree_util.tree_leaves(value):
      found.append((sub, type(state).__name__, name))
    else:
      found += _momentum_states(value, sub)
  return found


def compressed_optimizer(optimizer, axis_name, compressor, **reduce_kwargs):
  """``optax.chain(reduce_gradients(axis_name, compressor=compressor, ...), optimizer)`` that
  refuses to stack two momentums.

  DGC's momentum correction (Lin et al. 2018, Sec. 3.2) replaces the optimizer's momentum;
  an optimizer that keeps its own momentum on top applies momentum twice (the digits MLP
  diverges), and :func:`reduce_gradients` alone cannot see the transforms after it. When the
  compressor applies momentum correction (its ``momentum_correction`` factor is nonzero, e.g.
  ``dgc(momentum=0.9)``), ``init`` inspects ``optimizer.init(params)``'s state tree (nested
  chains, ``inject_hyperparams``, named tuples, dicts, dataclasses) and refuses momentum
  state: a non-empty field ``trace`` (``optax.trace``, ``optax.sgd(momentum=...)``), ``mu``
  (Adam-like first moments, Lion), ``momentum`` (``jaxlp.optim.lars``) or ``ema``. A trace
  with ``momentum=0.0`` counts (the state cannot tell its decay): pass ``momentum=None``.
  Otherwise the result is exactly the chain: the same state and the same bits.

  Args:
    optimizer: an ``optax.GradientTransformation`` applied to the reduced gradients.
    axis_name: worker axis (or tuple of axes), as in :func:`reduce_gradients`.
    compressor: a compressor of ``jaxlp.parallel.compressors`` (not None).
    **reduce_kwargs: the other keywords of :func:`reduce_gradients` (``mean``, ``key``,
      ``min_size``, ``skip_vectors``, ``algorithm``, ``bucket_mb``, ``plan``).

  Returns:
    ``optax.GradientTransformationExtraArgs`` whose state is the chain's
    ``(ReduceGradientsState, optimizer state)``.

  Raises:
    ValueError: ``compressor`` is None; from ``init``: the compressor applies momentum
      correction and the optimizer keeps momentum state (the message names the state, its
      transform and the two fixes). :func:`reduce_gradients` raises for bad ``reduce_kwargs``.

  Example:
    DGC with plain SGD over four workers (a named ``vmap`` under ``jit``); SGD with momentum
    is refused:

    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxlp import parallel as P
    >>> comp = P.compressors.dgc(ratio=0.5, momentum=0.9, sample_rate=None)
    >>> tx = P.compressed_optimizer(optax.sgd(0.1), "w", comp, min_size=0)
    >>> def step(g):
    ...   updates, _ = tx.update(g, tx.init(g))
    ...   return updates
    >>> g = jnp.tile(jnp.array([[4.0, 1.0]]), (4, 1, 1))   # a (1, 2) gradient per worker
    >>> jax.jit(jax.vmap(step, axis_name="w"))(g)[0]   # DGC kept 1 of the 2 values
    Array([[-0.4, -0. ]], dtype=float32)
    >>> P.compressed_optimizer(optax.sgd(0.1, momentum=0.9), "w", comp).init(jnp.zeros(2))
    Traceback (most recent call last):
    ...
    ValueError: compressed_optimizer: ...
  """
  import optax

  if compressor is None:
    raise ValueError("compressed_optimizer: compressor is None; for an uncompressed or "
                     "low-precision sum chain reduce_gradients(axis_name, fmt=...) yourself")
  chain = optax.chain(reduce_gradients(axis_name, compressor=compressor, **reduce_kwargs),
                      optimizer)
  factor = float(getattr(compressor, "momentum_correction", 0.0) or 0.0)

  def init_fn(params):
    state = chain.init(params)
    found = _momentum_states(state[1], "optimizer.init(params)") if factor else []
    if found:
      where = "; ".join(f"{path} ({kind}.{field}: {_MOMENTUM_FIELDS[field]})"
                        for path, kind, field in found)
      raise ValueError(
          f"compressed_optimizer: the compressor {type(compressor).__name__} applies momentum "
          f"correction (momentum={factor}), which replaces the optimizer's momentum, but the "
          f"optimizer keeps momentum state at {where}; stacked, momentum is applied twice. "
          f"Fix: an optimizer without momentum (e.g. optax.sgd(lr), momentum=None), or keep "
          f"the optimizer's momentum and set the compressor's momentum=0 (e.g. "
          f"compressors.dgc(..., momentum=0))")
    return state

  return optax.GradientTransformationExtraArgs(init_fn, chain.update)


def _nan_unless_finite(x):
  """The non-finite policy for the float32 ``lax.psum``: a leaf with a NaN or ±inf anywhere
  (from any worker, or an overflowing sum) is NaN everywhere, the same on every worker."""
  return jnp.where(jnp.all(jnp.isfinite(x)), x, jnp.asarray(jnp.nan, x.dtype))


def _div(g, w):
  if w & (w - 1) == 0:
    from jaxlp.parallel._arith import scale_pow2
    p = w.bit_length() - 1
    return scale_pow2(g.astype(jnp.float32), -p).astype(g.dtype)
  return (g.astype(jnp.float32) / jnp.float32(w)).astype(g.dtype)
