"""PyTorch DDP on MNIST with gradient compression: PyTorch's own hooks and every jaxlp option.

The DDP MNIST example from the seeds (single node, N processes, SyncBatchNorm, clean Ctrl-C
shutdown), on CPU with gloo on 127.0.0.1 (``--device cuda``: NCCL, one GPU per process, with
SyncBatchNorm, which PyTorch supports under DDP on GPU modules only), with the communication
hook chosen by ``--compression`` (a comma-separated list trains each choice in turn, from the same
initialisation, in the same process group):

* PyTorch: ``none``, ``fp16`` (``fp16_compress_hook``), ``powersgd``, ``powersgd_fp16``,
  ``batched_powersgd_fp16`` (``PowerSGDState(matrix_approximation_rank=2,
  start_powerSGD_iter=...)``, optionally wrapped in ``fp16_compress_wrapper``).
* jaxlp's hooks under PyTorch's names (``jaxlp.torch.ddp``, the same state arguments as the
  PyTorch choices): ``jaxlp_powersgd`` (``powerSGD_hook``), ``jaxlp_batched_powersgd``
  (``batched_powerSGD_hook``), ``jaxlp_powersgd_fp16`` (``fp16_compress_wrapper``).
* jaxlp compressors through ``jaxlp.torch.ddp.comm_hook``: ``cgx`` (4-bit, CGX README usage),
  ``cgx2``, ``qsgd``, ``terngrad``, ``onebit``, ``tbq``, ``topk``, ``randomk``, ``dgc``,
  ``graddrop``, ``cast_fp16`` (``fp16_compress_hook``'s bits), ``cast_bf16``,
  ``cast_e4m3``, ``cast_e5m2``.
* jaxlp low-precision reduction (CPD's chain sum in rank order): ``lp_e4m3``, ``lp_e4m3_aps``,
  ``lp_e5m2_aps``, ``lp_e5m2_kahan``, ``lp_e3m0_aps`` (``cpd_float(3, 0)``, 4-bit), and
  ``lp_e4m3_aps_bucket`` (one APS exponent per DDP bucket).

Data: MNIST IDX files from ``--data-dir`` (``train-images-idx3-ubyte[.gz]`` etc.), else the
scikit-learn digits upsampled to 28x28 (random data if scikit-learn is missing).

Usage:
  python examples/torch_mnist_ddp.py --nprocs 2 --compression none,cgx,lp_e4m3_aps
  python examples/torch_mnist_ddp.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import logging
import math
import os
import socket
import sys
import time

import numpy as np


def jaxlp_choices():
  """name -> CommState kwargs (built lazily: jax is imported in the workers only)."""
  import jaxlp  # noqa: PLC0415
  from jaxlp.parallel import compressors as C  # noqa: PLC0415
  F = jaxlp.formats  # noqa: N806
  return {
      "cgx": dict(compressor=C.cgx(bits=4, bucket_size=1024)),
      "cgx2": dict(compressor=C.cgx(bits=2, bucket_size=128)),
      "qsgd": dict(compressor=C.qsgd()),
      "terngrad": dict(compressor=C.terngrad()),
      "onebit": dict(compressor=C.onebit()),
      "tbq": dict(compressor=C.tbq(threshold=0.01)),
      "topk": dict(compressor=C.topk(0.01)),
      "randomk": dict(compressor=C.randomk(0.01)),
      "dgc": dict(compressor=C.dgc(0.01)),
      "graddrop": dict(compressor=C.graddrop()),
      "cast_fp16": dict(compressor=C.cast("fp16")),
      "cast_bf16": dict(compressor=C.cast("bf16")),
      "cast_e4m3": dict(compressor=C.cast("e4m3")),
      "cast_e5m2": dict(compressor=C.cast("e5m2")),
      "lp_e4m3": dict(fmt=F.E4M3),
      "lp_e4m3_aps": dict(fmt=F.E4M3, aps=True),
      "lp_e4m3_aps_bucket": dict(fmt=F.E4M3, aps="bucket"),
      "lp_e5m2_aps": dict(fmt=F.E5M2, aps=True),
      "lp_e5m2_kahan": dict(fmt=F.E5M2, kahan=True),
      "lp_e3m0_aps": dict(fmt=F.cpd_float(3, 0), aps=True),
  }


TORCH_CHOICES = ("none", "fp16", "powersgd", "powersgd_fp16", "batched_powersgd_fp16")
JAXLP_CHOICES = (
    "cgx", "cgx2", "qsgd", "terngrad", "onebit", "tbq", "topk", "randomk", "dgc", "graddrop",
    "jaxlp_powersgd", "jaxlp_batched_powersgd", "jaxlp_powersgd_fp16", "cast_fp16",
    "cast_bf16", "cast_e4m3", "cast_e5m2", "lp_e4m3", "lp_e4m3_aps", "lp_e4m3_aps_bucket",
    "lp_e5m2_aps", "lp_e5m2_kahan", "lp_e3m0_aps")
CHOICES = TORCH_CHOICES + JAXLP_CHOICES


# ---------------------------------------------------------------------------------------------
# data

def _read_idx(path):
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    data = f.read()
  ndim = data[3]
  shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
  return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(data_dir, stem):
  for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx")
               + ".gz"):
    p = os.path.join(data_dir, name)
    if os.path.exists(p):
      return p
  raise FileNotFoundError(f"{stem}[.gz] not found in {data_dir}")


def load_data(data_dir, seed=0):
  """(x_train, y_train, x_test, y_test): float32 (N, 1, 28, 28) normalised, int64 labels."""
  if data_dir:
    xs = [_read_idx(_find(data_dir, f"{s}-images-idx3-ubyte")) for s in ("train", "t10k")]
    ys = [_read_idx(_find(data_dir, f"{s}-labels-idx1-ubyte")) for s in ("train", "t10k")]
    xs = [(x.astype(np.float32) / 255.0 - 0.1307) / 0.3081 for x in xs]
  else:
    try:
      from sklearn.datasets import load_digits  # noqa: PLC0415
      d = load_digits()
      imgs = d.images.astype(np.float32) / 16.0                    # (n, 8, 8)
      imgs = np.kron(imgs, np.ones((1, 3, 3), np.float32))         # 24 x 24
      imgs = np.pad(imgs, ((0, 0), (2, 2), (2, 2)))                 # 28 x 28
      labels = d.target
    except ImportError:
      rng = np.random.default_rng(seed)
      labels = rng.integers(0, 10, 2000)
      imgs = rng.standard_normal((2000, 28, 28)).astype(np.float32) * 0.1
      imgs[np.arange(2000), labels * 2 + 4, :] += 1.0
    imgs = (imgs - imgs.mean()) / imgs.std()
    perm = np.random.default_rng(seed).permutation(len(imgs))
    imgs, labels = imgs[perm], labels[perm]
    n = int(len(imgs) * 0.8)
    xs, ys = [imgs[:n], imgs[n:]], [labels[:n], labels[n:]]
  return (xs[0][:, None].astype(np.float32), ys[0].astype(np.int64),
          xs[1][:, None].astype(np.float32), ys[1].astype(np.int64))


# ---------------------------------------------------------------------------------------------
# model, metrics, hooks

def make_net():
  import torch.nn as nn  # noqa: PLC0415

  class Net(nn.Module):
    """The seed's small MNIST CNN (conv-BN-ReLU x2, dropout, two FC layers)."""

    def __init__(self):
      super().__init__()
      self.features = nn.Sequential(
          nn.Conv2d(1, 32, 3), nn.BatchNorm2d(32), nn.ReLU(),
          nn.Conv2d(32, 64, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
          nn.Dropout(0.25))
      self.classifier = nn.Sequential(
          nn.Flatten(), nn.Linear(64 * 12 * 12, 128), nn.ReLU(), nn.Dropout(0.5),
          nn.Linear(128, 10))

    def forward(self, x):
      return self.classifier(self.features(x))

  return Net()


def accuracy(output, target, topk=(1, 5)):
  """Top-k accuracies in percent."""
  maxk = max(topk)
  pred = output.topk(maxk, 1, True, True).indices.t()
  correct = pred.eq(target.view(1, -1).expand_as(pred))
  return [float(correct[:k].reshape(-1).float().sum()) * 100.0 / target.size(0) for k in topk]


def _torch_batched_powersgd_is_broken():
  """PyTorch's ``batched_powerSGD_hook`` passes 2-D P/Q to ``_orthogonalize``, which asserts
  3-D input in recent versions; probe it."""
  import torch  # noqa: PLC0415
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook  # noqa: PLC0415
  try:
    powerSGD_hook._orthogonalize(torch.ones(2, 1))
  except AssertionError:
    return True
  return False


def batched_powersgd_hook_2d(state, bucket):
  """``batched_powerSGD_hook``'s intended semantics (its docstring) for PyTorch versions
  whose own hook fails: the bucket zero-padded to ``s x s`` (``s = ceil(sqrt(numel))``),
  error feedback, ``Q`` from ``randn`` seeded by ``state.rng`` on first use, every step
  ``orth(Q); P = M Q; allreduce(P); orth(P); Q = M^T P; allreduce(Q); Q /= W; M = P Q^T``
  (Gram-Schmidt through PyTorch's own ``_orthogonalize`` on a 3-D view).
  """
  import torch  # noqa: PLC0415
  import torch.distributed as dist  # noqa: PLC0415
  from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,  # noqa: PLC0415
    powerSGD_hook,  # noqa: PLC0415
  )
  group = state.process_group
  w = dist.get_world_size(group)
  buf = bucket.buffer()
  if state.iter < state.start_powerSGD_iter:
    state.maybe_increase_iter(bucket)
    return default_hooks._allreduce_fut(group, buf)
  n = buf.numel()
  s = math.ceil(math.sqrt(n))
  x = torch.zeros(s * s, dtype=buf.dtype, device=buf.device)
  x[:n] = buf.reshape(-1)
  idx = bucket.index()
  if state.use_error_feedback:
    if idx not in state.error_dict:
      state.error_dict[idx] = torch.zeros_like(x)
    x += state.error_dict[idx]
    cp = x.clone()
  m = x.view(s, s)
  if not state.warm_start or idx not in state.q_memory_dict:
    with torch.random.fork_rng(devices=[]):
      torch.manual_seed(state.rng.randint(1_000_000_000))
      state.q_memory_dict[idx] = torch.randn(s, state.matrix_approximation_rank,
                                             dtype=buf.dtype).to(buf.device)
  q = state.q_memory_dict[idx]
  powerSGD_hook._orthogonalize(q.unsqueeze(0))
  p = m @ q
  dist.all_reduce(p, group=group)
  powerSGD_hook._orthogonalize(p.unsqueeze(0))
  torch.matmul(m.t(), p, out=q)
  dist.all_reduce(q, group=group)
  q.div_(w)
  torch.matmul(p, q.t(), out=m)
  if state.use_error_feedback:
    state.error_dict[idx] = cp - x
  buf.copy_(x[:n].view_as(buf))
  state.maybe_increase_iter(bucket)
  fut = torch.futures.Future()
  fut.set_result(buf)
  return fut


