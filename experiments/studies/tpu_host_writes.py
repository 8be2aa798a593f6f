"""Writing an updated layer stack back to host memory, per layer or whole.

The streamed offload update (``zerojax._src.step.offload``) moves whole
leaves: a layer stack's master copy and moments come down, are updated and
go back as one chunk, so the device holds the largest stack old and new.
Splitting a stack by layer needs each layer's new rows written into the
host buffer in place. This compiles, for a TPU topology (libtpu on this
CPU machine, nothing allocated), one elementwise update of a host-resident
``[layers, rows, cols]`` fp32 stack (sharded over ``data`` along ``rows``)
four ways, and records what the compiler makes of each:

* ``whole``: the stack down, updated, back (today's chunk unit);
* ``concat``: the layers down, updated and sent back one group at a time,
  the pieces concatenated in host memory;
* ``in_place``: a Python loop over layer groups, each group's new rows
  written into the donated host buffer (``dynamic_update_slice``);
* ``in_place_loop``: the same in a ``fori_loop``, one layer per iteration.

Per variant: the compiled temp and peak bytes per chip, and the bytes each
way between host and device memory (``host_transfers``: loop trip counts
applied, a ``dynamic-update-slice-start`` into host memory counted by the
update's bytes).

    python experiments/studies/tpu_host_writes.py   # docs/data/tpu_host_writes_*.json
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parents[1]  # experiments/


def _variants(layers: int, group: int):
  import jax
  import jax.numpy as jnp

  down = lambda x: jax.device_put(x, jax.memory.Space.Device)
  up = lambda x: jax.device_put(x, jax.memory.Space.Host)
  step = lambda w, g: w - 1e-3 * g

  def whole(w, g):
    return up(step(down(w), g))

  def concat(w, g):
    parts = [
      up(step(down(w[i : i + group]), g[i : i + group]))
      for i in range(0, layers, group)
    ]
    return jnp.concatenate(parts, 0)

  def in_place(w, g):
    for i in range(0, layers, group):
      new = up(step(down(w[i : i + group]), g[i : i + group]))
      w = jax.lax.dynamic_update_slice_in_dim(w, new, i, 0)
    return w

  def in_place_loop(w, g):
    def body(i, w):
      row = down(jax.lax.dynamic_slice_in_dim(w, i, 1, 0))
      new = up(step(row, jax.lax.dynamic_slice_in_dim(g, i, 1, 0)))
      return jax.lax.dynamic_update_slice_in_dim(w, new, i, 0)

    return jax.lax.fori_loop(0, layers, body, w)

  return {
    "whole": whole,
    "concat": concat,
    "in_place": in_place,
    "in_place_loop": in_place_loop,
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--topology", default="v5e:2x2")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--group", type=int, default=2, help="layers per piece")
  p.add_argument("--rows", type=int, default=512)
  p.add_argument("--cols", type=int, default=1024)
  p.add_argument("--out", default=str(HERE.parent / "docs" / "data"))
  args = p.parse_args()

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from zerojax import aot
  from zerojax.diagnostics import host_transfers

  mesh = aot.topology_mesh(args.topology)
  spec = P(None, "data")
  shape = (args.layers, args.rows, args.cols)
  host = NamedSharding(mesh, spec, memory_kind="pinned_host")
  dev = NamedSharding(mesh, spec, memory_kind="device")
  w = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=host)
  g = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=dev)
  per_chip = 4 * args.layers * args.rows * args.cols // mesh.shape["data"]
  runs = []
  for name, fn in _variants(args.layers, args.group).items():
    row = {"variant": name}
    try:
      compiled = (
        jax.jit(fn, out_shardings=host, donate_argnums=0).lower(w, g).compile()
      )
    except (jax.errors.JaxRuntimeError, ValueError) as e:  # refused: a finding
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      runs.append(row)
      print(name, row["error"])
      continue
    mem = compiled.memory_analysis()
    row.update(
      temp_bytes=int(mem.temp_size_in_bytes),
      peak_bytes=int(
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
      ),
      host_transfers=host_transfers(compiled.as_text()),
    )
    runs.append(row)
    print(f"{name:>14}: temp {row['temp_bytes'] / 2**20:7.2f} MiB", row)
  versions = {k: md.version(k) for k in ("jax", "jaxlib", "libtpu")}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / (
    f"tpu_host_writes_{args.topology.replace(':', '-')}_"
    f"jax{versions['jax']}_libtpu{versions['libtpu']}.json"
  )
  record = {
    "topology": args.topology,
    "shape": list(shape),
    "group": args.group,
    "stack_bytes_per_chip": per_chip,
    "versions": versions,
    "runs": runs,
  }
  path.write_text(json.dumps(record, indent=1) + "\n")
  print(path)


if __name__ == "__main__":
  main()
