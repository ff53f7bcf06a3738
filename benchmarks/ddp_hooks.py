"""Per-step cost of jaxlp's DDP communication hooks against PyTorch's own (2 processes, gloo).

Every method trains two copies of PyTorch's MNIST example CNN (conv 1->32, conv 32->64,
max-pool, fc 9216->128, fc 128->10: 1.2M parameters) with DDP on W processes (gloo on
127.0.0.1, CPU): one copy with PyTorch's hook (``torch.distributed.algorithms.ddp_comm_hooks``),
one with jaxlp's hook of the same name (``jaxlp.torch.ddp``), the same state arguments, the
same random batches. The two copies step in turns (step k of both before step k+1 of
either), so a shared machine's load falls on both alike. A step is ``zero_grad``, forward,
backward (the hook runs in it) and the SGD update; its time is measured on rank 0 (the
collectives keep the ranks in step). Each hook call is wrapped in a timer (call to completed
future; PyTorch's PowerSGD future chain is waited for inside, as it must be with gloo).

Columns: the median step time of each (after the first compressed step), jaxlp's overhead
over PyTorch's step (goal: <= 10%), the median hook call (wall, and its process CPU time),
the median over steps of the CPU time of a step's hook calls (all buckets: the steadier
measure on a shared machine; the process's other threads, e.g. autograd's, count too), and
the first compressed step (jaxlp's includes compiling its jitted stages, once per bucket
layout).

PowerSGD methods start compressing at step 2 (``start_powerSGD_iter=2``, PyTorch's minimum
with error feedback / warm start). PyTorch 2.13's ``batched_powerSGD_hook`` fails at its first
compressed step (``_orthogonalize`` asserts a batch of matrices); its row runs it with that
call given the 3-D view it expects.

``--pin``: each worker process is bound to one CPU (``os.sched_setaffinity``, rank r to the
r-th allowed CPU modulo their number) before torch and JAX start: XLA:CPU then runs its
programs on one thread, as torch does here (``torch.set_num_threads(1)``); without it XLA
splits each bucket-sized loop over a pool of one thread per CPU (2-core CPU: about twice
torch's one-thread CPU time for the same 4.7 MB add, and the pool's threads compete with the
other rank's process).

Usage:
  python benchmarks/ddp_hooks.py [--steps 20] [--batch 64] [--world 2] [--pin]
      [--methods fp16,bf16,powersgd_r1,powersgd_r2,powersgd_r4,batched_r2,powersgd_r2_fp16w]
  python benchmarks/ddp_hooks.py --small    # CI-sized: 4 timed steps, batch 8, 2 methods
"""

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

METHODS = ("fp16", "bf16", "powersgd_r1", "powersgd_r2", "powersgd_r4", "batched_r2",
           "powersgd_r2_fp16w")
SMALL_METHODS = ("fp16", "powersgd_r2")
START = 2  # start_powerSGD_iter


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _net():
  import torch  # noqa: PLC0415

  class Net(torch.nn.Module):
    """PyTorch's MNIST example network (examples/mnist/main.py), without dropout."""

    def __init__(self):
      super().__init__()
      self.conv1 = torch.nn.Conv2d(1, 32, 3, 1)
      self.conv2 = torch.nn.Conv2d(32, 64, 3, 1)
      self.fc1 = torch.nn.Linear(9216, 128)
      self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
      f = torch.nn.functional
      x = f.relu(self.conv2(f.relu(self.conv1(x))))
      x = torch.flatten(f.max_pool2d(x, 2), 1)
      return self.fc2(f.relu(self.fc1(x)))

  return Net()


def _hooks(name):
  """(PyTorch's (state, hook), jaxlp's (state, hook)) of method ``name``."""
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as tdef  # noqa: PLC0415
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps  # noqa: PLC0415

  from jaxlp.torch import ddp as jddp  # noqa: PLC0415

  if name in ("fp16", "bf16"):
    return (None, getattr(tdef, f"{name}_compress_hook")), \
        (None, getattr(jddp, f"{name}_compress_hook"))
  rank = int(name.split("_r")[1][0])
  hook = "batched_powerSGD_hook" if name.startswith("batched") else "powerSGD_hook"
  pair = []
  for mod, wrap_mod in ((tps, tdef), (jddp, jddp)):
    state = mod.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START)
    h = getattr(mod, hook)
    if name.endswith("fp16w"):
      h = wrap_mod.fp16_compress_wrapper(h)
    pair.append((state, h))
  return tuple(pair)


def _timed(hook, times, cpu):
  import torch  # noqa: PLC0415

  def wrapped(state, bucket) -> torch.futures.Future[torch.Tensor]:
    t0, c0 = time.perf_counter(), time.process_time()
    fut = hook(state, bucket)
    fut.wait()
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
    return fut

  return wrapped


def _orthogonalize_2d_ok(original):
  def orth(matrices, epsilon=0):
    return original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)
  return orth


