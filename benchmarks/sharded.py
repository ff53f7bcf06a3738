"""Sharded (FSDP) training step over a throttled link: fp32 vs bf16 / int8 / int4 block wires.

Step time: the driver re-executes itself inside ``unshare -rn`` with ``tc tbf`` on ``lo``
(benchmarks/loopback.py's namespace and token bucket: the W workers share ONE link of the
given rate) and launches W processes that join one ``jax.distributed`` job on 127.0.0.1
(gloo, one CPU device each). Every process builds the ``jaxlp train --shard fsdp`` trainer
(:class:`jaxlp.training.Trainer`: the MLP on the built-in digits, ``--width``, W workers) for
each method and times its compiled training step -- all-gather of the parameters, forward and
backward on the worker's batch, reduce-scatter of the gradients, SGD with momentum on the
shard -- on real batches: one warm-up step (compile), then ``--steps`` timed steps; a step's
time is the slowest worker's (median and min over steps). "local ms" is the same step with
the W workers emulated in the driver process (named vmap: the collectives are in-memory
copies), divided by W: the compute + encode/decode share of a step, without the network.

Methods (``--grad-wire`` / ``--param-wire`` of ``jaxlp train``): ``fp32`` (the backend's
reduce-scatter and all-gather in float32), ``bf16``, ``int8-block``, ``int4-block`` (the
gradient reduce-scatter rounded once, all-to-all, float32 sum: ZeRO++'s qgZ; parameters
gathered exactly) and ``int4+int8`` (qgZ int4 blocks + the parameter all-gather in int8
blocks: qwZ). Block wires: sign-magnitude integers with one power-of-two scale per 64
values.

Memory: the bytes of the parameters + optimizer state each worker's device holds (measured on
its arrays), next to the replicated run's (the full parameters + momentum).

Accuracy (``--seeds``): the same runs trained to the end with W emulated workers in one
process (named vmap; the wires' rounding and float32 sums in rank order are the same bits as
over the network, the fp32 reduce-scatter adds in the order of that backend), final test
accuracy per seed, the mean and its gap to fp32.

Usage:
  python benchmarks/sharded.py [--rate 1gbit] [--workers 4] [--width 192] [--steps 5]
      [--methods fp32,bf16,int8-block,int4-block,int4+int8] [--seeds 0,1,2] [--epochs 10]
      [--accuracy-methods fp32,int4+int8] [--skip-timing] [--codec] [--smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
  sys.path.pop(0)
_ROOT = os.path.dirname(_HERE)

#: method -> (--grad-wire, --param-wire); None = fp32
METHODS = {
    "fp32": (None, None),
    "bf16": ("bf16", "bf16"),
    "int8-block": ("int8-block", None),
    "int4-block": ("int4-block", None),
    "int4+int8": ("int4-block", "int8-block"),
}
GOAL = ("int4+int8", 3.0)  # >= 3x the fp32 step
ACC_GAP = 0.005  # accuracy within 0.5 points of fp32 (mean over seeds)


def _loopback():
  spec = importlib.util.spec_from_file_location("_jaxlp_bench_loopback",
                                                os.path.join(_HERE, "loopback.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def config(name, a, workers, devices=None, seed=0, epochs=1):
  from jaxlp.training import TrainConfig
  gw, pw = METHODS[name]
  kw = {} if devices is None else {"devices": devices}
  return TrainConfig(model="mlp", width=a.width, nodes=workers, shard="fsdp", grad_wire=gw,
                     param_wire=pw, batch_size=a.batch_size, epochs=epochs, seed=seed,
                     quiet=True, max_steps_per_epoch=a.max_steps_per_epoch, **kw)


# ------------------------------------------------------------------------------------------
# worker (one process of the jax.distributed job)

def _device_bytes(tree):
  import jax
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      total += 8 * sum(int(s.data.size) for s in leaf.addressable_shards)
    else:
      total += sum(int(s.data.nbytes) for s in leaf.addressable_shards)
  return total


def _cpu_s():
  """CPU seconds of this process so far (user + system, every thread: XLA's and gloo's)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _time_method(name, a, w):
  """One method's trainer, its compiled step timed on real batches (this process's part)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxlp.training import Trainer

  t = Trainer(config(name, a, w))
  step = t._make_train_step(None)
  t._place_state()
  ds = t.ds
  perm = np.random.default_rng([0, 0]).permutation(len(ds.x_train))
  nb = len(perm) // a.batch_size

  def run(i, state):
    idx = perm[(i % nb) * a.batch_size:(i % nb + 1) * a.batch_size]
    key = jax.random.fold_in(t.step_key, i)
    out = step(*state, jnp.asarray(ds.x_train[idx]), jnp.asarray(ds.y_train[idx]), key)
    jax.block_until_ready(out)
    return out[:4], float(out[4])

  state = (t.params, t.batch_stats, t.opt_state, t.comp_state)
  t0 = time.perf_counter()
  state, _ = run(0, state)
  compile_s = time.perf_counter() - t0
  step_s, cpu_s, losses = [], [], []
  for i in range(1, a.steps + 1):
    t0, c0 = time.perf_counter(), _cpu_s()
    state, loss = run(i, state)
    step_s.append(time.perf_counter() - t0)
    cpu_s.append(_cpu_s() - c0)
    losses.append(loss)
  full = jax.jit(t._shard.full_params, out_shardings=NamedSharding(t._mesh, P()))(state[0])
  h = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(full):
    h.update(np.asarray(leaf.addressable_data(0)).tobytes())
  return {"step_s": step_s, "cpu_s": cpu_s, "compile_s": compile_s, "losses": losses,
          "hash": h.hexdigest(),
          "wire_bytes": t.wire_per_step, "n_params": t.n_params,
          "device_bytes": _device_bytes((state[0], state[2])),
          "replicated_bytes": t._shard.memory()["replicated_state_bytes_per_device"]}


def worker(port, w, pid, out_path, a):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  import jaxlp.parallel as jp

  if a.fast_compile:
    jax.config.update("jax_disable_most_optimizations", True)
  jp.initialize(f"127.0.0.1:{port}", num_processes=w, process_id=pid,
                initialization_timeout=120)
  assert jax.device_count() == w and jax.local_device_count() == 1, jax.devices()
  res = {"worker": pid, "W": w, "jax": jax.__version__, "methods": {}}
  for name in a.methods.split(","):
    res["methods"][name] = r = _time_method(name, a, w)
    with open(out_path, "w") as f:
      json.dump(res, f)
    print(f"[worker {pid}] {name}: compile+first step {r['compile_s']:.1f} s, step "
          f"{1e3 * min(r['step_s']):.1f} ms", file=sys.stderr, flush=True)
  jp.shutdown()


# ------------------------------------------------------------------------------------------
# inside the namespace: launch the W workers

def _worker_args(a):
  args = ["--methods", a.methods, "--width", str(a.width), "--batch-size", str(a.batch_size),
          "--steps", str(a.steps), "--timeout", str(a.timeout)]
  if a.fast_compile:
    args.append("--fast-compile")
  return args


def environment(a):
  lb = _loopback()
  w = a.env_workers
  port = lb._free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  env["JAX_PLATFORMS"] = "cpu"
  base = [sys.executable, os.path.abspath(__file__), *_worker_args(a)]
  procs = [subprocess.Popen(base + ["--_worker", str(port), str(w), str(i),
                                    os.path.join(a.env_out, f"worker{i}.json")], env=env,
                            stdout=sys.stderr) for i in range(w)]
  return lb.wait_workers(procs, w, a.timeout)


def run_env(rate, w, a, throttle):
  lb = _loopback()
  out = tempfile.mkdtemp(prefix="jaxlp_sharded_")
  inner = [sys.executable, os.path.abspath(__file__), "--_env", "--_env-out", out,
           "--_env-workers", str(w), *_worker_args(a)]
  if throttle:
    setup = "ip link set lo up"
    if lb.parse_rate(rate) is not None:
      setup += f" && tc qdisc add dev lo root tbf {lb.tbf_args(rate)}"
    cmd = ["unshare", "-rn", "sh", "-c", f"{setup} && exec {shlex.join(inner)}"]
  else:
    cmd = inner
  p = subprocess.run(cmd)
  results = []
  for i in range(w):
    path = os.path.join(out, f"worker{i}.json")
    if os.path.exists(path):
      with open(path) as f:
        results.append(json.load(f))
  shutil.rmtree(out, ignore_errors=True)
  return p.returncode, results


# ------------------------------------------------------------------------------------------
# driver

def step_rows(results, methods, w):
  """Per method: the slowest worker per step, median / min over steps, speedup vs fp32."""
  import numpy as np
  rows, base = [], None
  for name in methods:
    per = [r["methods"].get(name) for r in results]
    if len(per) < w or any(x is None for x in per):
      rows.append((name, None))
      continue
    step = np.max(np.array([x["step_s"] for x in per]), axis=0)
    med, mn = float(np.median(step)), float(np.min(step))
    if name == "fp32":
      base = med
    rows.append((name, dict(wire=per[0]["wire_bytes"], med=med, mn=mn, base=base,
                            same=len({x["hash"] for x in per}) == 1,
                            dev=max(x["device_bytes"] for x in per),
                            rep=per[0]["replicated_bytes"], n=per[0]["n_params"],
                            cpu=float(np.median(np.mean([x["cpu_s"] for x in per], axis=0))),
                            compile=max(x["compile_s"] for x in per))))
  return rows


def local_ms(a, methods, w):
  """Per method: the same step with the W workers emulated in this process (named vmap,
  collectives in memory), divided by W: the compute + encode/decode share of a step."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxlp.training import Trainer
  out = {}
  for name in methods:
    t = Trainer(config(name, a, w, devices=1))
    step = t._make_train_step(None)
    ds = t.ds
    idx = np.arange(a.batch_size)
    x, y = jnp.asarray(ds.x_train[idx]), jnp.asarray(ds.y_train[idx])
    state = (t.params, t.batch_stats, t.opt_state, t.comp_state)
    ts = []
    for i in range(a.steps + 1):
      t0 = time.perf_counter()
      res = jax.block_until_ready(step(*state, x, y, jax.random.fold_in(t.step_key, i)))
      ts.append(time.perf_counter() - t0)
      state = res[:4]
    out[name] = float(np.median(ts[1:])) / w
    print(f"# local {name}: {1e3 * out[name]:.1f} ms per worker", file=sys.stderr, flush=True)
  return out


