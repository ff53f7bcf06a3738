"""Re-runs every case of issue 49 (library and jaxlp command): silent wrong, data loss, crash.

What it is for: the issue's deliverable 7, "the probe counts re-measured: 0 silent wrong, 0
data loss, 0 obscure crash". Each case is a small self-contained probe: library calls run in
this process; ``jaxlp`` command cases run the real command (``python -m jaxlp``, this checkout
first on ``PYTHONPATH``) as subprocesses in a temporary folder with tiny runs (the digits
set, one hidden unit group, one worker); the concurrency cases start two real processes at
once, the Ctrl-C cases send SIGINT to a real process.

Usage: python benchmarks/tools/reliability_probes.py [--only SUBSTR ...] [--list]
       [--jobs N] [--keep] [--json PATH]

Every probe states its oracle (the "expected" column) and ends with one verdict:

* ``ok``: the oracle holds (a right result, or a clear error: the right exception type with a
  message naming the argument/file/state; for the command, exit status 2 (130 for Ctrl-C)
  with ONE line on stderr naming the flag/file/folder, and no "Traceback");
* ``silent wrong``: a result that differs from the probe's oracle (or a bad input accepted);
* ``data loss``: a run folder changed, lost or mixed up;
* ``obscure crash``: another exception or exit status, a traceback, several lines, a message
  that names nothing the probe looks for, or a hang (a timeout).

The table has one row per probe (probe, expected, got, verdict), then the counts per verdict.
The exit status is 1 when a probe is not ok, 0 otherwise (2 for bad options).

The gradient oracles use small integer operands (every product and sum is exact in float32),
so ``jaxlp.matmul``'s documented default derivative (``grad="fp32"``: ``dA = g B^T``,
``dB = A^T g``, forward mode ``dA B + A dB``) must equal numpy's bit for bit. The compressor
probes run each of the 11 compressors with its default settings (named ``vmap`` of 4
workers, one (64, 64) leaf, ``min_size=1``): from the state of one clean step, the step with
the bad value (a NaN or ±inf at 18 places: workers 0, 1, 3, elements 0, 1, 5, 100, 2048,
4095 -- whether a reduction keeps a NaN depends on where it meets it), then a clean step
from the state the bad step left. The oracle is the engine's non-finite policy (issue 49,
deliverable 2): a NaN/inf anywhere makes the leaf's result non-finite on every worker (the
same bits everywhere), the state stays finite and the next clean step is finite; finite
values of ±3e38 give finite results (PowerSGD, whose unscaled products overflow there, may
give the documented NaN step instead).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

# keep this script's folder off sys.path: no script name may shadow a module a dependency imports
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
  sys.path.pop(0)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OK, WRONG, LOSS, CRASH = "ok", "silent wrong", "data loss", "obscure crash"
VERDICTS = (OK, WRONG, LOSS, CRASH)


class Probe(NamedTuple):
  name: str
  expected: str
  fn: Callable[[], tuple[str, str]]  # -> (got, verdict)
  cli: bool = False  # runs the command in subprocesses (may run beside the library probes)


PROBES: list[Probe] = []


def probe(name, expected, cli=False):
  def deco(fn):
    PROBES.append(Probe(name, expected, fn, cli))
    return fn
  return deco


def _line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:300]}"


def expect_error(fn, types, needles=()) -> tuple[str, str]:
  """``fn()`` must raise one of ``types`` with every string of ``needles`` in its message."""
  try:
    r = fn()
  except types as e:
    msg = str(e)
    missing = [n for n in needles if n not in msg]
    if missing:
      return f"{_line(e)} (names none of {missing})", CRASH
    return _line(e), OK
  except Exception as e:  # noqa: BLE001 - any other exception is the finding
    return _line(e), CRASH
  return f"no error; returned {_summary(r)}", WRONG


def _summary(r) -> str:
  s = " ".join(repr(r).split())
  return s[:160] + ("..." if len(s) > 160 else "")


# -- jaxlp.matmul / jaxlp.pallas.matmul ------------------------------------------------------
def _ints(shape, seed):
  import numpy as np

  return np.random.default_rng(seed).integers(-4, 5, size=shape).astype(np.float32)


def _same(got, want) -> tuple[str, str]:
  import numpy as np

  got = np.asarray(got)
  if got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)):
    return f"equal bits, {got.shape}", OK
  if not np.any(got):
    return f"all zeros {got.shape}", WRONG
  return f"differs: max |diff| {float(np.max(np.abs(got - want))):g}, {got.shape}", WRONG


def _grad_probe(wrt, acc, kernel=False):
  import jax
  import numpy as np

  import jaxlp
  from jaxlp import formats as F

  a, b = _ints((3, 5), 0), _ints((5, 4), 1)
  fmt = F.BF16 if acc == "BF16" else None
  if kernel:
    from jaxlp import pallas
    mm = functools.partial(pallas.matmul, acc=fmt, interpret=True)
  else:
    mm = functools.partial(jaxlp.matmul, acc=fmt)
  g = np.ones((3, 4), np.float32)
  try:
    if wrt == "a":
      got = jax.grad(lambda x: mm(x, b).sum())(a)
      want = (g.astype(np.float64) @ b.T).astype(np.float32)
    else:
      got = jax.grad(lambda y: mm(a, y).sum())(b)
      want = (a.T.astype(np.float64) @ g).astype(np.float32)
  except Exception as e:  # noqa: BLE001
    return _line(e), CRASH
  return _same(got, want)


for _wrt, _acc in (("a", "BF16"), ("a", None), ("b", "BF16"), ("b", None)):
  probe(f"matmul.grad_{_wrt}.acc_{_acc or 'None'}",
        f"grad wrt {_wrt} of sum(jaxlp.matmul(a, b, acc={_acc})) == numpy's "
        f"{'g @ b.T' if _wrt == 'a' else 'a.T @ g'} (exact on integers)")(
      functools.partial(_grad_probe, _wrt, _acc))

probe("pallas.matmul.grad_a.interpret",
      "grad of sum(jaxlp.pallas.matmul(a, b, acc=BF16, interpret=True)) == numpy's g @ b.T")(
    functools.partial(_grad_probe, "a", "BF16", kernel=True))


@probe("matmul.jvp.acc_BF16",
       "jax.jvp of jaxlp.matmul(acc=BF16): tangent == numpy's da @ b + a @ db (exact)")
def _jvp():
  import jax
  import numpy as np

  import jaxlp
  from jaxlp import formats as F

  a, b, da, db = _ints((3, 5), 0), _ints((5, 4), 1), _ints((3, 5), 2), _ints((5, 4), 3)
  try:
    _, t = jax.jvp(lambda x, y: jaxlp.matmul(x, y, acc=F.BF16), (a, b), (da, db))
  except Exception as e:  # noqa: BLE001
    return _line(e), CRASH
  want = (da.astype(np.float64) @ b + a.astype(np.float64) @ db).astype(np.float32)
  return _same(t, want)


@probe("matmul.batch_dims_do_not_broadcast",
       "jaxlp.matmul((2,8,48) @ (3,48,4)): ValueError naming both shapes")
def _batch():
  import jax.numpy as jnp

  import jaxlp

  return expect_error(lambda: jaxlp.matmul(jnp.ones((2, 8, 48)), jnp.ones((3, 48, 4))),
                      ValueError, ["(2, 8, 48)", "(3, 48, 4)"])


# -- compressors: the non-finite policy ------------------------------------------------------
W = 4
LEAF = (64, 64)
#: (worker, flat element) of the bad value: where a reduction meets it first, last, midway
#: (a NaN's fate in a max/min reduction depends on its position)
BAD_AT = [(w, i) for w in (0, 1, 3) for i in (0, 1, 5, 100, 2048, 4095)]
COMPRESSORS = {  # the 11 compressors of jaxlp.parallel.compressors, default settings
    "cast_bf16": lambda C: C.cast("bf16"), "powersgd": lambda C: C.powersgd(),
    "cgx": lambda C: C.cgx(), "qsgd": lambda C: C.qsgd(), "onebit": lambda C: C.onebit(),
    "tbq": lambda C: C.tbq(), "terngrad": lambda C: C.terngrad(), "topk": lambda C: C.topk(),
    "randomk": lambda C: C.randomk(), "dgc": lambda C: C.dgc(), "graddrop": lambda C: C.graddrop(),
}
CASES = {
    "nan": f"a NaN in one worker (each of {len(BAD_AT)} places)",
    "+inf": f"+inf in one worker (each of {len(BAD_AT)} places)",
    "-inf": f"-inf in one worker (each of {len(BAD_AT)} places)",
    "big_one": "one worker's leaf all ±3e38 (random signs; workers 0, 1, 3 in turn)",
    "big_all": "every worker's leaf ±3e38 (random signs)",
}
#: compressors whose documented policy gives a NaN step (not a finite one) for ±3e38
#: (jaxlp/parallel/_compressed.py: PowerSGD's products M Q and M^T P are not divided by W)
MAY_OVERFLOW = {"powersgd"}


def _inputs(case, rng):
  """[(label, gradients)] of a case: one per place of the bad value."""
  import numpy as np

  def normal():
    return rng.standard_normal((W,) + LEAF).astype(np.float32)

  def signs():
    return np.where(rng.random(LEAF) < 0.5, 3e38, -3e38).astype(np.float32)

  out = []
  if case in ("nan", "+inf", "-inf"):
    for w, i in BAD_AT:
      g = normal()
      g[w].reshape(-1)[i] = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}[case]
      out.append((f"worker {w} element {i}", g))
  elif case == "big_one":
    for w in (0, 1, 3):
      g = normal()
      g[w] = signs()
      out.append((f"worker {w}", g))
  else:
    out.append(("all workers", np.stack([signs() for _ in range(W)])))
  return out


@functools.cache
def _compressor_runs(name):
  """{case: [(label, result, new state's float arrays, next clean result)]} as numpy (one
  jitted program per compressor; every input starts from the state of one clean step)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaxlp.parallel.compressors as C
  from jaxlp.parallel import compressed_allreduce, init_compression_state

  comp = COMPRESSORS[name](C)
  st0 = init_compression_state(comp, {"a": jnp.zeros(LEAF)})
  st0 = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (W,) + a.shape), st0)

  @jax.jit
  def step(g, st):
    f = lambda g, s: compressed_allreduce({"a": g}, s, "w", comp, min_size=1,
                                          skip_vectors=False)
    out, new = jax.vmap(f, axis_name="w")(g, st)
    return out["a"], new

  def floats(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)]

  rng = np.random.default_rng(0)
  _, st1 = step(rng.standard_normal((W,) + LEAF).astype(np.float32), st0)  # non-zero residuals
  res = {}
  for case in CASES:
    res[case] = []
    for label, g in _inputs(case, rng):
      out, st2 = step(g, st1)
      nxt, _ = step(rng.standard_normal((W,) + LEAF).astype(np.float32), st2)
      res[case].append((label, np.asarray(out), floats(st2), np.asarray(nxt)))
  return res


