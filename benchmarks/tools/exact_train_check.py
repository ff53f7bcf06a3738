"""Checks that an exact-mode training run has the same bits on a GPU as on the CPU.

What it is for (issue 18, item 5): ``jaxlp train --hbfp 8 --exact-blocks`` must give the same
bits on a GPU (the Pallas kernel) as on the CPU (the jnp reference).

Runs the same ``jaxlp train`` command twice, in subprocesses with different ``JAX_PLATFORMS``
(default: ``cuda,cpu``, then ``cpu``), and compares the two runs' checkpoints bit for bit and
their per-epoch losses. Prints one line per run and a verdict; exits 1 when they differ.

Usage: python benchmarks/tools/exact_train_check.py [--epochs N] [--first PLATFORMS]
       [--second PLATFORMS] [--out DIR] [-- extra jaxlp train arguments]
       python benchmarks/tools/exact_train_check.py --compare RUN_A RUN_B

``--compare`` only compares two run folders written elsewhere: e.g. the GPU run's folder,
brought back from a device machine, against the same command run here on the CPU
(``gpu_checks.sh`` runs the GPU half only and keeps its folder; on the H200 host of 2026-11-27
the CPU half ran past its limit, because jax 0.11 compiled the exact step for minutes, since
fixed by ``jaxlp.training._portable.materialize``).
"""

from __future__ import annotations

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports (jax tries `compression.zstd`, for one).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import json
import subprocess
import tempfile
import time

import numpy as np

ROOT = _os.path.dirname(_os.path.dirname(_here))
COMMAND = ["train", "--hbfp", "8", "--exact-blocks"]


def train(out: str, platforms: str, epochs: int, extra=()) -> float:
  """One ``jaxlp train`` run into ``out`` under ``JAX_PLATFORMS=platforms``; wall seconds."""
  env = dict(_os.environ, JAX_PLATFORMS=platforms,
             PYTHONPATH=ROOT + _os.pathsep + _os.environ.get("PYTHONPATH", ""))
  argv = [_sys.executable, "-m", "jaxlp", *COMMAND, "--epochs", str(epochs), "--out", out,
          *extra]
  t0 = time.perf_counter()
  r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
  if r.returncode != 0:
    raise SystemExit(f"exact_train_check: {' '.join(argv[2:])} under JAX_PLATFORMS={platforms} "
                     f"failed ({r.returncode}):\n{r.stderr[-3000:]}")
  return time.perf_counter() - t0


def state(d: str) -> dict:
  """The saved training state of run folder ``d`` (flax msgpack, as ``jaxlp train`` writes)."""
  from flax import serialization  # noqa: PLC0415

  with open(_os.path.join(d, "checkpoint.msgpack"), "rb") as f:
    return serialization.msgpack_restore(f.read())["state"]


def losses(d: str) -> list[float]:
  """Each epoch's mean training loss (``metrics.jsonl``)."""
  with open(_os.path.join(d, "metrics.jsonl")) as f:
    return [json.loads(line)["train_loss"] for line in f if line.strip()]


def compare(a: str, b: str) -> list[str]:
  """What differs between run folders ``a`` and ``b``: state entries (bits) and the losses."""
  sa, sb = state(a), state(b)
  bad = sorted(set(sa) ^ set(sb))
  for k in sorted(set(sa) & set(sb)):
    x, y = np.asarray(sa[k]), np.asarray(sb[k])
    if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
      bad.append(k)
  la, lb = losses(a), losses(b)
  if [float(v).hex() for v in la] != [float(v).hex() for v in lb]:
    bad.append(f"losses {la} vs {lb}")
  return bad


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--epochs", type=int, default=1)
  ap.add_argument("--first", default="cuda,cpu", help="JAX_PLATFORMS of the first run")
  ap.add_argument("--second", default="cpu", help="JAX_PLATFORMS of the second run")
  ap.add_argument("--out", default=None, help="keep the two run folders here (default: a "
                  "temporary folder, removed)")
  ap.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), default=None,
                  help="compare two existing run folders and train nothing")
  ap.add_argument("extra", nargs="*", help="more jaxlp train arguments (after --)")
  a = ap.parse_args(argv)
  if a.compare:
    for d in a.compare:
      if not _os.path.isfile(_os.path.join(d, "checkpoint.msgpack")):
        ap.error(f"--compare: {d} holds no checkpoint.msgpack (not a jaxlp train run folder)")
    bad = compare(*a.compare)
    return report(bad)
  if a.epochs < 1:
    ap.error(f"--epochs={a.epochs} must be >= 1")
  with tempfile.TemporaryDirectory() as tmp:
    base = a.out or tmp
    runs = []
    for name, platforms in (("first", a.first), ("second", a.second)):
      d = _os.path.join(base, name)
      if _os.path.exists(d):
        ap.error(f"--out: {d} exists; give an empty folder")
      secs = train(d, platforms, a.epochs, a.extra)
      runs.append(d)
      print(f"jaxlp {' '.join(COMMAND + a.extra)} --epochs {a.epochs}, "
            f"JAX_PLATFORMS={platforms}: {secs:.1f} s, losses {losses(d)}", flush=True)
    bad = compare(*runs)
  return report(bad)


def report(bad: list[str]) -> int:
  """Print the verdict on :func:`compare`'s list; the exit status."""
  if bad:
    print(f"DIFFERENT: {', '.join(bad)}")
    return 1
  print("same bits: every checkpoint entry and every epoch's loss")
  return 0


if __name__ == "__main__":
  _sys.exit(main())
