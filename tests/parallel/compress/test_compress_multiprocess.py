"""compressed_allreduce across 2 processes x 2 CPU devices (gloo on loopback, W = 4) gives
bit-identical results on all 4 devices, and the same bits (outputs of every step and the final
state) as the same jit(shard_map) on a 4-device mesh of this process's forced CPU devices.

One worker launch runs every case of ``_mp_compress_worker.CASES``, all cases in one program
in each process (compile dominates: one compile instead of one per case)."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

# one worker runs the whole module: its module fixture starts the processes once
pytestmark = pytest.mark.xdist_group("mp_compress")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _mp_compress_worker as mpw  # noqa: E402

NPROC = 2
W = 2 * NPROC


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _collect(arrays):
  """{case id: {key: {row: array}}} from the workers' npz entries "case|key|row"."""
  res = {}
  for name, a in arrays.items():
    cid, key, row = name.split("|")
    rows = res.setdefault(cid, {}).setdefault(key, {})
    assert int(row) not in rows, f"row {row} of {cid} {key} saved by two processes"
    rows[int(row)] = a
  return res


@pytest.fixture(scope="session")
def results(tmp_path_factory):
  """(multi-process results, in-process reference, worker logs); the reference is computed
  while the workers run."""
  tmp = tmp_path_factory.mktemp("mp_compress")
  port = _free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = str(HERE.parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
  env.pop("XLA_FLAGS", None)
  env["JAX_PLATFORMS"] = "cpu"  # CPU devices + gloo, even where this process sees a GPU
  logs = [tmp / f"log{i}.txt" for i in range(NPROC)]
  procs = []
  for i in range(NPROC):
    with open(logs[i], "wb") as fh:
      procs.append(subprocess.Popen(
          [sys.executable, str(HERE / "_mp_compress_worker.py"), str(port), str(NPROC), str(i),
           str(tmp / f"out{i}.npz")], env=env, stdout=fh, stderr=subprocess.STDOUT))
  try:
    # The forced CPU devices (jax.devices() is one GPU under JAX_PLATFORMS=cuda,cpu), and
    # the default device pinned to the CPU so the reference is XLA:CPU end to end, as in the
    # workers (initial compressor state included).
    devices = jax.devices("cpu")[:W]
    assert len(devices) == W, f"need {W} CPU devices (tests/conftest.py forces 8)"
    with jax.default_device(devices[0]):
      ref = mpw.run_cases(mpw.CASES, devices)
    deadline = time.monotonic() + 240
    for p in procs:
      try:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  texts = [f"--- worker {i} (rc={p.returncode}) ---\n"
           + logs[i].read_text(errors="replace")[-4000:] for i, p in enumerate(procs)]
  for p in procs:
    assert p.returncode == 0, "worker failed or timed out:\n" + "\n".join(texts)
  arrays = {}
  for i in range(NPROC):
    with np.load(tmp / f"out{i}.npz") as z:
      arrays.update({k: z[k] for k in z.files})
  return _collect(arrays), ref, "\n".join(texts)


def _bits_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _describe(a, b):
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
  af, bf = a.astype(np.float64), b.astype(np.float64)
  diff = ~((af == bf) | (np.isnan(af) & np.isnan(bf)))
  return (f"{int(diff.sum())}/{a.size} elements differ, max |diff| = "
          f"{np.nanmax(np.abs(af - bf)) if diff.any() else 0.0}")


@pytest.mark.parametrize("case", mpw.CASES, ids=mpw.case_id)
def test_multiprocess_matches_in_process_shard_map(results, case):
  mp, ref, logs = results
  cid = mpw.case_id(case)
  assert cid in mp, f"case {cid} missing from the workers' output\n{logs}"
  got, want = mp[cid], ref[cid]
  assert sorted(got) == sorted(want), (sorted(got), sorted(want))
  n_state = sum(k.startswith("state/") for k in want)
  n_out = sum(k.startswith("step") for k in want)
  assert n_out == mpw.STEPS * len(mpw.shapes(case)) and n_state > 0
  for key in sorted(want):
    assert sorted(got[key]) == list(range(W)), (key, sorted(got[key]))
    assert sorted(want[key]) == list(range(W))
    if key.startswith("step"):
      # (a) every device of the multi-process job holds the same reduced gradient
      for r in range(1, W):
        assert _bits_equal(got[key][r], got[key][0]), \
            f"{cid} {key}: device {r} != device 0: {_describe(got[key][r], got[key][0])}"
    # (b) the multi-process bits == the in-process shard_map bits (outputs and state)
    for r in range(W):
      assert _bits_equal(got[key][r], want[key][r]), \
          f"{cid} {key} row {r}: multi-process != in-process: " \
          f"{_describe(got[key][r], want[key][r])}"


def test_table_covers_every_aggregation_and_wire_type():
  """One case per aggregation family, collective and wire type (_mp_compress_worker.CASES)."""
  used = {c[0] for c in mpw.CASES}
  assert used == set(mpw.COMPRESSORS), set(mpw.COMPRESSORS) - used
  families = {mpw.COMPRESSORS[c[0]].aggregation for c in mpw.CASES}
  assert len(families) == 4, families  # dense quantizers, sparsifiers, low rank, casts
  kinds = {type(mpw.COMPRESSORS[c[0]]).__name__ for c in mpw.CASES}
  assert kinds >= {"CGX", "OneBit", "TopK", "PowerSGD", "Cast"}
  assert any(c[:2] == ("cgx4", "sra") for c in mpw.CASES) and ("onebit", "ring") in mpw.CASES
  # a fused case fuses two compressed leaves
  assert any(len(c) > 2 and "bucket_mb" in c[2] for c in mpw.CASES)
  assert sum(len(s) > 1 and int(np.prod(s)) >= mpw.MIN_SIZE
             for s in mpw.FUSED_SHAPES.values()) == 2
  assert len({mpw.case_id(c) for c in mpw.CASES}) == len(mpw.CASES)
