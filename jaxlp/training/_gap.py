"""What each piece of a recipe buys: the final training loss of every row of a reproduce
setting, and the part of the loss gap between a low-precision start row and a reference row
that each row closes (``jaxlp reproduce nvfp4``).

The final loss of a run is its mean training loss over the last ``LOSS_EPOCHS`` epochs (every
step of them; one epoch's mean alone moves by a third between neighbouring epochs at the end
of the digits runs, where the loss spikes now and then). Per row: its mean and
standard deviation over the seeds; its paired difference to the start row (the mean over
seeds of ``loss(row, seed) - loss(start, seed)``: the runs of one seed share their initial
weights and batch order) with the standard error of that mean; and the gap closed,
``100 * (L_start - L_row) / (L_start - L_ref)`` with ``L`` the means over seeds (100%: the
row trains as well as the reference; 0%: no better than the start row; negative: worse).
"""

from __future__ import annotations

import math
import os

from jaxlp.training._plot import read_metrics

#: epochs at the end of a run whose training losses make its final loss
LOSS_EPOCHS = 5
#: the gap plot's axis ends at these percentages (rows beyond get their value written)
PLOT_RANGE = (-200.0, 200.0)


def final_loss(hist: list[dict], epochs: int = LOSS_EPOCHS) -> float:
  """The mean training loss of the last ``epochs`` epochs of a run's history (each epoch's
  ``train_loss`` weighted by its ``steps``; all epochs if fewer)."""
  last = hist[-epochs:]
  steps = [h.get("steps", 1) for h in last]
  return sum(h["train_loss"] * n for h, n in zip(last, steps)) / sum(steps)


def _mean_sd(xs):
  m = sum(xs) / len(xs)
  sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
  return m, sd


def add_gap(rows: list[dict], ref: str, start: str) -> None:
  """Set ``final_loss_mean``, ``final_loss_sd``, ``delta_loss`` (paired, vs ``start``),
  ``delta_loss_se`` and ``gap_closed`` (percent; None where the gap is not positive) on every
  row of one setting (each row has ``label`` and ``final_train_loss``, one per seed).

  Raises:
    ValueError: ``ref`` or ``start`` is not a row label."""
  by = {r["label"]: r for r in rows}
  for lab in (ref, start):
    if lab not in by:
      raise ValueError(f"reproduce: the gap's row {lab!r} is not a row of the setting "
                       f"({', '.join(by)})")
  for r in rows:
    r["final_loss_mean"], r["final_loss_sd"] = _mean_sd(r["final_train_loss"])
  l_ref, l_start = by[ref]["final_loss_mean"], by[start]["final_loss_mean"]
  gap = l_start - l_ref
  for r in rows:
    d = [a - b for a, b in zip(r["final_train_loss"], by[start]["final_train_loss"],
                               strict=True)]
    m, sd = _mean_sd(d)
    r["delta_loss"], r["delta_loss_se"] = m, sd / math.sqrt(len(d))
    ok = gap > 0 and math.isfinite(gap) and math.isfinite(r["final_loss_mean"])
    r["gap_closed"] = 100.0 * (l_start - r["final_loss_mean"]) / gap if ok else None


def gap_table(setting: dict, ref: str, start: str) -> str:
  """The Markdown table of one setting after :func:`add_gap`: row, final loss (mean +- sd
  over seeds; the per-seed values), paired difference to ``start`` (+- its standard error),
  gap closed, final test accuracy (mean)."""
  lines = [f"| row | final loss, mean +- sd (seeds) | vs {start} (paired, +- s.e.) | "
           f"gap {start} -> {ref} closed | test acc |", "|---|---|---|---|---|"]
  for r in setting["rows"]:
    seeds = ", ".join(f"{v:.4f}" for v in r["final_train_loss"])
    gc = "-" if r["gap_closed"] is None else f"{r['gap_closed']:+.0f}%"
    lines.append(f"| {r['label']} | {r['final_loss_mean']:.4f} +- {r['final_loss_sd']:.4f} "
                 f"({seeds}) | {r['delta_loss']:+.4f} +- {r['delta_loss_se']:.4f} | {gc} | "
                 f"{r['mean']:.4f} |")
  return "\n".join(lines) + "\n"


def plot_gap(setting: dict, out_dir: str, ref: str, start: str) -> list[str]:
  """``loss_vs_epoch.png`` (training loss per epoch, mean over seeds, log scale) and
  ``gap_closed.png`` (the gap closed per row, with the paired standard error) of one
  setting after :func:`add_gap`; returns their paths (needs matplotlib)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(out_dir, exist_ok=True)
  fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=110)
  for r in setting["rows"]:
    hists = [read_metrics(d) for d in r["dirs"]]
    n = min(len(h) for h in hists)
    ys = [sum(h[i]["train_loss"] for h in hists) / len(hists) for i in range(n)]
    ax.plot(range(1, n + 1), ys, marker="o", ms=2, lw=1, label=r["label"])
  ax.set_xlabel("epoch")
  ax.set_ylabel(f"training loss (mean of {len(setting['rows'][0]['dirs'])} seeds, log)")
  ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  p1 = os.path.join(out_dir, "loss_vs_epoch.png")
  fig.savefig(p1)
  plt.close(fig)
  rows = [r for r in setting["rows"] if r["gap_closed"] is not None]
  fig, ax = plt.subplots(figsize=(7.0, 4.0), dpi=110)
  ys = [r["gap_closed"] for r in rows]
  by = {r["label"]: r for r in setting["rows"]}
  gap = by[start]["final_loss_mean"] - by[ref]["final_loss_mean"]
  err = [100.0 * r["delta_loss_se"] / gap for r in rows] if rows else []
  lo, hi = PLOT_RANGE
  clipped = [min(max(v, lo), hi) for v in ys]
  ax.barh([r["label"] for r in rows], clipped, xerr=err, color="tab:blue", alpha=0.8)
  for i, (v, c) in enumerate(zip(ys, clipped, strict=True)):
    if v != c:  # off the axis: the value written at the edge
      ax.text(c, i, f" {v:+.0f}% ", va="center", ha="left" if c < 0 else "right", fontsize=8)
  ax.set_xlim(lo, hi)
  if not rows:  # the start row is no worse than the reference: nothing to close
    ax.text(0.5, 0.5, f"no gap: {start} trains as well as {ref}", transform=ax.transAxes,
            ha="center")
  ax.axvline(0, color="k", lw=0.8)
  ax.axvline(100, color="k", lw=0.8, ls="--")
  ax.invert_yaxis()
  ax.set_xlabel(f"loss gap {start} -> {ref} closed (%; bar: paired standard error)")
  ax.grid(alpha=0.3, axis="x")
  fig.tight_layout()
  p2 = os.path.join(out_dir, "gap_closed.png")
  fig.savefig(p2)
  plt.close(fig)
  return [p1, p2]
