"""The jaxlp.torch QPyTorch drop-ins vs QPyTorch: per call (4K) and throughput (16M).

Every public quantizing entry point of the torch bridge is timed next to its QPyTorch twin on
the same tensors and device: ``quantize`` (vs QPyTorch ``float_quantize`` of the same format),
``float_quantize``, ``block_quantize``, ``fixed_point_quantize``, ``quantizer`` (the function),
``Quantizer`` (the module) and one ``OptimLP`` step (weights, gradients and momentum quantized;
an SGD step over one parameter). Rows: a small tensor (per-call overhead, us) and a large one
(throughput). Goals (for CUDA tensors): >= 1.5x QPyTorch's throughput at 16M
elements, <= 50 us per call at 4K; on the CPU the bridge must not be slower than before.
``OptimLP``'s per-call cost is its time over the plain ``torch.optim.SGD`` step it wraps,
timed in the same run (its own row): on the H200 (2026-11-27) ``OptimLP`` took 168-209 us
at 4K and QPyTorch's 205-230 us, most of it in torch's optimizer step.

Usage: python benchmarks/torch_quantize.py [--device cpu|cuda] [--small] [--n N] [--reps R]
       [--only NAMES] [--profile]

``--profile`` also runs each timed jaxlp entry point 2000 times at 4K elements under
``cProfile`` and prints its ten most expensive functions (own time per call): where a
per-call row above its goal spends the host's time.

``--device cuda`` on a machine without a CUDA device prints the table with every row
"not measured" (and says why) instead of numbers. On CUDA the column "via JITFunction.run"
times each jaxlp entry point again with the Triton kernels launched through Triton's
``JITFunction.run`` instead of the bridge's direct launches (``jaxlp/torch/_triton.py``,
``Launcher``), in the same run.
"""

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports (jax tries `compression.zstd`, for one).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import platform
import time

import torch

EXP, MAN = 5, 2  # E5M2-like QPyTorch float
WL_BLOCK, WL_FIXED, FL_FIXED = 8, 8, 4


def _time(fn, reps, sync, inner):
  """Best of ``reps`` timings of ``inner`` back-to-back calls, per call, in seconds."""
  for _ in range(3):
    fn()  # warm-up: compiles / builds
  sync()
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      fn()
    sync()
    best = min(best, (time.perf_counter() - t0) / inner)
  return best


def _launchers():
  """(the bridge's launcher, one that always takes JITFunction.run), or None without Triton."""
  from jaxlp.torch import _triton as T  # noqa: PLC0415

  if not T.available():
    return None
  jit = T.Launcher()
  jit.disabled = "benchmark: every launch through JITFunction.run"
  return T.LAUNCHER, jit


def _time_with(launchers, fn, reps, sync, inner):
  """:func:`_time` of ``fn`` with every Triton kernel launched through JITFunction.run."""
  if launchers is None:
    return None
  from jaxlp.torch import _triton as T  # noqa: PLC0415

  T.LAUNCHER = launchers[1]
  try:
    return _time(fn, reps, sync, inner)
  finally:
    T.LAUNCHER = launchers[0]


