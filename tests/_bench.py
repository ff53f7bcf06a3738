"""Load a script of ``benchmarks/`` (or of ``benchmarks/tools/``) as a module, for the tests of
the benchmarks (the scripts are run as files, with their folder kept off ``sys.path``)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def benchmark_path(name: str) -> str:
  """The file of benchmark or tool ``name``: ``benchmarks/<name>.py``, else
  ``benchmarks/tools/<name>.py``."""
  for folder in ("benchmarks", os.path.join("benchmarks", "tools")):
    path = os.path.join(ROOT, folder, f"{name}.py")
    if os.path.exists(path):
      return path
  raise FileNotFoundError(f"no benchmarks/{name}.py or benchmarks/tools/{name}.py")


def load_benchmark(name: str):
  """The script of :func:`benchmark_path` as a fresh module (its ``__main__`` part not run)."""
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", benchmark_path(name))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod
