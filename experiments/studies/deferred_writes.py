"""Writing the last chunks' new state back beside the next step's forward.

With ``offload=True`` the streamed update's last writes to host memory run
after the backward pass, beside no compute. Deferring them -- the step
returns the last chunks' new optimizer state in device memory, and the
next step writes it to host memory while its forward pass runs, then
loads it back for its update -- moves those writes beside compute. This
compiles one training step of a scanned ``[layers, width, width]`` stack
(tanh layers, Adam moments in host memory, updated in ``groups`` chunks of
layers, each chunk's loads behind the previous chunk's stores as
``zerojax._src.step.offload`` orders them) four ways, for a TPU topology
(libtpu on this CPU machine) and for an H200 (XLA's GPU compiler,
``experiments/lib/gpu_aot.py``), and records what each compiler makes of
them:

* ``offloaded``: every chunk's moments in host memory, down and back in
  the step;
* ``resident``: the last ``tail`` chunks' moments kept in device memory
  (``offload=`` a fraction);
* ``deferred``: those chunks' moments handed in on the device, written to
  host memory at the step's start, loaded back for the update, and their
  new values handed out on the device;
* ``deferred_in_loop``: the same, the tail written to host memory one
  layer per iteration of the forward pass's first layers (inside its
  loop, so beside its compute by construction).

Per variant and compiler: the planned peak per device (arguments +
outputs + temp - aliases), the bytes each way between host and device
memory, and the bytes of asynchronous host copies that cross a layer loop
or move outside every loop (``zerojax._src.diagnostics.schedule``).

    python experiments/studies/deferred_writes.py            # the TPU compiler
    python experiments/studies/deferred_writes.py --gpu h200 # XLA's GPU compiler
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parents[1]  # experiments/


def _gpu_aot():
  """``experiments/lib/gpu_aot.py``, imported on demand (this module is
  also loaded by a test, which should not see ``experiments/`` on its
  path)."""
  if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
  from lib import gpu_aot

  return gpu_aot


VARIANTS = ("offloaded", "resident", "deferred", "deferred_in_loop")


def _step(variant: str, layers: int, groups: int, tail: int):
  """One step: loss and gradients of the stack, then Adam on the moments
  chunk by chunk. Arguments ``(w, m_host, v_host, m_dev, v_dev, x)``:
  the first ``groups - tail`` chunks' moments in host memory, the last
  ``tail`` chunks' on the device (empty with ``tail == 0``)."""
  import jax
  import jax.numpy as jnp

  down = lambda a: jax.device_put(a, jax.memory.Space.Device)
  up = lambda a: jax.device_put(a, jax.memory.Space.Host)
  per = layers // groups
  split = (groups - tail) * per  # layers whose moments are in host memory

  def loss(w, x):
    def layer(h, wl):
      return jnp.tanh(h @ wl), None

    h, _ = jax.lax.scan(jax.checkpoint(layer), x, w)
    return jnp.mean(h * h)

  def loss_writing(w, x, m_dev, v_dev):
    """The loss, its first layers' iterations each writing one layer of
    the tail's moments into host buffers."""
    n = m_dev.shape[0]

    def layer(carry, xs):
      h, hm, hv = carry
      wl, i = xs
      h = jax.checkpoint(lambda h, wl: jnp.tanh(h @ wl))(h, wl)
      for buf, src in ((0, m_dev), (1, v_dev)):
        piece = up(jax.lax.dynamic_slice_in_dim(src, i, 1, 0))
        if buf == 0:
          hm = jax.lax.dynamic_update_slice_in_dim(hm, piece, i, 0)
        else:
          hv = jax.lax.dynamic_update_slice_in_dim(hv, piece, i, 0)
      return (h, hm, hv), None

    host_buf = lambda a: up(jnp.zeros_like(a))
    carry = (x, host_buf(m_dev), host_buf(v_dev))
    (h, hm, hv), _ = jax.lax.scan(layer, carry, (w[:n], jnp.arange(n)))
    h, _ = jax.lax.scan(
      jax.checkpoint(lambda h, wl: (jnp.tanh(h @ wl), None)), h, w[n:]
    )
    return jnp.mean(h * h), (hm, hv)

  def step(w, m_host, v_host, m_dev, v_dev, x):
    if variant == "deferred":  # last step's new tail, to host memory now
      m_dev, v_dev = up(m_dev), up(v_dev)
    if variant == "deferred_in_loop":
      (value, (m_dev, v_dev)), g = jax.value_and_grad(
        loss_writing, has_aux=True
      )(w, x, m_dev, v_dev)
    else:
      value, g = jax.value_and_grad(loss)(w, x)
    new_w, new_m, new_v = [], [], []  # new_m, new_v: the device tail
    stored = ()
    for k in range(groups):
      lo = k * per
      on_host = lo < split
      # a host buffer is sliced after the barrier: a slice of host
      # memory is a transfer of its own, which would otherwise start early
      if on_host:
        m_host, v_host, _ = jax.lax.optimization_barrier(
          (m_host, v_host, stored)
        )
        mk, vk = down(m_host[lo : lo + per]), down(v_host[lo : lo + per])
      elif variant.startswith("deferred"):
        m_dev, v_dev, _ = jax.lax.optimization_barrier((m_dev, v_dev, stored))
        i = lo - split
        mk, vk = down(m_dev[i : i + per]), down(v_dev[i : i + per])
      else:
        i = lo - split
        mk, vk = m_dev[i : i + per], v_dev[i : i + per]
      gk = g[lo : lo + per]
      mk = 0.9 * mk + 0.1 * gk
      vk = 0.999 * vk + 0.001 * gk * gk
      new_w.append(w[lo : lo + per] - 1e-3 * mk / (jnp.sqrt(vk) + 1e-8))
      if on_host:  # written into the host buffer in place
        mk, vk = up(mk), up(vk)
        m_host = jax.lax.dynamic_update_slice_in_dim(m_host, mk, lo, 0)
        v_host = jax.lax.dynamic_update_slice_in_dim(v_host, vk, lo, 0)
      else:
        new_m.append(mk)
        new_v.append(vk)
      stored = (mk, vk)
    cat = lambda xs: jnp.concatenate(xs, 0)
    return (
      cat(new_w),
      m_host,
      v_host,
      cat(new_m) if tail else m_dev,
      cat(new_v) if tail else v_dev,
      value,
    )

  return step