def _cases(jt, qq, x):
  """(name, rounding, jaxlp fn, QPyTorch fn or None) for every entry point."""
  from jaxlp.formats import qpytorch_float  # noqa: PLC0415

  fmt = qpytorch_float(EXP, MAN)
  q = qq.quant if qq else None
  cases = []
  for r in ("nearest", "stochastic"):
    cases += [
        ("quantize", r, lambda r=r: jt.quantize(x, fmt, r),
         (lambda r=r: q.float_quantize(x, EXP, MAN, r)) if q else None),
        ("float_quantize", r, lambda r=r: jt.float_quantize(x, EXP, MAN, r),
         (lambda r=r: q.float_quantize(x, EXP, MAN, r)) if q else None),
        ("block_quantize", r, lambda r=r: jt.block_quantize(x, WL_BLOCK, -1, r),
         (lambda r=r: q.block_quantize(x, WL_BLOCK, -1, r)) if q else None),
        ("fixed_point_quantize", r,
         lambda r=r: jt.fixed_point_quantize(x, WL_FIXED, FL_FIXED, rounding=r),
         (lambda r=r: q.fixed_point_quantize(x, WL_FIXED, FL_FIXED, rounding=r)) if q else None),
    ]
    jfn = jt.quantizer(fmt, forward_rounding=r)
    qfn = q.quantizer(qq.FloatingPoint(EXP, MAN), forward_rounding=r) if q else None
    cases.append(("quantizer", r, lambda f=jfn: f(x), (lambda f=qfn: f(x)) if q else None))
    jmod = jt.Quantizer(fmt, forward_rounding=r)
    qmod = q.Quantizer(qq.FloatingPoint(EXP, MAN), forward_rounding=r) if q else None
    cases.append(("Quantizer", r, lambda m=jmod: m(x), (lambda m=qmod: m(x)) if q else None))
    cases.append(("OptimLP step", r, _optim_step(jt.OptimLP, jfn, x),
                  _optim_step(qq.optim.OptimLP, qfn, x) if q else None))
  return cases


def _optim_step(optim_lp, q, x):
  """One SGD(momentum) step of a parameter shaped like ``x``, weight/grad/momentum quantized."""
  w = torch.nn.Parameter(x.clone())
  w.grad = x * 0.5
  opt = optim_lp(torch.optim.SGD([w], lr=0.1, momentum=0.9), weight_quant=q, grad_quant=q,
                 momentum_quant=q)

  def step():
    opt.step()
  return step


def _sgd_step(x):
  """The step ``OptimLP step`` wraps, without quantization: what any SGD user pays already."""
  w = torch.nn.Parameter(x.clone())
  w.grad = x * 0.5
  opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
  return opt.step


