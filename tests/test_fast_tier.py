"""The fast tier (``python -m pytest -q -n 2 --dist loadgroup -m "not slow"``; tests/conftest.py's
``_SLOW`` and ``_FAST_CASES``): its lists name tests that exist, and it keeps fast tests in
every folder of ``tests/`` and for every package of ``jaxlp``, so that each part of the
package is still exercised by it.

The tree is read with ``ast`` (test functions are the top-level ``def test_*``; a
``@pytest.mark.slow`` decorator counts as slow), so these checks cost no collection; the cases
named by ``_FAST_CASES`` (parametrization ids) are checked against this run's collection.
"""

import ast
import subprocess
import sys
from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _decorated_slow(fn) -> bool:
  return any("mark.slow" in ast.unparse(d) for d in fn.decorator_list)


def _test_functions():
  """{module path (from the repository root): {function name: decorated slow}}."""
  out = {}
  for path in sorted(TESTS.rglob("test_*.py")):
    tree = ast.parse(path.read_text(), str(path))
    out[path.relative_to(ROOT).as_posix()] = {
        n.name: _decorated_slow(n) for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
  return out


def _fast_functions(module, functions):
  """The functions of ``module`` with at least one case in the fast tier."""
  kept = {name.split("::")[1].split("[")[0] for name in conftest._FAST_CASES
          if name.startswith(module + "::")}
  return sorted(f for f, slow in functions.items() if not slow
                and (conftest.slow_reason(f"{module}::{f}") is None or f in kept))


def test_readme_fast_tier_is_the_full_suite_without_the_slow_tests():
  """The README's fast-tier command is its test command's pytest call plus ``-m "not slow"``."""
  readme = (ROOT / "README.md").read_text()
  ci = readme.split("<!-- ci:test-command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
  full = ci[ci.index("python -m pytest"):]
  assert f'{full} -m "not slow"' in readme, f"README: no fast-tier command {full} -m \"not slow\""


def test_every_slow_entry_names_an_existing_module_function_or_case():
  mods = _test_functions()
  names = conftest._SLOW + conftest._FAST_CASES
  assert len(set(names)) == len(names), "a name is listed twice"
  for name in names:
    module, _, rest = name.partition("::")
    assert module in mods, f"{name}: no test module {module}"
    function = rest.split("[")[0]
    assert not rest or function in mods[module], f"{name}: {module} has no test function {function}"
    assert not (rest and mods[module][function]), \
        f"{name}: already has @pytest.mark.slow in its file; list it in one place only"


def test_fast_cases_are_cases_of_slow_functions():
  for name in conftest._FAST_CASES:
    assert "[" in name, f"{name}: _FAST_CASES holds cases (path::function[id])"
    function = name.split("[")[0]
    assert conftest.slow_reason(function) is not None, \
        f"{name}: its function is not slow, so listing the case changes nothing"
    assert conftest.slow_reason(name) is None


def test_slow_reason_matches_module_function_and_case():
  """The marking rule itself: a module entry marks every test of it, a function entry every
  case, a case entry one case; ``_FAST_CASES`` wins."""
  assert conftest.slow_reason("tests/test_docs.py::test_anything") == "tests/test_docs.py"
  fn = "tests/cli/test_reproduce.py::test_every_claim_runs_at_toy_size"
  assert conftest.slow_reason(fn + "[cpd]") == fn
  case = "tests/torch_bridge/test_qtorch_tree.py::test_qpytorch_suite_stochastic_block"
  assert conftest.slow_reason(case + "[qtorch]") == case + "[qtorch]"
  assert conftest.slow_reason(case + "[jaxlp.torch.qtorch]") is None
  assert conftest.slow_reason(conftest._FAST_CASES[0]) is None
  assert conftest.slow_reason("tests/formats/test_errors.py::test_bad_key[x]") is None


def test_every_tests_folder_and_every_partly_slow_module_keeps_fast_tests():
  """Each folder of tests/ has fast tests; a module whose tests are all slow is listed as a
  whole in ``_SLOW`` (a decision, not an accident of listing each of its functions)."""
  mods = _test_functions()
  folders = {}
  for module, functions in mods.items():
    fast = _fast_functions(module, functions)
    folders.setdefault(module.rpartition("/")[0], []).extend(fast)
    if module not in conftest._SLOW:
      assert fast, (f"{module}: every test is slow; list the module itself in conftest's "
                    "_SLOW, or keep one of its tests fast")
    else:
      assert not fast or not functions, f"{module} is listed whole but not all of it is slow"
  empty = sorted(folder for folder, fast in folders.items() if not fast)
  assert not empty, f"folders of tests/ with no test in the fast tier: {empty}"


def _jaxlp_imports(module):
  """The ``jaxlp`` modules a test module imports: ``import`` statements (a ``from X import y``
  names both ``X`` and ``X.y``) and ``importlib.import_module("...")`` calls with a literal."""
  names = set()
  for n in ast.walk(ast.parse((ROOT / module).read_text())):
    if isinstance(n, ast.Import):
      names |= {a.name for a in n.names}
    elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
      names |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    elif (isinstance(n, ast.Call) and ast.unparse(n.func).endswith("import_module") and n.args
          and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
      names.add(n.args[0].value)
  return {name for name in names if name == "jaxlp" or name.startswith("jaxlp.")}


def test_every_jaxlp_subpackage_is_imported_by_a_module_with_fast_tests():
  """Each package of ``jaxlp`` (every folder with an ``__init__.py``, down to
  ``jaxlp.torch.cpdtorch.utils``) is imported by at least one test module that keeps tests in
  the fast tier: its test area is not left to the full suite alone."""
  mods = _test_functions()
  imports = {m: _jaxlp_imports(m) for m in mods if _fast_functions(m, mods[m])}
  packages = sorted(".".join(p.parent.relative_to(ROOT).parts)
                    for p in (ROOT / "jaxlp").rglob("__init__.py"))
  assert "jaxlp.torch.cpdtorch.utils" in packages  # the walk reaches nested packages
  bare = [pkg for pkg in packages
          if not any(n == pkg or n.startswith(pkg + ".") for ns in imports.values() for n in ns)]
  assert not bare, f"jaxlp packages that no test module with fast tests imports: {bare}"


def test_fast_cases_exist(request):
  """Every case of ``_FAST_CASES`` is a collected parametrization (a renamed id would silently
  drop the module's representative). Read from this run's collection where it collected the
  function (the fast tier and the full suite do); else from collecting those modules."""
  seen = dict(request.config.stash.get(conftest.FAST_CASES_SEEN, {}))
  missing_functions = {n.split("[")[0] for n in conftest._FAST_CASES} - set(seen)
  if missing_functions:
    modules = sorted({f.split("::")[0] for f in missing_functions})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *modules], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for line in out.stdout.splitlines():
      function = line.split("[")[0]
      if function in missing_functions:
        seen.setdefault(function, set()).add(line.strip())
  absent = [n for n in conftest._FAST_CASES if n not in seen.get(n.split("[")[0], ())]
  assert not absent, f"_FAST_CASES names cases that are not collected: {absent}"
