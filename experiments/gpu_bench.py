"""One accelerator: a plain jitted Optax loop beside zerojax stages 0-3.

The same GPT (fp32 params, bf16 compute, the backend's fast attention and
remat policy), batch and AdamW in every configuration; each configuration
runs in its own process so that ``memory_stats()["peak_bytes_in_use"]`` is
its own. Per configuration: compile time, median step time over
``--steps`` timed steps (after two warm-up steps), tokens/s, MFU
(``6 N + 12 L T D`` flops per token over the chip's dense bf16 peak), peak
device memory, and the compiled program's planned bytes
(``memory_analysis()``). Prints one JSON line per configuration and writes
``<out>/gpu_bench.json`` with the device name and JAX version.

    python experiments/gpu_bench.py                       # ~1B and ~2.7B
    python experiments/gpu_bench.py --sizes tiny --steps 3 # the code path, CPU

Sizes: ``1b`` = width 2048, depth 16, context 2048, batch 8; ``2.7b`` =
width 4096, depth 12, context 2048, batch 4; ``3.5b`` = depth 16 of the
same (out of device memory for the plain loop on one H100); ``tiny`` for a
CPU run; ``7b`` = width 4096, depth 32, context 2048, batch 4 (its Adam
state, 16 bytes per parameter, is what 128 GiB of host memory holds).

A configuration is ``plain`` or a stage, then options joined by ``+``:
``offload`` (the master copy and optimizer state in host memory,
``zero(..., offload=True)``), ``offload=0.5`` (that share of it),
``params`` (stage 3's parameter shards in host memory too,
``offload_params=True``), ``cross`` (the streamed update's crossing
order, ``zerojax._src.step.offload.crossing_waits``: a chunk comes down
while the one before goes back), ``whole`` (each layer stack streamed
as one chunk, not a few layers per chunk: ``zerojax._src.step.offload._by_rows``
off), ``unordered`` (no chunk's loads wait for another's stores: the
compiler places every host copy), ``grads`` (the reduced gradients in host memory too,
``offload_grads=True``; behind ``clip_by_global_norm`` the norm is
computed first and each gradient comes down twice, ``--clip leaf``
measures it without; with ``accumN`` the micro-batches' sums are kept
there too), ``accum4`` (4 micro-batches per step, the batch
4x as large; ``plain+accum4`` is the plain loop's baseline for it). An
offloaded record adds init's own device peak and the host bytes it holds;
``step_vs_plain`` compares with the plain loop at the same size and
accumulation. Every record has the loss of each step (``losses``) and
whether it fell (``loss_fell``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

SIZES = {
  "1b": dict(width=2048, depth=16, heads=16, seq_len=2048, batch=8),
  "2.7b": dict(width=4096, depth=12, heads=32, seq_len=2048, batch=4),
  "3.5b": dict(width=4096, depth=16, heads=32, seq_len=2048, batch=4),
  "7b": dict(width=4096, depth=32, heads=32, seq_len=2048, batch=4),
  "tiny": dict(width=64, depth=2, heads=2, seq_len=64, batch=4),
}
CONFIGS = ("plain", "0", "1", "2", "3", "3+offload")


def parse_config(config: str) -> dict:
  """``"3+offload=0.5+params+accum4"`` -> the run's options."""
  head, *opts = config.split("+")
  if head != "plain" and head not in "0123":
    raise SystemExit(f"config {config!r}: starts with plain or a stage 0-3")
  out = dict(
    stage=None if head == "plain" else int(head),
    offload=False,
    offload_params=False,
    offload_grads=False,
    accum=1,
    cross=False,
    whole=False,
    unordered=False,
  )
  for opt in opts:
    if opt == "offload":
      out["offload"] = True
    elif opt.startswith("offload="):
      out["offload"] = float(opt.split("=", 1)[1])
    elif opt == "params":
      out["offload_params"] = True
    elif opt == "grads":
      out["offload_grads"] = True
    elif opt in ("cross", "whole", "unordered"):
      out[opt] = True
    elif opt.startswith("accum") and opt[5:].isdigit():
      out["accum"] = int(opt[5:])
    else:
      raise SystemExit(
        f"config {config!r}: unknown option {opt!r} (offload, offload=SHARE, "
        "params, grads, accumN, cross, whole, unordered)"
      )
  if out["stage"] is None and (out["offload"] or out["offload_params"]):
    raise SystemExit(f"config {config!r}: the plain loop has no offload")
  if out["offload_grads"] and out["offload"] is not True:
    raise SystemExit(f"config {config!r}: grads needs +offload")
  return out


