"""CPU time of NVFP4 and MXFP4 quantize (jaxlp) next to a plain copy and torchao's reference.

Usage: python benchmarks/fp4.py [--small] [--repeats R]

The same float32 N(0, 1) matrix (2048 x 2048; --small: 256 x 512) goes through: numpy's
``copyto`` into a preallocated array and a jitted XLA copy (the bandwidth references);
``jaxlp.formats.quantize`` with ``nvfp4()`` (two-level, 1-D blocks of 16), ``nvfp4`` without
its tensor scale, ``nvfp4(tile=16)``, and ``mx(E2M1FN)`` (MXFP4) with the ``floor`` and
``rceil`` scale rules, nearest and stochastic rounding (jitted, ``block_until_ready``); and,
where torchao is installed, torchao's ``NVFP4Tensor.to_nvfp4`` + ``dequantize`` and
``MXTensor.to_mx`` + ``dequantize`` (eager PyTorch, the widely used reference) on the same
data. Each torchao row's last column says whether jaxlp's result has the same bits. Median of
R timed calls after one warm-up (which compiles). GPU: this script measures the CPU only; the
NVFP4 kernel family is not measured on a GPU (``KERNEL_IS_FASTER["scaled_blocks"]``).
"""

from __future__ import annotations

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports.
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


def _torchao():
  """torchao's NVFP4 and MX entry points, or the reason they are unavailable."""
  try:
    import torch
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor,
        per_tensor_amax_to_scale,
    )
  except Exception as e:  # reported in the table
    return None, repr(e)

  def nvfp4(t, two_level=True):
    pts = per_tensor_amax_to_scale(t.abs().max()) if two_level else None
    return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=pts).dequantize(torch.float32)

  def mxfp4(t, rule):
    mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}[rule]
    return MXTensor.to_mx(t, torch.float4_e2m1fn_x2, 32, mode).dequantize(torch.float32)

  return (torch, nvfp4, mxfp4), None


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--small", action="store_true", help="256 x 512 elements (CI smoke)")
  ap.add_argument("--repeats", type=int, default=None)
  args = ap.parse_args(argv)
  shape = (256, 512) if args.small else (2048, 2048)
  n = shape[0] * shape[1]
  repeats = args.repeats or (3 if args.small else 5)

  import jax
  import jax.numpy as jnp

  from jaxlp import formats as F

  x_np = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
  x = jnp.asarray(x_np)
  key = jax.random.key(0)
  rows = []  # (name, seconds, same-bits note)
  results = {}

  out = np.empty_like(x_np)
  rows.append(("numpy copyto (bandwidth ceiling)",
               _time(lambda: np.copyto(out, x_np), repeats), ""))
  cp = jax.jit(lambda v: v + 0.0)
  rows.append(("XLA jit copy (x + 0), fresh output", _time(lambda: cp(x).block_until_ready(),
                                                            repeats), ""))

  fmts = {"NVFP4": F.nvfp4(), "NVFP4 one-level": F.nvfp4(tensor_scale=False),
          "NVFP4 16x16 tiles": F.nvfp4(tile=16), "MXFP4 floor": F.mx(F.E2M1FN),
          "MXFP4 rceil": F.mx(F.E2M1FN, scale_rule="rceil")}
  for name, fmt in fmts.items():
    for mode in ("nearest", "stochastic"):
      if mode == "stochastic" and name not in ("NVFP4", "MXFP4 floor"):
        continue
      f = jax.jit(lambda v, k, fmt=fmt, mode=mode: F.quantize(
          v, fmt, mode, key=k if mode == "stochastic" else None))
      results[(name, mode)] = np.asarray(f(x, key))
      rows.append((f"jaxlp {name} {mode}",
                   _time(lambda f=f: f(x, key).block_until_ready(), repeats), ""))

  tao, why = _torchao()
  if tao is not None:
    torch, tao_nvfp4, tao_mxfp4 = tao
    xt = torch.from_numpy(x_np)
    for name, fn in (("NVFP4", lambda: tao_nvfp4(xt)),
                     ("NVFP4 one-level", lambda: tao_nvfp4(xt, False)),
                     ("MXFP4 floor", lambda: tao_mxfp4(xt, "floor")),
                     ("MXFP4 rceil", lambda: tao_mxfp4(xt, "rceil"))):
      got = fn().numpy()
      same = np.array_equal(got.view(np.uint32), results[(name, "nearest")].view(np.uint32))
      rows.append((f"torchao {name} (quantize + dequantize)", _time(fn, repeats),
                   "same bits" if same else "DIFFERENT bits"))

  t = {name: s for name, s, _ in rows}
  copy = t["numpy copyto (bandwidth ceiling)"]
  print(f"# FP4 quantize on the CPU, {shape[0]} x {shape[1]} float32 N(0,1), median of "
        f"{repeats}; jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"{_os.cpu_count()} cores, {datetime.date.today()}")
  if tao is None:
    print(f"(torchao unavailable: {why}; its rows are missing)")
  hdr = (f"| {'what':48s} | {'ms':>9s} | {'Melem/s':>8s} | {'vs copyto':>9s} "
         f"| {'vs torchao':>10s} | {'jaxlp vs torchao':16s} |")
  print(hdr)
  print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
  for name, s, note in rows:
    base = None  # torchao has no stochastic rounding: those rows have no ratio
    for fam in ("NVFP4 one-level", "NVFP4", "MXFP4 floor", "MXFP4 rceil"):
      if f" {fam} " in f" {name} " and "16x16" not in name and "stochastic" not in name:
        base = t.get(f"torchao {fam} (quantize + dequantize)")
        break
    vs = f"{base / s:9.2f}x" if base else "n/a"
    print(f"| {name:48s} | {s * 1e3:9.2f} | {n / s / 1e6:8.1f} | {copy / s * 100:8.1f}% "
          f"| {vs:>10s} | {note:16s} |")
  print("GPU: not measured (CPU script; the NVFP4 kernel family has no GPU measurement).")
  return rows


if __name__ == "__main__":
  main()
