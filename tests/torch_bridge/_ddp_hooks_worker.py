"""One rank of the 2-process gloo comparison of jaxlp's DDP hooks with PyTorch's own.

Usage: python _ddp_hooks_worker.py RANK WORLD PORT OUTDIR. Run by
tests/torch_bridge/test_ddp_hooks.py. For every variant one DDP model trains STEPS SGD steps;
its hook hands each bucket to PyTorch's hook (``torch.distributed.algorithms.ddp_comm_hooks``,
on a copy of the bucket, with PyTorch's state) and to jaxlp's hook of the same name (with
jaxlp's state), waits for both, records both outputs and continues with jaxlp's: the two hooks
see the same gradients at every step and keep their own state (error feedback, Q), so they
can be compared step by step. Writes OUTDIR/rank{RANK}.npz.

PyTorch 2.13's ``batched_powerSGD_hook`` passes one matrix to ``_orthogonalize``, which
asserts a batch of matrices; here that call gets the 3-D view it expects (nothing else of
PyTorch's hook changes).
"""

import datetime
import os
import sys

import jax
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as tdef
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps
from torch.nn.parallel import DistributedDataParallel as DDP

from jaxlp.parallel import compressors as C
from jaxlp.torch import ddp as jddp

STEPS = 5
# Variants checked to a tolerance against PyTorch (PowerSGD, CommState) compile with XLA's
# optimizations off (tests/conftest.py, ``fast_compile``: their compiles are most of this run);
# the cast hooks, whose bits are compared with PyTorch's, compile normally.
BIT_EXACT = ("fp16", "bf16", "allreduce_fp16w")


def _fast_compile(on):
  if jax.config.read("jax_disable_most_optimizations") != on:
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", on)


def _orthogonalize_2d_ok(original):
  def orth(matrices, epsilon=0):
    if matrices.dim() == 2:
      return original(matrices.unsqueeze(0), epsilon)
    return original(matrices, epsilon)
  return orth


class FakeBucket:
  """A ``GradBucket`` over a copy of a real one (PyTorch's hooks only call these methods)."""

  def __init__(self, bucket):
    self._buf = bucket.buffer().detach().clone()
    self._index, self._last = bucket.index(), bucket.is_last()
    self._shapes = [tuple(g.shape) for g in bucket.gradients()]
    self._params = bucket.parameters()

  def buffer(self):
    return self._buf

  def set_buffer(self, b):
    self._buf = b

  def index(self):
    return self._index

  def is_last(self):
    return self._last

  def parameters(self):
    return self._params

  def gradients(self):
    out, off = [], 0
    for shp in self._shapes:
      n = int(np.prod(shp)) if shp else 1
      out.append(self._buf[off:off + n].view(shp))
      off += n
    return out


def psgd(**kw):
  return lambda mod: mod.PowerSGDState(None, **kw)


SMALL, ONE = 0.0019, 25.0  # bucket_cap_mb: three buckets after DDP's rebuild, or one


def variants():
  """name -> (state factory (given the hooks' module), hook name, wrapper name or None,
  bucket_cap_mb)."""
  return {
      "fp16": (lambda mod: None, "fp16_compress_hook", None, SMALL),
      "bf16": (lambda mod: None, "bf16_compress_hook", None, SMALL),
      "allreduce_fp16w": (lambda mod: None, "allreduce_hook", "fp16_compress_wrapper", SMALL),
      "psgd_r1": (psgd(start_powerSGD_iter=2), "powerSGD_hook", None, SMALL),
      "psgd_r4_batch": (psgd(matrix_approximation_rank=4, start_powerSGD_iter=2,
                             batch_tensors_with_same_shape=True), "powerSGD_hook", None, ONE),
      # from step 1 (PyTorch allows start_powerSGD_iter <= 1 only without error feedback and
      # warm start): PowerSGD on the rebuilt bucket only. From step 0 it also ran on the
      # bucket before the rebuild (the same parameters in another order): one more bucket
      # layout to compile, about 15 s of this run on the 2-core VM, for a case psgd_r1's
      # three rebuilt buckets (other layouts, same code) already check
      "psgd_r2_noef_cold": (psgd(matrix_approximation_rank=2, start_powerSGD_iter=1,
                                 use_error_feedback=False, warm_start=False, random_seed=3),
                            "powerSGD_hook", None, ONE),
      "batched_r2": (psgd(matrix_approximation_rank=2, start_powerSGD_iter=2),
                     "batched_powerSGD_hook", None, ONE),
      "psgd_r2_fp16w": (psgd(matrix_approximation_rank=2, start_powerSGD_iter=2),
                        "powerSGD_hook", "fp16_compress_wrapper", ONE),
  }


def model_fn():
  """Three layers and the dead one (PowerSGD compresses four weights at rank 1, three at
  ranks 2 and 4). Each stage program of a PowerSGD bucket holds every matrix of the bucket,
  and XLA's compiles of those programs are most of this run's time: a fourth layer
  (48 x 48, until 2026-11-30) made the run about a quarter dearer without another kind of
  bucket (``SMALL`` gives three buckets after the rebuild either way: the dead layer with
  the last one, then the bias and weight of each other layer)."""
  torch.manual_seed(0)
  body = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32),
                             torch.nn.ReLU(), torch.nn.Linear(32, 4))
  dead = torch.nn.Linear(16, 24, bias=False)  # its gradient is exactly zero

  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.body, self.dead = body, dead

    def forward(self, x):
      return self.body(x) + 0.0 * self.dead(x).sum()

  return Net()