def _judge(name, case, out, state, nxt):
  """(what happened, verdict) of one input."""
  import numpy as np

  bits = out.view(np.uint32)
  same = all(np.array_equal(bits[0], bits[w]) for w in range(W))
  bad_workers = [w for w in range(W) if not np.isfinite(out[w]).all()]
  state_ok = all(np.isfinite(s).all() for s in state)
  next_ok = bool(np.isfinite(nxt).all())
  got = (f"non-finite on workers {bad_workers}, workers {'agree' if same else 'DIFFER'}, "
         f"state {'finite' if state_ok else 'NOT finite'}, next clean step "
         f"{'finite' if next_ok else 'NOT finite'}")
  if not same:
    return got, WRONG
  if case.startswith("big"):
    if not bad_workers and state_ok and next_ok:
      return got, OK
    if name in MAY_OVERFLOW and len(bad_workers) == W and state_ok and next_ok:
      return got + " (the documented overflow: a NaN step)", OK
    return got, WRONG
  return got, OK if len(bad_workers) == W and state_ok and next_ok else WRONG


def _compressor_probe(name, case):
  try:
    runs = _compressor_runs(name)[case]
  except Exception as e:  # noqa: BLE001
    return _line(e), CRASH
  judged = [(label, *_judge(name, case, *rest)) for label, *rest in runs]
  bad = [(label, got) for label, got, verdict in judged if verdict != OK]
  if not bad:
    return f"{len(judged)} input(s): {judged[0][1]}", OK
  return (f"{len(bad)} of {len(judged)} input(s) wrong; first, {bad[0][0]}: {bad[0][1]}",
          WRONG)


