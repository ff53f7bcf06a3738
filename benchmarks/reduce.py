"""jaxlp.parallel.psum variants (ring, chain, tree; packed, APS, Kahan) vs lax.psum, 8 CPU devices.

Usage: python benchmarks/reduce.py [--small] [--sizes 1000000 10000000] [--reps 3] [--json F]

Sets XLA_FLAGS itself (8 host devices) before importing jax, so run it as its own process.
Prints a markdown table: time per all-reduce (median of reps, after one compile+warm-up
run), time relative to lax.psum, and bytes each worker sends (exact payload accounting of
jaxlp.parallel.payload_bytes; lax.psum counted as a float32 ring all-reduce). Then times an
8-node emulated step on one device against 8 x the single-node step.
"""

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports (jax tries `compression.zstd`, for one).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import json
import os
import platform
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxlp.parallel as jp  # noqa: E402
from jaxlp import formats as F  # noqa: E402

VARIANTS = [  # name, psum kwargs (None = lax.psum)
    ("lax.psum f32", None),
    ("native E4M3", dict(fmt=F.E4M3, order="native")),
    ("ring E4M3 packed", dict(fmt=F.E4M3, order="ring")),
    ("ring E4M3 f32 wire", dict(fmt=F.E4M3, order="ring", pack=False)),
    ("ring E4M3 +APS", dict(fmt=F.E4M3, order="ring", aps=True)),
    ("ring E4M3 +Kahan", dict(fmt=F.E4M3, order="ring", kahan=True)),
    ("ring BF16 packed", dict(fmt=F.BF16, order="ring")),
    ("chain E4M3", dict(fmt=F.E4M3, order="chain")),
    ("tree E4M3", dict(fmt=F.E4M3, order="tree")),
]


def _time(f, *args, reps):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def bench_reduce(sizes, reps):
  mesh = jax.make_mesh((8,), ("dev",))
  rows = []
  for n in sizes:
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (8, n), jnp.float32) * 1e-3,
        NamedSharding(mesh, P("dev")))
    base = None
    for name, kw in VARIANTS:
      if kw is None:
        body = lambda v: lax.psum(v, "dev")  # noqa: E731
        sent = int(2 * 7 * (-(-n // 8)) * 4)
      else:
        body = lambda v, kw=kw: jp.psum(v, "dev", **kw)  # noqa: E731
        kw2 = {k: v for k, v in kw.items() if k in ("kahan", "aps", "pack")}
        sent = jp.payload_bytes(n, 8, kw["fmt"], kw["order"], **kw2)
      f = jax.jit(jax.shard_map(lambda v, body=body: body(v[0])[None], mesh=mesh,
                                in_specs=P("dev"), out_specs=P("dev"), check_vma=False))
      t = _time(f, x, reps=reps)
      base = t if base is None else base
      rows.append(dict(n=n, variant=name, ms=t * 1e3, rel=t / base, bytes_per_worker=sent))
      print(f"  n={n:>9} {name:<20} {t*1e3:9.2f} ms  x{t/base:5.2f}  {sent/1e6:8.3f} MB",
            file=sys.stderr, flush=True)
  return rows


def bench_emulation(reps, small):
  """8 emulated nodes on one device (vmap + low-precision ring) vs 8 x single-node step."""
  d, h, b = (256, 256, 64) if small else (1024, 1024, 256)
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  params = {"w1": jax.random.normal(k1, (d, h)) / np.sqrt(d),
            "w2": jax.random.normal(k2, (h, 10)) / np.sqrt(h)}
  xb = jax.random.normal(k3, (8 * b, d))
  yb = jnp.arange(8 * b) % 10

  def loss(p, x, y):
    logits = jnp.tanh(x @ p["w1"]) @ p["w2"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y])

  def node_step(p, batch):
    g = jax.grad(loss)(p, *batch)
    return jp.psum(g, "node", fmt=F.E4M3, order="ring", aps=True)

  emu = jax.jit(jp.emulate(node_step, 8, "node"))
  single = jax.jit(lambda p, batch: jax.grad(loss)(p, *batch))
  t_emu = _time(emu, params, (xb, yb), reps=reps)
  xs, ys = xb[:b], yb[:b]
  t_one = _time(single, params, (xs, ys), reps=reps)
  return dict(emulated_8_ms=t_emu * 1e3, single_ms=t_one * 1e3,
              ratio_vs_8x_single=t_emu / (8 * t_one), mlp=(d, h, b))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--sizes", type=int, nargs="*")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--json")
  a = ap.parse_args()
  sizes = a.sizes or ([1 << 14] if a.small else [1_000_000, 10_000_000])
  rows = bench_reduce(sizes, a.reps)
  emu = bench_emulation(a.reps, a.small)
  print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"jax {jax.__version__}, date {time.strftime('%Y-%m-%d')}")
  print("\n| elements | variant | time (ms) | x lax.psum | bytes sent / worker |")
  print("|---:|---|---:|---:|---:|")
  for r in rows:
    print(f"| {r['n']:,} | {r['variant']} | {r['ms']:.2f} | {r['rel']:.2f} | "
          f"{r['bytes_per_worker']:,} |")
  print(f"\n8-node emulation (MLP {emu['mlp']}, ring E4M3 + APS): {emu['emulated_8_ms']:.2f} ms "
        f"vs single-node step {emu['single_ms']:.2f} ms -> "
        f"{emu['ratio_vs_8x_single']:.2f} x (8 x single)")
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(dict(rows=rows, emulation=emu), fh, indent=1)


if __name__ == "__main__":
  main()
