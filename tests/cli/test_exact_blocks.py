"""``jaxlp train --exact-blocks``: exact integer block dots (``block_dot="exact"``) for the
integer block policies, recorded in config.json and checked on resume; refused elsewhere."""

import dataclasses
import json

import pytest
from test_flags import _run

from jaxlp.training import TrainConfig, Trainer
from jaxlp.training._loop import _policy
from jaxlp.training._runs import config_differences

TOY = ["--epochs", "1", "--max-steps-per-epoch", "1", "--batch-size", "16", "--width", "1",
       "--quiet"]


@pytest.mark.usefixtures("fast_compile")  # runs; what is recorded and checked on resume
def test_cnn_exact_blocks_runs_is_recorded_and_resume_checks_it(tmp_path, capsys):
  out = tmp_path / "run"
  rc, err = _run(["train", "--model", "cnn", "--hbfp", "8", "--exact-blocks", *TOY,
                  "--out", str(out)], capsys)
  assert rc == 0, err
  stored = json.loads((out / "config.json").read_text())
  assert stored["exact_blocks"] is True
  # what --resume checks (jaxlp train ... --resume without --exact-blocks is refused)
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  cfg = TrainConfig(**{k: v for k, v in stored.items() if k in fields}, quiet=True)
  assert config_differences(cfg, stored, TrainConfig()) == []
  cfg = dataclasses.replace(cfg, exact_blocks=False)
  assert config_differences(cfg, stored, TrainConfig()) == [
      "--exact-blocks False (the run has True)"]


def test_mlp_exact_blocks_matches_the_emulation_on_the_toy_run():
  """Documented (README, "Block formats on tensor cores"): on the digits MLP every
  sum of block products fits float32's 24 bits, so the exact block dots give the same bits
  as today's emulation: the same logits from the same parameters (``--policy mxint8`` here).
  The training runs of the exact MLP (``--hbfp 8`` with 3 workers, a schedule and weight
  decay, over 2 epochs: the same init and logits, then the portable loss, softmax, sums and
  update within a few ulps of XLA's, the same accuracy) are in tests/cli/test_portable.py; the
  portable arithmetic does not depend on the block format, MXINT8's exact block dots give
  their definition's forward and both gradients in tests/ops/test_block_dot.py
  (test_dot_general_mxint8_requantizes_along_each_contraction) and train a language model in
  tests/cli/test_text.py: an MXINT8 run here traced two more training steps for no path of
  its own."""
  import jax
  import numpy as np

  cfg = dict(model="mlp", epochs=1, batch_size=16, width=1, max_steps_per_epoch=1,
             quiet=True, policy="mxint8")
  assert _policy(TrainConfig(**cfg, exact_blocks=True)).block_dot == "exact"
  t_exact, t_emu = Trainer(TrainConfig(**cfg, exact_blocks=True)), Trainer(TrainConfig(**cfg))
  assert t_exact.portable and not t_emu.portable
  for a, b in zip(jax.tree_util.tree_leaves(t_exact.params),
                  jax.tree_util.tree_leaves(t_emu.params)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()  # the same init
  x = t_emu.ds.x_train[:128]
  lx = np.asarray(jax.jit(t_exact.model.apply)({"params": t_exact.params}, x))
  le = np.asarray(jax.jit(t_emu.model.apply)({"params": t_emu.params}, x))
  assert lx.tobytes() == le.tobytes()


@pytest.mark.parametrize("args,needle", [
    (["--exact-blocks"], "--exact-blocks needs an integer block policy"),
    (["--exact-blocks", "--policy", "e4m3"], "not --policy e4m3"),
    (["--exact-blocks", "--hbfp", "16", "--tile", "64"], "--exact-blocks: jaxlp train"),
])
def test_refused_combinations_exit_2(args, needle, capsys):
  rc, err = _run(["train", *TOY, *args], capsys)
  lines = err.strip().splitlines()
  assert rc == 2 and len(lines) == 1 and needle in lines[0], err