def worker(rank, world, port, args):
  if args.pin:  # before torch and JAX make their thread pools
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
  import torch  # noqa: PLC0415
  import torch.distributed as dist  # noqa: PLC0415
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps  # noqa: PLC0415
  from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415, N817

  os.environ["MASTER_ADDR"] = "127.0.0.1"
  os.environ["MASTER_PORT"] = str(port)
  dist.init_process_group("gloo", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=600))
  torch.set_num_threads(1)
  tps._orthogonalize = _orthogonalize_2d_ok(tps._orthogonalize)  # see the module docstring
  rows = []
  for name in args.methods:
    models, opts, times = [], [], []
    for state, hook in _hooks(name):
      torch.manual_seed(0)
      m = DDP(_net())
      ht, hc = [], []
      m.register_comm_hook(state, _timed(hook, ht, hc))
      models.append(m)
      opts.append(torch.optim.SGD(m.parameters(), lr=0.01))
      times.append(([], ht, hc, []))
    n_steps = START + 1 + args.steps
    for step in range(n_steps):
      g = torch.Generator().manual_seed(1000 * step + rank)
      x = torch.randn(args.batch, 1, 28, 28, generator=g)
      y = torch.randint(0, 10, (args.batch,), generator=g)
      for m, opt, (st, ht, _, ends) in zip(models, opts, times, strict=True):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        st.append(time.perf_counter() - t0)
        ends.append(len(ht))  # the hook calls of step k: [ends[k-1], ends[k])
    if rank == 0:
      first = START if "powersgd" in name or "batched" in name else 0
      row = [name]
      for st, ht, hc, ends in times:
        steady = st[first + 1:]
        k = ends[first]  # the first call after the first compressed step
        # DDP rebuilds its buckets after the first step: one call then, two from then on
        step_cpu = [sum(hc[a:b]) for a, b in zip(ends[first:-1], ends[first + 1:], strict=True)]
        row += [statistics.median(steady), st[first], statistics.median(ht[k:]),
                statistics.median(hc[k:]), statistics.median(step_cpu)]
      rows.append(row)
      print(f"  {name}: done", file=sys.stderr, flush=True)
  if rank == 0:
    print("RESULT", repr(rows), flush=True)
  dist.barrier()
  dist.destroy_process_group()


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=20, help="timed steps after the first "
                  "compressed one (default 20; --small 4)")
  ap.add_argument("--batch", type=int, default=64, help="batch per process (default 64)")
  ap.add_argument("--world", type=int, default=2, help="processes (default 2)")
  ap.add_argument("--methods", default=None,
                  help=f"comma-separated, from {','.join(METHODS)} (default: all)")
  ap.add_argument("--small", action="store_true", help="CI-sized run")
  ap.add_argument("--pin", action="store_true", help="bind each process to one CPU (XLA then "
                  "runs on one thread, as torch here)")
  ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.small:
    args.steps, args.batch = 4, 8
  methods = args.methods.split(",") if args.methods else list(
      SMALL_METHODS if args.small else METHODS)
  bad = [m for m in methods if m not in METHODS]
  if bad:
    ap.error(f"unknown method(s) {bad}; choose from {METHODS}")
  args.methods = methods
  if args.worker is not None:
    worker(args.worker, args.world, args.port, args)
    return 0
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
  cmd = [sys.executable, os.path.abspath(__file__), "--port", str(port), "--world",
         str(args.world), "--steps", str(args.steps), "--batch", str(args.batch),
         "--methods", ",".join(methods)] + (["--pin"] if args.pin else [])
  procs = [subprocess.Popen(cmd + ["--worker", str(r)], env=env, stdout=subprocess.PIPE,
                            text=True) for r in range(args.world)]
  outs = [p.communicate()[0] for p in procs]
  if any(p.returncode for p in procs):
    print("ddp_hooks: a worker failed", file=sys.stderr)
    return 1
  rows = eval(next(line for line in outs[0].splitlines()  # noqa: S307 -- our own repr
                   if line.startswith("RESULT"))[len("RESULT "):])
  try:
    load = os.getloadavg()
  except OSError:
    load = None
  print(f"DDP hooks, {args.world} processes (gloo, CPU), MNIST CNN (1.2M parameters), batch "
        f"{args.batch} per process, {args.steps} timed steps; load average "
        f"{'n/a' if load is None else ' '.join(f'{v:.2f}' for v in load)}"
        f"{'; each process pinned to one CPU' if args.pin else ''}")
  print("step: median wall time of zero_grad + forward + backward (with the hook) + SGD "
        "update; hook: median wall (CPU) time per call; hook CPU/step: median CPU time of a "
        "step's hook calls, torch / jaxlp; 1st: the first compressed step")
  print(f"{'method':<19}{'torch step':>11}{'jaxlp step':>11}{'overhead':>9}"
        f"{'torch hook':>17}{'jaxlp hook':>17}{'hook CPU/step':>18}{'1st step torch / jaxlp':>26}")
  for name, ts, tf, th, tc, tp, js, jf, jh, jc, jp in rows:
    print(f"{name:<19}{ts * 1e3:>8.1f} ms{js * 1e3:>8.1f} ms{(js / ts - 1) * 100:>8.0f}%"
          f"{th * 1e3:>8.1f} ({tc * 1e3:4.1f}) ms{jh * 1e3:>8.1f} ({jc * 1e3:4.1f}) ms"
          f"{tp * 1e3:>8.1f} / {jp * 1e3:4.1f} ms{tf * 1e3:>12.0f} / {jf * 1e3:.0f} ms")
  return 0


if __name__ == "__main__":
  sys.exit(main())
