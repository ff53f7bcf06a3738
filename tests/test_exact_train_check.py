"""benchmarks/tools/exact_train_check.py (issue 18, item 5: the exact mode's training run has
the same bits on a GPU as on the CPU): on the CPU both runs take the reference and agree; a run
whose checkpoint and losses differ in one bit is reported as different."""

import json
import shutil

import jax
import numpy as np
import pytest
from _bench import FAST_COMPILE, load_benchmark


def _tampered_copy(src, dst):
  """``dst``: run folder ``src`` with one bit of one parameter and of the first epoch's loss
  flipped (what another seed or another backend changes, at its smallest)."""
  from flax import serialization

  shutil.copytree(src, dst)
  with open(dst / "checkpoint.msgpack", "rb") as f:
    ckpt = serialization.msgpack_restore(f.read())
  leaves, tree = jax.tree_util.tree_flatten(ckpt["state"])
  i = next(j for j, x in enumerate(leaves) if np.asarray(x).dtype == np.float32 and np.size(x))
  x = np.array(leaves[i])
  x.reshape(-1).view(np.uint32)[0] ^= 1
  leaves[i] = x
  ckpt["state"] = jax.tree_util.tree_unflatten(tree, leaves)
  (dst / "checkpoint.msgpack").write_bytes(serialization.msgpack_serialize(ckpt))
  lines = (dst / "metrics.jsonl").read_text().splitlines()
  row = json.loads(lines[0])
  row["train_loss"] = float(np.nextafter(row["train_loss"], np.inf))
  lines[0] = json.dumps(row)
  (dst / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_two_cpu_runs_agree_and_a_changed_run_differs(tmp_path, capsys, monkeypatch):
  mod = load_benchmark("exact_train_check")
  for k, v in FAST_COMPILE.items():  # for the two jaxlp train processes
    monkeypatch.setenv(k, v)
  # the exact HBFP8 command at a smaller size (2 workers, 2 steps of 512): the check is the same
  assert mod.main(["--first", "cpu", "--second", "cpu", "--out", str(tmp_path), "--",
                   "--nodes", "2", "--batch-size", "512", "--width", "4"]) == 0
  out = capsys.readouterr().out
  assert "JAX_PLATFORMS=cpu" in out and "same bits: every checkpoint entry" in out
  other = tmp_path / "changed"
  _tampered_copy(tmp_path / "second", other)
  other = str(other)
  bad = mod.compare(str(tmp_path / "first"), other)
  assert any(k.startswith("losses") for k in bad)
  assert len(bad) == 2  # the one parameter and the losses
  # --compare: two existing folders, nothing trained; a folder that is not a run is refused
  capsys.readouterr()
  assert mod.main(["--compare", str(tmp_path / "first"), str(tmp_path / "second")]) == 0
  assert mod.main(["--compare", str(tmp_path / "first"), other]) == 1
  out = capsys.readouterr().out
  assert "same bits" in out and "DIFFERENT: " in out
  with pytest.raises(SystemExit):
    mod.main(["--compare", str(tmp_path), other])
  assert "holds no checkpoint.msgpack" in capsys.readouterr().err

