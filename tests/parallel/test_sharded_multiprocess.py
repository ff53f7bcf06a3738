"""Two processes x two CPU devices (W = 4) over loopback jax.distributed (gloo CPU collectives):
the sharded collectives and psum give the numpy oracles' bits (those of one process's vmap and
shard_map)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _mp_sharded_worker as worker  # noqa: E402
import oracle  # noqa: E402
from _bench import xla_flags  # noqa: E402
from test_sharded import assert_same_bits  # noqa: E402

from jaxlp import formats as F  # noqa: E402
from jaxlp.parallel.compressors._base import exact_div  # noqa: E402

HERE = Path(__file__).parent


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_equal_one_process_vmap(tmp_path):
  nproc = 2
  port = _free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = str(HERE.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = xla_flags()
  env["JAX_PLATFORMS"] = "cpu"
  procs = [subprocess.Popen([sys.executable, str(HERE / "_mp_sharded_worker.py"), str(port),
                             str(nproc), str(i), str(tmp_path / f"out{i}.npz")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(nproc)]
  logs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=240)
      logs.append(out.decode(errors="replace")[-3000:])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log
  # the reference: the numpy oracles of every case (vmap and shard_map in one process give
  # their bits: tests/parallel/test_sharded*.py); no program compiled in this process
  gs = np.load(tmp_path / "out0.npz")["gs"]
  w = gs.shape[0]
  assert w == 2 * nproc
  flat = gs.reshape(w, -1)
  shape = worker.SHAPE
  mx = F.mx(F.E2M1FN, 2)
  want = {
      "ring": oracle.reduce_scatter("ring", flat, shape, 1, oracle.Q(F.E4M3)),
      "ring-kahan-d0": oracle.reduce_scatter("ring", flat, (flat.shape[1],), 0,
                                             oracle.Q(F.E4M3), kahan=True),
      "chain": oracle.reduce_scatter("chain", flat, shape, 1, oracle.Q(F.E5M2)),
      "tree": oracle.reduce_scatter("tree", flat, shape, 1, oracle.Q(F.FP32)),
      "a2a-mx": oracle.all_to_all_sum(flat, shape, 1, oracle.Q(mx)),
      "ag-mx": np.tile(oracle.all_gather(gs, mx).reshape(1, -1), (w, 1)),
      # qgZ, first step: each worker's gradient divided by W (mean) plus its zero residual
      # (as test_sharded_compressed.format_oracle)
      "qgz-ef": oracle.all_to_all_sum(np.asarray(exact_div(jnp.asarray(flat), w)) + np.float32(0),
                                      shape, 1, oracle.Q(mx)),
  }
  q = oracle.Q(F.E4M3)
  ps = flat[:, :worker.PSUM_N]
  for name, red in (("psum-chain", oracle.chain(ps, q)), ("psum-ring", oracle.ring(ps, q)),
                    ("psum-ring-aps", oracle.aps_sum(ps, F.E4M3, lambda p: oracle.ring(p, q),
                                                     q))):
    want[name] = np.tile(red.reshape(1, -1), (w, 1))  # every worker has the whole sum
  assert set(want) == set(worker.cases())
  for i in range(nproc):
    r = np.load(tmp_path / f"out{i}.npz")
    np.testing.assert_array_equal(r["gs"], gs)
    for name, rows in want.items():
      idx = r[name + "-rows"]
      got = r[name].reshape(len(idx), -1)
      assert_same_bits(got, rows[np.sort(idx)], f"process {i} {name}")
