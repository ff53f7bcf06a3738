"""optax transformations: master weights, quantized updates, low-precision optimizer state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlp._deprecation import renamed_kwargs
from jaxlp.formats._quantize import check_format, typed_key
from jaxlp.ops._quantize import quantize as _quantize  # kernel on a GPU where faster


def _check(fmt, rounding, name):
  if fmt is not None:
    check_format(fmt, rounding)


def _needs_key(rounding, key, who):
  """The state's key: a typed key for stochastic rounding, None (no key) for nearest."""
  if rounding == "stochastic" and key is None:
    raise ValueError(f"{who}: rounding='stochastic' needs key=jax.random.key(...) (kept in the "
                     "optimizer state and split every step)")
  if key is None:
    return None
  key = typed_key(key, who)
  return key if rounding == "stochastic" else None


def _tree_quantize(tree, fmt, rounding, key):
  """Quantize every float leaf; leaf i draws noise from fold_in(key, i)."""
  if fmt is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for i, leaf in enumerate(leaves):
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      out.append(leaf)
      continue
    k = jax.random.fold_in(key, i) if rounding == "stochastic" else None
    x = leaf.astype(jnp.float32) if leaf.dtype == jnp.float64 else leaf
    out.append(_quantize(x, fmt, rounding, key=k).astype(leaf.dtype))
  return jax.tree.unflatten(treedef, out)


def _split(key, rounding):
  if rounding != "stochastic":
    return key, key
  k_next, k_use = jax.random.split(key)
  return k_next, k_use


class MasterWeightsState(NamedTuple):
  """State of :func:`master_weights`: the wide copy, the inner state and the noise key.

  Attributes:
    wide: the stored copy of the parameters, rounded to ``wide_fmt`` (params' dtypes).
    inner_state: the inner transformation's state.
    key: typed PRNG key of the next step's roundings (split every step with stochastic
      rounding), or None when the rounding is not stochastic.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from jaxlp import formats as F
    >>> from jaxlp import optim
    >>> state = optim.master_weights(optax.sgd(0.1), fmt=F.E4M3).init({"w": jnp.ones(2)})
    >>> state.wide, state.inner_state
    ({'w': Array([1., 1.], dtype=float32)}, (EmptyState(), EmptyState()))
  """

  wide: Any
  inner_state: Any
  key: jax.Array | None


