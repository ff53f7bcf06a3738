"""Emulating N data-parallel workers on one device with a named ``vmap``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def emulate(step_fn, num_nodes: int, axis_name="node", *, batch_argnums=(-1,), out_axes=0):
  """Run ``step_fn`` as ``num_nodes`` logical workers on the current device.

  The arguments in ``batch_argnums`` (pytrees whose leaves have a leading batch axis
  divisible by ``num_nodes``) are split into ``num_nodes`` contiguous equal parts, worker j
  getting rows ``[j*b, (j+1)*b)``; the other arguments are shared. Inside ``step_fn`` the
  workers form the named axis ``axis_name``, so ``jaxlp.parallel.psum(g, axis_name, ...)``,
  ``lax.psum``/``pmax`` and ``reduce_gradients(axis_name)`` work unchanged. Compose with
  real devices by calling the result inside ``jax.shard_map`` (with ``check_vma=False``)
  and reducing over ``(mesh_axis, axis_name)``: device-major workers, e.g. 8 devices x 32
  emulated = 256 workers (CPD's ``--emulate-node 32``).

  Args:
    step_fn: the per-worker function.
    num_nodes: number of emulated workers (>= 1).
    axis_name: name of the emulated-worker axis.
    batch_argnums: positions (negative allowed) of the arguments to split.
    out_axes: ``jax.vmap`` out_axes: 0 stacks every worker's outputs on a leading axis
      (after an all-reduce they are identical); ``None`` for outputs that are the same on
      all workers and unbatched.

  Returns:
    A function with ``step_fn``'s arguments.

  Raises:
    ValueError: ``num_nodes`` is not a positive int (at once); a leaf of a split argument is
      a scalar or its leading axis is not divisible by ``num_nodes`` (when the returned
      function is called).

  Example:
    Eight rows split over four emulated workers (two rows each), summed over the workers:

    >>> import jax, jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> step = P.emulate(lambda x: jax.lax.psum(x.sum(), "node"), 4)
    >>> step(jnp.arange(8.0))
    Array([28., 28., 28., 28.], dtype=float32)
  """
  if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
    raise ValueError(f"emulate: num_nodes must be a positive int, got num_nodes={num_nodes!r}")
  if isinstance(batch_argnums, int):
    batch_argnums = (batch_argnums,)

  @functools.wraps(step_fn)
  def wrapped(*args):
    nargs = len(args)
    split = {a % nargs for a in batch_argnums}

    def cut(x):
      x = jnp.asarray(x)
      if x.ndim == 0 or x.shape[0] % num_nodes:
        raise ValueError(
            f"emulate: batch leaves need a leading axis divisible by num_nodes={num_nodes}, "
            f"got shape {x.shape}")
      return x.reshape((num_nodes, x.shape[0] // num_nodes) + x.shape[1:])

    new_args = [jax.tree_util.tree_map(cut, a) if i in split else a for i, a in enumerate(args)]
    in_axes = tuple(0 if i in split else None for i in range(nargs))
    return jax.vmap(step_fn, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)(*new_args)

  return wrapped
