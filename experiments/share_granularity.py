"""Which shares ``zero(..., offload=f)`` can reach on the reference GPT.

Partial offload puts whole arrays in host memory (a leaf's master copy,
each of its optimizer-state leaves; the largest while below the share,
then the smallest that reaches it: ``records/host_memory``), so a model
scanned over its layers, with a dozen large stacks, reaches a few dozen
shares. This lists, per GPU bench size (stage 3, one device, bf16 params
with an fp32 master copy and AdamW's moments, as the planner prices the
main job), each leaf's share of the offloadable bytes, every share the
rule reaches, and for each asked share the one reached and the nearest
reachable one below it; beside it, the same rule over whole leaves (a
leaf's master copy and state together), the coarser baseline. From
shapes alone: nothing is allocated.

    python experiments/share_granularity.py --out docs/data

writes ``share_granularity_jax<v>.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

from zerojax._src.diagnostics.planner import plan_spec
from zerojax._src.records import host_memory
from zerojax.app import planner, train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_bench import SIZES, configure  # noqa: E402

ASKED = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _rule(sizes) -> dict:
  """The shares the rule reaches over items of ``sizes``, and asked ->
  reached with the nearest reachable share below."""
  every = [True] * len(sizes)
  total = sum(sizes)
  reached = host_memory.ShareChoice.of(sizes, every).reached()
  rows = []
  for f in ASKED:
    held = host_memory.chosen_for_share(sizes, every, f)
    below = reached[reached < f * (1 - 1e-12)]
    rows.append(
      {
        "asked": f,
        "reached": sum(sizes[i] for i in held) / total,
        "nearest_below": float(below[-1]) if len(below) else None,
      }
    )
  return {
    "reachable_shares": [float(x) for x in reached],
    "asked_to_reached": rows,
  }


def granularity(size: str) -> dict:
  """The leaves' shares, the reachable shares and asked -> reached, by
  arrays (the rule ``zero`` applies) and by whole leaves."""
  _, _, model = configure(size, "3+offload")
  abstract = planner.abstract_gpt(model)
  spec = plan_spec(abstract, 3, 1, optimizer=train.recipe()[0], offload=True)
  units = host_memory.share_units(spec.leaves, spec.opt_leaves, True)
  per_leaf = [0] * len(spec.leaves)
  for u in units:
    per_leaf[u.leaf] += u.size
  total = sum(per_leaf)
  return {
    "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract))),
    "width": model.width,
    "depth": model.depth,
    "offloadable_bytes": int(total),
    "arrays": len(units),
    "leaves": {
      r.path: n / total
      for r, n in sorted(zip(spec.leaves, per_leaf), key=lambda t: -t[1])
      if n
    },
    **_rule([u.size for u in units]),
    "whole_leaves": _rule([n for n in per_leaf if n]),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default="1b,2.7b,3.5b,7b")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
  args = p.parse_args()
  record = {
    "jax": jax.__version__,
    "rule": "whole arrays (a leaf's master copy, each optimizer-state "
    "leaf): the largest while below the share, then the smallest that "
    "reaches it (zerojax._src.records.host_memory); whole_leaves: the "
    "same rule over a leaf's master copy and state together",
    "sizes": {s: granularity(s) for s in args.sizes.split(",") if s in SIZES},
  }
  out = args.out / f"share_granularity_jax{jax.__version__}.json"
  out.write_text(json.dumps(record, indent=1) + "\n")
  for size, r in record["sizes"].items():
    print(
      f"{size}: {len(r['reachable_shares'])} reachable shares "
      f"({len(r['whole_leaves']['reachable_shares'])} by whole leaves); "
      + ", ".join(
        f"{x['asked']:g}->{x['reached']:.3f} ({y['reached']:.3f})"
        for x, y in zip(
          r["asked_to_reached"], r["whole_leaves"]["asked_to_reached"]
        )
      )
    )
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
