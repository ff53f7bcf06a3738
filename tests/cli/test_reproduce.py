"""``jaxlp reproduce``: every claim runs end to end at toy size; bad input exits 2 with one line.

The verdicts themselves come from the full built-in runs recorded in README / RESULTS.md (minutes
per claim, not CI material)."""

import json
import os

import pytest

pytest.importorskip("optax", reason="jaxlp.training needs the examples extra")

from jaxlp.cli import main  # noqa: E402
from jaxlp.training import CLAIMS  # noqa: E402


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_every_claim_runs_at_toy_size(name, tmp_path, capsys):
  args = ["reproduce", name, "--toy", "--seeds", "0", "--out", str(tmp_path)]
  if name != "ddp":
    args.append("--no-plot")  # one claim draws the plots
  assert main(args) == 0
  out = capsys.readouterr().out
  assert f"jaxlp reproduce {name}" in out and "| claim | setting | row |" in out
  summary = json.loads((tmp_path / name / "summary.json").read_text())
  assert summary["seeds"] == [0] and summary["toy"]
  for setting, spec in zip(summary["settings"], CLAIMS[name].settings, strict=True):
    labels = [r["label"] for r in setting["rows"]]
    assert labels == ["fp32"] + [r.label for r in spec.rows]
    assert {r["verdict"] for r in setting["rows"][1:]} == {"toy run: no verdict"}
    if CLAIMS[name].metric == "perplexity":  # language models: test perplexity
      assert all(1.0 < r["mean"] < 1e4 for r in setting["rows"])
      assert all(len(r["final_perplexity"]) == 1 for r in setting["rows"])
    else:
      assert all(0.0 <= r["mean"] <= 1.0 for r in setting["rows"])
    if spec.gap is not None:  # nvfp4: every row's final loss and the gap it closes
      assert setting["gap"] == list(spec.gap)
      assert all(len(r["final_train_loss"]) == 1 and "gap_closed" in r
                 for r in setting["rows"])
      assert "final training loss" in (tmp_path / name / "REPORT.md").read_text()
  assert (tmp_path / name / "REPORT.md").exists()
  if name == "ddp":
    assert (tmp_path / name / "s0" / "accuracy_vs_epoch.png").exists()
    # finished runs are reused: the same report again, nothing retrained
    assert main(args) == 0
    again = json.loads((tmp_path / name / "summary.json").read_text())
    assert again["settings"][0]["rows"] == summary["settings"][0]["rows"]


