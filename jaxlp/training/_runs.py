"""Run folders of :func:`jaxlp.training.train`: a record that is never silently changed.

A run folder holds

* ``config.json`` -- the run's configuration (every :class:`TrainConfig` field that defines
  the run, plus ``n_params`` and ``wire_bytes_per_step``), written atomically;
* ``metrics.jsonl`` -- one JSON line per finished epoch, appended (and fsynced) before that
  epoch's checkpoint is written;
* ``checkpoint.msgpack`` -- the training state after the last finished epoch, in
  ``flax.serialization``'s msgpack format (no code runs on load; readable without jaxlp:
  ``flax.serialization.msgpack_restore(open(path, "rb").read())``), written atomically
  (temporary file, fsync, ``os.replace``). It holds a format name and version, the
  configuration it belongs to (and its SHA-256), the epoch and step, the metrics history
  and the state: a flat map from ``jax.tree_util.keystr`` paths to arrays. Typed PRNG keys
  are stored as ``{"prng_impl": name, "key_data": uint32 array}`` and re-wrapped on load.
  Format version 2 adds ``checksums``: the SHA-256 of every state array (over its dtype,
  shape and bytes; :func:`array_sha256`) and of the epoch, step and history
  (:func:`record_sha256`). Every read verifies them, so a damaged file is refused naming the
  file and the array instead of resuming from changed weights. Version-1 files (no
  checksums) are still read, unverified, with a note; the next checkpoint is version 2.
* ``.lock`` -- while a run writes the folder: the writer's pid, under an OS advisory lock
  (:class:`RunLock`; ``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows), released by
  the OS when the process ends, so a second writer is refused and a killed one leaves no
  stale lock.
* ``.replaced-PID/`` -- while ``--overwrite`` runs: the run it replaces, set aside
  (:func:`move_aside`) until the new run's first checkpoint exists, and put back if the new
  run fails or is interrupted before it (also by the next writer, if the process was
  killed: :func:`recover_aside`).

Resuming checks the configuration against ``config.json`` and the checkpoint before writing
anything, restores the state into the trainer's freshly built state (so optax's NamedTuples
come back), and validates ``metrics.jsonl`` against the checkpoint's history: the epochs
1..n of the checkpoint, optionally followed by the line (complete or torn) of an epoch n + 1
whose checkpoint was never written -- that tail is dropped (the epoch is recomputed with the
same bits). Anything else is refused with a message naming the file.

Checkpoints of older jaxlp versions (``checkpoint.pkl``, a pickle) are loaded only with
``migrate_pickle=True`` (``--migrate-pickle``): loading a pickle can run arbitrary code.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import hashlib
import json
import os
import pickle
import shutil
import time
import warnings
from typing import Any

import jax
import numpy as np

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.msgpack"
LEGACY_CHECKPOINT = "checkpoint.pkl"
LOCK = ".lock"
ASIDE = ".replaced-"
RUN_FILES = (CONFIG, METRICS, CHECKPOINT, LEGACY_CHECKPOINT)
FORMAT = "jaxlp-checkpoint"
VERSION = 2
#: Checkpoint format versions this jaxlp reads (1: before the checksums).
READABLE_VERSIONS = (1, 2)

try:  # the lock's backend: POSIX flock, Windows byte-range locks, or none (a warning)
  import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows
  _fcntl = None
try:
  import msvcrt as _msvcrt
except ImportError:
  _msvcrt = None

#: Fields that say how to run, not what the run is: never compared, not in config.json.
NOT_RECORDED = ("out", "resume", "overwrite", "migrate_pickle", "quiet")
#: Fields a resumed run may change (documented in TrainConfig and the README).
MAY_GROW = ("epochs",)


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


# -- files ---------------------------------------------------------------------------------
def atomic_write(path: str, data: bytes) -> None:
  """Write ``data`` to ``path`` through ``path.tmp``: write, flush, fsync, ``os.replace``
  (and fsync the folder, where the platform allows), so ``path`` is either the old or the
  new content, never a mix."""
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(d: str) -> None:
  try:
    fd = os.open(d, os.O_RDONLY)
  except OSError:  # pragma: no cover - platforms without directory fds
    return
  try:
    os.fsync(fd)
  except OSError:  # pragma: no cover
    pass
  finally:
    os.close(fd)


def append_line(path: str, line: str) -> None:
  """Append one line and fsync (a crash leaves at most a torn last line, repaired on
  resume)."""
  with open(path, "a") as f:
    f.write(line + "\n")
    f.flush()
    os.fsync(f.fileno())


def metrics_text(history: list[dict]) -> str:
  return "".join(json.dumps(h) + "\n" for h in history)


# -- one writer per run folder -------------------------------------------------------------
class RunLock:
  """An exclusive, advisory lock on a run folder for as long as a run writes it.

  ``with RunLock(folder):`` creates ``folder`` if needed (and its missing parents), opens
  ``folder/.lock``, locks it without waiting (``fcntl.flock(LOCK_EX | LOCK_NB)`` on POSIX,
  ``msvcrt.locking(LK_NBLCK)`` on Windows) and writes the process id into it. A second writer
  -- another process, or another run in this one -- is refused with a ValueError naming the
  folder and the holder's pid. The operating system releases the lock when the process ends,
  however it ends, so a killed run leaves no stale lock (a ``.lock`` file left behind holds
  no lock and is reused). On exit the lock file is removed, and so are the folders that were
  created for the lock if they are still empty (a run refused before it wrote anything leaves
  nothing behind). Where the platform has neither ``fcntl`` nor ``msvcrt`` the folder is used
  unlocked, with a RuntimeWarning.

  Args:
    folder: the run folder.
    flag: how the folder is named in messages (``--out``).
  """

  def __init__(self, folder: str, flag: str = "--out"):
    self.folder, self.flag = folder, flag
    self.path = os.path.join(folder, LOCK)
    self._fd = None
    self._created: list[str] = []

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()

  def acquire(self) -> None:
    folder = self.folder
    if os.path.exists(folder) and not os.path.isdir(folder):
      raise ValueError(f"{self.flag} {folder}: exists and is not a folder")
    d, missing = os.path.abspath(folder), []
    while not os.path.exists(d):
      missing.append(d)
      d = os.path.dirname(d)
    os.makedirs(folder, exist_ok=True)
    self._created = missing  # innermost first
    try:
      self._lock()
    except BaseException:
      self._remove_created()
      raise

  def _lock(self) -> None:
    if _fcntl is None and _msvcrt is None:  # exotic platforms
      warnings.warn(f"no file locking on this platform: nothing stops a second jaxlp process "
                    f"from writing {self.folder} at the same time", RuntimeWarning, stacklevel=3)
      return
    for _ in range(100):  # retried only while other writers remove the file under us
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        locked = self._try_lock(fd)
      except BaseException:
        os.close(fd)
        raise
      if not locked:
        os.close(fd)
        raise ValueError(f"{self.flag} {self.folder} is in use by another jaxlp run "
                         f"({self._holder()}); wait for it or choose another {self.flag}")
      try:  # the previous holder may have removed the file between our open and our lock
        same = os.path.samestat(os.fstat(fd), os.stat(self.path))
      except FileNotFoundError:
        same = False
      if same:
        break
      self._unlock(fd)
      os.close(fd)
    else:  # pragma: no cover - a file replaced 100 times in a row
      raise OSError(errno.EAGAIN, f"could not lock {self.path}")
    self._fd = fd
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, f"{os.getpid()}\n".encode())

  def _try_lock(self, fd) -> bool:
    busy = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK, errno.EDEADLK)
    try:
      if _fcntl is not None:
        _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
      else:  # pragma: no cover - Windows: lock one byte far past the pid (readable by others)
        os.lseek(fd, _WIN_LOCK_OFFSET, os.SEEK_SET)
        _msvcrt.locking(fd, _msvcrt.LK_NBLCK, 1)
    except OSError as e:
      if e.errno in busy:
        return False
      raise OSError(e.errno, f"cannot lock {self.path}: {e.strerror}") from None
    return True

  @staticmethod
  def _unlock(fd) -> None:
    try:
      if _fcntl is not None:
        _fcntl.flock(fd, _fcntl.LOCK_UN)
      elif _msvcrt is not None:  # pragma: no cover - Windows
        os.lseek(fd, _WIN_LOCK_OFFSET, os.SEEK_SET)
        _msvcrt.locking(fd, _msvcrt.LK_UNLCK, 1)
    except OSError:  # pragma: no cover - closing the file releases it anyway
      pass

  def _holder(self) -> str:
    for _ in range(50):  # the holder writes its pid right after locking
      try:
        with open(self.path, "rb") as f:
          text = f.read(32).decode("ascii", "replace").strip()
      except OSError:
        text = ""
      if text.isdigit():
        return f"pid {int(text)}"
      time.sleep(0.01)
    return "pid unknown"

  def release(self) -> None:
    fd, self._fd = self._fd, None
    if fd is not None:
      if _fcntl is not None:  # remove the file while holding the lock (see _lock's check)
        try:
          os.remove(self.path)
        except OSError:  # pragma: no cover
          pass
        self._unlock(fd)
        os.close(fd)
      else:  # pragma: no cover - Windows: an open file cannot be removed
        self._unlock(fd)
        os.close(fd)
        try:
          os.remove(self.path)
        except OSError:
          pass
    self._remove_created()

  def _remove_created(self) -> None:
    for d in self._created:  # innermost first; stops at the first folder that has content
      try:
        os.rmdir(d)
      except OSError:
        break
    self._created = []


_WIN_LOCK_OFFSET = 1 << 20  # msvcrt locks byte ranges; the pid is written at offset 0


# -- --overwrite: the old run is set aside until the new run's first checkpoint exists ------
def move_aside(out: str, names) -> str:
  """Move the run files ``names`` of ``out`` into ``out/.replaced-PID`` (same file system:
  renames only); returns that folder."""
  aside = os.path.join(out, f"{ASIDE}{os.getpid()}")
  os.makedirs(aside)
  for n in names:
    os.replace(os.path.join(out, n), os.path.join(aside, n))
  _fsync_dir(aside)
  _fsync_dir(out)
  return aside


def restore_aside(out: str, aside: str) -> None:
  """Put the run set aside by :func:`move_aside` back into ``out``, removing what a
  replacing run wrote there."""
  for n in RUN_FILES:
    for p in (os.path.join(out, n), os.path.join(out, n + ".tmp")):
      if os.path.exists(p):
        os.remove(p)
  for n in os.listdir(aside):
    os.replace(os.path.join(aside, n), os.path.join(out, n))
  os.rmdir(aside)
  _fsync_dir(out)


def discard_aside(aside: str) -> None:
  """Delete the replaced run (the replacing run has its first checkpoint)."""
  shutil.rmtree(aside, ignore_errors=True)


def recover_aside(out: str) -> str | None:
  """Finish an ``--overwrite`` whose process was killed (called under the folder's lock).

  A set-aside run next to a checkpoint of the replacing run is deleted (the replacement had
  committed); without one it is put back (the replacement never reached its first
  checkpoint). Returns a note saying what was done, or None."""
  found = sorted(glob.glob(os.path.join(glob.escape(out), ASIDE + "*")))
  if not found:
    return None
  if os.path.exists(os.path.join(out, CHECKPOINT)):
    for a in found:
      discard_aside(a)
    return (f"removed {', '.join(found)}: the run that an earlier --overwrite replaced (the "
            "replacing run had written its first checkpoint)")
  restore_aside(out, found[0])
  for a in found[1:]:  # pragma: no cover - only one replacement runs at a time
    discard_aside(a)
  return (f"restored the run in {out} that an interrupted --overwrite had set aside in "
          f"{found[0]} (the replacing run never wrote a checkpoint)")


class Interrupted(KeyboardInterrupt):
  """A run stopped by Ctrl-C (SIGINT); still a KeyboardInterrupt.

  Attributes:
    out: the run folder, or None.
    epoch: the epoch that was running (1-based), or 0 before training started.
    saved: the finished epochs saved in ``out`` (its checkpoint).
    resumable: whether ``out`` holds this run, so that resuming it continues it.
    note: what happened to the folder, for the message.
  """

  def __init__(self, out, epoch, saved, resumable, note=""):
    super().__init__(out, epoch, saved, resumable, note)
    self.out, self.epoch, self.saved = out, epoch, saved
    self.resumable, self.note = resumable, note

  def __str__(self):
    where = f" (epochs 1..{self.saved} saved in {self.out})" if self.saved else ""
    return f"interrupted at epoch {self.epoch}{where}" + (f"; {self.note}" if self.note else "")


# -- configuration -------------------------------------------------------------------------
def recorded_config(cfg) -> dict:
  """The fields of ``cfg`` that define the run (what config.json records)."""
  return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_RECORDED}


def config_hash(rec: dict) -> str:
  """SHA-256 of the recorded configuration without the fields a resume may change."""
  ident = {k: v for k, v in rec.items() if k not in MAY_GROW}
  return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _norm(name, value):
  if name == "tile" and value is None:
    return 24  # TrainConfig.tile None = the default tile (24) of earlier config files
  return value


def config_differences(cfg, stored: dict, defaults) -> list[str]:
  """The fields where ``cfg`` differs from a stored configuration (``stored`` may come from
  an older jaxlp without some fields: those count as their defaults)."""
  diffs = []
  for f in dataclasses.fields(cfg):
    k = f.name
    if k in NOT_RECORDED or k in MAY_GROW:
      continue
    old = stored.get(k, getattr(defaults, k))
    new = getattr(cfg, k)
    if _norm(k, old) != _norm(k, new):
      diffs.append(f"{_flag(k)} {new!r} (the run has {old!r})")
  return diffs


def read_json(path: str) -> Any:
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e}); the run folder is damaged") from None


def continue_or_replace(cfg, overwrite: bool):
  """``cfg`` set to continue the run in its folder when there is one (``resume``), or -- with
  ``overwrite`` -- to replace it when its ``config.json`` records another configuration (or
  cannot be read). Without a run in the folder, ``cfg`` with ``overwrite``. For commands that
  run many configurations (``jaxlp compare --resume``, ``jaxlp reproduce``): a finished run is
  reused, an interrupted one continues; :func:`jaxlp.training.train` checks everything again
  under the folder's lock."""
  if not os.path.exists(os.path.join(cfg.out, CONFIG)):
    return dataclasses.replace(cfg, resume=False, overwrite=overwrite)
  try:
    stored = read_json(os.path.join(cfg.out, CONFIG))
    differs = not isinstance(stored, dict) or bool(config_differences(cfg, stored, type(cfg)()))
  except (OSError, ValueError):
    differs = True
  replace = overwrite and differs
  return dataclasses.replace(cfg, resume=not replace, overwrite=replace)


def holds_run(out: str) -> list[str]:
  """The run files present in folder ``out``."""
  if not os.path.isdir(out):
    return []
  return [n for n in (CONFIG, METRICS, CHECKPOINT, LEGACY_CHECKPOINT)
          if os.path.exists(os.path.join(out, n))]


def check_out(cfg) -> list[str]:
  """Validate ``cfg.out`` against what the folder holds, before anything is written.

  Returns the run files present. Raises ValueError naming the folder and the flag."""
  out = cfg.out
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"--out {out}: exists and is not a folder")
  if cfg.resume and cfg.overwrite:
    raise ValueError("give either --resume or --overwrite, not both")
  if cfg.migrate_pickle and not cfg.resume:
    raise ValueError("--migrate-pickle converts the checkpoint of a run being resumed: it "
                     "needs --resume")
  present = holds_run(out)
  if present and not (cfg.resume or cfg.overwrite):
    raise ValueError(f"--out {out} already holds a run ({', '.join(present)}); pass --resume "
                     "to continue it or --overwrite to replace it")
  if cfg.resume:
    if CONFIG not in present:
      raise ValueError(f"--resume: {out} holds no run (no {CONFIG})")
    stored = read_json(os.path.join(out, CONFIG))
    if not isinstance(stored, dict):
      raise ValueError(f"{os.path.join(out, CONFIG)} is not a configuration (a JSON object)")
    diffs = config_differences(cfg, stored, type(cfg)())
    if diffs:
      raise ValueError(f"--resume: the flags differ from the run in {out} ({CONFIG}): "
                       f"{'; '.join(diffs)}. A resumed run keeps its configuration (only "
                       "--epochs may grow); start a new run in another folder instead")
  return present


