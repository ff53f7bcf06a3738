"""jaxlp's module import graph has no circles and follows DESIGN.md's layering.

Every module under ``jaxlp/`` is parsed with ``ast`` (nothing is imported) and EVERY import
statement counts: at module level, inside functions, under ``if`` and ``try``. A lazy import
still makes the importing module depend on the imported one when it runs, and an import moved
into a function to dodge a circular import is exactly what this test is meant to find. Calls
``importlib.import_module("jaxlp....")`` with a constant name count too.

Edges (module -> module):

* ``import jaxlp.a.b`` and ``from jaxlp.a.b import x``: ``jaxlp.a.b``.
* ``from jaxlp.a import b``: ``jaxlp.a.b`` where that is a module, else the package
  ``jaxlp.a`` (its ``__init__``).
* A package's ``__init__`` is a module like any other: its re-exports are its edges.
* Importing ``jaxlp.a.b`` gives NO edge to the package ``jaxlp.a``, although Python runs
  ``jaxlp/a/__init__.py`` first: that is the package's own dependency, not the importer's;
  counted, it would make every re-exported submodule a circle with its package. For the same
  reason the root's lazy subpackage attributes (``jaxlp/__init__.py``'s ``__getattr__``, an
  ``import_module(f"jaxlp.{name}")`` with a computed name) are not edges. The other computed
  import, the deprecated class names of ``jaxlp/parallel/compressors/__init__.py``, goes down
  into that package's own submodules.

Layers, lowest first (DESIGN.md: formats <- pallas <- ops <- {flax, optim, parallel} <-
{torch, cli}): the helpers ``jaxlp._util`` and ``jaxlp._deprecation``; ``formats``;
``pallas``; ``ops``; ``flax``, ``optim``, ``parallel``; the root ``jaxlp/__init__.py`` (the
curated public API: it re-exports formats, pallas, ops and parallel); ``torch``, ``cli``,
``training`` (the top: users of the public API); ``jaxlp/_entry.py`` (the command's entry
point) and ``jaxlp/__main__.py``. A module may import
its own package and any module of a lower layer. Packages of one layer may import each other
(``parallel`` reaches ``optim.lars`` through a deprecated name; ``cli`` runs ``training``)
as long as the graph of packages has no circle, which is checked as well.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxlp"

#: The layer of each top-level name under jaxlp/ (a subpackage or a module); "" is the root
#: ``jaxlp/__init__.py``. Lower imports nothing from higher.
LAYERS = {
    "_util": 0, "_deprecation": 0,
    "formats": 1,
    "pallas": 2,
    "ops": 3,
    "flax": 4, "optim": 4, "parallel": 4,
    "": 5,
    "torch": 6, "cli": 6, "training": 6,
    "_entry": 7, "__main__": 7,
}


def _modules(root=None):
  """{dotted module name: (path, is_package)} for every .py file under ``root`` (jaxlp/), and
  every C extension's source (``setup.py``: ``jaxlp/torch/_cnoise.c``, a module that imports
  nothing from jaxlp)."""
  root = ROOT if root is None else root
  mods = {}
  for path in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
      parts = parts[:-1]
    mods[".".join(parts)] = (path, is_pkg)
  return mods


def _targets(node, name, is_pkg, mods):
  """The jaxlp modules one import node (or ``import_module`` call) names."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  elif isinstance(node, ast.ImportFrom):
    if node.level:  # relative: resolved against the importing module's package
      base = (name if is_pkg else name.rpartition(".")[0]).split(".")
      base = base[:len(base) - node.level + 1]
      mod = ".".join(base + ([node.module] if node.module else []))
    else:
      mod = node.module or ""
    names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
  elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
        == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)):
    names = [node.args[0].value]
  else:
    return []
  out = []
  for t in names:
    if t == "jaxlp" or t.startswith("jaxlp."):
      while t not in mods:  # ``import jaxlp.a.b.attr`` style: the longest module prefix
        t = t.rpartition(".")[0]
      out.append(t)
  return out


def import_graph(root=None):
  """{module: {imported module: first line}} over every import statement of every module."""
  mods = _modules(root)
  graph = {}
  for name, (path, is_pkg) in mods.items():
    edges = graph.setdefault(name, {})
    if path.suffix != ".py":
      continue
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      for t in _targets(node, name, is_pkg, mods):
        if t != name:
          edges.setdefault(t, node.lineno)
  return graph


def strongly_connected(graph):
  """Tarjan's strongly connected components of ``graph`` ({node: iterable of nodes}),
  iterative (no recursion limit); each component a sorted list."""
  index, low, on_stack, stack, comps = {}, {}, set(), [], []
  counter = 0
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph.get(start, ()))))]
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = counter
          counter += 1
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph.get(w, ())))))
        elif w in on_stack:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          comp.append(w)
          if w == v:
            break
        comps.append(sorted(comp))
  return comps


