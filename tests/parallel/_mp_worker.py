"""Worker of test_multiprocess.py: one process of a loopback jax.distributed job."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxlp.parallel as jp  # noqa: E402
from jaxlp import formats as F  # noqa: E402


def main():
  port, nproc, pid, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
  jp.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                initialization_timeout=60)
  w = jax.device_count()
  mesh = jax.make_mesh((w,), ("dev",))
  gs = (np.random.default_rng(0).normal(size=(w, 37)) * 1e-3).astype(np.float32)
  sharding = NamedSharding(mesh, P("dev"))
  garr = jax.make_array_from_callback(gs.shape, sharding, lambda idx: gs[idx])
  res = {}
  for order, aps in (("chain", False), ("ring", False), ("ring", True)):
    f = jax.jit(jax.shard_map(
        lambda x, order=order, aps=aps: psum_row(x, order, aps), mesh=mesh,
        in_specs=P("dev"), out_specs=P("dev"), check_vma=False))
    y = f(garr)
    rows = [np.asarray(s.data) for s in y.addressable_shards]
    res[f"{order}-{aps}"] = np.concatenate(rows)
  np.savez(out, gs=gs, **res)
  jp.shutdown()


def psum_row(x, order, aps):
  return jp.psum(x[0], "dev", fmt=F.E4M3, order=order, aps=aps)[None]


if __name__ == "__main__":
  main()
