"""Load a script of ``benchmarks/`` as a module, for the tests of the benchmarks (the folder is
not a package, and it is kept off ``sys.path``: one of its scripts is named like a module that
jax's dependencies import)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark(name: str):
  """``benchmarks/<name>.py`` as a fresh module (its ``if __name__ == "__main__"`` not run)."""
  spec = importlib.util.spec_from_file_location(
      f"benchmark_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod
