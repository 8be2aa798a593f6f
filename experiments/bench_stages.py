"""ZeRO stages 0-3 and the GSPMD peers side by side on one GPT.

    python experiments/bench_stages.py                 # writes runs/bench_stages/
    python experiments/bench_stages.py --precision bf16 --width 512

Configurations: zerojax stages 0 (data parallel through zerojax), 1, 2, 3 (append ``b``, e.g.
``3b``, to mark only the scanned blocks as layer stacks, so embeddings and
head may shard their leading dimension), the Optax drop-in ``dropin1``
(an unchanged ``jax.jit`` + ``jax.grad`` + ``tx.update`` loop), and two GSPMD peers
(``experiments/lib/peers.py``): ``fsdp`` (params and optimizer state sharded
with NamedSharding, plain jit), ``zero1`` (params replicated, optimizer
state sharded, plain jit) and ``dp`` (both replicated: plain data
parallelism, what stage 0 stands for). Same model, data, seed, optimizer,
precision. A last table sets each stage beside the alternative a user
would pick (stage 0: ``dp``; 1: ``zero1``; 2-3: ``fsdp``): peak RSS and
step time ratios from the same run, with what explains a time ratio on
CPU: XLA's temp bytes, CPU seconds and page faults per step.
Each runs in its own fresh subprocess (8 fake CPU devices), so its peak RSS
is its own.

``fsdp2`` (on request; needs torch, ``pip install -e '.[bench]'``) is
PyTorch FSDP2 on the same GPT, initial values and batches: 8 torchrun ranks
over gloo (``experiments/lib/fsdp2_peer.py``). Its peak RSS is summed over the
ranks; compare the column "net of runtime" (peak minus the RSS before the
model exists: 8 Python + torch runtimes there, one JAX runtime here).

Output: a markdown table on stdout, ``<out>/bench.json``,
``<out>/memory.png`` (state per device stacked by category, as the ZeRO
paper's Figure 1) and ``<out>/step_time.png``.

``bench.json`` schema: ``{"runs": [run, ...]}``, one run per configuration:

- ``name``, ``config`` ("0".."3", "3b", "dropin1", "fsdp", "zero1"), ``stage`` (int, null for
  peers), ``n_devices``, ``n_params``, ``precision``; ``init``: how the
  zerojax stages built their state (``--init``: ``params``, the README's
  ``zerojax.init(params, tx)`` on params born replicated on the mesh, the
  caller's name still bound; ``params-copy``, the same with
  ``copy=True``; ``from``, ``init_from``); the peers' params are born as
  the stages' are (on the mesh, or on one device for ``from``), and with
  ``params`` the peer's script, too, keeps its name bound: a peer uses
  arrays already laid out as it stores them as they are (as zerojax's
  state holds them), so a replicated peer holds no extra copy and the
  FSDP peer keeps the replicated arrays beside its shards, as stage 3 does
- ``step_time_s``: median over ``--steps`` steps after one warm-up step;
  ``compile_s`` apart; with ``--repeat R``, the median over the R rounds
  of that (every round in ``step_time_s_rounds``)
- ``cpu_s_per_step``, ``minor_faults_per_step``: over the same timed
  steps, the process's CPU seconds (user + system, all device threads)
  and minor page faults; medians over rounds like the step time. XLA CPU
  allocates a run's temp buffer per execution: above glibc's largest mmap
  threshold (32 MiB) it is mapped anew each step and every page of it
  faults in again
- ``peak_rss_bytes``: process peak RSS (all 8 fake devices plus runtime)
  up to the end of the timed steps (before ``zerojax.report`` reads a
  zerojax step and before the checkpoint measurement);
  with ``--repeat``, the median over rounds (``peak_rss_bytes_rounds``);
  ``runtime_rss_bytes``: RSS before the model was built
- ``argument_bytes_per_device``: XLA's argument size for the step;
  ``xla_memory``: XLA's memory analysis (argument, output, temp, alias per
  device; on CPU temp misses buffers inside loop bodies)
- ``state_bytes_per_device`` / ``theory_state_bytes_per_device``: by
  category (params, master, opt_state.<field>), measured from addressable
  shards / the ZeRO formula for the layout
- ``collective_bytes`` / ``collective_elements``: per step by kind, compiled
  HLO, loop bodies times trip counts, full-buffer convention;
  ``theory_collective_elements``: the formula for the layout
- ``final_loss``: after the same steps (all configurations must agree)
- ``fsdp2`` only: ``peak_rss_bytes_per_rank``, ``runtime_rss_bytes_per_rank``,
  ``torch`` (version); collective bytes counted at FSDP2's
  ``torch.distributed`` calls, not from an HLO
- ``checkpoint`` (zerojax stages; null for peers): ``save_s`` (synchronous
  save, for timing), ``restore_s``, ``bytes_on_disk`` and
  ``state_bytes_global`` (the state's bytes, all shards, padding included)

On CPU, XLA runs bf16 collectives in f32, so compare collective *elements*
with theory; bytes are what the CPU program moves.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys


def worker(args) -> dict:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import functools
  import resource
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import zerojax
  from zerojax.app import data, gpt

  # zerojax's path hands the compile heap back after init and after the
  # step's first call (zerojax.launch.release_free_heap), unless switched off
  release = (
    zerojax.launch.release_free_heap
    if args.heap_release != "off"
    else lambda: False
  )
  sys.path.insert(0, str(pathlib.Path(__file__).parent / "lib"))
  import peers

  rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  page = os.sysconf("SC_PAGE_SIZE")

  def mark(name):  # peak and current RSS where each phase ends
    try:  # current RSS: Linux only
      with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * page
    except OSError:
      current = None
    milestones[name] = {"peak": rss(), "current": current}

  milestones = {}
  jax.devices()
  rss_runtime = rss()
  model = gpt.GPTConfig(
    vocab=args.vocab,
    width=args.width,
    depth=args.depth,
    heads=args.heads,
    seq_len=args.seq_len,
  )
  bf16 = args.precision == "bf16"
  optimizer = optax.adamw(1e-3)
  if args.model == "plain":  # a user's plain-JAX GPT: no zerojax.gather
    import plain_gpt

    init_fn = functools.partial(
      plain_gpt.init,
      vocab=args.vocab,
      width=args.width,
      depth=args.depth,
      seq_len=args.seq_len,
    )
    loss_fn = functools.partial(plain_gpt.loss, heads=args.heads)
    gather_mode = "auto"
  else:
    init_fn = functools.partial(gpt.init, model)
    loss_fn = functools.partial(gpt.loss, config=model)
    gather_mode = "model"
  if args.block_dtype:
    # fp32 params, the blocks computed in a lower precision (a common user
    # setup without a master copy): cast inside the loss
    full_loss = loss_fn

    def loss_fn(params, batch):
      params = dict(
        params,
        blocks=jax.tree.map(
          lambda x: x.astype(args.block_dtype), params["blocks"]
        ),
      )
      return full_loss(params, batch)

  key = jax.random.key(0)
  n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(init_fn, key)))
  tokens, _ = data.split(data.corpus_bytes())
  batch_at = lambda i: data.batch_at(
    tokens, seed=0, step=i, batch=args.batch, seq_len=args.seq_len
  )
  mesh = zerojax.make_mesh(
    axis_types={
      "explicit": jax.sharding.AxisType.Explicit,
      "auto": jax.sharding.AxisType.Auto,
    }[args.axis_types]
  )
  shard_bytes = lambda tree: {
    jax.tree_util.keystr(path): int(x.addressable_shards[0].data.nbytes)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }

  def born_on_mesh():
    # a script's params: a jitted init under the mesh, replicated on it
    return jax.jit(
      init_fn,
      out_shardings=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()
      ),
    )(key)

  # the peers' params are born as the zerojax stages' are: on one device
  # for --init from (init_from needs none), on the mesh otherwise
  peer_params = (lambda: init_fn(key)) if args.init == "from" else born_on_mesh
  if args.init != "from":
    # the script's params, bound for the whole run as the zerojax rows'
    # ``params`` are (a peer donates them where it holds them as they are)
    params = born_on_mesh()
    peer_params = lambda: params

  if args.config.rstrip("b").isdigit():  # zerojax stage
    stage = int(args.config.rstrip("b"))
    policy = (
      zerojax.Policy(param_dtype=jnp.bfloat16) if bf16 else zerojax.Policy()
    )
    # "3b": only the scanned blocks are layer stacks, so the embeddings and
    # the head may be sharded along their leading (major) dimension
    stacked = (
      (lambda path, shape: "blocks" in path)
      if args.config.endswith("b")
      else None
    )
    tx = zerojax.zero(
      optimizer, stage=stage, mesh=mesh, policy=policy, stacked=stacked
    )
    if args.init == "from":
      # created sharded under jit: no device ever holds the full model
      state = zerojax.init_from(init_fn, tx, key)
    else:
      # a user's script: params made by a jitted init on the mesh
      # (replicated, as under jax.set_mesh), handed to zerojax.init, and
      # still bound to the name ``params`` for the rest of the run
      state = zerojax.init(params, tx, copy=args.init == "params-copy")
    jax.block_until_ready(state)
    release()
    mark("state")
    step = zerojax.train_step(loss_fn, tx, gather=gather_mode)
    # compiled as the peers' steps are; zerojax.report (state bytes,
    # collectives, XLA memory) runs after the timed steps and the peak RSS,
    # so its own tracing and compiling are not counted against the step
    t0 = time.perf_counter()
    step.lower(state, batch_at(0)).compile()
    compile_s = time.perf_counter() - t0
    mark("compiled")
    run_step = lambda st, b: step(st, b)
    name = f"zerojax stage {stage}" + (" (stacks: blocks)" if stacked else "")
  else:  # a plain-jit loop: the Optax drop-in or a GSPMD peer
    stage, n = None, 8
    if args.config.startswith("dropin"):
      d_stage = int(args.config[-1])
      if bf16:
        raise SystemExit(
          "the drop-in keeps no master copy: use --precision fp32"
        )
      tx = zerojax.zero(optimizer, stage=d_stage, mesh=mesh)
      rep_s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      data_s = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data")
      )
      p = jax.device_put(peer_params(), rep_s)  # a DP loop's params
      o = tx.init(p)

      @jax.jit
      def jitted(params, opt_state, batch):  # the user's own loop
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

      put = lambda b: jax.device_put(b, data_s)
      like, name = 1, f"Optax drop-in, stage {d_stage}"
    else:
      jitted, p, o = peers.make_peer(
        args.config,
        loss_fn,
        optimizer,
        peer_params(),
        mesh,
        compute_dtype=jnp.bfloat16 if bf16 else None,
      )
      put = lambda b: b
      like = {"fsdp": 3, "dp": 0}.get(args.config, 1)
      name = f"GSPMD peer: {args.config}"
    state = (p, o)
    jax.block_until_ready(state)
    release()
    mark("state")
    t0 = time.perf_counter()
    compiled = jitted.lower(p, o, put(batch_at(0))).compile()
    compile_s = time.perf_counter() - t0
    mark("compiled")
    coll_bytes, coll_elems = {}, {}
    colls = zerojax.diagnostics.collectives(compiled.as_text(), n)
    launches = [c.count for c in colls]
    for c in colls:
      coll_bytes[c.kind] = coll_bytes.get(c.kind, 0) + c.total_bytes
      coll_elems[c.kind] = coll_elems.get(c.kind, 0) + c.total_elements

    def run_step(st, b):
      p, o, m = jitted(st[0], st[1], put(b))
      return (p, o), m

    pb, ob = shard_bytes(p), shard_bytes(o)
    measured = {"params": sum(pb.values())}
    for k, v in ob.items():
      cat = (
        "opt_state." + k.split(".")[-1].split("[")[0]
        if "." in k
        else "opt_state"
      )
      measured[cat] = measured.get(cat, 0) + v
    theory_state = {
      "params": 4 * n_params / (n if like == 3 else 1),
      "opt_state.mu": 4 * n_params / (n if like else 1),
      "opt_state.nu": 4 * n_params / (n if like else 1),
    }
    theory_elems = (
      {"reduce-scatter": n_params, "all-gather": 2 * n_params}
      if like == 3
      else {"reduce-scatter": n_params, "all-gather": n_params}
      if like == 1
      else {"all-reduce": n_params}
    )
    mem = compiled.memory_analysis()
    argument = mem.argument_size_in_bytes
    xla_memory = {
      "argument": mem.argument_size_in_bytes,
      "output": mem.output_size_in_bytes,
      "temp": mem.temp_size_in_bytes,
      "alias": mem.alias_size_in_bytes,
    }

  state, metrics = run_step(state, batch_at(0))  # warm-up
  jax.block_until_ready(metrics)
  if args.config.rstrip("b").isdigit():  # a zerojax stage
    release()
  mark("first step")
  times = []
  usage0 = resource.getrusage(resource.RUSAGE_SELF)
  for i in range(1, args.steps + 1):
    t = time.perf_counter()
    state, metrics = run_step(state, batch_at(i))
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t)
  usage1 = resource.getrusage(resource.RUSAGE_SELF)
  peak_rss = rss()  # before the checkpoint phase
  mark("steps")
  if stage is not None:  # zerojax: what the compiled step holds
    rep = zerojax.report(step, state, batch_at(0))
    measured = rep.state_bytes
    theory_state = {
      k: v for k, v in rep.theory_state_bytes.items() if k != "grads"
    }
    coll_bytes, coll_elems = rep.collective_bytes, rep.collective_elements
    theory_elems = rep.theory_collective_elements
    argument = rep.xla_memory["argument"]
    xla_memory = rep.xla_memory
    launches = [c["count"] for c in rep.collectives]
  ckpt_cost = None
  if stage is not None:  # checkpoint cost (zerojax)
    import shutil
    import tempfile

    from zerojax import checkpoint

    where = pathlib.Path(tempfile.mkdtemp(prefix="zerojax_bench_ckpt_"))
    try:
      t = time.perf_counter()
      with checkpoint.Checkpointer(where, async_save=False) as ckpt:
        ckpt.save(state)
      save_s = time.perf_counter() - t
      t = time.perf_counter()
      with checkpoint.Checkpointer(where) as ckpt:
        restored, _ = ckpt.restore(jax.eval_shape(init_fn, key), tx)
        jax.block_until_ready(restored)
      restore_s = time.perf_counter() - t
      disk = sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
      logical = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
      ckpt_cost = {
        "save_s": save_s,
        "restore_s": restore_s,
        "bytes_on_disk": disk,
        "state_bytes_global": logical,
      }
    finally:
      shutil.rmtree(where, ignore_errors=True)
  return {
    "checkpoint": ckpt_cost,
    "name": name
    + (
      ""
      if args.axis_types == "explicit"
      or not (stage is not None or args.config.startswith("dropin"))
      else f" [{args.axis_types}]"
    ),
    "config": args.config,
    "stage": stage,
    "n_devices": 8,
    "init": args.init,
    "axis_types": args.axis_types,
    "n_params": n_params,
    "precision": args.precision,
    "step_time_s": float(np.median(times)),
    "compile_s": compile_s,
    # the timed steps' process CPU seconds (all device threads, user +
    # system) and minor page faults (pages first touched: XLA CPU's
    # buffers above glibc's mmap threshold are mapped anew each run)
    "cpu_s_per_step": (
      usage1.ru_utime - usage0.ru_utime + usage1.ru_stime - usage0.ru_stime
    )
    / args.steps,
    "minor_faults_per_step": (usage1.ru_minflt - usage0.ru_minflt)
    // args.steps,
    "peak_rss_bytes": peak_rss,
    "runtime_rss_bytes": rss_runtime,
    "rss_milestones": milestones,
    "argument_bytes_per_device": argument,
    "xla_memory": xla_memory,
    "state_bytes_per_device": measured,
    "theory_state_bytes_per_device": theory_state,
    "collective_bytes": coll_bytes,
    "collective_elements": coll_elems,
    # collective instructions in the compiled step, and how many times
    # they run per step (a loop body's once per iteration)
    "collective_ops": len(launches),
    "collective_launches": sum(launches),
    "theory_collective_elements": theory_elems,
    "final_loss": float(metrics["loss"]),
  }


def fsdp2(args) -> dict:
  """PyTorch FSDP2 on the same GPT: export the initial params and batches
  (JAX, its own process), then train under torchrun with 8 gloo ranks."""
  import tempfile

  try:
    import torch  # noqa: F401
  except ImportError:
    sys.exit("fsdp2 needs torch: pip install -e '.[bench]' (torch 2.13.0, CPU)")
  script = str(pathlib.Path(__file__).parent / "lib" / "fsdp2_peer.py")
  flags = [
    f"--{k.replace('_', '-')}={getattr(args, k)}"
    for k in (
      "width",
      "vocab",
      "depth",
      "heads",
      "seq_len",
      "batch",
      "steps",
      "precision",
    )
  ]
  if args.block_dtype:
    sys.exit("fsdp2: --block-dtype is not mirrored in the torch model")
  with tempfile.TemporaryDirectory(prefix="zerojax_fsdp2_") as where:
    for cmd in (
      [sys.executable, script, "--export", where],
      [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "8",
        script,
        "--train-from",
        where,
      ],
    ):
      out = subprocess.run(
        cmd + flags, capture_output=True, text=True, check=False
      )
      if out.returncode:
        sys.exit(f"fsdp2 failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def table(runs) -> str:
  from zerojax.app import tables

  mib = lambda x: f"{x / 2**20:,.2f}"
  head = (
    "config",
    "step s",
    "vs stage 0",
    "peak RSS MiB",
    "net of runtime MiB",
    "state MiB/dev (theory)",
    "AR MiB",
    "RS MiB",
    "AG MiB",
    "coll elems / theory",
    "final loss",
  )
  base = next((r["step_time_s"] for r in runs if r["config"] == "0"), None)
  rows = []
  for r in runs:
    state = sum(r["state_bytes_per_device"].values())
    theory = sum(r["theory_state_bytes_per_device"].values())
    cb, ce, te = (
      r["collective_bytes"],
      r["collective_elements"],
      r["theory_collective_elements"],
    )
    ratio = sum(ce.get(k, 0) for k in te) / sum(te.values())
    rows.append(
      (
        r["name"],
        f"{r['step_time_s']:.3f}",
        f"{r['step_time_s'] / base:.2f}x" if base else "",
        mib(r["peak_rss_bytes"]),
        mib(r["peak_rss_bytes"] - r["runtime_rss_bytes"]),
        f"{mib(state)} ({mib(theory)})",
        mib(cb.get("all-reduce", 0)),
        mib(cb.get("reduce-scatter", 0)),
        mib(cb.get("all-gather", 0)),
        f"{ratio:.3f}",
        f"{r['final_loss']:.5f}",
      )
    )
  return tables.markdown(head, rows)


def charts(runs, outdir):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [
    r["name"].replace("zerojax ", "").replace("GSPMD peer: ", "peer ")
    for r in runs
  ]
  cats = sorted({c for r in runs for c in r["state_bytes_per_device"]})
  fig, ax = plt.subplots(figsize=(8, 4))
  bottom = [0.0] * len(runs)
  for cat in cats:
    vals = [r["state_bytes_per_device"].get(cat, 0) / 2**20 for r in runs]
    ax.bar(names, vals, bottom=bottom, label=cat)
    bottom = [b + v for b, v in zip(bottom, vals)]
  ax.set_ylabel("MiB per device (persistent state)")
  ax.set_title("Model state per device by category")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(outdir / "memory.png", dpi=120)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(8, 3.5))
  ax.bar(names, [r["step_time_s"] for r in runs])
  ax.set_ylabel("median step time (s)")
  fig.tight_layout()
  fig.savefig(outdir / "step_time.png", dpi=120)
  plt.close(fig)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--width", type=int, default=256)
  p.add_argument(
    "--vocab",
    type=int,
    default=256,
    help="output classes (the data are bytes; e.g. 50257 for "
    "GPT-2's unstacked head and embedding shapes)",
  )
  p.add_argument("--depth", type=int, default=8)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--precision", choices=["bf16", "fp32"], default="fp32")
  p.add_argument(
    "--model",
    choices=["gpt", "plain"],
    default="gpt",
    help="gpt: zerojax's reference GPT (calls zerojax.gather per "
    "layer); plain: experiments/lib/plain_gpt.py, a plain-JAX "
    "GPT that never calls zerojax (a user who wraps only "
    "the optimizer)",
  )
  p.add_argument(
    "--init",
    choices=["from", "params", "params-copy"],
    default="from",
    help="how the zerojax stages build their state: from: "
    "zerojax.init_from(init_fn, tx, key), built sharded; "
    "params: zerojax.init(params, tx) on params a jitted "
    "init made replicated on the mesh, the name kept bound "
    "for the whole run (a script's way; at stage 3 the "
    "caller's replicated copy then stays alive, as it is "
    "the caller's); params-copy: the same with copy=True "
    "(the state copies, the caller's arrays stay valid). "
    "The peers' params are born as the stages' are: on "
    "one device for from, on the mesh otherwise, where "
    "the peer's script keeps the name bound too (the "
    "FSDP peer then holds the replicated copy beside its "
    "shards, as stage 3 does)",
  )
  p.add_argument(
    "--block-dtype",
    choices=["bfloat16"],
    default=None,
    help="fp32 params cast to this dtype inside the loss for "
    "the transformer blocks (every configuration alike)",
  )
  p.add_argument(
    "--configs",
    default="0,dp,1,zero1,2,3,fsdp,dropin1",
    help="zerojax stages and peers to run: GSPMD fsdp, zero1, dp; "
    "PyTorch FSDP2 fsdp2 (needs the [bench] extra)",
  )
  p.add_argument(
    "--axis-types",
    choices=["explicit", "auto", "both"],
    default="explicit",
    help="the mesh's axis types (jax.make_mesh gives Explicit); "
    "'both' runs each zerojax configuration on each, side "
    "by side, and prints the Explicit / Auto step-time "
    "ratio (peers are GSPMD code: Auto either way)",
  )
  p.add_argument(
    "--repeat",
    type=int,
    default=1,
    help="rounds of every configuration, interleaved (each in "
    "a fresh process); peak RSS and step time are the "
    "medians over rounds (a single process's peak RSS "
    "varies by a few percent from run to run)",
  )
  p.add_argument(
    "--malloc-mmap-threshold",
    type=int,
    default=None,
    metavar="BYTES",
    help="run the workers with glibc's MALLOC_MMAP_THRESHOLD_ "
    "fixed at BYTES: buffers above it are mapped and "
    "unmapped, so freed ones leave the process and peak RSS "
    "follows the live buffers (glibc's default raises the "
    "threshold as buffers are freed and keeps them in its "
    "arenas)",
  )
  p.add_argument(
    "--heap-release",
    choices=["on", "off"],
    default="on",
    help="off: zerojax keeps the C heap's free pages after init "
    "and a step's first call (runtime/host_heap.py), to "
    "measure what handing them back saves",
  )
  p.add_argument("--out", default="runs/bench_stages")
  p.add_argument("--config", help=argparse.SUPPRESS)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  import numpy as np

  if args.worker:
    print(json.dumps(worker(args)))
    return
  runs = []
  repeats: dict[tuple, list] = {}
  for rep in range(args.repeat):  # rounds: every configuration once per round
    for config in args.configs.split(","):
      if config == "fsdp2":
        if rep == 0:
          runs.append(fsdp2(args))
          print(f"{config}: done", file=sys.stderr, flush=True)
        continue
      zerojax_config = config.rstrip("b").isdigit() or config.startswith(
        "dropin"
      )
      kinds = (
        ["auto", "explicit"]
        if args.axis_types == "both" and zerojax_config
        else ["explicit" if args.axis_types == "both" else args.axis_types]
      )
      for kind in kinds:  # side by side: one configuration after the other
        cmd = [
          sys.executable,
          __file__,
          "--worker",
          "--config",
          config,
          f"--axis-types={kind}",
        ] + [
          f"--{k.replace('_', '-')}={v}"
          for k, v in vars(args).items()
          if k
          not in (
            "worker",
            "config",
            "configs",
            "out",
            "axis_types",
            "repeat",
            "malloc_mmap_threshold",
          )
          and v is not None
        ]
        env = (
          None
          if args.malloc_mmap_threshold is None
          else dict(
            os.environ, MALLOC_MMAP_THRESHOLD_=str(args.malloc_mmap_threshold)
          )
        )
        out = subprocess.run(
          cmd, capture_output=True, text=True, check=False, env=env
        )
        if out.returncode:
          sys.exit(f"{config} ({kind}) failed:\n{out.stderr[-3000:]}")
        run = json.loads(out.stdout.strip().splitlines()[-1])
        if (config, kind) not in repeats:
          repeats[(config, kind)] = []
          runs.append(run)
        repeats[(config, kind)].append(run)
        print(
          f"{config} ({kind}) round {rep + 1}: done",
          file=sys.stderr,
          flush=True,
        )
  for r in runs:
    group = repeats.get((r["config"], r.get("axis_types", "explicit")), [])
    if len(group) > 1:  # medians over the rounds; every round kept
      for key in (
        "peak_rss_bytes",
        "step_time_s",
        "cpu_s_per_step",
        "minor_faults_per_step",
      ):
        r[key + "_rounds"] = [g[key] for g in group]
        r[key] = float(np.median(r[key + "_rounds"]))
  outdir = pathlib.Path(args.out)
  outdir.mkdir(parents=True, exist_ok=True)
  import platform

  import jax

  import zerojax

  try:  # the zerojax code measured: its checkout's commit
    commit = subprocess.run(
      ["git", "describe", "--always", "--dirty"],
      capture_output=True,
      text=True,
      cwd=pathlib.Path(zerojax.__file__).parent,
    ).stdout.strip()
  except OSError:
    commit = ""
  meta = {
    "jax_version": jax.__version__,
    "zerojax_commit": commit or None,
    "machine": (
      f"{platform.machine()}, {os.cpu_count()} cores, 8 fake CPU devices"
    ),
    "argv": sys.argv[1:],
    "repeat": args.repeat,
    "malloc_mmap_threshold": args.malloc_mmap_threshold,
    "heap_release": args.heap_release,
    # glibc tunables the workers inherited (e.g. MALLOC_TRIM_THRESHOLD_)
    "malloc_env": {
      k: v for k, v in os.environ.items() if k.startswith("MALLOC_")
    },
  }
  (outdir / "bench.json").write_text(
    json.dumps({**meta, "runs": runs}, indent=2)
  )
  charts(runs, outdir)
  print(
    f"GPT {runs[0]['n_params']:,} params, {args.precision}, AdamW, 8 fake "
    f"CPU devices, batch {args.batch}x{args.seq_len}, median of "
    f"{args.steps} steps, each configuration in its own process"
  )
  print(table(runs))
  for r in runs:
    c = r.get("checkpoint")
    if c:
      print(
        f"{r['name']} checkpoint: save {c['save_s']:.2f} s, restore "
        f"{c['restore_s']:.2f} s, {c['bytes_on_disk'] / 2**20:,.1f} MiB on "
        f"disk for {c['state_bytes_global'] / 2**20:,.1f} MiB of state"
      )
  for r in runs:
    cats = ", ".join(
      f"{k} {v:,} ({r['theory_state_bytes_per_device'].get(k, 0):,.0f})"
      for k, v in r["state_bytes_per_device"].items()
    )
    print(f"{r['name']} bytes/device measured (theory): {cats}")
  if args.axis_types == "both":
    print(axis_type_ratios(runs))
  print(peer_ratios(runs))


# what a user would pick instead of each stage, run in the same bench
PEER_OF = {"0": "dp", "1": "zero1", "2": "fsdp", "3": "fsdp"}


def peer_ratios(runs) -> str:
  """Each zerojax stage against the plain-jit alternative with its layout
  (stage 0: data parallelism; 1: the ZeRO-1 layout; 2-3: FSDP), from the
  same run: peak RSS and step time, zerojax / peer."""
  by = {
    r["config"]: r
    for r in runs
    if r.get("axis_types", "explicit") == "explicit" or r["stage"] is None
  }
  lines = [
    "| stage | peer | peak RSS MiB (peer) | memory ratio | step s "
    "(peer) | time ratio | XLA temp MiB/dev (peer) | CPU s/step "
    "(peer) | page faults/step (peer) |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for stage, peer in PEER_OF.items():
    if stage not in by or peer not in by:
      continue
    z, q = by[stage], by[peer]
    temp = lambda r: r["xla_memory"]["temp"] / 2**20
    cpu = lambda r: (
      f"{r['cpu_s_per_step']:.3f}" if "cpu_s_per_step" in r else "-"
    )
    faults = lambda r: (
      f"{int(r['minor_faults_per_step']):,}"
      if "minor_faults_per_step" in r
      else "-"
    )
    lines.append(
      f"| {stage} | {peer} | {z['peak_rss_bytes'] / 2**20:,.0f} "
      f"({q['peak_rss_bytes'] / 2**20:,.0f}) | "
      f"{z['peak_rss_bytes'] / q['peak_rss_bytes']:.3f} | "
      f"{z['step_time_s']:.3f} ({q['step_time_s']:.3f}) | "
      f"{z['step_time_s'] / q['step_time_s']:.3f} | "
      f"{temp(z):.1f} ({temp(q):.1f}) | {cpu(z)} ({cpu(q)}) | "
      f"{faults(z)} ({faults(q)}) |"
    )
  return "\n".join(lines)


def axis_type_ratios(runs) -> str:
  """Explicit / Auto per zerojax configuration: step time, peak RSS,
  collective bytes (the same program is expected: 1.00 for bytes)."""
  lines = [
    "| config | step s Auto | step s Explicit | Explicit / Auto | "
    "peak RSS ratio | collective bytes ratio |",
    "|---|---|---|---|---|---|",
  ]
  for config in dict.fromkeys(r["config"] for r in runs):
    by = {r["axis_types"]: r for r in runs if r["config"] == config}
    if set(by) != {"auto", "explicit"}:
      continue
    a, e = by["auto"], by["explicit"]
    cb = lambda r: sum(r["collective_bytes"].values())
    lines.append(
      f"| {config} | {a['step_time_s']:.3f} | {e['step_time_s']:.3f} "
      f"| {e['step_time_s'] / a['step_time_s']:.3f} | "
      f"{e['peak_rss_bytes'] / a['peak_rss_bytes']:.3f} | "
      f"{cb(e) / max(cb(a), 1):.3f} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main()
