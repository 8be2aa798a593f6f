"""ZeRO stages 0-3 side by side on one GPT: memory, collectives, step time.

    python experiments/bench_stages.py                 # writes runs/bench_stages/
    python experiments/bench_stages.py --width 512 --depth 8

Each stage runs in its own fresh subprocess (8 fake CPU devices), so its
peak RSS is its own. Per stage: median step time over --steps steps after
one warm-up step (compile time apart), process peak RSS (and the RSS before
the state was built, the runtime's share), measured per-device state bytes
by category next to the ZeRO formula, collective bytes per step from the
compiled HLO next to the formula, and the final loss (all stages must
agree). Output: a markdown table on stdout and ``<out>/bench_stages.json``.

On CPU, XLA runs bf16 collectives in f32 (a float-normalisation pass); the
theory column is therefore computed in the dtype the compiled program
communicates, which the table prints.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys


def worker(args) -> dict:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import functools
  import resource
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import zerojax
  from zerojax import data
  from zerojax.models import gpt

  rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  jax.devices()
  rss_runtime = rss()
  model = gpt.GPTConfig(width=args.width, depth=args.depth, heads=args.heads,
                        seq_len=args.seq_len)
  policy = (zerojax.Policy(param_dtype=jnp.bfloat16) if args.precision == "bf16"
            else zerojax.Policy())
  tx = zerojax.zero(optax.adamw(1e-3), stage=args.stage, policy=policy)
  state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
  loss_fn = functools.partial(gpt.loss, config=model)
  step = zerojax.train_step(loss_fn, tx, gather="model")
  tokens, _ = data.split(data.corpus_bytes())
  batch_at = lambda i: data.batch_at(tokens, seed=0, step=i, batch=args.batch,
                                     seq_len=args.seq_len)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch_at(0)).compile()
  compile_s = time.perf_counter() - t0
  hlo = compiled.as_text()
  colls = zerojax.collectives(hlo, 8)
  coll_bytes = zerojax.collective_bytes(hlo, 8)
  mem = compiled.memory_analysis()

  state, metrics = step(state, batch_at(0))        # warm-up
  jax.block_until_ready(metrics)
  times = []
  for i in range(1, args.steps + 1):
    t = time.perf_counter()
    state, metrics = step(state, batch_at(i))
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t)

  n_params = gpt.num_params(model)
  # Theory in the dtype the compiled program communicates (f32 on CPU).
  comm_dtype = max((c.dtype for c in colls if c.elements > 1000),
                   key=lambda d: {"f32": 4, "bf16": 2}.get(d, 0), default="f32")
  b = {"f32": 4, "bf16": 2}.get(comm_dtype, 4)
  psi = n_params * b
  theory_coll = {0: {"all-reduce": psi},
                 1: {"reduce-scatter": psi, "all-gather": psi},
                 2: {"reduce-scatter": psi, "all-gather": psi},
                 3: {"reduce-scatter": psi, "all-gather": 2 * psi}}[args.stage]
  measured = zerojax.state_bytes(state)
  theory = zerojax.theory_bytes(state)
  return {
      "name": f"zerojax stage {args.stage}", "stage": args.stage,
      "n_devices": 8, "n_params": n_params, "precision": args.precision,
      "step_time_s": float(np.median(times)), "compile_s": compile_s,
      "peak_rss_bytes": rss(), "runtime_rss_bytes": rss_runtime,
      "state_bytes_per_device": measured,
      "theory_state_bytes_per_device": {k: v for k, v in theory.items()
                                        if k != "grads"},
      "xla_memory": {"argument": mem.argument_size_in_bytes,
                     "output": mem.output_size_in_bytes,
                     "temp": mem.temp_size_in_bytes,
                     "alias": mem.alias_size_in_bytes},
      "collective_bytes": coll_bytes, "collective_dtype": comm_dtype,
      "theory_collective_bytes": theory_coll,
      "final_loss": float(metrics["loss"]),
  }


def table(runs) -> str:
  mib = lambda x: f"{x / 2**20:,.2f}"
  head = ("stage", "step s", "peak RSS MiB", "state MiB/dev (theory)",
          "AR MiB", "RS MiB", "AG MiB", "coll/theory", "final loss")
  rows = []
  for r in runs:
    state = sum(v for k, v in r["state_bytes_per_device"].items())
    theory = sum(r["theory_state_bytes_per_device"].values())
    cb, tb = r["collective_bytes"], r["theory_collective_bytes"]
    big = sum(v for k, v in cb.items()
              if k in tb)
    rows.append((str(r["stage"]), f"{r['step_time_s']:.3f}",
                 mib(r["peak_rss_bytes"]), f"{mib(state)} ({mib(theory)})",
                 mib(cb.get("all-reduce", 0)), mib(cb.get("reduce-scatter", 0)),
                 mib(cb.get("all-gather", 0)),
                 f"{big / sum(tb.values()):.3f}", f"{r['final_loss']:.5f}"))
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
  line = lambda cols: "| " + " | ".join(c.rjust(w) for c, w in zip(cols, widths)) + " |"
  return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                   + [line(r) for r in rows])


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--depth", type=int, default=8)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
  p.add_argument("--stages", default="0,1,2,3")
  p.add_argument("--out", default="runs/bench_stages")
  p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    print(json.dumps(worker(args)))
    return
  runs = []
  for stage in [int(s) for s in args.stages.split(",")]:
    cmd = [sys.executable, __file__, "--worker", "--stage", str(stage)] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("worker", "stage", "stages", "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
      sys.exit(f"stage {stage} failed:\n{out.stderr[-3000:]}")
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"stage {stage}: done", file=sys.stderr, flush=True)
  outdir = pathlib.Path(args.out)
  outdir.mkdir(parents=True, exist_ok=True)
  (outdir / "bench_stages.json").write_text(json.dumps({"runs": runs}, indent=2))
  print(f"GPT {runs[0]['n_params']:,} params, {args.precision}, 8 fake CPU "
        f"devices, batch {args.batch}x{args.seq_len}, median of {args.steps} "
        f"steps; collectives in {runs[-1]['collective_dtype']}")
  print(table(runs))
  for r in runs:
    cats = ", ".join(
        f"{k} {v:,} ({r['theory_state_bytes_per_device'].get(k, 0):,.0f})"
        for k, v in r["state_bytes_per_device"].items())
    print(f"stage {r['stage']} bytes/device measured (theory): {cats}")


if __name__ == "__main__":
  main()
