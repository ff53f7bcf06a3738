"""benchmarks/gpu_checks.sh (the GPU checks of the open issues, for a machine with a GPU):
its dry run lists every step, and every flag a step passes is one its script accepts."""

import os
import re
import subprocess
import sys

from _bench import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_checks_dry_run_lists_steps_with_known_flags():
  r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_checks.sh"), "--dry-run"],
                     capture_output=True, text=True, cwd=ROOT, timeout=60)
  assert r.returncode == 0, r.stderr
  steps = re.findall(r"^== (\w+) \(limit (\d+) s\): (.*)$", r.stdout, re.M)
  assert [s[0] for s in steps] == ["compression_buckets", "compression_nocb", "torch_quantize",
                                   "torch_cuda", "block_gpu_bits", "layers", "train_exact_gpu"]
  assert sum(int(s[1]) for s in steps) <= 600  # fits one device call
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  for name, _, cmd in steps:
    args = cmd.split()
    if args[1] == "-m":  # pytest: the files exist
      assert all(os.path.exists(os.path.join(ROOT, a)) for a in args if a.endswith(".py")), cmd
      continue
    script = os.path.join(ROOT, args[1])
    if args[1].startswith("tests/"):  # a checker run with positional arguments: it exists
      assert os.path.exists(script), cmd
      continue
    helptext = subprocess.run([sys.executable, script, "--help"], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=120).stdout
    own = args[2:args.index("--")] if "--" in args else args[2:]  # after "--": passed on
    for flag in (a for a in own if a.startswith("--")):
      assert flag in helptext, (name, flag)


def test_gpu_checks_compression_names_known_compressors():
  r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_checks.sh"), "--dry-run"],
                     capture_output=True, text=True, cwd=ROOT, timeout=60)
  cmds = re.findall(r"^== compression\w* \(limit \d+ s\): (.*)$", r.stdout, re.M)
  assert len(cmds) == 2  # bucketed, with and without command buffers
  mod = load_benchmark("compression")
  for cmd in cmds:
    args = cmd.split()
    names = args[args.index("--only") + 1].split(",")
    assert len(set(names)) == len(names) and set(names) <= set(mod.COMPRESSORS), names
