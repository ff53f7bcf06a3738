"""jaxlp's DDP hooks next to PyTorch's own, in one real 2-process DDP run (gloo, 127.0.0.1).

The worker (``_ddp_hooks_worker.py``) hands every bucket of every step to PyTorch's hook
(``torch.distributed.algorithms.ddp_comm_hooks``, PyTorch's state) and to jaxlp's hook of the
same name (jaxlp's state), so both see the same gradients and keep their own error feedback
and Q's; training continues with jaxlp's result. The model has a layer whose gradient is
exactly zero (PyTorch's PowerSGD turns it into NaN, jaxlp's into 0) and, after DDP's bucket
rebuild, three buckets (one in most PowerSGD runs, to keep the compiles few). Checks, at
every step:

* ``fp16_compress_hook``, ``bf16_compress_hook``, ``fp16_compress_wrapper(allreduce_hook)``:
  PyTorch's bits;
* ``powerSGD_hook`` (rank 1: Gram-Schmidt; rank 4: QR, same-shape batching; no error
  feedback and no warm start: a fresh PyTorch Q every step), ``batched_powerSGD_hook``:
  PyTorch's bits before ``start_powerSGD_iter``, then PyTorch's result to 1e-5 of the
  bucket's largest magnitude (float32 rounding of other summation orders; observed <= 1e-6),
  the Q memories too; ``fp16_compress_wrapper(powerSGD_hook)``: to 1e-2 (float16 rounding
  of PyTorch's float16 Gram-Schmidt against jaxlp's float32 one; observed <= 2e-3);
* every result identical on both ranks;
* ``CommState`` with error-feedback compressors from step 0 across the rebuild: per
  parameter, the sum of the outputs plus the final error states equals the sum of the
  inputs (nothing lost when the parameters moved to other buckets); the final parameters
  identical on both ranks and close to full-batch training without a hook (onebit, PowerSGD:
  until 2026-11-30 two more variants of ``test_torch_ddp.py``'s run).
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from _bench import xla_flags

pytestmark = pytest.mark.xdist_group("torch_ddp_hooks")

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORLD = 2
BIT_EXACT = ("fp16", "bf16", "allreduce_fp16w")
POWERSGD = {"psgd_r1": (1e-5, 2), "psgd_r4_batch": (1e-5, 2), "psgd_r2_noef_cold": (1e-5, 1),
            "batched_r2": (1e-5, 2), "psgd_r2_fp16w": (1e-2, 2)}  # tolerance, start iteration
DEAD = (24, 16)  # the zero-gradient layer's weight


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# session scope: a module-scoped fixture was set up twice in one CI run (pytest-xdist ran
# other modules' tests between this module's), doubling its 2-process run
@pytest.fixture(scope="session")
def runs(tmp_path_factory):
  out = tmp_path_factory.mktemp("ddp_hooks")
  port = str(_free_port())
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS=xla_flags(), OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_ddp_hooks_worker.py"),
                             str(r), str(WORLD), port, str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for r in range(WORLD)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=900)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log[-4000:]
  return [dict(np.load(out / f"rank{r}.npz")) for r in range(WORLD)]


def _steps(run, name):
  """[(step, bucket key)] of variant ``name`` in step order."""
  keys = {k.rsplit("/", 1)[0] for k in run if k.startswith(name + "/s")}
  return sorted(keys, key=lambda k: (int(k.split("/")[1][1:]), k))


def _bits(a):
  return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("name", BIT_EXACT)
def test_cast_hooks_give_pytorchs_bits(runs, name):
  keys = _steps(runs[0], name)
  assert len(keys) >= 1 + 3 * 4  # one bucket at step 0, three after the rebuild
  rounded = False
  for k in keys:
    for run in runs:
      np.testing.assert_array_equal(_bits(run[k + "/jaxlp"]), _bits(run[k + "/torch"]), k)
    np.testing.assert_array_equal(_bits(runs[0][k + "/jaxlp"]), _bits(runs[1][k + "/jaxlp"]))
    exact = (runs[0][k + "/in"] + runs[1][k + "/in"]) / 2
    rounded |= not np.array_equal(runs[0][k + "/jaxlp"], exact)
  assert rounded


def _dead_slice(nm):
  """The flat range of the zero-gradient weight in a bucket of (n, m) views, or None."""
  off = 0
  for n, m in nm:
    if (n, m) == DEAD:
      return slice(off, off + n * m)
    off += n * m
  return None


@pytest.mark.parametrize("name", sorted(POWERSGD))
def test_powersgd_hooks_follow_pytorchs_step_by_step(runs, name):
  tol, start = POWERSGD[name]
  keys = _steps(runs[0], name)
  assert len(keys) >= 5
  steps = {int(k.split("/")[1][1:]) for k in keys}
  for k in keys:
    step = int(k.split("/")[1][1:])
    np.testing.assert_array_equal(_bits(runs[0][k + "/jaxlp"]), _bits(runs[1][k + "/jaxlp"]))
    for run in runs:
      t, j = run[k + "/torch"], run[k + "/jaxlp"]
      if step < start:  # PyTorch's allreduce_hook: the same bits
        np.testing.assert_array_equal(_bits(j), _bits(t), k)
        continue
      dead = None if name.startswith("batched") else _dead_slice(run[k + "/nm"])
      if dead is not None:
        # an all-zero gradient: PyTorch's Gram-Schmidt divides 0 by 0 (NaN), jaxlp keeps 0
        assert not j[dead].any(), k
        gram_schmidt = "r4" not in name
        assert np.isnan(t[dead]).all() == gram_schmidt, k
        keep = np.ones(t.size, bool)
        keep[dead] = False
        t, j = t[keep], j[keep]
      assert not np.isnan(j).any() and not np.isnan(t).any(), k
      err = np.abs(t - j).max() / np.abs(t).max()
      assert err <= tol, (k, err)
  assert len([s for s in steps if s >= start]) >= 3
  for what in ("error_dict", "p_memory_dict", "q_memory_dict"):  # PyTorch's state layout
    np.testing.assert_array_equal(runs[0][f"{name}/layout/{what}/jaxlp"],
                                  runs[0][f"{name}/layout/{what}/torch"], what)
  q_keys = [k for k in runs[0] if k.startswith(name + "/q/") and k.endswith("/torch")]
  for k in q_keys:
    t, j = runs[0][k].ravel(), runs[0][k.replace("/torch", "/jaxlp")].ravel()
    ok = ~np.isnan(t)
    assert ok.any() and np.abs(t[ok] - j[ok]).max() <= max(tol, 1e-4) * np.abs(t[ok]).max(), k


def test_powersgd_trains_like_pytorchs(runs):
  """Final parameters: identical on both ranks."""
  for name in POWERSGD:
    i = 0
    while f"{name}/param{i}" in runs[0]:
      np.testing.assert_array_equal(_bits(runs[0][f"{name}/param{i}"]),
                                    _bits(runs[1][f"{name}/param{i}"]))
      i += 1
    assert i == 7


@pytest.mark.parametrize("name,scale", [("comm_onebit", 0.5), ("comm_powersgd", 1.0)])
def test_comm_state_keeps_error_feedback_across_the_bucket_rebuild(runs, name, scale):
  """Error feedback conserves the gradient: per parameter, over the steps,
  ``sum(out) + scale * sum_ranks(final error) == scale * sum_steps sum_ranks(in)`` (onebit: the
  residual holds ``g / W`` units, scale 1/W; PowerSGD: ``W * out``, the error in ``g``
  units). A state lost when the parameter moved to another bucket breaks the equality by a
  whole step's error."""
  r0, r1 = runs
  params = sorted({int(k.rsplit("/p", 1)[1]) for k in r0 if k.startswith(f"{name}/residual")})
  assert len(params) >= 6
  steps = sorted({int(k.split("/")[1][1:]) for k in r0 if k.startswith(name + "/s")})
  moved = 0
  for i in params:
    buckets = [int(r0[f"{name}/s{s}/p{i}/bucket"]) for s in steps]
    moved += buckets[0] != buckets[-1]
    ins = sum(r[f"{name}/s{s}/p{i}/in"].astype(np.float64) for s in steps for r in runs)
    outs = sum(r0[f"{name}/s{s}/p{i}/out"].astype(np.float64) for s in steps)
    res = sum(r[f"{name}/residual/p{i}"].astype(np.float64) for r in runs)
    if name == "comm_powersgd":
      lhs, rhs = WORLD * outs + res, ins
    else:
      lhs, rhs = outs + res, ins * scale
    np.testing.assert_allclose(lhs, rhs, atol=1e-5 * np.abs(rhs).max() + 1e-7, err_msg=str(i))
  assert moved >= 1  # some parameters did change buckets at the rebuild


COMM_TOLERANCE = {"comm_onebit": 0.05, "comm_powersgd": 0.02}  # observed 0.027, 0.0025


def _full_batch_params():
  """The worker's model trained in this process on both ranks' batches (no DDP, no hook): the
  uncompressed mean gradient of every step."""
  sys.path.insert(0, HERE)
  import _ddp_hooks_worker as w  # noqa: PLC0415
  from _torch_testutil import full_batch_train  # noqa: PLC0415
  model = full_batch_train(w, WORLD)
  return [p.detach().numpy() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(COMM_TOLERANCE))
def test_comm_state_trains_identically_on_both_ranks_and_close(runs, name):
  ref = _full_batch_params()
  assert len(ref) == 7
  err = 0.0
  for i, want in enumerate(ref):
    a, b = runs[0][f"{name}/param{i}"], runs[1][f"{name}/param{i}"]
    np.testing.assert_array_equal(_bits(a), _bits(b), f"{name} param {i}")
    err = max(err, float(np.abs(a - want).max()))
  assert 0 < err <= COMM_TOLERANCE[name], err  # changed by the compressor, still close