def serialized(hook):
  """Wait for ``hook``'s future chain before returning it.

  PyTorch's PowerSGD hooks chain further ``all_reduce`` calls in future callbacks; with gloo
  those callbacks run on gloo's worker threads, so with several buckets in flight the ranks
  can issue collectives in different orders (a "collective mismatch" abort). Waiting per
  bucket keeps the order identical on every rank (at the cost of overlap).
  """
  def wrapped(state, bucket):
    fut = hook(state, bucket)
    fut.wait()
    return fut

  return wrapped


def cpu_safe_cuda_synchronize():
  """Make ``torch.cuda.synchronize(cpu_device)`` a no-op in this process.

  PyTorch's PowerSGD hooks call ``torch.cuda.synchronize(bucket_device)`` whenever
  ``torch.cuda.is_available()``, which raises ``ValueError: Expected a cuda device, but got:
  cpu`` for the CPU buckets of a gloo run on a machine that has a GPU. Only CPU devices are
  skipped; CUDA devices synchronize as before. Called by the CPU workers only.
  """
  import torch  # noqa: PLC0415

  if not torch.cuda.is_available() or getattr(torch.cuda.synchronize, "_cpu_safe", False):
    return
  original = torch.cuda.synchronize

  def synchronize(device=None):
    if device is not None and torch.device(device).type == "cpu":
      return None
    return original(device)

  synchronize._cpu_safe = True
  torch.cuda.synchronize = synchronize


