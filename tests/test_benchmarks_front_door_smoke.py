"""Smoke test of the benchmarks' front door (``python -m benchmarks``, benchmarks/__main__.py):
it lists every benchmark and tool, each listed name's ``--help`` runs through it, arguments and
exit statuses pass through, unknown names are refused with status 2, and every benchmark path
or ``python -m benchmarks NAME`` the docs name exists."""

import glob
import importlib.util
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


def test_every_listed_name_runs_its_help():
  """``python -m benchmarks NAME --help`` for every benchmark and tool, all at once."""
  fd = _front_door()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = {n: subprocess.Popen([sys.executable, "-m", "benchmarks", n, "--help"], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
           for n in [*fd.BENCHMARKS, *fd.TOOLS]}
  for name, p in procs.items():
    out, err = p.communicate(timeout=300)
    dep = OPTIONAL.get(name)
    if dep and importlib.util.find_spec(dep) is None:
      assert p.returncode != 0 and f"No module named '{dep}'" in err, (name, err[-2000:])
    else:
      assert p.returncode == 0 and "usage:" in out, (name, out[-2000:], err[-2000:])


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
