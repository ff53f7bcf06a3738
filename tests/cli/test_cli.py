"""End-to-end tests of the ``jaxlp`` command on built-in data (small and fast)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from _bench import FAST_COMPILE, xla_flags

from jaxlp.cli import main
from jaxlp.training import TrainConfig, train

FAST = ["--epochs", "2", "--max-steps-per-epoch", "4", "--batch-size", "64", "--quiet"]


def _metrics(d):
  with open(os.path.join(d, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_train_writes_outputs_and_is_deterministic(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  assert main(["train", "--nodes", "4", "--out", a] + FAST) == 0
  assert main(["train", "--nodes", "4", "--out", b] + FAST) == 0
  ma, mb = _metrics(a), _metrics(b)
  assert [m["epoch"] for m in ma] == [1, 2]
  for m in ma:
    assert set(m) >= {"epoch", "train_loss", "test_accuracy", "wire_bytes", "seconds"}
    assert 0.0 <= m["test_accuracy"] <= 1.0
  strip = lambda ms: [{k: v for k, v in m.items() if k != "seconds"} for m in ms]
  assert strip(ma) == strip(mb)
  cfg = json.load(open(os.path.join(a, "config.json")))
  assert cfg["nodes"] == 4 and cfg["model"] == "mlp"
  assert os.path.exists(os.path.join(a, "checkpoint.msgpack"))


def test_resume_equals_uninterrupted(tmp_path):
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  common = dict(nodes=2, batch_size=64, max_steps_per_epoch=3, quiet=True, seed=3)
  h_full = train(TrainConfig(epochs=3, out=full, **common))
  train(TrainConfig(epochs=1, out=part, **common))
  h_res = train(TrainConfig(epochs=3, out=part, resume=True, **common))
  strip = lambda ms: [{k: v for k, v in m.items() if k != "seconds"} for m in ms]
  assert strip(h_full) == strip(h_res)
  sf, sr = _checkpoint_state(full), _checkpoint_state(part)
  assert any(k.startswith("['params']") for k in sf)
  _assert_same_state(sf, sr)


def _checkpoint_state(d):
  """The saved training state of run folder ``d``, read with flax alone (the checkpoint is
  readable without jaxlp)."""
  from flax import serialization

  with open(os.path.join(d, "checkpoint.msgpack"), "rb") as f:
    return serialization.msgpack_restore(f.read())["state"]


def _assert_same_state(a, b):
  """The same entries with the same bits."""
  assert sorted(a) == sorted(b)
  for k in a:
    np.testing.assert_array_equal(np.asarray(a[k]).view(np.uint8),
                                  np.asarray(b[k]).view(np.uint8), err_msg=k)


@pytest.mark.parametrize("argv", [
    ["train", "--model", "nope"],
    ["train", "--nodes", "3", "--batch-size", "64"],
    ["train", "--aps"],
    ["train", "--grad-exp", "4"],
    ["train", "--data", "cifar10"],
    ["train", "--compress", "nosuch:bits=4"],
    ["train", "--compress", "cgx:algorithm=tree"],
    ["train", "--compress", "topk:schedule=tpu"],
    ["train", "--grad-format", "E9M9"],
    ["plot", "/nonexistent-dir"],
    ["frobnicate"],
])
def test_bad_input_exits_2(argv, capsys):
  with pytest.raises(SystemExit) as e:
    rc = main(argv)
    raise SystemExit(rc)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "error" in err


def test_help_is_complete(capsys):
  # the command's entry point (``python -m jaxlp``) in a process of its own; the subcommand's
  # help is the same parser's, in process
  out = subprocess.run([sys.executable, "-m", "jaxlp", "--help"], capture_output=True, text=True)
  assert out.returncode == 0
  for cmd in ("train", "compare", "plot", "plan", "bench", "formats"):
    assert cmd in out.stdout
  with pytest.raises(SystemExit) as e:
    main(["train", "--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  for flag in ("--model", "--data", "--data-dir", "--nodes", "--grad-exp", "--grad-man",
               "--grad-format", "--order", "--aps", "--kahan", "--lars", "--compress", "--hbfp",
               "--tile", "--policy", "--epochs", "--batch-size", "--lr", "--seed", "--out",
               "--resume"):
    assert flag in text, flag


def test_bench_is_the_benchmarks_front_door(capsys):
  # ``jaxlp bench`` hands its arguments to ``python -m benchmarks --run`` (whose runs are
  # tested in tests/test_benchmarks_front_door_smoke.py): an unknown name is the front door's
  # refusal, exit 2, naming it and listing the benchmarks.
  assert main(["bench", "--small", "--only", "no_such_bench"]) == 2
  err = capsys.readouterr().err
  assert "no benchmark named 'no_such_bench'" in err and "engine_compile" in err


@pytest.mark.usefixtures("fast_compile")  # two runs' metrics and plots, no bits
def test_compare_and_plot(tmp_path):
  out = str(tmp_path / "cmp")
  rc = main(["compare", "--out", out, "--config", "fp32=", "--config",
             "E4M3=--grad-exp 4 --grad-man 3", "--", "--nodes", "2"] + FAST[:-1])
  assert rc == 0
  for name in ("accuracy_vs_epoch.png", "accuracy_vs_wire_bytes.png"):
    p = os.path.join(out, name)
    assert os.path.getsize(p) > 1000
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert [s["config"] for s in summary] == ["fp32", "E4M3"]
  pdir = str(tmp_path / "plots")
  assert main(["plot", os.path.join(out, "fp32"), os.path.join(out, "E4M3"), "--out", pdir]) == 0
  assert os.path.getsize(os.path.join(pdir, "accuracy_vs_epoch.png")) > 1000


@pytest.mark.parametrize("lines,needle", [
    (['{"epoch": 1, "test_accuracy": 0.5}', "garbage"], "line 2 is not valid JSON"),
    (['{"epoch": 1, "test_accuracy": 0.5}', "[1, 2]"], "line 2 is not a JSON object"),
    (['{"epoch": 1}'], "line 1 has no numeric 'test_accuracy'"),
    (['{"epoch": 1, "test_accuracy": 0.5, "wire_bytes": "x"}'],
     "line 1 has no numeric 'wire_bytes'"),
])
def test_plot_names_the_file_and_line_of_damaged_metrics(tmp_path, capsys, lines, needle):
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  rc = main(["plot", str(run), "--out", str(tmp_path / "plots")])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert err.startswith(f"jaxlp plot: error: {run / 'metrics.jsonl'}: {needle}"), err


def test_plot_skips_a_torn_last_line(tmp_path):
  """A last line without its newline that does not parse is one being written (or torn by a
  crash; --resume repairs it): the plot shows the complete epochs."""
  from jaxlp.training import read_metrics

  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text('{"epoch": 1, "test_accuracy": 0.5}\n{"epoch": 2, "te')
  assert read_metrics(str(run)) == [{"epoch": 1, "test_accuracy": 0.5}]
  assert main(["plot", str(run), "--out", str(tmp_path / "plots")]) == 0


def test_formats_demo(capsys):
  assert main(["formats", "--values", "1.0625", "300"]) == 0
  out = capsys.readouterr().out
  assert "E4M3FN" in out and "448" in out


def _train_on_4_cpu_devices(args):
  """``jaxlp train ARGS`` where JAX's default backend has (at least) 4 CPU devices.

  ``jaxlp train --devices`` takes its devices from JAX's default backend. In this process
  that is the 8 forced CPU devices of tests/conftest.py on a CPU-only run (CI: run in process,
  sharing compiled functions between runs), but a single GPU under ``JAX_PLATFORMS=cuda,cpu``:
  then the run is a child process whose JAX has only 4 forced CPU devices.
  """
  if jax.default_backend() == "cpu" and jax.device_count() >= 4:
    assert main(args) == 0
    return
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  fast = FAST_COMPILE if jax.config.read("jax_disable_most_optimizations") else {}
  env = dict(os.environ, **fast, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"),
             PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  r = subprocess.run([sys.executable, "-m", "jaxlp"] + args, capture_output=True, text=True,
                     env=env, timeout=300)
  assert r.returncode == 0, f"{args}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def _devices_and_emulation(tmp_path, flags):
  """Workers spread over 2 (forced CPU) devices x 2 emulated, and the same run on one device
  (both runs on the CPU backend, see _train_on_4_cpu_devices): each run's (loss, accuracy) per
  epoch and its checkpointed state. (4 workers: the 1-bit ring's steps grow with the workers;
  8 cost the onebit case a third more CPU time, for the same property.)"""
  runs, states = [], []
  for d in ("1", "2"):
    out = str(tmp_path / d)
    _train_on_4_cpu_devices(["train", "--nodes", "4", "--devices", d, "--out", out] + FAST
                            + flags)
    runs.append([(m["train_loss"], m["test_accuracy"]) for m in _metrics(out)])
    states.append(_checkpoint_state(out))
  return runs, states


@pytest.mark.usefixtures("fast_compile")  # both runs compiled alike, compared within rel 1e-5
@pytest.mark.parametrize("flags", [[], ["--compress", "onebit:algorithm=ring,min_size=512"]])
def test_real_devices_equal_emulation(tmp_path, flags):
  """Plain lax.psum: XLA's fp32 summation order differs between the two layouts; and the
  per-worker gradients themselves come from batched (vmap) vs per-device matmuls, whose last
  bits differ -- compressed_allreduce's own layout-independence is tested in
  tests/parallel/compress (the 1-bit scale is an fp32 mean, so it carries those bits). The
  same run, then, within float32 rounding; XLA's optimizations off (tests/conftest.py,
  ``fast_compile``), both runs alike."""
  runs, _ = _devices_and_emulation(tmp_path, flags)
  for (l1, a1), (l2, a2) in zip(runs[0], runs[1]):
    assert l2 == pytest.approx(l1, rel=1e-5) and a2 == pytest.approx(a1, abs=0.01)


def test_real_devices_equal_emulation_bit_for_bit_with_aps(tmp_path):
  """jaxlp.parallel.psum is order-faithful and the 4-bit gradients absorb the last-bit
  differences of the per-worker gradients (test above): every parameter has the same bits
  (compiled normally: a claim on the production program). The reported loss is a lax.psum of
  per-worker losses from batched (vmap) vs per-device forward passes; with jax 0.12 it
  differed in the last bit (1.7664451003 vs 1.7664451897) while every parameter was the
  same."""
  runs, states = _devices_and_emulation(tmp_path, ["--grad-exp", "3", "--grad-man", "0",
                                                   "--aps"])
  _assert_same_state(*states)
  for (l1, a1), (l2, a2) in zip(runs[0], runs[1]):
    assert l2 == pytest.approx(l1, rel=1e-6) and a2 == a1


def test_bad_devices_is_a_clear_error(capsys):
  assert main(["train", "--nodes", "8", "--devices", "3"] + FAST) == 2
  assert "--devices" in capsys.readouterr().err


@pytest.mark.usefixtures("fast_compile")  # counts compiles, at any optimization level
@pytest.mark.parametrize("flags", [{}, {"compress": "cgx:bits=4,min_size=64"}])
def test_several_devices_compile_the_step_once(flags):
  """On several devices the state is placed where the compiled step leaves it before the
  first step: the step compiles once, not again on the second step (it did, for every run
  with more than one device). Also with the workers' compression state, split over them."""
  from jaxlp.training import Trainer

  if jax.device_count() < 2:
    pytest.skip("needs 2 devices of the default backend (a one-GPU machine has one)")
  t = Trainer(TrainConfig(nodes=2, width=1, batch_size=16, max_steps_per_epoch=2, quiet=True,
                          **flags))
  assert t.ndev == 2
  t.run_epoch()
  t.run_epoch()
  (step,) = t._train_steps.values()
  assert step._cache_size() == 1