# -- checkpoints ---------------------------------------------------------------------------
def _is_key(x) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def flatten_state(tree) -> dict:
  """``{keystr(path): array}`` of a pytree; typed PRNG keys as key data + impl name."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    k = jax.tree_util.keystr(path)
    if _is_key(leaf):
      flat[k] = {"prng_impl": str(jax.random.key_impl(leaf)),
                 "key_data": np.asarray(jax.random.key_data(leaf))}
    else:
      flat[k] = np.asarray(leaf)
  return flat


def unflatten_state(flat: dict, target, path: str):
  """Restore ``flat`` into the structure of ``target`` (same paths, shapes and dtypes, or a
  ValueError naming ``path``)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  keys = [jax.tree_util.keystr(p) for p, _ in leaves]
  if set(keys) != set(flat):
    missing = sorted(set(keys) - set(flat))[:3]
    extra = sorted(set(flat) - set(keys))[:3]
    raise ValueError(f"{path}: the checkpoint's state does not fit this run's model/optimizer "
                     f"(missing {missing}, unexpected {extra})")
  out = []
  for k, (_, ref) in zip(keys, leaves):
    v = flat[k]
    if _is_key(ref):
      if not isinstance(v, dict) or "key_data" not in v:
        raise ValueError(f"{path}: {k} should be a PRNG key")
      v = jax.random.wrap_key_data(np.asarray(v["key_data"]), impl=v["prng_impl"])
      ok = v.shape == ref.shape and str(jax.random.key_impl(v)) == str(jax.random.key_impl(ref))
    else:
      if isinstance(v, dict):
        raise ValueError(f"{path}: {k} is a PRNG key in the checkpoint, not in this run")
      v = np.asarray(v)
      ok = v.shape == np.shape(ref) and v.dtype == np.asarray(ref).dtype
    if not ok:
      raise ValueError(f"{path}: {k} has shape/dtype {v.shape}/{v.dtype}, this run expects "
                       f"{np.shape(ref)}/{ref.dtype}")
    out.append(v)
  return jax.tree_util.tree_unflatten(treedef, out)


