"""CPD's LARS variant as an optax transformation (drcut/CPD ``example/ResNet18/tools/mix.py``).

``optax.lars`` differs: it computes the trust ratio from the norm of the *decayed*
update, ``eta * ||w|| / ||g + wd*w||`` (plus ``eps``), and falls back to ratio 1 when
either norm is zero, whereas CPD uses ``eta * ||w|| / (||g|| + wd*||w||)``. The momentum
recursions are the same (``buf = m*buf + lr*ratio*(g + wd*w)``, ``w -= buf``).

References:
  You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks" (LARS),
  arXiv:1708.03888; drcut/CPD ``example/ResNet18/tools/mix.py`` (``--use_lars``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class LarsState(NamedTuple):
  """State of :func:`lars`.

  Attributes:
    count: int32 number of updates so far (the schedule's step).
    momentum: the momentum buffers ``buf`` (params' structure, shapes and dtypes).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlp import optim
    >>> optim.lars(0.1).init({"w": jnp.zeros(2)})
    LarsState(count=Array(0, dtype=int32), momentum={'w': Array([0., 0.], dtype=float32)})
  """

  count: jax.Array
  momentum: Any


def lars(learning_rate, *, momentum: float = 0.9, weight_decay: float = 1e-4,
         eta: float = 0.001):
  """CPD's LARS: per tensor ``local_lr = eta*||w|| / (||g|| + wd*||w||)``,
  ``buf = momentum*buf + lr*local_lr*(g + wd*w)``, update ``-buf``.

  Guard (CPD gives NaN): when ``||g|| + wd*||w|| == 0`` (then ``g + wd*w == 0``) the local
  lr is 0, so the step is 0.

  Args:
    learning_rate: float or optax schedule (called with the step count).
    momentum, weight_decay, eta: as in CPD (defaults 0.9, 1e-4, 0.001).

  Returns:
    ``optax.GradientTransformation`` with state :class:`LarsState`.

  Raises:
    ValueError: ``update`` is called without ``params``.

  Example:
    ``||w|| = 5``, ``||g|| = 1``, no weight decay, ``eta = 1``: local lr 5, step
    ``0.1 * 5 * g``:

    >>> import jax.numpy as jnp
    >>> from jaxlp import optim
    >>> tx = optim.lars(0.1, weight_decay=0.0, eta=1.0)
    >>> params = {"w": jnp.array([3.0, 4.0])}
    >>> grads = {"w": jnp.array([0.6, 0.8])}
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> updates
    {'w': Array([-0.3, -0.4], dtype=float32)}
  """
  import optax

  def init_fn(params):
    return LarsState(jnp.zeros((), jnp.int32), jax.tree_util.tree_map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("lars: update needs params")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

    def one(g, w, buf):
      wn = jnp.linalg.norm(w.reshape(-1))
      gn = jnp.linalg.norm(g.reshape(-1))
      den = gn + weight_decay * wn
      local = jnp.where(den > 0, eta * wn / jnp.where(den > 0, den, 1), 0.0)
      new = momentum * buf + (lr * local) * (g + weight_decay * w)
      return new.astype(buf.dtype)

    bufs = jax.tree_util.tree_map(one, updates, params, state.momentum)
    upd = jax.tree_util.tree_map(lambda b: -b, bufs)
    return upd, LarsState(optax.safe_increment(state.count), bufs)

  return optax.GradientTransformation(init_fn, update_fn)
