"""``jaxlp reproduce``: each replaced system's headline accuracy (or perplexity) claim, one
command each.

A :class:`Claim` names the system, quotes its claim (with the source), and lists one or more
:class:`Setting` groups: a base configuration (model, workers, epochs, ...), its fp32
baseline, and the rows that carry the claim (and rows shown only for context, such as the
same format without APS). :func:`reproduce` trains every row for every seed (0, 1, 2 by
default) with :func:`jaxlp.training.train`, then reports, per row, the final test accuracy of
each seed, their mean, the mean difference to the fp32 baseline of the same setting, the wire
bytes, and a verdict: the claim *holds* for a row when its mean final accuracy is at most
``margin`` points below the fp32 mean (being better is fine); otherwise it *does not hold*,
with the difference. A claim that does not hold at this scale is a finding, reported as such.

Language-model claims (``metric="perplexity"``: ``hbfp-lstm``, ``hbfp-bert``) report the
final test perplexity (BERT: of the masked tokens) instead, and a row holds when it is on
average at most ``margin`` percent above fp32's, compared seed by seed (lower is better):
the difference is the mean over seeds of ``100 * (ppl_row / ppl_fp32 - 1)``, since the runs
of one seed share their initial weights, dropout masks and batch order; fp32's own
seed-to-seed spread at this small scale (about 5% for the LSTM) would hide a 2% effect in a
difference of means. They train on the
built-in text (the standard library's ``pydoc_data`` topics, byte level; see
:mod:`jaxlp.training._text`).

The built-in settings use the scikit-learn digits (1437 train / 360 test images) and finish in
minutes on a 2-core CPU. ``data_dir`` switches every setting to its full-scale version
(CIFAR-10 or MNIST from that folder, with the seeds' own models), which needs a GPU.

References:
  Han, Demmel, You, "Auto-Precision Scaling for Distributed Deep Learning", arXiv:1911.08907;
  Drumond, Lin, Jaggi, Falsafi, "Training DNNs with Hybrid Block Floating Point", NeurIPS 2018;
  Markov, Ramezanikebrya, Alistarh, "CGX: Adaptive System Support for Communication-Efficient
  Deep Learning", Middleware 2022; Bai et al., "Gradient Compression Supercharged
  High-Performance Data Parallel DNN Training", SOSP 2021; Vogels, Karimireddy, Jaggi,
  "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
  NeurIPS 2019; Lin et al., "Deep Gradient Compression", ICLR 2018.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

from jaxlp.training._gap import add_gap, final_loss, gap_table, plot_gap
from jaxlp.training._loop import TrainConfig, train
from jaxlp.training._runs import RunLock, continue_or_replace


@dataclasses.dataclass(frozen=True)
class Row:
  """One configuration of a :class:`Setting`.

  Attributes:
    label: the row's name in the report.
    flags: :class:`~jaxlp.training.TrainConfig` fields set on top of the setting's base.
    claim: True when the row carries the claim (it gets a verdict); False for context rows.

  Example:
    >>> from jaxlp.training import Row
    >>> Row("cgx4", {"compress": "cgx:bits=4"}).claim
    True
  """

  label: str
  flags: dict
  claim: bool = True


@dataclasses.dataclass(frozen=True)
class Setting:
  """A base configuration, its fp32 baseline and the rows compared with it.

  Attributes:
    name: what the setting is (printed above its rows).
    base: :class:`~jaxlp.training.TrainConfig` fields shared by every row (built-in data).
    rows: the compared rows (the fp32 baseline is added first, as row ``fp32``).
    full: fields that replace ``base`` for the full-scale version (``data_dir`` given).
    gap: ``(reference, start)`` row labels: the report adds a table of every row's final
      training loss and the part of the loss gap from ``start`` to ``reference`` it closes
      (``jaxlp/training/_gap.py``), and its plots; None: no such table.

  Example:
    >>> from jaxlp.training import CLAIMS
    >>> CLAIMS["cgx"].settings[0].base["model"]
    'cnn'
    >>> CLAIMS["nvfp4"].settings[0].gap
    ('bf16', 'NVFP4')
  """

  name: str
  base: dict
  rows: tuple
  full: dict = dataclasses.field(default_factory=dict)
  gap: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Claim:
  """A replaced system's headline accuracy claim and the settings that test it.

  Attributes:
    name: the name given to ``jaxlp reproduce``.
    system: the system (and paper) the claim comes from.
    statement: the claim, as its source states it.
    settings: the :class:`Setting` groups.
    margin: accuracy points a claim row may lose against fp32 and still hold
      (``metric="accuracy"``), or percent by which its test perplexity may exceed fp32's,
      on average over the seeds, seed by seed (``metric="perplexity"``).
    metric: ``"accuracy"`` (final test accuracy; classifiers) or ``"perplexity"`` (final
      test perplexity; language models).

  Example:
    >>> from jaxlp.training import CLAIMS
    >>> CLAIMS["hbfp"].margin, CLAIMS["hbfp-lstm"].metric, CLAIMS["hbfp-lstm"].margin
    (1.0, 'perplexity', 2.0)
  """

  name: str
  system: str
  statement: str
  settings: tuple
  margin: float = 1.0
  metric: str = "accuracy"


# Built-in settings: digits, 8 workers, batch 128 (16 per worker), SGD with momentum 0.9.
_MLP = {"model": "mlp", "nodes": 8, "epochs": 30}
_CNN = {"model": "cnn", "nodes": 8, "epochs": 30}
_CIFAR = {"data": "cifar10", "model": "resnet18", "nodes": 8, "epochs": 30, "batch_size": 512,
          "lr": 0.1, "weight_decay": 5e-4}
# the seeds' own full-scale models: CPD's DavidNet (ResNet-9, triangular LR peaking at 0.4 in
# epoch 5, 24 epochs; examples/cpd_davidnet.py) and HiPress's VGG-19 (on CIFAR-10)
_DAVIDNET = {"data": "cifar10", "model": "resnet9", "nodes": 8, "epochs": 24, "batch_size": 512,
             "lr": 0.4, "schedule": "triangle", "warmup_epochs": 5, "weight_decay": 5e-4}
_VGG19 = dict(_CIFAR, model="vgg19")
# The language models on the built-in text (bytes; 419,575 training bytes on Python 3.11.7),
# sized to train in minutes per run on the 2-core CPU: windows of 64 bytes, 32 rows, Adam 2e-3,
# 3 epochs of 204 steps, one worker (HBFPEmulator's LSTM and Megatron-LM's BERT
# runs are single-node); the LSTM 2 layers of 128, BERT 2 blocks of width 64 (4 heads). Full
# scale (--data-dir: Penn Treebank / WikiText-2 words; not run here): AWD-LSTM's 3 layers,
# BPTT 70, batch 20 (its hidden layers of 1150 are 400 here, the embedding size), and a
# 4-layer BERT of width 256 on windows of 128.
_LSTM = {"model": "lstm", "nodes": 1, "epochs": 3, "width": 16, "layers": 2, "seq_len": 64,
         "batch_size": 32}
_BERT = {"model": "bert", "nodes": 1, "epochs": 3, "width": 8, "layers": 2, "seq_len": 64,
         "batch_size": 32}
_LSTM_FULL = {"model": "lstm", "nodes": 1, "epochs": 50, "width": 50, "layers": 3,
              "seq_len": 70, "batch_size": 20, "dropout": 0.4}
_BERT_FULL = {"model": "bert", "nodes": 8, "epochs": 20, "width": 32, "layers": 4,
              "seq_len": 128, "batch_size": 64}
# HBFPEmulator's LSTM scripts (lstm/scripts/run_bfp8.sh): --mant_bits 8 --bfp_tile_size 24
# --weight_mant_bits 16; the other 8-bit formats of jaxlp for comparison
# The NVFP4 recipe (arXiv:2509.25149) piece by piece, on the CNN with one worker (the recipe
# is about the GEMMs, not the reduction): NVFP4 with no piece of the recipe, each piece alone
# on top of it, the whole recipe; MXFP4, and MXFP8 with OCP's floor scales vs rounded-up ones
_NVFP4_CNN = {"model": "cnn", "nodes": 1, "epochs": 30}
_NVFP4_ROWS = (
    Row("bf16", {"policy": "bf16"}, claim=False),
    Row("NVFP4", {"policy": "nvfp4"}, claim=False),
    Row("+ 2-D weight tiles", {"policy": "nvfp4+tiles"}, claim=False),
    Row("+ SR of gradients", {"policy": "nvfp4+sr"}, claim=False),
    Row("+ RHT on Wgrad", {"policy": "nvfp4+rht"}, claim=False),
    Row("+ BF16 first/last", {"policy": "nvfp4+ends"}, claim=False),
    Row("NVFP4 recipe", {"policy": "nvfp4-recipe"}),
    Row("MXFP4", {"policy": "mxfp4"}, claim=False),
    Row("MXFP8 (floor)", {"policy": "mxfp8"}, claim=False),
    Row("MXFP8 (rceil)", {"policy": "mxfp8-rceil"}),
)

_LM_ROWS = (
    Row("HBFP8 + 16-bit weights", {"hbfp": 8, "tile": 24, "weight_man": 16}),
    Row("MXFP8", {"policy": "mxfp8"}),
    Row("MXFP8 (rceil)", {"policy": "mxfp8-rceil"}),
    Row("E4M3", {"policy": "e4m3"}),
    Row("E5M2", {"policy": "e5m2"}),
)

CLAIMS: dict[str, Claim] = {c.name: c for c in (
    Claim(
        "cpd", "CPD (Han, Demmel, You: Auto-Precision Scaling, arXiv:1911.08907)",
        "With APS, 8-bit gradient all-reduces train with no or only a tiny accuracy loss, and "
        "large-batch training converges with only 4 bits (E3M0); the artifact adds Kahan "
        "summation and LARS to the 4-bit runs.",
        (Setting("CNN, 8 workers, chain sum in the gradient format", _CNN, (
            Row("E4M3", {"grad_format": "E4M3"}, claim=False),
            Row("E4M3+APS", {"grad_format": "E4M3", "aps": True}),
            Row("E5M2+APS", {"grad_format": "E5M2", "aps": True}),
            Row("E3M0", {"grad_exp": 3, "grad_man": 0}, claim=False),
            Row("E3M0+APS", {"grad_exp": 3, "grad_man": 0, "aps": True}),
            Row("E3M0+APS+Kahan", {"grad_exp": 3, "grad_man": 0, "aps": True, "kahan": True}),
            Row("fp32+LARS", {"lars": True, "lr": 2.0}, claim=False),
            Row("E3M0+APS+LARS", {"grad_exp": 3, "grad_man": 0, "aps": True, "lars": True,
                                  "lr": 2.0}),
        ), full=_DAVIDNET),)),
    Claim(
        "aps", "CPD (APS: the 8-bit gain)",
        "APS improves accuracy for all precisions: 8-bit gradients that underflow without it "
        "train like fp32 with it.",
        (Setting("MLP, 256 workers of one sample each (gradients pre-scaled by 1/256: E4M3's "
                 "smallest subnormal, 2^-9, flushes many of them)",
                 dict(_MLP, nodes=256, batch_size=256), (
                     Row("E4M3", {"grad_format": "E4M3"}, claim=False),
                     Row("E4M3+APS", {"grad_format": "E4M3", "aps": True}),
                     Row("E5M2", {"grad_format": "E5M2"}, claim=False),
                     Row("E5M2+APS", {"grad_format": "E5M2", "aps": True}),
                 ), full=dict(_DAVIDNET, nodes=256)),)),
    Claim(
        "hbfp", "HBFPEmulator (Drumond et al.: Hybrid Block Floating Point, NeurIPS 2018)",
        "DNNs trained with HBFP (all dot products in block floating point with tiles, other "
        "operations in fp32) with 12- and 8-bit mantissas match fp32 accuracy.",
        (Setting("CNN, 8 workers, every GEMM in HBFP with 24x24 tiles; HBFPEmulator's CNN "
                 "scripts: HBFP8 = 7 mantissa bits + sign, HBFP12 = 11, wide weights 15",
                 _CNN, (
                     Row("HBFP8", {"hbfp": 7, "tile": 24, "weight_man": 15}),
                     Row("HBFP12", {"hbfp": 11, "tile": 24, "weight_man": 15}),
                     Row("HBFP8, narrow weights", {"hbfp": 7, "tile": 24}, claim=False),
                 ), full=_CIFAR),)),
    Claim(
        "cgx", "CGX (Markov et al., Middleware 2022; torch_cgx README usage)",
        "4-bit bucketed quantization of the gradients (bucket 1024, layers below 1024 elements "
        "in fp32) recovers full accuracy.",
        (Setting("CNN, 8 workers, CGX scatter-reduce-allgather", _CNN, (
            Row("cgx4", {"compress": "cgx:bits=4,bucket=1024"}),
            Row("cgx2", {"compress": "cgx:bits=2,bucket=128"}, claim=False),
        ), full=_CIFAR),)),
    Claim(
        "hipress", "HiPress (Bai et al., SOSP 2021) compressors",
        "onebit, TBQ, TernGrad, DGC and GradDrop, with their error feedback or corrections, "
        "train to the accuracy of uncompressed training.",
        (Setting("CNN, 8 workers, all-gather of the compressed gradients", _CNN, (
            Row("onebit, 30 epochs", {"compress": "onebit:algorithm=allgather"}, claim=False),
            Row("onebit (SRA), 30 epochs", {"compress": "onebit"}, claim=False),
            Row("TBQ", {"compress": "tbq:threshold=0.002,algorithm=allgather"}),
            Row("TernGrad", {"compress": "terngrad:algorithm=allgather"}),
            Row("GradDrop 99%", {"compress": "graddrop"}),
            Row("GradDrop 90%", {"compress": "graddrop:drop_ratio=0.9"}, claim=False),
        ), full=_VGG19),
         Setting("MLP, 8 workers, DGC (momentum correction replaces SGD's momentum)", _MLP, (
             Row("DGC 99.9%", {"compress": "dgc:ratio=0.001", "momentum": 0.0}),
             Row("DGC 99%", {"compress": "dgc:ratio=0.01", "momentum": 0.0}),
         ), full=_VGG19),
         Setting("CNN, 8 workers, 60 epochs (1-bit SGD needs more steps than fp32 to converge)",
                 dict(_CNN, epochs=60), (
                     Row("onebit", {"compress": "onebit:algorithm=allgather"}),
                 ), full=_VGG19))),
    Claim(
        "ddp", "PyTorch DDP communication hooks (the DDP MNIST seed; Vogels et al., PowerSGD)",
        "fp16 compression and PowerSGD rank 2 train to the accuracy of plain SGD.",
        (Setting("MLP, 8 workers", _MLP, (
            Row("fp16", {"compress": "cast:fmt=fp16"}),
            Row("PowerSGD r2", {"compress": "powersgd:rank=2"}),
        ), full={"data": "mnist", "model": "cnn", "nodes": 8, "epochs": 10}),)),
    Claim(
        "hbfp-lstm", "HBFPEmulator (Drumond et al., NeurIPS 2018): its LSTM language model "
        "(lstm/, adapted from AWD-LSTM; Penn Treebank)",
        "An LSTM language model trained with HBFP8 (every dot product in block floating point "
        "with 24x24 tiles and 8-bit mantissas, 16-bit wide weight storage, other operations "
        "in fp32) reaches the perplexity of fp32 training. MXFP8 (OCP's floor scales, and the "
        "rounded-up 'rceil' scales of NVIDIA's MXFP8 recipe), E4M3 (E5M2 gradients) and "
        "E5M2 on every matmul are judged by the same margin.",
        (Setting("LSTM LM, 2 layers of 128, byte level, windows of 64, every matmul (gates, "
                 "tied decoder) quantized", _LSTM, _LM_ROWS, full=_LSTM_FULL),),
        margin=2.0, metric="perplexity"),
    Claim(
        "hbfp-bert", "HBFPEmulator (Drumond et al., NeurIPS 2018): BERT through its "
        "Megatron-LM fork (Megatron-LM_HBFP)",
        "A BERT masked language model trained with HBFP8 (24x24 tiles, 8-bit mantissas, "
        "16-bit wide weights, as the LSTM scripts) reaches the masked-LM loss of fp32 "
        "training. MXFP8 (floor and rceil scales), E4M3 (E5M2 gradients) and E5M2 on every "
        "matmul are judged by the same margin.",
        (Setting("BERT MLM, 2 layers of 64, 4 heads, byte level, windows of 64, 80/10/10 "
                 "masking of 15%, every matmul (projections, attention q.k and p.v, MLP, tied "
                 "MLM logits) quantized", _BERT, _LM_ROWS, full=_BERT_FULL),),
        margin=2.0, metric="perplexity"),
    Claim(
        "nvfp4", "NVIDIA's NVFP4 pretraining recipe (arXiv:2509.25149); the MXFP8 recipe "
        "(Mishra et al., arXiv:2506.08027)",
        "Trained with NVFP4 on the GEMMs of its linear layers and the recipe (16x16 2-D "
        "weight scaling, stochastic rounding of gradients, 16x16 random Hadamard transforms "
        "on the weight-gradient inputs, a few layers kept in BF16), a 12B model reaches "
        "training loss and downstream accuracy comparable to FP8 training over 10T tokens; "
        "the paper's ablations show a higher loss without each piece. MXFP8 (E4M3 on every "
        "tensor) with scales rounded up (RCEIL) matches BF16.",
        (Setting("CNN, 1 worker, batch 128, every GEMM (forward, dlhs, weight gradient) of "
                 "every conv/dense layer quantized; '+' rows add one piece of the recipe to "
                 "plain NVFP4", _NVFP4_CNN, _NVFP4_ROWS, gap=("bf16", "NVFP4")),)),
)}



METRICS = ("accuracy", "perplexity")


def _run_dir(out, claim, setting_index, label, seed):
  safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
  return os.path.join(out, claim, f"s{setting_index}", safe, f"seed{seed}")


def _config(base: dict, flags: dict, seed: int, out: str, *, data_dir, toy: bool,
            overwrite: bool, epochs: int | None = None,
            max_steps: int | None = None) -> TrainConfig:
  from jaxlp.training._models import LM_MODELS

  fields = dict(base) | dict(flags) | {"seed": seed, "out": out, "quiet": True}
  if data_dir is not None:
    fields["data_dir"] = data_dir
  if epochs is not None:  # a reduced run: fewer epochs (a warm-up no longer than the run)
    fields |= {"epochs": epochs, "warmup_epochs": min(fields.get("warmup_epochs", 0), epochs)}
  if max_steps is not None:
    fields["max_steps_per_epoch"] = max_steps
  if toy and fields.get("model") in LM_MODELS:  # the same language model, smallest
    fields |= {"width": 1, "layers": 1, "seq_len": 8, "epochs": 1, "max_steps_per_epoch": 2,
               "nodes": 2, "batch_size": 4}
  elif toy:  # the whole pipeline, smallest: a narrow MLP, 2 workers, one epoch of two steps
    fields |= {"model": "mlp", "width": 2, "epochs": 1, "max_steps_per_epoch": 2, "nodes": 2,
               "batch_size": 16, "warmup_epochs": min(fields.get("warmup_epochs", 0), 1)}
  return continue_or_replace(TrainConfig(**fields), overwrite)


def _stats(xs):
  m = sum(xs) / len(xs)
  sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
  return m, sd


def reproduce(name, *, seeds=(0, 1, 2), out: str = "runs/reproduce",
              data_dir: str | None = None, toy: bool = False, overwrite: bool = False,
              plots: bool = True, stream=None, epochs: int | None = None,
              max_steps: int | None = None, rows=None) -> dict[str, Any]:
  """Train every row of claim ``name`` for every seed and judge the claim.

  Finished runs in ``out`` are reused (resumed: a run with the same configuration continues to
  its epochs, which for a finished run trains nothing, and an interrupted one continues where
  it stopped); a run folder with another configuration is refused unless ``overwrite``. The
  folder ``out/name`` is locked for the whole call (one reproduce of a claim at a time) and
  every run folder by its run (:func:`jaxlp.training.train`).

  Args:
    name: a key of :data:`CLAIMS` (``cpd``, ``aps``, ``hbfp``, ``cgx``, ``hipress``, ``ddp``,
      ``hbfp-lstm``, ``hbfp-bert``, ``nvfp4``), or a :class:`Claim` of your own.
    seeds: the seeds each row is trained with.
    out: the folder for the run folders, ``summary.json``, ``REPORT.md`` and the plots (in
      ``out/name``).
    data_dir: CIFAR-10/MNIST folder (Penn Treebank / WikiText-2 text files for the language
      models): run the full-scale settings instead of the built-in ones.
    toy: a narrow MLP (the language-model claims: their model at width 1, one layer, windows
      of 8), 2 workers, one epoch of two steps per run (a smoke test of the whole pipeline; no
      verdicts).
    overwrite: replace run folders whose configuration differs (runs of the same
      configuration are still reused).
    plots: write ``accuracy_vs_epoch.png`` / ``accuracy_vs_wire_bytes.png`` (language
      models: ``perplexity_vs_...``) per setting (seed 0 of every row; needs matplotlib).
    stream: where the progress and the report go (default ``sys.stdout``).
    epochs, max_steps: a reduced run, for a machine too slow for the settings' size: every
      run trains ``epochs`` epochs (None: the setting's) of at most ``max_steps`` steps
      (None: all). The verdicts are those of the reduced runs; the setting's name in the
      report says so, and the summary records both under ``reduced``.
    rows: row labels (``Row.label``, matched exactly; ``fp32`` names the baselines):
      train the fp32 baseline and only these rows of each setting (None: every row), for
      example one row again after a change without retraining the others (finished runs are
      reused: remove the row's run folders first, or give ``overwrite`` if its flags
      changed). A setting with none of the named rows is skipped, its baseline too, unless
      ``fp32`` is named. A setting's loss-gap table (``Setting.gap``) needs both its rows
      named and is left out otherwise (finished runs of them are reused, so naming them costs
      little). The summary records the selection under ``rows``; the printed header and
      ``REPORT.md`` say the table is a subset (the same call without ``rows`` writes the
      whole table, training only the rows not yet run).

  Returns:
    The summary (also written to ``out/name/summary.json``): the claim, its statement,
    ``metric`` and margin, the row selection ``rows`` (None: all), and per setting that ran
    (``index``: its place in the claim, from 0) the rows with ``label``, ``flags``, ``claim``,
    ``seeds``, ``final_test_accuracy`` (one per seed), ``mean``, ``sd``, ``delta_points``
    (mean minus the fp32 mean, in points), ``wire_mb`` (mean over seeds of the run's wire
    bytes) and ``verdict``. Perplexity claims have ``final_perplexity`` and
    ``delta_percent`` (the mean over seeds of 100 * (ppl / fp32's ppl of the seed - 1))
    instead. Every row also has ``final_train_loss`` (the mean training loss of the last 5
    epochs, one per seed); in a setting with a ``gap``, also ``final_loss_mean``,
    ``final_loss_sd``, ``delta_loss``, ``delta_loss_se`` and ``gap_closed``
    (``jaxlp/training/_gap.py``).

  Raises:
    ValueError: an unknown ``name``; no seeds; ``epochs`` or ``max_steps`` below 1 or with
      ``toy``; ``rows`` empty or with a label that is no row of the claim (the message lists
      the labels); ``out/name`` in use by another reproduce; or
      an error of :func:`jaxlp.training.train` (a run folder with another configuration,
      without ``overwrite``; a damaged checkpoint).
    KeyboardInterrupt: Ctrl-C (``jaxlp.training._runs.Interrupted`` naming the run folder);
      the same call again continues.

  Example:
    A claim of your own, at toy size (the built-in ones run the same way by name):

    >>> import io, tempfile
    >>> from jaxlp.training import Claim, Row, Setting, reproduce
    >>> mine = Claim("e5m2", "me", "E5M2 gradients match fp32.", (Setting(
    ...     "MLP, 2 workers", {"model": "mlp", "nodes": 2},
    ...     (Row("E5M2", {"grad_format": "E5M2"}),)),))
    >>> s = reproduce(mine, seeds=(0,), toy=True, plots=False, out=tempfile.mkdtemp(),
    ...               stream=io.StringIO())
    >>> [(r["label"], r["verdict"]) for r in s["settings"][0]["rows"]]
    [('fp32', 'baseline'), ('E5M2', 'toy run: no verdict')]

    Only some rows (``jaxlp reproduce NAME --rows LABEL,...``); a label of no row is refused:

    >>> reproduce(mine, rows=["E4M3"], out=tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    ValueError: jaxlp reproduce e5m2: rows (--rows): no row is labelled 'E4M3';
    the rows are 'fp32', 'E5M2'
  """
  if isinstance(name, Claim):
    claim = name
  elif name in CLAIMS:
    claim = CLAIMS[name]
  else:
    raise ValueError(f"jaxlp reproduce: unknown claim {name!r}; choose from {sorted(CLAIMS)}")
  name = claim.name
  seeds = tuple(seeds)
  if not seeds:
    raise ValueError("jaxlp reproduce: give at least one seed")
  stream = stream or sys.stdout
  for arg, v in (("epochs", epochs), ("max_steps", max_steps)):
    if v is None:
      continue
    flag = f"{arg} (--{arg.replace('_', '-')})"
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"jaxlp reproduce: {flag} must be an int >= 1, got {v!r}")
    if toy:
      raise ValueError(f"jaxlp reproduce: {flag} and toy (--toy) both set the size of the "
                       "runs; choose one")
  if data_dir is not None and not all(s.full for s in claim.settings):
    raise ValueError(f"jaxlp reproduce {name}: this claim has no full-scale setting (it runs on "
                     "built-in data only); leave out data_dir (--data-dir)")
  if claim.metric not in METRICS:
    raise ValueError(f"jaxlp reproduce: Claim.metric must be one of {METRICS}, got "
                     f"{claim.metric!r}")
  rows = _selected_rows(claim, rows)
  margin_key = "margin_points" if claim.metric == "accuracy" else "margin_percent"
  summary: dict[str, Any] = {"claim": name, "system": claim.system,
                             "statement": claim.statement, "metric": claim.metric,
                             margin_key: claim.margin,
                             "seeds": list(seeds), "toy": toy, "data_dir": data_dir,
                             "reduced": ({"epochs": epochs, "max_steps_per_epoch": max_steps}
                                         if epochs or max_steps else None),
                             "rows": None if rows is None else list(rows), "settings": []}
  with RunLock(os.path.join(out, name)):  # one reproduce of a claim per output folder
    return _reproduce(claim, seeds, out, data_dir, toy, overwrite, plots, stream, summary)


def _selected_rows(claim: Claim, rows) -> tuple | None:
  """``rows`` checked against the claim's row labels (one label: a str), without repeats;
  None for every row."""
  if rows is None:
    return None
  rows = tuple(dict.fromkeys((rows,) if isinstance(rows, str) else rows))
  if not rows:
    raise ValueError("jaxlp reproduce: rows (--rows) names no row; give at least one label, "
                     "or leave it out for every row")
  labels = ["fp32"] + list(dict.fromkeys(r.label for s in claim.settings for r in s.rows))
  bad = [r for r in rows if r not in labels]
  if bad:
    raise ValueError(f"jaxlp reproduce {claim.name}: rows (--rows): no row is labelled "
                     f"{', '.join(map(repr, bad))}; the rows are {', '.join(map(repr, labels))}")
  return rows


def _reduced_label(reduced, base) -> str:
  """`` [reduced: E epochs of at most N steps]`` (empty for a full-size run)."""
  if not reduced:
    return ""
  e = reduced["epochs"] or base.get("epochs", 10)
  n = reduced["max_steps_per_epoch"]
  return f" [reduced: {e} epoch{'s' if e != 1 else ''}" + \
      (f" of at most {n} steps]" if n else "]")


def _reproduce(claim, seeds, out, data_dir, toy, overwrite, plots, stream, summary):
  name = claim.name
  reduced = summary["reduced"] or {}
  selected = summary["rows"]
  stream.write(f"jaxlp reproduce {name}: {claim.system}\n  claim: {claim.statement}\n")
  subset = _subset_note(selected)
  if subset:
    stream.write(f"  {subset}\n")
  for si, setting in enumerate(claim.settings):
    base = dict(setting.full) if data_dir is not None else dict(setting.base)
    rows = (Row("fp32", {}, claim=False),) + tuple(setting.rows)
    if selected is not None:
      rows = rows[:1] + tuple(r for r in rows[1:] if r.label in selected)
      if len(rows) == 1 and "fp32" not in selected:
        stream.write(f"\n  setting {si + 1}: {setting.name}: skipped (none of its rows "
                     "selected)\n")
        continue
    from jaxlp.training._models import LM_MODELS

    toy_what = ("the same model at width 1, 1 layer, windows of 8" if base.get("model") in
                LM_MODELS else "MLP of width 2")
    label = setting.name + (" (full scale)" if data_dir is not None else "") + \
        (f" [toy size: {toy_what}, 2 workers, 2 steps]" if toy else "") + \
        _reduced_label(summary["reduced"], base)
    stream.write(f"\n  setting {si + 1}: {label}\n")
    ppl = claim.metric == "perplexity"
    key = "perplexity" if ppl else "test_accuracy"
    results = []
    for row in rows:
      accs, wires, dirs, losses = [], [], [], []
      for seed in seeds:
        d = _run_dir(out, name, si, row.label, seed)
        cfg = _config(base, row.flags, seed, d, data_dir=data_dir, toy=toy, overwrite=overwrite,
                      epochs=reduced.get("epochs"), max_steps=reduced.get("max_steps_per_epoch"))
        hist = train(cfg)
        accs.append(hist[-1][key])
        losses.append(final_loss(hist))
        wires.append(sum(h["wire_bytes"] for h in hist) / 1e6)
        dirs.append(d)
      mean, sd = _stats(accs)
      results.append({"label": row.label, "flags": row.flags, "claim": row.claim,
                      "seeds": list(seeds), f"final_{key}": accs, "mean": mean, "sd": sd,
                      "final_train_loss": losses, "wire_mb": sum(wires) / len(wires),
                      "dirs": dirs})
      stream.write(f"    {row.label:<22} {' '.join(f'{a:.4f}' for a in accs)}  mean {mean:.4f}"
                   f"  wire {results[-1]['wire_mb']:.1f} MB\n")
      stream.flush()
    _judge(results, claim, toy)
    summary["settings"].append({"name": label, "index": si, "base": base, "rows": results})
    missing = [g for g in setting.gap or () if g not in [r.label for r in rows]]
    if setting.gap is not None and not missing:
      add_gap(results, *setting.gap)
      summary["settings"][-1]["gap"] = list(setting.gap)
    elif setting.gap is not None:
      stream.write(f"    no loss-gap table: --rows leaves out {' and '.join(missing)}\n")
  folder = os.path.join(out, name)
  os.makedirs(folder, exist_ok=True)
  table = report_table(summary)
  for s in summary["settings"]:
    if s.get("gap"):
      table += f"\nSetting {s['index'] + 1}, final training loss:\n\n" + \
          gap_table(s, *s["gap"])
  stream.write("\n" + table)
  with open(os.path.join(folder, "REPORT.md"), "w") as f:
    what = (f"{claim.margin}% above fp32 (final test perplexity against fp32's of the same "
            "seed, averaged" if claim.metric == "perplexity" else
            f"{claim.margin} points below fp32 (mean final test accuracy")
    size = ("Reduced runs (the settings' size did not fit the machine): the verdicts are "
            "those of runs shorter than the settings'.\n\n" if reduced else "")
    size += f"{subset[0].upper()}{subset[1:]}\n\n" if subset else ""
    f.write(f"# jaxlp reproduce {name}\n\n{claim.system}\n\nClaim: {claim.statement}\n\n"
            f"Margin: {what} over seeds {', '.join(map(str, seeds))}).\n\n{size}{table}")
  with open(os.path.join(folder, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  if plots:
    from jaxlp.training._plot import plot_runs  # noqa: PLC0415 -- matplotlib is optional

    for s in summary["settings"]:
      sdir = os.path.join(folder, f"s{s['index']}")
      paths = plot_runs([r["dirs"][0] for r in s["rows"]], sdir,
                        labels=[r["label"] for r in s["rows"]])
      if s.get("gap"):
        paths += plot_gap(s, sdir, *s["gap"])
      stream.write(f"plots: {', '.join(paths)}\n")
  return summary


def _subset_note(selected) -> str:
  """The line saying the table holds only the rows ``selected`` (``--rows``); empty for all."""
  if selected is None:
    return ""
  named = [r for r in selected if r != "fp32"]
  if not named:
    return "the table is a subset: only each setting's fp32 baseline (--rows fp32)"
  skipped = "" if "fp32" in selected else "; settings with none of them are skipped"
  return (f"the table is a subset: only the rows {', '.join(map(repr, named))} (--rows) and "
          f"each setting's fp32 baseline{skipped}")


def _judge(results: list[dict], claim: Claim, toy: bool) -> None:
  """Set ``delta_points`` / ``delta_percent`` and ``verdict`` of every row of one setting
  (``results[0]`` is the fp32 baseline)."""
  fp32 = results[0]["mean"]
  ppl = claim.metric == "perplexity"
  for r in results:
    if ppl:  # lower is better: a row may exceed fp32 by margin percent, seed by seed
      pairs = list(zip(r["final_perplexity"], results[0]["final_perplexity"], strict=True))
      r["delta_percent"] = sum(100.0 * (v / b - 1.0) for v, b in pairs) / len(pairs)
      ok, diff = r["delta_percent"] <= claim.margin, f"{r['delta_percent']:+.1f}%"
    else:
      r["delta_points"] = 100.0 * (r["mean"] - fp32)
      ok, diff = r["delta_points"] >= -claim.margin, f"{r['delta_points']:+.1f} points"
    if r["label"] == "fp32":
      r["verdict"] = "baseline"
    elif toy:
      r["verdict"] = "toy run: no verdict"
    elif not r["claim"]:
      r["verdict"] = "context (no claim)"
    elif ok and math.isfinite(r["mean"]):
      r["verdict"] = "holds"
    else:
      r["verdict"] = f"does not hold ({diff})"


def report_table(summary: dict) -> str:
  """The reproduction table of a :func:`reproduce` summary, in Markdown.

  Columns: claim, setting, row, fp32 mean, the row's mean (per-seed values), difference in
  points, wire MB and verdict; for a perplexity claim (``summary["metric"]``) the means are
  test perplexities and the difference is in percent of fp32's.

  Args:
    summary: what :func:`reproduce` returned (or its ``summary.json``).

  Returns:
    The table as a string (one line per row, header first).

  Example:
    >>> from jaxlp.training import report_table
    >>> s = {"claim": "cgx", "settings": [{"name": "CNN", "rows": [
    ...     {"label": "fp32", "final_test_accuracy": [0.9], "mean": 0.9, "delta_points": 0.0,
    ...      "wire_mb": 10.0, "verdict": "baseline"},
    ...     {"label": "cgx4", "final_test_accuracy": [0.895], "mean": 0.895,
    ...      "delta_points": -0.5, "wire_mb": 1.5, "verdict": "holds"}]}]}
    >>> print(report_table(s).splitlines()[-1])
    | cgx | CNN | cgx4 | 0.9000 | 0.8950 (0.8950) | -0.5 | 1.5 | holds |
  """
  ppl = summary.get("metric") == "perplexity"
  if ppl:
    lines = ["| claim | setting | row | fp32 ppl | jaxlp ppl (seeds) | diff (%) | wire MB | "
             "verdict |"]
  else:
    lines = ["| claim | setting | row | fp32 | jaxlp (seeds) | diff (points) | wire MB | "
             "verdict |"]
  lines.append("|---|---|---|---|---|---|---|---|")
  for s in summary["settings"]:
    fp32 = s["rows"][0]["mean"]
    for r in s["rows"]:
      vals = r["final_perplexity"] if ppl else r["final_test_accuracy"]
      per_seed = ", ".join(f"{a:.4f}" for a in vals)
      diff = f"{r['delta_percent']:+.1f}" if ppl else f"{r['delta_points']:+.1f}"
      lines.append(f"| {summary['claim']} | {s['name']} | {r['label']} | {fp32:.4f} | "
                   f"{r['mean']:.4f} ({per_seed}) | {diff} | "
                   f"{r['wire_mb']:.1f} | {r['verdict']} |")
  return "\n".join(lines) + "\n"
