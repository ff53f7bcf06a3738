"""The README's python snippets run as written; its test command is the one CI runs."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_readme_python_snippets_run():
  blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
  assert len(blocks) >= 5
  ns: dict = {}
  for i, code in enumerate(blocks):
    try:
      exec(compile(code, f"README.md python block {i}", "exec"), ns)  # noqa: S102
    except Exception as e:  # pragma: no cover - the message names the block
      raise AssertionError(f"README python block {i} failed: {e!r}\n{code}") from e


def test_ci_runs_the_readme_test_command():
  out = subprocess.run(
      ["awk", "/<!-- ci:test-command -->/{f=1; next} f && /^(pip|python|bash|jaxlp)/{print; exit}",
       os.path.join(ROOT, "README.md")], capture_output=True, text=True, check=True).stdout
  assert "pytest" in out and out.startswith("pip install")
  assert "ci:test-command" in open(os.path.join(ROOT, ".ci", "run")).read()
