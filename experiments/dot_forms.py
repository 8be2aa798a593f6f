"""The weight-gradient dots of stages 0 and 1 against their peers', on XLA CPU.

    python experiments/dot_forms.py

Autodiff gives ``x @ W``'s weight gradient as ``transpose(dot)``. XLA CPU
folds such a transpose into the dot, and the folded dot (transposed
operands) runs on Eigen, which allocates its packing buffers on every
call, instead of in a YNNPACK fusion. A plain ``jax.jit`` loop escapes it
by accident: GSPMD's gradient all-reduce sits between the dot and the
transpose. ``zerojax/_src/jaxpr/transposes.py`` rewrites the gradient
program: at stage 0 the sum moves before the transpose, as GSPMD has it;
at stages 1-3 an ``optimization_barrier`` keeps the transpose out of the
dot.

Six configurations of the plain GPT of ``bench_stages.py --model plain``,
each in a fresh process (8 fake CPU devices): the plain ``jit`` loop
(``peers.make_peer("dp")``), zerojax stage 0, stage 0 without the rewrite
(replaced by the identity), the ZeRO-1 layout (``peers.make_peer("zero1")``),
stage 1, and stage 1 without the rewrite. For each, twice: under glibc's
default allocator settings, and with its mmap threshold fixed at 1 MiB
(``MALLOC_MMAP_THRESHOLD_``), where every buffer of 1 MiB or more a step
allocates is mapped afresh and its pages counted as faults.

Writes ``<out>`` (JSON): per configuration and allocator setting the
compiled step's dots left out of fusions (``unfused_dots``), in the
traced zerojax step the sums over devices fed by a transpose and the
transposes fed by a dot, the page faults per step (``ru_minflt``, the
median of ``--steps``), the median step time, the peak RSS (the zerojax
rows also trace the step once more, to count: compare peak RSS with
``bench_stages.py``, not here); the JAX version, the machine, the zerojax
commit.
"""

import argparse
import json
import os
import pathlib
import platform
import re
import resource
import subprocess
import sys
import time

CONFIGS = (
  "dp",
  "stage0",
  "stage0-without-rewrite",
  "zero1",
  "stage1",
  "stage1-without-rewrite",
)


def worker(args) -> dict:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import jax
  import numpy as np
  import optax

  import zerojax

  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  import peers
  import plain_gpt

  init_fn, loss_fn, batches = plain_gpt.from_flags(args, args.steps + 1)
  mesh = zerojax.make_mesh()
  key = jax.random.key(0)
  params = jax.jit(
    init_fn,
    out_shardings=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()
    ),
  )(key)
  out = {"config": args.config}
  if not args.config.startswith("stage"):
    jitted, p, o = peers.make_peer(
      args.config, loss_fn, optax.adamw(1e-3), params, mesh
    )
    compiled = jitted.lower(p, o, batches[0]).compile()
    box = [(p, o)]

    def run(b):
      p, o, m = jitted(*box[0], b)
      box[0] = (p, o)
      return m
  else:
    from zerojax._src.jaxpr import transposes

    if args.config.endswith("-without-rewrite"):
      transposes.rewrite_for_dots = lambda fn, **rules: fn
    tx = zerojax.zero(optax.adamw(1e-3), stage=int(args.config[5]), mesh=mesh)
    step = zerojax.train_step(loss_fn, tx)
    box = [zerojax.init(params, tx)]
    traced = step.trace(box[0], batches[0]).jaxpr.jaxpr
    out["sums_of_transposes"] = transposes.count_sums_of_transposes(traced)
    out["transposed_dots"] = transposes.count_transposed_dots(traced)
    compiled = step.lower(box[0], batches[0]).compile()

    def run(b):
      box[0], m = step(box[0], b)
      return m

  out["unfused_dots"] = len(
    re.findall(r"^\s+%[\w.\-]+ = \S+ dot\(", compiled.as_text(), re.M)
  )
  jax.block_until_ready(run(batches[0]))  # the first call
  faults, times = [], []
  for b in batches[1:]:
    f0, t0 = (
      resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
      time.perf_counter(),
    )
    jax.block_until_ready(run(b))
    times.append(time.perf_counter() - t0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
  out.update(
    faults_per_step=float(np.median(faults)),
    faults=faults,
    step_time_s=float(np.median(times)),
    step_times_s=times,
    peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  )
  return out


def main():
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  import plain_gpt

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  plain_gpt.add_size_flags(p)
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
  p.add_argument("--out", default="docs/data/dot_forms_plain_jax{jax}.json")
  args = p.parse_args()
  if args.config:
    print(json.dumps(worker(args)))
    return
  import jax

  runs = []
  for malloc in ("default", "mmap_threshold_1MiB"):
    env = dict(os.environ)
    if malloc != "default":
      env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
    for config in CONFIGS:
      cmd = [
        sys.executable,
        __file__,
        "--config",
        config,
        f"--steps={args.steps}",
        *plain_gpt.size_argv(args),
      ]
      res = subprocess.run(
        cmd, env=env, capture_output=True, text=True, check=True
      )
      run = json.loads(res.stdout.strip().splitlines()[-1])
      run["malloc"] = malloc
      runs.append(run)
      print(
        f"{malloc:20s} {config:24s} unfused dots {run['unfused_dots']:2d}"
        f"  faults/step {run['faults_per_step']:9,.0f}"
        f"  step {run['step_time_s']:.3f} s"
        f"  peak RSS {run['peak_rss_bytes'] / 2**20:,.0f} MiB",
        flush=True,
      )
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
  ).stdout.strip()
  path = pathlib.Path(args.out.format(jax=jax.__version__))
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(
    json.dumps(
      {
        "model": {
          k: v for k, v in vars(args).items() if k not in ("config", "out")
        },
        "devices": 8,
        "jax": jax.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "zerojax_commit": commit,
        "runs": runs,
      },
      indent=1,
    )
    + "\n"
  )
  print("wrote", path)


if __name__ == "__main__":
  main()
