"""CPU throughput of jaxlp quantize vs ml_dtypes casts, QPyTorch float_quantize and np.copyto.

Usage: python benchmarks/quantize.py [--small] [--repeats R]

Bytes counted = read + write (8 bytes per float32 element). Median of R timed repeats after
one warm-up call; jaxlp calls are jitted and end with block_until_ready. XLA:CPU already
splits the elementwise loop over the host's cores (``outer_dimension_partitions`` in the
compiled HLO); "in place (donated)" rows reuse the input buffer (``donate_argnums``), as a
training step does for its own buffers, and so avoid the page faults of a fresh output.
"""

from __future__ import annotations

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports (jax tries `compression.zstd`, for one).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import datetime
import platform
import statistics
import time

import numpy as np


def _time(fn, repeats):
  fn()  # warm-up / compile
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--small", action="store_true", help="1M elements (CI smoke)")
  ap.add_argument("--repeats", type=int, default=None)
  args = ap.parse_args(argv)
  n = (1 << 20) if args.small else (1 << 24)
  repeats = args.repeats or (3 if args.small else 7)

  import jax
  import jax.numpy as jnp
  import ml_dtypes

  from jaxlp import formats as F

  rng = np.random.default_rng(0)
  x_np = rng.standard_normal(n, dtype=np.float32)
  x = jnp.asarray(x_np)
  key = jax.random.key(0)
  rows = []  # (name, seconds)

  out = np.empty_like(x_np)
  rows.append(("numpy copyto (bandwidth ceiling)", _time(lambda: np.copyto(out, x_np), repeats)))
  # Out-of-place ops get a fresh 64 MiB output buffer per call (page faults on first touch):
  # these two rows are the ceiling for any out-of-place numpy / jitted XLA elementwise op.
  rows.append(("numpy copy, fresh output buffer", _time(lambda: x_np.copy(), repeats)))
  neg = jax.jit(lambda v: -v)
  rows.append(("XLA jit negate, fresh output buffer",
               _time(lambda: neg(x).block_until_ready(), repeats)))

  for fmt in (F.E4M3, F.BF16):
    for mode in ("nearest", "stochastic"):
      def q(v, k, fmt=fmt, mode=mode):
        return F.quantize(v, fmt, mode, key=k if mode == "stochastic" else None)
      f = jax.jit(q)
      rows.append((f"jaxlp {fmt.name} {mode}",
                   _time(lambda f=f: f(x, key).block_until_ready(), repeats)))
      # In place: the input buffer is donated and the output fed back as the next input
      # (same work per call: the rounding is branch-free, so its cost is data-independent).
      fd = jax.jit(q, donate_argnums=0)
      buf = [jnp.array(x)]

      def step(fd=fd, buf=buf):
        buf[0] = fd(buf[0], key)
        buf[0].block_until_ready()
      rows.append((f"jaxlp {fmt.name} {mode}, in place (donated)", _time(step, repeats)))

  rows.append(("ml_dtypes float8_e4m3fn cast",
               _time(lambda: x_np.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), repeats)))
  rows.append(("ml_dtypes bfloat16 cast",
               _time(lambda: x_np.astype(ml_dtypes.bfloat16).astype(np.float32), repeats)))

  qt_ok = True
  try:
    import torch
    from qtorch.quant import float_quantize
    torch.set_num_threads(max(1, torch.get_num_threads()))
    xt = torch.from_numpy(x_np)
    for mode in ("nearest", "stochastic"):
      rows.append((f"QPyTorch float_quantize(4,3) {mode}",
                   _time(lambda mode=mode: float_quantize(xt, 4, 3, rounding=mode), repeats)))
  except Exception as e:  # pragma: no cover - reported in the table
    qt_ok = False
    print(f"(QPyTorch unavailable: {e!r})")

  t = dict(rows)
  copy = t["numpy copyto (bandwidth ceiling)"]
  nbytes = 8 * n
  print(f"# quantize throughput, n={n} float32, median of {repeats}; "
        f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"{datetime.date.today()}")
  hdr = (f"| {'what':42s} | {'ms':>8s} | {'GB/s':>6s} | {'Gelem/s':>7s} | {'vs QPyTorch':>11s} "
         f"| {'vs copy':>7s} |")
  print(hdr)
  print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
  for name, s in rows:
    ref = None
    if qt_ok:
      if "stochastic" in name:
        ref = t["QPyTorch float_quantize(4,3) stochastic"]
      else:
        ref = t["QPyTorch float_quantize(4,3) nearest"]
    vs_qt = f"{ref / s:10.2f}x" if ref else "n/a"
    print(f"| {name:42s} | {s * 1e3:8.2f} | {nbytes / s / 1e9:6.2f} | {n / s / 1e9:7.3f} | "
          f"{vs_qt:>11s} | {copy / s * 100:6.0f}% |")
  return rows


if __name__ == "__main__":
  main()
