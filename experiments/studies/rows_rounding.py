"""Do layer stacks streamed by rows round like the whole update here?

Offload streams each layer stack's update a few rows at a time
(``zerojax._src.step.offload_rows``). Rows are the same operations on the
same elements as the whole update, but a compiler that contracts
multiply-adds to FMA instructions may fuse the two programs differently
and round them apart in the last bits (``docs/design.md``, "Layer stacks
by rows"). This runs a 16-layer reference GPT at stage 3 for two steps,
fp32 params without a master copy, with each optimizer: no offload,
offload by rows and offload with whole stacks, on the default backend's devices
with its default flags (``XLA_FLAGS`` as given), and records per optimizer whether each offloaded run
is bit for bit no offload's, the largest difference as a share of each
leaf's change over the run, and the losses' largest relative difference.

    python experiments/studies/rows_rounding.py --out docs/data

writes ``rows_rounding_<platform><devices>_jax<v>.json`` (with
``_isa<X>`` before ``_jax`` when ``XLA_FLAGS`` caps the CPU's instruction
set: ``--xla_cpu_max_isa=AVX`` has no FMA, as the suite compiles).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import re

import jax
import numpy as np
import optax

import zerojax
from zerojax._src.step import offload as _stream
from zerojax.app import data, gpt

OPTIMIZERS = {  # most wanted first
  "clip+adamw": lambda: optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(3e-3)
  ),
  "nadamw": lambda: optax.nadamw(1e-3),
  "adamw": lambda: optax.adamw(3e-3, weight_decay=0.1),
  "lion": lambda: optax.lion(1e-4),
  # a traced scalar divides each update inside a cond (bias correction)
  "adamw_if_finite": lambda: optax.apply_if_finite(optax.adamw(3e-3), 3),
  "muon": lambda: optax.contrib.muon(3e-3),
}


def run(name: str, offload: bool, steps: int):
  """``steps`` steps; the params' and state's leaves and the losses."""
  model = gpt.GPTConfig(width=32, depth=16, heads=2, seq_len=32)
  tokens, _ = data.split(data.corpus_bytes())
  tx = zerojax.zero(
    OPTIMIZERS[name](),
    stage=3,
    policy=zerojax.Policy(),
    offload=offload,
    stacked=gpt.is_layer_stack,
  )
  state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
  step = zerojax.train_step(functools.partial(gpt.loss, config=model), tx)
  by_rows = None
  if offload:
    batch = data.batch_at(tokens, seed=0, step=0, batch=16, seq_len=32)
    by_rows = zerojax.report(step, state, batch).offload["stacks_by_rows"]
  losses = []
  for i in range(steps):
    batch = data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=32)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  leaves = [
    np.asarray(x, np.float64)
    for x in jax.tree.leaves((state.params, state.opt_state))
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
  ]
  return leaves, losses, by_rows


def compare(name: str, steps: int) -> dict:
  start, _, _ = run(name, False, 0)
  plain, plain_losses, _ = run(name, False, steps)
  rows, rows_losses, by_rows = run(name, True, steps)
  jax.clear_caches()
  _stream._by_rows = False
  try:
    whole, whole_losses, _ = run(name, True, steps)
  finally:
    _stream._by_rows = True
    jax.clear_caches()

  def off_of_change(leaves):
    return max(
      float(np.max(np.abs(x - y), initial=0.0))
      / max(float(np.max(np.abs(y - x0), initial=0.0)), 1e-30)
      for x, y, x0 in zip(leaves, plain, start)
    )

  def loss_rel(losses):
    return max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses))

  same = lambda leaves: all(np.array_equal(x, y) for x, y in zip(leaves, plain))
  return {
    "stacks_by_rows": by_rows,
    "rows_bitwise": same(rows),
    "whole_bitwise": same(whole),
    "rows_off_of_change": off_of_change(rows),
    "whole_off_of_change": off_of_change(whole),
    "rows_loss_rel": loss_rel(rows_losses),
    "whole_loss_rel": loss_rel(whole_losses),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  p.add_argument("--steps", type=int, default=2)
  p.add_argument("--out", default="docs/data")
  args = p.parse_args()
  device = jax.devices()[0]
  result = {
    "device": device.device_kind,
    "platform": device.platform,
    "devices": jax.device_count(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "jax": jax.__version__,
    "steps": args.steps,
    "model": "zerojax.app.gpt width 32, depth 16, seq 32, batch 16; "
    "stage 3, fp32 params, no master copy",
    "optimizers": {},
  }
  isa = re.search(r"--xla_cpu_max_isa=(\w+)", result["xla_flags"])
  path = pathlib.Path(args.out) / (
    f"rows_rounding_{device.platform}{jax.device_count()}"
    f"{'_isa' + isa[1] if isa else ''}_jax{jax.__version__}.json"
  )
  path.parent.mkdir(parents=True, exist_ok=True)
  for name in args.optimizers.split(","):
    result["optimizers"][name] = compare(name, args.steps)
    print(name, json.dumps(result["optimizers"][name]), flush=True)
    # written after each optimizer, so a run cut short keeps its rows
    path.write_text(json.dumps(result, indent=1) + "\n")
  print(path)


if __name__ == "__main__":
  main()