def array_sha256(value) -> str:
  """SHA-256 (hex) of one state entry of a checkpoint: its dtype, shape and bytes (C order);
  for a typed PRNG key ``{"prng_impl", "key_data"}`` also the impl name."""
  h = hashlib.sha256()
  if isinstance(value, dict):
    h.update(b"prng_key:" + str(value["prng_impl"]).encode() + b"|")
    value = value["key_data"]
  a = np.ascontiguousarray(np.asarray(value))
  h.update(f"{a.dtype.str}|{a.shape}|".encode())
  h.update(a.tobytes())
  return h.hexdigest()


def record_sha256(epoch, step, history) -> str:
  """SHA-256 (hex) of a checkpoint's epoch, step and metrics history (as sorted JSON)."""
  return hashlib.sha256(json.dumps([epoch, step, history], sort_keys=True).encode()).hexdigest()


def checkpoint_bytes(rec: dict, epoch: int, step: int, history: list[dict], state) -> bytes:
  from flax import serialization

  flat = flatten_state(state)
  history = list(history)
  return serialization.msgpack_serialize({
      "format": FORMAT, "version": VERSION, "config": rec, "config_sha256": config_hash(rec),
      "epoch": int(epoch), "step": int(step), "history": history,
      "checksums": {"record": record_sha256(int(epoch), int(step), history),
                    "state": {k: array_sha256(v) for k, v in flat.items()}},
      "state": flat})