for _name in COMPRESSORS:
  for _case, _what in CASES.items():
    _exp = ("result non-finite on all 4 workers (same bits), state finite, next clean step "
            "finite" if not _case.startswith("big") else
            "result finite on all 4 workers (same bits), state finite, next step finite")
    probe(f"compress.{_name}.{_case}", f"{_what}: {_exp}")(
        functools.partial(_compressor_probe, _name, _case))


def _state_probe(kind):
  import jax
  import jax.numpy as jnp

  import jaxlp.parallel.compressors as C
  from jaxlp.parallel import compressed_allreduce, init_compression_state

  g = jnp.ones((W,) + LEAF)
  comp = C.topk(0.1)
  if kind == "empty":
    st = ()
  elif kind == "other_compressor":
    st = init_compression_state(C.cgx(4, 64), {"a": jnp.zeros(LEAF)})
  else:
    st = init_compression_state(comp, {"a": jnp.zeros((8, 8))})
  batched = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (W,) + a.shape), st)
  f = lambda g, s: compressed_allreduce({"a": g}, s, "w", comp, min_size=1, skip_vectors=False)
  return expect_error(lambda: jax.vmap(f, axis_name="w")(g, batched), (TypeError, ValueError),
                      ["state"])


for _kind, _what in (("empty", "state ()"),
                     ("other_compressor", "a cgx state given to topk"),
                     ("other_shapes", f"a state built for an (8, 8) leaf, tree {LEAF}")):
  probe(f"compress.state.{_kind}",
        f"compressed_allreduce with {_what}: TypeError/ValueError naming the state")(
      functools.partial(_state_probe, _kind))


