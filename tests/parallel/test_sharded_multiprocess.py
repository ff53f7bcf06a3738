"""Two processes x two CPU devices (W = 4) over loopback jax.distributed: the sharded
collectives give the single-process oracles' bits and the same bits as one process's vmap."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _mp_sharded_worker as worker  # noqa: E402
import oracle  # noqa: E402
from test_multiprocess import _free_port  # noqa: E402
from test_sharded import assert_same_bits  # noqa: E402

from jaxlp import formats as F  # noqa: E402

HERE = Path(__file__).parent


def test_two_processes_equal_one_process_vmap(tmp_path):
  nproc = 2
  port = _free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = str(HERE.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
  env.pop("XLA_FLAGS", None)
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
  # the reference: the same functions over a named vmap in this process (bit-identical to the
  # numpy oracles by tests/parallel/test_sharded*.py)
  gs = np.load(tmp_path / "out0.npz")["gs"]
  w = gs.shape[0]
  assert w == 2 * nproc
  fns = worker.cases()
  # all cases in one program, as in the workers
  ref = jax.jit(jax.vmap(lambda x: {k: fn(x) for k, fn in fns.items()}, axis_name="dev"))(gs)
  ref = {name: np.asarray(a) for name, a in ref.items()}
  for i in range(nproc):
    r = np.load(tmp_path / f"out{i}.npz")
    np.testing.assert_array_equal(r["gs"], gs)
    for name in fns:
      rows = r[name + "-rows"]
      got = r[name].reshape((len(rows),) + ref[name].shape[1:])
      assert_same_bits(got, ref[name][np.sort(rows)], f"process {i} {name}")
  # and the numpy oracles directly
  flat = gs.reshape(w, -1)
  shape = worker.SHAPE
  want = {
      "ring": oracle.reduce_scatter("ring", flat, shape, 1, oracle.Q(F.E4M3)),
      "ring-kahan-d0": oracle.reduce_scatter("ring", flat, (flat.shape[1],), 0,
                                             oracle.Q(F.E4M3), kahan=True),
      "chain": oracle.reduce_scatter("chain", flat, shape, 1, oracle.Q(F.E5M2)),
      "tree": oracle.reduce_scatter("tree", flat, shape, 1, oracle.Q(F.FP32)),
      "a2a-mx": oracle.all_to_all_sum(flat, shape, 1, oracle.Q(F.mx(F.E2M1FN, 2))),
  }
  for name, rows in want.items():
    assert_same_bits(ref[name].reshape(w, -1), rows, f"oracle {name}")
  assert_same_bits(ref["ag-mx"][0], oracle.all_gather(gs, F.mx(F.E2M1FN, 2)), "oracle ag-mx")
