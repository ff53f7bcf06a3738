"""A real 2-process DDP run (gloo, 127.0.0.1) with jaxlp.torch.ddp's CommState variants (those
with onebit and PowerSGD compressors run in ``test_ddp_hooks.py``'s job).

The worker (``_ddp_worker.py``) runs all variants in one process group: 5 SGD steps each;
it records the first two steps' bucket inputs/outputs. Checks: parameters bitwise identical
across ranks, close to uncompressed training (and the fp32 hook equals single-process
full-batch training), and the low-precision buckets equal an independent numpy computation
of CPD's chain sum (ml_dtypes casts) with APS / Kahan. Every check runs twice: on CPU
buckets, and (on a GPU host, else skipped with the reason) on CUDA buckets, both ranks on
cuda:0 with gloo and the hooks' JAX on the GPU: the same bits where the arithmetic is
jaxlp's (the buckets), a tolerance where torch's GEMMs sum (the full-batch comparison).
"""

import math
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from _bench import xla_flags

# one worker runs the whole module: its module fixture starts the processes once
pytestmark = pytest.mark.xdist_group("torch_ddp")

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import jax  # noqa: E402

import jaxlp  # noqa: E402
from tests.torch_bridge._torch_testutil import (  # noqa: E402
    assert_same_bits,
    full_batch_train,
    gpu_host,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORLD = 2
CPU = jax.devices("cpu")[0]  # the workers' JAX backend; references run there too
# onebit and PowerSGD (CommState's error-feedback compressors): in test_ddp_hooks.py's run
# (identical on both ranks, close to full-batch training, error feedback kept across DDP's
# bucket rebuild)
VARIANTS = ("fp32", "e4m3_aps", "e5m2_kahan_bucket_aps", "cgx4", "topk")
TOLERANCE = {"fp32": 0.0, "e4m3_aps": 0.01, "e5m2_kahan_bucket_aps": 0.02, "cgx4": 0.01,
             "topk": 0.02}


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


NO_GPU = ("CUDA buckets need a CUDA device visible to torch and a JAX GPU backend "
          "(JAX_PLATFORMS=cuda,cpu); this machine has none")


@pytest.fixture(scope="session", params=[
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not gpu_host(), reason=NO_GPU))])
def runs(request, tmp_path_factory):
  """Both ranks' records. "cpu": gloo DDP of CPU tensors, the hooks' JAX on XLA:CPU
  (JAX_PLATFORMS=cpu, so two workers do not both initialise a GPU where the test process
  sees one). "cuda": both ranks on cuda:0, gloo with CUDA buckets, the hooks' JAX on the GPU
  (without preallocation, so that two processes share it)."""
  device = request.param
  out = tmp_path_factory.mktemp(f"ddp_{device}")
  port = str(_free_port())
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS=xla_flags(), OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
  if device == "cuda":
    env.update(JAX_PLATFORMS="cuda,cpu", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_ddp_worker.py"), str(r),
                             str(WORLD), port, str(out), device], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for r in range(WORLD)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=240)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log[-4000:]
  return [dict(np.load(out / f"rank{r}.npz"), device=device) for r in range(WORLD)]


def _params(run, name):
  return [run[k] for k in sorted((k for k in run if k.startswith(name + "/param")),
                                 key=lambda k: int(k.split("param")[1]))]


@pytest.mark.parametrize("name", VARIANTS)
def test_parameters_identical_across_ranks_and_close(runs, name):
  a, b = (_params(r, name) for r in runs)
  assert len(a) == 6
  for x, y in zip(a, b, strict=True):
    assert_same_bits(x, y, name)
  ref = _params(runs[0], "fp32")
  err = max(float(np.abs(x - y).max()) for x, y in zip(a, ref, strict=True))
  assert err <= TOLERANCE[name], err
  if name != "fp32":
    assert err > 0  # the hook really changed the numerics


def test_fp32_hook_equals_full_batch_training(runs):
  sys.path.insert(0, HERE)
  import _ddp_worker as w  # noqa: PLC0415
  model = full_batch_train(w, WORLD)
  # (on CUDA, torch's GEMMs sum in another order than the CPU's: a looser tolerance)
  tol = 1e-5 if runs[0]["device"] == "cpu" else 1e-4
  for p, q in zip(model.parameters(), _params(runs[0], "fp32"), strict=True):
    np.testing.assert_allclose(p.detach().numpy(), q, rtol=tol, atol=tol / 10)


def _records(run, name):
  i = 0
  while f"{name}/rec{i}/in" in run:
    yield (run[f"{name}/rec{i}/in"], run[f"{name}/rec{i}/out"], run[f"{name}/rec{i}/numels"])
    i += 1


def _np_chain(xs, q, kahan):
  res = np.zeros_like(xs[0])
  c = np.zeros_like(res)
  for g in xs:
    if kahan:
      y = q(g - c)
      t = q(res + y)
      c = q(q(t - res) - y)
      res = t
    else:
      res = q(res + g)
  return res


