"""The README's python snippets run as written; its test command is the one CI runs."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


# XLA's optimizations off (tests/conftest.py, ``fast_compile``, as the benchmark scripts' smoke
# runs): the snippets' time is mostly XLA's compiles (cold: 135 s -> 87 s of CPU, 2-core VM,
# 2026-11-30). The snippets' own checks compare programs compiled here with each other, under
# the same setting, never with a program compiled normally; the two bit claims among them are
# also checked compiled normally: the Pallas kernel == jaxlp.matmul (tests/pallas/
# test_pallas_matmul.py) and all_gather(reduce_scatter) == psum (tests/parallel/test_sharded.py).
@pytest.mark.usefixtures("fast_compile")
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
