"""The optimizer update on the host's CPU cores, against streaming it.

Two ways to keep the fp32 master copy and Adam's moments in host memory:

* **host-side update** (ZeRO-Offload): the device sends its compute-dtype
  gradients down, the host's cores run the update, the new compute-dtype
  params go back up: 2 bytes per parameter each way, and the host's update
  on the step's critical path (the next forward needs its params; hiding it
  means a one-step-delayed update, which changes the numbers);
* **streamed update** (zerojax's ``offload=``): the state comes down to the
  device in chunks and goes back, 12 bytes per parameter each way with an
  fp32 master copy (8 with fp32 params, whose copy is the device's), both
  directions and the device's update at once.

This script measures what decides between them on the machine it runs on:
the host's update throughput (the GPU bench's optimizer, clip + AdamW,
jitted for the CPU backend over ``--params`` fp32 parameters in leaves of
``--leaf`` elements: a state far beyond the caches, so the time is the
memory's and scales with the parameter count) and, where an accelerator is
present, the link (copies of ``--link-mib`` between pinned host memory and
the device, each way, and both ways at once). Without an accelerator the
link is the stated ``--link-gb-s``. It then prices one step of each path
at ``--at`` parameters (default: the GPU bench's 2.7B model):

    host, serial      2Ψ/down + Ψ/throughput + 2Ψ/up
    host, pipelined   max(2Ψ/down, Ψ/throughput, 2Ψ/up)   (chunks in flight)
    streamed          B·Ψ / both-ways bandwidth (B = 12 or 8 bytes)

    python experiments/studies/host_update.py                    # writes runs/host_update/
    python experiments/studies/host_update.py --params 268435456 # a larger state

Output: a table on stdout and ``<out>/host_update.json`` with the device,
the host's cores and CPU model, JAX's version and every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

GPU_BENCH_2_7B = 2_427_052_032  # gpu_bench.py's 2.7b model


def _cpu_model() -> str:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def _median_s(fn, reps: int) -> float:
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def host_throughput(n_params: int, leaf: int, reps: int) -> dict:
  """The bench's optimizer on the CPU backend: params per second."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  cpu = jax.devices("cpu")[0]
  sizes = [leaf] * (n_params // leaf) + (
    [n_params % leaf] if n_params % leaf else []
  )
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.1)
  )
  rng = np.random.default_rng(0)
  params = [
    jax.device_put(rng.standard_normal(s, np.float32), cpu) for s in sizes
  ]
  grads = [
    jax.device_put(rng.standard_normal(s, np.float32).astype(jnp.bfloat16), cpu)
    for s in sizes
  ]
  state = jax.jit(tx.init)(params)  # on the CPU device, where params are

  def update(params, state, grads):
    # the host's update: compute-dtype gradients in, compute-dtype params out
    grads = [g.astype(jnp.float32) for g in grads]
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return params, state, [p.astype(jnp.bfloat16) for p in params]

  update = jax.jit(update, donate_argnums=(0, 1))
  held = {"params": params, "state": state}

  def once():
    p, s, out = update(held["params"], held["state"], grads)
    jax.block_until_ready(out)
    held["params"], held["state"] = p, s

  once()  # compile
  seconds = _median_s(once, reps)
  return {
    "params": n_params,
    "leaves": len(sizes),
    "update_s": seconds,
    "params_per_s": n_params / seconds,
  }


# bytes an AdamW update moves per parameter on the host: bf16 gradient in,
# fp32 param and two moments read and written, bf16 param out
ADAM_BYTES = 2 + 12 + 12 + 2


