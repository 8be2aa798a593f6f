"""The main job's records as it trains: ``metrics.jsonl``, TensorBoard
event files beside it, the progress bar, and whether the run diverged."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any


def strict_json(rec: dict) -> dict:
  """``rec`` with every non-finite float as ``None`` (JSON has no NaN)."""
  return {
    k: None if isinstance(v, float) and not math.isfinite(v) else v
    for k, v in rec.items()
  }


def host(x):
  """A replicated value, read from this process's first shard."""
  import numpy as np

  return np.asarray(x.addressable_data(0))


class RunLog:
  """The run's records, ``metrics.jsonl`` and TensorBoard event files beside
  it (main process; ``tensorboard --logdir runs/``), and the progress bar;
  step metrics are read one step late, so the host never stalls."""

  def __init__(
    self, config, out, main_process, schedule, devices, flops_per_token
  ):
    from tqdm.auto import tqdm

    self.config, self.schedule, self.devices = config, schedule, devices
    self.flops_per_token = flops_per_token
    self.main_process = main_process
    self.records = []
    self.tokens_per_step = config.batch * config.seq_len
    self.file = (
      open(out / "metrics.jsonl", "a" if config.resume else "w")
      if main_process
      else open(os.devnull, "w")
    )
    self.events = None
    if main_process:
      from tensorboardX import SummaryWriter

      self.events = SummaryWriter(logdir=str(out))
    self.t_start = self.t_window = time.perf_counter()
    self.window_steps = 0
    self.bar = tqdm(
      total=config.steps,
      desc="train",
      unit="step",
      disable=None if main_process else True,
      dynamic_ncols=True,
    )
    self.pending = None
    self.wall_s = None
    self.diverged: dict | None = None  # the first non-finite record
    self.last_finite: int | None = None  # the last step read finite
    self.stopped_at = 0  # the last step run

  def write(self, rec: dict, flush: bool = False):
    self.records.append(rec)
    self.file.write(json.dumps(strict_json(rec)) + "\n")
    self.watch(rec)
    if self.events is not None:
      for name, value in rec.items():
        if name != "step" and isinstance(value, (int, float)):
          self.events.add_scalar(name, value, rec["step"])
    if flush:
      self.file.flush()
      if self.events is not None:
        self.events.flush()

  def step_metrics(self, step_done: int, metrics) -> dict:
    from zerojax.app import mfu

    rec: dict[str, Any] = {
      "step": step_done,
      "loss": float(host(metrics["loss"])),
      "grad_norm": float(host(metrics["grad_norm"])),
      "lr": float(self.schedule(step_done - 1)),
    }
    now = time.perf_counter()
    if self.window_steps:
      rec["tokens_per_s"] = (
        self.tokens_per_step * self.window_steps / (now - self.t_window)
      )
      rec["mfu"] = mfu.mfu(
        rec["tokens_per_s"], self.flops_per_token, self.devices
      )
    self.t_window, self.window_steps = now, 0
    return rec

  def after_step(self, step: int, metrics, is_eval: bool):
    """Writes the previous step's metrics; queues this step's."""
    self.window_steps += 1
    if self.pending is not None:
      rec = self.pending()
      self.write(rec)
      postfix = dict(
        loss=f"{rec['loss']:.3f}", tok_s=f"{rec.get('tokens_per_s', 0):,.0f}"
      )
      if rec.get("mfu") is not None:
        postfix["mfu"] = f"{100 * rec['mfu']:.1f}%"
      self.bar.set_postfix(**postfix)
      self.pending = None
    if step % self.config.log_every == 0 or is_eval:
      self.pending = functools.partial(self.step_metrics, step, metrics)

  def evaluation(self, step: int, eval_loss: float):
    rec = self.pending() if self.pending is not None else {"step": step}
    self.pending = None
    rec["eval_loss"] = eval_loss
    self.write(rec, flush=True)
    if self.main_process:
      self.bar.write(
        f"step {step:5d}  loss "
        f"{rec.get('loss', float('nan')):.4f}  "
        f"eval_loss {rec['eval_loss']:.4f}"
      )
    self.t_window, self.window_steps = time.perf_counter(), 0

  def finite_at(self, step: int, metrics) -> bool:
    """Whether ``step``'s loss and gradient norm are finite (read now: the
    step is about to be saved). If not, the step's record is written and
    the run is marked diverged."""
    values = [float(host(metrics[k])) for k in ("loss", "grad_norm")]
    if all(math.isfinite(v) for v in values):
      self.last_finite = step
      return True
    if self.pending is not None:
      self.write(self.pending())
      self.pending = None
    self.write(self.step_metrics(step, metrics))
    return False

  def watch(self, rec: dict):
    """Notes the first record whose loss, gradient norm or eval loss is not
    finite (the run diverged), and the last one whose values all are."""
    values = [rec[k] for k in ("loss", "grad_norm", "eval_loss") if k in rec]
    if all(math.isfinite(v) for v in values):
      if values and self.diverged is None:
        self.last_finite = max(rec["step"], self.last_finite or 0)
    elif self.diverged is None:
      self.diverged = rec

  def close(self):
    if self.pending is not None:  # stopped before the next step read it
      self.write(self.pending())
      self.pending = None
    self.file.close()
    if self.events is not None:
      self.events.close()
    self.bar.close()
