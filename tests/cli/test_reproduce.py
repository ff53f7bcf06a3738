"""``jaxlp reproduce``: every claim runs end to end at toy size; bad input exits 2 with one line.

The verdicts themselves come from the full built-in runs recorded in README / RESULTS.md (minutes
per claim, not CI material)."""

import json
import os

import pytest

pytest.importorskip("optax", reason="jaxlp.training needs the examples extra")

from jaxlp.cli import main  # noqa: E402
from jaxlp.training import CLAIMS, reproduce  # noqa: E402

# At toy size every claim trains only some of its rows (--rows; every row traces and compiles a
# whole quantized training step and its evaluation, 3-10 CPU s each on the MLP, 15-30 s on the
# language models), chosen so that each flag its rows set trains at least once here; the rows
# left out set the same flags with other values (another format, bit width, ratio or mantissa
# width) through the same trainer path, which check_config accepts for every row at both sizes
# (test_full_scale_settings_use_the_seeds_models). Kept, per claim:
# - cpd: E3M0+APS+Kahan (grad_exp/grad_man, aps, kahan: the 4-bit claim) and fp32+LARS (lars,
#   lr); the E4M3/E5M2 rows are --grad-format names of the same chain-sum quantizer, trained
#   with APS by the aps case (at toy size both claims train the same 2-worker MLP);
# - aps: E4M3+APS (grad_format, aps: the claim row); E5M2 is the other format name;
# - hbfp: HBFP8 (hbfp, tile, weight_man); HBFP12 differs by the mantissa width alone, the
#   narrow-weights row by leaving weight_man out (--hbfp without it trains in tests/cli/
#   test_flags.py, test_hbfp_tile_defines_the_run, and tests/cli/test_exact_blocks.py);
# - cgx: cgx4; cgx2 is the same compressor at 2 bits (every CGX width and bucket through the
#   engine: tests/parallel/compress/test_compress_allreduce.py);
# - hipress: one claim row per setting, so each setting runs: TBQ, DGC 99% (momentum 0) and
#   onebit (the 60-epoch setting); onebit (SRA) trains in tests/cli/test_onebit_defaults.py,
#   TernGrad and GradDrop are other --compress names of the same trainer path, their
#   compressors checked through the engine in tests/parallel/compress (test_engine_families,
#   test_compress_allreduce);
# - nvfp4: its two claim rows (the recipe has all its pieces at once: 2-D weight tiles, SR, RHT,
#   BF16 ends; MXFP8 (rceil));
# - hbfp-lstm, hbfp-bert: HBFP8 (the claim's system). The other rows are --policy names through
#   the same trainer path (recipe_policy / the presets, then quantize_model): e4m3, e5m2 and
#   bf16 train a language model in tests/cli/test_text.py, MXFP8 (rceil) trains in the nvfp4
#   case; mxfp8 differs from it by its scale rule alone (tests/formats/test_mx_rules.py); bf16,
#   nvfp4 and mxfp4 map to their policies in tests/ops/test_recipes.py
#   (test_train_policy_names), whose plain-NVFP4 GEMMs (forward, dlhs, drhs) are checked bit for
#   bit there too;
# - ddp: both rows (its case also reuses finished runs and takes a subset of them).
TOY_ROWS = {
    "cpd": ("E3M0+APS+Kahan", "fp32+LARS"),
    "aps": ("E4M3+APS",),
    "hbfp": ("HBFP8",),
    "cgx": ("cgx4",),
    "hipress": ("TBQ", "DGC 99%", "onebit"),
    "nvfp4": ("NVFP4 recipe", "MXFP8 (rceil)"),
    "hbfp-lstm": ("HBFP8 + 16-bit weights",),
    "hbfp-bert": ("HBFP8 + 16-bit weights",),
}


