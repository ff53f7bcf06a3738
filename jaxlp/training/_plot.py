"""Plots for ``jaxlp compare`` / ``jaxlp plot`` (matplotlib, PNG): CPD's draw_curve, redone."""

from __future__ import annotations

import json
import os


def read_metrics(run_dir: str) -> list[dict]:
  r"""The per-epoch metrics of a run folder (its ``metrics.jsonl``).

  Every line must be a JSON object with a numeric ``epoch`` and a numeric ``test_accuracy``
  (classifiers) or ``perplexity`` (language models), and, where present, a numeric
  ``wire_bytes``; a last line without its newline that does not parse is
  skipped (a run is writing it, or a crash tore it: ``--resume`` repairs it).

  Args:
    run_dir: the run folder.

  Returns:
    One dict per line of ``metrics.jsonl``.

  Raises:
    ValueError: a line that is not such an object (the message names the file and line).
    OSError: the file cannot be read (the message names it).

  Example:
    >>> import json, os, tempfile
    >>> from jaxlp.training import read_metrics
    >>> run = tempfile.mkdtemp()
    >>> with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    ...   _ = f.write(json.dumps({"epoch": 1, "test_accuracy": 0.9}) + "\n")
    >>> read_metrics(run)
    [{'epoch': 1, 'test_accuracy': 0.9}]
  """
  path = os.path.join(run_dir, "metrics.jsonl")
  with open(path, "rb") as f:
    pieces = f.read().split(b"\n")
  out = []
  for i, raw in enumerate(pieces, 1):
    if not raw.strip():
      continue
    try:
      h = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
      if i == len(pieces):  # the last line, without its newline: being written, or torn
        continue
      raise ValueError(f"{path}: line {i} is not valid JSON; the metrics file is damaged") from None
    if not isinstance(h, dict):
      raise ValueError(f"{path}: line {i} is not a JSON object of metrics")
    score = "perplexity" if "perplexity" in h else "test_accuracy"
    for key, need in (("epoch", True), (score, True), ("wire_bytes", False)):
      v = h.get(key)
      if (v is None and need) or (v is not None and (isinstance(v, bool)
                                                    or not isinstance(v, (int, float)))):
        what = ("'test_accuracy' (or 'perplexity')" if key == "test_accuracy" else repr(key))
        raise ValueError(f"{path}: line {i} has no numeric {what}")
    out.append(h)
  return out


def plot_runs(dirs, out_dir: str, labels=None) -> list[str]:
  r"""Write ``accuracy_vs_epoch.png`` and ``accuracy_vs_wire_bytes.png`` (classifier runs)
  and/or ``perplexity_vs_epoch.png`` and ``perplexity_vs_wire_bytes.png`` (language-model
  runs: test perplexity, log scale); return their paths.

  Args:
    dirs: run folders (each with a ``metrics.jsonl``).
    out_dir: where the PNG files go.
    labels: a legend label per run (default: the folder names).

  Returns:
    The paths of the files written (two per kind of run present).

  Example:
    >>> import json, os, tempfile
    >>> from jaxlp.training import plot_runs
    >>> run = tempfile.mkdtemp()
    >>> with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    ...   _ = f.write(json.dumps({"epoch": 1, "test_accuracy": 0.9, "wire_bytes": 1000}) + "\n")
    >>> [os.path.basename(p) for p in plot_runs([run], run)]
    ['accuracy_vs_epoch.png', 'accuracy_vs_wire_bytes.png']
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:  # pragma: no cover
    raise ImportError("plots need matplotlib: pip install 'jaxlp[examples]'") from e
  labels = labels or [os.path.basename(os.path.normpath(d)) for d in dirs]
  runs = [(lab, read_metrics(d)) for lab, d in zip(labels, dirs)]
  os.makedirs(out_dir, exist_ok=True)
  lm = lambda hist: bool(hist) and "perplexity" in hist[-1]
  kinds = []
  if not runs or not all(lm(h) for _, h in runs):
    kinds.append(("accuracy", "test_accuracy", "test accuracy",
                  [(lab, h) for lab, h in runs if not lm(h)]))
  if any(lm(h) for _, h in runs):
    kinds.append(("perplexity", "perplexity", "test perplexity (log scale)",
                  [(lab, h) for lab, h in runs if lm(h)]))
  paths = []
  for kind, key, ylabel, group in kinds:
    paths += _plot_kind(plt, group, out_dir, kind, key, ylabel)
  return paths


def _plot_kind(plt, runs, out_dir, kind, key, ylabel):
  paths = []
  for xkey, fname, xlabel in (("epoch", f"{kind}_vs_epoch.png", "epoch"),
                              ("wire", f"{kind}_vs_wire_bytes.png",
                               "cumulative bytes sent per worker (MB)")):
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for lab, hist in runs:
      if not hist:
        continue
      ys = [h[key] for h in hist]
      if xkey == "epoch":
        xs = [h["epoch"] for h in hist]
      else:
        acc, xs = 0, []
        for h in hist:
          acc += h.get("wire_bytes", 0)
          xs.append(acc / 1e6)
      ax.plot(xs, ys, marker="o", ms=3, label=lab)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if kind == "accuracy":
      ax.set_ylim(0, 1)
    else:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, fname)
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
  return paths
