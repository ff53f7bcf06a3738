"""Times the sparsifiers' selection on one bucket in each of its schedules (cpu, gpu, radix).

What it is for: choosing each platform's default selection schedule (``per_platform``) and
profiling the sparsifiers' part of the compressors' GPU goal, one bucket at a time.

Usage: python benchmarks/tools/sparse_select.py [--small] [--sizes N,N] [--repeats R]
       [--schedules platform,cpu,gpu,radix]

``select_sparse`` (top-k, DGC, GradDrop) and ``feistel_sample`` (RandomK) have two schedules
of the same arithmetic (``jaxlp/parallel/compressors/_base.py``): "cpu" (a bisection loop
and conditionals, binary searches as loops) and "gpu" (a sort of the candidates, no loop,
unrolled searches). ``select_sparse`` has a third, "radix" (no candidate buffer: the k-th
largest key in eight counting passes over the bucket, no conditional at all; not a
platform's default until it is measured faster on a GPU; no RandomK row). A program picks
by the platform it is compiled for ("platform"); this
benchmark forces each one on the current device, so one run shows what the choice is worth
there. Each row is one jitted round trip of one flat float32 bucket of N elements (encode
and decode, as the engine's fused buckets run them), best of R, with:

* ``copy``: the same program shape with the round trip replaced by a negation;
* ``full top_k``: ``lax.top_k`` over all N elements (the fallback, and what the compaction
  path replaces).

GB/s is of the float32 bucket (4N bytes); "vs copy" against the copy row of the same size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# keep this script's folder off sys.path: no script name may shadow a module a dependency imports
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
  sys.path.pop(0)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxlp.parallel.compressors._base import (  # noqa: E402
  _select_full,
  sample_threshold,
  select_sparse,
  sparse_capacity,
  sparse_decode,
)
from jaxlp.parallel.compressors._sparse import feistel_sample  # noqa: E402

SCHEDULES = {"platform": None, "cpu": "cpu", "gpu": "gpu", "radix": "radix"}
RATIO = 0.01  # top-k 1%, DGC 1%, GradDrop 99% dropped, RandomK 1%
SAMPLE_RATE = 0.01  # DGC's and GradDrop's default


def cases(n, impl):
  """``{name: fn(x, key) -> decoded float32[n]}`` for one schedule."""
  k = sparse_capacity(n, RATIO)

  def topk(x, key):
    del key
    return sparse_decode(select_sparse(x, None, -1.0, k, impl=impl)[0], n)

  def sampled(x, key):  # DGC and GradDrop: a sampled threshold, then the selection
    thr = sample_threshold(jnp.abs(x), key, RATIO, SAMPLE_RATE)
    return sparse_decode(select_sparse(x, None, thr, k, impl=impl)[0], n)

  def randomk(x, key):  # RandomK's encode (the values at the seed's indices) and decode
    seed = jax.random.bits(key, (2,), jnp.uint32)
    val = x[feistel_sample(seed, n, k, impl=impl)]
    return sparse_decode({"idx": feistel_sample(seed, n, k, impl=impl), "val": val}, n)

  out = {"topk1%": topk, "dgc1%/graddrop99%": sampled}
  if impl != "radix":  # a schedule of select_sparse only
    out["randomk1%"] = randomk
  return out


def baselines(n):
  k = sparse_capacity(n, RATIO)

  def full(x, key):
    del key
    idx = _select_full(x, jnp.abs(x), -1.0, k, None)
    return sparse_decode({"idx": idx, "val": x[jnp.minimum(idx, n - 1)]}, n)

  return {"copy": lambda x, key: -x, "full top_k": full}


def best_of(fns, args, repeats):
  """``{name: best time}`` of ``fns`` (``{name: jitted fn}``), compiled first and then run in
  turn, ``repeats`` rounds: a drift of the machine's speed affects every row alike."""
  for fn in fns.values():
    jax.block_until_ready(fn(*args))
  best = dict.fromkeys(fns, float("inf"))
  for _ in range(repeats):
    for name, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[name] = min(best[name], time.perf_counter() - t)
  return best


def run(sizes, repeats, schedules, out=print):
  """Per size: the baselines, then each case in every schedule (the schedules of one case run
  in turn, with the copy, and print as soon as they are timed: a run stopped at a time limit
  keeps the cases it finished)."""
  dev = jax.devices()[0]
  out(f"# device: {dev.platform} ({dev.device_kind}), jax {jax.__version__}; best of {repeats}, "
      "the rows of one case run in turn with the copy")
  out("| n | case | schedule | ms | GB/s | vs copy | vs cpu schedule |")
  out("|---|---|---|---|---|---|---|")
  rows = []
  for n in sizes:
    x = jax.random.normal(jax.random.key(n), (n,), jnp.float32)
    key = jax.random.key(1)
    base = baselines(n)
    copy_fn = jax.jit(base.pop("copy"))
    groups = [{("copy", "-"): copy_fn, ("full top_k", "-"): jax.jit(base.pop("full top_k"))}]
    per_sched = {sched: cases(n, SCHEDULES[sched]) for sched in schedules}
    names = dict.fromkeys(name for sched in schedules for name in per_sched[sched])
    for name in names:
      group = {("copy", "-"): copy_fn}
      group.update({(name, sched): jax.jit(per_sched[sched][name]) for sched in schedules
                    if name in per_sched[sched]})
      groups.append(group)
    for i, group in enumerate(groups):
      times = best_of(group, (x, key), repeats)
      copy = times[("copy", "-")]
      for (name, sched), t in times.items():
        if name == "copy" and i:
          continue  # timed again with each case for its ratio; printed once
        cpu_t = times.get((name, "cpu"))
        vs_cpu = f"{cpu_t / t:.2f}x" if cpu_t and sched not in ("-", "cpu") else "-"
        rows.append((n, name, sched, t, vs_cpu))
        out(f"| {n} | {name} | {sched} | {t * 1e3:.3f} | {4 * n / t / 1e9:.3g} | "
            f"{copy / t:.2f}x | {vs_cpu} |")
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--small", action="store_true", help="one small bucket (2**16), 2 repeats")
  ap.add_argument("--sizes", default="1048576,6553600",
                  help="comma-separated bucket sizes in elements (default: 4 MB and 25 MB)")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--schedules", default="platform,cpu,gpu,radix",
                  help=f"comma-separated, of {', '.join(SCHEDULES)}")
  a = ap.parse_args(argv)
  try:
    sizes = [65536] if a.small else [int(s) for s in a.sizes.split(",")]
  except ValueError:
    ap.error(f"--sizes {a.sizes!r}: expected comma-separated integers")
  if any(s < 1 for s in sizes):
    ap.error(f"--sizes {a.sizes!r}: every size must be >= 1")
  if a.repeats < 1:
    ap.error(f"--repeats {a.repeats}: must be >= 1")
  schedules = a.schedules.split(",")
  bad = [s for s in schedules if s not in SCHEDULES]
  if bad or len(set(schedules)) != len(schedules):
    ap.error(f"--schedules {a.schedules!r}: each once, of {list(SCHEDULES)}")
  run(sizes, 2 if a.small else a.repeats, schedules)


if __name__ == "__main__":
  main()
