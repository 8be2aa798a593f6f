"""The reference GPT's saved activations: the planner against the compiled step.

    python experiments/saved_activations.py   # writes docs/data/saved_activations_jax<version>.json

For the GPT of ``tests/test_activations.py`` (width 64, 32 tokens, 16
sequences over the batch axes, stage 3, SGD) on 8 fake CPU devices, per
mesh, Pa (``seq_shard``), remat policy and compute dtype:

* ``planner_per_layer``: ``zerojax.plan.gpt_activations``'s bytes per
  layer per device;
* ``compiled_per_layer``: the compiled step's temp bytes per added layer
  (least-squares slope over depths 2-8: with "dots" XLA's temp is not
  linear in depth), less the layer's gradient shard, which the backward
  scan stacks too;
* ``temps``: the compiled temp bytes at each depth.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax import plan  # noqa: E402
from zerojax.app import gpt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, T, D, V = 16, 32, 64, 64
DEPTHS = (2, 4, 6, 8)
CASES = [  # (mesh, Pa axis, remat, compute dtype)
  ("data=8", None, "full", None),
  ("data=8", None, "full", "bfloat16"),
  ("data=8", None, "dots", None),
  ("data=8", None, "dots", "bfloat16"),
  ("data=4,model=2", None, "full", None),
  ("data=4,model=2", None, "dots", None),
  ("data=4,model=2", None, "dots", "bfloat16"),
  ("data=4,model=2", "model", "full", None),
  ("data=4,model=2", "model", "full", "bfloat16"),
  ("data=4,model=2", "model", "dots", None),
  ("data=4,model=2", "model", "dots", "bfloat16"),
]


def _temp(mesh_spec, depth, remat, seq_shard, compute_dtype):
  """(compiled temp bytes, one layer's gradient shard bytes)."""
  cfg = gpt.GPTConfig(
    vocab=V,
    seq_len=T,
    width=D,
    depth=depth,
    heads=4,
    remat=remat,
    seq_shard=seq_shard,
    compute_dtype=compute_dtype,
  )
  mesh = zerojax.make_mesh(mesh_spec)
  kw = {"model_specs": gpt.model_specs()} if "model" in mesh_spec else {}
  tx = zerojax.zero(
    optax.sgd(0.1), stage=3, mesh=mesh, stacked=gpt.is_layer_stack, **kw
  )
  state = zerojax.init(gpt.init(cfg, jax.random.key(0)), tx)
  step = zerojax.train_step(
    functools.partial(gpt.loss, config=cfg), tx, gather="model"
  )
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(0, V, (B, T)).astype(np.int32) for k in "xy"}
  temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  grads = (
    sum(
      x.addressable_shards[0].data.size * 4
      for x in jax.tree.leaves(state.params["blocks"])
    )
    / depth
  )
  return temp, grads


def measure(mesh_spec, seq_shard, remat, compute_dtype) -> dict:
  temps, grads = [], 0.0
  for depth in DEPTHS:
    temp, grads = _temp(mesh_spec, depth, remat, seq_shard, compute_dtype)
    temps.append(temp)
  model = 2 if "model" in mesh_spec else 1
  cfg = gpt.GPTConfig(
    vocab=V,
    seq_len=T,
    width=D,
    depth=2,
    heads=4,
    remat=remat,
    seq_shard=seq_shard,
    compute_dtype=compute_dtype,
  )
  planned = plan.gpt_activations(cfg, B // (8 // model), model=model)
  compiled = float(np.polyfit(DEPTHS, temps, 1)[0]) - grads
  return {
    "mesh": mesh_spec,
    "pa": seq_shard,
    "remat": remat,
    "compute_dtype": compute_dtype or "float32",
    "depths": DEPTHS,
    "temps": temps,
    "grad_shard_per_layer": grads,
    "planner_per_layer": planned["per_layer"],
    "compiled_per_layer": compiled,
    "compiled_over_planner": compiled / planned["per_layer"],
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--out",
    default=str(
      ROOT / "docs" / "data" / f"saved_activations_jax{jax.__version__}.json"
    ),
  )
  args = parser.parse_args(argv)
  rows = []
  for case in CASES:
    rows.append(measure(*case))
    r = rows[-1]
    print(
      f"{r['mesh']:15s} Pa={str(r['pa']):5s} {r['remat']:4s} "
      f"{r['compute_dtype']:8s} planner {r['planner_per_layer']:>9,.0f} "
      f"compiled {r['compiled_per_layer']:>11,.0f} "
      f"({r['compiled_over_planner']:.3f})",
      flush=True,
    )
  out = {
    "argv": sys.argv,
    "jax": jax.__version__,
    "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
    f"8 fake CPU devices",
    "rows": rows,
  }
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  print(args.out)


if __name__ == "__main__":
  main()
