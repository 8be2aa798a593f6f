"""ZeRO-R's CB: the largest collective of the compiled step against depth.

    python experiments/collective_buckets.py                # depths 4..32
    python experiments/collective_buckets.py --depths 4,16 --stages 1,2

For the reference GPT (width 128, 8 fake CPU devices, fp32) at each stage and
depth, compiles the train step with ``bucket_bytes=None`` (whole-leaf
collectives) and with the default and a small configured bucket, and prints
the largest collective operand (full-buffer bytes of one execution, read from
the compiled HLO with ``zerojax.diagnostics.collectives``), the total bytes per step
(unchanged by bucketing), and whether the bucketed run's params after two
steps equal the unbucketed run's (largest absolute difference). JSON lines on stdout; the table on
stderr.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.app import (
  data,  # noqa: E402
  gpt,  # noqa: E402
)


def measure(stage, depth, width, bucket, steps):
  model = gpt.GPTConfig(
    vocab=256, width=width, depth=depth, heads=4, seq_len=64
  )
  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, bucket_bytes=bucket)
  state = zerojax.init_from(
    functools.partial(gpt.init, model), tx, jax.random.key(0)
  )
  step = zerojax.train_step(functools.partial(gpt.loss, config=model), tx)
  tokens, _ = data.split(data.corpus_bytes())
  batch = lambda i: data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=64)
  hlo = step.lower(state, batch(0)).compile().as_text()
  colls = [
    c for c in zerojax.diagnostics.collectives(hlo, 8) if c.group_size > 1
  ]
  big = max(colls, key=lambda c: c.bytes)
  for i in range(steps):
    state, _ = step(state, batch(i))
  params = [
    np.asarray(x) for x in jax.tree.leaves(zerojax.gather_params(state))
  ]
  return dict(
    stage=stage,
    depth=depth,
    width=width,
    bucket_bytes=bucket,
    largest_bytes=big.bytes,
    largest_kind=big.kind,
    largest_count=big.count,
    total_bytes=sum(c.total_bytes for c in colls),
  ), params


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--depths", default="4,8,16,32")
  p.add_argument("--stages", default="0,1,2,3")
  p.add_argument("--width", type=int, default=128)
  p.add_argument(
    "--bucket",
    type=int,
    default=256 * 1024,
    help="the small configured bucket, bytes",
  )
  p.add_argument("--steps", type=int, default=2)
  args = p.parse_args()
  rows = []
  for stage in map(int, args.stages.split(",")):
    for depth in map(int, args.depths.split(",")):
      base = None
      for bucket in (None, zerojax.ZeroConfig.bucket_bytes, args.bucket):
        row, params = measure(stage, depth, args.width, bucket, args.steps)
        if base is None:
          base = params
        row["max_abs_diff_to_whole_leaf"] = float(
          max(np.abs(a - b).max() for a, b in zip(params, base))
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
  kib = lambda b: f"{b / 1024:,.0f}"
  print(
    "| stage | depth | largest KiB, whole leaves | default (32 MiB) | "
    f"bucket {kib(args.bucket)} KiB | bytes/step equal | params max diff |",
    file=sys.stderr,
  )
  print("|---|---|---|---|---|---|---|", file=sys.stderr)
  for i in range(0, len(rows), 3):
    w, d, s = rows[i : i + 3]
    print(
      f"| {w['stage']} | {w['depth']} | {kib(w['largest_bytes'])} | "
      f"{kib(d['largest_bytes'])} | {kib(s['largest_bytes'])} | "
      f"{w['total_bytes'] == s['total_bytes'] == d['total_bytes']} | "
      f"{max(d['max_abs_diff_to_whole_leaf'], s['max_abs_diff_to_whole_leaf']):.1e} |",
      file=sys.stderr,
    )


if __name__ == "__main__":
  main()
