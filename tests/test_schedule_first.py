"""tests/conftest.py's list of slow tests to schedule first names tests that exist: a renamed or
removed test would silently drop out of the longest-first order."""

import re
from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_every_scheduled_first_name_is_a_test_function():
  names = conftest._SCHEDULE_FIRST
  assert len(set(names)) == len(names), "a name is listed twice"
  for name in names:
    path, func = name.split("::")
    src = ROOT / path
    assert src.is_file(), f"{name}: no file {path}"
    assert re.search(rf"^def {re.escape(func)}\(", src.read_text(), re.M), \
        f"{name}: {path} has no test function {func}"