def _package(module: str) -> str:
  """The top-level name under jaxlp/ a module belongs to ("" for the root)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def _where(graph, a, b):
  path = _modules()[a][0].relative_to(ROOT.parent)
  return f"{path}:{graph[a][b]} imports {b}"


def test_strongly_connected_finds_circles():
  """The circle finder finds a circle through a lazy import (the case the suite is for)."""
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
  assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d"], ["e"]]
  mods = {"jaxlp.x": None, "jaxlp.y": None, "jaxlp.y.z": None}
  fn = ast.parse("def f():\n  from jaxlp.y import z\n  import jaxlp.x\n  from jaxlp.y import w\n")
  found = [t for n in ast.walk(fn) for t in _targets(n, "jaxlp.q", False, mods)]
  assert sorted(found) == ["jaxlp.x", "jaxlp.y", "jaxlp.y.z"]


def test_the_graph_sees_every_module_and_lazy_imports():
  """Sanity: the parse covers the package, and finds an import inside a function."""
  graph = import_graph()
  assert {"jaxlp", "jaxlp.formats._quantize", "jaxlp.ops._block_dot",
          "jaxlp.pallas._block_gemm", "jaxlp.parallel._aggregate"} <= set(graph)
  assert "jaxlp.optim" in graph["jaxlp.parallel"]  # a deprecated name, imported on access


def test_no_import_circles():
  """No two modules of jaxlp import each other, directly or through others."""
  graph = import_graph()
  circles = [c for c in strongly_connected(graph) if len(c) > 1]
  detail = []
  for comp in circles:
    members = set(comp)
    detail += [_where(graph, a, b) for a in comp for b in sorted(graph[a]) if b in members]
  assert not circles, ("import circles (move what both sides need to the lower module):\n  "
                       + "\n  ".join(detail))


def test_every_package_has_a_layer():
  unknown = sorted({_package(m) for m in import_graph()} - set(LAYERS))
  assert not unknown, (f"jaxlp/{unknown}: not in tests/test_layering.py's LAYERS; give each "
                       "new package its layer (DESIGN.md)")


def test_layers_import_only_downwards():
  """formats imports nothing above it, pallas nothing from ops and above, ops nothing from
  flax/optim/parallel/torch/cli/training, ...: every edge goes to the same package or to a
  lower layer (LAYERS)."""
  graph = import_graph()
  bad = [_where(graph, a, b) + f" (layer {LAYERS[_package(a)]} -> {LAYERS[_package(b)]})"
         for a in sorted(graph) for b in sorted(graph[a])
         if LAYERS[_package(b)] > LAYERS[_package(a)]]
  assert not bad, "imports against DESIGN.md's layering:\n  " + "\n  ".join(bad)


def test_no_circles_between_packages():
  """Packages of one layer may import each other, but not both ways (through any path)."""
  graph = import_graph()
  pkgs = {}
  for a, bs in graph.items():
    pkgs.setdefault(_package(a), set()).update(
        _package(b) for b in bs if _package(b) != _package(a))
  circles = [c for c in strongly_connected(pkgs) if len(c) > 1]
  assert not circles, f"circles between jaxlp's packages: {circles}"


@pytest.mark.parametrize("pkg,forbidden", [
    ("formats", ("pallas", "ops", "flax", "optim", "parallel", "torch", "cli", "training")),
    ("pallas", ("ops", "flax", "optim", "parallel", "torch", "cli", "training")),
    ("ops", ("flax", "optim", "parallel", "torch", "cli", "training")),
    ("_util", ("formats", "pallas", "ops", "flax", "optim", "parallel", "torch", "cli",
               "training")),
])
def test_design_md_layering_spelled_out(pkg, forbidden):
  """DESIGN.md's rules as stated there (redundant with LAYERS, readable on its own)."""
  graph = import_graph()
  bad = [_where(graph, a, b) for a in sorted(graph) if _package(a) == pkg
         for b in sorted(graph[a]) if _package(b) in forbidden or _package(b) == ""]
  assert not bad, f"jaxlp/{pkg} imports from above it:\n  " + "\n  ".join(bad)


def test_nothing_below_the_top_imports_torch_cli_or_training():
  graph = import_graph()
  top = {"torch", "cli", "training", "_entry", "__main__"}
  bad = [_where(graph, a, b) for a in sorted(graph) if _package(a) not in top
         for b in sorted(graph[a]) if _package(b) in top]
  assert not bad, "the top packages are imported from below:\n  " + "\n  ".join(bad)