# -- patterns, plans, torch -----------------------------------------------------------------
@probe("quantize_model.linen.exclude_typo",
       "jaxlp.flax.quantize_model(MLP, exclude='Dense_l') then init: ValueError naming 'Dense_l'")
def _linen():
  import jax
  import jax.numpy as jnp

  import jaxlp
  from jaxlp.flax import quantize_model
  from jaxlp.flax.models import MLP
  from jaxlp.formats import E4M3

  def go():
    qm = quantize_model(MLP(features=(4, 2)), jaxlp.float_policy(E4M3), exclude="Dense_l")
    return qm.init(jax.random.key(0), jnp.ones((1, 3)))
  return expect_error(go, ValueError, ["Dense_l"])


@probe("quantize_model.nnx.exclude_typo",
       "jaxlp.flax.quantize_model(nnx model, exclude='layers/l'): ValueError naming 'layers/l'")
def _nnx():
  from flax import nnx

  import jaxlp
  from jaxlp.flax import quantize_model
  from jaxlp.formats import E4M3

  def go():
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    return quantize_model(model, jaxlp.float_policy(E4M3), exclude="layers/l")
  return expect_error(go, ValueError, ["layers/l"])


@probe("quantize_model.torch.exclude_typo",
       "jaxlp.torch.nn.quantize_model(net with fc1, fc2, exclude='fc_l'): ValueError naming "
       "'fc_l', nothing swapped")
def _torch_pattern():
  import torch

  import jaxlp
  from jaxlp.formats import E4M3
  from jaxlp.torch.nn import quantize_model

  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

  net = Net()
  got, verdict = expect_error(lambda: quantize_model(net, jaxlp.float_policy(E4M3),
                                                     exclude="fc_l"), ValueError, ["fc_l"])
  if verdict == OK and (type(net.fc1) is not torch.nn.Linear or
                        type(net.fc2) is not torch.nn.Linear):
    return got + "; but layers were swapped before the error", WRONG
  return got, verdict


@probe("secopa_plan.negative_size",
       "secopa_plan([-5, 100], num_nodes=4): ValueError naming sizes[0]")
def _secopa():
  from jaxlp.parallel import secopa_plan

  return expect_error(lambda: secopa_plan([-5, 100], num_nodes=4), ValueError, ["sizes[0]"])


@probe("torch.quantize.sparse_tensor",
       "jaxlp.torch.quantize(sparse COO tensor, E4M3): TypeError naming the layout")
def _sparse():
  import torch

  import jaxlp.torch as jt
  from jaxlp.formats import E4M3

  return expect_error(lambda: jt.quantize(torch.ones(3, 3).to_sparse(), E4M3), TypeError,
                      ["layout"])


# -- the jaxlp command ----------------------------------------------------------------------
TINY = ["--width", "1", "--nodes", "1", "--batch-size", "64", "--quiet"]
BASE = ["--epochs", "2", "--max-steps-per-epoch", "4", *TINY]  # the shared finished run
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.msgpack")


class Result(NamedTuple):
  rc: int | None  # None: timed out (killed)
  out: str
  err: str
  seconds: float


