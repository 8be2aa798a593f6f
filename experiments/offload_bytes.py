"""Host offload on the bench GPT: where the state lives and what the update moves.

    python experiments/offload_bytes.py [--out runs/offload_bytes]

bf16 params + fp32 master, AdamW, 8 fake CPU devices. For stages 1-3, with
and without ``zero(..., offload=True)``: persistent bytes per device by
memory kind (``zerojax.diagnostics.memory_bytes``), the compiled step's argument bytes
in host memory space (``zerojax.diagnostics.entry_bytes_by_memory``), and whether the
state after 3 steps is bitwise the one without offload. Then, at stage 3
with offload, ``zerojax.report(...).offload`` for AdamW, clipped AdamW and
``optax.MultiSteps``: how the update is streamed and the bytes it moves
each way. Writes ``<out>/offload_bytes.json`` (with the JAX version) and
prints the tables. Bytes only: on CPU host and device memory are the same
RAM, so nothing here is a timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.app import data, gpt  # noqa: E402


def _setup():
  model = gpt.GPTConfig(vocab=256, width=256, depth=8, heads=4, seq_len=128)
  tokens, _ = data.split(data.corpus_bytes())
  batches = [
    data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=128)
    for i in range(3)
  ]
  return model, batches


def placement(stage: int, model, batches) -> dict:
  policy = zerojax.Policy(param_dtype=jnp.bfloat16)
  out, finals = {}, {}
  for offload in (False, True):
    tx = zerojax.zero(
      optax.adamw(1e-3), stage=stage, policy=policy, offload=offload
    )
    state = zerojax.init_from(
      functools.partial(gpt.init, model), tx, jax.random.key(0)
    )
    step = zerojax.train_step(
      functools.partial(gpt.loss, config=model), tx, gather="model"
    )
    hlo = step.lower(state, batches[0]).compile().as_text()
    entry = zerojax.diagnostics.entry_bytes_by_memory(hlo)["arguments"]
    for b in batches:
      state, metrics = step(state, b)
    out["offload" if offload else "on_device"] = {
      "memory_bytes": zerojax.diagnostics.memory_bytes(state),
      "step_argument_bytes_by_memory": entry,
      "loss": float(metrics["loss"]),
    }
    finals[offload] = [
      np.asarray(x)
      for x in jax.tree.leaves((state.params, state.master, state.opt_state))
    ]
  out["bitwise_equal"] = all(
    np.array_equal(a, b) for a, b in zip(finals[False], finals[True])
  )
  return out


def streamed(model, batches) -> dict:
  policy = zerojax.Policy(param_dtype=jnp.bfloat16)
  optimizers = {
    "AdamW": optax.adamw(1e-3),
    "clip(1.0) + AdamW": optax.chain(
      optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
    "MultiSteps(AdamW, 2)": optax.MultiSteps(optax.adamw(1e-3), 2),
  }
  out = {}
  for name, opt in optimizers.items():
    tx = zerojax.zero(opt, stage=3, policy=policy, offload=True)
    state = zerojax.init_from(
      functools.partial(gpt.init, model), tx, jax.random.key(0)
    )
    step = zerojax.train_step(
      functools.partial(gpt.loss, config=model), tx, gather="model"
    )
    out[name] = zerojax.report(step, state, batches[0]).offload
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="runs/offload_bytes")
  args = p.parse_args()
  model, batches = _setup()
  result = {
    "jax_version": jax.__version__,
    "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
    f"{len(jax.devices())} fake CPU devices",
    "n_params": gpt.num_params(model),
    "placement": {s: placement(s, model, batches) for s in (1, 2, 3)},
    "streamed": streamed(model, batches),
  }
  outdir = pathlib.Path(args.out)
  outdir.mkdir(parents=True, exist_ok=True)
  (outdir / "offload_bytes.json").write_text(json.dumps(result, indent=1))
  print(
    "| stage | without offload: device | offload: device | offload: "
    "pinned_host | step arguments in host space | bitwise equal |"
  )
  print("|---|---|---|---|---|---|")
  for s, r in result["placement"].items():
    on, off = r["on_device"], r["offload"]
    print(
      f"| {s} | {on['memory_bytes'].get('device', 0):,} | "
      f"{off['memory_bytes'].get('device', 0):,} | "
      f"{off['memory_bytes'].get('pinned_host', 0):,} | "
      f"{off['step_argument_bytes_by_memory'].get('pinned_host', 0):,} | "
      f"{r['bitwise_equal']} |"
    )
  print(
    "\n| optimizer | chunks | largest chunk | host->device | device->host "
    "| theory (state each way) | host-side update |"
  )
  print("|---|---|---|---|---|---|---|")
  for name, o in result["streamed"].items():
    print(
      f"| {name} | {o['chunks']} | {o['largest_chunk_fraction']:.1%} | "
      f"{o['host_to_device_bytes']:,} | {o['device_to_host_bytes']:,} | "
      f"{o['theory_streamed_bytes']:,} | "
      f"{o['theory_host_compute_bytes']:,} |"
    )


if __name__ == "__main__":
  main()
