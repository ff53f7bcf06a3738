"""Where a jitted program's device time goes: its most expensive XLA ops and source lines.

Used by ``layers.py --trace-top N`` and ``compressors.py --trace-top N``. :func:`trace_ops`
runs a function under ``jax.profiler.trace`` and reads the trace's JSON: on a GPU the device's
"XLA Ops" line (else its stream kernels, named by their ``hlo_op``), on the CPU the XLA
threads' thunks (thread time: threads overlap). :func:`hlo_sources` names each op of the
compiled HLO by the innermost jaxlp frame of its stack (a custom VJP's backward ops carry the
stack of its forward call) and the last parts of its jax op name. :func:`print_trace` prints
both tables in ms per run (a training step, a round trip).
"""

import collections
import gzip
import json
import os as _os
import re
import tempfile
import time

import jax

#: XLA:GPU's option that lists the op kinds it records into command buffers (CUDA graphs);
#: empty: none. A trace then shows each kernel as its own op instead of one
#: ``command_buffer_N`` per graph (on the H200, 2026-11-27, the exact ResNet-18 step traced
#: as a single 52 ms command buffer).
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def command_buffers_off():
  """Switch XLA:GPU's command buffers off for this process (``XLA_FLAGS``), before JAX
  starts a backend: XLA reads the flags then. Times measured this way are not the default
  configuration's; scripts say so in their output."""
  from jax._src import xla_bridge  # noqa: PLC0415 -- whether a backend has started

  if xla_bridge.backends_are_initialized():
    raise RuntimeError("command_buffers_off: a JAX backend has started; XLA_FLAGS would be "
                       "ignored")
  flags = _os.environ.get("XLA_FLAGS", "")
  if NO_COMMAND_BUFFERS not in flags.split():
    _os.environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}")


def hlo_sources(hlo: str) -> dict[str, tuple[str, str]]:
  """HLO instruction name -> (``file:line (function)`` of its innermost jaxlp frame, else its
  innermost frame, else "?"; the last three parts of its jax op name), from a compiled
  module's text. A custom VJP's backward ops carry the stack of its forward call."""
  sections = {}
  cur = None  # the table being read: "<id> <entry>" lines up to the first other line
  for line in hlo.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      cur = sections.setdefault(line, {})
    elif cur is not None and line[:1].isdigit():
      k, _, v = line.partition(" ")
      cur[int(k)] = v.strip().strip('"')
    else:
      cur = None
  field = lambda v, f: int(re.search(rf"{f}=(-?\d+)", v).group(1))  # noqa: E731

  def where(frame_id):
    frames, seen = [], set()
    while frame_id in sections.get("StackFrames", {}) and frame_id not in seen:
      seen.add(frame_id)
      fr = sections["StackFrames"][frame_id]
      loc = sections["FileLocations"][field(fr, "file_location_id")]
      fname = sections["FileNames"][field(loc, "file_name_id")]
      func = sections["FunctionNames"][field(loc, "function_name_id")]
      frames.append((fname, field(loc, "line"), func))
      parent = field(fr, "parent_frame_id")
      frame_id = parent if parent != frame_id else -1
    if not frames:
      return None
    mine = [f for f in frames if "/jaxlp/" in f[0].replace(_os.sep, "/")]
    fname, line, func = (mine or frames)[0]
    return f"{_os.path.basename(fname)}:{line} ({func})"

  out = {}
  for line in hlo.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    meta = m.group(2)
    sf = re.search(r"stack_frame_id=(\d+)", meta)
    on = re.search(r'op_name="([^"]*)"', meta)
    out[m.group(1)] = ((where(int(sf.group(1))) if sf else None) or "?",
                       "/".join(on.group(1).split("/")[-3:]) if on else "-")
  return out


def trace_ops(run, hlo: str):
  """Run ``run()`` under ``jax.profiler.trace``; (op name -> total us, source map, kind, wall
  seconds of ``run()``): the device's XLA ops (a GPU's "XLA Ops" line, else its stream
  kernels named by their ``hlo_op``), or on the CPU the XLA threads' thunks (thread time)."""
  src = hlo_sources(hlo)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      t0 = time.perf_counter()
      run()
      wall = time.perf_counter() - t0
    paths = [_os.path.join(r, f) for r, _, fs in _os.walk(d) for f in fs
             if f.endswith(".trace.json.gz")]
    if not paths:
      return collections.Counter(), src, "no trace written", wall
    with gzip.open(paths[0]) as f:
      data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e["args"]["name"]
  dev = {p for p, n in procs.items() if n.startswith("/device:")}
  ops_lines = {k for k, n in threads.items() if k[0] in dev and n == "XLA Ops"}
  if ops_lines:
    kind, keep = "device (XLA Ops)", lambda k: k in ops_lines
  elif dev:
    kind, keep = "device kernels", lambda k: k[0] in dev and "Stream" in threads.get(k, "")
  else:
    kind, keep = "CPU thread time", lambda k: threads.get(k, "").startswith("tf_XLA")
  totals = collections.Counter()
  for e in events:
    if e.get("ph") != "X" or not keep((e.get("pid"), e.get("tid"))):
      continue
    name = (e.get("args") or {}).get("hlo_op") or e["name"]
    m = re.match(r"(.*)_(\d+)$", name)
    if name not in src and m and f"{m.group(1)}.{m.group(2)}" in src:
      name = f"{m.group(1)}.{m.group(2)}"  # a kernel named after its HLO op, "." as "_"
    if name in src or dev:  # on a device also what the HLO does not name (library kernels)
      totals[name] += float(e.get("dur", 0))
  return totals, src, kind, wall


#: Control-flow ops: their time includes the ops they run, traced as events of their own.
_NESTING = re.compile(r"^(while|cond|conditional|call)(\.|$)")


def print_trace(totals, src, kind, wall: float, steps: int, top: int):
  """The op and source tables. A control-flow op (while, conditional, call) is listed, marked
  "(nesting)", but its time (which includes the ops it runs) is not summed again."""
  total = sum(us for name, us in totals.items() if not _NESTING.match(name))
  print(f"\n# trace: {kind}, {1e-3 * total / steps:.2f} ms per run in {len(totals)} ops; "
        f"{1e3 * wall / steps:.2f} ms wall per run under the profiler")
  print("| op | ms per run | share | source | jax op |")
  print("|---|---|---|---|---|")
  for name, us in totals.most_common(top):
    where, op = src.get(name, ("-", "-"))
    mark = " (nesting)" if _NESTING.match(name) else ""
    print(f"| {name}{mark} | {1e-3 * us / steps:.3f} | {us / max(total, 1e-9):.1%} | {where} | "
          f"{op} |")
  by_src = collections.Counter()
  for name, us in totals.items():
    if not _NESTING.match(name):
      by_src[src[name][0] if name in src else name] += us
  print("| source | ms per run | share |")
  print("|---|---|---|")
  for where, us in by_src.most_common(top):
    print(f"| {where} | {1e-3 * us / steps:.3f} | {us / max(total, 1e-9):.1%} |")


def report(run, hlo: str, steps: int, top: int) -> bool:
  """:func:`trace_ops` then :func:`print_trace`; a failure (no profiler backend, an
  unreadable trace) prints one "# trace failed" line instead of raising, so the timings of
  the calling benchmark still print. Returns whether the tables were printed."""
  try:
    result = trace_ops(run, hlo)
  except Exception as e:  # noqa: BLE001 -- any profiler failure: report it, go on
    print(f"\n# trace failed: {type(e).__name__}: {e}")
    return False
  print_trace(*result, steps, top)
  return True