def _profile(jt, x, only, sync, calls=2000, top=10):
  """cProfile of ``calls`` calls of each jaxlp entry point on ``x``: the ``top`` functions by
  own time, in us per call."""
  import cProfile  # noqa: PLC0415
  import pstats  # noqa: PLC0415

  for name, r, jf, _ in _cases(jt, None, x):
    if only is not None and name not in only:
      continue
    jf()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
      jf()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values())
    print(f"\n# profile: {name} {r}, {x.numel()} elements, {calls} calls: "
          f"{1e6 * total / calls:.1f} us per call under cProfile")
    print("| function | calls per call | own us per call | cumulative us per call |")
    print("|---|---|---|---|")
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (fname, line, func), (_, ncalls, tt, ct, _) in rows:
      where = f"{_os.path.basename(fname)}:{line}({func})"
      print(f"| {where} | {ncalls / calls:.2f} | {1e6 * tt / calls:.2f} | "
            f"{1e6 * ct / calls:.2f} |")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
  ap.add_argument("--small", action="store_true",
                  help="4K and 64K elements, 2 reps (smoke test)")
  ap.add_argument("--n", type=int, default=16 * 2**20, help="large size (default 16M)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--only", default=None, help="comma-separated entry points to time")
  ap.add_argument("--profile", action="store_true",
                  help="profile each timed jaxlp entry point at 4K elements (cProfile)")
  args = ap.parse_args()
  small_n, large_n = (4096, 2**16) if args.small else (4096, args.n)
  reps = 2 if args.small else args.reps

  import jax  # noqa: PLC0415

  import jaxlp.torch as jt  # noqa: PLC0415
  try:
    import qtorch  # noqa: PLC0415
    import qtorch.optim  # noqa: F401, PLC0415
    import qtorch.quant  # noqa: F401, PLC0415
    qq = qtorch
  except Exception as e:  # noqa: BLE001
    qq = None
    print(f"# qtorch unavailable: {e!r}")

  print(f"# {platform.node()} {platform.processor() or platform.machine()} "
        f"torch {torch.__version__} jax {jax.__version__} threads {torch.get_num_threads()} "
        f"device={args.device} {time.strftime('%Y-%m-%d')}")
  print(f"# formats: float E{EXP}M{MAN} (QPyTorch FloatingPoint), block wl={WL_BLOCK} "
        f"(last dim), fixed wl={WL_FIXED} fl={FL_FIXED}; per-call rows: best of {reps} x 50 "
        "calls; throughput rows: best of reps (CUDA: x 10 calls)")
  cuda = args.device == "cuda"
  jit_col = " via JITFunction.run |" if cuda else ""
  print(f"| entry point | rounding | elements | jaxlp.torch |{jit_col} QPyTorch | speed-up | "
        "goal |")
  print("|---|---|---|---|---|---|---|" + ("---|" if cuda else ""))
  only = set(args.only.split(",")) if args.only else None
  if cuda and not torch.cuda.is_available():
    for n in (small_n, large_n):
      for name in ("quantize", "float_quantize", "block_quantize", "fixed_point_quantize",
                   "quantizer", "Quantizer", "OptimLP step"):
        for r in ("nearest", "stochastic"):
          if only is None or name in only:
            print(f"| {name} | {r} | {n} | not measured | not measured | not measured | - | "
                  f"{'<= 50 us' if n == small_n else '>= 1.5x'} |")
    print("# not measured: torch.cuda.is_available() is False on this machine")
    return
  launchers = _launchers() if cuda else None
  dev = torch.device(args.device)
  sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
  for n in (small_n, large_n):
    x = torch.randn(n, device=dev)
    # large CUDA tensors: 10 back-to-back calls per timing (one synchronisation, as in a
    # training step), so the sync latency does not pose as throughput
    inner = 50 if n == small_n else (10 if dev.type == "cuda" else 1)
    tsgd = None
    for name, r, jf, qf in _cases(jt, qq, x):
      if only is not None and name not in only:
        continue
      if name == "OptimLP step" and tsgd is None:
        # OptimLP's own cost is its time over this row: the 4K goal is per call of the
        # bridge, and the wrapped torch step alone can take longer than 50 us on CUDA
        tsgd = _time(_sgd_step(x), reps, sync, inner)
        u, sc = ("us", 1e6) if n == small_n or dev.type == "cuda" else ("ms", 1e3)
        print(f"| torch.optim.SGD step alone (OptimLP's baseline) | - | {n} | "
              f"{tsgd * sc:.1f} {u} |{' - |' if cuda else ''} - | - | - |")
      tj = _time(jf, reps, sync, inner)
      jit_s = ""
      if cuda:
        tjit = _time_with(launchers, jf, reps, sync, inner)
        jit_s = f" {tjit * 1e6:.1f} us |" if tjit is not None else " n/a |"
      tq = _time(qf, reps, sync, inner) if qf is not None else None
      unit, scale = ("us", 1e6) if n == small_n or dev.type == "cuda" else ("ms", 1e3)
      goal = "<= 50 us" if n == small_n else "CPU: no regression" if dev.type == "cpu" \
          else ">= 1.5x"
      if name == "OptimLP step" and n == small_n:
        goal = f"<= 50 us over SGD: {(tj - tsgd) * 1e6:+.1f} us"
      q_s = f"{tq * scale:.1f} {unit}" if tq is not None else "n/a"
      ratio = f"{tq / tj:.2f}x" if tq is not None else "n/a"
      print(f"| {name} | {r} | {n} | {tj * scale:.1f} {unit} |{jit_s} {q_s} | {ratio} | "
            f"{goal} |")
  if args.profile:
    _profile(jt, torch.randn(small_n, device=dev), only, sync)
  x = torch.randn(large_n)
  trt = _time(lambda: jt.to_torch(jt.to_jax(x)), reps, lambda: None, 20)
  same = jt.to_torch(jt.to_jax(x)).data_ptr() == x.data_ptr()
  print(f"| DLPack round trip torch->jax->torch (CPU) | - | {large_n} | {trt * 1e6:.0f} us "
        f"(zero-copy={same}) | - | - | - |")


if __name__ == "__main__":
  main()
