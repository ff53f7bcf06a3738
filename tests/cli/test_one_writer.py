"""One writer per run folder (issue 49): the lock on ``--out``, an ``--overwrite`` that keeps
the old run until the new one has its first checkpoint, ``jaxlp compare``'s configuration
names, and Ctrl-C as one line that says how to resume. The concurrency and Ctrl-C cases run
real ``jaxlp`` processes."""

import glob
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
from _bench import FAST_COMPILE

from jaxlp.cli import main
from jaxlp.training import TrainConfig, Trainer, _runs, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = dict(nodes=2, devices=1, width=2, batch_size=16, max_steps_per_epoch=2, seed=3,
              quiet=True)
FLAGS = ["--nodes", "2", "--devices", "1", "--width", "2", "--batch-size", "16",
         "--max-steps-per-epoch", "2", "--seed", "3", "--quiet"]
# XLA's optimizations off, in this process (tests/conftest.py, ``fast_compile``) and in the
# ``jaxlp`` processes (tests/_bench.py, ``FAST_COMPILE``): the tests check locks, folders,
# messages and exit codes, never bits
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **FAST_COMPILE)
pytestmark = pytest.mark.usefixtures("fast_compile")


def _cli(argv, capsys):
  """(exit code, stderr) of ``jaxlp ARGV`` in this process."""
  try:
    rc = main(argv)
  except SystemExit as e:
    rc = e.code
  return rc, capsys.readouterr().err


def _one_line(err):
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in err, err
  return lines[0]


def _snapshot(d):
  """Every file under ``d`` (hidden ones too) with its bytes."""
  out = {}
  for root, _, files in os.walk(d):
    for n in files:
      p = os.path.join(root, n)
      out[os.path.relpath(p, d)] = open(p, "rb").read()
  return out


def _epochs(d):
  with open(os.path.join(d, "metrics.jsonl")) as f:
    return [json.loads(line)["epoch"] for line in f]


def _saved_epoch(d):
  from flax import serialization

  with open(os.path.join(d, "checkpoint.msgpack"), "rb") as f:
    return serialization.msgpack_restore(f.read())["epoch"]


def _wait(what, cond, p=None, timeout=180):
  t_end = time.time() + timeout
  while time.time() < t_end:
    if cond():
      return
    if p is not None and p.poll() is not None:
      pytest.fail(f"the process ended (rc {p.returncode}) before {what}: "
                  f"{p.stderr.read().decode()[-2000:]}")
    time.sleep(0.02)
  pytest.fail(f"timed out waiting for {what}")


def _holds_lock(d, pid):
  try:
    with open(os.path.join(d, _runs.LOCK)) as f:
      return f.read().strip() == str(pid)
  except OSError:
    return False


def _sigint_default():
  """In the child, before ``exec``: SIGINT at its default action, as a shell leaves it for a
  command run in the foreground. A child inherits an ignored SIGINT (and Python then keeps it
  ignored, as ``nohup`` wants): a test run started in the background by a non-interactive shell
  (``pytest ... &``) has SIGINT ignored, and so had every ``jaxlp`` started here, which then
  trained on after the test's SIGINT (measured twice: the stacks below showed the loop still
  saving checkpoints 300 s later)."""
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def _jaxlp(args):
  # -X faulthandler: a process that does not end can be made to print every thread's Python
  # stack (SIGABRT, see _end_after_sigint); nothing else changes
  return subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "jaxlp"] + args, env=ENV,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          preexec_fn=_sigint_default)


def _end_after_sigint(p, timeout=300):
  """Send SIGINT to ``p`` and return its stderr once it has ended. A process still running
  after ``timeout`` seconds (a generous bound: on the loaded 2-core CI machine the whole exit
  takes seconds) is a failure that shows where it hangs: SIGABRT makes faulthandler print every
  thread's stack."""
  p.send_signal(signal.SIGINT)
  try:
    return p.communicate(timeout=timeout)[1].decode()
  except subprocess.TimeoutExpired:
    p.send_signal(signal.SIGABRT)
    try:
      err = p.communicate(timeout=60)[1].decode()
    except subprocess.TimeoutExpired:
      p.kill()
      err = p.communicate()[1].decode()
    pytest.fail(f"jaxlp train did not end within {timeout} s of SIGINT; its stacks:\n"
                f"{err[-6000:]}")


@pytest.fixture(scope="session")
def run(tmp_path_factory):
  """A finished 2-epoch run."""
  d = str(tmp_path_factory.mktemp("run") / "r")
  train(TrainConfig(epochs=2, out=d, **COMMON))
  return d