@renamed_kwargs(narrow="fmt", wide="wide_fmt")
def master_weights(inner: optax.GradientTransformation, fmt=None, wide_fmt=None, *,
                   rounding: str = "nearest", key=None) -> optax.GradientTransformation:
  """HBFP's shell optimizer: the inner optimizer updates a wide copy; params come out narrow.

  ``init``: ``wide = Q_wide(params)`` (HBFPEmulator quantizes the weight to the wide format
  the first time). ``update(grads, state, params)``: the inner transformation runs in FP32 on
  the wide copy (``u = inner(grads, wide)``, ``new = wide + u``); then, from the same FP32
  ``new``, ``state.wide = Q_wide(new)`` and the narrow parameters ``Q_narrow(new)`` are formed
  with independent roundings (independent noise for stochastic rounding), and the returned
  updates are ``Q_narrow(new) - params``, so ``optax.apply_updates(params, updates)`` yields
  the narrow parameters. (That add is exact whenever params and the new narrow value are on
  nearby grids, e.g. BFP values whose exponents differ by < 2^(24 - man_bits - 1); in
  general it is one FP32 rounding away from ``Q_narrow(new)``.)

  Args:
    inner: the base optimizer (its buffers stay FP32: HBFPEmulator never quantizes them).
    fmt: format of the parameters the model uses (the narrow format, e.g. ``hbfp(7, 24)``),
      None = FP32. Formerly ``narrow`` (still accepted, deprecated).
    wide_fmt: format of the stored copy (e.g. ``hbfp(15, 24)``), None = FP32. Formerly
      ``wide`` (still accepted, deprecated).
    rounding: rounding of both quantizations.
    key: a typed PRNG key, ``jax.random.key(...)`` (required for stochastic rounding; a
      legacy uint32[2] key is accepted and stored as a typed key).

  Returns:
    ``optax.GradientTransformation`` with state :class:`MasterWeightsState`.

  Raises:
    TypeError: ``fmt`` or ``wide_fmt`` is not a jaxlp format (or None); both a new keyword
      and its deprecated name are given.
    ValueError: an unknown ``rounding`` or one a format does not support;
      ``rounding="stochastic"`` without ``key`` (or with a key that is not a PRNG key);
      ``update`` is called without ``params``.

  Example:
    The narrow (E4M3) parameters stay at 1 and 2 while the FP32 wide copy takes the SGD
    steps:

    >>> import jax.numpy as jnp
    >>> import optax
    >>> from jaxlp import formats as F
    >>> from jaxlp import optim
    >>> tx = optim.master_weights(optax.sgd(0.1), fmt=F.E4M3)
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> updates, state = tx.update({"w": jnp.array([0.3, -0.3])}, tx.init(params), params)
    >>> updates, state.wide
    ({'w': Array([0., 0.], dtype=float32)}, {'w': Array([0.97, 2.03], dtype=float32)})

  References:
    parsa-epfl/HBFPEmulator ``bfp/bfp_optim.py`` (``get_bfp_optim``); Drumond et al., NeurIPS
    2018 ("wide weight storage").
  """
  _check(fmt, rounding, "fmt")
  _check(wide_fmt, rounding, "wide_fmt")
  key0 = _needs_key(rounding, key, "master_weights")

  def init_fn(params):
    k_next, k = _split(key0, rounding)
    w = _tree_quantize(params, wide_fmt, rounding, k)
    return MasterWeightsState(w, inner.init(w), k_next)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("master_weights: update(updates, state, params) needs params (the "
                       "current narrow parameters) to return narrow - params")
    u, inner_state = inner.update(updates, state.inner_state, state.wide)
    new = optax.apply_updates(state.wide, u)
    key, k = _split(state.key, rounding)
    k_wide, k_narrow = jax.random.split(k) if rounding == "stochastic" else (k, k)
    new_wide = _tree_quantize(new, wide_fmt, rounding, k_wide)
    new_narrow = _tree_quantize(new, fmt, rounding, k_narrow)
    out = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_narrow, params)
    new_wide = jax.tree.map(lambda n, w: n.astype(w.dtype), new_wide, state.wide)
    return out, MasterWeightsState(new_wide, inner_state, key)

  return optax.GradientTransformation(init_fn, update_fn)


class QuantizeUpdatesState(NamedTuple):
  """State of :func:`quantize_updates`: the noise key (split every step).

  Attributes:
    key: typed PRNG key of the next step's rounding (``jax.random.key``), or None when the
      rounding is not stochastic.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp import optim
    >>> optim.quantize_updates(F.E4M3).init({"w": jnp.zeros(2)})
    QuantizeUpdatesState(key=None)
  """

  key: jax.Array | None


def quantize_updates(fmt, rounding: str = "nearest", *, key=None
                     ) -> optax.GradientTransformation:
  """Round every update leaf to ``fmt`` (stochastic rounding: key in the state, split per step).

  Args:
    fmt: a jaxlp format.
    rounding: rounding mode.
    key: a typed PRNG key, ``jax.random.key(...)`` (required for stochastic rounding; a
      legacy uint32[2] key is accepted and stored as a typed key).

  Returns:
    ``optax.GradientTransformation`` with state :class:`QuantizeUpdatesState`.

  Raises:
    TypeError: ``fmt`` is not a jaxlp format.
    ValueError: an unknown ``rounding`` or one ``fmt`` does not support;
      ``rounding="stochastic"`` without ``key`` (or with a key that is not a PRNG key).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp import optim
    >>> tx = optim.quantize_updates(F.E4M3)
    >>> updates = {"w": jnp.array([0.3, -1.1])}
    >>> tx.update(updates, tx.init(updates))[0]
    {'w': Array([ 0.3125, -1.125 ], dtype=float32)}
  """
  _check(fmt, rounding, "fmt")
  key0 = _needs_key(rounding, key, "quantize_updates")

  def init_fn(params):
    del params
    return QuantizeUpdatesState(key0)

  def update_fn(updates, state, params=None):
    del params
    key, k = _split(state.key, rounding)
    return _tree_quantize(updates, fmt, rounding, k), QuantizeUpdatesState(key)

  return optax.GradientTransformation(init_fn, update_fn)