def _abstract(mesh, layers, width, batch, groups, tail, host_kind):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  dev = NamedSharding(mesh, P(), memory_kind="device")
  host = NamedSharding(mesh, P(), memory_kind=host_kind)
  per = layers // groups
  n_dev = tail * per
  f32 = jnp.float32
  mat = lambda n, s: jax.ShapeDtypeStruct((n, width, width), f32, sharding=s)
  args = (
    mat(layers, dev),
    mat(layers - n_dev, host),
    mat(layers - n_dev, host),
    mat(n_dev, dev),
    mat(n_dev, dev),
    jax.ShapeDtypeStruct((batch, width), f32, sharding=dev),
  )
  outs = (dev, host, host, dev, dev, dev)
  return args, outs


def _where_started(text: str) -> dict:
  """Per direction, the entry computation's host copies of whole arrays
  (``copy-start``: the deferred tail's writes; the chunks' slices are
  ``dynamic-slice`` / ``dynamic-update-slice`` starts) by where they
  start: before the first layer loop, between loops, after the last."""
  from zerojax._src.diagnostics import schedule
  from zerojax._src.diagnostics.hlo import split_computations

  comps, entry = split_computations(text)
  lines = [line for line in comps[entry] if schedule._INSTR.match(line)]
  loops = [i for i, line in enumerate(lines) if " while(" in line]
  out = {}
  for c in schedule.issued(text):
    if c.kind not in schedule.HOST_KINDS or c.computation != entry:
      continue
    if " copy-start(" not in lines[c.span[0]]:
      continue
    at = c.span[0]
    where = (
      "before_loops"
      if not loops or at < loops[0]
      else "after_loops"
      if at > loops[-1]
      else "between_loops"
    )
    row = out.setdefault(c.kind, {})
    row[where] = row.get(where, 0) + 1
  return out


def _in_bodies(text: str) -> list[dict]:
  """The host copies scheduled inside a loop body (once per iteration),
  each with how it is issued and the matmuls scheduled beside it."""
  from zerojax._src.diagnostics import schedule
  from zerojax._src.diagnostics.hlo import split_computations

  _, entry = split_computations(text)
  return [
    {"kind": c.kind, "mode": c.mode, "matmuls_beside": c.overlapped_matmuls}
    for c in schedule.issued(text)
    if c.kind in schedule.HOST_KINDS and c.computation != entry
  ]