@pytest.mark.parametrize("argv, message", [
    (["reproduce"], "give a claim"),
    (["reproduce", "nope"], "unknown claim 'nope'"),
    (["reproduce", "cgx", "--seeds", "1,x"], "--seeds"),
    (["reproduce", "cgx", "--seeds", "1,1"], "distinct seeds"),
    (["reproduce", "cgx", "--seeds", "0,99999999999999999999"], "at most 4294967295"),
    (["reproduce", "hbfp-lstm", "--max-steps", "0"], "--max-steps"),
    (["reproduce", "hbfp-bert", "--epochs", "x"], "--epochs"),
    (["reproduce", "hbfp-lstm", "--toy", "--max-steps", "5"], "choose one"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
  try:
    rc = main(argv)
  except SystemExit as e:
    rc = e.code
  assert rc == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_reduced_runs_are_marked_and_judged(tmp_path):
  """--epochs/--max-steps shrink every run of a claim (for a machine too slow for its size):
  the runs' configs say so, the setting's name and REPORT.md mark the runs reduced, and the
  rows get real verdicts (unlike --toy)."""
  import io

  from jaxlp.training import Claim, Row, Setting, reproduce

  mine = Claim("mine", "me", "E5M2 gradients match fp32.", (Setting(
      "MLP, 2 workers", {"model": "mlp", "nodes": 2, "width": 2, "epochs": 30},
      (Row("E5M2", {"grad_format": "E5M2"}),)),))
  s = reproduce(mine, seeds=(0,), out=str(tmp_path), plots=False, stream=io.StringIO(),
                epochs=1, max_steps=2)
  assert s["reduced"] == {"epochs": 1, "max_steps_per_epoch": 2} and not s["toy"]
  setting = s["settings"][0]
  assert setting["name"] == "MLP, 2 workers [reduced: 1 epoch of at most 2 steps]"
  assert setting["rows"][1]["verdict"] != "toy run: no verdict"
  cfg = json.loads((tmp_path / "mine" / "s0" / "E5M2" / "seed0" / "config.json").read_text())
  assert (cfg["epochs"], cfg["max_steps_per_epoch"], cfg["width"]) == (1, 2, 2)
  assert "Reduced runs" in (tmp_path / "mine" / "REPORT.md").read_text()
  with pytest.raises(ValueError, match="max_steps"):
    reproduce(mine, out=str(tmp_path), max_steps=0)


def test_list(capsys):
  assert main(["reproduce", "--list"]) == 0
  out = capsys.readouterr().out
  for name in CLAIMS:
    assert out.count(f"{name} ") >= 1


def test_verdicts(tmp_path):
  from jaxlp.training import Claim, Row, Setting, report_table

  claim = Claim("x", "s", "t", (Setting("n", {}, (Row("a", {}),)),), margin=1.0)
  assert claim.margin == 1.0
  rows = [{"label": "fp32", "final_test_accuracy": [0.9], "mean": 0.9, "delta_points": 0.0,
           "wire_mb": 1.0, "verdict": "baseline"}]
  table = report_table({"claim": "x", "settings": [{"name": "n", "rows": rows}]})
  assert "| x | n | fp32 | 0.9000 | 0.9000 (0.9000) | +0.0 | 1.0 | baseline |" in table
  assert not os.listdir(tmp_path)


def test_perplexity_verdicts_compare_each_seed_with_fp32():
  """A perplexity claim judges the mean over seeds of 100 * (ppl / fp32's ppl of that seed
  - 1) against its margin in percent (lower is better), and a NaN/inf run fails."""
  from jaxlp.training import CLAIMS, report_table
  from jaxlp.training._reproduce import _judge

  claim = CLAIMS["hbfp-lstm"]
  assert (claim.metric, claim.margin) == ("perplexity", 2.0)
  row = lambda label, ppls: {"label": label, "claim": label != "fp32", "wire_mb": 0.0,
                             "final_perplexity": ppls, "mean": sum(ppls) / len(ppls)}
  rows = [row("fp32", [8.0, 7.4, 8.2]), row("a", [8.1, 7.5, 8.3]),  # +1.3% per seed
          row("b", [8.6, 7.4, 8.2]), row("c", [8.0, float("nan"), 8.2])]
  _judge(rows, claim, toy=False)
  assert [r["verdict"] for r in rows] == ["baseline", "holds", "does not hold (+2.5%)",
                                          "does not hold (+nan%)"]
  assert rows[1]["delta_percent"] == pytest.approx(100 / 3 * (0.1 / 8 + 0.1 / 7.4 + 0.1 / 8.2))
  table = report_table({"claim": "hbfp-lstm", "metric": "perplexity",
                        "settings": [{"name": "n", "rows": rows}]})
  assert table.splitlines()[0].startswith("| claim | setting | row | fp32 ppl | jaxlp ppl")
  assert "| hbfp-lstm | n | a | 7.8667 | 7.9667 (8.1000, 7.5000, 8.3000) | +1.3 | 0.0 | holds |" \
      in table


def test_data_dir_runs_the_full_scale_settings(tmp_path, capsys):
  """``--data-dir`` switches the settings to CIFAR-10 (here a tiny fake folder, at toy size)."""
  from test_data import _write_cifar

  _write_cifar(str(tmp_path / "data"), n=20)
  out = tmp_path / "out"
  assert main(["reproduce", "cgx", "--toy", "--seeds", "0", "--no-plot", "--data-dir",
               str(tmp_path / "data"), "--out", str(out)]) == 0
  summary = json.loads((out / "cgx" / "summary.json").read_text())
  assert summary["data_dir"] == str(tmp_path / "data")
  setting = summary["settings"][0]
  assert setting["base"]["data"] == "cifar10" and "(full scale)" in setting["name"]
  config = json.loads((out / "cgx" / "s0" / "cgx4" / "seed0" / "config.json").read_text())
  assert config["data"] == "cifar10" and config["data_dir"] == str(tmp_path / "data")
  assert "full scale" in capsys.readouterr().out


def test_full_scale_settings_use_the_seeds_models(tmp_path):
  """CPD's claims run DavidNet (ResNet-9, its triangular schedule), HiPress's VGG-19, the
  others ResNet-18 / the MNIST CNN; every full-scale row is a valid configuration, also at toy
  size (which shrinks it to the MLP)."""
  from jaxlp.training import CLAIMS
  from jaxlp.training._loop import check_config
  from jaxlp.training._reproduce import _config

  models = {}
  for name, claim in CLAIMS.items():
    for setting in claim.settings:
      models.setdefault(name, set()).add(setting.full["model"])
      for row in setting.rows:
        for toy in (False, True):
          cfg = _config(setting.full, row.flags, 0, str(tmp_path / "r"),
                        data_dir=str(tmp_path / "d"), toy=toy, overwrite=False)
          check_config(cfg)
  assert models["cpd"] == models["aps"] == {"resnet9"}
  assert models["hipress"] == {"vgg19"}
  assert models["hbfp"] == models["cgx"] == {"resnet18"}