def register_hook(model, name, args):
  """Register the communication hook of compression choice ``name`` on DDP ``model``."""
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD  # noqa: PLC0415,N812
  if name == "none":
    return None
  if name == "fp16":
    model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
    return None
  if name in ("powersgd", "powersgd_fp16", "batched_powersgd_fp16"):
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=args.start_powersgd_iter)
    hook = powerSGD.powerSGD_hook
    if name.startswith("batched"):
      hook = batched_powersgd_hook_2d if _torch_batched_powersgd_is_broken() else \
          powerSGD.batched_powerSGD_hook
    if name.endswith("fp16"):
      hook = default_hooks.fp16_compress_wrapper(hook)
    model.register_comm_hook(state, hook if args.device == "cuda" else serialized(hook))
    return state
  from jaxlp.torch import ddp as jddp  # noqa: PLC0415
  if name.startswith("jaxlp_") and "powersgd" in name:  # jaxlp's hooks, PyTorch's names
    state = jddp.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                               start_powerSGD_iter=args.start_powersgd_iter)
    hook = jddp.batched_powerSGD_hook if "batched" in name else jddp.powerSGD_hook
    if name.endswith("fp16"):
      hook = jddp.fp16_compress_wrapper(hook)
    model.register_comm_hook(state, hook)
    return state
  state = jddp.CommState(layer_min_size=args.layer_min_size, seed=args.seed,
                         **jaxlp_choices()[name])
  model.register_comm_hook(state, jddp.comm_hook)
  return state


