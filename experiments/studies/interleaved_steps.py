"""Step time of a zerojax stage and its GSPMD peer in one process, interleaved.

    python experiments/studies/interleaved_steps.py                 # the plain GPT
    python experiments/studies/interleaved_steps.py --pairs 0:dp --rounds 8
    python experiments/studies/interleaved_steps.py --pairs 0:dp,0/nonorm:dp

A pair is ``STAGE[/nonorm]:PEER``: ``/nonorm`` builds the zerojax step with
``grad_norm=False`` (no gradient-norm metric, as the peers compute none).
``control:PEER`` times the peer against a second, separately compiled copy
of itself in the zerojax slot: how far from 1.0 two identical programs land
on this machine, the resolution of every other ratio.

``bench_stages.py`` runs every configuration in a process of its own; on a
shared 2-core machine its step times move by a few percent from process to
process, more than a 1-2% difference between a stage and its peer. Here
each pair (``stage:peer``) runs in one fresh process: both compiled and
warmed up, then ``--rounds`` rounds of ``--steps`` steps each, alternating
which goes first, so both see the same machine. Same model, optimizer,
batches and 8 fake CPU devices as ``bench_stages.py --model plain``
(a plain-JAX GPT, no zerojax call); the state is built by
``zerojax.init_from``, the peer's params on one device.

Writes ``<out>`` (JSON): per pair every step time, the medians and
``ratio`` = the stage's median / the peer's; XLA's per-device flops and
bytes accessed of both compiled programs (``bytes_accessed_ratio``: a
figure of the programs, free of the machine's noise); the JAX version, the
machine, the zerojax commit.
"""

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time


def worker(args) -> dict:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import jax
  import numpy as np
  import optax

  import zerojax

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))
  import peers
  import plain_gpt

  stage, peer = args.pair.split(":")
  stage, _, variant = stage.partition("/")
  if variant not in ("", "nonorm") or not (
    stage.isdigit() or stage == "control"
  ):
    raise SystemExit(
      f"--pairs: {args.pair!r}: use STAGE[/nonorm]:PEER or control:PEER"
    )
  init_fn, loss_fn, batches = plain_gpt.from_flags(args, args.steps)
  mesh = zerojax.make_mesh()
  key = jax.random.key(0)

  def peer_runner():
    step, p, o = peers.make_peer(
      peer, loss_fn, optax.adamw(1e-3), init_fn(key), mesh
    )

    def call(state, b):
      p, o, m = step(*state, b)
      return (p, o), m

    return call, (lambda state, b: step.lower(*state, b)), (p, o)

  if stage == "control":
    # the peer against a second, separately compiled copy of itself: the
    # ratio two identical programs show here (the harness's noise floor)
    first = peer_runner()
  else:
    tx = zerojax.zero(optax.adamw(1e-3), stage=int(stage), mesh=mesh)
    step = zerojax.train_step(loss_fn, tx, grad_norm=variant != "nonorm")
    first = (step, step.lower, zerojax.init_from(init_fn, tx, key))
  runners = {"zerojax": first, "peer": peer_runner()}
  box = {k: r[2] for k, r in runners.items()}

  def run(which, b):
    box[which], m = runners[which][0](box[which], b)
    jax.block_until_ready(m)

  for which in box:  # compile and warm up
    run(which, batches[0])
  programs = {k: runners[k][1](box[k], batches[0]) for k in box}
  cost = {k: _cost(v.compile()) for k, v in programs.items()}
  times = {"zerojax": [], "peer": []}
  for r in range(args.rounds):
    for which in ("zerojax", "peer") if r % 2 == 0 else ("peer", "zerojax"):
      for b in batches:
        t = time.perf_counter()
        run(which, b)
        times[which].append(time.perf_counter() - t)
  med = {k: float(np.median(v)) for k, v in times.items()}
  return {
    "pair": args.pair,
    "stage": None if stage == "control" else int(stage),
    "peer": peer,
    "grad_norm": variant != "nonorm",
    "step_times_s": times,
    "median_s": med,
    "ratio": med["zerojax"] / med["peer"],
    "xla_cost_per_device": cost,
    "bytes_accessed_ratio": cost["zerojax"]["bytes accessed"]
    / cost["peer"]["bytes accessed"],
  }


def _cost(compiled) -> dict:
  """XLA's count of one device's flops and bytes read and written."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return {k: float(cost[k]) for k in ("flops", "bytes accessed")}


def main():
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))
  import plain_gpt

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--pairs", default="0:dp,1:zero1,2:fsdp,3:fsdp")
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--steps", type=int, default=4, help="steps per round")
  plain_gpt.add_size_flags(p)
  p.add_argument("--out", default="runs/interleaved_steps.json")
  p.add_argument("--pair", help=argparse.SUPPRESS)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    print(json.dumps(worker(args)))
    return
  runs = []
  for pair in args.pairs.split(","):
    cmd = [
      sys.executable,
      __file__,
      "--worker",
      "--pair",
      pair,
      f"--rounds={args.rounds}",
      f"--steps={args.steps}",
      *plain_gpt.size_argv(args),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    r = runs[-1]
    print(
      f"{r['pair']}: {r['median_s']['zerojax']:.3f}"
      f" s vs {r['median_s']['peer']:.3f} s, ratio {r['ratio']:.3f}; "
      f"bytes accessed {r['bytes_accessed_ratio']:.3f}x",
      flush=True,
    )
  import jax

  import zerojax

  commit = subprocess.run(
    ["git", "describe", "--always", "--dirty"],
    capture_output=True,
    text=True,
    cwd=pathlib.Path(zerojax.__file__).parent,
  ).stdout.strip()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(
    json.dumps(
      {
        "jax_version": jax.__version__,
        "zerojax_commit": commit or None,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"8 fake CPU devices",
        "argv": sys.argv[1:],
        "runs": runs,
      },
      indent=1,
    )
  )


if __name__ == "__main__":
  main()
