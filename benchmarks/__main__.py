"""The benchmarks' front door: list them, run one, or run several in turn.

Usage (from a source checkout):
  python -m benchmarks                          # every benchmark, one line each
  python -m benchmarks --list-tools             # the diagnostics in benchmarks/tools/
  python -m benchmarks NAME [ARGS...]           # run benchmark or tool NAME with ARGS
  python -m benchmarks NAME --help              # its own options
  python -m benchmarks --run [--small] [NAME ...]
      # run benchmarks in turn (default: all of them); --small: each one's CI-sized run

Each benchmark or tool runs as its own Python process (``benchmarks/NAME.py`` or
``benchmarks/tools/NAME.py``, with this checkout first on ``PYTHONPATH``); the exit status is
its exit status (``--run``: nonzero when one of them failed). An unknown name or option exits
with status 2. The GPU checks of the open goals run in one command:
``bash benchmarks/gpu_checks.sh OUTDIR``. Results: ``benchmarks/RESULTS.md`` (its goals
table first, then one section per benchmark). ``jaxlp bench`` runs the same :func:`main`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: benchmark name -> (where its numbers are measured, the arguments of its CI-sized run)
BENCHMARKS = {
    "quantize": ("CPU", ("--small",)),
    "fp4": ("CPU", ("--small",)),
    "kernels": ("GPU", ("--small",)),
    "block_gemm": ("CPU, GPU", ("--small",)),
    "layers": ("CPU, GPU", ("--small",)),
    "reduce": ("CPU", ("--small",)),
    "compressors": ("CPU, GPU", ("--small",)),
    "loopback": ("CPU", ("--smoke",)),
    "sharded": ("CPU", ("--smoke",)),
    "torch_quantize": ("CPU, GPU", ("--small",)),
    "ddp_hooks": ("CPU", ("--small",)),
    "engine_compile": ("CPU, GPU", ("--model", "tiny")),
    "sequence": ("CPU, GPU", ("--small",)),
}

#: tool name (``benchmarks/tools/NAME.py``) -> where it is meant to run
TOOLS = {
    "exact_train_check": "GPU vs CPU",
    "block_programs": "GPU",
    "sparse_select": "CPU, GPU",
    "ptx_per_mac": "CPU",
    "reliability_probes": "CPU",
    "recipe_grads": "CPU",
}


def script(name: str) -> str | None:
  """The file of benchmark or tool ``name``, or None if there is no such name."""
  if name in BENCHMARKS:
    return os.path.join(HERE, f"{name}.py")
  if name in TOOLS:
    return os.path.join(HERE, "tools", f"{name}.py")
  return None


def summary(name: str) -> str:
  """The first line of the docstring of ``name``'s script: what it measures or is for."""
  with open(script(name)) as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  return doc.strip().splitlines()[0] if doc.strip() else "(no docstring)"


def _table(entries) -> str:
  return "\n".join(f"  {name:<19}{where:<12}{summary(name)}" for name, where in entries)


def listing() -> str:
  """The benchmarks, one line each: name, where it measures, what it measures."""
  return ("jaxlp benchmarks: python -m benchmarks NAME [ARGS...] runs one (NAME --help: its "
          "options)\n\n" + _table((n, w) for n, (w, _) in BENCHMARKS.items()) + "\n\n"
          "Diagnostics: python -m benchmarks --list-tools. GPU checks in one command: "
          "bash benchmarks/gpu_checks.sh OUTDIR.\nResults: benchmarks/RESULTS.md (goals table "
          "first).")


def tools_listing() -> str:
  """The diagnostics of ``benchmarks/tools/``, one line each."""
  return ("jaxlp benchmark tools (benchmarks/tools/): python -m benchmarks NAME [ARGS...] runs "
          "one\n\n" + _table(TOOLS.items()))


def run(name: str, args=()) -> int:
  """Runs benchmark or tool ``name`` with ``args`` in a new Python process; its exit status
  (128 + N when signal N ended it, as a shell reports it)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  code = subprocess.call([sys.executable, script(name), *args], env=env)
  return 128 - code if code < 0 else code


def _error(msg: str) -> int:
  print(f"python -m benchmarks: error: {msg}", file=sys.stderr)
  return 2


def main(argv=None) -> int:
  """The front door's command line (see the module docstring); returns the exit status."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv:
    print(listing())
    return 0
  head, rest = argv[0], argv[1:]
  if head in ("-h", "--help"):
    print(__doc__.strip())
    return 0
  if head == "--list-tools":
    if rest:
      return _error(f"--list-tools takes no arguments, got {' '.join(rest)}")
    print(tools_listing())
    return 0
  if head == "--run":
    small = "--small" in rest
    names = [a for a in rest if a != "--small"]
    bad = [a for a in names if a.startswith("-")]
    if bad:
      return _error(f"--run takes --small and benchmark names, not {' '.join(bad)}")
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
      return _error(f"--run: no benchmark named {', '.join(map(repr, unknown))} (benchmarks: "
                    f"{', '.join(BENCHMARKS)}; tools run one at a time)")
    rc = 0
    for n in names or list(BENCHMARKS):
      print(f"== {n} ==", flush=True)
      code = run(n, BENCHMARKS[n][1] if small else ())
      rc = rc or code  # the first failure's status; the others still run
    return rc
  if head.startswith("-"):
    return _error(f"unknown option {head} (python -m benchmarks --help)")
  if script(head) is None:
    return _error(f"no benchmark or tool named {head!r} (python -m benchmarks lists the "
                  "benchmarks, --list-tools the tools)")
  return run(head, rest)


if __name__ == "__main__":
  sys.exit(main())