class Workspace:
  """The temporary folder of the command probes, with one finished tiny run to copy."""

  def __init__(self, keep=False):
    self.root = tempfile.mkdtemp(prefix="jaxlp-probes-")
    self.keep = keep
    self._base_lock = threading.Lock()
    self._base: str | None = None
    self.env = dict(os.environ)
    self.env["PYTHONPATH"] = ROOT + (os.pathsep + self.env["PYTHONPATH"]
                                     if self.env.get("PYTHONPATH") else "")
    self.env.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator-fallback warnings on stderr
    self.env["PYTHONUNBUFFERED"] = "1"

  def path(self, *parts) -> str:
    return os.path.join(self.root, *parts)

  def cmd(self, args):
    return [sys.executable, "-m", "jaxlp", *args]

  def start(self, args) -> subprocess.Popen:
    return subprocess.Popen(self.cmd(args), cwd=self.root, env=self.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

  @staticmethod
  def finish(p: subprocess.Popen, t0: float, timeout: float = 300) -> Result:
    try:
      out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
      rc = p.returncode
    except subprocess.TimeoutExpired:
      p.kill()
      out, err = p.communicate()
      rc = None
    return Result(rc, out, err, time.monotonic() - t0)

  def run(self, args, timeout: float = 300) -> Result:
    t0 = time.monotonic()
    return self.finish(self.start(args), t0, timeout)

  def base(self) -> str:
    """A finished run of 2 epochs (made once; copy it, never change it)."""
    with self._base_lock:
      if self._base is None:
        out = self.path("base")
        r = self.run(["train", *BASE, "--out", out])
        if r.rc != 0:
          raise RuntimeError(f"the base run failed (exit {r.rc}): {r.err.strip()[-500:]}")
        self._base = out
      return self._base

  def copy_base(self, name) -> str:
    dst = self.path(name)
    shutil.copytree(self.base(), dst, ignore=shutil.ignore_patterns(".lock"))
    return dst

  def close(self):
    if not self.keep:
      shutil.rmtree(self.root, ignore_errors=True)


WS: Workspace | None = None


def _err_lines(r: Result) -> list[str]:
  return [ln for ln in r.err.splitlines() if ln.strip()]


def _describe(r: Result) -> str:
  if r.rc is None:
    return f"timed out after {r.seconds:.0f} s"
  if r.rc < 0:
    try:
      sig = signal.Signals(-r.rc).name
    except ValueError:
      sig = f"signal {-r.rc}"
    rc = f"{r.rc} (killed by {sig}{'; a shell shows 130' if r.rc == -signal.SIGINT else ''})"
  else:
    rc = str(r.rc)
  lines = _err_lines(r)
  tb = " (Traceback)" if "Traceback" in r.err else ""
  last = " ".join(lines[-1].split())[:300] if lines else "(nothing)"
  n = f"{len(lines)} lines, last: " if len(lines) > 1 else ""
  return f"exit {rc}; stderr{tb}: {n}{last}"


def clear_error(r: Result, needles, status=2) -> bool:
  lines = _err_lines(r)
  return (r.rc == status and len(lines) == 1 and "Traceback" not in r.err
          and all(n in lines[0] for n in needles))


def cli_error(r: Result, needles, status=2, accepted=WRONG) -> tuple[str, str]:
  """The verdict of a command that must refuse its input: ``accepted`` when it exits 0."""
  if clear_error(r, needles, status):
    return _describe(r), OK
  if r.rc == 0:
    return _describe(r) + " (accepted)", accepted
  missing = [n for n in needles if n not in r.err]
  return _describe(r) + (f" (names none of {missing})" if missing else ""), CRASH


def _digest(folder) -> dict:
  out = {}
  for n in RUN_FILES:
    p = os.path.join(folder, n)
    out[n] = hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.exists(p) else None
  return out


def _epochs(folder) -> list:
  p = os.path.join(folder, "metrics.jsonl")
  if not os.path.exists(p):
    return []
  eps = []
  for line in open(p):
    try:
      eps.append(json.loads(line)["epoch"])
    except (ValueError, KeyError, TypeError):
      eps.append("?")
  return eps


def _checkpoint_epoch(folder):
  """The epoch of the folder's checkpoint (read and verified as ``--resume`` reads it)."""
  from jaxlp.training import _runs

  try:
    return int(_runs.read_checkpoint(os.path.join(folder, "checkpoint.msgpack"))["epoch"])
  except Exception as e:  # noqa: BLE001
    return _line(e)


@probe("cli.seed_too_large", "train --seed 99999999999999999999: exit 2, one line naming --seed",
       cli=True)
def _seed():
  return cli_error(WS.run(["train", "--seed", "99999999999999999999", *TINY]), ["--seed"])


@probe("cli.width_too_large", "train --width 20000: exit 2, one line naming --width", cli=True)
def _width():
  args = ["train", "--epochs", "1", "--nodes", "1", "--quiet", "--width", "20000"]
  return cli_error(WS.run(args, timeout=240), ["--width"])


@probe("cli.mnist_0x0_images",
       "train --data mnist with IDX files of 0x0 images: exit 2, one line naming the images "
       "file", cli=True)
def _mnist():
  d = WS.path("mnist0")
  os.makedirs(d)
  for prefix in ("train", "t10k"):
    with open(os.path.join(d, f"{prefix}-images-idx3-ubyte"), "wb") as f:
      f.write(b"\0\0\x08\x03" + (5).to_bytes(4, "big") + bytes(8))  # 5 images of 0x0
    with open(os.path.join(d, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
      f.write(b"\0\0\x08\x01" + (5).to_bytes(4, "big") + bytes(range(5)))
  r = WS.run(["train", "--data", "mnist", "--data-dir", d, "--epochs", "1", *TINY,
              "--out", WS.path("mnist0-run")])
  return cli_error(r, ["train-images-idx3-ubyte"])


@probe("cli.plot_garbage_line",
       "plot on a metrics.jsonl with a garbage line: exit 2, one line naming the file", cli=True)
def _plot():
  d = WS.path("garbage-run")
  os.makedirs(d)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"epoch": 1, "train_loss": 1.0, "test_accuracy": 0.5, "wire_bytes": 0,
                        "steps": 2, "nonfinite_steps": 0, "seconds": 0.1}) + "\n")
    f.write("garbage{\n")
  r = WS.run(["plot", d, "--out", WS.path("garbage-plots")])
  return cli_error(r, [os.path.join(d, "metrics.jsonl")])


