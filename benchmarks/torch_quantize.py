"""Benchmark: jaxlp.torch.float_quantize vs QPyTorch CPU float_quantize; DLPack overhead.

Usage: python benchmarks/torch_quantize.py [--small] [--n N] [--exp 5 --man 2]
"""

import os as _os
import sys as _sys

# This folder holds a script named like a module that jax's dependencies import
# ("compression"); keep it off sys.path so running any benchmark as a script is safe.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import platform
import time

import numpy as np
import torch


def _time(fn, reps):
  fn()  # warm-up (compiles / builds)
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--small", action="store_true", help="64k elements, 2 reps (smoke test)")
  ap.add_argument("--n", type=int, default=16 * 2**20)
  ap.add_argument("--exp", type=int, default=5)
  ap.add_argument("--man", type=int, default=2)
  ap.add_argument("--reps", type=int, default=5)
  args = ap.parse_args()
  n, reps = (2**16, 2) if args.small else (args.n, args.reps)

  import jax  # noqa: PLC0415

  import jaxlp.torch as jt  # noqa: PLC0415
  try:
    import qtorch.quant as qq  # noqa: PLC0415
  except Exception as e:  # noqa: BLE001
    qq = None
    print(f"# qtorch unavailable: {e!r}")

  x = torch.randn(n)
  print(f"# {platform.node()} {platform.processor() or platform.machine()} "
        f"torch {torch.__version__} jax {jax.__version__} threads {torch.get_num_threads()} "
        f"n={n} exp={args.exp} man={args.man} {time.strftime('%Y-%m-%d')}")
  print("| op | rounding | jaxlp.torch (ms) | QPyTorch CPU (ms) | speed-up |")
  print("|---|---|---|---|---|")
  for rounding in ("nearest", "stochastic"):
    tj = _time(lambda r=rounding: jt.float_quantize(x, args.exp, args.man, r), reps)
    if qq is not None:
      tq = _time(lambda r=rounding: qq.float_quantize(x, args.exp, args.man, r), reps)
      print(f"| float_quantize | {rounding} | {tj * 1e3:.1f} | {tq * 1e3:.1f} | {tq / tj:.2f}x |")
    else:
      print(f"| float_quantize | {rounding} | {tj * 1e3:.1f} | n/a | n/a |")
  trt = _time(lambda: jt.to_torch(jt.to_jax(x)), max(reps, 20))
  same = jt.to_torch(jt.to_jax(x)).data_ptr() == x.data_ptr()
  print(f"| DLPack round trip torch->jax->torch | - | {trt * 1e6:.0f} us "
        f"(zero-copy={same}) | - | - |")


if __name__ == "__main__":
  main()
