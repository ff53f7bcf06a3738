"""Worker of test_compress_multiprocess.py, and the case table + computation it shares with
the in-process reference.

Run as a script it is one process of a loopback ``jax.distributed`` job (gloo CPU collectives,
2 CPU devices per process): it runs every case of :data:`CASES` (``compressed_allreduce`` under
``jit(shard_map)`` over all devices of the job, :data:`STEPS` steps carrying the state; all
cases in one program) and saves the rows of its own devices to an npz. Imported (by the test),
it only defines the table and :func:`run_cases`, and touches no environment.

Usage: python _mp_compress_worker.py PORT NUM_PROCESSES PROCESS_ID OUT.npz
"""

import os
import sys

if __name__ == "__main__":
  # the suite's XLA:CPU flags (tests/conftest.py), then two devices per process
  os.environ["XLA_FLAGS"] = (os.environ.get("JAXLP_TEST_XLA_CPU_FLAGS", "") +
                             " --xla_force_host_platform_device_count=2").strip()
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxlp.parallel.compressors as C  # noqa: E402
from jaxlp.parallel._compressed import compressed_allreduce, init_compression_state  # noqa: E402

# Gradient pytree (shapes only): "fc" is compressed (>= MIN_SIZE elements, ndim > 1), "bias" (a
# vector) and "tiny" (< MIN_SIZE) go through the fp32 path. The fused cases (bucket_mb) add a
# second compressed leaf, "conv", to fuse with "fc": every compressed leaf is one more copy of
# the compressor's code to compile in each of the 3 processes, and leaves are reduced one by
# one, alike (what crosses the processes is what a leaf's collectives send).
SHAPES = {"fc": (96, 40), "bias": (40,), "tiny": (3, 5)}
FUSED_SHAPES = dict(SHAPES, conv=(8, 4, 3, 3))
MIN_SIZE = 64
STEPS = 2

COMPRESSORS = {
    "cgx4": C.cgx(4, 64),
    "onebit": C.onebit(),  # error feedback
    "topk": C.topk(0.05),
    "powersgd2": C.powersgd(2, start_iter=1),  # step 0 plain mean, step 1 low rank
    "bf16": C.cast("bf16"),
}

# THE case table: (compressor name, algorithm[, extra compressed_allreduce kwargs]).
# One line per case. Each case adds its compressor's code to the one program compiled in each
# of the 3 processes (~1-7 s of CPU per case, less in one program): keep the table short.
# What crosses the processes is what the cases' collectives send, so one case per aggregation
# family and collective (all_to_all, all_gather, ppermute) and wire type (u8, u16, int32, f32):
# the compressor's own code is the same in one process and in several (every compressor's
# shard_map bits are compared with vmap's, on 8 devices of one process, in
# test_compress_allreduce.py::test_identical_on_workers_and_vmap_equals_shard_map). The
# workers' global axis index (chunk owners, ring neighbours) is in every case.
CASES = (
    # SRA (all_to_all, all_gather) of a fused bucket (fc + conv, 4128 elements): packed u8
    # levels and f32 min/max
    ("cgx4", "sra", {"bucket_mb": 0.02}),
    ("onebit", "ring"),  # CGX compressed ring (ppermute) with error feedback
    ("topk", "auto"),  # sparsifiers: all_gather of int32 indices and f32 values
    ("powersgd2", "auto"),  # low rank: P and Q in f32, the plain mean before start_iter
    ("bf16", "auto"),  # casts: 16-bit words (a ring in the narrow type)
)


def case_id(case) -> str:
  name, algo, *rest = case
  extra = "".join(f"-{k}={v}" for k, v in sorted((rest[0] if rest else {}).items()))
  return f"{name}-{algo}{extra}"


def shapes(case) -> dict:
  """The gradient pytree's shapes of a case: :data:`FUSED_SHAPES` with ``bucket_mb``."""
  return FUSED_SHAPES if len(case) > 2 and "bucket_mb" in case[2] else SHAPES