def codec_ms(a, methods, w):
  """Per method: the hidden (8w x 8w) kernel's gradient reduce-scatter and its parameter
  all-gather alone, W workers emulated in this process (named vmap), ms per worker."""
  import jax
  import numpy as np
  from jax import lax

  import jaxlp.parallel as jp
  from jaxlp.training._sharded import parse_wire

  h = 8 * a.width
  g = jax.random.normal(jax.random.key(0), (w, h, h)) * 1e-2

  def best(f, x):
    f = jax.jit(jax.vmap(f, axis_name="w"))
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(max(a.steps, 2)):
      t0 = time.perf_counter()
      jax.block_until_ready(f(x))
      ts.append(time.perf_counter() - t0)
    return float(np.min(ts)) / w

  out = {}
  for name in methods:
    gw, pw = (parse_wire(v, "wire") for v in METHODS[name])
    if gw is None:
      rs = lambda x: lax.psum_scatter(x, "w", tiled=True)  # noqa: E731
    else:
      st = jp.init_sharded_state(gw, g[0])
      rs = lambda x, gw=gw, st=st: jp.compressed_reduce_scatter(x, st, "w", gw)[0]  # noqa: E731
    ag = lambda x, pw=pw: jp.all_gather(x, "w", fmt=pw)  # noqa: E731
    out[name] = (best(rs, g), best(ag, g[:, :h // w]))
    print(f"codec {name}: reduce-scatter {1e3 * out[name][0]:.1f} ms, all-gather "
          f"{1e3 * out[name][1]:.1f} ms per worker ({h}x{h} kernel, W={w} in one process)",
          flush=True)
  return out


def accuracy(a, methods, seeds, w):
  """Final test accuracy of every (method, seed): W emulated workers on one device."""
  from jaxlp.training import train
  acc = {}
  for name in methods:
    for s in seeds:
      t0 = time.perf_counter()
      hist = train(config(name, a, w, devices=1, seed=s, epochs=a.epochs))
      acc[(name, s)] = (hist[-1]["test_accuracy"], hist[-1]["train_loss"])
      print(f"# accuracy {name} seed {s}: {acc[(name, s)][0]:.4f}, train loss "
            f"{acc[(name, s)][1]:.5f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
            flush=True)
  return acc


def timing(a, methods, label, ok):
  """The timed job over the link and its table; returns (exit code, bad rows)."""
  t0 = time.perf_counter()
  rc, results = run_env(a.rate, a.workers, a, ok)
  print(f"# timed job: exit {rc}, wall {time.perf_counter() - t0:.0f} s", file=sys.stderr)
  rows = step_rows(results, methods, a.workers)
  local = local_ms(a, methods, a.workers) if a.local else {}
  print("| link | W | method | grad wire | param wire | wire MB/worker/step | local ms (no net) | "
        "step ms median | step ms min | speedup vs fp32 | params+opt state per device | "
        "replicated | identical on all workers |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  bad = 0
  for name, d in rows:
    gw, pw = METHODS[name]
    if d is None:
      print(f"| {label} | {a.workers} | {name} | {gw or 'fp32'} | {pw or 'fp32'} | - | - | "
            "(did not finish) | - | - | - | - | - |")
      bad = 1
      continue
    sp = f"{d['base'] / d['med']:.2f}x" if d["base"] else "-"
    loc = f"{1e3 * local[name]:.1f}" if name in local else "-"
    print(f"| {label} | {a.workers} | {name} | {gw or 'fp32'} | {pw or 'fp32'} | "
          f"{d['wire'] / 1e6:.3f} | {loc} | {1e3 * d['med']:.1f} | {1e3 * d['mn']:.1f} | {sp} | "
          f"{d['dev'] / 2**20:.2f} MiB ({d['dev'] / d['rep']:.3f}x) | "
          f"{d['rep'] / 2**20:.2f} MiB | {'yes' if d['same'] else 'NO'} |")
    bad = bad or not d["same"]
  rate = _loopback().parse_rate(a.rate) if ok else None
  for name, d in rows:
    if d is not None:  # where the step goes: CPU per process, and the link's share
      ms = 1e3 * 8 * a.workers * d["wire"] / rate if rate else 0.0
      link = f"; the W workers' wire bytes at {a.rate}: {ms:.1f} ms" if rate else ""
      print(f"cpu {name}: {1e3 * d['cpu']:.1f} ms per process per step (median over steps of "
            f"the mean over the {a.workers} processes){link}")
  goal = dict(rows).get(GOAL[0])
  if goal and goal["base"]:
    sp = goal["base"] / goal["med"]
    print(f"goal: {GOAL[0]} >= {GOAL[1]:.0f}x the fp32 sharded step: {sp:.2f}x -> "
          f"{'met' if sp >= GOAL[1] else 'not met'}")
  return rc, bad


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rate", default="1gbit", help="tc rate of the shared link (none: no qdisc)")
  ap.add_argument("--workers", type=int, default=4)
  ap.add_argument("--width", type=int, default=192,
                  help="MLP width (hidden units 8*width; 192: 2.47M parameters)")
  ap.add_argument("--batch-size", type=int, default=128, help="global batch")
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--seeds", default="0,1,2", help="accuracy seeds ('' to skip)")
  ap.add_argument("--epochs", type=int, default=10, help="epochs of the accuracy runs")
  ap.add_argument("--accuracy-methods", default="fp32,int4+int8")
  ap.add_argument("--skip-timing", action="store_true",
                  help="only the accuracy runs (no network job, no step table)")
  ap.add_argument("--codec", action="store_true",
                  help="also time each method's reduce-scatter and all-gather of the hidden "
                       "kernel alone, W workers in one process (no network)")
  ap.add_argument("--no-local", dest="local", action="store_false",
                  help="skip the no-network timing of each method (W workers in one process)")
  ap.add_argument("--max-steps-per-epoch", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the timed job")
  ap.add_argument("--fast-compile", action="store_true",
                  help="jax_disable_most_optimizations (quick compiles; slower steps)")
  ap.add_argument("--smoke", action="store_true",
                  help="width 4, W=2, 2 steps, fp32 and int4+int8, --codec, one 1-epoch "
                       "accuracy run")
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
    a.width, a.workers, a.steps, a.batch_size = 4, 2, 2, 32
    a.methods, a.accuracy_methods, a.seeds, a.epochs = "fp32,int4+int8", "int4+int8", "0", 1
    a.max_steps_per_epoch, a.fast_compile, a.codec = 2, True, True
  methods = [m for m in a.methods.split(",") if m]
  for m in methods + [m for m in a.accuracy_methods.split(",") if m]:
    if m not in METHODS:
      ap.error(f"unknown method {m!r}; choose from {','.join(METHODS)}")
  if "fp32" not in methods:
    methods = ["fp32"] + methods
  a.methods = ",".join(methods)
  lb = _loopback()
  lb.parse_rate(a.rate)
  ok, why = lb.netns_available()
  if not ok:
    msg = (f"!! WARNING: network namespaces / tc are NOT available here ({why}); the link is "
           "NOT throttled; the table says 'unthrottled'.")
    print(msg, file=sys.stderr)
    print(msg)
  throttled = ok and lb.parse_rate(a.rate) is not None
  label = a.rate if throttled else ("none (netns)" if ok else "unthrottled")
  load = os.getloadavg()
  print(f"# sharded (fsdp) step: mlp width {a.width} on digits, W={a.workers} processes, "
        f"global batch {a.batch_size}, steps={a.steps}, link {label} "
        f"(tc tbf on lo in unshare -rn: {'yes' if ok else 'NO'}); load average at start "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
  rc = bad = 0
  if not a.skip_timing:
    rc, bad = timing(a, methods, label, ok)
  if a.codec:
    codec_ms(a, methods, a.workers)
  seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
  acc_methods = [m for m in a.accuracy_methods.split(",") if m]
  if seeds and acc_methods:
    acc = accuracy(a, acc_methods, seeds, a.workers)
    print(f"\n# accuracy: {a.epochs} epochs, W={a.workers} emulated workers, final test accuracy "
          "(final train loss)")
    print("| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | gap vs fp32 |")
    print("|---|" + "---|" * len(seeds) + "---|---|")
    means = {m: sum(acc[(m, s)][0] for s in seeds) / len(seeds) for m in acc_methods}
    for m in acc_methods:
      gap = f"{100 * (means[m] - means['fp32']):+.2f} points" if "fp32" in means else "-"
      print(f"| {m} | " + " | ".join(f"{acc[(m, s)][0]:.4f} ({acc[(m, s)][1]:.5f})"
                                     for s in seeds) + f" | {means[m]:.4f} | {gap} |")
    if "fp32" in means and GOAL[0] in means:
      gap = means["fp32"] - means[GOAL[0]]
      print(f"goal: {GOAL[0]} within {100 * ACC_GAP:.1f} points of fp32 (mean of seeds): "
            f"{100 * gap:+.2f} points below -> {'met' if gap <= ACC_GAP else 'not met'}")
  return rc or bad


if __name__ == "__main__":
  sys.exit(main())