_NO_EARLIER = ("the file changed after it was written (disk or copy damage, or an edit); jaxlp "
               "keeps no earlier checkpoint, so the run cannot continue from it: restore the "
               "file from a backup, or start over with --overwrite")


def verify_checksums(ck: dict, path: str) -> None:
  """Check a version-2 checkpoint's ``checksums`` (ValueError naming ``path`` and the damaged
  entry)."""
  sums = ck.get("checksums")
  if not isinstance(sums, dict) or not isinstance(sums.get("state"), dict):
    raise ValueError(f"{path}: the checkpoint has no checksums (damaged); {_NO_EARLIER}")
  try:
    record_ok = record_sha256(ck["epoch"], ck["step"], ck["history"]) == sums.get("record")
  except (TypeError, ValueError):
    record_ok = False
  if not record_ok:
    raise ValueError(f"{path} is damaged: its epoch, step or metrics history does not match "
                     f"the SHA-256 stored with it; {_NO_EARLIER}")
  state, want = ck["state"], sums["state"]
  if not isinstance(state, dict) or set(state) != set(want):
    raise ValueError(f"{path} is damaged: its state entries differ from the ones its checksums "
                     f"list; {_NO_EARLIER}")
  for k in sorted(state):
    try:
      ok = array_sha256(state[k]) == want[k]
    except (KeyError, TypeError, ValueError):
      ok = False
    if not ok:
      raise ValueError(f"{path} is damaged: the array {k} does not match the SHA-256 stored "
                       f"with it; {_NO_EARLIER}")


def read_checkpoint(path: str) -> dict:
  """The checkpoint at ``path`` as a dict (validated format and fields, verified checksums).

  A version-1 checkpoint (no checksums) is returned unverified; the caller can tell by its
  ``version``."""
  from flax import serialization

  with open(path, "rb") as f:
    data = f.read()
  try:
    ck = serialization.msgpack_restore(data)
  except Exception as e:  # msgpack raises several types for damaged input
    raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e}); the file "
                     "is damaged or truncated") from None
  if not isinstance(ck, dict) or ck.get("format") != FORMAT:
    raise ValueError(f"{path} is not a jaxlp checkpoint")
  if ck.get("version") not in READABLE_VERSIONS:
    raise ValueError(f"{path}: checkpoint format version {ck.get('version')!r}; this jaxlp "
                     f"reads versions {', '.join(map(str, READABLE_VERSIONS))}")
  for k in ("config", "config_sha256", "epoch", "step", "history", "state"):
    if k not in ck:
      raise ValueError(f"{path}: the checkpoint has no {k!r}")
  try:
    config_ok = config_hash(ck["config"]) == ck["config_sha256"]
  except (TypeError, ValueError, AttributeError):
    config_ok = False
  if not config_ok:
    raise ValueError(f"{path}: the stored configuration does not match its hash (damaged)")
  if ck["version"] >= 2:
    verify_checksums(ck, path)
  check_history(ck["history"], int(ck["epoch"]), path)
  return ck


