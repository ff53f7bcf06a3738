"""benchmarks/exact_train_check.py (issue 18, item 5: the exact mode's training run has the same
bits on a GPU as on the CPU): on the CPU both runs take the reference and agree; a run with
another seed is reported as different."""

import pytest
from _bench import load_benchmark


def test_two_cpu_runs_agree_and_another_seed_differs(tmp_path, capsys):
  mod = load_benchmark("exact_train_check")
  assert mod.main(["--first", "cpu", "--second", "cpu", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "JAX_PLATFORMS=cpu" in out and "same bits: every checkpoint entry" in out
  other = str(tmp_path / "seed1")
  mod.train(other, "cpu", 1, ["--seed", "1"])
  bad = mod.compare(str(tmp_path / "first"), other)
  assert bad and any(k.startswith("losses") for k in bad)
  assert len(bad) > 1  # parameters differ too, not only the loss
  # --compare: two existing folders, nothing trained; a folder that is not a run is refused
  capsys.readouterr()
  assert mod.main(["--compare", str(tmp_path / "first"), str(tmp_path / "second")]) == 0
  assert mod.main(["--compare", str(tmp_path / "first"), other]) == 1
  out = capsys.readouterr().out
  assert "same bits" in out and "DIFFERENT: " in out
  with pytest.raises(SystemExit):
    mod.main(["--compare", str(tmp_path), other])
  assert "holds no checkpoint.msgpack" in capsys.readouterr().err


def test_diagnosis_runs_every_stage_and_finds_no_difference_between_two_cpu_runs(capsys):
  """benchmarks/exact_train_diag.py (where two backends part, stage by stage): on one backend
  every stage and primitive has the same bits; the report covers init, the steps and the
  portable primitives."""
  mod = load_benchmark("exact_train_diag")
  assert mod.main(["--platforms", "cpu,cpu", "--steps", "1"]) == 0
  out = capsys.readouterr().out
  assert "DIFFERS" not in out and "# portable mode: True" in out
  for stage in ("init params", "training step 1", "portable exp", "portable log",
                "portable cross_entropy"):
    assert f"same: {stage}" in out