def configure(size: str, config: str, platform: str | None = None):
  """``(shapes, options, GPT config)`` of a run: the size's shapes, the
  configuration's options (setting the stream's switches they name) and
  the GPT, its attention and remat resolved for ``platform``."""
  from zerojax._src.step import offload as _stream
  from zerojax.app import gpt

  s = SIZES[size]
  opts = parse_config(config)
  if opts["cross"]:
    _stream._waits = _stream.crossing_waits
  if opts["whole"]:
    _stream._by_rows = False
  if opts["unordered"]:
    _stream._waits = _unordered_waits
  model = gpt.GPTConfig(
    vocab=256,
    seq_len=s["seq_len"],
    width=s["width"],
    depth=s["depth"],
    heads=s["heads"],
    compute_dtype="bfloat16",
  ).resolved(platform)
  return s, opts, model


def _unordered_waits(sizes):
  """A stream whose chunks' loads wait for nothing: the compiler places
  every host copy where it likes (whether it starts any of them before
  the passes end)."""
  return (None,) * len(sizes), (None,) * len(sizes)


def plain_step_fn(loss_fn, opt, accum: int):
  """The plain loop's step: ``(params, opt_state), batch -> (new, loss)``,
  the batch split into ``accum`` micro-batches whose gradients are
  averaged."""
  import jax
  import jax.numpy as jnp
  import optax

  def loss_and_grads(params, batch):
    if accum == 1:
      return jax.value_and_grad(loss_fn)(params, batch)
    micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

    def add(total, b):
      loss, grads = jax.value_and_grad(loss_fn)(params, b)
      return jax.tree.map(jnp.add, total, (loss, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), params))
    total, _ = jax.lax.scan(add, zeros, micro)
    return jax.tree.map(lambda x: x / accum, total)

  def plain_step(carry, batch):
    params, opt_state = carry
    loss, grads = loss_and_grads(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return plain_step


def run_one(
  size: str, config: str, steps: int, warmup: int = 100, clip: str = "global"
) -> dict:
  """Runs one configuration in this process; returns its record."""
  import jax
  import numpy as np

  import zerojax
  from zerojax.app import data, gpt, mfu

  s, opts, model = configure(size, config)
  accum = opts["accum"]
  device = jax.devices()[0]
  n_params = gpt.num_params(model)
  tokens, _ = data.split(data.corpus_bytes())
  # one batch, every step: the timings do not depend on the data, and the
  # loss on a repeated batch falls step by step where training works
  batches = [
    data.batch_at(
      tokens, seed=0, step=0, batch=accum * s["batch"], seq_len=s["seq_len"]
    )
  ] * (steps + 2)
  opt = _optimizer(warmup, clip)
  loss_fn = lambda p, b: gpt.loss(p, b, model)
  key = jax.random.key(0)

  if opts["stage"] is None:
    params = jax.jit(lambda k: gpt.init(model, k))(key)
    opt_state = jax.jit(opt.init)(params)

    plain_step = plain_step_fn(loss_fn, opt, accum)
    step = jax.jit(plain_step, donate_argnums=0)
    state = (params, opt_state)
    call = lambda state, b: step(state, b)
    lowered = step.lower(state, batches[0])
  else:
    mesh = zerojax.make_mesh(devices=[device])
    tx = zerojax.zero(
      opt,
      stage=opts["stage"],
      mesh=mesh,
      offload=opts["offload"],
      offload_params=opts["offload_params"],
      offload_grads=opts["offload_grads"],
    )
    state = zerojax.init_from(lambda k: gpt.init(model, k), tx, key)
    zstep = zerojax.train_step(loss_fn, tx, gather="model", accum_steps=accum)
    call = lambda state, b: zstep(state, b)
    lowered = zstep.lower(state, batches[0])
  after_init = dict(device.memory_stats() or {})
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  planned = compiled.memory_analysis()
  times, losses = [], []
  for i, b in enumerate(batches):
    t = time.perf_counter()
    state, out = call(state, b)
    jax.block_until_ready(out)
    if i >= 2:
      times.append(time.perf_counter() - t)
    losses.append(
      float(np.asarray(out["loss"] if isinstance(out, dict) else out))
    )
  step_s = statistics.median(times)
  tokens_per_s = accum * s["batch"] * s["seq_len"] / step_s
  stats = device.memory_stats() or {}
  on_host = opts["stage"] is not None and (
    opts["offload"] or opts["offload_params"]
  )
  host_plan = (
    zerojax.cost.plan_stage(
      jax.eval_shape(lambda: gpt.init(model, key)),
      opts["stage"],
      mesh=dict(mesh.shape),
      optimizer=opt,
      policy=zerojax.Policy(),
      offload=opts["offload"],
      offload_params=opts["offload_params"],
      offload_grads=opts["offload_grads"],
    )
    if on_host
    else None
  )
  return {
    "size": size,
    "config": config,
    "n_params": n_params,
    "device_kind": device.device_kind,
    "platform": device.platform,
    "jax_version": jax.__version__,
    "attention": model.attention,
    "remat": model.remat,
    "batch": accum * s["batch"],
    "accum_steps": accum,
    "warmup_steps": warmup,
    "clip": clip,
    "seq_len": s["seq_len"],
    "compile_s": compile_s,
    "step_s": step_s,
    "steps_timed": len(times),
    "tokens_per_s": tokens_per_s,
    "mfu": mfu.mfu(
      tokens_per_s, gpt.flops_per_token(model, n_params), [device]
    ),
    "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
    # init's own peak (before any step) and what the state then holds
    "init_peak_bytes": after_init.get("peak_bytes_in_use"),
    "state_bytes_in_use": after_init.get("bytes_in_use"),
    "host_bytes": (
      None
      if opts["stage"] is None
      else zerojax.diagnostics.memory_bytes(state).get("pinned_host", 0)
    ),
    "planned_bytes": None
    if planned is None
    else int(
      planned.argument_size_in_bytes
      + planned.output_size_in_bytes
      + planned.temp_size_in_bytes
      - planned.alias_size_in_bytes
    ),
    # where the GPU compiler put the host copies (offloaded configs), and
    # the planner's bytes each way beside them
    "host_schedule": None if not on_host else _host_schedule(compiled, mesh),
    "planned_host_traffic": (
      None
      if not on_host
      else {
        "host_to_device": host_plan.host_to_device,
        "device_to_host": host_plan.device_to_host,
      }
    ),
    # the planner's device bytes of model state (params, gradients, the
    # streamed update's chunks in flight; no activations), beside the peak
    "planned_device_state": None if not on_host else host_plan.device,
    # how the update streams (chunks, layer stacks by rows)
    "offload_stream": _offload_stream(state) if on_host else None,
    "losses": losses,
    "final_loss": losses[-1],
    "loss_fell": losses[-1] < losses[0],
  }


def _host_schedule(compiled, mesh) -> dict:
  """Where the compiler put the host copies; a reader failure on this JAX
  is recorded in the row (``error``) rather than losing the row's timings."""
  import zerojax

  keys = ("host_transfers", "issued", "host_copies_across_loops")
  try:
    report = zerojax.aot.compiled_report(compiled, mesh)
  except Exception as e:  # noqa: BLE001 - recorded, not hidden
    return {"error": f"{type(e).__name__}: {e}"[:300]}
  return {k: v for k, v in report.items() if k in keys}


def _offload_stream(state) -> dict:
  from zerojax._src.diagnostics import offload_stream

  return offload_stream.describe(state.spec)


def _optimizer(warmup: int, clip: str = "global"):
  """Clipped AdamW with a linear warm-up from 0 to 1e-4 at step ``warmup``:
  the same in every configuration, so each timing is also a training run.
  ``clip``: ``"global"`` (the gradients' global norm at 1.0) or ``"leaf"``
  (each leaf's RMS at 1.0, ``optax.clip_by_block_rms``: an update that
  reads each leaf's gradient alone, as ``offload_grads`` asks).
  On the repeated batch the loss falls at 1B and 2.7B with 100 warm-up
  steps (1e-4 from the first step diverged at 2.7B); at 7B the first
  step at that rate overshoots and 1000 warm-up steps fall."""
  import optax

  return optax.chain(
    optax.clip_by_global_norm(1.0)
    if clip == "global"
    else optax.clip_by_block_rms(1.0),
    optax.adamw(
      optax.linear_schedule(0.0, 1e-4, warmup),
      weight_decay=0.1,
    ),
  )


def _run_child(size: str, config: str, args) -> dict:
  """One configuration in a fresh process (its own device peak)."""
  cmd = [sys.executable, __file__, "--one", size, config]
  cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
  cmd += ["--clip", args.clip]
  return child_record(cmd, size, config, args.timeout)


def child_record(cmd: list, size: str, config: str, timeout: int) -> dict:
  """Runs ``cmd`` (one configuration's process); returns the record it
  printed (``RECORD {...}``) or, if none, its error."""
  try:
    proc = subprocess.run(
      cmd,
      capture_output=True,
      text=True,
      env=dict(os.environ),
      timeout=timeout,
    )
  except subprocess.TimeoutExpired:
    return {
      "size": size,
      "config": config,
      "error": f"timed out after {timeout} s",
    }
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RECORD ")]
  if lines:
    return json.loads(lines[-1][7:])
  # the exception's own line, not JAX's note on filtered frames after it
  errs = [
    l
    for l in proc.stderr.splitlines()
    if l and not l[0].isspace() and "Error" in l.split(":")[0]
  ]
  return {
    "size": size,
    "config": config,
    "error": (errs or proc.stderr.strip().splitlines() or ["?"])[-1][:300],
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default="1b,2.7b")
  p.add_argument("--configs", default=",".join(CONFIGS))
  p.add_argument("--steps", type=int, default=10)
  p.add_argument(
    "--warmup",
    type=int,
    default=100,
    help="steps of the linear warm-up to the peak rate 1e-4",
  )
  p.add_argument(
    "--clip",
    choices=("global", "leaf"),
    default="global",
    help="every configuration's clip: the global norm, or each leaf's RMS "
    "(what +grads needs)",
  )
  p.add_argument("--out", default="runs/gpu_bench")
  p.add_argument(
    "--timeout",
    type=int,
    default=300,
    help="seconds per configuration (a timed-out one records an error)",
  )
  p.add_argument(
    "--one", nargs=2, metavar=("SIZE", "CONFIG"), help=argparse.SUPPRESS
  )
  args = p.parse_args()
  for config in args.configs.split(","):
    parse_config(config)  # a typo fails here, not after an hour of runs
  if args.one:
    print(
      "RECORD "
      + json.dumps(run_one(*args.one, args.steps, args.warmup, args.clip)),
      flush=True,
    )
    return
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  records = []
  for size in args.sizes.split(","):
    for config in args.configs.split(","):
      rec = _run_child(size, config, args)
      print(json.dumps(rec), flush=True)
      records.append(rec)
      # written after every configuration, so a run cut short keeps its rows
      (out / "gpu_bench.json").write_text(json.dumps(records, indent=2))
  # the plain loop at the same size and accumulation is each run's baseline
  key = lambda r: (r["size"], parse_config(r["config"])["accum"])
  plain = {
    key(r): r
    for r in records
    if r["config"].split("+")[0] == "plain" and "error" not in r
  }
  for r in records:
    base = plain.get(key(r))
    if base and "error" not in r and base is not r:
      r["step_vs_plain"] = r["step_s"] / base["step_s"]
      if r.get("peak_bytes_in_use") and base.get("peak_bytes_in_use"):
        r["peak_vs_plain"] = r["peak_bytes_in_use"] / base["peak_bytes_in_use"]
  (out / "gpu_bench.json").write_text(json.dumps(records, indent=2))
  print(f"wrote {out / 'gpu_bench.json'}")


if __name__ == "__main__":
  main()