# The toy runs compile with XLA's optimizations off (tests/conftest.py, ``fast_compile``): much
# of their time is XLA's compiles of each row's step and evaluation (BERT's HBFP8 row, under
# cProfile: 70 of its 103 s), and with the flag the cases took 78 -> 56 CPU s (hbfp-bert),
# 34 -> 26 (hbfp-lstm), 40 -> 31 (nvfp4) on the 2-core VM, 2026-11-30. They check that each
# claim runs end to end and reports in range, never bits against a program compiled normally
# (the ddp case's second report reuses the finished runs: nothing is recomputed).
@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_every_claim_runs_at_toy_size(name, tmp_path, capsys):
  args = ["reproduce", name, "--toy", "--seeds", "0", "--out", str(tmp_path)]
  if name != "ddp":
    args.append("--no-plot")  # one claim draws the plots
  rows = TOY_ROWS.get(name)
  if rows:
    args += ["--rows", ",".join(rows)]
  assert main(args) == 0
  out = capsys.readouterr().out
  assert f"jaxlp reproduce {name}" in out and "| claim | setting | row |" in out
  summary = json.loads((tmp_path / name / "summary.json").read_text())
  assert summary["seeds"] == [0] and summary["toy"]
  assert summary["rows"] == (list(rows) if rows else None)
  report = (tmp_path / name / "REPORT.md").read_text()
  assert ("The table is a subset" in report) == ("table is a subset" in out) == bool(rows)
  for setting, spec in zip(summary["settings"], CLAIMS[name].settings, strict=True):
    labels = [r["label"] for r in setting["rows"]]
    assert labels == ["fp32"] + [r.label for r in spec.rows if not rows or r.label in rows]
    assert {r["verdict"] for r in setting["rows"][1:]} == {"toy run: no verdict"}
    if CLAIMS[name].metric == "perplexity":  # language models: test perplexity
      assert all(1.0 < r["mean"] < 1e4 for r in setting["rows"])
      assert all(len(r["final_perplexity"]) == 1 for r in setting["rows"])
    else:
      assert all(0.0 <= r["mean"] <= 1.0 for r in setting["rows"])
    if spec.gap is not None:  # nvfp4: its gap's rows (bf16, NVFP4) are not run here
      assert "gap" not in setting and "final training loss" not in report
      assert "no loss-gap table: --rows leaves out bf16 and NVFP4" in out
  if name == "ddp":
    assert (tmp_path / name / "s0" / "accuracy_vs_epoch.png").exists()
    # finished runs are reused: the same report again, nothing retrained
    assert main(args) == 0
    again = json.loads((tmp_path / name / "summary.json").read_text())
    assert again["settings"][0]["rows"] == summary["settings"][0]["rows"]
    # --rows on finished runs: a subset of the same rows (reused), marked as such
    assert main(args + ["--rows", "PowerSGD r2", "--no-plot"]) == 0
    part = json.loads((tmp_path / name / "summary.json").read_text())
    assert part["rows"] == ["PowerSGD r2"]
    assert part["settings"][0]["rows"] == [summary["settings"][0]["rows"][i] for i in (0, 2)]
    assert "The table is a subset: only the rows 'PowerSGD r2' (--rows)" in \
        (tmp_path / name / "REPORT.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["reproduce"], "give a claim"),
    (["reproduce", "nope"], "unknown claim 'nope'"),
    (["reproduce", "cgx", "--seeds", "1,x"], "--seeds"),
    (["reproduce", "cgx", "--seeds", "1,1"], "distinct seeds"),
    (["reproduce", "cgx", "--seeds", "0,99999999999999999999"], "at most 4294967295"),
    (["reproduce", "hbfp-lstm", "--max-steps", "0"], "--max-steps"),
    (["reproduce", "hbfp-bert", "--epochs", "x"], "--epochs"),
    (["reproduce", "hbfp-lstm", "--toy", "--max-steps", "5"], "choose one"),
    # a comma followed by a space is part of a label: only 'nope' is unknown
    (["reproduce", "hipress", "--rows", "onebit, 30 epochs,TBQ,nope"],
     "no row is labelled 'nope'; the rows are 'fp32', 'onebit, 30 epochs',"),
    (["reproduce", "cgx", "--rows", "cgx4,"], "--rows"),
    (["reproduce", "all", "--rows", "cgx4"], "not all"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
  try:
    rc = main(argv)
  except SystemExit as e:
    rc = e.code
  assert rc == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.usefixtures("fast_compile")  # as the toy runs above
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


@pytest.mark.usefixtures("fast_compile")  # as the toy runs above
def test_rows_trains_only_the_named_rows(tmp_path):
  """``rows`` (``--rows``): each setting's fp32 and the named rows train, a setting with none
  of them is skipped (its run folders never made), the loss-gap table and the plots of a
  setting keep its place in the claim, and the summary, the header and REPORT.md say the
  table is a subset."""
  import io

  from jaxlp.training import Claim, Row, Setting

  mlp = {"model": "mlp", "nodes": 2}
  mine = Claim("mine", "me", "E5M2 gradients match fp32.", (
      Setting("first", mlp, (Row("fp16", {"compress": "cast:fmt=fp16"}),)),
      Setting("second", mlp, (Row("E4M3", {"grad_format": "E4M3"}, claim=False),
                              Row("E5M2", {"grad_format": "E5M2"})), gap=("fp32", "E5M2"))))
  stream = io.StringIO()
  s = reproduce(mine, seeds=(0,), toy=True, out=str(tmp_path), stream=stream, rows=["E5M2"])
  assert s["rows"] == ["E5M2"]
  (setting,) = s["settings"]
  assert setting["index"] == 1 and [r["label"] for r in setting["rows"]] == ["fp32", "E5M2"]
  assert setting["gap"] == ["fp32", "E5M2"] and all("gap_closed" in r for r in setting["rows"])
  listing = lambda d: sorted(f for f in os.listdir(tmp_path / "mine" / d) if f[0] != ".")
  assert listing("") == ["REPORT.md", "s1", "summary.json"]  # no s0: the first is skipped
  assert listing("s1") == [
      "E5M2", "accuracy_vs_epoch.png", "accuracy_vs_wire_bytes.png", "fp32", "gap_closed.png",
      "loss_vs_epoch.png"]
  text = stream.getvalue()
  assert "setting 1: first: skipped (none of its rows selected)" in text
  assert "the table is a subset: only the rows 'E5M2' (--rows) and each setting's fp32" in text
  report = (tmp_path / "mine" / "REPORT.md").read_text()
  assert "The table is a subset" in report and "Setting 2, final training loss" in report
  with pytest.raises(ValueError, match=r"no row is labelled 'E3M0', 'e5m2'; the rows are "
                                       r"'fp32', 'fp16', 'E4M3', 'E5M2'$"):
    reproduce(mine, out=str(tmp_path), rows=["E5M2", "E3M0", "e5m2"])
  with pytest.raises(ValueError, match="names no row"):
    reproduce(mine, out=str(tmp_path), rows=[])


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


@pytest.mark.usefixtures("fast_compile")  # as the toy runs above
def test_data_dir_runs_the_full_scale_settings(tmp_path, capsys):
  """``--data-dir`` switches the settings to CIFAR-10 (here a tiny fake folder, at toy size;
  fp32 and one row: the data path is the same for every row)."""
  from test_data import _write_cifar

  _write_cifar(str(tmp_path / "data"), n=20)
  out = tmp_path / "out"
  assert main(["reproduce", "cgx", "--toy", "--seeds", "0", "--no-plot", "--data-dir",
               str(tmp_path / "data"), "--rows", "cgx4", "--out", str(out)]) == 0
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
      if not setting.full:  # built-in data only (nvfp4): --data-dir is refused
        with pytest.raises(ValueError, match="no full-scale setting"):
          reproduce(name, seeds=(0,), out=str(tmp_path / "o"), data_dir=str(tmp_path / "d"))
        continue
      models.setdefault(name, set()).add(setting.full["model"])
      for row in setting.rows:
        for toy in (False, True):
          cfg = _config(setting.full, row.flags, 0, str(tmp_path / "r"),
                        data_dir=str(tmp_path / "d"), toy=toy, overwrite=False)
          check_config(cfg)
  assert models["cpd"] == models["aps"] == {"resnet9"}
  assert models["hipress"] == {"vgg19"}
  assert models["hbfp"] == models["cgx"] == {"resnet18"}
