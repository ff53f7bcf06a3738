"""benchmarks/exact_train_check.py (issue 18, item 5: the exact mode's training run has the same
bits on a GPU as on the CPU): on the CPU both runs take the reference and agree; a run with
another seed is reported as different."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
  spec = importlib.util.spec_from_file_location(
      "exact_train_check", os.path.join(ROOT, "benchmarks", "exact_train_check.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_two_cpu_runs_agree_and_another_seed_differs(tmp_path, capsys):
  mod = _module()
  assert mod.main(["--first", "cpu", "--second", "cpu", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "JAX_PLATFORMS=cpu" in out and "same bits: every checkpoint entry" in out
  other = str(tmp_path / "seed1")
  mod.train(other, "cpu", 1, ["--seed", "1"])
  bad = mod.compare(str(tmp_path / "first"), other)
  assert bad and any(k.startswith("losses") for k in bad)
  assert len(bad) > 1  # parameters differ too, not only the loss
