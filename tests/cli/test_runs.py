"""Run folders (issue 15): never silently changed, resumable after a crash with the bits of an
uninterrupted run, msgpack checkpoints (no code on load), clear refusals naming the file."""

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from _bench import FAST_COMPILE

from jaxlp.cli import main
from jaxlp.training import TrainConfig, Trainer, _runs, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = dict(nodes=2, devices=1, batch_size=64, max_steps_per_epoch=3, seed=3, quiet=True)
FLAGS = ["--nodes", "2", "--devices", "1", "--batch-size", "64", "--max-steps-per-epoch", "3",
         "--seed", "3", "--quiet"]
# XLA's optimizations off, in this process (tests/conftest.py, ``fast_compile``; the session's
# reference run ``ref`` too, made by the first test here that uses it) and in the killed
# ``jaxlp`` process (tests/_bench.py, ``FAST_COMPILE``): every run compared here is compiled
# alike. Resume's bits against the uninterrupted run's on a normally compiled program:
# tests/cli/test_cli.py (test_resume_equals_uninterrupted, the same train() resume path).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _strip(hist):
  return [{k: v for k, v in h.items() if k != "seconds"} for h in hist]


def _metrics(d):
  with open(os.path.join(d, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _state(d):
  from flax import serialization  # readable without jaxlp

  with open(os.path.join(d, "checkpoint.msgpack"), "rb") as f:
    return serialization.msgpack_restore(f.read())


def _assert_same_run(d, ref):
  assert _strip(_metrics(d)) == _strip(_metrics(ref))
  a, b = _state(d), _state(ref)
  assert a["epoch"] == b["epoch"] and a["step"] == b["step"]
  assert sorted(a["state"]) == sorted(b["state"])
  for k in a["state"]:
    np.testing.assert_array_equal(np.asarray(a["state"][k]).view(np.uint8),
                                  np.asarray(b["state"][k]).view(np.uint8), err_msg=k)


def _snapshot(d):
  return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def _cli(argv, capsys):
  """(exit code, stderr) of ``jaxlp ARGV`` in process."""
  try:
    rc = main(argv)
  except SystemExit as e:
    rc = e.code
  return rc, capsys.readouterr().err


@pytest.fixture(scope="session")
def ref(tmp_path_factory):
  """An uninterrupted 3-epoch run."""
  d = str(tmp_path_factory.mktemp("ref") / "run")
  train(TrainConfig(epochs=3, out=d, **COMMON))
  return d


def test_checkpoint_is_msgpack_with_config_and_history(ref):
  ck = _state(ref)
  assert ck["format"] == "jaxlp-checkpoint" and ck["version"] == 2
  assert ck["config"]["nodes"] == 2 and ck["config"]["seed"] == 3
  assert ck["config_sha256"] == _runs.config_hash(ck["config"])
  assert [h["epoch"] for h in ck["history"]] == [1, 2, 3] == [m["epoch"] for m in _metrics(ref)]
  assert not os.path.exists(os.path.join(ref, "checkpoint.pkl"))


def test_existing_run_needs_resume_or_overwrite(ref, tmp_path, capsys):
  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  before = _snapshot(d)
  rc, err = _cli(["train", "--epochs", "1", "--out", d] + FLAGS, capsys)
  assert rc == 2 and "--resume" in err and "--overwrite" in err and d in err
  assert _snapshot(d) == before  # metrics and checkpoint untouched
  rc, err = _cli(["train", "--epochs", "1", "--out", d, "--resume", "--overwrite"] + FLAGS,
                 capsys)
  assert rc == 2 and _snapshot(d) == before
  assert _cli(["train", "--epochs", "1", "--out", d, "--overwrite"] + FLAGS, capsys)[0] == 0
  assert [m["epoch"] for m in _metrics(d)] == [1] and _state(d)["epoch"] == 1


@pytest.mark.parametrize("change", [["--lr", "0.1"], ["--nodes", "4"],
                                    ["--grad-exp", "4", "--grad-man", "3"], ["--seed", "4"],
                                    ["--model", "cnn"]])
def test_resume_refuses_a_changed_configuration(ref, tmp_path, capsys, change):
  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  before = _snapshot(d)
  rc, err = _cli(["train", "--epochs", "4", "--out", d, "--resume"] + FLAGS + change, capsys)
  assert rc == 2 and change[0] in err and "config.json" in err
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
  assert _snapshot(d) == before  # config.json still describes the run


def test_resume_epochs_may_grow_not_shrink(ref, tmp_path, capsys):
  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  rc, err = _cli(["train", "--epochs", "2", "--out", d, "--resume"] + FLAGS, capsys)
  assert rc == 2 and "--epochs 2" in err and "3 epochs" in err
  # nothing to do at the same count; the history is returned as stored
  assert _strip(train(TrainConfig(epochs=3, out=d, resume=True, **COMMON))) == \
      _strip(_metrics(ref))


def test_resume_without_a_run_and_out_a_file(tmp_path, capsys):
  rc, err = _cli(["train", "--out", str(tmp_path / "none"), "--resume"] + FLAGS, capsys)
  assert rc == 2 and "holds no run" in err
  f = tmp_path / "file"
  f.write_text("x")
  rc, err = _cli(["train", "--out", str(f)] + FLAGS, capsys)
  assert rc == 2 and "--out" in err and "not a folder" in err


@pytest.mark.parametrize("damage", ["missing", "duplicate", "garbage"])
def test_resume_refuses_a_damaged_history(ref, tmp_path, capsys, damage):
  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  p = os.path.join(d, "metrics.jsonl")
  lines = open(p).read().splitlines(keepends=True)
  lines = {"missing": lines[:1] + lines[2:], "duplicate": lines[:2] + lines[1:],
           "garbage": lines[:1] + ["{not json\n"] + lines[2:]}[damage]
  open(p, "w").write("".join(lines))
  before = _snapshot(d)
  rc, err = _cli(["train", "--epochs", "4", "--out", d, "--resume"] + FLAGS, capsys)
  assert rc == 2 and p in err and "Traceback" not in err, err
  assert _snapshot(d) == before


@pytest.mark.parametrize("content", [b"", b"\x00garbage\xff" * 10, b"\x93\x01\x02\x03"])
def test_damaged_checkpoint_is_a_clear_error(ref, tmp_path, capsys, content):
  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  ck = os.path.join(d, "checkpoint.msgpack")
  open(ck, "wb").write(content)
  rc, err = _cli(["train", "--epochs", "4", "--out", d, "--resume"] + FLAGS, capsys)
  assert rc == 2 and ck in err and len(err.strip().splitlines()) == 1


def _flip(path, needle: bytes):
  """Flip one bit in the middle of the (unique) occurrence of ``needle`` in the file."""
  data = bytearray(open(path, "rb").read())
  at = data.find(needle)
  assert at > 0 and data.find(needle, at + 1) < 0
  data[at + len(needle) // 2] ^= 0x10
  open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("where", ["array", "history", "truncated"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(ref, tmp_path, capsys, where):
  """A flipped bit inside a parameter array (msgpack still reads it: only the checksum can
  tell), inside the stored history, or a truncated file: refused before anything changes."""
  import struct

  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  ck = os.path.join(d, "checkpoint.msgpack")
  kernel = "['params']['Dense_0']['kernel']"
  if where == "array":
    _flip(ck, np.asarray(_state(d)["state"][kernel]).tobytes())
    from flax import serialization

    serialization.msgpack_restore(open(ck, "rb").read())  # still a readable msgpack file
  elif where == "history":
    _flip(ck, b"\xcb" + struct.pack(">d", _state(d)["history"][1]["train_loss"]))
  else:
    data = open(ck, "rb").read()
    open(ck, "wb").write(data[:len(data) // 2])
  before = _snapshot(d)
  rc, err = _cli(["train", "--epochs", "4", "--out", d, "--resume"] + FLAGS, capsys)
  assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  assert ck in err
  if where == "array":
    assert f"the array {kernel} does not match the SHA-256" in err and "--overwrite" in err
  elif where == "history":
    assert "history does not match the SHA-256" in err
  else:
    assert "damaged or truncated" in err
  assert _snapshot(d) == before


def test_a_version_1_checkpoint_loads_unverified_with_a_note(ref, tmp_path):
  """Checkpoints written before the checksums (format version 1) still resume, with a note;
  the next checkpoint is version 2."""
  import io

  from flax import serialization

  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  ck = _state(d)
  del ck["checksums"]
  ck["version"] = 1
  open(os.path.join(d, "checkpoint.msgpack"), "wb").write(serialization.msgpack_serialize(ck))
  log = io.StringIO()
  hist = train(TrainConfig(epochs=3, out=d, resume=True, **(COMMON | {"quiet": False})),
               stream=log)
  assert "format version 1" in log.getvalue() and "unverified" in log.getvalue()
  assert _strip(hist) == _strip(_metrics(ref))
  train(TrainConfig(epochs=4, out=d, resume=True, **COMMON))
  assert _state(d)["version"] == 2 and _state(d)["epoch"] == 4


def test_checksums_cover_every_array(ref):
  ck = _state(ref)
  assert sorted(ck["checksums"]["state"]) == sorted(ck["state"])
  for k, v in ck["state"].items():
    assert ck["checksums"]["state"][k] == _runs.array_sha256(v)
  assert ck["checksums"]["record"] == _runs.record_sha256(ck["epoch"], ck["step"],
                                                           ck["history"])


def test_resume_without_the_checkpoint_names_the_checkpoint(ref, tmp_path, capsys):
  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  ck = os.path.join(d, "checkpoint.msgpack")
  os.remove(ck)
  before = _snapshot(d)
  rc, err = _cli(["train", "--epochs", "4", "--out", d, "--resume"] + FLAGS, capsys)
  assert rc == 2 and len(err.strip().splitlines()) == 1, err
  assert f"--resume: {ck} is missing" in err and "records 3 finished epochs" in err
  assert _snapshot(d) == before


def test_checkpoint_of_another_configuration_is_refused(ref, tmp_path):
  d = str(tmp_path / "r")
  shutil.copytree(ref, d)
  ck = os.path.join(d, "checkpoint.msgpack")
  t = Trainer(TrainConfig(**(COMMON | {"seed": 4})))
  with pytest.raises(ValueError, match="another configuration.*--seed"):
    t.load_checkpoint(ck)


def test_legacy_pickle_needs_the_opt_in_and_migrates(ref, tmp_path, capsys):
  # a run folder of an older jaxlp: checkpoint.pkl after epoch 2, config.json with tile 24
  d = str(tmp_path / "old")
  os.makedirs(d)
  cfg = TrainConfig(epochs=2, **COMMON)
  t = Trainer(cfg)
  hist = [t.run_epoch(), t.run_epoch()]
  with open(os.path.join(d, "checkpoint.pkl"), "wb") as f:
    pickle.dump(t.state_dict(), f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(h) + "\n" for h in hist))
  old_cfg = _runs.recorded_config(cfg) | {"tile": 24, "out": d, "resume": False}
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(old_cfg, f)
  rc, err = _cli(["train", "--epochs", "3", "--out", d, "--resume"] + FLAGS, capsys)
  assert rc == 2 and "checkpoint.pkl" in err and "--migrate-pickle" in err
  assert not os.path.exists(os.path.join(d, "checkpoint.msgpack"))
  rc, err = _cli(["train", "--epochs", "3", "--out", d, "--resume", "--migrate-pickle"]
                 + FLAGS, capsys)
  assert rc == 0, err
  _assert_same_run(d, ref)


def test_typed_prng_keys_and_optax_namedtuples_round_trip():
  tx = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  tree = {"opt": tx.init(params), "key": jax.random.split(jax.random.key(7), 3),
          "rbg": jax.random.key(1, impl="rbg"), "none": None}
  flat = _runs.flatten_state(tree)
  from flax import serialization

  flat = serialization.msgpack_restore(serialization.msgpack_serialize(flat))
  target = {"opt": tx.init({"w": np.zeros((2, 3), np.float32)}),
            "key": jax.random.split(jax.random.key(0), 3),
            "rbg": jax.random.key(0, impl="rbg"), "none": None}
  back = _runs.unflatten_state(flat, target, "f")
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
  assert type(back["opt"][1][0]).__name__ == "TraceState"
  for name in ("key", "rbg"):
    assert jax.dtypes.issubdtype(back[name].dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(back[name]) == jax.random.key_impl(tree[name])
    np.testing.assert_array_equal(jax.random.key_data(back[name]),
                                  jax.random.key_data(tree[name]))
  with pytest.raises(ValueError, match="f: .*shape"):
    _runs.unflatten_state(flat, target | {"key": jax.random.split(jax.random.key(0), 4)}, "f")


def test_crash_during_checkpoint_write_resumes_to_the_same_bits(ref, tmp_path, monkeypatch):
  """os.replace fails at the second epoch's checkpoint (after its metrics line was appended,
  with a half-written temporary file); then a torn metrics line as a crash mid-append leaves
  it. Resuming gives the uninterrupted run's bits."""
  d = str(tmp_path / "r")
  real_replace, calls = os.replace, []

  def failing_replace(src, dst):
    if dst.endswith("checkpoint.msgpack"):
      calls.append(dst)
      if len(calls) == 2:
        with open(src, "r+b") as f:
          f.truncate(100)
        raise OSError("simulated crash")
    return real_replace(src, dst)

  monkeypatch.setattr(os, "replace", failing_replace)
  with pytest.raises(OSError, match="simulated"):
    train(TrainConfig(epochs=3, out=d, **COMMON))
  monkeypatch.setattr(os, "replace", real_replace)
  assert [m["epoch"] for m in _metrics(d)] == [1, 2] and _state(d)["epoch"] == 1
  with open(os.path.join(d, "metrics.jsonl"), "a") as f:
    f.write('{"epoch": 3, "train_lo')  # torn line of a later crash
  with pytest.raises(ValueError, match="already holds a run"):
    train(TrainConfig(epochs=3, out=d, **COMMON))
  import io

  log = io.StringIO()
  train(TrainConfig(epochs=3, out=d, resume=True, **(COMMON | {"quiet": False})), stream=log)
  assert "repaired" in log.getvalue() and "metrics.jsonl" in log.getvalue()
  _assert_same_run(d, ref)


def test_killed_process_resumes_to_the_same_bits(ref, tmp_path):
  """SIGKILL `jaxlp train` at a random point after its first epoch (seeded: with seed 15 the
  kill lands in epoch 3, after epoch 2's checkpoint); the resume continues to the
  uninterrupted run's bits. (Crashes between the metrics append and the checkpoint, inside
  the checkpoint write and mid-append are injected deterministically in the test above.)"""
  d = str(tmp_path / "r")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             **FAST_COMPILE)
  rng = random.Random(15)
  for _ in range(1):
    resume = ["--resume"] if os.path.exists(os.path.join(d, "config.json")) else []
    mp = os.path.join(d, "metrics.jsonl")
    n0 = open(mp, "rb").read().count(b"\n") if os.path.exists(mp) else 0
    p = subprocess.Popen([sys.executable, "-m", "jaxlp", "train", "--epochs", "3", "--out", d]
                         + resume + FLAGS, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    t_end = time.time() + 120
    while p.poll() is None and time.time() < t_end:  # wait for a new epoch's line
      if os.path.exists(mp) and open(mp, "rb").read().count(b"\n") > n0:
        break
      time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.05))
    if p.poll() is None:
      p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode in (0, -signal.SIGKILL), p.stderr.read().decode()[-2000:]
  train(TrainConfig(epochs=3, out=d, resume=True, **COMMON))
  _assert_same_run(d, ref)