def torch_hook(name):
  for mod in (tdef, tps):
    if hasattr(mod, name):
      return getattr(mod, name)
  raise AttributeError(name)


def run_variant(name, spec, rank):
  make_state, hook_name, wrapper, cap = spec
  model = model_fn()
  ddp = DDP(model, bucket_cap_mb=cap)
  t_state, j_state = make_state(tps), make_state(jddp)
  t_hook, j_hook = torch_hook(hook_name), getattr(jddp, hook_name)
  if wrapper:
    t_hook, j_hook = getattr(tdef, wrapper)(t_hook), getattr(jddp, wrapper)(j_hook)
  rec = {}
  step = [0]

  def hook(_, bucket):
    fb = FakeBucket(bucket)
    inp = bucket.buffer().detach().clone()
    t_out = t_hook(t_state, fb).wait()          # PyTorch's hook, waited for (serialised)
    j_out = j_hook(j_state, bucket).wait()
    key = f"{name}/s{step[0]}/b{bucket.index()}"
    rec[key + "/in"] = inp.float().numpy()
    rec[key + "/torch"] = t_out.detach().float().numpy().copy()
    rec[key + "/jaxlp"] = j_out.detach().float().numpy().copy()
    rec[key + "/nm"] = np.array([(g.shape[0] if g.dim() else 1,
                                  g.numel() // (g.shape[0] if g.dim() else 1))
                                 for g in bucket.gradients()]).reshape(-1, 2)
    if bucket.is_last():
      step[0] += 1
    return _done(j_out)

  ddp.register_comm_hook(None, hook)
  train(ddp, rank)
  for i, p in enumerate(model.parameters()):
    rec[f"{name}/param{i}"] = p.detach().numpy()
  if isinstance(t_state, tps.PowerSGDState):
    for idx, q in t_state.q_memory_dict.items():
      rec[f"{name}/q/b{idx}/torch"] = q.float().numpy()
      rec[f"{name}/q/b{idx}/jaxlp"] = j_state.q_memory_dict[idx].float().numpy()
    for what in ("error_dict", "p_memory_dict", "q_memory_dict"):  # PyTorch's state layout
      for st, who in ((t_state, "torch"), (j_state, "jaxlp")):
        rec[f"{name}/layout/{what}/{who}"] = np.array(
            [(idx, *tuple(t.shape), int(t.dtype == torch.float16))
             for idx, t in sorted(getattr(st, what).items())]).reshape(-1)
  return rec


def train(ddp, rank):
  opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
  for s in range(STEPS):
    g = torch.Generator().manual_seed(1000 * s + rank)
    x = torch.randn(32, 16, generator=g)
    y = torch.randint(0, 4, (32,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def comm_variants():
  """jaxlp's CommState with an error-feedback compressor from step 0, several buckets: the
  state must follow each parameter through DDP's bucket rebuild. PowerSGD with an explicit
  ``layer_min_size`` (the 4 x 32 weight then goes uncompressed: the per-tensor filter of
  ``_comm_powersgd``; PowerSGD's plan without one runs in the ``psgd_*`` variants)."""
  return {
      "comm_onebit": dict(compressor=C.onebit(), layer_min_size=0, skip_vectors=False),
      "comm_powersgd": dict(compressor=C.powersgd(rank=2), layer_min_size=256),
  }


def run_comm_variant(name, kw, rank):
  """Records, per parameter (model order) and step, the hook's input and output slices,
  the parameters' buckets per step, and the final error-feedback state per parameter."""
  model = model_fn()
  params = list(model.parameters())
  pidx = {id(p): i for i, p in enumerate(params)}
  ddp = DDP(model, bucket_cap_mb=SMALL)
  state = jddp.CommState(**kw)
  rec, step = {}, [0]

  def hook(st, bucket):
    inp = bucket.buffer().detach().clone()
    out = jddp.comm_hook(st, bucket).wait()
    off = 0
    for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
      i, n = pidx[id(p)], g.numel()
      rec[f"{name}/s{step[0]}/p{i}/in"] = inp[off:off + n].numpy()
      rec[f"{name}/s{step[0]}/p{i}/out"] = out[off:off + n].detach().numpy().copy()
      rec[f"{name}/s{step[0]}/p{i}/bucket"] = np.array(bucket.index())
      off += n
    if bucket.is_last():
      step[0] += 1
    return _done(out)

  ddp.register_comm_hook(state, hook)
  train(ddp, rank)
  for i, p in enumerate(params):
    rec[f"{name}/param{i}"] = p.detach().numpy()
  for p in params:
    st = state.param_states.get(id(p), {})
    res = st.get("residual", st.get("error"))
    if res is not None:
      rec[f"{name}/residual/p{pidx[id(p)]}"] = np.asarray(res, np.float32)
  return rec


def _done(t):
  fut = torch.futures.Future()
  fut.set_result(t)
  return fut


def main():
  rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
  only = sys.argv[5].split(",") if len(sys.argv) > 5 else None
  os.environ["MASTER_ADDR"] = "127.0.0.1"
  os.environ["MASTER_PORT"] = port
  dist.init_process_group("gloo", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=120))
  torch.set_num_threads(1)
  tps._orthogonalize = _orthogonalize_2d_ok(tps._orthogonalize)
  res = {}
  for name, spec in variants().items():
    if not only or name in only:
      _fast_compile(name not in BIT_EXACT)
      res.update(run_variant(name, spec, rank))
  for name, kw in comm_variants().items():
    if not only or name in only:
      _fast_compile(True)
      res.update(run_comm_variant(name, kw, rank))
  np.savez(os.path.join(out, f"rank{rank}.npz"), **res)
  dist.barrier()
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
