"""Worker of test_sharded_multiprocess.py: one process of a loopback jax.distributed job that
runs jaxlp.parallel.reduce_scatter / all_gather / compressed_reduce_scatter / psum under
shard_map."""

import os
import sys

# the suite's XLA:CPU flags (tests/conftest.py), then two devices per process
os.environ["XLA_FLAGS"] = (os.environ.get("JAXLP_TEST_XLA_CPU_FLAGS", "") +
                           " --xla_force_host_platform_device_count=2").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxlp.parallel as jp  # noqa: E402
from jaxlp import formats as F  # noqa: E402

SHAPE = (3, 8)  # one leaf per worker; dimension 1 scattered (not psum's chunks), 0 gathered
PSUM_N = 21


def cases():
  """name -> fn(leaf of SHAPE) -> array; shared with the test (its oracles)."""
  mx = F.mx(F.E2M1FN, 2)
  return {
      "ring": lambda x: jp.reduce_scatter(x, "dev", scatter_dimension=1, fmt=F.E4M3),
      "ring-kahan-d0": lambda x: jp.reduce_scatter(x.reshape(-1), "dev", fmt=F.E4M3, kahan=True),
      "chain": lambda x: jp.reduce_scatter(x, "dev", scatter_dimension=1, fmt=F.E5M2,
                                           order="chain"),
      "tree": lambda x: jp.reduce_scatter(x, "dev", scatter_dimension=1, order="tree"),
      "a2a-mx": lambda x: jp.reduce_scatter(x, "dev", scatter_dimension=1, fmt=mx,
                                            order="all_to_all"),
      "ag-mx": lambda x: jp.all_gather(x, "dev", fmt=mx),
      "qgz-ef": lambda x: jp.compressed_reduce_scatter(
          x, jp.init_sharded_state(mx, x, error_feedback=True), "dev", mx,
          scatter_dimension=1, mean=True)[0],
      # psum's orders on PSUM_N values (not a multiple of W: the ring pads its chunks)
      "psum-chain": lambda x: jp.psum(x.reshape(-1)[:PSUM_N], "dev", fmt=F.E4M3, order="chain"),
      "psum-ring": lambda x: jp.psum(x.reshape(-1)[:PSUM_N], "dev", fmt=F.E4M3, order="ring"),
      "psum-ring-aps": lambda x: jp.psum(x.reshape(-1)[:PSUM_N], "dev", fmt=F.E4M3,
                                         order="ring", aps=True),
  }


def main():
  port, nproc, pid, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
  jp.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                initialization_timeout=60)
  w = jax.device_count()
  mesh = jax.make_mesh((w,), ("dev",))
  gs = np.random.default_rng(0).normal(size=(w,) + SHAPE).astype(np.float32)
  sharding = NamedSharding(mesh, P("dev"))
  garr = jax.make_array_from_callback(gs.shape, sharding, lambda idx: gs[idx])
  # every case in one program (one trace and one compile instead of one per case: compile is
  # most of this job's time); each case still runs its own collectives across the processes
  fns = cases()
  f = jax.jit(jax.shard_map(lambda x: {k: fn(x[0])[None] for k, fn in fns.items()}, mesh=mesh,
                            in_specs=P("dev"), out_specs=P("dev"), check_vma=False))
  res = {}
  for name, y in f(garr).items():
    rows = [np.asarray(s.data) for s in sorted(y.addressable_shards,
                                                key=lambda s: s.index[0].start)]
    res[name] = np.concatenate(rows)
    res[name + "-rows"] = np.asarray([s.index[0].start for s in y.addressable_shards])
  np.savez(out, gs=gs, **res)
  jp.shutdown()


if __name__ == "__main__":
  main()
