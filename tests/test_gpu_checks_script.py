"""benchmarks/gpu_checks.sh (the GPU checks of the open issues, for a machine with a GPU):
its dry run lists every step, and every flag a step passes is one its script accepts."""

import contextlib
import functools
import importlib.util
import io
import os
import re
import subprocess
import sys
from unittest import mock

import pytest
from _bench import benchmark_path, load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _help_text(script):
  """``script --help``'s output, run in this process (each script parses ``sys.argv`` in its
  ``main()``); the scripts run as commands in tests/test_benchmarks_front_door_smoke.py
  (``--help``) and tests/examples (``--smoke``)."""
  spec = importlib.util.spec_from_file_location("gpu_checks_help", os.path.join(ROOT, script))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = io.StringIO()
  with (mock.patch.object(sys, "argv", [script, "--help"]), contextlib.redirect_stdout(out),
        pytest.raises(SystemExit) as e):
    mod.main()
  assert e.value.code == 0, script
  return out.getvalue()


def test_gpu_checks_dry_run_lists_steps_with_known_flags():
  r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_checks.sh"), "--dry-run"],
                     capture_output=True, text=True, cwd=ROOT, timeout=60)
  assert r.returncode == 0, r.stderr
  steps = re.findall(r"^== (\w+) \(limit (\d+) s\): (.*)$", r.stdout, re.M)
  assert [s[0] for s in steps] == ["block_gpu_bits", "train_exact_gpu", "layers", "census",
                                   "optimlp_profile", "torch_ddp_example", "compression_powersgd",
                                   "torch_ddp_cuda"]
  assert sum(int(s[1]) for s in steps) <= 600  # fits one device call
  for name, _, cmd in steps:
    args = cmd.split()
    if args[1] == "-m":  # pytest: the files exist
      assert all(os.path.exists(os.path.join(ROOT, a)) for a in args if a.endswith(".py")), cmd
      continue
    script = os.path.join(ROOT, args[1])
    if args[1].startswith("tests/"):  # a checker run with positional arguments: it exists
      assert os.path.exists(script), cmd
      continue
    helptext = _help_text(args[1])
    own = args[2:args.index("--")] if "--" in args else args[2:]  # after "--": passed on
    for flag in (a for a in own if a.startswith("--")):
      assert flag in helptext, (name, flag)
    if args[1] == "benchmarks/compressors.py":  # known compressors
      names = args[args.index("--only") + 1].split(",")
      known = load_benchmark("compressors").COMPRESSORS
      assert len(set(names)) == len(names) and set(names) <= set(known), names
    if args[1] == "benchmarks/torch_quantize.py" and "--only" in args:  # known entry points
      only = cmd.split("--only ")[1].split(" --")[0].split(",")
      known = re.findall(r"\(\"([\w. ]+)\", r", load_benchmark_source("torch_quantize"))
      assert set(only) <= set(known), (only, known)


def load_benchmark_source(name):
  with open(benchmark_path(name)) as f:
    return f.read()
