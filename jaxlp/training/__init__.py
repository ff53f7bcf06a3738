"""jaxlp.training: the data-parallel training loop behind ``jaxlp train`` and ``jaxlp compare``,
as a library (for notebooks and scripts; the ``jaxlp`` command only parses arguments and prints).

* :class:`TrainConfig` — every knob of a run (the command's flags, one field each).
* :func:`train` — run a configuration to the end and return its per-epoch metrics;
  :class:`Trainer` — the same loop one epoch at a time.
* :func:`load_dataset`, :func:`build_model` — the built-in data (digits, synthetic, CIFAR-10
  and MNIST from a folder) and models (MLP, CNN, ResNet-9/18, VGG-19).
* :func:`plot_runs` — the comparison plots of ``jaxlp compare``.
* :func:`reproduce` — ``jaxlp reproduce``: each replaced system's headline claim (:data:`CLAIMS`,
  :class:`Claim`, :class:`Setting`, :class:`Row`) trained over seeds and judged against fp32;
  :func:`report_table` — its Markdown table.

Needs the ``examples`` extra (flax, optax, scikit-learn, matplotlib).
"""

from jaxlp.training._data import DATASETS as DATASETS
from jaxlp.training._data import Dataset as Dataset
from jaxlp.training._data import load as load_dataset
from jaxlp.training._loop import ORDERS as ORDERS
from jaxlp.training._loop import TrainConfig as TrainConfig
from jaxlp.training._loop import Trainer as Trainer
from jaxlp.training._loop import train as train
from jaxlp.training._models import MODELS as MODELS
from jaxlp.training._models import build as build_model
from jaxlp.training._plot import plot_runs as plot_runs
from jaxlp.training._plot import read_metrics as read_metrics
from jaxlp.training._reproduce import CLAIMS as CLAIMS
from jaxlp.training._reproduce import Claim as Claim
from jaxlp.training._reproduce import Row as Row
from jaxlp.training._reproduce import Setting as Setting
from jaxlp.training._reproduce import report_table as report_table
from jaxlp.training._reproduce import reproduce as reproduce

__all__ = [
    "CLAIMS", "DATASETS", "MODELS", "ORDERS", "Claim", "Dataset", "Row", "Setting",
    "TrainConfig", "Trainer", "build_model", "load_dataset", "plot_runs", "read_metrics",
    "report_table", "reproduce", "train",
]
