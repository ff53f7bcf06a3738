"""Smoke test of benchmarks/loopback.py --smoke: 2 real processes (gloo over 127.0.0.1, tc-
throttled in a network namespace where available, unthrottled otherwise -- never skipped).

The run: ``--methods onebit`` (a compressor with error feedback, its state carried from step
to step), to which the script adds the fp32 baseline, each in the two workers and in their
no-network vmap. The other compressors' bits across processes are tested by
tests/parallel/compress/test_compress_multiprocess.py (bf16 and PowerSGD among them: when they
were run here too, their compiles took 6 and 29 s of each worker's 45 s of compiling), their
rows by benchmarks/compressors.py's smoke test; the wire bytes of a cast (one bucket) and of
PowerSGD (one payload per matrix) are checked below."""

import os
import pathlib
import re
import subprocess
import sys

from _bench import FAST_COMPILE, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
METHODS = ("fp32", "onebit")


def test_loopback_smoke():
  env = dict(os.environ, **FAST_COMPILE)
  env["XLA_FLAGS"] = xla_flags()  # not the conftest's 8 forced devices: each worker wants ONE
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  # the script adds fp32 (the baseline of every ratio) to --methods
  p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loopback.py"), "--smoke",
                      "--methods", "onebit"], env=env, capture_output=True, text=True,
                     timeout=300, cwd=str(ROOT))
  log = p.stdout + "\n--- stderr ---\n" + p.stderr[-4000:]
  assert p.returncode == 0, log
  rows = {}
  for line in p.stdout.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 9 and cells[2] in METHODS:
      rows[cells[2]] = cells
  assert set(rows) == set(METHODS), log
  throttled = "NOT available" not in p.stdout
  for name, (rate, w, _, wire, local, med, mn, speed, same) in rows.items():
    assert rate == ("1gbit" if throttled else "unthrottled"), log
    assert w == "2", log
    assert float(wire) > 0 and float(local) > 0 and float(med) > 0 and float(mn) > 0, log
    assert float(mn) <= float(med), log
    assert re.fullmatch(r"\d+\.\d\dx", speed), log
    # every worker's reduced gradients hash the same (compressed_allreduce is bit-identical)
    assert same == "yes", (name, log)
  assert rows["fp32"][7] == "1.00x"
  # fp32 moves 4 B/element; every compressor moves less
  for name in METHODS[1:]:
    assert float(rows[name][3]) < float(rows["fp32"][3]), (name, log)


def _load():
  import runpy
  return runpy.run_path(str(ROOT / "benchmarks" / "loopback.py"))


def test_rates_and_tbf_parameters():
  mod = _load()
  assert mod["parse_rate"]("100mbit") == 1e8 and mod["parse_rate"]("1gbit") == 1e9
  assert mod["parse_rate"]("none") is None
  # burst: >= 10 ms of line rate and >= 128 KiB (twice lo's 64 KiB MTU)
  assert mod["tbf_args"]("100mbit") == "rate 100mbit burst 131072 latency 100ms"
  assert mod["tbf_args"]("10gbit") == "rate 10gbit burst 12500000 latency 100ms"
  try:
    mod["parse_rate"]("fast")
  except ValueError as e:
    assert "rate" in str(e)
  else:
    raise AssertionError("bad rate accepted")


def test_no_netns_is_reported(monkeypatch):
  mod = _load()
  monkeypatch.setenv("PATH", "/nonexistent")
  ok, why = mod["netns_available"]()
  assert not ok and "not found" in why


def test_wire_bytes_per_worker():
  mod = _load()
  shapes = [(64, 32, 3, 3), (64,), (100, 128)]
  n = sum(int(__import__("math").prod(s)) for s in shapes)
  assert mod["wire_bytes_per_worker"]("fp32", shapes, 25.0) == 4 * n
  # bf16: the two matrices fused into one bucket at 2 B/element, the vector in fp32
  assert mod["wire_bytes_per_worker"]("bf16", shapes, 25.0) == 2 * (18432 + 12800) + 4 * 64
  # PowerSGD rank 2: P and Q of each matrix (the conv as 64 x 288), no buckets; the vector
  # in fp32
  assert mod["wire_bytes_per_worker"]("powersgd2", shapes, 25.0) == 4 * (
      2 * (64 + 288) + 2 * (100 + 128) + 64)
