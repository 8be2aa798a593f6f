"""Which shares ``zero(..., offload=f)`` can reach on the reference GPT.

Partial offload meets a share with whole arrays (a leaf's master copy,
each of its optimizer-state leaves) or whole leaves (all of a leaf's
arrays together), whichever puts fewer bytes on the host; each the
largest while below the share, then the smallest that reaches it
(``records/host_memory.ShareRule``). A model scanned over its layers has
a dozen large stacks, so it reaches a few dozen shares. This lists, per
GPU bench size (stage 3, one device, AdamW) and per precision (``bf16``:
bf16 params with an fp32 master copy, as the planner prices the main job;
``fp32``: fp32 params and no master copy, as ``gpu_bench.py`` trains),
each leaf's share of the offloadable bytes, every share the rule
reaches, and for each asked share the one reached and the nearest
reachable one below it; beside it, the share each half of the rule
alone reaches (``by_arrays``, ``whole_leaves``). From shapes alone:
nothing is allocated.

    python experiments/studies/share_granularity.py --out docs/data

writes ``share_granularity_jax<v>.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import zerojax
from zerojax._src.diagnostics.plan_layout import plan_spec
from zerojax._src.records import host_memory
from zerojax.app import planner, train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gpu_bench import SIZES, configure  # noqa: E402

ASKED = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
POLICIES = {
  "bf16": zerojax.Policy(param_dtype=jnp.bfloat16),
  "fp32": zerojax.Policy(),
}


def _asked(reached, held) -> list[dict]:
  """Per asked share, the one ``held`` (share -> share kept) reaches and
  the nearest in ``reached`` below it."""
  return [
    {
      "asked": f,
      "reached": held(f),
      "nearest_below": host_memory.nearest_below(reached, f),
    }
    for f in ASKED
  ]


def _one_rule(sizes) -> dict:
  """One half of the rule alone, over items of ``sizes``."""
  choice = host_memory.ShareChoice.of(sizes, [True] * len(sizes))
  total = sum(sizes)
  held = lambda f: sum(sizes[i] for i in choice.pick(f)) / total
  return {
    "reachable_shares": len(choice.reached()),
    "asked_to_reached": _asked(choice.reached(), held),
  }


def granularity(size: str, policy: str) -> dict:
  """The leaves' shares, the reachable shares and asked -> reached."""
  _, _, model = configure(size, "3+offload")
  abstract = planner.abstract_gpt(model)
  spec = plan_spec(
    abstract,
    3,
    1,
    optimizer=train.recipe()[0],
    offload=True,
    policy=POLICIES[policy],
  )
  has_master = spec.policy.has_master
  units = host_memory.share_units(spec.leaves, spec.opt_leaves, has_master)
  sizes = [u.size for u in units]
  rule = host_memory.ShareRule.of(sizes, [u.leaf for u in units])
  total = sum(sizes)
  per_leaf = [0] * len(spec.leaves)
  for u in units:
    per_leaf[u.leaf] += u.size
  reached = rule.reached()
  return {
    "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract))),
    "width": model.width,
    "depth": model.depth,
    "master_copy": has_master,
    "offloadable_bytes": int(total),
    "arrays": len(units),
    "leaves": {
      r.path: n / total
      for r, n in sorted(zip(spec.leaves, per_leaf), key=lambda t: -t[1])
      if n
    },
    "reachable_shares": [float(x) for x in reached],
    "asked_to_reached": _asked(
      reached, lambda f: sum(sizes[i] for i in rule.chosen(f)) / total
    ),
    "by_arrays": _one_rule(sizes),
    "whole_leaves": _one_rule([n for n in per_leaf if n]),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default="1b,2.7b,3.5b,7b")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
  args = p.parse_args()
  sizes = [s for s in args.sizes.split(",") if s in SIZES]
  record = {
    "jax": jax.__version__,
    "rule": "whole arrays (a leaf's master copy, each optimizer-state "
    "leaf) or whole leaves, whichever keeps fewer bytes on the host; each "
    "the largest while below the share, then the smallest that reaches "
    "it (zerojax._src.records.host_memory.ShareRule); by_arrays and "
    "whole_leaves: each half alone",
    "policies": {
      name: {s: granularity(s, name) for s in sizes} for name in POLICIES
    },
  }
  args.out.mkdir(parents=True, exist_ok=True)
  out = args.out / f"share_granularity_jax{jax.__version__}.json"
  out.write_text(json.dumps(record, indent=1) + "\n")
  for name, by_size in record["policies"].items():
    for size, r in by_size.items():
      print(
        f"{name} {size}: {len(r['reachable_shares'])} reachable shares "
        f"({r['by_arrays']['reachable_shares']} by arrays, "
        f"{r['whole_leaves']['reachable_shares']} by whole leaves); "
        + ", ".join(
          f"{x['asked']:g}->{x['reached']:.3f} "
          f"({a['reached']:.3f}, {w['reached']:.3f})"
          for x, a, w in zip(
            r["asked_to_reached"],
            r["by_arrays"]["asked_to_reached"],
            r["whole_leaves"]["asked_to_reached"],
          )
        )
      )
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
