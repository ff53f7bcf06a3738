"""``jaxlp reproduce nvfp4``'s loss-gap table (jaxlp/training/_gap.py) on crafted rows: the
means, the paired differences and their standard errors, the gap closed, the table and the
plots. (The claim itself runs end to end at toy size in test_reproduce.py.)"""

import json
import math
import os

import pytest

pytest.importorskip("optax", reason="jaxlp.training needs the examples extra")

from jaxlp.training import CLAIMS  # noqa: E402
from jaxlp.training._gap import add_gap, final_loss, gap_table, plot_gap  # noqa: E402


def _rows():
  return [
      {"label": "fp32", "final_train_loss": [0.10, 0.12, 0.08], "mean": 0.97},
      {"label": "bf16", "final_train_loss": [0.11, 0.13, 0.09], "mean": 0.96},
      {"label": "NVFP4", "final_train_loss": [0.31, 0.33, 0.29], "mean": 0.95},
      {"label": "+ piece", "final_train_loss": [0.21, 0.22, 0.20], "mean": 0.955},
      {"label": "worse", "final_train_loss": [0.41, 0.40, 0.45], "mean": 0.90},
  ]


def test_gap_closed_and_paired_differences():
  rows = _rows()
  add_gap(rows, "bf16", "NVFP4")
  by = {r["label"]: r for r in rows}
  assert math.isclose(by["NVFP4"]["final_loss_mean"], 0.31)
  assert math.isclose(by["NVFP4"]["final_loss_sd"], 0.02)
  assert by["NVFP4"]["gap_closed"] == 0.0 and by["NVFP4"]["delta_loss"] == 0.0
  assert math.isclose(by["bf16"]["gap_closed"], 100.0)
  # (0.31 - 0.21) / (0.31 - 0.11) = 50 %
  assert math.isclose(by["+ piece"]["gap_closed"], 50.0)
  # paired: [-0.10, -0.11, -0.09] -> mean -0.10, sd 0.01, s.e. 0.01 / sqrt(3)
  assert math.isclose(by["+ piece"]["delta_loss"], -0.10)
  assert math.isclose(by["+ piece"]["delta_loss_se"], 0.01 / math.sqrt(3))
  assert by["worse"]["gap_closed"] < 0
  assert math.isclose(by["fp32"]["gap_closed"], 105.0)
  table = gap_table({"rows": rows}, "bf16", "NVFP4")
  assert "| + piece | 0.2100 +- 0.0100 (0.2100, 0.2200, 0.2000) | -0.1000 +- 0.0058 | +50% |" \
         in table
  assert table.splitlines()[0].startswith("| row | final loss")


def test_final_loss_is_the_mean_of_the_last_epochs():
  hist = [{"train_loss": v, "steps": 10} for v in (9.0, 1.0, 2.0, 3.0, 4.0, 5.0)]
  assert final_loss(hist) == 3.0  # the last 5 epochs
  assert final_loss(hist, 2) == 4.5 and final_loss(hist[:1]) == 9.0
  hist[-1]["steps"] = 30  # a longer epoch weighs more
  assert math.isclose(final_loss(hist, 2), (4.0 * 10 + 5.0 * 30) / 40)


def test_no_gap_and_bad_labels():
  rows = _rows()
  rows[2]["final_train_loss"] = [0.1, 0.1, 0.1]  # NVFP4 better than bf16: no gap to close
  add_gap(rows, "bf16", "NVFP4")
  assert all(r["gap_closed"] is None for r in rows)
  assert "| - |" in gap_table({"rows": rows}, "bf16", "NVFP4")
  with pytest.raises(ValueError, match="'fp16' is not a row"):
    add_gap(_rows(), "fp16", "NVFP4")


def test_gap_plots(tmp_path):
  pytest.importorskip("matplotlib", reason="the plots need matplotlib")
  rows = _rows()
  for r in rows:
    r["dirs"] = []
    for s, loss in enumerate(r["final_train_loss"]):
      d = tmp_path / r["label"].replace(" ", "_").replace("+", "p") / f"seed{s}"
      d.mkdir(parents=True)
      lines = [{"epoch": e, "test_accuracy": 0.5, "train_loss": loss * (3 - e)}
               for e in (1, 2)]
      (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
      r["dirs"].append(str(d))
  add_gap(rows, "bf16", "NVFP4")
  paths = plot_gap({"rows": rows}, str(tmp_path / "out"), "bf16", "NVFP4")
  assert [os.path.basename(p) for p in paths] == ["loss_vs_epoch.png", "gap_closed.png"]
  assert all(os.path.getsize(p) > 1000 for p in paths)
  rows[4]["final_train_loss"] = [90.0, 80.0, 70.0]  # off the axis: clipped, value written
  add_gap(rows, "bf16", "NVFP4")
  assert len(plot_gap({"rows": rows}, str(tmp_path / "far"), "bf16", "NVFP4")) == 2
  rows[2]["final_train_loss"] = [0.0, 0.0, 0.0]  # no gap: an empty bar chart, with a note
  add_gap(rows, "bf16", "NVFP4")
  assert len(plot_gap({"rows": rows}, str(tmp_path / "none"), "bf16", "NVFP4")) == 2


def test_the_nvfp4_claim_rows():
  (setting,) = CLAIMS["nvfp4"].settings
  assert setting.gap == ("bf16", "NVFP4")
  policies = [r.flags["policy"] for r in setting.rows]
  assert policies == ["bf16", "nvfp4", "nvfp4+tiles", "nvfp4+sr", "nvfp4+rht", "nvfp4+ends",
                      "nvfp4-recipe", "mxfp4", "mxfp8", "mxfp8-rceil"]
  assert [r.label for r in setting.rows if r.claim] == ["NVFP4 recipe", "MXFP8 (rceil)"]
  assert setting.base == {"model": "cnn", "nodes": 1, "epochs": 30}
