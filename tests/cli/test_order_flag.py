"""--order is used by the low-precision sum it orders, or refused (issue 15: every flag is used
or refused)."""

import pytest

pytest.importorskip("optax", reason="jaxlp.training needs the examples extra")

from jaxlp.cli import main  # noqa: E402


@pytest.mark.parametrize("extra", [[], ["--compress", "cgx:bits=4"]], ids=["fp32", "compress"])
def test_order_without_a_low_precision_sum_is_refused(extra, capsys):
  assert main(["train", "--order", "ring", "--epochs", "1", *extra]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "--order ring applies only" in err
