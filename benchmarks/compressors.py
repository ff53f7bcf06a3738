"""Compressors' encode+decode throughput (against a copy) and wire bytes on real models' gradients.

For ResNet-18- and VGG-19-sized gradient sets (real layer shapes): each compressor's
encode+decode GB/s, its bytes on the wire against fp32 and bf16, and a bandwidth-model step
time (step = compute + wire_bytes/bandwidth; a MODEL, not a measured network).

Usage: python benchmarks/compressors.py [--small] [--model resnet18|vgg19|both] [--only a,b]
       [--repeats N] [--bucket-mb B] [--trace-top N]

Rows: a copy baseline (the same program with each leaf's encode+decode replaced by a
negation), then each compressor with its ratio to the copy (issue 14's GPU goal: >= 0.5x).
``--bucket-mb B`` encodes and decodes consecutive leaves fused into flat buckets of at most B
MB, as ``reduce_gradients(bucket_mb=B)`` does (fewer, larger kernels: on a GPU the per-leaf
program is launch-bound); PowerSGD stays per leaf (its fused buckets are square matrices).
``--trace-top N`` also traces each compressor's timed runs (``benchmarks/_trace.py``): its N
most expensive XLA ops and source lines, and the device time against the wall time per run.
``--no-command-buffers`` switches XLA:GPU's command buffers (CUDA graphs) off first, to see
what they are worth (on the H200 the bucketed sparsifiers' wall time was 5-6x their device
time under the profiler and 2-3x without it, 2026-11-27).
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
import numpy as np  # noqa: E402

import jaxlp.parallel.compressors as C  # noqa: E402
from jaxlp.parallel import compressed_wire_bytes  # noqa: E402
from jaxlp.parallel._compressed import _group_buckets  # noqa: E402


def resnet18_shapes():
  s = [(64, 3, 7, 7), (64,), (64,)]
  cin = 64
  for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
    for b in range(2):
      s += [(cout, cin if b == 0 else cout, 3, 3), (cout,), (cout,), (cout, cout, 3, 3), (cout,),
            (cout,)]
      if b == 0 and (stride != 1 or cin != cout):
        s += [(cout, cin, 1, 1), (cout,), (cout,)]
    cin = cout
  return s + [(1000, 512), (1000,)]


def small_shapes(shapes):
  """--small: the first two dimensions of each leaf divided by 8, one leaf of each shape."""
  return list(dict.fromkeys(tuple(max(1, d // 8) if i < 2 else d for i, d in enumerate(s))
                            for s in shapes))


def vgg19_shapes():
  cfg = [64, 64, 128, 128, 256, 256, 256, 256, 512, 512, 512, 512, 512, 512, 512, 512]
  s, cin = [], 3
  for c in cfg:
    s += [(c, cin, 3, 3), (c,)]
    cin = c
  return s + [(4096, 25088), (4096,), (4096, 4096), (4096,), (1000, 4096), (1000,)]


COMPRESSORS = {
    "bf16": C.cast("bf16"), "cgx4": C.cgx(4, 512), "cgx8": C.cgx(8, 512), "qsgd15": C.qsgd(15, 512),
    "onebit": C.onebit(), "tbq": C.tbq(0.01), "terngrad": C.terngrad(),
    "terngrad_hp2": C.terngrad("hipress", 2), "topk1%": C.topk(0.01),
    "randomk1%": C.randomk(0.01), "dgc1%": C.dgc(0.01, sample_rate=0.01),
    "graddrop99%": C.graddrop(0.99, sample_rate=0.01), "powersgd2": C.powersgd(2),
    # the same selections on the "radix" schedule (no candidate buffer, no conditional): an
    # A/B against the platform's schedule in one run, before it becomes a platform's default
    "topk1%_radix": C.topk(0.01, schedule="radix"),
    "dgc1%_radix": C.dgc(0.01, sample_rate=0.01, schedule="radix"),
    # PowerSGD as the engine runs it with bucket_mb (one square matrix per bucket, as
    # PyTorch's batched_powerSGD_hook); "powersgd2" is always per leaf
    "powersgd2_batched": C.powersgd(2, batched=True),
}


# issue 14 goals (encode+decode GB/s of fp32 gradient on the 2-core CPU) and the quiet-machine
# ResNet-18 numbers before the speed work (benchmarks/RESULTS.md, 2026-11-22)
GOAL_GBPS = {"quantizer": 2.0, "cast": 2.0, "sparse": 1.0, "lowrank": 1.0}
BEFORE_GBPS = {"bf16": 3.31, "cgx4": 0.24, "cgx8": 0.4, "qsgd15": 0.0616, "onebit": 1.04,
               "tbq": 1.73, "terngrad": 0.346, "terngrad_hp2": 0.268, "topk1%": 0.175,
               "dgc1%": 0.3, "graddrop99%": 0.322, "powersgd2": 0.76}


def buckets(shapes, bucket_mb):
  """Leaf numbers per bucket: one leaf each (``bucket_mb`` None), else consecutive leaves
  in buckets of at most ``bucket_mb`` MB of fp32, as the engine fuses them."""
  return _group_buckets(range(len(shapes)), [int(np.prod(s)) for s in shapes], bucket_mb)


def _fuse(gs, groups):
  """The gradients as one flat array per bucket (a bucket of one leaf keeps its shape)."""
  return [gs[g[0]] if len(g) == 1 else jnp.concatenate([gs[i].ravel() for i in g])
          for g in groups]


def _split(outs, groups, shapes):
  res = [None] * len(shapes)
  for o, g in zip(outs, groups, strict=True):
    if len(g) == 1:
      res[g[0]] = o
      continue
    offs = np.cumsum([0] + [int(np.prod(shapes[i])) for i in g])
    for j, i in enumerate(g):
      res[i] = o[offs[j]:offs[j + 1]].reshape(shapes[i])
  return res


def _trace_module():
  import importlib.util  # noqa: PLC0415

  spec = importlib.util.spec_from_file_location(
      "benchmark__trace", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trace.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _gradients(shapes):
  """Standard normal float32 gradients, one leaf per shape (numpy's generator: on the CPU,
  jax.random.normal compiled once per shape, about a second each)."""
  rng = np.random.default_rng(0)
  return [jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in shapes]


def bench(comp, shapes, repeats, bucket_mb=None, trace_top=0):
  key = jax.random.key(0)
  grads = _gradients(shapes)
  # PowerSGD's buckets are square matrices: "powersgd2_batched" (batched=True, as the engine
  # fuses them); the per-leaf PowerSGD stays per leaf
  per_leaf = comp.kind == "lowrank" and not comp.batched
  groups = buckets(shapes, None if per_leaf else bucket_mb)
  units = [shapes[g[0]] if len(g) == 1 else (sum(int(np.prod(shapes[i])) for i in g),)
           for g in groups]
  states = [comp.init(s, key=key) for s in units]

  @jax.jit
  def roundtrip(gs, sts):
    outs, new = [], []
    for i, (g, st) in enumerate(zip(_fuse(gs, groups), sts, strict=True)):
      if comp.kind == "lowrank" and comp.matrix_shape(g.shape) is None:
        # PowerSGD leaves it does not compress (vectors, small) travel as fp32 (wire_bytes
        # counts them so), as in compressed_allreduce
        outs.append(g)
        new.append(st)
        continue
      p, st = comp.encode(g, st, jax.random.fold_in(key, i))
      outs.append(comp.decode(p, g.shape))
      new.append(st)
    return _split(outs, groups, shapes), new

  if trace_top:  # one compile, whose optimized HLO names the traced ops
    roundtrip = roundtrip.lower(grads, states).compile()
  jax.block_until_ready(roundtrip(grads, states))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(roundtrip(grads, states))
    ts.append(time.perf_counter() - t0)
  if trace_top:
    T = _trace_module()

    def run():
      for _ in range(repeats):
        jax.block_until_ready(roundtrip(grads, states))

    T.report(run, roundtrip.as_text(), repeats, trace_top)
  n = sum(int(np.prod(s)) for s in shapes)
  wire = sum(comp.wire_bytes(s) for s in units)
  return 4 * n / min(ts) / 1e9, wire, n


def bench_copy(shapes, repeats, bucket_mb=None):
  """GB/s of the same per-leaf (or per-bucket) program with each encode+decode replaced by a
  negation (read 4 bytes, write 4 bytes per element: a copy's traffic, which XLA cannot
  elide): the copy bandwidth the GPU goal compares with, counted as the compressors are (4
  bytes of gradient per element)."""
  grads = _gradients(shapes)
  groups = buckets(shapes, bucket_mb)
  neg = jax.jit(lambda gs: _split([-g for g in _fuse(gs, groups)], groups, shapes))
  jax.block_until_ready(neg(grads))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(neg(grads))
    ts.append(time.perf_counter() - t0)
  return 4 * sum(int(np.prod(s)) for s in shapes) / min(ts) / 1e9


#: issue 14's GPU goal: every compressor's encode+decode >= this fraction of the copy row
GPU_GOAL_VS_COPY = 0.5


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--small", action="store_true",
                  help="scaled-down layers, one of each shape, 1 repeat")
  ap.add_argument("--model", default="both", choices=["resnet18", "vgg19", "both"])
  ap.add_argument("--only", default=None, help="comma-separated compressor names")
  ap.add_argument("--bandwidth-gbps", type=float, default=10.0)
  ap.add_argument("--workers", type=int, default=8)
  ap.add_argument("--compute-ms", type=float, default=50.0)
  ap.add_argument("--repeats", type=int, default=None,
                  help="timed runs per compressor (best of; default 3, 1 with --small)")
  ap.add_argument("--bucket-mb", type=float, default=None,
                  help="encode and decode consecutive leaves fused into buckets of at most this "
                       "many MB (the engine's bucket_mb; PowerSGD stays per leaf unless "
                       "batched: powersgd2_batched), the copy row likewise")
  ap.add_argument("--trace-top", type=int, default=0,
                  help="also trace each compressor's timed runs: its N most expensive XLA ops "
                       "and source lines (0: no trace)")
  ap.add_argument("--fc6", action="store_true",
                  help="also time randomk1%% on one VGG-19 fc6 leaf (4096 x 25088 = 102.8M)")
  ap.add_argument("--no-command-buffers", action="store_true",
                  help="switch XLA:GPU's command buffers (CUDA graphs) off (not the default "
                       "configuration's times; the header says so)")
  a = ap.parse_args(argv)
  if a.no_command_buffers:
    _trace_module().command_buffers_off()
  models = {"resnet18": resnet18_shapes(), "vgg19": vgg19_shapes()}
  if a.model != "both":
    models = {a.model: models[a.model]}
  names = a.only.split(",") if a.only else list(COMPRESSORS)
  unknown = [n for n in names if n not in COMPRESSORS]
  if unknown:
    ap.error(f"unknown compressor(s) {unknown}; choose from {list(COMPRESSORS)}")
  repeats = a.repeats if a.repeats is not None else (1 if a.small else 3)
  if repeats < 1:
    ap.error(f"--repeats={repeats} must be >= 1")
  if a.trace_top < 0:
    ap.error(f"--trace-top={a.trace_top} must be >= 0")
  if a.bucket_mb is not None and not a.bucket_mb > 0:
    ap.error(f"--bucket-mb={a.bucket_mb} must be > 0")
  unit = "leaf" if a.bucket_mb is None else f"bucket of <= {a.bucket_mb:g} MB"
  on_gpu = jax.default_backend() == "gpu"
  print(f"# device: {jax.devices()[0].device_kind}, jax {jax.__version__}"
        + (", XLA:GPU command buffers OFF" if a.no_command_buffers else ""))
  print("# goal: on this 2-core CPU, GB/s (dense >= 2, sparse and low-rank >= 1); on a GPU, "
        f"enc+dec >= {GPU_GOAL_VS_COPY:g}x the copy row (the same program, one negation per "
        f"{unit})")
  print("| model | compressor | enc+dec GB/s | vs copy | goal | before | verdict | wire MB | "
        "vs fp32 | vs bf16 | model step ms |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for mname, shapes in models.items():
    if a.small:
      shapes = small_shapes(shapes)
    n = sum(int(np.prod(s)) for s in shapes)
    bw = a.bandwidth_gbps * 1e9 / 8
    ring = 2 * (a.workers - 1) / a.workers
    fp32_ms = a.compute_ms + 1e3 * ring * 4 * n / bw
    copy = bench_copy(shapes, repeats, a.bucket_mb)
    print(f"| {mname} | copy (per {unit}) | {copy:.3g} | 1.00x | - | - | - | - | - | - | - |")
    print(f"| {mname} | fp32 | - | - | - | - | - | {4 * n / 1e6:.2f} | 1.00x | 0.50x | "
          f"{fp32_ms:.1f} |",
          flush=True)
    for name in names:
      gbps, wire, _ = bench(COMPRESSORS[name], shapes, repeats, a.bucket_mb, a.trace_top)
      # bytes each worker sends per step: the engine's own accounting (default filters:
      # small leaves and vectors in fp32; CGX scatter-reduce-allgather, sparsifiers'
      # all-gather, PowerSGD's fused P/Q sums, the bf16 ring)
      sent = compressed_wire_bytes([jax.ShapeDtypeStruct(s, np.float32) for s in shapes],
                                   COMPRESSORS[name], a.workers)
      step = a.compute_ms + 1e3 * sent / bw
      if on_gpu:
        goal = f"{GPU_GOAL_VS_COPY:g}x copy"
        met = gbps >= GPU_GOAL_VS_COPY * copy
      else:
        goal = f"{GOAL_GBPS[COMPRESSORS[name].kind]:g}"
        met = gbps >= GOAL_GBPS[COMPRESSORS[name].kind]
      before = BEFORE_GBPS.get(name) if mname == "resnet18" and not a.small else None
      verdict = "met" if met else "NOT met"
      print(f"| {mname} | {name} | {gbps:.3g} | {gbps / copy:.2f}x | {goal} | {before or '-'} | "
            f"{verdict} | "
            f"{wire / 1e6:.3f} | {4 * n / wire:.1f}x | "
            f"{2 * n / wire:.1f}x | {step:.1f} |", flush=True)
  if a.fc6:
    comp, shape = COMPRESSORS["randomk1%"], (4096, 25088)
    t0 = time.perf_counter()
    gbps, wire, n = bench(comp, [shape], repeats)
    print(f"| vgg19 fc6 leaf | randomk1% | {gbps:.3g} | - | {GOAL_GBPS[comp.kind]:g} | "
          f"not finished in 420 s | {'met' if gbps >= GOAL_GBPS[comp.kind] else 'NOT met'} | "
          f"{wire / 1e6:.3f} | {4 * n / wire:.1f}x | {2 * n / wire:.1f}x | - |")
    print(f"# fc6 row: {time.perf_counter() - t0:.1f} s wall including compile")


if __name__ == "__main__":
  main()