@probe("cli.resume_missing_checkpoint",
       "train --resume after deleting the checkpoint.msgpack of a run of 2 finished epochs: "
       "exit 2, one line naming checkpoint.msgpack; the folder untouched", cli=True)
def _resume_missing():
  d = WS.copy_base("no-checkpoint")
  os.remove(os.path.join(d, "checkpoint.msgpack"))
  before = _digest(d)
  r = WS.run(["train", *BASE, "--epochs", "3", "--resume", "--out", d])
  got, verdict = cli_error(r, ["checkpoint.msgpack"])
  if _digest(d) != before:
    return got + f"; the run folder changed (metrics epochs now {_epochs(d)})", LOSS
  return got, verdict


@probe("cli.resume_missing_checkpoint.first_epoch",
       "train --resume of a folder whose metrics.jsonl holds epoch 1 and no checkpoint (as a "
       "run killed just before its first checkpoint leaves it): a clear error naming "
       "checkpoint.msgpack, or a restart whose epoch 1 has the old line's numbers", cli=True)
def _resume_first_epoch():
  d = WS.copy_base("no-checkpoint-1")
  os.remove(os.path.join(d, "checkpoint.msgpack"))
  path = os.path.join(d, "metrics.jsonl")
  first = open(path).readline()
  with open(path, "w") as f:
    f.write(first)
  r = WS.run(["train", *BASE, "--epochs", "2", "--resume", "--out", d])
  if r.rc != 0:
    return cli_error(r, ["checkpoint.msgpack"])
  strip = lambda h: {k: v for k, v in h.items() if k != "seconds"}
  new = [json.loads(ln) for ln in open(path)]
  eps, ck = [h.get("epoch") for h in new], _checkpoint_epoch(d)
  got = f"{_describe(r)}; restarted from epoch 0, metrics epochs {eps}, checkpoint epoch {ck}"
  if eps != [1, 2] or ck != 2:
    return got, LOSS
  if strip(new[0]) != strip(json.loads(first)):
    return got + "; epoch 1 differs from the old line", WRONG
  return got + "; epoch 1 as before", OK


@probe("cli.checkpoint_flipped_byte",
       "train --resume with one byte flipped inside a parameter array of checkpoint.msgpack: "
       "exit 2, one line naming the file; the file untouched", cli=True)