def grads_np(step: int, w: int, leaf_shapes=None):
  """Per-device gradients of one step, deterministic: {leaf: float32 (w, *shape)}."""
  rng = np.random.default_rng(1234 + step)
  out = {}
  for k, shape in (SHAPES if leaf_shapes is None else leaf_shapes).items():
    g = rng.standard_normal((w,) + shape).astype(np.float32)
    # per-device scale so that workers differ in magnitude too
    out[k] = g * np.float32(2.0 ** -step) * (1 + np.arange(w, dtype=np.float32)).reshape(
        (w,) + (1,) * len(shape))
  return out


def _global(mesh, a):
  a = np.asarray(a)
  sharding = NamedSharding(mesh, P("i"))
  return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def _local_rows(arr):
  """{global row index: numpy row} of this process's shards of a (w, ...) array."""
  rows = {}
  for s in arr.addressable_shards:
    start = s.index[0].start or 0
    data = np.asarray(s.data)
    for j in range(data.shape[0]):
      rows[start + j] = data[j]
  return rows


def run_cases(cases, devices):
  """Runs ``cases`` on a 1-D mesh of ``devices``, all in ONE program (one trace and one XLA
  compile per process instead of one per case: the compile of the 15 small programs was most
  of this test's time, about 50 s of CPU in each of the 3 processes, 35 s as one program; each
  case is still its own ``compressed_allreduce`` on its own gradients and state, and the
  multi-process job runs every case's collectives). Returns {case id: {"stepN/<path>" or
  "state/<path>": {global row: numpy row}}} for the rows this process holds."""
  w = len(devices)
  mesh = Mesh(np.asarray(devices), ("i",))
  st0 = {}
  for case in cases:
    params = {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes(case).items()}
    st0[case_id(case)] = jax.tree_util.tree_map(
        lambda a: np.broadcast_to(np.asarray(a), (w,) + a.shape),
        init_compression_state(COMPRESSORS[case[0]], params))

  def body(g, s):
    g, s = jax.tree_util.tree_map(lambda a: a[0], (g, s))
    out = {}
    for case in cases:
      name, algo, *rest = case
      cid = case_id(case)
      out[cid] = compressed_allreduce(g[cid], s[cid], "i", COMPRESSORS[name], min_size=MIN_SIZE,
                                      algorithm=algo, **(dict(rest[0]) if rest else {}))
    return jax.tree_util.tree_map(lambda a: a[None], out)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i"),
                            check_vma=False))
  st = jax.tree_util.tree_map(lambda a: _global(mesh, a), st0)
  res = {case_id(c): {} for c in cases}
  for step in range(STEPS):
    g = {case_id(c): jax.tree_util.tree_map(lambda a: _global(mesh, a),
                                            grads_np(step, w, shapes(c))) for c in cases}
    out = f(g, st)
    st = {cid: o[1] for cid, o in out.items()}
    for cid, (o, _) in out.items():
      for path, leaf in jax.tree_util.tree_flatten_with_path(o)[0]:
        res[cid][f"step{step}/{jax.tree_util.keystr(path)}"] = _local_rows(leaf)
  for cid, s in st.items():
    for path, leaf in jax.tree_util.tree_flatten_with_path(s)[0]:
      res[cid][f"state/{jax.tree_util.keystr(path)}"] = _local_rows(leaf)
  return res


def main():
  port, nproc, pid, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
  import jaxlp.parallel as jp
  jp.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                initialization_timeout=60)
  devices = jax.devices()
  print(f"process {pid}: {len(devices)} devices, {jax.local_device_count()} local", flush=True)
  arrays = {}
  for cid, res in run_cases(CASES, devices).items():
    for key, rows in res.items():
      for r, a in rows.items():
        arrays[f"{cid}|{key}|{r}"] = a
  print(f"process {pid}: {len(CASES)} cases done", flush=True)
  np.savez(out, **arrays)
  jp.shutdown()


if __name__ == "__main__":
  main()
