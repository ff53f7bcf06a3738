"""Every docstring example in the package runs and prints what it shows (doctest).

Modules of optional integrations are skipped where their dependency is not installed.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import jaxlp

_OPTIONAL = {"jaxlp.torch": "torch", "jaxlp.flax": "flax", "jaxlp.optim": "optax"}


def _modules():
  names = ["jaxlp"]
  for info in pkgutil.walk_packages(jaxlp.__path__, "jaxlp."):
    if info.name.endswith("__main__"):
      continue
    names.append(info.name)
  return names


#: Modules whose examples print only what holds at any XLA optimization level (shapes, report
#: entries, counts, structure, epochs of a toy run, comparisons): their examples compile with
#: XLA's optimizations off (``fast_compile``, tests/conftest.py). The others print computed
#: values (quantized numbers, reductions): they claim production bits and compile normally.
_ANY_LEVEL = ("jaxlp.flax", "jaxlp.flax._report", "jaxlp.flax.linen", "jaxlp.flax.models",
              "jaxlp.parallel._secopa", "jaxlp.training._loop", "jaxlp.training._reproduce")


@pytest.mark.parametrize("name", [n for n in _modules() if n not in _ANY_LEVEL])
def test_docstring_examples(name):
  _run_doctests(name)


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("name", _ANY_LEVEL)
def test_docstring_examples_at_any_level(name):
  _run_doctests(name)


def test_the_modules_at_any_level_exist():
  assert set(_ANY_LEVEL) <= set(_modules())


def _run_doctests(name):
  for prefix, dep in _OPTIONAL.items():
    if name == prefix or name.startswith(prefix + "."):
      pytest.importorskip(dep)
  if name.startswith(("jaxlp.cli", "jaxlp.training")):  # built-in data, flax models
    for dep in ("sklearn", "flax", "optax"):
      pytest.importorskip(dep)
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for test in finder.find(module, name):
    runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