class LowPrecisionTraceState(NamedTuple):
  """State of :func:`trace`: the momentum (values representable in ``fmt``) and key.

  Attributes:
    trace: the momentum buffers ``m`` (float32, values representable in ``fmt``).
    key: typed PRNG key of the next step's rounding (split every step with stochastic
      rounding), or None when the rounding is not stochastic.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp import optim
    >>> optim.trace(0.9, fmt=F.BF16, rounding="nearest").init({"w": jnp.zeros(2)}).trace
    {'w': Array([0., 0.], dtype=float32)}
  """

  trace: Any
  key: jax.Array | None


@renamed_kwargs(format="fmt")
def trace(decay: float, nesterov: bool = False, *, fmt=None,
          rounding: str = "stochastic", key=None) -> optax.GradientTransformation:
  """optax.trace (momentum) whose buffer is stored rounded to ``fmt``.

  ``m = Q(g + decay * m)``; the update is ``m`` (or ``g + decay * m`` for Nesterov). The
  buffer is float32 holding values representable in ``fmt``; stochastic rounding (the
  default) draws from a key kept in the state and split every step.

  Args:
    decay: momentum decay.
    nesterov: Nesterov momentum.
    fmt: storage format of the buffer (None = FP32, i.e. ``optax.trace``). Formerly
      ``format`` (still accepted, deprecated).
    rounding: rounding mode of the buffer writes.
    key: a typed PRNG key, ``jax.random.key(...)`` (required for stochastic rounding with a
      format; a legacy uint32[2] key is accepted and stored as a typed key).

  Returns:
    ``optax.GradientTransformation`` with state :class:`LowPrecisionTraceState`.

  Raises:
    TypeError: ``fmt`` is not a jaxlp format (or None); both ``fmt`` and ``format`` are
      given.
    ValueError: an unknown ``rounding`` or one ``fmt`` does not support;
      ``rounding="stochastic"`` (the default) with a format but without ``key`` (or with a
      key that is not a PRNG key).

  Example:
    Two steps with the buffer in E4M3 (round to nearest: ``Q(0.3 + 0.9 * 0.3125) = 0.5625``):

    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp import optim
    >>> tx = optim.trace(0.9, fmt=F.E4M3, rounding="nearest")
    >>> g = {"w": jnp.array([0.3, -1.1])}
    >>> state = tx.init(g)
    >>> updates, state = tx.update(g, state)
    >>> updates, state = tx.update(g, state)
    >>> state.trace
    {'w': Array([ 0.5625, -2.    ], dtype=float32)}
  """
  rounding = "nearest" if fmt is None else rounding
  _check(fmt, rounding, "fmt")
  key0 = _needs_key(rounding, key, "trace")

  def init_fn(params):
    return LowPrecisionTraceState(
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), key0)

  def update_fn(updates, state, params=None):
    del params
    key, k = _split(state.key, rounding)
    m = jax.tree.map(lambda g, t: g.astype(jnp.float32) + decay * t, updates, state.trace)
    m = _tree_quantize(m, fmt, rounding, k)
    if nesterov:
      out = jax.tree.map(lambda g, t: g.astype(jnp.float32) + decay * t, updates, m)
    else:
      out = m
    out = jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates)
    return out, LowPrecisionTraceState(m, key)

  return optax.GradientTransformation(init_fn, update_fn)


class LowPrecisionAdamState(NamedTuple):
  """State of :func:`scale_by_adam`: step count, moments (values in their formats), key.

  Attributes:
    count: int32 number of updates so far (for the bias correction).
    mu: first moments (float32, values representable in ``mu_fmt``).
    nu: second moments (float32, values representable in ``nu_fmt``).
    key: typed PRNG key of the next step's roundings (split every step with stochastic
      rounding), or None when the rounding is not stochastic.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import optim
    >>> state = optim.scale_by_adam().init({"w": jnp.zeros(2)})
    >>> state.count, state.mu
    (Array(0, dtype=int32), {'w': Array([0., 0.], dtype=float32)})
  """

  count: jax.Array
  mu: Any
  nu: Any
  key: jax.Array | None


@renamed_kwargs(mu_format="mu_fmt", nu_format="nu_fmt")
def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0, *, mu_fmt=None, nu_fmt=None,
                  rounding: str = "stochastic", key=None) -> optax.GradientTransformation:
  """optax.scale_by_adam with the moments stored rounded to ``mu_fmt`` / ``nu_fmt``.

  ``mu = Q_mu(b1 mu + (1 - b1) g)``, ``nu = Q_nu(b2 nu + (1 - b2) g²)`` (float32 containers of
  representable values), then optax's bias correction and ``mu_hat / (sqrt(nu_hat +
  eps_root) + eps)`` from the stored (quantized) moments. With both formats None this equals
  ``optax.scale_by_adam``.

  Args:
    b1, b2, eps, eps_root: as in optax.
    mu_fmt, nu_fmt: storage formats (None = FP32). Formerly ``mu_format``/``nu_format``
      (still accepted, deprecated).
    rounding: rounding of the moment writes (default stochastic: unbiased).
    key: a typed PRNG key, ``jax.random.key(...)`` (required for stochastic rounding with a
      format; a legacy uint32[2] key is accepted and stored as a typed key).

  Returns:
    ``optax.GradientTransformation`` with state :class:`LowPrecisionAdamState`.

  Raises:
    TypeError: ``mu_fmt`` or ``nu_fmt`` is not a jaxlp format (or None); both a new keyword
      and its deprecated name are given.
    ValueError: an unknown ``rounding`` or one a format does not support;
      ``rounding="stochastic"`` (the default) with a format but without ``key`` (or with a
      key that is not a PRNG key).

  Example:
    Moments stored in bfloat16, rounded to nearest (``0.1 * 0.3`` is stored as
    ``0.0300293``; the default stochastic rounding needs ``key=jax.random.key(...)``):

    >>> import jax.numpy as jnp
    >>> from jaxlp import formats as F
    >>> from jaxlp import optim
    >>> tx = optim.scale_by_adam(mu_fmt=F.BF16, nu_fmt=F.BF16, rounding="nearest")
    >>> g = {"w": jnp.array([0.3, -1.1])}
    >>> updates, state = tx.update(g, tx.init(g))
    >>> state.count, state.mu
    (Array(1, dtype=int32), {'w': Array([ 0.0300293 , -0.10986328], dtype=float32)})
  """
  lp = mu_fmt is not None or nu_fmt is not None
  rounding = rounding if lp else "nearest"
  _check(mu_fmt, rounding, "mu_fmt")
  _check(nu_fmt, rounding, "nu_fmt")
  key0 = _needs_key(rounding, key, "scale_by_adam")

  def init_fn(params):
    z = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return LowPrecisionAdamState(jnp.zeros([], jnp.int32), z, z, key0)

  def update_fn(updates, state, params=None):
    del params
    key, k = _split(state.key, rounding)
    k_mu, k_nu = jax.random.split(k) if rounding == "stochastic" else (k, k)
    g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    mu = optax.tree.update_moment(g32, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(g32, state.nu, b2, 2)
    mu = _tree_quantize(mu, mu_fmt, rounding, k_mu)
    nu = _tree_quantize(nu, nu_fmt, rounding, k_nu)
    count = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    out = jax.tree.map(lambda m, v, g: (m / (jnp.sqrt(v + eps_root) + eps)).astype(g.dtype),
                       mu_hat, nu_hat, updates)
    return out, LowPrecisionAdamState(count, mu, nu, key)

  return optax.GradientTransformation(init_fn, update_fn)
