"""Smoke test of benchmarks/tools/reliability_probes.py: it lists its probes (every family of
issue 49), runs one cheap probe through ``--only``, and its verdict rules for the command's
errors classify hand-made outcomes as the docstring says."""

import pytest
from _bench import load_benchmark


def test_list_names_every_family(capsys):
  mod = load_benchmark("reliability_probes")
  assert mod.main(["--list"]) == 0
  names = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert len(names) == len(set(names)) == len(mod.PROBES)
  # 11 compressors x 5 cases, and each family of the issue
  assert sum(n.startswith("compress.") and n.split(".")[1] != "state" for n in names) == 55
  for family in ("matmul.grad_a", "matmul.jvp", "pallas.matmul.grad", "compress.state.",
                 "quantize_model.torch", "secopa_plan", "torch.quantize.sparse",
                 "cli.checkpoint_flipped_byte", "cli.overwrite_invalid_config",
                 "cli.concurrent_train", "cli.concurrent_resume", "cli.compare.dotdot_name",
                 "cli.seed_too_large", "cli.width_too_large", "cli.mnist_0x0_images",
                 "cli.plot_garbage_line", "cli.resume_missing_checkpoint", "cli.ctrl_c.training"):
    assert any(n.startswith(family) for n in names), family


def test_one_cheap_probe_runs_and_is_ok(capsys):
  mod = load_benchmark("reliability_probes")
  assert mod.main(["--only", "secopa_plan.negative_size"]) == 0
  out = capsys.readouterr().out
  assert "secopa_plan.negative_size" in out and "sizes[0]=-5" in out
  assert "ok: 1, silent wrong: 0, data loss: 0, obscure crash: 0  (1 probes" in out


def test_verdicts_of_command_outcomes():
  mod = load_benchmark("reliability_probes")
  R = mod.Result
  one = "jaxlp train: error: argument --seed: must be at most 4294967295\n"
  assert mod.cli_error(R(2, "", one, 1.0), ["--seed"])[1] == mod.OK
  assert mod.cli_error(R(2, "", one, 1.0), ["--width"])[1] == mod.CRASH  # names another flag
  assert mod.cli_error(R(1, "", one, 1.0), ["--seed"])[1] == mod.CRASH  # status 1
  tb = "Traceback (most recent call last):\n  File x\nOverflowError: too big\n"
  assert mod.cli_error(R(2, "", tb, 1.0), [])[1] == mod.CRASH
  assert mod.cli_error(R(None, "", "", 300.0), [])[1] == mod.CRASH  # a hang
  assert mod.cli_error(R(0, "", "", 1.0), ["--seed"])[1] == mod.WRONG  # accepted
  assert mod.cli_error(R(0, "", "", 1.0), [], accepted=mod.LOSS)[1] == mod.LOSS


def test_unknown_only_is_refused():
  mod = load_benchmark("reliability_probes")
  with pytest.raises(SystemExit) as e:
    mod.main(["--only", "no-such-probe"])
  assert e.value.code == 2
