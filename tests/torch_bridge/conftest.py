"""Fixtures for the torch bridge tests: a module-scoped live QPyTorch import."""

import os

import pytest

torch = pytest.importorskip("torch", reason="jaxlp.torch tests need torch")


@pytest.fixture(scope="session")
def qtorch_quant():
  """``qtorch.quant`` (its CPU extension compiles on first import, ~40 s).

  Missing qtorch FAILS the parity tests unless JAXLP_ALLOW_NO_QTORCH=1 (then they skip with
  the reason), so parity is never silently untested.
  """
  try:
    import qtorch.quant as qq  # noqa: PLC0415
  except Exception as e:  # ImportError or a failed extension build
    if os.environ.get("JAXLP_ALLOW_NO_QTORCH") == "1":
      pytest.skip(f"qtorch not importable ({e!r}) and JAXLP_ALLOW_NO_QTORCH=1")
    pytest.fail(f"qtorch is needed for QPyTorch parity tests but failed to import: {e!r} "
                "(pip install --no-deps qtorch==0.3.0 ninja, or set JAXLP_ALLOW_NO_QTORCH=1)")
  return qq
