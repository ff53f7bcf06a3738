"""Load a script of ``benchmarks/`` (or of ``benchmarks/tools/``) as a module, for the tests of
the benchmarks (the scripts are run as files, with their folder kept off ``sys.path``)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The environment entry that makes a smoke run's subprocess compile with XLA's optimizations
#: off (JAX's ``jax_disable_most_optimizations``, read from this variable when JAX starts; the
#: in-process runs get the same from the ``fast_compile`` fixture of tests/conftest.py). A smoke
#: run checks that a script runs end to end and prints what it claims, not its speed, and its
#: time is mostly XLA's compiles: with this, the smoke tests took 17% less CPU time in all
#: (2-core VM, 2026-11-29: 862 s -> 715 s), 20-40% less on training steps. The scripts'
#: defaults are unchanged; benchmarks/loopback.py and sharded.py --smoke set the same in their
#: worker processes.
FAST_COMPILE = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def xla_flags(*extra: str) -> str:
  """``XLA_FLAGS`` for a subprocess a test starts with flags of its own (or none, where the
  conftest's 8 forced CPU devices are not wanted): the suite's XLA:CPU flags
  (tests/conftest.py, ``JAXLP_TEST_XLA_CPU_FLAGS``: the elemental fusion emitters, which compile
  faster), then ``extra``."""
  return " ".join(f for f in (os.environ.get("JAXLP_TEST_XLA_CPU_FLAGS", ""), *extra) if f)


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
