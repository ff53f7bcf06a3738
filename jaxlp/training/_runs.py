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
import hashlib
import json
import os
import pickle
from typing import Any

import jax
import numpy as np

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.msgpack"
LEGACY_CHECKPOINT = "checkpoint.pkl"
FORMAT = "jaxlp-checkpoint"
VERSION = 1

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


def checkpoint_bytes(rec: dict, epoch: int, step: int, history: list[dict], state) -> bytes:
  from flax import serialization

  return serialization.msgpack_serialize({
      "format": FORMAT, "version": VERSION, "config": rec, "config_sha256": config_hash(rec),
      "epoch": int(epoch), "step": int(step), "history": list(history),
      "state": flatten_state(state)})


def read_checkpoint(path: str) -> dict:
  """The checkpoint at ``path`` as a dict (validated format and fields)."""
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
  if ck.get("version") != VERSION:
    raise ValueError(f"{path}: checkpoint format version {ck.get('version')!r}; this jaxlp "
                     f"reads version {VERSION}")
  for k in ("config", "config_sha256", "epoch", "step", "history", "state"):
    if k not in ck:
      raise ValueError(f"{path}: the checkpoint has no {k!r}")
  if config_hash(ck["config"]) != ck["config_sha256"]:
    raise ValueError(f"{path}: the stored configuration does not match its hash (damaged)")
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


