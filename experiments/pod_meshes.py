"""ZeRO-3 on pod meshes: collective bytes per mesh axis for the bench GPT.

    python experiments/pod_meshes.py            # writes runs/pod_meshes/

The bench GPT (width 256, depth 8, vocab 256, context 128, fp32, AdamW,
batch 16) at one stage on 8 fake CPU devices arranged as a 1-D mesh
(``data=8``), hybrid sharding (``replica=2,data=4``), tensor parallelism
(``data=4,model=2``, Megatron layout from the GPT's logical axis names) and
both (``replica=2,data=2,model=2``). For each: the compiled step's
collectives grouped by the mesh axes their replica groups span (bytes per
step, full-buffer convention, loop bodies times trip counts), the ZeRO
formula for the data and replica axes, the state bytes per device, the
step time (median of ``--steps``) and the loss after the same steps (all
meshes must agree). One process; step times compare configurations run
side by side here, on in-process CPU collectives.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import time


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--stage", type=int, default=3)
  p.add_argument(
    "--meshes",
    default="data=8;replica=2,data=4;data=4,model=2;replica=2,data=2,model=2",
  )
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--depth", type=int, default=8)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--out", default="runs/pod_meshes")
  args = p.parse_args()
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )
  import jax
  import numpy as np
  import optax

  import zerojax
  from zerojax.app import data, gpt

  cfg = gpt.GPTConfig(
    vocab=256, seq_len=128, width=args.width, depth=args.depth, heads=4
  )
  tokens, _ = data.split(data.corpus_bytes())
  batches = [
    data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=128)
    for i in range(args.steps + 1)
  ]
  loss = functools.partial(gpt.loss, config=cfg)
  runs = []
  for mesh_axes in args.meshes.split(";"):
    mesh = zerojax.make_mesh(mesh_axes)
    tp = mesh.shape.get("model", 1) > 1
    tx = zerojax.zero(
      optax.adamw(1e-3),
      stage=args.stage,
      mesh=mesh,
      model_specs=gpt.model_specs() if tp else None,
      stacked=gpt.is_layer_stack,
    )
    state = zerojax.init_from(lambda k: gpt.init(cfg, k), tx, jax.random.key(0))
    step = zerojax.train_step(loss, tx, gather="model")
    rep = zerojax.report(step, state, batches[0])
    state, m = step(state, batches[0])  # compile + warm up
    times = []
    for b in batches[1:]:
      t = time.perf_counter()
      state, m = step(state, b)
      jax.block_until_ready(m["loss"])
      times.append(time.perf_counter() - t)
    runs.append(
      {
        "mesh": dict(mesh.shape),
        "stage": args.stage,
        "n_params": rep.n_params,
        "bytes_by_axis": rep.bytes_by_axis,
        "theory_collective_bytes": rep.theory_collective_bytes,
        "state_bytes_per_device": sum(rep.state_bytes.values()),
        "step_time_s": float(np.median(times)),
        "final_loss": float(np.asarray(m["loss"].addressable_data(0))),
      }
    )
    print(f"{mesh_axes}: done", flush=True)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "pod_meshes.json").write_text(json.dumps({"runs": runs}, indent=2))
  keys = sorted({k for r in runs for k in r["bytes_by_axis"]})
  mb = lambda b: f"{b / 2**20:.2f}" if b else "-"
  head = ["collective over axes (MiB/step)"] + [
    ",".join(f"{a}={n}" for a, n in r["mesh"].items()) for r in runs
  ]
  rows = [[k] + [mb(r["bytes_by_axis"].get(k, 0)) for r in runs] for k in keys]
  rows.append(
    ["state MiB/device"] + [mb(r["state_bytes_per_device"]) for r in runs]
  )
  rows.append(["step s (median)"] + [f"{r['step_time_s']:.2f}" for r in runs])
  rows.append(["loss after steps"] + [f"{r['final_loss']:.5f}" for r in runs])
  print(
    f"\nGPT {runs[0]['n_params']:,} params, stage {args.stage}, fp32, "
    f"AdamW, 8 fake CPU devices, batch 16 x 128"
  )
  print("| " + " | ".join(head) + " |")
  print("|" + "---|" * len(head))
  for r in rows:
    print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
  main()