def get_logger(path, rank):
  logger = logging.getLogger(f"mnist_ddp.{rank}")
  logger.setLevel(logging.INFO)
  logger.handlers.clear()
  if rank == 0:
    fmt = logging.Formatter("%(asctime)s %(message)s")
    sh = logging.StreamHandler(sys.stdout)
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if path:
      os.makedirs(path, exist_ok=True)
      fh = logging.FileHandler(os.path.join(path, "mnist_train.log"))
      fh.setFormatter(fmt)
      logger.addHandler(fh)
  return logger


# ---------------------------------------------------------------------------------------------
# worker

def train(rank, args, port):
  """One DDP process: trains every requested compression choice in turn."""
  import torch  # noqa: PLC0415
  import torch.distributed as dist  # noqa: PLC0415
  from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415,N817

  torch.set_num_threads(max(1, args.threads))
  logger = get_logger(args.path, rank)
  cuda = args.device == "cuda"
  if cuda:
    torch.cuda.set_device(rank)
  else:
    cpu_safe_cuda_synchronize()
  dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                          rank=rank, world_size=args.nprocs,
                          timeout=datetime.timedelta(seconds=args.timeout))
  try:
    xtr, ytr, xte, yte = load_data(args.data_dir, args.seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    xtr, ytr = torch.from_numpy(xtr), torch.from_numpy(ytr)
    xte, yte = torch.from_numpy(xte).to(dev), torch.from_numpy(yte).to(dev)
    results = {}
    for name in args.compression:
      torch.manual_seed(args.seed)
      model = make_net()
      if cuda:
        # SyncBN: running statistics over the global batch (PyTorch's SyncBatchNorm only
        # works with GPU modules under DDP); on CPU the BatchNorm buffers of rank 0 are
        # broadcast every forward (DDP's broadcast_buffers), so ranks stay identical
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
      model = DDP(model.to(dev), bucket_cap_mb=args.bucket_cap_mb)
      register_hook(model, name, args)
      opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
      dataset = torch.utils.data.TensorDataset(xtr, ytr)
      sampler = torch.utils.data.distributed.DistributedSampler(
          dataset, num_replicas=args.nprocs, rank=rank, shuffle=True, seed=args.seed)
      loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                           drop_last=True)
      step, t0 = 0, time.time()
      for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
          x, y = x.to(dev), y.to(dev)
          opt.zero_grad()
          out = model(x)
          loss = torch.nn.functional.cross_entropy(out, y)
          loss.backward()
          opt.step()
          step += 1
          if step % args.log_every == 0:
            top1, top5 = accuracy(out.detach(), y)
            logger.info(f"[{name}] epoch {epoch} step {step} loss {loss.item():.4f} "
                        f"top1 {top1:.1f} top5 {top5:.1f}")
          if args.max_steps and step >= args.max_steps:
            break
        if args.max_steps and step >= args.max_steps:
          break
      model.eval()
      with torch.no_grad():
        out = model.module(xte)
        top1, top5 = accuracy(out, yte)
      # parameters must be identical on every rank
      flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
      gathered = [torch.empty_like(flat) for _ in range(args.nprocs)]
      dist.all_gather(gathered, flat)
      same = all(torch.equal(gathered[0], g) for g in gathered)
      results[name] = (top1, top5, same)
      logger.info(f"[{name}] done: {step} steps in {time.time() - t0:.1f}s, test top1 "
                  f"{top1:.2f} top5 {top5:.2f}, parameters identical across ranks: {same}")
      if not same:
        raise RuntimeError(f"[{name}] parameters differ across ranks")
    if rank == 0:
      logger.info("summary: " + ", ".join(f"{k}: top1 {v[0]:.2f}" for k, v in results.items()))
  except KeyboardInterrupt:
    pass
  finally:
    if dist.is_initialized():
      dist.destroy_process_group()


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--nprocs", type=int, default=2, help="number of DDP processes")
  p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                 help="cpu: gloo, BatchNorm with broadcast buffers; cuda: NCCL and SyncBN")
  p.add_argument("--compression", default="powersgd_fp16",
                 help=f"comma-separated list of {CHOICES}")
  p.add_argument("--data-dir", default=None, help="MNIST IDX files; default built-in digits")
  p.add_argument("--epochs", type=int, default=3)
  p.add_argument("--max-steps", type=int, default=0, help="stop each run after this many steps")
  p.add_argument("--batch-size", type=int, default=64, help="per process")
  p.add_argument("--lr", type=float, default=0.01)
  p.add_argument("--start-powersgd-iter", type=int, default=1000)
  p.add_argument("--layer-min-size", type=int, default=None,
                 help="jaxlp compressors: parameters below this size are sent in fp32 "
                      "(default: CommState's, 1024 for quantizers and sparsifiers, 0 for casts)")
  p.add_argument("--bucket-cap-mb", type=float, default=25.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--threads", type=int, default=1, help="torch threads per process")
  p.add_argument("--timeout", type=int, default=300, help="collective timeout (s)")
  p.add_argument("--log-every", type=int, default=20)
  p.add_argument("--path", default="./logging/", help="log directory")
  p.add_argument("--smoke", action="store_true",
                 help="CI-sized run: 2 processes, a few steps, PyTorch + jaxlp hooks")
  args = p.parse_args(argv)
  if args.smoke:
    # 4 steps: 2 plain all-reduces, then PowerSGD's first step (Q drawn) and a warm-started
    # one with error feedback; the jaxlp hooks compile in their first 2 steps (cgx: both took
    # about 20 s, the later steps under 1 s), so steps 3 and 4 run them compiled
    args.nprocs, args.epochs, args.max_steps, args.log_every = 2, 1, 4, 2
    args.start_powersgd_iter = 2
    args.bucket_cap_mb = 1.0
    if args.compression == p.get_default("compression"):
      # a PyTorch hook, a jaxlp compressor through comm_hook, a jaxlp low-precision sum
      # (cast_e4m3, not cgx: the same lines of this script, a third less of the smoke's CPU)
      args.compression = "powersgd_fp16,cast_e4m3,lp_e4m3_aps"
  args.compression = [c.strip() for c in args.compression.split(",") if c.strip()]
  for c in args.compression:
    if c not in CHOICES:
      p.error(f"unknown --compression {c!r}; choose from {CHOICES}")
  if args.nprocs < 1:
    p.error("--nprocs must be >= 1")
  if args.device == "cuda":
    import torch  # noqa: PLC0415

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < args.nprocs:
      p.error(f"--device cuda runs one process per GPU (NCCL, SyncBatchNorm): --nprocs "
              f"{args.nprocs} needs {args.nprocs} GPUs, this machine has {n}; use --device cpu "
              "(gloo) or fewer processes")
  return args


def main(argv=None):
  import torch.multiprocessing as mp  # noqa: PLC0415
  args = parse_args(argv)
  port = _free_port()
  ctx = mp.get_context("spawn")
  processes = []
  try:
    for rank in range(args.nprocs):
      proc = ctx.Process(target=train, args=(rank, args, port))
      proc.start()
      processes.append(proc)
    for proc in processes:
      proc.join()
  except KeyboardInterrupt:
    print("KeyboardInterrupt received. Terminating processes...")
    for proc in processes:
      proc.terminate()
      proc.join()
    return 130
  bad = [proc.exitcode for proc in processes if proc.exitcode != 0]
  if bad:
    print(f"worker processes failed with exit codes {bad}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
