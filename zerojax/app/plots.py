"""Plots, with matplotlib (the Agg backend: files only, no display)."""

from __future__ import annotations

import pathlib


def loss_curve(records, path, title: str = ""):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  train = [(r["step"], r["loss"]) for r in records if "loss" in r]
  evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  fig, ax = plt.subplots(figsize=(6, 4))
  if train:
    ax.plot(*zip(*train), label="train loss", lw=1)
  if evals:
    ax.plot(*zip(*evals), "o-", label="held-out loss")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/byte)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(pathlib.Path(path), dpi=120)
  plt.close(fig)
