"""The public API: every name in ``__all__`` of every public package resolves, is documented,
and is not shadowed by a module of the same name.

Implementation modules have private names (``jaxlp/formats/_quantize.py``); a public package
re-exports what users call. A module named like a function it exports (``jaxlp.parallel.psum``
was both) makes ``import jaxlp.parallel.psum`` and ``mock.patch("jaxlp.parallel.psum...")``
depend on import order, which is what this test forbids.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import jax
import pytest

PUBLIC_PACKAGES = [
    "jaxlp", "jaxlp.formats", "jaxlp.ops", "jaxlp.pallas", "jaxlp.parallel",
    "jaxlp.parallel.compressors", "jaxlp.optim", "jaxlp.flax", "jaxlp.flax.linen",
    "jaxlp.flax.nnx", "jaxlp.flax.models", "jaxlp.torch", "jaxlp.torch.nn", "jaxlp.torch.ddp",
    "jaxlp.torch.cpd", "jaxlp.training",
    # QPyTorch's and CPD's module trees (migration by one import prefix)
    "jaxlp.torch.qtorch", "jaxlp.torch.qtorch.number", "jaxlp.torch.qtorch.quant",
    "jaxlp.torch.qtorch.quant.quant_function", "jaxlp.torch.qtorch.quant.quant_module",
    "jaxlp.torch.qtorch.optim", "jaxlp.torch.qtorch.optim.optim_low",
    "jaxlp.torch.qtorch.auto_low", "jaxlp.torch.cpdtorch", "jaxlp.torch.cpdtorch.quant",
    "jaxlp.torch.cpdtorch.quant.quant_function", "jaxlp.torch.cpdtorch.quant.quant_module",
    "jaxlp.torch.cpdtorch.utils", "jaxlp.torch.cpdtorch.utils.dist_util",
]


def _import(name):
  if name.startswith("jaxlp.torch"):
    pytest.importorskip("torch")
  if name.startswith(("jaxlp.flax", "jaxlp.optim", "jaxlp.training")):
    pytest.importorskip("flax" if "flax" in name else "optax")
  return importlib.import_module(name)


@pytest.mark.parametrize("pkg_name", PUBLIC_PACKAGES)
def test_every_public_name_resolves_and_is_documented(pkg_name):
  pkg = _import(pkg_name)
  names = getattr(pkg, "__all__", None)
  assert names, f"{pkg_name} has no __all__"
  assert len(names) == len(set(names)), f"{pkg_name}.__all__ has duplicates"
  assert inspect.getdoc(pkg), f"{pkg_name} has no module docstring"
  for name in names:
    assert hasattr(pkg, name), f"{pkg_name}.{name} is in __all__ but does not resolve"
    obj = getattr(pkg, name)
    if isinstance(obj, types.ModuleType):
      assert obj.__name__ == f"{pkg_name}.{name}", f"{pkg_name}.{name} is {obj.__name__}"
      continue
    if callable(obj):  # classes need their own docstring, not an inherited one
      doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
      assert doc and doc.strip(), f"{pkg_name}.{name} has no docstring"


@pytest.mark.parametrize("pkg_name", PUBLIC_PACKAGES)
def test_every_public_function_has_args_returns_and_an_example(pkg_name):
  """Args / Returns for functions with parameters, a runnable example (``>>>``, run by
  tests/test_doctests.py) for every function and class."""
  pkg = _import(pkg_name)
  for name in pkg.__all__:
    obj = getattr(pkg, name)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
      continue
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"{pkg_name}.{name}: no example in its docstring"
    if inspect.isfunction(obj) and inspect.signature(obj).parameters:
      assert "Args:" in doc and "Returns:" in doc, f"{pkg_name}.{name}: no Args:/Returns:"


#: The public names that are packages (the others are plain modules: jaxlp.flax.linen, ...).
PUBLIC_SUBPACKAGES = [
    "jaxlp", "jaxlp.formats", "jaxlp.ops", "jaxlp.pallas", "jaxlp.parallel",
    "jaxlp.parallel.compressors", "jaxlp.optim", "jaxlp.flax", "jaxlp.torch", "jaxlp.training",
    "jaxlp.torch.qtorch", "jaxlp.torch.qtorch.quant", "jaxlp.torch.qtorch.optim",
    "jaxlp.torch.cpdtorch", "jaxlp.torch.cpdtorch.quant", "jaxlp.torch.cpdtorch.utils",
]


@pytest.mark.parametrize("pkg_name", PUBLIC_SUBPACKAGES)
def test_no_module_shadows_a_public_name(pkg_name):
  pkg = _import(pkg_name)
  assert hasattr(pkg, "__path__"), f"{pkg_name} is not a package"
  exported = set(pkg.__all__)
  for info in pkgutil.iter_modules(pkg.__path__):
    if info.name.startswith("_"):
      continue
    # A public submodule is a namespace users import (jaxlp.flax.linen): it must be exported
    # as that module, never hidden behind a function or class of the same name.
    # Integrations with optional dependencies load on first access and stay out of __all__
    # (``from jaxlp import *`` must not need flax or torch).
    lazy = getattr(pkg, "_LAZY", ())
    assert info.name in exported or info.name in lazy, (
        f"{pkg_name}.{info.name} is a public module missing from __all__ (make it private: "
        f"{pkg_name}._{info.name})")
    if info.name in lazy and info.name != "cli":
      pytest.importorskip({"flax": "flax", "optim": "optax", "training": "optax"}.get(
          info.name, info.name))
    obj = getattr(pkg, info.name)
    assert isinstance(obj, types.ModuleType), (
        f"module {pkg_name}.{info.name} is shadowed by {type(obj).__name__} "
        f"{pkg_name}.{info.name}")


def test_deprecated_names_warn_and_still_work():
  import jaxlp.parallel as P
  import jaxlp.parallel.compressors as C

  pytest.importorskip("optax")
  from jaxlp.optim import lars
  with pytest.warns(DeprecationWarning, match="jaxlp.optim.lars"):
    assert P.lars is lars
  with pytest.warns(DeprecationWarning, match=r"compressors\.cgx\(\.\.\.\)"):
    assert C.CGX is type(C.cgx())


def test_ordered_psum_and_compression_state_old_spellings():
  import jax.numpy as jnp

  from jaxlp.parallel import compressors as C
  from jaxlp.parallel import init_compression_state, ordered_psum

  x = jnp.arange(4.0)
  want = jax.vmap(lambda v: ordered_psum(v, "w"), axis_name="w")(x)
  with pytest.warns(DeprecationWarning, match="w is deprecated"):
    old = jax.vmap(lambda v: ordered_psum(v, "w", 4), axis_name="w")(x)
  assert jnp.array_equal(old, want) and float(want[0]) == 6.0
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="has size 4"):
    jax.vmap(lambda v: ordered_psum(v, "w", 3), axis_name="w")(x)
  state = init_compression_state(C.topk(0.5), {"a": jnp.zeros(8)}, min_size=0)
  with pytest.warns(DeprecationWarning, match="use CompressionState.count"):
    assert state.step is state.count


def test_renamed_format_keywords_warn_and_give_the_same_object():
  from jaxlp import formats as F
  from jaxlp import mx_policy

  with pytest.warns(DeprecationWarning, match=r"mx\(elem=...\) is deprecated: use fmt="):
    assert F.mx(elem=F.E4M3FN, block_size=8) == F.mx(F.E4M3FN, 8)
  with pytest.warns(DeprecationWarning, match="grad_fmt"):
    assert mx_policy(F.E4M3FN, 8, grad_elem=F.E5M2) == mx_policy(F.E4M3FN, 8, grad_fmt=F.E5M2)
  with pytest.raises(TypeError, match="pass fmt= only"):
    F.mx(fmt=F.E4M3FN, elem=F.E4M3FN)
  optax = pytest.importorskip("optax")
  import jaxlp.optim as optim
  with pytest.warns(DeprecationWarning, match="use fmt="):
    optim.trace(0.9, format=F.BF16, key=jax.random.key(0))
  with pytest.warns(DeprecationWarning, match="use wide_fmt="), pytest.warns(
      DeprecationWarning, match="narrow=...\\) is deprecated: use fmt="):
    optim.master_weights(optax.sgd(0.1), narrow=F.BF16, wide=F.FP32)
  with pytest.warns(DeprecationWarning, match="use mu_fmt="):
    optim.scale_by_adam(mu_format=F.BF16, key=jax.random.key(0))


def test_import_path_equals_attribute_path():
  """``import a.b.c as m`` and ``a.b.c`` are the same object for every public module."""
  for pkg_name in PUBLIC_PACKAGES:
    pkg = _import(pkg_name)
    parent, _, leaf = pkg_name.rpartition(".")
    if parent:
      assert getattr(importlib.import_module(parent), leaf) is pkg, pkg_name


# names a test folder must not take: pytest puts tests/ on sys.path (rootdir conftest), and a
# folder without __init__.py named like a dependency becomes a namespace package that
# ``import <dependency>`` finds when the dependency is not installed (``import torch`` then
# "succeeds", and importorskip no longer skips)
_DEPENDENCIES = ("jax", "jaxlib", "numpy", "ml_dtypes", "flax", "optax", "chex", "torch",
                 "matplotlib", "sklearn", "triton", "qtorch", "hypothesis", "pytest")


def test_no_test_folder_shadows_a_dependency():
  from pathlib import Path

  tests = Path(__file__).parent
  folders = {p.name for p in tests.iterdir() if p.is_dir()}
  assert not folders & set(_DEPENDENCIES), sorted(folders & set(_DEPENDENCIES))