# -- the lock ------------------------------------------------------------------------------
def test_lock_refuses_a_second_writer_and_leaves_nothing_behind(tmp_path):
  d = str(tmp_path / "a" / "b")
  with _runs.RunLock(d):
    assert _holds_lock(d, os.getpid())
    with pytest.raises(ValueError, match=re.escape(
        f"--out {d} is in use by another jaxlp run (pid {os.getpid()}); wait for it")):
      _runs.RunLock(d).acquire()
    with pytest.raises(ValueError, match="is in use"):  # train takes the same lock
      train(TrainConfig(epochs=1, out=d, **COMMON))
  assert not os.path.exists(tmp_path / "a")  # the lock's own folders, empty: removed
  # a lock file left by a killed process holds no lock: reused
  os.makedirs(d)
  with open(os.path.join(d, _runs.LOCK), "w") as f:
    f.write("999999\n")
  with _runs.RunLock(d):
    assert _holds_lock(d, os.getpid())
  assert os.listdir(d) == []


def test_without_a_lock_backend_the_folder_is_used_with_a_warning(tmp_path, monkeypatch):
  """A platform with neither fcntl nor msvcrt: a RuntimeWarning says the folder is
  unprotected; the run folder works as before."""
  monkeypatch.setattr(_runs, "_fcntl", None)
  monkeypatch.setattr(_runs, "_msvcrt", None)
  d = str(tmp_path / "r")
  with pytest.warns(RuntimeWarning, match="no file locking on this platform"):
    with _runs.RunLock(d):
      assert os.path.isdir(d) and not os.path.exists(os.path.join(d, _runs.LOCK))
  assert not os.path.exists(d)


def test_a_refused_new_run_leaves_no_folder(tmp_path, capsys):
  d = str(tmp_path / "new")
  rc, err = _cli(["train", "--out", d, "--epochs", "1"] + FLAGS + ["--batch-size", "1440"],
                 capsys)
  assert rc == 2 and "--batch-size 1440" in _one_line(err)
  assert not os.path.exists(d)


def test_two_processes_on_one_folder_then_ctrl_c_and_resume(tmp_path, capsys):
  """Two `jaxlp train --out D`: the second is refused naming D and the first's pid. Then
  SIGINT ends the first with one line (exit 130) whose command resumes the run."""
  d = str(tmp_path / "r")
  p1 = _jaxlp(["train", "--out", d, "--epochs", "100000"] + FLAGS)
  try:
    _wait("the first run's lock", lambda: _holds_lock(d, p1.pid), p1)
    p2 = subprocess.run([sys.executable, "-m", "jaxlp", "train", "--out", d, "--epochs", "1"]
                        + FLAGS, env=ENV, capture_output=True, text=True, timeout=300)
    line = _one_line(p2.stderr)
    assert p2.returncode == 2 and line == (
        f"jaxlp train: error: --out {d} is in use by another jaxlp run (pid {p1.pid}); "
        "wait for it or choose another --out")
    _wait("an epoch", lambda: os.path.exists(os.path.join(d, "checkpoint.msgpack")), p1)
    err = _end_after_sigint(p1)
  finally:
    if p1.poll() is None:
      p1.kill()
      p1.wait()
  line = _one_line(err)
  assert p1.returncode == 130, err
  assert line.startswith("jaxlp train: interrupted at epoch ") and "saved in" in line, line
  cmd = shlex.split(line.split("; resume with: ")[1])
  assert cmd[:2] == ["jaxlp", "train"] and cmd[-1] == "--resume" and d in cmd
  assert not os.path.exists(os.path.join(d, _runs.LOCK))  # released with the process
  saved = _saved_epoch(d)
  cmd[cmd.index("--epochs") + 1] = str(saved + 1)  # the printed command, one epoch further
  rc, err = _cli(cmd[1:], capsys)
  assert rc == 0, err
  assert _epochs(d) == list(range(1, saved + 2))


def test_two_resumes_on_one_folder_and_a_killed_holder_leaves_no_lock(run, tmp_path, capsys):
  d = str(tmp_path / "r")
  shutil.copytree(run, d)
  p1 = _jaxlp(["train", "--out", d, "--resume", "--epochs", "100000"] + FLAGS)
  try:
    _wait("the first resume's lock", lambda: _holds_lock(d, p1.pid), p1)
    rc, err = _cli(["train", "--out", d, "--resume", "--epochs", "3"] + FLAGS, capsys)
    assert rc == 2 and f"--out {d} is in use by another jaxlp run (pid {p1.pid})" in \
        _one_line(err)
  finally:
    p1.kill()
    p1.wait()
  hist = train(TrainConfig(epochs=_saved_epoch(d) + 1, out=d, resume=True, **COMMON))
  assert [h["epoch"] for h in hist] == _epochs(d) == list(range(1, len(hist) + 1))


# -- --overwrite ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [["--batch-size", "1440"], ["--width", "100000"],
                                 ["--compress", "dgc:ratio=0.01"]])
def test_overwrite_checks_everything_before_touching_the_old_run(run, tmp_path, capsys, bad):
  """The issue's case (a batch larger than digits' 1,438 training images), a model that cannot
  fit in memory, a compressor refused with the default momentum: the old run is intact."""
  d = str(tmp_path / "r")
  shutil.copytree(run, d)
  before = _snapshot(d)
  rc, err = _cli(["train", "--out", d, "--overwrite", "--epochs", "1"] + FLAGS + bad, capsys)
  assert rc == 2 and bad[0] in _one_line(err)
  assert _snapshot(d) == before


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_overwrite_puts_the_old_run_back_when_the_new_one_stops_early(run, tmp_path,
                                                                      monkeypatch, exc):
  d = str(tmp_path / "r")
  shutil.copytree(run, d)
  before = _snapshot(d)

  def stop(self, progress=None):
    # the old run is set aside while the new one runs, not deleted
    assert os.listdir(glob.glob(os.path.join(d, _runs.ASIDE + "*"))[0])
    assert not os.path.exists(os.path.join(d, "checkpoint.msgpack"))
    raise exc("stop")

  monkeypatch.setattr(Trainer, "run_epoch", stop)
  with pytest.raises(exc) as e:
    train(TrainConfig(epochs=1, out=d, overwrite=True, **(COMMON | {"seed": 4})))
  assert _snapshot(d) == before
  if exc is KeyboardInterrupt:
    assert isinstance(e.value, _runs.Interrupted) and not e.value.resumable
    assert "back in" in e.value.note


def test_overwrite_replaces_the_old_run_once_its_first_checkpoint_exists(run, tmp_path,
                                                                          monkeypatch):
  d = str(tmp_path / "r")
  shutil.copytree(run, d)
  real, calls = Trainer.run_epoch, []

  def second_fails(self, progress=None):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("stop")
    return real(self, progress)

  monkeypatch.setattr(Trainer, "run_epoch", second_fails)
  with pytest.raises(RuntimeError):
    train(TrainConfig(epochs=2, out=d, overwrite=True, **(COMMON | {"seed": 4})))
  assert json.load(open(os.path.join(d, "config.json")))["seed"] == 4
  assert _epochs(d) == [1] and _saved_epoch(d) == 1
  assert sorted(os.listdir(d)) == ["checkpoint.msgpack", "config.json", "metrics.jsonl"]


def test_a_killed_overwrite_is_finished_by_the_next_writer(run, tmp_path):
  # killed before the new run's first checkpoint: the old run comes back
  d = str(tmp_path / "r")
  shutil.copytree(run, d)
  before = _snapshot(d)
  _runs.move_aside(d, _runs.holds_run(d))
  open(os.path.join(d, "config.json"), "w").write('{"seed": 4}')  # the new run's start
  open(os.path.join(d, "metrics.jsonl"), "w").write("")
  log = io.StringIO()
  hist = train(TrainConfig(epochs=2, out=d, resume=True, **(COMMON | {"quiet": False})),
               stream=log)
  assert "restored the run" in log.getvalue() and [h["epoch"] for h in hist] == [1, 2]
  assert _snapshot(d) == before
  # killed after it: the set-aside run is deleted
  os.makedirs(os.path.join(d, _runs.ASIDE + "12345"))
  open(os.path.join(d, _runs.ASIDE + "12345", "config.json"), "w").write("{}")
  train(TrainConfig(epochs=2, out=d, resume=True, **COMMON))
  assert _snapshot(d) == before


# -- jaxlp compare -------------------------------------------------------------------------
@pytest.mark.parametrize("configs,needle", [
    (["a=", "a=--lr 0.1"], "'a' is given twice"),
    (["x+y=", "x_y="], "'x_y' and 'x+y' would share the run folder"),
    (["fp32=", "FP32=--lr 0.1"], "would share the run folder"),
    (["..="], "may not start with '.'"),
    (["a/../..="], "may not contain /"),
    (["/tmp/abs="], "may not contain /"),
    (["=--lr 0.1"], "empty"),
    (["summary.json="], "summary.json is a file compare writes"),
    (["ok=", "bad=--grad-exp 99 --grad-man 2"], "--config bad: --grad-exp 99"),
])
def test_compare_refuses_names_and_configurations_before_any_run(tmp_path, capsys, configs,
                                                                 needle):
  out = str(tmp_path / "cmp")
  argv = ["compare", "--out", out, "--no-plot"]
  for c in configs:
    argv += ["--config", c]
  rc, err = _cli(argv + ["--", "--epochs", "1"] + FLAGS[:-1], capsys)
  line = _one_line(err)
  assert rc == 2 and line.startswith("jaxlp compare: error: --config") and needle in line, line
  assert not os.path.exists(out)  # nothing ran, nothing was written


def test_compare_ctrl_c_then_resume_reuses_the_finished_runs(tmp_path, capsys, monkeypatch):
  out = str(tmp_path / "cmp")
  argv = ["compare", "--out", out, "--no-plot", "--config", "a=", "--config", "b=--lr 0.1",
          "--", "--epochs", "1"] + FLAGS[:-1]
  real, calls = Trainer.run_epoch, []

  def interrupt_b(self, progress=None):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(self, progress)

  monkeypatch.setattr(Trainer, "run_epoch", interrupt_b)
  rc, err = _cli(argv, capsys)
  line = _one_line(err)
  assert rc == 130 and line.startswith(
      "jaxlp compare: interrupted at epoch 1 of configuration b; resume with: "), line
  cmd = shlex.split(line.split("resume with: ")[1])
  assert cmd[:3] == ["jaxlp", "compare", "--resume"] and cmd[3:] == argv[1:]
  monkeypatch.setattr(Trainer, "run_epoch", real)
  a_metrics = open(os.path.join(out, "a", "metrics.jsonl")).read()
  rc, err = _cli(cmd[1:], capsys)
  assert rc == 0, err
  assert open(os.path.join(out, "a", "metrics.jsonl")).read() == a_metrics  # reused
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert [s["config"] for s in summary] == ["a", "b"] and _epochs(os.path.join(out, "b")) == [1]
  assert not glob.glob(os.path.join(out, "**", _runs.LOCK), recursive=True)


# -- Ctrl-C in process: the message of each case -------------------------------------------
@pytest.mark.parametrize("case", ["no-out", "before-training", "overwrite"])
def test_ctrl_c_says_what_was_kept(run, tmp_path, capsys, monkeypatch, case):
  def interrupt(*a, **k):
    raise KeyboardInterrupt

  d = str(tmp_path / "r")
  argv = ["train", "--epochs", "1"] + FLAGS
  if case == "no-out":
    monkeypatch.setattr(Trainer, "run_epoch", interrupt)
    want = "jaxlp train: interrupted at epoch 1 (no --out: nothing was saved)"
  elif case == "before-training":
    from jaxlp.training import _data

    monkeypatch.setattr(_data, "load", interrupt)
    argv += ["--out", d]
    want = f"jaxlp train: interrupted before training started; nothing was written to {d}"
  else:
    shutil.copytree(run, d)
    monkeypatch.setattr(Trainer, "run_epoch", interrupt)
    argv += ["--out", d, "--overwrite", "--lr", "0.1"]
    want = (f"jaxlp train: interrupted at epoch 1; the run that --overwrite was replacing is "
            f"back in {d}")
  rc, err = _cli(argv, capsys)
  assert rc == 130 and _one_line(err) == want
  if case == "before-training":
    assert not os.path.exists(d)


def test_reproduce_ctrl_c_then_the_same_command_continues(tmp_path, capsys, monkeypatch):
  from jaxlp.training import CLAIMS, Claim, Setting

  # a claim of one fp32 run: the command's whole path at the least cost
  monkeypatch.setitem(CLAIMS, "tiny", Claim("tiny", "test", "fp32 trains.", (
      Setting("MLP, 2 workers", {"model": "mlp", "nodes": 2, "epochs": 1}, ()),)))
  argv = ["reproduce", "tiny", "--toy", "--seeds", "0", "--no-plot", "--out", str(tmp_path)]

  def interrupt(self, progress=None):
    raise KeyboardInterrupt

  real = Trainer.run_epoch
  monkeypatch.setattr(Trainer, "run_epoch", interrupt)
  rc, err = _cli(argv, capsys)
  line = _one_line(err)
  assert rc == 130 and line.startswith("jaxlp reproduce: interrupted at epoch 1 of the run in ")
  assert line.endswith("; resume with: jaxlp " + shlex.join(argv)), line
  monkeypatch.setattr(Trainer, "run_epoch", real)
  rc, err = _cli(argv, capsys)
  assert rc == 0, err
  assert json.load(open(tmp_path / "tiny" / "summary.json"))["settings"][0]["rows"][0]["label"] \
      == "fp32"
