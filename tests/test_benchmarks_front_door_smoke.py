"""Smoke test of the benchmarks' front door (``python -m benchmarks``, benchmarks/__main__.py):
it lists every benchmark and tool, each listed name's ``--help`` runs through it, arguments and
exit statuses pass through, unknown names are refused with status 2, and every benchmark path
or ``python -m benchmarks NAME`` the docs name exists."""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")

#: a script whose import needs an optional dependency: its --help fails without it (and says so)
OPTIONAL = {"torch_quantize": "torch", "ptx_per_mac": "triton"}


def _front_door():
  spec = importlib.util.spec_from_file_location("benchmarks_front_door",
                                                os.path.join(BENCH, "__main__.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _scripts(folder):
  return {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(folder, "*.py"))
          if not os.path.basename(p).startswith("_")}


def test_listing_covers_every_script_with_its_docstring(capsys):
  fd = _front_door()
  # every script is registered (a new one must say where it runs), and nothing else is
  assert set(fd.BENCHMARKS) == _scripts(BENCH)
  assert set(fd.TOOLS) == _scripts(os.path.join(BENCH, "tools"))
  assert fd.main([]) == 0
  out = capsys.readouterr().out
  for name, (where, _) in fd.BENCHMARKS.items():
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == [name])
    assert where in line and fd.summary(name) in line and len(fd.summary(name)) > 20, line
  assert not any(t in out.split() for t in fd.TOOLS), out  # tools are listed apart
  assert fd.main(["--list-tools"]) == 0
  out = capsys.readouterr().out
  for name, where in fd.TOOLS.items():
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == [name])
    assert where in line and fd.summary(name) in line, line
  assert fd.main(["--help"]) == 0 and "--list-tools" in capsys.readouterr().out


# Each listed script's --help, all in ONE Python process (the scripts run one after the other
# as ``__main__`` with ``sys.argv = [script, "--help"]``, as ``python SCRIPT --help`` runs
# them): ``python -m benchmarks NAME`` starts the front door and then the script, two
# interpreters and their imports for each of the ~25 names (20 CPU s in a full run, 2-core
# VM, 2026-11-30). What the front door adds for a name is the same for every name
# (``script(name)`` then ``run``): the lookup of each name is checked here, and the command
# itself runs for a tool here and for a benchmark in test_arguments_and_exit_status_pass_through
# (its status and its stderr), and the command with an unknown name in
# test_unknown_names_and_options_exit_with_status_2.
_HELP_ALL = r"""
import contextlib, io, json, runpy, sys
res = {}
for name, path in json.loads(sys.argv[1]).items():
  out, err, code = io.StringIO(), io.StringIO(), 0
  sys.argv = [path, "--help"]
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # an import that fails: as the interpreter reports it
      code, _ = 1, err.write(f"{type(e).__name__}: {e}")
  res[name] = (code, out.getvalue(), err.getvalue())
print(json.dumps(res))
"""


def test_every_listed_name_runs_its_help():
  """``NAME --help`` of every benchmark and tool, each script as its own ``__main__`` in one
  process; ``python -m benchmarks NAME --help`` through the front door for one tool."""
  fd = _front_door()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  names = [*fd.BENCHMARKS, *fd.TOOLS]
  paths = {n: fd.script(n) for n in names}
  for n, path in paths.items():  # the front door's lookup: benchmarks/NAME.py or tools/NAME.py
    folder = BENCH if n in fd.BENCHMARKS else os.path.join(BENCH, "tools")
    assert path == os.path.join(folder, f"{n}.py") and os.path.isfile(path), (n, path)
  tool = next(iter(fd.TOOLS))
  door = subprocess.Popen([sys.executable, "-m", "benchmarks", tool, "--help"], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  r = subprocess.run([sys.executable, "-c", _HELP_ALL, json.dumps(paths)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  out, err = door.communicate(timeout=300)
  assert door.returncode == 0 and "usage:" in out, (tool, out[-2000:], err[-2000:])
  assert r.returncode == 0, r.stderr[-3000:]
  results = json.loads(r.stdout.strip().splitlines()[-1])
  assert set(results) == set(names)
  for name, (code, out, err) in results.items():
    dep = OPTIONAL.get(name)
    if dep and importlib.util.find_spec(dep) is None:
      assert code != 0 and f"No module named '{dep}'" in err, (name, err[-2000:])
    else:
      assert code == 0 and "usage:" in out, (name, out[-2000:], err[-2000:])


def test_unknown_names_and_options_exit_with_status_2(capsys):
  fd = _front_door()
  for argv, needle in [(["nope"], "no benchmark or tool named 'nope'"),
                       (["--bogus"], "unknown option --bogus"),
                       (["--list-tools", "x"], "--list-tools takes no arguments"),
                       (["--run", "exact_train_check"], "no benchmark named 'exact_train_check'"),
                       (["--run", "--iters", "1"], "--run takes --small and benchmark names")]:
    assert fd.main(argv) == 2, argv
    assert needle in capsys.readouterr().err, argv
  r = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 2 and "error: no benchmark or tool named 'nope'" in r.stderr, r.stderr


def test_arguments_and_exit_status_pass_through(capfd):
  fd = _front_door()
  # engine_compile checks its arguments before importing JAX: its refusal (status 2) comes back
  assert fd.main(["engine_compile", "--workers", "1"]) == 2
  assert "--workers must be >= 2" in capfd.readouterr().err  # the child's own message


def test_run_takes_each_benchmark_s_ci_arguments(monkeypatch, capsys):
  fd = _front_door()
  calls = []
  monkeypatch.setattr(fd, "run", lambda name, args=(): calls.append((name, tuple(args))) or
                      (3 if name == "loopback" else 0))
  assert fd.main(["--run", "--small", "loopback", "engine_compile"]) == 3  # the first failure
  assert calls == [("loopback", ("--smoke",)), ("engine_compile", ("--model", "tiny"))]
  calls.clear()
  assert fd.main(["--run"]) == 3
  assert calls == [(n, ()) for n in fd.BENCHMARKS]
  assert "== quantize ==" in capsys.readouterr().out


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/RESULTS.md", "benchmarks/gpu_checks.sh",
                                 "jaxlp", "tests", "docs", "examples"])
def test_documented_benchmark_paths_exist(doc):
  fd = _front_door()
  path = os.path.join(ROOT, doc)
  files = ([path] if os.path.isfile(path) else
           [p for p in glob.glob(os.path.join(path, "**", "*"), recursive=True)
            if p.endswith((".py", ".md", ".rst", ".sh"))])
  for f in files:
    with open(f) as fh:
      text = fh.read()
    for ref in re.findall(r"benchmarks/[\w/]+\.(?:py|sh|md)", text):
      if "NAME" not in ref:  # a placeholder (benchmarks/NAME.py)
        assert os.path.exists(os.path.join(ROOT, ref)), (f, ref)
    for name in re.findall(r"python3? -m benchmarks ([a-z0-9_]+)", text):  # not NAME
      assert fd.script(name), (f, name)
