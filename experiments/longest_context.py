"""ZeRO-R on one accelerator: the longest context each remat policy trains.

    python experiments/longest_context.py                 # ~1B, batch 1, GPU
    python experiments/longest_context.py --size tiny --start 64 --max 1024

For the reference GPT at batch 1 (``1b``: width 2048, depth 16, bf16
compute, AdamW, zerojax stage 3 on one device, the backend's attention:
cuDNN's fused kernel on GPU) and each remat policy (``dots``, ``full``,
``offload``: the layer inputs in pinned host memory), doubles the context
from ``--start`` until a step fails (out of memory), then bisects to
``--granularity`` tokens. Every attempt runs in its own process, so
``memory_stats()["peak_bytes_in_use"]`` is its own.

Per attempt: whether two steps ran, the median step time, the device peak,
the compiled program's planned device bytes (``memory_analysis()``:
arguments + outputs + temp - aliases) and host temp bytes, the planner's
saved activations (:func:`zerojax.plan.gpt_activations`) and
``peak / planned`` -- ZeRO-R's MD: how far the allocator's peak sits above
what XLA's static buffer assignment planned. ``--allocator`` runs the
children with another allocator setting (``XLA_PYTHON_CLIENT_ALLOCATOR`` /
``XLA_PYTHON_CLIENT_PREALLOCATE``) to measure what closes that gap.

JSON lines on stdout; ``<out>/longest_context.json`` with the device name
and JAX version.
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
  "1b": dict(width=2048, depth=16, heads=16),
  "tiny": dict(width=64, depth=2, heads=2),
}
POLICIES = ("dots", "full", "offload")
ALLOCATORS = {
  "default": {},
  "platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
  "no-prealloc": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
}


def run_one(size: str, policy: str, seq_len: int, steps: int) -> dict:
  """Trains ``steps`` steps at this context in this process."""
  import jax
  import numpy as np
  import optax

  import zerojax
  from zerojax import plan
  from zerojax.app import gpt

  s = SIZES[size]
  model = gpt.GPTConfig(
    vocab=256,
    seq_len=seq_len,
    width=s["width"],
    depth=s["depth"],
    heads=s["heads"],
    remat=policy,
    compute_dtype="bfloat16",
  ).resolved()
  device = jax.devices()[0]
  rec = {
    "size": size,
    "policy": policy,
    "seq_len": seq_len,
    "batch": 1,
    "device_kind": device.device_kind,
    "platform": device.platform,
    "jax_version": jax.__version__,
    "attention": model.attention,
    "n_params": gpt.num_params(model),
    "planner_saved": plan.gpt_activations(model, 1),
  }
  rng = np.random.default_rng(0)
  batches = [
    {
      "x": rng.integers(0, 256, (1, seq_len)).astype(np.int32),
      "y": rng.integers(0, 256, (1, seq_len)).astype(np.int32),
    }
    for _ in range(steps + 1)
  ]
  tx = zerojax.zero(
    optax.adamw(1e-4), stage=3, mesh=zerojax.make_mesh(devices=[device])
  )
  state = zerojax.init_from(lambda k: gpt.init(model, k), tx, jax.random.key(0))
  step = zerojax.train_step(
    lambda p, b: gpt.loss(p, b, model), tx, gather="model"
  )
  compiled = step.lower(state, batches[0]).compile()
  m = compiled.memory_analysis()
  if m is not None:
    rec["planned_bytes"] = int(
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      + m.temp_size_in_bytes
      - m.alias_size_in_bytes
    )
    rec["planned_host_temp_bytes"] = int(
      getattr(m, "host_temp_size_in_bytes", 0)
    )
  times = []
  for i, b in enumerate(batches):
    t = time.perf_counter()
    state, out = step(state, b)
    jax.block_until_ready(out)
    if i:
      times.append(time.perf_counter() - t)
  rec["step_s"] = statistics.median(times)
  rec["loss"] = float(out["loss"])
  stats = device.memory_stats() or {}
  rec["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  if rec.get("planned_bytes") and rec["peak_bytes_in_use"]:
    rec["peak_vs_planned"] = rec["peak_bytes_in_use"] / rec["planned_bytes"]
  rec["ok"] = True
  return rec


def attempt(args, policy: str, seq_len: int) -> dict:
  env = dict(os.environ, **ALLOCATORS[args.allocator])
  try:
    proc = subprocess.run(
      [
        sys.executable,
        __file__,
        "--one",
        args.size,
        policy,
        str(seq_len),
        "--steps",
        str(args.steps),
      ],
      capture_output=True,
      text=True,
      env=env,
      timeout=args.timeout,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RECORD ")]
    err = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
  except subprocess.TimeoutExpired:
    lines, err = [], f"timed out after {args.timeout} s"
  if lines:
    rec = json.loads(lines[-1][7:])
  else:
    rec = {
      "size": args.size,
      "policy": policy,
      "seq_len": seq_len,
      "ok": False,
      "error": err,
    }
  rec["allocator"] = args.allocator
  print(json.dumps(rec), flush=True)
  return rec


def longest(args, policy: str, records: list, save) -> int | None:
  """Doubling, then bisection on multiples of ``--granularity``.

  ``save()`` runs after every attempt, so a run cut short by its lease
  still leaves each finished attempt in the data file.
  """
  g = args.granularity
  lo, hi, t = None, None, args.start
  while t <= args.max:
    r = attempt(args, policy, t)
    records.append(r)
    save()
    if not r["ok"]:
      hi = t
      break
    lo, t = t, t * 2
  if lo is None or hi is None:
    return lo
  while hi - lo > g:
    mid = (lo + hi) // 2 // g * g
    if mid in (lo, hi):
      break
    r = attempt(args, policy, mid)
    records.append(r)
    save()
    lo, hi = (mid, hi) if r["ok"] else (lo, mid)
  return lo


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", default="1b", choices=sorted(SIZES))
  p.add_argument("--policies", default=",".join(POLICIES))
  p.add_argument("--start", type=int, default=8192)
  p.add_argument("--max", type=int, default=1 << 20)
  p.add_argument("--granularity", type=int, default=2048)
  p.add_argument("--steps", type=int, default=2)
  p.add_argument("--allocator", default="default", choices=sorted(ALLOCATORS))
  p.add_argument(
    "--timeout",
    type=int,
    default=540,
    help="seconds per attempt (a timed-out attempt fails)",
  )
  p.add_argument("--out", default="runs/longest_context")
  p.add_argument(
    "--one",
    nargs=3,
    metavar=("SIZE", "POLICY", "SEQ_LEN"),
    help=argparse.SUPPRESS,
  )
  args = p.parse_args()
  if args.one:
    size, policy, seq_len = args.one
    print(
      "RECORD " + json.dumps(run_one(size, policy, int(seq_len), args.steps)),
      flush=True,
    )
    return
  records, table = [], {}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  summary = {
    "longest_context": table,
    "allocator": args.allocator,
    "complete": False,
  }

  def save():
    (out / "longest_context.json").write_text(
      json.dumps({"summary": summary, "attempts": records}, indent=2)
    )

  for policy in args.policies.split(","):
    table[policy] = longest(args, policy, records, save)
  summary["complete"] = True
  save()
  print(json.dumps(summary), flush=True)
  print(f"wrote {out / 'longest_context.json'}")


if __name__ == "__main__":
  main()
