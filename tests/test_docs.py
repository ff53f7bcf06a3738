"""The API reference builds from the docstrings with warnings as errors (README: Development)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_builds_without_warnings(tmp_path):
  pytest.importorskip("sphinx")
  pytest.importorskip("torch")
  pytest.importorskip("flax")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "html",
       str(ROOT / "docs"), str(tmp_path / "html")],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  page = (tmp_path / "html" / "api" / "parallel.html").read_text()
  assert "reduce_gradients" in page and "ordered_psum" in page
