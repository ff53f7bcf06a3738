"""Multi-process (loopback, gloo CPU collectives) reduction == single-process numpy oracle."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import oracle  # noqa: E402
from test_psum import assert_rows_equal  # noqa: E402

from jaxlp import formats as F  # noqa: E402

HERE = Path(__file__).parent


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_loopback(tmp_path):
  nproc = 2
  port = _free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = str(HERE.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
  env.pop("XLA_FLAGS", None)
  env["JAX_PLATFORMS"] = "cpu"  # CPU devices + gloo (the worker sets it too), even on a GPU host
  procs = [subprocess.Popen([sys.executable, str(HERE / "_mp_worker.py"), str(port), str(nproc),
                             str(i), str(tmp_path / f"out{i}.npz")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(nproc)]
  logs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=120)
      logs.append(out.decode(errors="replace")[-3000:])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log
  q = oracle.Q(F.E4M3)
  for i in range(nproc):
    r = np.load(tmp_path / f"out{i}.npz")
    gs = r["gs"]
    assert gs.shape[0] == 2 * nproc  # 2 devices per process
    assert_rows_equal(r["chain-False"], oracle.chain(gs, q))
    assert_rows_equal(r["ring-False"], oracle.ring(gs, q))
    assert_rows_equal(r["ring-True"], oracle.aps_sum(gs, F.E4M3, lambda p: oracle.ring(p, q), q))
