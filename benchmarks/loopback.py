"""Measured loopback experiment: compressed vs fp32 gradient all-reduce over a throttled link.

For every ``--rates`` entry the driver re-executes itself inside ``unshare -rn`` (a fresh user +
network namespace in which only the loopback device exists), brings ``lo`` up, attaches a token
bucket (``tc qdisc add dev lo root tbf rate R burst B latency 100ms``) and launches W worker
processes there. The workers join one ``jax.distributed`` job on ``127.0.0.1`` (gloo CPU
collectives, ONE CPU device each), build a 1-D mesh over the W devices and time a jitted
``jax.shard_map`` step that reduces a gradient pytree (ResNet-18's real layer shapes, fp32
random, different on every worker):

* ``fp32``: the baseline -- the gradient leaves fused into buckets of ``--bucket-mb`` MB (as
  PyTorch DDP does), ``lax.psum`` (gloo's all-reduce) and a division by W;
* every other method: :func:`jaxlp.parallel.compressed_allreduce` with the same
  ``bucket_mb`` (default filters: leaves under 1024 elements and vectors go in fp32), the
  compression state carried from step to step.

There is NO synthetic compute in the step: the step is the reduction only, so "speedup" is the
speedup of the gradient exchange itself (with compute C added to both, the gain of a method
shrinks to (fp32 + C) / (method + C)).

Timing: one warm-up step (compile), then ``--steps`` timed steps; a step's time is the slowest
worker's; the table shows the median and min over steps. "local ms" is the same reduction with
NO network: ``compressed_allreduce`` (or the fp32 psum) run for all W workers inside one
process under ``jax.vmap(axis_name=..., axis_size=W)`` (collectives become in-memory copies),
divided by W, with all W processes doing it at the same time (the same CPU sharing as in the
steps): the encode/decode + local arithmetic share of a step.

Throttling notes: tbf on ``lo`` throttles the AGGREGATE of all loopback traffic of the
namespace -- every worker's sends share ONE link of rate R (a shared bus / one switch port, not
W full-duplex NICs). ``burst`` = max(10 ms of line rate, 128 KiB): at least rate/HZ for any
kernel HZ >= 100, and at least twice loopback's 64 KiB MTU so that no full-size packet is ever
dropped for exceeding the bucket. ``latency 100ms`` bounds the queue (excess is dropped; TCP
backs off). Rate ``none`` runs in a fresh namespace without a qdisc. Where ``unshare``/``tc``
do not work the driver says so on stderr and in the table ("unthrottled") and runs every rate
unthrottled in the current namespace, once.

Usage:
  python benchmarks/loopback.py [--rates 100mbit,1gbit,none] [--workers 2,4]
      [--model resnet18|small|tiny] [--methods fp32,bf16,cgx4,onebit,powersgd2,topk1%]
      [--steps N] [--smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# keep this script's folder off sys.path: no script name may shadow a module a dependency imports
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
  sys.path.pop(0)
_ROOT = os.path.dirname(_HERE)

METHODS = ("fp32", "bf16", "cgx4", "onebit", "powersgd2", "topk1%")


def _compressor(name):
  import jaxlp.parallel.compressors as C
  table = {
      "bf16": lambda: C.cast("bf16"), "fp16": lambda: C.cast("fp16"),
      "cgx4": lambda: C.cgx(4, 512), "cgx8": lambda: C.cgx(8, 512),
      "qsgd15": lambda: C.qsgd(15, 512), "onebit": lambda: C.onebit(), "tbq": lambda: C.tbq(0.01),
      "terngrad": lambda: C.terngrad(), "powersgd1": lambda: C.powersgd(1),
      "powersgd2": lambda: C.powersgd(2), "powersgd4": lambda: C.powersgd(4),
      "topk1%": lambda: C.topk(0.01), "randomk1%": lambda: C.randomk(0.01),
      "dgc1%": lambda: C.dgc(0.01, sample_rate=0.01),
  }
  if name == "fp32":
    return None
  if name not in table:
    raise ValueError(f"{name=} unknown; choose from fp32,{','.join(table)}")
  return table[name]()


def shapes_for(model):
  """Gradient leaf shapes: ResNet-18's real layers, scaled down for small/tiny."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("_jaxlp_bench_compressors",
                                                os.path.join(_HERE, "compressors.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  s = mod.resnet18_shapes()
  if model == "resnet18":
    return s
  if model == "small":
    return [tuple(max(1, d // 8) if i < 2 else d for i, d in enumerate(t)) for t in s]
  if model == "tiny":
    return [(64, 32, 3, 3), (64,), (64,), (128, 64, 1, 1), (128,), (100, 128), (100,)]
  raise ValueError(f"{model=} must be resnet18, small or tiny")


def _numel(s):
  n = 1
  for d in s:
    n *= int(d)
  return n


def wire_bytes_per_worker(name, shapes, bucket_mb, min_size=1024):
  """Payload bytes one worker puts into the reduction (``wire_bytes`` of its encodings; 4
  B/element in fp32). What it SENDS through the collectives at W workers is
  :func:`jaxlp.parallel.compressed_wire_bytes` (``sent_bytes`` in the worker's JSON)."""
  comp = _compressor(name)
  if comp is None:
    return 4 * sum(_numel(s) for s in shapes)
  total, todo = 0, []
  for s in shapes:
    ok = _numel(s) >= min_size and len(s) > 1 and comp.aggregation.compresses(comp, s)
    if ok:
      todo.append(s)
    else:
      total += 4 * _numel(s)
  if not comp.elementwise_state or not bucket_mb:  # PowerSGD: one payload per matrix
    return total + sum(comp.wire_bytes(s) for s in todo)
  limit = int(bucket_mb * 2 ** 20) // 4
  size = 0
  for s in todo:
    n = _numel(s)
    if size and size + n > limit:
      total += comp.wire_bytes((size,))
      size = 0
    size += n
  return total + (comp.wire_bytes((size,)) if size else 0)


# ------------------------------------------------------------------------------------------
# worker

def _reduce_fn(name, w, bucket_mb):
  import jax
  import jax.numpy as jnp
  from jax import lax

  from jaxlp.parallel import compressed_allreduce
  comp = _compressor(name)

  def fp32(grads, state):
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    limit = int(bucket_mb * 2 ** 20) // 4 if bucket_mb else None
    groups, cur, size = [], [], 0
    for i, g in enumerate(leaves):
      if cur and limit and size + g.size > limit:
        groups.append(cur)
        cur, size = [], 0
      cur.append(i)
      size += g.size
    groups.append(cur)
    out = [None] * len(leaves)
    for grp in groups:
      x = jnp.concatenate([jnp.ravel(leaves[i]) for i in grp])
      r = lax.psum(x, "dev") / w
      off = 0
      for i in grp:
        out[i] = r[off:off + leaves[i].size].reshape(leaves[i].shape)
        off += leaves[i].size
    return treedef.unflatten(out), state

  def compressed(grads, state):
    return compressed_allreduce(grads, state, "dev", comp, bucket_mb=bucket_mb)

  return (fp32 if comp is None else compressed), comp


def _timed(fn, args, reps):
  import jax
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return ts


def worker(port, w, pid, out_path, a):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxlp.parallel as jp
  from jaxlp.parallel import compressed_wire_bytes, init_compression_state

  if a.fast_compile:
    jax.config.update("jax_disable_most_optimizations", True)
  jp.initialize(f"127.0.0.1:{port}", num_processes=w, process_id=pid,
                initialization_timeout=120)
  assert jax.device_count() == w and jax.local_device_count() == 1, jax.devices()
  mesh = jax.make_mesh((w,), ("dev",))
  shard = NamedSharding(mesh, P("dev"))
  shapes = shapes_for(a.model)
  rng = np.random.default_rng(1234 + pid)
  local = [(rng.standard_normal(s, dtype=np.float32) * 1e-2) for s in shapes]
  to_global = lambda t: jax.tree_util.tree_map(  # noqa: E731
      lambda x: jax.make_array_from_process_local_data(shard, np.asarray(x)[None]), t)
  grads = to_global(local)
  # W virtual workers for the no-network ("local") timing: this worker's gradients, scaled
  stacked = [jnp.asarray(np.stack([x * np.float32(j + 1) for j in range(w)])) for x in local]
  res = {"worker": pid, "W": w, "jax": jax.__version__, "n": int(sum(x.size for x in local)),
         "methods": {}}
  for name in a.methods.split(","):
    fn, comp = _reduce_fn(name, w, a.bucket_mb)
    st0 = jnp.zeros((), jnp.float32) if comp is None else init_compression_state(comp, shapes_sd(
        shapes))

    def sm(g, s, fn=fn):
      g = jax.tree_util.tree_map(lambda x: x[0], g)
      s = jax.tree_util.tree_map(lambda x: x[0], s)
      o, s = fn(g, s)
      return jax.tree_util.tree_map(lambda x: x[None], (o, s))

    step = jax.jit(jax.shard_map(sm, mesh=mesh, in_specs=(P("dev"), P("dev")),
                                 out_specs=P("dev"), check_vma=False))
    state = to_global(st0)
    t0 = time.perf_counter()
    out, state = jax.block_until_ready(step(grads, state))
    compile_s = time.perf_counter() - t0
    step_s = []
    for _ in range(a.steps):
      t0 = time.perf_counter()
      out, state = jax.block_until_ready(step(grads, state))
      step_s.append(time.perf_counter() - t0)
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(out):
      h.update(np.asarray(leaf.addressable_shards[0].data).tobytes())
    # no-network share: all W workers in this process (vmap), same ops, collectives in memory
    vst = jax.tree_util.tree_map(lambda x: jnp.stack([x] * w), st0)
    loc = jax.jit(jax.vmap(fn, axis_name="dev", axis_size=w))
    jax.block_until_ready(loc(stacked, vst))
    local_s = [t / w for t in _timed(loc, (stacked, vst), max(2, a.steps))]
    res["methods"][name] = {
        "step_s": step_s, "compile_s": compile_s, "local_s": local_s, "hash": h.hexdigest(),
        "wire_bytes": wire_bytes_per_worker(name, shapes, a.bucket_mb),
        "sent_bytes": (None if comp is None else compressed_wire_bytes(
            shapes_sd(shapes), comp, w, bucket_mb=a.bucket_mb))}
    with open(out_path, "w") as f:
      json.dump(res, f)
    print(f"[worker {pid}] {name}: compile+first step {compile_s:.1f} s, step "
          f"{1e3 * min(step_s):.1f} ms, local {1e3 * min(local_s):.1f} ms", file=sys.stderr,
          flush=True)
    del out, state, loc, step
  jp.shutdown()


def shapes_sd(shapes):
  import jax
  import jax.numpy as jnp
  return [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]


# ------------------------------------------------------------------------------------------
# environment (inside the namespace): launch W workers

def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def environment(a):
  w = a.env_workers
  port = _free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  env["JAX_PLATFORMS"] = "cpu"
  args = [sys.executable, os.path.abspath(__file__), "--methods", a.methods, "--model", a.model,
          "--steps", str(a.steps), "--bucket-mb", str(a.bucket_mb)]
  if a.fast_compile:
    args.append("--fast-compile")
  procs = [subprocess.Popen(args + ["--_worker", str(port), str(w), str(i),
                                    os.path.join(a.env_out, f"worker{i}.json")], env=env,
                            stdout=sys.stderr)  # gloo's chatter stays out of the table
           for i in range(w)]
  return wait_workers(procs, w, a.timeout)


def wait_workers(procs, w: int, timeout: float) -> int:
  """Wait for the W worker processes (at most ``timeout`` s in all): the first non-zero exit
  status, 124 on a timeout; the workers are killed if this process is interrupted or
  terminated (SIGTERM) or the time runs out. Shared with benchmarks/sharded.py."""
  deadline = time.time() + timeout

  def _term(signum, frame):
    raise SystemExit(143)
  signal.signal(signal.SIGTERM, _term)  # so that `finally` kills the workers
  rc = 0
  try:
    for p in procs:
      p.wait(timeout=max(1, deadline - time.time()))
      rc = rc or p.returncode
  except subprocess.TimeoutExpired:
    print(f"!! W={w}: workers timed out after {timeout} s", file=sys.stderr)
    rc = 124
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return rc


# ------------------------------------------------------------------------------------------
# driver

def parse_rate(r):
  """'100mbit' -> bits/s (tc units: kbit, mbit, gbit); 'none' -> None."""
  r = r.strip().lower()
  if r in ("none", "unthrottled", ""):
    return None
  for suf, mul in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
    if r.endswith(suf):
      return float(r[:-len(suf)]) * mul
  raise ValueError(f"rate={r!r} must look like 100mbit, 1gbit or none")


def tbf_args(rate):
  burst = max(int(parse_rate(rate) / 8 / 100), 131072)
  return f"rate {rate} burst {burst} latency 100ms"


def netns_available():
  """True when an unprivileged/rooted ``unshare -rn`` + ``tc tbf`` on lo works here."""
  if not (shutil.which("unshare") and shutil.which("tc") and shutil.which("ip")):
    return False, "unshare/tc/ip not found"
  cmd = f"ip link set lo up && tc qdisc add dev lo root tbf {tbf_args('1gbit')}"
  try:
    p = subprocess.run(["unshare", "-rn", "sh", "-c", cmd], capture_output=True, text=True,
                       timeout=30)
  except (OSError, subprocess.TimeoutExpired) as e:
    return False, str(e)
  return p.returncode == 0, (p.stderr.strip() or f"rc={p.returncode}")


def run_env(rate, w, a, throttle):
  out = tempfile.mkdtemp(prefix="jaxlp_loopback_")
  inner = [sys.executable, os.path.abspath(__file__), "--_env", "--_env-out", out,
           "--_env-workers", str(w), "--methods", a.methods, "--model", a.model,
           "--steps", str(a.steps), "--bucket-mb", str(a.bucket_mb), "--timeout", str(a.timeout)]
  if a.fast_compile:
    inner.append("--fast-compile")
  if throttle:
    setup = "ip link set lo up"
    if parse_rate(rate) is not None:
      setup += f" && tc qdisc add dev lo root tbf {tbf_args(rate)}"
    cmd = ["unshare", "-rn", "sh", "-c", f"{setup} && exec {shlex.join(inner)}"]
  else:
    cmd = inner
  t0 = time.perf_counter()
  p = subprocess.run(cmd)
  wall = time.perf_counter() - t0
  results = []
  for i in range(w):
    path = os.path.join(out, f"worker{i}.json")
    if os.path.exists(path):
      with open(path) as f:
        results.append(json.load(f))
  shutil.rmtree(out, ignore_errors=True)
  return p.returncode, results, wall


def summarize(label, w, results, methods):
  """Rows for one (rate, W): per method the slowest worker per step, median/min over steps."""
  import numpy as np
  rows = []
  base = None
  for name in methods:
    per = [r["methods"].get(name) for r in results]
    if len(per) < w or any(x is None for x in per):
      rows.append((label, w, name, None))
      continue
    step = np.max(np.array([x["step_s"] for x in per]), axis=0)
    local = np.median(np.max(np.array([x["local_s"] for x in per]), axis=0))
    med, mn = float(np.median(step)), float(np.min(step))
    if name == "fp32":
      base = med
    same = len({x["hash"] for x in per}) == 1
    rows.append((label, w, name, dict(wire=per[0]["wire_bytes"], local=float(local), med=med,
                                      mn=mn, same=same, base=base)))
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rates", default="100mbit,1gbit,none")
  ap.add_argument("--workers", default="2")
  ap.add_argument("--model", default="resnet18", choices=["resnet18", "small", "tiny"])
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--bucket-mb", type=float, default=25.0)
  ap.add_argument("--timeout", type=float, default=900.0, help="seconds per (rate, W) run")
  ap.add_argument("--fast-compile", action="store_true",
                  help="jax_disable_most_optimizations (quick compiles; slower steps)")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny gradient set, W=2, 2 steps, one 1gbit (or unthrottled) run")
  ap.add_argument("--_worker", nargs=4, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--_env", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--_env-out", dest="env_out", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--_env-workers", dest="env_workers", type=int, default=2,
                  help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a._worker:
    port, w, pid, out = a._worker
    return worker(port, int(w), int(pid), out, a)
  if a._env:
    return environment(a)
  if a.smoke:
    a.model, a.workers, a.steps, a.rates = "tiny", "2", 2, "1gbit"
    a.fast_compile = True
  methods = a.methods.split(",")
  for m in methods:
    _compressor(m)
  if "fp32" not in methods:
    methods = ["fp32"] + methods
    a.methods = ",".join(methods)
  rates = [r.strip() for r in a.rates.split(",") if r.strip()]
  for r in rates:
    parse_rate(r)
  ok, why = netns_available()
  if not ok:
    msg = (f"!! WARNING: network namespaces / tc are NOT available here ({why}); the link is "
           "NOT throttled. Running ONE unthrottled configuration instead of "
           f"{','.join(rates)}; the table says 'unthrottled'.")
    print(msg, file=sys.stderr)
    print(msg)
    rates = ["unthrottled"]
  shapes = shapes_for(a.model)
  n = sum(_numel(s) for s in shapes)
  print(f"# loopback experiment: model={a.model} ({len(shapes)} leaves, {n} params, "
        f"{4 * n / 1e6:.1f} MB fp32), steps={a.steps}, bucket_mb={a.bucket_mb}, "
        f"throttle={'tc tbf on lo in unshare -rn' if ok else 'NONE'}")
  all_rows, rc_all = [], 0
  for w in [int(x) for x in a.workers.split(",")]:
    for rate in rates:
      label = rate if (ok and parse_rate(rate) is not None) else (
          "none (netns)" if ok else "unthrottled")
      print(f"# running rate={label} W={w} ...", file=sys.stderr, flush=True)
      rc, results, wall = run_env(rate, w, a, ok)
      if rc != 0:
        print(f"!! rate={label} W={w}: exit code {rc}", file=sys.stderr)
        rc_all = rc_all or rc
      if results:
        print(f"# rate={label} W={w}: jax {results[0]['jax']}, wall {wall:.0f} s",
              file=sys.stderr)
      all_rows += summarize(label, w, results, methods)
  print("| rate | W | method | wire MB/worker | local ms (no net) | step ms median | "
        "step ms min | speedup vs fp32 | identical on all workers |")
  print("|---|---|---|---|---|---|---|---|---|")
  bad = []
  for label, w, name, d in all_rows:
    if d is None:
      print(f"| {label} | {w} | {name} | - | - | (did not finish) | - | - | - |")
      rc_all = rc_all or 1
      continue
    sp = f"{d['base'] / d['med']:.2f}x" if d["base"] else "-"
    print(f"| {label} | {w} | {name} | {d['wire'] / 1e6:.3f} | {1e3 * d['local']:.1f} | "
          f"{1e3 * d['med']:.1f} | {1e3 * d['mn']:.1f} | {sp} | {'yes' if d['same'] else 'NO'} |")
    if not d["same"] and name != "fp32":
      bad.append((label, w, name))
  if bad:
    print(f"!! compressed results differ between workers: {bad}", file=sys.stderr)
    rc_all = rc_all or 2
  return rc_all


if __name__ == "__main__":
  sys.exit(main())
