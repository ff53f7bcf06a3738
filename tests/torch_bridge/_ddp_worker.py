"""One rank of the 2-process gloo DDP test (run by tests/torch_bridge/test_torch_ddp.py).

Usage: python _ddp_worker.py RANK WORLD PORT OUTDIR [DEVICE]. Runs every hook variant in one
process group and writes OUTDIR/rank{RANK}.npz with the final parameters of each variant and
the bucket inputs/outputs of the first step of the low-precision variants. DEVICE ("cpu" by
default, or "cuda": every rank on cuda:0, so DDP's buckets are CUDA tensors) holds the model
and the batches.
"""

import os
import sys

import jax
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import jaxlp
from jaxlp.parallel import compressors as C
from jaxlp.torch import ddp as jddp

STEPS = 5
# Variants whose only checks are "identical on both ranks and close to uncompressed training"
# compile with XLA's optimizations off (tests/conftest.py, ``fast_compile``); the others' bits
# are compared with references compiled normally (CPD's chain sum, CGX's decode-sum).
# (onebit and PowerSGD run in _ddp_hooks_worker.py's comm_* variants.)
FAST_COMPILE = ("topk",)


def _fast_compile(on):
  if jax.config.read("jax_disable_most_optimizations") != on:
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", on)


def variants():
  return {
      "fp32": dict(),
      "e4m3_aps": dict(fmt=jaxlp.formats.E4M3, aps=True),
      "e5m2_kahan_bucket_aps": dict(fmt=jaxlp.formats.E5M2, kahan=True, aps="bucket"),
      "cgx4": dict(compressor=C.cgx(bits=4, bucket_size=128)),
      "topk": dict(compressor=C.topk(0.1)),
  }


def model_fn():
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                             torch.nn.ReLU(), torch.nn.Linear(32, 4))


def main():
  rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
  dev = torch.device(sys.argv[5] if len(sys.argv) > 5 else "cpu")
  os.environ["MASTER_ADDR"] = "127.0.0.1"
  os.environ["MASTER_PORT"] = port
  import datetime
  dist.init_process_group("gloo", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=60))
  torch.set_num_threads(1)
  res = {}
  for name, kw in variants().items():
    _fast_compile(name in FAST_COMPILE)
    model = model_fn().to(dev)
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = jddp.CommState(layer_min_size=256, **kw)
    records = []

    def hook(st, bucket, records=records):
      inp = bucket.buffer().detach().clone()
      numels = [g.numel() for g in bucket.gradients()]
      step = st.step
      fut = jddp.comm_hook(st, bucket)
      if step <= 1:
        records.append((bucket.index(), inp.cpu().numpy().copy(),
                        fut.value().detach().cpu().numpy().copy(), np.array(numels)))
      return fut

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
      g = torch.Generator().manual_seed(1000 * step + rank)
      x = torch.randn(32, 16, generator=g).to(dev)
      y = torch.randint(0, 4, (32,), generator=g).to(dev)
      opt.zero_grad()
      torch.nn.functional.cross_entropy(ddp(x), y).backward()
      opt.step()
    for i, p in enumerate(model.parameters()):
      res[f"{name}/param{i}"] = p.detach().cpu().numpy()
    for j, (idx, inp, outp, numels) in enumerate(records):
      res[f"{name}/rec{j}/index"] = np.array(idx)
      res[f"{name}/rec{j}/in"] = inp
      res[f"{name}/rec{j}/out"] = outp
      res[f"{name}/rec{j}/numels"] = numels
  _fast_compile(False)
  # CPD's sum_gradients (non-DDP, SUM semantics), E4M3-like cpd_float(4, 3) with APS
  model = model_fn().to(dev)
  g = torch.Generator().manual_seed(77 + rank)
  torch.nn.functional.cross_entropy(model(torch.randn(8, 16, generator=g).to(dev)),
                                    torch.randint(0, 4, (8,), generator=g).to(dev)).backward()
  for i, p in enumerate(model.parameters()):
    res[f"sumgrad/in{i}"] = p.grad.cpu().numpy().copy()
  jddp.sum_gradients(model, use_APS=True, grad_exp=4, grad_man=3)
  for i, p in enumerate(model.parameters()):
    res[f"sumgrad/out{i}"] = p.grad.cpu().numpy().copy()
  np.savez(os.path.join(out, f"rank{rank}.npz"), **res)
  dist.barrier()
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
