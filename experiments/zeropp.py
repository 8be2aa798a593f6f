"""ZeRO++ on the bench GPT: bytes per collective by dtype, inside and across
nodes, against plain stage 3.

    python experiments/zeropp.py                 # writes runs/zeropp/
    python experiments/zeropp.py --meshes        # every mesh x technique

8 fake CPU devices seen as 2 nodes of 4 (nodes are runs of ``--node``
devices along the data axis, as ``zerojax.make_mesh`` places processes; in
a 2-process run, node = process). For plain stage 3 and each ZeRO++
setting -- qwZ (int8 weight gathers), qgZ (int8 / int4 gradient
all-to-all), hpZ (secondary partition inside the node), all three -- the
compiled step's collectives, full-buffer convention, loop bodies times trip
counts, split by whether a collective's replica groups span nodes; the bytes
a device *receives* from other nodes (each group member's piece, counted
for the members on other nodes); XLA's temp bytes per device (hpZ's
secondary copy lives there); the loss after ``--steps`` steps and the step
time (in-process CPU collectives: not the point, reported).

The paper's accounting (Wang et al., arXiv 2306.10209, section 3): stage 3
moves 3M across nodes per step (M: the model in fp16 bytes), ZeRO++ 0.75M
(qwZ 0.5M, hpZ 0, qgZ 0.25M).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import time

CONFIGS = {
  "stage 3": {},
  "qwZ": dict(weight_bits=8),
  "qgZ int8": dict(grad_bits=8),
  "qgZ int4": dict(grad_bits=4),
  "qgZ int8, hierarchical": dict(grad_bits=8, node_size="node"),
  "qgZ int4, hierarchical": dict(grad_bits=4, node_size="node"),
  "hpZ": dict(hpz_size="node"),
  "qwZ + hpZ + qgZ int8": dict(weight_bits=8, hpz_size="node", grad_bits=8),
  "qwZ + hpZ + qgZ int4": dict(weight_bits=8, hpz_size="node", grad_bits=4),
}


def received_across(c, node: int) -> int:
  """Bytes one device receives from devices of other nodes, per step: each
  member's piece of the full buffer (an all-reduce twice: reduce, gather)."""
  if not c.groups:
    return 0
  g = c.groups[0]
  piece = c.bytes / len(g)
  worst = max(
    sum(1 for d in grp if d // node != me // node)
    for grp in c.groups
    for me in grp
  )
  factor = 2 if c.kind == "all-reduce" else 1
  return int(piece * worst * factor * c.count)


MESHES = (
  "data=8",
  "replica=2,data=4",
  "data=4,model=2",
  "replica=2,data=2,model=2",
)
TECHNIQUES = {  # name: (stage, ZeroPP kwargs; hpz "half": half the data axis)
  "stage 1 qgZ int8": (1, dict(grad_bits=8)),
  "stage 2 qgZ int4": (2, dict(grad_bits=4)),
  "stage 3 qwZ + qgZ int8": (3, dict(weight_bits=8, grad_bits=8)),
  "stage 3 qwZ + hpZ + qgZ int4": (
    3,
    dict(weight_bits=8, grad_bits=4, hpz_size="half"),
  ),
}


def mesh_table(args):
  """ZeRO++ on every mesh: runs or refuses (with the reason), the loss
  after ``--steps`` against the same mesh unquantized, and the bytes per
  step over each mesh axis from the compiled HLO (``zerojax.report``)."""
  import jax
  import optax

  import zerojax
  from zerojax.app import data, gpt

  cfg = gpt.GPTConfig(vocab=256, seq_len=64, width=128, depth=4, heads=4)
  tokens, _ = data.split(data.corpus_bytes())
  batches = [
    data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=64)
    for i in range(args.steps)
  ]
  rows = []
  for mesh_axes in MESHES:
    mesh = zerojax.make_mesh(mesh_axes)
    tp = "model" in mesh_axes
    n = int(mesh.shape["data"])
    for name, (stage, kw) in TECHNIQUES.items():
      kw = {k: (n // 2 if v == "half" else v) for k, v in kw.items()}
      row = {"mesh": mesh_axes, "technique": name, "stage": stage, "zeropp": kw}
      try:
        losses = {}
        for label, zpp in (
          ("plain", zerojax.ZeroPP()),
          ("zeropp", zerojax.ZeroPP(**kw)),
        ):
          tx = zerojax.zero(
            optax.adamw(1e-3),
            stage=stage,
            mesh=mesh,
            zeropp=zpp,
            stacked=gpt.is_layer_stack,
            model_specs=gpt.model_specs() if tp else None,
          )
          state = zerojax.init_from(
            functools.partial(gpt.init, cfg), tx, jax.random.key(0)
          )
          step = zerojax.train_step(
            functools.partial(gpt.loss, config=cfg), tx, gather="model"
          )
          if label == "zeropp":
            rep = zerojax.report(step, state, batches[0])
            row["bytes_by_axis"] = rep.bytes_by_axis
            row["ratios"] = {k: round(v, 4) for k, v in rep.ratios().items()}
          for b in batches:
            state, metrics = step(state, b)
          losses[label] = float(metrics["loss"])
        row.update(
          status="runs", loss=losses["zeropp"], plain_loss=losses["plain"]
        )
      except ValueError as e:
        row.update(status="refused", reason=str(e))
      rows.append(row)
      print(f"{mesh_axes} {name}: {row['status']}", flush=True)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "meshes.json").write_text(json.dumps({"runs": rows}, indent=2))
  mib = lambda b: f"{b / 2**20:,.2f}"
  print(
    f"\nGPT {gpt.num_params(cfg):,} params, {args.steps} steps; MiB per "
    f"step by collective and mesh axes (compiled HLO, full buffers)"
  )
  print(
    "| mesh | technique | status | loss vs unquantized | ZeRO bytes / theory "
    "| collective MiB by axis |"
  )
  print("|---|---|---|---|---|---|")
  for r in rows:
    if r["status"] != "runs":
      print(
        f"| {r['mesh']} | {r['technique']} | refused: {r['reason']} | | | |"
      )
      continue
    by = ", ".join(
      f"{k} {mib(v)}"
      for k, v in sorted(r["bytes_by_axis"].items())
      if v >= 2**12
    )
    worst = max(
      abs(v - 1) for k, v in r["ratios"].items() if k != "state_bytes"
    )
    print(
      f"| {r['mesh']} | {r['technique']} | runs | "
      f"{r['loss'] / r['plain_loss'] - 1:+.3%} | 1 ± {worst:.3f} | {by} |"
    )


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--depth", type=int, default=8)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--node", type=int, default=4, help="devices per node")
  p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
  p.add_argument("--out", default="runs/zeropp")
  p.add_argument(
    "--meshes",
    action="store_true",
    help="the mesh x technique table instead (meshes.json)",
  )
  args = p.parse_args()
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )
  if args.meshes:
    return mesh_table(args)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import zerojax
  from zerojax.app import data, gpt

  cfg = gpt.GPTConfig(
    vocab=256, seq_len=128, width=args.width, depth=args.depth, heads=4
  )
  n_params = gpt.num_params(cfg)
  tokens, _ = data.split(data.corpus_bytes())
  batches = [
    data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=128)
    for i in range(args.steps + 1)
  ]
  policy = (
    zerojax.Policy(param_dtype=jnp.bfloat16)
    if args.precision == "bf16"
    else zerojax.Policy()
  )
  mesh = zerojax.make_mesh()
  runs = []
  for name, kw in CONFIGS.items():
    kw = {k: (args.node if v == "node" else v) for k, v in kw.items()}
    tx = zerojax.zero(
      optax.adamw(1e-3),
      stage=3,
      mesh=mesh,
      policy=policy,
      zeropp=zerojax.ZeroPP(**kw),
      stacked=gpt.is_layer_stack,
    )
    state = zerojax.init_from(
      functools.partial(gpt.init, cfg), tx, jax.random.key(0)
    )
    step = zerojax.train_step(
      functools.partial(gpt.loss, config=cfg), tx, gather="model"
    )
    compiled = step.lower(state, batches[0]).compile()
    colls = zerojax.diagnostics.collectives(compiled.as_text(), 8)
    by_dtype, inside, across, recv, grad_across = {}, 0, 0, 0, 0
    for c in colls:
      key = f"{c.kind} {c.dtype}"
      by_dtype[key] = by_dtype.get(key, 0) + c.total_bytes
      spans = (
        c.groups and max(len({d // args.node for d in g}) for g in c.groups) > 1
      )
      if spans or not c.groups:
        across += c.total_bytes
        if c.kind in ("reduce-scatter", "all-to-all"):
          grad_across += c.total_bytes
      else:
        inside += c.total_bytes
      recv += received_across(c, args.node)
    temp = compiled.memory_analysis().temp_size_in_bytes
    state, metrics = step(state, batches[0])  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for b in batches[1:]:
      t = time.perf_counter()
      state, metrics = step(state, b)
      jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - t)
    runs.append(
      {
        "name": name,
        "zeropp": kw,
        "n_params": n_params,
        "bytes_by_kind_dtype": by_dtype,
        "bytes_inside_node": inside,
        "bytes_across_nodes": across,
        "received_across_per_device": recv,
        "gradient_bytes_across_nodes": grad_across,
        "xla_temp_bytes": temp,
        "loss": float(metrics["loss"]),
        "step_s": float(np.median(times)),
      }
    )
    print(f"{name}: done", flush=True)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "zeropp.json").write_text(json.dumps({"runs": runs}, indent=2))
  mib = lambda b: f"{b / 2**20:,.2f}"
  model_bytes = n_params * (2 if args.precision == "bf16" else 4)
  base = runs[0]
  print(
    f"\nGPT {n_params:,} params, {args.precision}, stage 3, 8 devices as "
    f"{8 // args.node} nodes x {args.node}; MiB per step per device "
    f"(full buffers); M = the model's {args.precision} bytes "
    f"({mib(model_bytes)} MiB)"
  )
  print(
    "| config | collectives by kind and dtype (MiB) | in-node MiB | "
    "across-node MiB (M) | received from other nodes MiB | vs stage 3 | "
    "XLA temp MiB | loss | step s |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for r in runs:
    kinds = ", ".join(
      f"{k} {mib(v)}"
      for k, v in sorted(r["bytes_by_kind_dtype"].items())
      if v >= 2**14
    )
    print(
      f"| {r['name']} | {kinds} | {mib(r['bytes_inside_node'])} | "
      f"{mib(r['bytes_across_nodes'])} ({r['bytes_across_nodes'] / model_bytes:.3f}) | "
      f"{mib(r['received_across_per_device'])} | "
      f"{r['received_across_per_device'] / base['received_across_per_device']:.3f} | "
      f"{mib(r['xla_temp_bytes'])} | {r['loss']:.5f} | {r['step_s']:.2f} |"
    )
  print(
    "\nThe gradient's collectives across nodes (reduce-scatter or "
    "all-to-all whose groups span nodes), against plain stage 3:"
  )
  print("| config | gradient MiB across nodes | vs stage 3 |")
  print("|---|---|---|")
  for r in runs:
    if "grad_bits" in r["zeropp"] or r["name"] == "stage 3":
      g = r["gradient_bytes_across_nodes"]
      print(
        f"| {r['name']} | {mib(g)} | "
        f"{g / base['gradient_bytes_across_nodes']:.3f} |"
      )
  hpz = next(r for r in runs if r["name"] == "hpZ")
  print(
    f"\nhpZ extra XLA temp per device: "
    f"{mib(hpz['xla_temp_bytes'] - base['xla_temp_bytes'])} MiB; the "
    f"secondary copy, Ψ/{args.node} params in the compute dtype: "
    f"{mib(model_bytes / args.node)} MiB"
  )


if __name__ == "__main__":
  main()
