"""Benchmark: the jaxlp.torch QPyTorch drop-ins vs QPyTorch, per call and throughput.

Every public quantizing entry point of the torch bridge is timed next to its QPyTorch twin on
the same tensors and device: ``quantize`` (vs QPyTorch ``float_quantize`` of the same format),
``float_quantize``, ``block_quantize``, ``fixed_point_quantize``, ``quantizer`` (the function),
``Quantizer`` (the module) and one ``OptimLP`` step (weights, gradients and momentum quantized;
an SGD step over one parameter), nearest and stochastic. Rows: 100 elements and 4K (per-call
cost, us) and a large tensor (16M, throughput); then a loop over ``--shapes`` distinct shapes,
run twice (what a new shape costs: the JAX route compiled every new (format, rounding, shape)
and kept 256, so a 300-shape loop paid 16-19 s per pass).

Every number is the MEDIAN of ``--reps`` repetitions (each the mean of ``--inner`` calls,
default 50, for the per-call rows, one call for the large rows, one pass for the shape loop),
jaxlp's and QPyTorch's repetitions taken in turns: the machines are shared, so medians, not
bests, under the same load. ``--stat minmed`` takes instead the smallest of the medians of
consecutive groups of 5 repetitions (the quietest stretch of the run, each group still a
median): on a loaded machine, use it with short repetitions (``--inner 10``) and many of them
(``--reps 105``), since a repetition that a time slice of another process interrupts is
slower, and a longer repetition (the slower entry point's) is interrupted more often, which
biases a plain median of long repetitions against the slower side. ``OptimLP``'s per-call
cost is also given over the plain ``torch.optim.SGD`` step it wraps, timed in the same run
(its own row).

Goals. CPU (the NumPy path of ``jaxlp/torch/_cpu.py``, with its C accelerator of the
stochastic noise and fixed-point rounding where it was built; the header says which): <= 2x
QPyTorch's time at 100 elements, >= 1x QPyTorch's speed at 4K, and a second pass over new
shapes no slower than the first. CUDA (the Triton kernels): >= 1.5x QPyTorch's throughput
at 16M, <= 50 us per call at 4K. ``--with-jax-route`` adds a column: the same call with the
NumPy path switched off (the JAX route every CPU call took before; slow in the shape loop: it
compiles).

Usage: python benchmarks/torch_quantize.py [--device cpu|cuda] [--small] [--n N]
       [--sizes A,B,..] [--shapes S] [--reps R] [--inner I] [--stat median|min|minmed]
       [--only NAMES] [--profile] [--with-jax-route]

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
import contextlib
import platform
import statistics
import time

import torch

EXP, MAN = 5, 2  # E5M2-like QPyTorch float
WL_BLOCK, WL_FIXED, FL_FIXED = 8, 8, 4


def _times(fn, reps, sync, inner):
  """``reps`` timings of ``inner`` back-to-back calls, per call, in seconds."""
  for _ in range(3):
    fn()  # warm-up: builds / first calls
  sync()
  out = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      fn()
    sync()
    out.append((time.perf_counter() - t0) / inner)
  return out


def _min_of_medians(times, group=5):
  """The smallest median of consecutive groups of ``group`` repetitions (a last, shorter group
  counts only when it is the only one)."""
  groups = [times[i:i + group] for i in range(0, len(times), group)]
  full = [g for g in groups if len(g) == group] or groups
  return min(statistics.median(g) for g in full)


_min_of_medians.__name__ = "min of medians of 5"

#: How repetitions are summarised (``--stat``): the median (default), the fastest, or the
#: smallest median of groups of 5 consecutive repetitions.
STAT = {"median": statistics.median, "min": min, "minmed": _min_of_medians}
_stat = statistics.median


def _time(fn, reps, sync, inner):
  """The median (``--stat``) of :func:`_times`."""
  return _stat(_times(fn, reps, sync, inner))


def _interleaved(fns, reps, sync, inner):
  """Median per-call times of ``fns`` (None entries give None), timed in turns: repetition
  k of every function before repetition k + 1 of any, so that a shared machine's load falls
  on all of them alike."""
  live = [f for f in fns if f is not None]
  for f in live:
    for _ in range(3):
      f()  # warm-up: builds / first calls
  sync()
  times = {id(f): [] for f in live}
  for _ in range(reps):
    for f in live:
      t0 = time.perf_counter()
      for _ in range(inner):
        f()
      sync()
      times[id(f)].append((time.perf_counter() - t0) / inner)
  return [None if f is None else _stat(times[id(f)]) for f in fns]


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


@contextlib.contextmanager
def _jax_route():
  """Every CPU call of the bridge takes the JAX route (the NumPy path switched off)."""
  from jaxlp.torch import _cpu  # noqa: PLC0415

  saved = _cpu.quantize
  _cpu.quantize = lambda *args, **kwargs: None
  try:
    yield
  finally:
    _cpu.quantize = saved


def _shape_cases(jt, qq, x):
  """The entry points of the shape loop, on tensor ``x``: (name, rounding, jaxlp, QPyTorch)."""
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
        ("fixed_point_quantize", r,
         lambda r=r: jt.fixed_point_quantize(x, WL_FIXED, FL_FIXED, rounding=r),
         (lambda r=r: q.fixed_point_quantize(x, WL_FIXED, FL_FIXED, rounding=r)) if q else None),
        ("block_quantize", r, lambda r=r: jt.block_quantize(x, WL_BLOCK, -1, r),
         (lambda r=r: q.block_quantize(x, WL_BLOCK, -1, r)) if q else None),
    ]
  return cases


def _shape_loop(jt, qq, n_shapes, reps, only, with_jax):
  """Each entry point over ``n_shapes`` distinct shapes (up to 2400 elements), two passes
  per repetition: median seconds per pass."""
  shapes = [(1 + i % 20, 1 + i // 20, 8) for i in range(n_shapes)]
  xs = [torch.randn(s) for s in shapes]
  print(f"\n# a loop over {n_shapes} distinct shapes ({shapes[0]} ... {shapes[-1]}), "
        f"twice; {_stat.__name__} of {reps} repetitions (the JAX route: one), seconds per pass")
  jax_col = " JAX route pass 1 | JAX route pass 2 |" if with_jax else ""
  print(f"| entry point | rounding | jaxlp.torch pass 1 | jaxlp.torch pass 2 |{jax_col} "
        "QPyTorch pass 1 | QPyTorch pass 2 |")
  print("|---|---|---|---|---|---|" + ("---|---|" if with_jax else ""))
  names = [(c[0], c[1]) for c in _shape_cases(jt, qq, xs[0])]
  for k, (name, r) in enumerate(names):
    if only is not None and name not in only:
      continue

    def passes(side, k=k, reps=reps):
      first, second = [], []
      for _ in range(reps):
        fns = [_shape_cases(jt, qq, x)[k][side] for x in xs]
        if fns[0] is None:
          return None
        for out in (first, second):
          t0 = time.perf_counter()
          for f in fns:
            f()
          out.append(time.perf_counter() - t0)
      return _stat(first), _stat(second)

    tj = passes(2)
    cells = [f"{tj[0]:.4f} s", f"{tj[1]:.4f} s"]
    if with_jax:
      if name == "float_quantize":  # the JAX route compiles each shape: one entry point,
        with _jax_route():          # one repetition
          tr = passes(2, reps=1)
          cells += [f"{tr[0]:.2f} s", f"{tr[1]:.2f} s"]
      else:
        cells += ["-", "-"]
    tq = passes(3)
    cells += [f"{tq[0]:.4f} s", f"{tq[1]:.4f} s"] if tq else ["n/a", "n/a"]
    print(f"| {name} | {r} | " + " | ".join(cells) + " |")


def _goal(n, device, small):
  """The goal column of a row of ``n`` elements."""
  if device == "cuda":
    return "<= 50 us" if n == 4096 else ">= 1.5x" if n >= 2**20 else "-"
  if small:
    return "-"
  return {100: "<= 2x QPyTorch's time", 4096: ">= 1x QPyTorch"}.get(n, "- (throughput)")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
  ap.add_argument("--small", action="store_true",
                  help="4K and 64K elements, 2 reps, 20 shapes (smoke test)")
  ap.add_argument("--n", type=int, default=16 * 2**20, help="large size (default 16M)")
  ap.add_argument("--sizes", default=None,
                  help="comma-separated sizes (default: 100,4096,N; --small: 4096,65536)")
  ap.add_argument("--shapes", type=int, default=None,
                  help="distinct shapes of the shape loop (default 300, --small 20; 0: none)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--inner", type=int, default=50,
                  help="calls per repetition of the per-call rows (default 50)")
  ap.add_argument("--only", default=None, help="comma-separated entry points to time")
  ap.add_argument("--profile", action="store_true",
                  help="profile each timed jaxlp entry point at 4K elements (cProfile)")
  ap.add_argument("--with-jax-route", action="store_true",
                  help="also time the JAX route (the NumPy path off) of CPU calls")
  ap.add_argument("--stat", choices=tuple(STAT), default="median",
                  help="summary of the repetitions (default: median)")
  args = ap.parse_args()
  global _stat
  _stat = STAT[args.stat]
  if args.sizes:
    sizes = [int(v) for v in args.sizes.split(",")]
  else:
    sizes = [4096, 2**16] if args.small else [100, 4096, args.n]
  n_shapes = args.shapes if args.shapes is not None else (20 if args.small else 300)
  reps = 2 if args.small else args.reps
  small_n = 4096

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
  from jaxlp.torch import _cpu  # noqa: PLC0415
  print("# CPU path: " + ("NumPy with the C accelerator jaxlp.torch._cnoise"
                          if _cpu._cnoise is not None else
                          "NumPy only (jaxlp.torch._cnoise is not built)"))
  print(f"# formats: float E{EXP}M{MAN} (QPyTorch FloatingPoint), block wl={WL_BLOCK} "
        f"(one block), fixed wl={WL_FIXED} fl={FL_FIXED}; every time the {_stat.__name__} of "
        f"{reps} repetitions (per-call rows: each the mean of {args.inner} calls; large rows: of "
        "1 call, CUDA 10); speed-up = QPyTorch's time / jaxlp's")
  cuda = args.device == "cuda"
  with_jax = args.with_jax_route and not cuda
  jit_col = " via JITFunction.run |" if cuda else ""
  jax_col = " JAX route |" if with_jax else ""
  print(f"| entry point | rounding | elements | jaxlp.torch |{jit_col}{jax_col} QPyTorch | "
        "speed-up | goal |")
  print("|---|---|---|---|---|---|---|" + ("---|" if cuda or with_jax else ""))
  only = set(args.only.split(",")) if args.only else None
  if cuda and not torch.cuda.is_available():
    for n in sizes:
      for name in ("quantize", "float_quantize", "block_quantize", "fixed_point_quantize",
                   "quantizer", "Quantizer", "OptimLP step"):
        for r in ("nearest", "stochastic"):
          if only is None or name in only:
            print(f"| {name} | {r} | {n} | not measured | not measured | not measured | - | "
                  f"{_goal(n, 'cuda', args.small)} |")
    print("# not measured: torch.cuda.is_available() is False on this machine")
    return
  launchers = _launchers() if cuda else None
  dev = torch.device(args.device)
  sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
  for n in sizes:
    x = torch.randn(n, device=dev)
    # large CUDA tensors: 10 back-to-back calls per timing (one synchronisation, as in a
    # training step), so the sync latency does not pose as throughput
    inner = args.inner if n <= 65536 else (10 if dev.type == "cuda" else 1)
    per_call = n <= 65536 or dev.type == "cuda"
    unit, scale = ("us", 1e6) if per_call else ("ms", 1e3)
    tsgd = None
    for name, r, jf, qf in _cases(jt, qq, x):
      if only is not None and name not in only:
        continue
      if name == "OptimLP step" and tsgd is None:
        # OptimLP's own cost is its time over this row: the 4K goal is per call of the
        # bridge, and the wrapped torch step alone can take longer than 50 us on CUDA
        tsgd = _time(_sgd_step(x), reps, sync, inner)
        print(f"| torch.optim.SGD step alone (OptimLP's baseline) | - | {n} | "
              f"{tsgd * scale:.1f} {unit} |{' - |' if cuda or with_jax else ''} - | - | - |")
      tj, tq = _interleaved([jf, qf], reps, sync, inner)
      extra = ""
      if cuda:
        tjit = _time_with(launchers, jf, reps, sync, inner)
        extra = f" {tjit * 1e6:.1f} us |" if tjit is not None else " n/a |"
      if with_jax:
        with _jax_route():
          extra = f" {_time(jf, reps, sync, inner) * scale:.1f} {unit} |"
      goal = _goal(n, dev.type, args.small)
      if name == "OptimLP step" and n == small_n:
        goal = f"{goal}; <= 50 us over SGD: {(tj - tsgd) * 1e6:+.1f} us"
      q_s = f"{tq * scale:.1f} {unit}" if tq is not None else "n/a"
      ratio = f"{tq / tj:.2f}x" if tq is not None else "n/a"
      print(f"| {name} | {r} | {n} | {tj * scale:.1f} {unit} |{extra} {q_s} | {ratio} | "
            f"{goal} |")
  if n_shapes and dev.type == "cpu":
    _shape_loop(jt, qq, n_shapes, reps, only, with_jax)
  if args.profile:
    _profile(jt, torch.randn(small_n, device=dev), only, sync)
  large_n = max(sizes)
  x = torch.randn(large_n)
  trt = _time(lambda: jt.to_torch(jt.to_jax(x)), reps, lambda: None, 20)
  same = jt.to_torch(jt.to_jax(x)).data_ptr() == x.data_ptr()
  print(f"| DLPack round trip torch->jax->torch (CPU) | - | {large_n} | {trt * 1e6:.0f} us "
        f"(zero-copy={same}) | - | - | - |")


if __name__ == "__main__":
  main()