def check_history(history, n: int, path: str) -> None:
  if not isinstance(history, list) or [h.get("epoch") if isinstance(h, dict) else None
                                       for h in history] != list(range(1, n + 1)):
    raise ValueError(f"{path}: the metrics history is not the epochs 1..{n}")


def read_metrics_lines(path: str) -> tuple[list[dict], bool]:
  """(complete lines parsed, whether a torn last line was found). Raises naming the line."""
  if not os.path.exists(path):
    return [], False
  with open(path, "rb") as f:
    data = f.read()
  pieces = data.split(b"\n")
  torn = pieces[-1] != b""
  lines = []
  for i, raw in enumerate(pieces[:-1], 1):
    try:
      lines.append(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise ValueError(f"{path}: line {i} is not valid JSON; the metrics file is damaged "
                       "(restore it, or start over with --overwrite)") from None
  return lines, torn


def reconcile_metrics(path: str, history: list[dict]) -> str | None:
  """Validate ``metrics.jsonl`` against the checkpoint's ``history`` (epochs 1..n).

  Accepted: exactly the history, optionally followed by one line of epoch n + 1 and/or a
  torn last line (a crash between the append and the checkpoint); that tail is dropped by
  rewriting the file atomically. Returns a note on what was repaired, or None.
  Raises ValueError naming the file for anything else (a missing, duplicated, edited line).
  """
  lines, torn = read_metrics_lines(path)
  n = len(history)
  got = [h.get("epoch") if isinstance(h, dict) else None for h in lines]
  want = [h["epoch"] for h in history]
  head_ok = lines[:n] == history
  tail = lines[n:]
  tail_ok = len(tail) <= 1 and all(t.get("epoch") == n + 1 if isinstance(t, dict) else False
                                   for t in tail)
  if not head_ok or not tail_ok:
    raise ValueError(f"{path} does not match the checkpoint: it lists epochs {got}, the "
                     f"checkpoint's history is epochs {want}. The file was edited or damaged; "
                     "restore it, or start over with --overwrite")
  if tail or torn:
    atomic_write(path, metrics_text(history).encode())
    what = (["a partial line"] if torn else []) + ([f"the line of epoch {n + 1}"] if tail else [])
    return (f"repaired {path} from the checkpoint: dropped {' and '.join(what)} of an epoch "
            "whose checkpoint was never written (it is run again)")
  return None


def load_legacy_pickle(path: str):
  """A pre-msgpack checkpoint (only called with the explicit opt-in)."""
  try:
    with open(path, "rb") as f:
      return pickle.load(f)  # noqa: S301 - explicit opt-in (--migrate-pickle)
  except Exception as e:
    raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from None