def _flipped():
  import numpy as np
  from flax import serialization

  d = WS.copy_base("flipped")
  path = os.path.join(d, "checkpoint.msgpack")
  data = bytearray(open(path, "rb").read())
  state = serialization.msgpack_restore(bytes(data))["state"]
  key = max((k for k in state if k.startswith("['params']")), key=lambda k: state[k].size)
  raw = np.ascontiguousarray(state[key]).tobytes()
  at = bytes(data).find(raw)
  if at < 0 or bytes(data).find(raw, at + 1) >= 0:
    raise RuntimeError(f"the bytes of {key} are not found once in {path}")
  data[at + len(raw) // 2 + 1] ^= 0x40  # an exponent bit of one float32
  with open(path, "wb") as f:
    f.write(data)
  before = _digest(d)
  r = WS.run(["train", *BASE, "--epochs", "3", "--resume", "--out", d])
  got, verdict = cli_error(r, ["checkpoint.msgpack"])
  if _digest(d) != before:
    return got + f"; the run folder changed (epochs now {_epochs(d)})", LOSS
  return got + f" [flipped a byte of {key}]", verdict


@probe("cli.overwrite_invalid_config",
       "train --overwrite --batch-size 1440 (digits has 1438 training images) on a finished "
       "run: exit 2, one line naming --batch-size; the old run byte for byte", cli=True)
def _overwrite():
  d = WS.copy_base("overwrite")
  before = _digest(d)
  r = WS.run(["train", *BASE, "--batch-size", "1440", "--overwrite", "--out", d])
  after = _digest(d)
  left = sorted(set(os.listdir(d)) - set(RUN_FILES) - {".lock"})
  if after != before or left:
    changed = [n for n in RUN_FILES if after[n] != before[n]]
    return f"{_describe(r)}; changed/lost {changed}, left over {left}", LOSS
  return cli_error(r, ["--batch-size"])


def _two_at_once(args_a, args_b, timeout=400):
  t0 = time.monotonic()
  pa, pb = WS.start(args_a), WS.start(args_b)
  return WS.finish(pa, t0, timeout), WS.finish(pb, t0, timeout)


def _writers_verdict(results, d, epochs, seeds=None) -> tuple[str, str]:
  """Two writers on one folder: at most one may write; a refused one gives one clear line;
  the folder holds one consistent run."""
  rcs = [r.rc for r in results]
  eps = _epochs(d)
  ck = _checkpoint_epoch(d)
  got = f"exits {rcs}; metrics epochs {eps}; checkpoint epoch {ck}"
  refused = [r for r in results if r.rc != 0]
  lock_seen = any("in use" in r.err for r in refused)
  got += "; " + ("a writer was refused by the lock" if lock_seen else
                 "no writer refused by the lock (the runs did not overlap?)")
  if eps != list(range(1, epochs + 1)) or ck != epochs:
    return got, LOSS
  if seeds is not None:
    cfg = json.load(open(os.path.join(d, "config.json")))
    winners = [s for s, r in zip(seeds, results) if r.rc == 0]
    if len(winners) != 1 or cfg.get("seed") != winners[0]:
      return got + f"; config seed {cfg.get('seed')}, exit-0 seeds {winners}", LOSS
  for r in refused:
    if not clear_error(r, [d]):
      return got + f"; refused one: {_describe(r)}", CRASH
  return got, OK


@probe("cli.concurrent_train",
       "two train --out R started together (seeds 1, 2): one exit 0, the other exit 2 with "
       "one line naming R; R holds the winner's run, epochs [1, 2, 3]", cli=True)
def _concurrent_train():
  d = WS.path("concurrent")
  args = ["train", "--epochs", "3", *TINY, "--out", d]
  res = _two_at_once(args + ["--seed", "1"], args + ["--seed", "2"])
  return _writers_verdict(res, d, 3, seeds=(1, 2))


@probe("cli.concurrent_resume",
       "two train --resume --epochs 4 on one finished 2-epoch run started together: R ends "
       "with epochs [1, 2, 3, 4]; a refused one exits 2 with one line naming R", cli=True)
def _concurrent_resume():
  d = WS.copy_base("concurrent-resume")
  args = ["train", *BASE, "--epochs", "4", "--resume", "--out", d]
  return _writers_verdict(_two_at_once(args, args), d, 4)


def _compare(name, configs, extra=(), parent=None):
  out = os.path.join(parent or WS.path(name), "C")
  cfg_args = [a for c in configs for a in ("--config", c)]
  args = ["compare", "--out", out, "--no-plot", *extra, *cfg_args, "--", *BASE]
  return out, WS.run(args)


@probe("cli.compare.duplicate_names",
       "compare --config a=... --config a=...: exit 2, one line naming 'a'; nothing trained",
       cli=True)
def _dup():
  out, r = _compare("dup", ["a=--seed 1", "a=--seed 2"])
  trained = os.path.isdir(os.path.join(out, "a"))
  got, verdict = cli_error(r, ["'a'"], accepted=LOSS)
  return (got + "; trained into C/a", LOSS) if trained and verdict != OK else (got, verdict)


@probe("cli.compare.colliding_names",
       "compare --config x+y=... --config x_y=... (one folder x_y): exit 2, one line naming "
       "both", cli=True)
def _colliding():
  out, r = _compare("collide", ["x+y=--seed 1", "x_y=--seed 2"])
  return cli_error(r, ["x+y", "x_y"], accepted=LOSS)


@probe("cli.compare.dotdot_name",
       "compare --overwrite --config ..=... with --out P/C where P holds a run: exit 2, one "
       "line naming '..'; P's run byte for byte", cli=True)
def _dotdot():
  parent = WS.copy_base("dotdot")
  before = _digest(parent)
  _, r = _compare("dotdot", ["..=--seed 3"], extra=["--overwrite"], parent=parent)
  if _digest(parent) != before:
    return f"{_describe(r)}; the run in P changed", LOSS
  return cli_error(r, ["'..'"], accepted=LOSS)


SIGINT_WAIT = 90  # seconds a command may take to end after SIGINT


def _sigint(name, wait_for_epoch: bool) -> tuple[str, str]:
  d = WS.path(name)
  t0 = time.monotonic()
  p = WS.start(["train", "--epochs", "1000", *TINY, "--out", d])  # SIGINT ends it
  deadline = t0 + 240
  if wait_for_epoch:  # SIGINT once the first epoch is in metrics.jsonl
    while time.monotonic() < deadline and p.poll() is None and not _epochs(d):
      time.sleep(0.05)
  else:  # SIGINT while the command starts (importing JAX)
    time.sleep(1.0)
  phase = f"SIGINT after {time.monotonic() - t0:.1f} s, {len(_epochs(d))} epoch(s) written"
  if p.poll() is None:
    p.send_signal(signal.SIGINT)
  t1 = time.monotonic()
  r = WS.finish(p, t1, timeout=SIGINT_WAIT)
  got = f"{phase}; {_describe(r)}"
  if r.rc is None:
    return f"{phase}; still running {SIGINT_WAIT} s after the SIGINT (killed)", CRASH
  # ended by SIGINT itself (returncode -2) is what a shell reports as 130; seen at some
  # moments of the start-up, after the one line was printed
  if not clear_error(r._replace(rc=130 if r.rc == -signal.SIGINT else r.rc), ["interrupted"],
                     status=130):
    return got, CRASH
  if not wait_for_epoch:
    return got, OK
  if "--resume" not in r.err:
    return got + " (does not say how to resume)", CRASH
  # the folder must continue: --resume to one epoch past what metrics.jsonl records (a line
  # written just before its checkpoint is dropped and that epoch run again, by design)
  eps, ck = _epochs(d), _checkpoint_epoch(d)
  got += f"; then metrics epochs {eps}, checkpoint epoch {ck}"
  k = len(eps) + 1
  r2 = WS.run(["train", "--epochs", str(k), *TINY, "--out", d, "--resume"])
  eps2, ck2 = _epochs(d), _checkpoint_epoch(d)
  got += f"; --resume --epochs {k}: exit {r2.rc}, metrics epochs {eps2}, checkpoint epoch {ck2}"
  if r2.rc != 0 or eps2 != list(range(1, k + 1)) or ck2 != k:
    return got + f" ({_describe(r2)})", LOSS
  return got, OK


@probe("cli.ctrl_c.training",
       "SIGINT to train --out R during training: exit 130, one line 'interrupted ... resume "
       "with ... --resume'; then --resume continues R to epochs [1..n+1] (n: epochs in "
       "metrics.jsonl at the interrupt)",
       cli=True)
def _ctrl_c_training():
  return _sigint("ctrl-c", True)


@probe("cli.ctrl_c.startup",
       "SIGINT to train --out R 1 s after launch (while it imports): exit 130, one line "
       "'interrupted', no traceback", cli=True)
def _ctrl_c_startup():
  return _sigint("ctrl-c-startup", False)


# -- running --------------------------------------------------------------------------------
def run_probe(p: Probe) -> tuple[str, str, float]:
  t0 = time.monotonic()
  try:
    got, verdict = p.fn()
  except Exception as e:  # noqa: BLE001 - a failure of the probe's own setup
    got, verdict = f"PROBE SETUP FAILED: {_line(e)}", CRASH
  return got, verdict, time.monotonic() - t0


def _clip(s: str, n: int) -> str:
  return s if len(s) <= n else s[:n - 3] + "..."


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="reliability_probes", description=__doc__.split("\n")[0])
  ap.add_argument("--only", action="append", metavar="SUBSTR",
                  help="run only probes whose name contains SUBSTR (repeatable)")
  ap.add_argument("--list", action="store_true", help="list the probes and their oracles")
  ap.add_argument("--jobs", type=int, default=2,
                  help="command probes run in N threads beside the library probes (default 2)")
  ap.add_argument("--width", type=int, default=0,
                  help="clip the expected/got columns to N characters (default: no clipping)")
  ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
  ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
  args = ap.parse_args(argv)
  if args.jobs < 1:
    ap.error(f"--jobs must be >= 1, got {args.jobs}")
  chosen = [p for p in PROBES if not args.only or any(s in p.name for s in args.only)]
  if not chosen:
    ap.error(f"no probe name contains any of {args.only} (--list lists them)")
  if args.list:
    w = max(len(p.name) for p in chosen)
    for p in chosen:
      print(f"{p.name:<{w}}  {p.expected}")
    return 0

  global WS
  WS = Workspace(keep=args.keep)
  t0 = time.monotonic()
  results: dict[str, tuple[str, str, float]] = {}
  try:
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
      futures = {p.name: pool.submit(run_probe, p) for p in chosen if p.cli}
      for p in chosen:
        if not p.cli:
          results[p.name] = run_probe(p)
          print(f"  {results[p.name][1]:<14} {p.name} ({results[p.name][2]:.1f} s)", flush=True)
      for name, f in futures.items():
        results[name] = f.result()
        print(f"  {results[name][1]:<14} {name} ({results[name][2]:.1f} s)", flush=True)
  finally:
    WS.close()

  clip = (lambda s: _clip(s, args.width)) if args.width else (lambda s: s)
  w = max(len(p.name) for p in chosen)
  print(f"\n{'probe':<{w}} | {'verdict':<13} | expected | got")
  print("-" * 100)
  rows = []
  for p in chosen:
    got, verdict, secs = results[p.name]
    rows.append(dict(probe=p.name, expected=p.expected, got=got, verdict=verdict,
                     seconds=round(secs, 2)))
    print(f"{p.name:<{w}} | {verdict:<13} | {clip(p.expected)} | {clip(got)}")
  counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
  print("\n" + ", ".join(f"{v}: {n}" for v, n in counts.items()) +
        f"  ({len(rows)} probes, {time.monotonic() - t0:.0f} s)")
  bad = [r for r in rows if r["verdict"] != OK]
  if bad:
    print("\nnot ok:")
    for r in bad:
      print(f"  {r['probe']} [{r['verdict']}]: {r['got']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"counts": counts, "rows": rows}, f, indent=2)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