def _record(compiled) -> dict:
  from zerojax._src.diagnostics.schedule import host_copies_across_loops
  from zerojax.diagnostics import host_transfers

  mem = compiled.memory_analysis()
  text = compiled.as_text()
  return {
    "peak_bytes": int(
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      + mem.temp_size_in_bytes
      - mem.alias_size_in_bytes
    ),
    "temp_bytes": int(mem.temp_size_in_bytes),
    "argument_bytes": int(mem.argument_size_in_bytes),
    "host_transfers": host_transfers(text),
    "schedule": host_copies_across_loops(text),
    "whole_copies_started": _where_started(text),
    "loop_body_copies": _in_bodies(text),
  }


def measure(variant, mesh, *, layers, width, batch, groups, tail, gpu=None):
  """One variant compiled (for ``mesh``'s TPU devices, or for ``gpu``
  from a CPU device's mesh) and read back as a record."""
  import jax

  tail = 0 if variant == "offloaded" else tail
  fn = _step(variant, layers, groups, tail)
  shapes, outs = _abstract(
    mesh, layers, width, batch, groups, tail, "pinned_host"
  )
  jitted = jax.jit(fn, out_shardings=outs, donate_argnums=(0, 1, 2, 3, 4))
  if gpu:
    gpu_aot = _gpu_aot()
    compiled = gpu_aot.compile_for_gpu(jitted.trace(*shapes), gpu)
  else:
    compiled = jitted.lower(*shapes).compile()
  return {"variant": variant, "tail_chunks": tail, **_record(compiled)}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--topology", default="v5e:1x1", help="TPU topology")
  p.add_argument("--gpu", default=None, help="compile for this GPU instead")
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--width", type=int, default=4096)
  p.add_argument("--batch", type=int, default=1024)
  p.add_argument("--groups", type=int, default=8)
  p.add_argument("--tail", type=int, default=2, help="chunks kept or deferred")
  p.add_argument("--out", default=str(HERE.parent / "docs" / "data"))
  args = p.parse_args()
  if args.gpu:
    gpu_aot = _gpu_aot()
    gpu_aot.one_cpu_device()
  import jax

  from zerojax import aot

  # Auto axes: the step is written for one device and replicated arrays
  auto = jax.sharding.AxisType.Auto
  if args.gpu:
    mesh = jax.make_mesh(
      (1,), ("data",), devices=jax.devices("cpu")[:1], axis_types=(auto,)
    )
  else:
    mesh = aot.topology_mesh(args.topology, axis_types=(auto,))
  moment_bytes = 4 * args.layers * args.width**2
  runs = []
  for variant in VARIANTS:
    row = measure(
      variant,
      mesh,
      layers=args.layers,
      width=args.width,
      batch=args.batch,
      groups=args.groups,
      tail=args.tail,
      gpu=args.gpu,
    )
    runs.append(row)
    s = row["schedule"]
    print(
      f"{variant:>10}: peak {row['peak_bytes'] / 2**20:8.2f} MiB, "
      f"host {row['host_transfers']}, "
      + " ".join(
        f"{k}: across {s[k]['bytes_across_loops'] / 2**20:.1f} "
        f"outside {s[k]['bytes_outside_loops'] / 2**20:.1f} MiB"
        for k in ("host-to-device", "device-to-host")
        if s
      )
    )
  packages = ("jax", "jaxlib") + (
    ("jax-cuda13-plugin",) if args.gpu else ("libtpu",)
  )
  versions = {k: md.version(k) for k in packages}
  target = args.gpu or args.topology.replace(":", "-")
  backend = f"libtpu{versions['libtpu']}" if not args.gpu else "cuda"
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"deferred_writes_{target}_jax{versions['jax']}_{backend}.json"
  record = {
    "target": target,
    "layers": args.layers,
    "width": args.width,
    "batch": args.batch,
    "groups": args.groups,
    "tail": args.tail,
    "moment_bytes_each": moment_bytes,
    "tail_moment_bytes": 2 * moment_bytes * args.tail // args.groups,
    "versions": versions,
    "runs": runs,
  }
  path.write_text(json.dumps(record, indent=1) + "\n")
  print(path)


if __name__ == "__main__":
  main()
