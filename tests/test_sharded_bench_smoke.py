"""Smoke test of benchmarks/sharded.py --smoke: 2 real processes (gloo over 127.0.0.1, tc-
throttled in a network namespace where available, unthrottled otherwise -- never skipped)
train the fsdp MLP with fp32 and int4+int8 wires; one short accuracy run."""

import os
import pathlib
import re
import subprocess
import sys

from _bench import FAST_COMPILE, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_sharded_bench_smoke():
  env = dict(os.environ, **FAST_COMPILE)
  env["XLA_FLAGS"] = xla_flags()  # not the conftest's 8 forced devices: each worker wants ONE
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sharded.py"), "--smoke"],
                     env=env, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
  log = p.stdout + "\n--- stderr ---\n" + p.stderr[-4000:]
  assert p.returncode == 0, log
  rows = {}
  for line in p.stdout.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 13 and cells[2] in ("fp32", "int4+int8"):
      rows[cells[2]] = cells
  assert set(rows) == {"fp32", "int4+int8"}, log
  throttled = "NOT available" not in p.stdout
  for name, (link, w, _, _gw, _pw, wire, loc, med, mn, speed, mem, _rep, same) in rows.items():
    assert link == ("1gbit" if throttled else "unthrottled") and w == "2", log
    assert float(wire) > 0 and float(loc) > 0 and float(mn) <= float(med), log
    assert re.fullmatch(r"\d+\.\d\dx", speed), log
    # each of the 2 devices holds about half of the replicated parameters + momentum
    frac = float(re.search(r"\(([\d.]+)x\)", mem).group(1))
    assert 0.5 <= frac < 0.52, log
    assert same == "yes", (name, log)  # every worker gathered the same parameters
  assert rows["fp32"][9] == "1.00x" and (rows["fp32"][3], rows["fp32"][4]) == ("fp32", "fp32")
  assert (rows["int4+int8"][3], rows["int4+int8"][4]) == ("int4-block", "int8-block")
  assert float(rows["int4+int8"][5]) < float(rows["fp32"][5]) / 3, log  # the wires' bytes
  assert re.search(r"goal: int4\+int8 >= 3x the fp32 sharded step: [\d.]+x -> (not )?met",
                   p.stdout), log
  for name in ("fp32", "int4+int8"):
    assert re.search(rf"codec {re.escape(name)}: reduce-scatter [\d.]+ ms, all-gather [\d.]+ ms",
                     p.stdout), log
  assert re.search(r"\| int4\+int8 \| 0\.\d{4} \([\d.]+\) \| 0\.\d{4} \| - \|", p.stdout), log
