"""Multi-host start-up: a thin wrapper over ``jax.distributed.initialize``.

Launch one process per host (or per GPU) and call :func:`initialize` before any other JAX
call. Under SLURM (``srun``) and Open MPI (``mpirun``) JAX detects the coordinator, the
number of processes and the process id itself::

  srun --nodes=2 --ntasks-per-node=1 python train.py      # SLURM
  mpirun -np 2 -H host1,host2 python train.py             # Open MPI

Elsewhere pass them explicitly (``initialize("10.0.0.1:1234", num_processes=2,
process_id=i)``). Afterwards ``jax.devices()`` lists every process's devices; build a
global mesh (``jax.make_mesh``) and use ``jax.shard_map`` with ``jaxlp.parallel.psum``
over the mesh axis exactly as on one host.
"""

from __future__ import annotations

import jax


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               cpu_collectives: str | None = "gloo", **kwargs) -> None:
  """Initialise multi-process JAX (``jax.distributed.initialize``).

  Args:
    coordinator_address: ``"host:port"`` of process 0 (auto-detected under SLURM/MPI).
    num_processes, process_id: total processes and this one's id (auto-detected likewise).
    local_device_ids: devices this process uses (optional).
    cpu_collectives: CPU cross-process collectives implementation (sets
      ``jax_cpu_collectives_implementation``; ``"gloo"`` works on loopback/TCP, ``"mpi"``
      needs an MPI library; ``None`` leaves the config alone). Ignored by GPU/TPU backends.
    **kwargs: passed to ``jax.distributed.initialize``.

  Returns:
    None.

  Raises:
    RuntimeError: from ``jax.distributed.initialize``, e.g. when JAX has already initialised
      a backend in this process (any computation, ``jax.devices()``, ...) or when
      :func:`initialize` was already called.

  Example:
    Not run here: it must be the first JAX call of the process (this documentation's
    examples have already run JAX computations, so it raises ``RuntimeError``), and it
    waits for all ``num_processes`` processes to connect to the coordinator:

    >>> from jaxlp import parallel as P
    >>> P.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # doctest: +SKIP
    >>> import jax
    >>> jax.process_count()  # doctest: +SKIP
    2
  """
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             local_device_ids=local_device_ids, **kwargs)


def shutdown() -> None:
  """``jax.distributed.shutdown()``: leave the multi-process runtime of :func:`initialize`.

  Call it once at the end of every process (a no-op when :func:`initialize` was not called).

  Returns:
    None.

  Example:
    >>> from jaxlp import parallel as P
    >>> P.shutdown()  # nothing to shut down in a single process
  """
  jax.distributed.shutdown()
