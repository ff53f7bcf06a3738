"""Run several example scripts with ``--smoke``, one after the other, in this one process.

  python tests/examples/_one_process.py RESULTS.json NAME.py [NAME.py ...]

Each script runs as ``python examples/NAME.py --smoke`` would run it (``runpy.run_path`` with
``__name__ == "__main__"``, ``sys.argv`` and ``sys.path[0]`` as for the script), so its
``__main__`` part is what runs; they share the imports (JAX, jaxlp, flax, optax, the built-in
data) and JAX's in-memory caches, which separate processes would pay for once each. A script
that raises (or exits with a non-zero code) is recorded and the next one still runs.
RESULTS.json gets ``{name: {"ok": bool, "output": its stdout, "error": the traceback}}``.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")


def run_one(name: str) -> dict:
  path = os.path.join(EXAMPLES, name)
  out, error = io.StringIO(), ""
  argv, path0 = sys.argv, sys.path[0]
  sys.argv, sys.path[0] = [path, "--smoke"], EXAMPLES
  try:
    with contextlib.redirect_stdout(out):
      runpy.run_path(path, run_name="__main__")
  except SystemExit as e:
    if e.code not in (None, 0):
      error = f"SystemExit({e.code!r})"
  except BaseException:  # noqa: BLE001 -- recorded, and the next script runs
    error = traceback.format_exc()
  finally:
    sys.argv, sys.path[0] = argv, path0
  return {"ok": not error, "output": out.getvalue(), "error": error}


def main(argv):
  results_path, names = argv[0], argv[1:]
  results = {}
  for name in names:
    print(f"-- {name}", file=sys.stderr, flush=True)
    results[name] = run_one(name)
    with open(results_path, "w") as f:  # after each script: a crash keeps what ran
      json.dump(results, f)


if __name__ == "__main__":
  main(sys.argv[1:])