def _np_aps_chain(xs, q, emax, kahan, world):
  """Independent numpy APS + chain: one shared exponent for the given pieces."""
  m = [float(np.max(np.abs(x * np.float32(world)))) if x.size else 0.0 for x in xs]
  a = max(math.ceil(math.log2(v)) if v > 0 else -math.inf for v in m)
  shift = 0 if not math.isfinite(a) else emax - a
  scaled = [q((x.astype(np.float64) * 2.0 ** shift).astype(np.float32)) for x in xs]
  return (_np_chain(scaled, q, kahan).astype(np.float64) * 2.0 ** -shift).astype(np.float32)


@pytest.mark.parametrize("name,dtype,emax,kahan,per_param", [
    ("e4m3_aps", ml_dtypes.float8_e4m3, 7, False, True),
    ("e5m2_kahan_bucket_aps", ml_dtypes.float8_e5m2, 15, True, False)])
def test_low_precision_bucket_is_cpd_chain_sum(runs, name, dtype, emax, kahan, per_param):
  def q(v):
    return np.asarray(v, np.float32).astype(dtype).astype(np.float32)

  recs = [list(_records(r, name)) for r in runs]
  assert len(recs[0]) >= 2 and len(recs[0]) == len(recs[1])
  for (in0, out0, numels), (in1, out1, _) in zip(*recs, strict=True):
    assert_same_bits(out0, out1, "ranks")
    xs = [in0 / np.float32(WORLD), in1 / np.float32(WORLD)]  # mean: divide first
    if per_param:
      bounds = np.concatenate([[0], np.cumsum(numels)])
      want = np.concatenate([
          _np_aps_chain([x[s:e] for x in xs], q, emax, kahan, WORLD)
          for s, e in zip(bounds[:-1], bounds[1:], strict=True)])
    else:
      want = _np_aps_chain(xs, q, emax, kahan, WORLD)
    assert_same_bits(out0, want, name)
    assert not np.array_equal(out0, xs[0] + xs[1])


def test_sum_gradients_is_cpd(runs):
  fmt = jaxlp.formats.cpd_float(4, 3)

  def q(v):  # on the CPU device, as in the (JAX_PLATFORMS=cpu) workers
    return np.asarray(jaxlp.formats.quantize(jax.device_put(np.asarray(v, np.float32), CPU), fmt))

  for i in range(6):
    gs = [r[f"sumgrad/in{i}"].ravel() for r in runs]
    want = _np_aps_chain(gs, q, 7, False, WORLD)  # SUM of the raw gradients
    got0, got1 = (r[f"sumgrad/out{i}"].ravel() for r in runs)
    assert_same_bits(got0, got1, "ranks")
    assert_same_bits(got0, want, f"param {i}")
    exact = gs[0] + gs[1]
    assert np.abs(got0 - exact).max() <= 0.1 * np.abs(exact).max()


def test_comm_state_validation():
  import inspect  # noqa: PLC0415

  from jaxlp.torch import ddp  # noqa: PLC0415
  # DDP.register_comm_hook checks this annotation object
  assert (inspect.signature(ddp.comm_hook).return_annotation
          == torch.futures.Future[torch.Tensor])
  with pytest.raises(ValueError, match="not both"):
    ddp.CommState(compressor=jaxlp.parallel.compressors.onebit(), fmt=jaxlp.formats.E4M3)
  with pytest.raises(ValueError, match="need fmt"):
    ddp.CommState(aps=True)
  with pytest.raises(ValueError, match="order"):
    ddp.CommState(order="ring")
  with pytest.raises(TypeError, match="compressor"):
    ddp.CommState(compressor="cgx")


def test_cgx_bucket_is_decode_sum_of_rank_encodings(runs):
  # CGX (deterministic rounding): fp32 mean for the small parameters (< layer_min_size=256,
  # all biases here), and for the weights the rank-order sum of decode(encode(g_r / W)) of
  # the bucket's weights concatenated in bucket order
  comp = jaxlp.parallel.compressors.cgx(bits=4, bucket_size=128)
  recs = [list(_records(r, "cgx4")) for r in runs]
  assert len(recs[0]) >= 2
  for (in0, out0, numels), (in1, out1, _) in zip(*recs, strict=True):
    assert_same_bits(out0, out1, "ranks")
    bounds = np.concatenate([[0], np.cumsum(numels)])
    pieces = list(zip(bounds[:-1], bounds[1:], strict=True))
    big = [(s, e) for s, e in pieces if e - s >= 256]
    xs = [x / np.float32(WORLD) for x in (in0, in1)]
    for s, e in pieces:
      if e - s < 256:
        assert_same_bits(out0[s:e], xs[0][s:e] + xs[1][s:e], "fp32 part")
    cat = [np.concatenate([x[s:e] for s, e in big]) for x in xs]
    dec = []
    for c in cat:
      # jitted as in the hook (XLA:CPU may contract decode's multiply-add into an FMA), and on
      # the CPU device as in the (JAX_PLATFORMS=cpu) workers whatever the default backend is
      f = jax.jit(lambda v: comp.decode(comp.encode(v, comp.init(v.shape), None)[0], v.shape))
      dec.append(np.asarray(f(jax.device_put(c, CPU))))
    want = dec[0] + dec[1]
    got = np.concatenate([out0[s:e] for s, e in big])
    assert_same_bits(got, want, "cgx part")
    assert not np.array_equal(got, cat[0] + cat[1])
