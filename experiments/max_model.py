"""The largest GPT this machine trains at each ZeRO stage, found by bisection.

    python experiments/max_model.py                      # writes runs/max_model/
    python experiments/max_model.py --cap-gib 4 --width 256 --configs 0,3

Each attempt runs in its own subprocess (8 fake CPU devices): build the
sharded state with ``zerojax.init_from``, two AdamW training steps at batch
8, one checkpoint save (synchronous, Orbax; ``--save lean``, the default:
uncompressed, no replica-parallel host copies) and one eval. A watchdog in this
process reads the child's RSS from ``/proc`` every 20 ms and kills it when
it crosses ``--cap-gib``: that attempt does not fit. The model family is
fixed width and context, growing depth (``--width 1024 --seq-len 64``:
12.6M parameters per layer; the search stops when the first failing
depth is within ``--tolerance`` (3%) of the largest that trains).

For each configuration (stage 0-3 and stage 3 with host offload, in fp32 and
in bf16 params + fp32 master: both 16 bytes per parameter with Adam) the
search starts at the planner's prediction for the same machine -- 8 devices
sharing ``--cap-gib`` of RAM, ``cap / 8`` each: the model state
(:func:`zerojax.plan.plan_gpt`) plus the step's working set
(:func:`zerojax.plan.working_set`) -- and bisects on depth. ``--report
a.json b.json`` merges runs into one table and chart.

Output: a table on stdout, ``<out>/max_model.json`` (every attempt with its
phase-by-phase RSS, and per configuration the largest depth, its parameter
count, peak RSS, step time and the floor) and ``<out>/max_model.png``.

The floor of a run: 8 x the planner's per-device model state (16 Ψ bytes in
all at stage 3; on CPU host and device memory are one RAM, so offload does
not lower it), plus each of the 8 fake devices' working set
(:func:`zerojax.plan.working_set`: at stage 3 two gathered layers in the
compute dtype and the layer's full gradient before its reduce-scatter; the
saved activations and logits), plus the runtime's own RSS measured before
the model exists.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

GIB = 1 << 30
CONFIGS = ("0", "1", "2", "3", "3o")  # "3o": stage 3 + host offload


def child(args) -> dict:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import functools
  import resource
  import tempfile

  import jax
  import jax.numpy as jnp
  import optax

  import zerojax
  from zerojax import checkpoint
  from zerojax.app import data, gpt

  def rss_now():
    for line in open("/proc/self/status"):
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
    return 0

  peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  phases = {}
  mark = lambda name: phases.__setitem__(
    name, {"rss": rss_now(), "peak": peak()}
  )
  jax.devices()
  jnp.zeros(()).block_until_ready()
  mark("runtime")
  stage = int(args.config[0])
  model = gpt.GPTConfig(
    vocab=256,
    width=args.width,
    depth=args.depth,
    heads=max(1, args.width // 128),
    seq_len=args.seq_len,
  )
  policy = (
    zerojax.Policy(param_dtype=jnp.bfloat16)
    if args.precision == "bf16"
    else zerojax.Policy()
  )
  tx = zerojax.zero(
    optax.adamw(1e-4),
    stage=stage,
    policy=policy,
    offload=args.config.endswith("o"),
  )
  key = jax.random.key(0)
  init_fn = functools.partial(gpt.init, model)
  state = zerojax.init_from(init_fn, tx, key)
  jax.block_until_ready(state)
  mark("init")
  tokens, held_out = data.split(data.corpus_bytes())
  batch_at = lambda i, t=tokens: data.batch_at(
    t, seed=0, step=i, batch=args.batch, seq_len=args.seq_len
  )
  loss_fn = functools.partial(gpt.loss, config=model)
  step = zerojax.train_step(loss_fn, tx)
  times, losses = [], []
  for i in range(args.steps):
    t = time.perf_counter()
    state, metrics = step(state, batch_at(i))
    losses.append(float(metrics["loss"]))
    times.append(time.perf_counter() - t)
    mark(f"step{i + 1}")
  where = tempfile.mkdtemp(prefix="zerojax_max_model_")
  t = time.perf_counter()
  lean = dict(compression=False, replica_parallel=False)
  with checkpoint.Checkpointer(
    where, async_save=False, **(lean if args.save == "lean" else {})
  ) as ckpt:
    ckpt.save(state)
  save_s = time.perf_counter() - t
  mark("save")
  import shutil

  shutil.rmtree(where, ignore_errors=True)
  eval_loss = float(
    zerojax.eval_step(loss_fn, tx)(state, batch_at(0, held_out))
  )
  mark("eval")
  return {
    "n_params": gpt.num_params(model),
    "phases": phases,
    "step_s": times,
    "losses": losses,
    "save_s": save_s,
    "eval_loss": eval_loss,
    "peak_rss": peak(),
    "runtime_rss": phases["runtime"]["rss"],
    "state_bytes": int(
      sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    ),
  }


def floor(config: str, precision: str, depth: int, runtime: int, args) -> float:
  """The least RSS a run can have: 8 x (the planner's model state per
  device + the step's working set) + the runtime measured before the model."""
  import jax.numpy as jnp

  from zerojax import Policy, plan
  from zerojax.app import gpt

  policy = Policy(param_dtype=jnp.bfloat16) if precision == "bf16" else Policy()
  cfg = gpt.GPTConfig(
    vocab=256,
    width=args.width,
    depth=depth,
    heads=max(1, args.width // 128),
    seq_len=args.seq_len,
  )
  stage = int(config[0])
  per_device = plan.plan_gpt(
    plan.abstract_gpt(cfg), stage, 8, policy=policy
  ).total + plan.working_set(cfg, stage, args.batch // 8, policy, n_devices=8)
  return 8 * per_device + runtime


def predicted_depth(
  config: str, precision: str, args, working: bool = True
) -> int:
  """The planner's largest depth: model state (plus, with ``working``, the
  step's working set, :func:`zerojax.plan.working_set`) within cap / 8 per
  device."""
  import jax.numpy as jnp

  from zerojax import Policy, plan
  from zerojax.app import gpt

  policy = Policy(param_dtype=jnp.bfloat16) if precision == "bf16" else Policy()
  budget = args.cap_gib * GIB / 8
  stage = int(config[0])

  def fits(depth):
    cfg = gpt.GPTConfig(
      vocab=256,
      width=args.width,
      depth=depth,
      heads=max(1, args.width // 128),
      seq_len=args.seq_len,
    )
    # on CPU host memory is the same RAM: offload's host bytes count too
    need = plan.plan_gpt(plan.abstract_gpt(cfg), stage, 8, policy=policy).total
    if working:
      need += plan.working_set(cfg, stage, args.batch // 8, policy, n_devices=8)
    return need <= budget

  lo, hi = 0, 1
  while fits(hi):
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def attempt(config: str, precision: str, depth: int, args) -> dict:
  """One child run under the RSS watchdog."""
  cmd = [
    sys.executable,
    __file__,
    "--child",
    "--config",
    config,
    "--precision",
    precision,
    "--depth",
    str(depth),
    "--width",
    str(args.width),
    "--seq-len",
    str(args.seq_len),
    "--batch",
    str(args.batch),
    "--steps",
    str(args.steps),
    "--save",
    args.save,
  ]
  env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).parents[1]))
  t0 = time.perf_counter()
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
  )
  cap, seen, killed = args.cap_gib * GIB, 0, None
  status = pathlib.Path(f"/proc/{proc.pid}/status")
  while proc.poll() is None:
    try:
      rss = next(
        int(l.split()[1]) * 1024
        for l in status.read_text().splitlines()
        if l.startswith("VmRSS:")
      )
    except (OSError, StopIteration, ValueError):
      rss = 0
    seen = max(seen, rss)
    if rss > cap:
      proc.kill()
      killed = f"RSS {rss / GIB:.2f} GiB > cap {args.cap_gib} GiB"
      break
    if time.perf_counter() - t0 > args.timeout:
      proc.kill()
      killed = f"timeout {args.timeout} s"
      break
    time.sleep(0.02)
  out, err = proc.communicate()
  row = {
    "config": config,
    "precision": precision,
    "depth": depth,
    "wall_s": time.perf_counter() - t0,
    "watchdog_peak_rss": seen,
  }
  if killed or proc.returncode != 0:
    row.update(fits=False, why=killed or err.strip().splitlines()[-1][:300])
    return row
  row.update(json.loads(out.strip().splitlines()[-1]), fits=True)
  return row


def search(config, precision, args, log, start=None) -> dict:
  pred = predicted_depth(config, precision, args)
  tried = {}

  def fits(d):
    if d not in tried:
      r = attempt(config, precision, d, args)
      tried[d] = r
      log(r)
    return tried[d]["fits"]

  lo, hi = 0, None  # lo fits (0: nothing yet), hi fails
  d = max(1, start or pred)
  step = max(1, round(0.06 * d))
  close = lambda: hi is not None and hi - lo <= max(1, args.tolerance * lo)
  while len(tried) < args.max_attempts:
    if fits(d):
      lo = d
      if hi is None:
        d += step
        step *= 2  # widen the bracket geometrically
        continue
    else:
      hi = d
      if lo == 0 and d > 1:
        d = max(1, d - step)
        step *= 2
        if d in tried:
          break
        continue
    if hi is None or close():
      break
    d = (lo + hi) // 2
  best = tried.get(lo)
  return {
    "config": config,
    "precision": precision,
    "predicted_depth": pred,
    "largest_depth": lo or None,
    "first_failing_depth": hi,
    "resolved": close(),
    "largest": best,
    "attempts": list(tried.values()),
  }


def predicted_params(depth, args):
  from zerojax.app import gpt

  return gpt.num_params(
    gpt.GPTConfig(
      vocab=256,
      width=args.width,
      depth=depth,
      heads=max(1, args.width // 128),
      seq_len=args.seq_len,
    )
  )


def table(results, args) -> str:
  lines = [
    "| config | precision | largest Ψ (depth) | first failing depth | "
    "planner Ψ: state / + working set | measured / planner (+ws) | "
    "peak RSS GiB | floor GiB | peak / floor | step s |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    b = r["largest"]
    name = (
      "stage 3 + offload" if r["config"] == "3o" else f"stage {r['config']}"
    )
    state = predicted_params(
      predicted_depth(r["config"], r["precision"], args, working=False), args
    )
    pred = predicted_params(
      predicted_depth(r["config"], r["precision"], args), args
    )
    if b is None:
      lines.append(
        f"| {name} | {r['precision']} | none fits | - | "
        f"{state / 1e6:,.0f}M / {pred / 1e6:,.0f}M | - | - | - | - | - |"
      )
      continue
    low = floor(
      r["config"], r["precision"], r["largest_depth"], b["runtime_rss"], args
    )
    lines.append(
      f"| {name} | {r['precision']} | {b['n_params'] / 1e6:,.1f}M "
      f"({r['largest_depth']}) | {r['first_failing_depth']} | "
      f"{state / 1e6:,.1f}M / {pred / 1e6:,.1f}M | "
      f"{b['n_params'] / state:.3f} ({b['n_params'] / pred:.3f}) | "
      f"{b['peak_rss'] / GIB:.2f} | {low / GIB:.2f} | "
      f"{b['peak_rss'] / low:.3f} | {b['step_s'][-1]:.1f} |"
    )
  return "\n".join(lines)


def chart(results, path, args):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [
    ("3+off" if r["config"] == "3o" else r["config"]) + "\n" + r["precision"]
    for r in results
  ]
  got = [
    (r["largest"]["n_params"] if r["largest"] else 0) / 1e6 for r in results
  ]
  pred = [
    predicted_params(predicted_depth(r["config"], r["precision"], args), args)
    / 1e6
    for r in results
  ]
  x = range(len(results))
  fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(results)), 4))
  ax.bar(
    [i - 0.2 for i in x], got, 0.4, label="measured (trains under the cap)"
  )
  ax.bar(
    [i + 0.2 for i in x],
    pred,
    0.4,
    label="planner (model state + working set, cap / 8 per device)",
  )
  ax.set_xticks(list(x), names)
  ax.set_ylabel("parameters (millions)")
  ax.set_title(
    f"Largest GPT under {args.cap_gib:g} GiB, 8 fake CPU devices "
    f"(width {args.width}, context {args.seq_len}, batch {args.batch})"
  )
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--cap-gib",
    type=float,
    default=20.0,
    help="memory cap: an attempt whose RSS crosses it is killed",
  )
  p.add_argument(
    "--configs",
    default=",".join(CONFIGS),
    help="stages to search; '3o' is stage 3 with host offload",
  )
  p.add_argument("--precisions", default="fp32,bf16")
  p.add_argument("--width", type=int, default=1024)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=2)
  p.add_argument(
    "--save",
    choices=("lean", "orbax"),
    default="lean",
    help="checkpoint writes: lean (Checkpointer(compression="
    "False, replica_parallel=False): no host copies) or "
    "orbax (its defaults: zstd, replica-parallel)",
  )
  p.add_argument(
    "--max-attempts", type=int, default=6, help="attempts per configuration"
  )
  p.add_argument(
    "--start",
    type=int,
    default=None,
    help="first depth to try (default: the planner's)",
  )
  p.add_argument(
    "--tolerance",
    type=float,
    default=0.03,
    help="stop when the first failing depth is within this "
    "fraction of the largest fitting one",
  )
  p.add_argument(
    "--timeout",
    type=float,
    default=1800,
    help="seconds before an attempt is killed",
  )
  p.add_argument("--out", default="runs/max_model")
  p.add_argument(
    "--report",
    nargs="+",
    metavar="JSON",
    help="no search: print the table and draw the chart of "
    "max_model.json files already written (merged)",
  )
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--config", default="3", help=argparse.SUPPRESS)
  p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
  p.add_argument("--depth", type=int, default=1, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print(json.dumps(child(args)))
    return
  if args.report:
    runs = [json.loads(pathlib.Path(f).read_text()) for f in args.report]
    for k in ("cap_gib", "width", "seq_len", "batch"):
      setattr(args, k, runs[0]["args"][k])
    results = [r for run in runs for r in run["results"]]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(table(results, args))
    chart(results, out / "max_model.png", args)
    (out / "max_model.json").write_text(
      json.dumps({"args": runs[0]["args"], "results": results}, indent=1)
    )
    print(f"wrote {out / 'max_model.json'} and {out / 'max_model.png'}")
    return
  bad = [c for c in args.configs.split(",") if c not in CONFIGS]
  if bad:
    p.error(f"--configs: {bad} not in {CONFIGS}")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)

  def log(r):
    status = "fits" if r["fits"] else f"does not fit ({r['why']})"
    peak = r.get("peak_rss", r["watchdog_peak_rss"]) / GIB
    print(
      f"  {r['config']:>2} {r['precision']} depth {r['depth']:>3}: {status}; "
      f"peak {peak:.2f} GiB, {r['wall_s']:.0f} s",
      flush=True,
    )

  results = []
  for precision in args.precisions.split(","):
    for config in args.configs.split(","):
      print(f"stage {config} {precision}: searching", flush=True)
      # offload on CPU: the same RAM, so start from stage 3's answer
      start = next(
        (
          r["largest_depth"]
          for r in results
          if config == "3o"
          and r["config"] == "3"
          and r["precision"] == precision
        ),
        args.start,
      )
      results.append(search(config, precision, args, log, start))
      (out / "max_model.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1)
      )
  print(table(results, args))
  chart(results, out / "max_model.png", args)
  print(f"wrote {out / 'max_model.json'} and {out / 'max_model.png'}")


if __name__ == "__main__":
  main()
