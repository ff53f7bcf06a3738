"""DGC's momentum correction replaces SGD's momentum (issue 16): jaxlp train refuses the stack."""

import pytest

pytest.importorskip("optax", reason="jaxlp.training needs the examples extra")

from jaxlp.cli import main  # noqa: E402
from jaxlp.training import TrainConfig, train  # noqa: E402


def test_dgc_with_sgd_momentum_is_refused_naming_both(capsys):
  assert main(["train", "--compress", "dgc:ratio=0.01", "--epochs", "1"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1
  assert "--compress dgc:ratio=0.01" in err and "--momentum 0" in err and "twice" in err


@pytest.mark.usefixtures("fast_compile")  # runs, finite; any optimization level
@pytest.mark.parametrize("flags", [{"momentum": 0.0}, {"compress": "dgc:ratio=0.01,momentum=0"}])
def test_dgc_runs_with_one_momentum(flags):
  cfg = TrainConfig(**({"compress": "dgc:ratio=0.01", "nodes": 2, "epochs": 1,
                        "max_steps_per_epoch": 2, "quiet": True} | flags))
  assert train(cfg)[0]["nonfinite_steps"] == 0
