"""Stage 0's weight-gradient dots against the plain loop's, on XLA CPU.

    python experiments/dot_forms.py

At stage 0 the backward pass sums each weight's gradient over the devices
where JAX differentiates the loss's implicit ``pvary``: after the
transpose autodiff adds to ``x @ W``'s weight gradient. XLA CPU folds that
transpose into the dot, and the folded dot runs on Eigen, which allocates
its packing buffers on every call, instead of in a YNNPACK fusion. GSPMD's
all-reduce in a plain ``jax.jit`` loop sits before the transpose.
``zerojax/_src/jaxpr/transposes.py`` moves the sum there too.

Three configurations of the plain GPT of ``bench_stages.py --model
plain``, each in a fresh process (8 fake CPU devices): the plain ``jit``
loop (``peers.make_peer("dp")``), zerojax stage 0, and zerojax stage 0
with the sums left after the transposes (the pass replaced by the
identity). For each, twice: under glibc's default allocator settings, and
with its mmap threshold fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_``), where
every buffer of 1 MiB or more a step allocates is mapped afresh and its
pages counted as faults.

Writes ``<out>`` (JSON): per configuration and allocator setting the
compiled step's dots left out of fusions (``unfused_dots``), its sums over
devices fed by a transpose in the jaxpr (zerojax only), the page faults
per step (``ru_minflt``, the median of ``--steps``), the median step time,
the peak RSS (the zerojax rows also trace the step once more, to count
its sums: compare peak RSS with ``bench_stages.py``, not here); the JAX
version, the machine, the zerojax commit.
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

CONFIGS = ("dp", "stage0", "stage0-sum-after-transpose")


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
  params = jax.jit(init_fn, out_shardings=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))(key)
  out = {"config": args.config}
  if args.config == "dp":
    jitted, p, o = peers.make_peer("dp", loss_fn, optax.adamw(1e-3), params,
                                   mesh)
    compiled = jitted.lower(p, o, batches[0]).compile()
    box = [(p, o)]

    def run(b):
      p, o, m = jitted(*box[0], b)
      box[0] = (p, o)
      return m
  else:
    if args.config == "stage0-sum-after-transpose":
      from zerojax._src.jaxpr import transposes
      transposes.rewrite_for_dots = lambda fn, **rules: fn
    from zerojax._src.jaxpr.transposes import count_sums_of_transposes
    tx = zerojax.zero(optax.adamw(1e-3), stage=0, mesh=mesh)
    step = zerojax.train_step(loss_fn, tx)
    box = [zerojax.init(params, tx)]
    out["sums_of_transposes"] = count_sums_of_transposes(
        step.trace(box[0], batches[0]).jaxpr.jaxpr)
    compiled = step.lower(box[0], batches[0]).compile()

    def run(b):
      box[0], m = step(box[0], b)
      return m
  out["unfused_dots"] = len(re.findall(r"^\s+%[\w.\-]+ = \S+ dot\(",
                                       compiled.as_text(), re.M))
  jax.block_until_ready(run(batches[0]))          # the first call
  faults, times = [], []
  for b in batches[1:]:
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    jax.block_until_ready(run(b))
    times.append(time.perf_counter() - t0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
  out.update(faults_per_step=float(np.median(faults)), faults=faults,
             step_time_s=float(np.median(times)), step_times_s=times,
             peak_rss_bytes=resource.getrusage(
                 resource.RUSAGE_SELF).ru_maxrss * 1024)
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
      cmd = [sys.executable, __file__, "--config", config,
             f"--steps={args.steps}", *plain_gpt.size_argv(args)]
      res = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           check=True)
      run = json.loads(res.stdout.strip().splitlines()[-1])
      run["malloc"] = malloc
      runs.append(run)
      print(f"{malloc:20s} {config:28s} unfused dots {run['unfused_dots']:2d}"
            f"  faults/step {run['faults_per_step']:9,.0f}"
            f"  step {run['step_time_s']:.3f} s"
            f"  peak RSS {run['peak_rss_bytes'] / 2**20:,.0f} MiB", flush=True)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
  path = pathlib.Path(args.out.format(jax=jax.__version__))
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({
      "model": {k: v for k, v in vars(args).items() if k not in ("config", "out")},
      "devices": 8, "jax": jax.__version__, "machine": platform.machine(),
      "cpus": os.cpu_count(), "zerojax_commit": commit, "runs": runs},
      indent=1) + "\n")
  print("wrote", path)


if __name__ == "__main__":
  main()