def memory_bandwidth(mib: int, reps: int) -> float:
  """The host's memory bandwidth in GB/s: numpy's ``a += b`` over two
  ``mib`` arrays (read, read, write), best of ``reps``. An update kernel
  that only waits on memory runs at ``this / ADAM_BYTES`` params per s."""
  import numpy as np

  a = np.ones((mib << 20) // 4, np.float32)
  b = np.ones_like(a)
  best = min(_median_s(lambda: np.add(a, b, out=a), 1) for _ in range(reps))
  return 3 * a.nbytes / best / 1e9


def link_bandwidth(mib: int, reps: int) -> dict | None:
  """Copies between pinned host memory and the first accelerator, in GB/s
  (None without one)."""
  import jax
  import jax.numpy as jnp

  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return None
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  n = (mib << 20) // 4
  a_dev = jax.device_put(jnp.ones((n,), jnp.float32), on_dev)
  a_host = jax.device_put(a_dev, host)
  b_dev = jax.device_put(a_host, on_dev)
  jax.block_until_ready((a_host, b_dev))
  nbytes = n * 4

  def both():
    jax.block_until_ready(
      (jax.device_put(a_host, on_dev), jax.device_put(b_dev, host))
    )

  down = _median_s(
    lambda: jax.block_until_ready(jax.device_put(a_host, on_dev)), reps
  )
  up = _median_s(
    lambda: jax.block_until_ready(jax.device_put(a_dev, host)), reps
  )
  both_s = _median_s(both, reps)
  return {
    "bytes": nbytes,
    "host_to_device_gb_s": nbytes / down / 1e9,
    "device_to_host_gb_s": nbytes / up / 1e9,
    "both_ways_gb_s_each": nbytes / both_s / 1e9,
  }


def price(
  n: int, params_per_s: float, h2d: float, d2h: float, both: float
) -> dict:
  """Seconds per step of each path at ``n`` parameters (bandwidths in GB/s,
  host to device, device to host, and each way when both run at once)."""
  g = 1e9
  grads_down, params_up = 2 * n / (d2h * g), 2 * n / (h2d * g)
  update = n / params_per_s
  return {
    "host_serial_s": grads_down + update + params_up,
    "host_pipelined_s": max(grads_down, update, params_up),
    "host_update_s": update,
    "streamed_master_s": 12 * n / (both * g),
    "streamed_fp32_s": 8 * n / (both * g),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
    "--params",
    type=int,
    default=1 << 27,
    help="fp32 params updated on the host",
  )
  p.add_argument("--leaf", type=int, default=1 << 22, help="elements per leaf")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--link-mib", type=int, default=1024)
  p.add_argument(
    "--link-gb-s",
    type=float,
    default=50.0,
    help="stated link, each way, without an accelerator",
  )
  p.add_argument(
    "--at", type=int, default=GPU_BENCH_2_7B, help="params to price a step at"
  )
  p.add_argument("--out", default="runs/host_update")
  args = p.parse_args()

  import jax

  host = host_throughput(args.params, args.leaf, args.reps)
  host["memory_gb_s"] = memory_bandwidth(1024, args.reps)
  host["memory_bound_params_per_s"] = host["memory_gb_s"] * 1e9 / ADAM_BYTES
  link = link_bandwidth(args.link_mib, args.reps)
  if link is None:
    down = up = both = args.link_gb_s
    link_source = f"stated: {args.link_gb_s:g} GB/s each way, both ways at once"
  else:
    down, up = link["host_to_device_gb_s"], link["device_to_host_gb_s"]
    both = link["both_ways_gb_s_each"]
    link_source = "measured"
  record = {
    "device": str(jax.devices()[0].device_kind),
    "platform": jax.devices()[0].platform,
    "jax_version": jax.__version__,
    "host_cores": os.cpu_count(),
    "host_cpu": _cpu_model(),
    "argv": sys.argv[1:],
    "host_update": host,
    "link": link,
    "link_source": link_source,
    "at_params": args.at,
    "per_step": price(args.at, host["params_per_s"], down, up, both),
    "per_step_memory_bound": price(
      args.at, host["memory_bound_params_per_s"], down, up, both
    ),
  }
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "host_update.json").write_text(json.dumps(record, indent=1))
  s, m = record["per_step"], record["per_step_memory_bound"]
  print(
    f"host ({record['host_cores']} cores, {record['host_cpu']}): "
    f"{host['params_per_s'] / 1e6:,.1f}M params/s ({host['update_s'] * 1e3:.0f} ms "
    f"for {args.params:,})\nlink ({link_source}): {down:.1f} down, {up:.1f} up, "
    f"{both:.1f} each way at once (GB/s)\nper step at {args.at:,} params: "
    f"host update {s['host_serial_s']:.2f} s serial, {s['host_pipelined_s']:.2f} s "
    f"pipelined; streamed {s['streamed_master_s']:.2f} s (fp32 master) / "
    f"{s['streamed_fp32_s']:.2f} s (fp32 params)\nhost memory "
    f"{host['memory_gb_s']:.1f} GB/s: an update at that speed "
    f"({host['memory_bound_params_per_s'] / 1e6:,.0f}M params/s) would take "
    f"{m['host_pipelined_s']:.2f} s pipelined"
  )


if __name__ == "__main__":
  main()
