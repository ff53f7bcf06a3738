"""Named-axis helpers that work for one axis name or a tuple of names.

A tuple axis name is worker-major in the order given: for ``("dev", "emu")`` worker
``d * size(emu) + e``. JAX 0.10 cannot ``ppermute``/``all_gather`` over a tuple that mixes a
mesh axis and a vmap axis, so everything here is built from per-axis collectives.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def as_tuple(axis_name) -> tuple:
  if isinstance(axis_name, (tuple, list)):
    if not axis_name:
      raise ValueError("axis_name: an empty tuple of axis names was given")
    return tuple(axis_name)
  return (axis_name,)


def axis_size(axis_name) -> int:
  """Static number of workers over ``axis_name`` (product over a tuple)."""
  n = 1
  for a in as_tuple(axis_name):
    n *= int(lax.axis_size(a))
  return n


def axis_index(axis_name):
  """Worker-major combined index (int32 scalar)."""
  idx = jnp.int32(0)
  for a in as_tuple(axis_name):
    idx = idx * jnp.int32(lax.axis_size(a)) + lax.axis_index(a).astype(jnp.int32)
  return idx


def all_gather(x, axis_name):
  """Stack ``x`` of every worker along a new leading axis, in combined worker order."""
  axes = as_tuple(axis_name)
  out = x
  for a in reversed(axes):
    out = lax.all_gather(out, a, axis=0, tiled=False)
  # out has one leading axis per name (outermost name first): flatten them.
  return out.reshape((axis_size(axes),) + x.shape)


def all_to_all(x, axis_name):
  """Personalised exchange: ``x`` has a leading axis of size W whose row ``j`` goes to worker
  ``j``; row ``j`` of the result is the row worker ``j`` sent to this worker (combined order).

  For a tuple of axes the rows are viewed as an array of shape ``(n_0, ..., n_k)`` and one
  ``all_to_all`` is done per name along its own dimension.
  """
  axes = as_tuple(axis_name)
  sizes = tuple(int(lax.axis_size(a)) for a in axes)
  w = axis_size(axes)
  if x.shape[0] != w:
    raise ValueError(f"all_to_all: leading dimension {x.shape[0]} != number of workers {w}")
  out = x.reshape(sizes + x.shape[1:])
  for d, a in enumerate(axes):
    if sizes[d] > 1:
      out = lax.all_to_all(out, a, d, d)
  return out.reshape(x.shape)


def ring_shift(x, axis_name):
  """Value of ``x`` held by the combined predecessor (worker ``i-1 mod W``).

  For a tuple of axes the shift is done one axis at a time with a borrow: on workers
  whose inner indices are all 0 the value also moves one step along the next outer axis.
  """
  axes = as_tuple(axis_name)

  def shift1(v, a):
    n = int(lax.axis_size(a))
    if n == 1:
      return v
    return lax.ppermute(v, a, perm=[(j, (j + 1) % n) for j in range(n)])

  res = shift1(x, axes[-1])
  wrap = lax.axis_index(axes[-1]) == 0
  for a in reversed(axes[:-1]):
    moved = shift1(res, a)
    res = jnp.where(wrap, moved, res)
    wrap = wrap & (lax.axis_index(a) == 0)
  return res


def pmax(x, axis_name):
  return lax.pmax(x, as_tuple(axis_name))
