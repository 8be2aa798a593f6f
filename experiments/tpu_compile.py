"""zerojax's stages beside the GSPMD peers, compiled for a TPU topology.

The TPU compiler (libtpu: ``pip install -e '.[tpu]'``) compiles for a
named topology from this CPU machine; nothing is allocated (abstract state
and batch, ``zerojax.aot``). Per configuration, in a fresh process each:
the compiler's per-device memory plan (peak = arguments + outputs + temp -
aliases) beside zerojax's planner (the state plus the saved activations,
``working_set``), collectives per step by kind and mesh axis (full-buffer bytes,
loop trip counts applied), how each collective is issued in the scheduled
program (synchronous, or asynchronous with the matmuls it overlaps; a loop
body's collective counted once: ``zerojax._src.diagnostics.schedule``),
and the compile time. The model is ``plain_gpt.py`` (a GPT written
without zerojax: zerojax walks its scan per layer) or, with ``--model
gpt``, zerojax's reference GPT (``zerojax.app.gpt``: it gathers per layer
itself); AdamW, fp32 params and state for every configuration but
``3offb`` / ``3offp`` (bf16 params, fp32 master copy). The peers (``peers.py``): ``fsdp`` (params
and state sharded over ``data``, plain ``jit``) and ``zero1`` (state
sharded), as MaxText and Flax users write them, and ``dropin`` (the
``zero1`` loop with zerojax's Optax drop-in at stage 1 as its optimizer).

    python experiments/tpu_compile.py --topology v5e:2x2 \\
        --width 512 --depth 4 --vocab 8192 --seq-len 256 --batch-per-chip 2

writes ``docs/data/tpu_compile_<topology>_<model>_jax<v>_libtpu<v>.json``
(``--out`` for another folder). Across slices (``--num-slices 2 --mesh
replica=2,data=4``: the replica axis over the data-center network) the
configurations are zerojax's stages and ``3pp`` (stage 3 with ZeRO++'s
hierarchical qgZ int8 and hpZ, nodes = one slice's chips); each run
records the bytes per mesh axis beside the planner's. ``--buffers N``
adds each program's N largest device-memory allocations and the shapes
of the values that share them (``largest_buffers``, from XLA's
memory-usage report in a ``--xla_dump_to`` folder; the report lists
allocations, not the temp figure's split).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "lib"))
import xla_live

CONFIGS = (
  "1",
  "2",
  "3",
  "fsdp",
  "zero1",
  "dropin",
  "3off",
  "3off50",
  "3off-serial",
  "3off-cross",
  "3off-whole",
  "3offb-whole",
  "3offp-whole",
  "3offb",
  "3offp",
  "3offbg",
  "3offpg",
  "3offbc",
  "3offbgc",
  "3offpc",
  "3offpgc",
  "3offb-finite",
  "3offbg-finite",
  "3offb-finite-all",
  "3offbgc-finite",
  "3offbg-cfinite",
  "1-free",
  "3-free",
  "3off-free",
  "1split",
  "1split-free",
  "3split",
  "3split-free",
)
ZEROPP = "3pp"  # stage 3 + hierarchical qgZ int8 + hpZ (one slice)
# "<stage>off": the stage with offload=True (master and moments on the
# host); "<stage>off50": offload=0.5 (half their bytes, in whole arrays or leaves);
# "<stage>off-serial": offload=True with the streamed update's chunks run
# one after another (each chunk's loads wait for the previous chunk's
# stores: no chunk prefetched), to compare with the prefetching stream;
# "<stage>off-cross": offload=True with the crossing stream (a chunk the
# default keeps serial comes down while the one before goes back);
# "<config>-whole": that offloaded configuration with each layer stack
# streamed as one chunk (the default streams a stack larger than every
# whole leaf a few layers per chunk: zerojax._src.step.offload_rows);
# "<stage>offb": offload=True with bf16 params and an fp32 master copy;
# "<stage>offp": the same and offload_params=True (the params' shards in
# host memory too, each layer brought down before its gather);
# "<stage>offbg" / "<stage>offpg": those with offload_grads=True (the
# reduced gradients in host memory, each chunk's brought down with it);
# "<offloaded config>c": that configuration behind clip_by_global_norm
# (with offload_grads the norm is computed first, each gradient brought
# down whole in turn);
# "<config>-finite": that configuration's optimizer, clip included, inside
# optax.apply_if_finite; "-finite-all": with the branch read as one
# equation (the whole-state update); "<config>-cfinite": the optimizer
# inside apply_if_finite behind clip_by_global_norm (the finiteness of the
# clipped gradients: with offload_grads, two passes over them first);
# "<config>-free": that configuration with the update free to start before
# the last gradient exists (zerojax's step waits for all of them), to
# compare the compiler's peaks; "<stage>split": the step as a user's own
# jit (donating the state) around zerojax.value_and_grad and
# zerojax.apply_gradients


def worker(args) -> dict:
  import functools

  import jax
  import jax.numpy as jnp
  import optax
  import peers
  import plain_gpt

  import zerojax
  from zerojax import aot, cost

  mesh = aot.topology_mesh(args.topology, args.mesh, num_slices=args.num_slices)
  n = mesh.size
  axes = dict(mesh.shape)
  if args.model == "gpt":  # zerojax's reference GPT (gathers per layer)
    from zerojax.app import gpt

    config = gpt.GPTConfig(
      vocab=args.vocab,
      seq_len=args.seq_len,
      width=args.width,
      depth=args.depth,
      heads=args.heads,
    ).resolved("tpu")
    init_fn = functools.partial(gpt.init, config)
    loss_fn = functools.partial(gpt.loss, config=config)
  else:
    init_fn = functools.partial(
      plain_gpt.init,
      vocab=args.vocab,
      width=args.width,
      depth=args.depth,
      seq_len=args.seq_len,
    )
    loss_fn = functools.partial(plain_gpt.loss, heads=args.heads)
  rows = args.batch_per_chip * n * args.accum_steps
  batch = aot.abstract_batch(
    {
      "x": ((rows, args.seq_len), jnp.int32),
      "y": ((rows, args.seq_len), jnp.int32),
    }
  )
  opt = optax.adamw(1e-4)
  shapes = jax.eval_shape(init_fn, jax.random.key(0))
  n_params = sum(x.size for x in jax.tree.leaves(shapes))
  out = {"config": args.config, "n_params": int(n_params)}
  t0 = time.perf_counter()
  if args.config in ("fsdp", "zero1", "dp", "dropin"):
    jitted, p_sh, o_sh, b_sh = peers.peer_program(
      args.config, loss_fn, opt, shapes, mesh
    )
    put = lambda tree, sh: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh
    )
    lowered = jitted.lower(
      put(shapes, p_sh),
      put(jax.eval_shape(opt.init, shapes), o_sh),
      jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=b_sh), batch
      ),
    )
  else:
    stage = int(args.config[0])
    zeropp = None
    if args.config == ZEROPP:  # nodes: one slice's chips of the data axis
      node = axes["data"] // (args.num_slices // axes.get("replica", 1))
      zeropp = zerojax.ZeroPP(grad_bits=8, hpz_size=node, node_size=node)
    offload = _offload_share(args.config)
    from zerojax._src.diagnostics import offload_stream
    from zerojax._src.step import offload as _stream

    if args.config.endswith("-free"):
      from zerojax._src.step import update as _update

      _update._GRADS_BEFORE_UPDATE = False
    if args.config.endswith("-serial"):
      _stream._waits = lambda sizes: (
        tuple(None if k == 0 else k - 1 for k in range(len(sizes))),
        (None,) * len(sizes),
      )
    if args.config.endswith("-cross"):
      _stream._waits = _stream.crossing_waits
    if args.config.endswith("-whole"):
      _stream._by_rows = False
    if args.config.endswith("-finite-all"):
      # a branch read as one equation over all its operands: the update
      # behind apply_if_finite runs on the whole state at once
      from zerojax._src.jaxpr import deps as _deps

      _deps.cond_branches = lambda eqn: None
    # fp32 params, no master copy, except "offb" / "offp": bf16 + master
    policy, stacked = zerojax.Policy(), None
    base = args.config.removesuffix("-whole").removesuffix("-all")
    clipped_finite = base.endswith("-cfinite")
    if clipped_finite:
      opt = optax.chain(
        optax.clip_by_global_norm(1.0), optax.apply_if_finite(opt, 3)
      )
      base = base.removesuffix("-cfinite")
    finite = base.endswith("-finite")
    base = base.removesuffix("-finite")
    if base.endswith("c"):  # behind global-norm clipping
      opt = optax.chain(optax.clip_by_global_norm(1.0), opt)
      base = base.removesuffix("c")
    if finite:  # all of it inside apply_if_finite
      opt = optax.apply_if_finite(opt, 3)
    grads_host = base.endswith(("offbg", "offpg"))
    base = base.removesuffix("g") if grads_host else base
    if base.endswith(("offb", "offp")):
      policy = zerojax.Policy(param_dtype=jnp.bfloat16)
      if args.model == "gpt":  # its embedding and head are not stacks
        stacked = gpt.is_layer_stack
    tx = zerojax.zero(
      opt,
      stage=stage,
      mesh=mesh,
      zeropp=zeropp,
      policy=policy,
      stacked=stacked,
      offload=offload,
      offload_params=base.endswith("offp"),
      offload_grads=grads_host,
    )
    state = jax.eval_shape(
      lambda k: zerojax.init_from(init_fn, tx, k), jax.random.key(0)
    )
    if "split" in args.config:
      grad_fn = zerojax.value_and_grad(loss_fn, tx)

      @functools.partial(jax.jit, donate_argnums=0)
      def split_step(state, batch):
        loss, grads = grad_fn(state, batch)
        return zerojax.apply_gradients(state, grads), loss

      lowered = split_step.lower(state, batch)
    else:
      lowered = zerojax.train_step(
        loss_fn, tx, accum_steps=args.accum_steps
      ).lower(state, batch)
    one_device = {
      k: jax.ShapeDtypeStruct((args.batch_per_chip, args.seq_len), jnp.int32)
      for k in ("x", "y")
    }
    acts = cost.saved_activations(loss_fn, shapes, one_device, mesh={"data": n})
    plan = cost.plan_stage(
      shapes,
      stage,
      mesh=axes,
      activations=acts,
      policy=policy,
      optimizer=opt,
      stacked=stacked,
      offload=offload,
      offload_params=base.endswith("offp"),
      offload_grads=grads_host,
      accum_steps=args.accum_steps,
    )
    if offload:
      out["offload"] = {
        **offload_stream.describe(state.spec),
        "planner_host": plan.host,
        "planner_host_to_device": plan.host_to_device,
        "planner_device_to_host": plan.device_to_host,
        "planner_update_transient": plan.update_transient,
      }
    slices = args.num_slices
    out["planner_comm"] = cost.comm_time(plan, slices)
    if zeropp is not None:
      out["planner_zeropp"] = cost.zeropp_comm(
        int(n_params),
        axes["data"],
        slices,
        grad_bits=8,
        hpz=True,
        param_bytes=4,
      )
    out["planner"] = {
      "state": plan.total,
      "params": plan.params,
      "master": plan.master,
      "optimizer": plan.optimizer,
      "grads": plan.grads,
      "grads_host": plan.grads_host,
      "activations": plan.activations,
      "working_set": plan.working_set,
      "collectives": plan.collectives,
    }
  out["lower_s"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = lowered.compile()
  out["compile_s"] = time.perf_counter() - t0
  out.update(aot.compiled_report(compiled, mesh))
  return out


def _main_report(dump: str):
  """The TPU program's ``*memory-usage-report.txt`` in an XLA dump folder
  (the module with the most bytes that is not one of the CPU backend's):
  ``(total bytes, path, text)``, or None."""
  best = None
  for f in pathlib.Path(dump).glob("*memory-usage-report.txt"):
    if "cpu_after" in f.name:
      continue
    text = f.read_text()
    m = re.search(r"Total bytes: (\d+)", text)
    if m and (best is None or int(m.group(1)) > best[0]):
      best = (int(m.group(1)), f, text)
  return best


def largest_buffers(dump: str, n: int) -> dict:
  """The ``n`` largest allocations in device memory of the TPU program in
  an XLA dump folder (:func:`_main_report`), each allocation's bytes and
  the shapes of the values sharing it over the program; with the live
  bytes over its schedule beside the heap they were packed into
  (``device_live``: ``experiments/lib/xla_live.py``)."""
  best = _main_report(dump)
  if best is None:
    return {}
  total, path, text = best
  name = path.name
  table = text.split("\n\n")[0]  # the first table: the default memory space
  rows = []
  for line in table.splitlines():
    # cumulative; size; offset; values sharing it; their shapes
    cols = [c.strip() for c in line.split(";", 4)]
    if len(cols) == 5 and cols[2].isdigit():
      rows.append({"bytes": _size_bytes(cols[1]), "shapes": cols[4]})
  rows.sort(key=lambda r: -r["bytes"])
  return {
    "report": name,
    "total_bytes": total,
    "allocations": rows[:n],
    "device_live": xla_live.from_dump(path, n),
  }


def _size_bytes(text: str) -> int:
  """``'16.00MiB'`` -> bytes (the report's rounding)."""
  units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
  m = re.fullmatch(r"([\d.]+)\s*([KMGT]?i?B)", text)
  return round(float(m.group(1)) * units[m.group(2)]) if m else 0


def _offload_share(config: str) -> bool | float:
  """``offload=`` of a configuration name (see :data:`CONFIGS`)."""
  if "off" not in config:
    return False
  digits = config.split("off", 1)[1].split("-")[0].rstrip("bpgc")
  return int(digits) / 100 if digits else True


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--topology", default="v5e:2x2")
  p.add_argument("--num-slices", type=int, default=1)
  p.add_argument(
    "--model",
    choices=("plain", "gpt"),
    default="plain",
    help="plain_gpt.py (written without zerojax) or zerojax's "
    "reference GPT (zerojax.app.gpt)",
  )
  p.add_argument(
    "--mesh",
    default=None,
    help="mesh axes, e.g. replica=2,data=4 (default: data)",
  )
  p.add_argument("--configs", default=",".join(CONFIGS))
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--depth", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--batch-per-chip", type=int, default=2)
  p.add_argument(
    "--accum-steps",
    type=int,
    default=1,
    help="micro-batches per step (each of --batch-per-chip rows per chip)",
  )
  p.add_argument("--out", default=str(HERE.parent / "docs" / "data"))
  p.add_argument(
    "--tag",
    default="",
    help="appended to the file name (e.g. the LIBTPU_INIT_ARGS "
    "set tried; the flags are recorded in the JSON)",
  )
  p.add_argument(
    "--buffers",
    type=int,
    default=0,
    help="record each program's N largest device-memory allocations "
    "(XLA's memory-usage report, through --xla_dump_to)",
  )
  p.add_argument("--config", help=argparse.SUPPRESS)  # worker mode
  args = p.parse_args()
  if args.config:
    print(json.dumps(worker(args)))
    return
  import importlib.metadata as md

  versions = {k: md.version(k) for k in ("jax", "jaxlib", "libtpu")}
  runs = []
  for config in args.configs.split(","):
    argv = [
      sys.executable,
      __file__,
      f"--config={config}",
      f"--topology={args.topology}",
      f"--width={args.width}",
      f"--num-slices={args.num_slices}",
      f"--model={args.model}",
      *([f"--mesh={args.mesh}"] if args.mesh else []),
      f"--depth={args.depth}",
      f"--heads={args.heads}",
      f"--vocab={args.vocab}",
      f"--seq-len={args.seq_len}",
      f"--batch-per-chip={args.batch_per_chip}",
      f"--accum-steps={args.accum_steps}",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as dump:
      if args.buffers:
        env["XLA_FLAGS"] = (
          f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
          "--xla_dump_hlo_as_text"
        )
      proc = subprocess.run(argv, capture_output=True, text=True, env=env)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
      if proc.returncode or not lines:
        errors = [l for l in proc.stderr.splitlines() if "Error" in l]
        run = {
          "config": config,  # e.g. the compiler's OOM
          "error": errors[-1:] or proc.stderr.strip().splitlines()[-1:],
        }
      else:
        run = json.loads(lines[-1])
        if args.buffers:
          run["largest_buffers"] = largest_buffers(dump, args.buffers)
    runs.append(run)
    mem = run.get("memory", {})
    print(
      f"{args.topology} {config:>6}: peak {mem.get('peak', 0) / 2**20:8.1f} "
      f"MiB  {run.get('issued', run.get('error'))}",
      flush=True,
    )
  model = (
    f"{args.model}_w{args.width}_d{args.depth}_v{args.vocab}_t{args.seq_len}"
    f"_b{args.batch_per_chip}"
    + (f"_a{args.accum_steps}" if args.accum_steps > 1 else "")
  )
  topology = args.topology + (
    f"x{args.num_slices}slices" if args.num_slices > 1 else ""
  )
  if args.mesh:
    model += "_" + args.mesh.replace("=", "").replace(",", "_")
  if args.tag:
    model += "_" + args.tag
  result = {
    "topology": topology,
    "mesh": args.mesh,
    "model": model,
    "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
    "model_source": (
      "zerojax.app.gpt"
      if args.model == "gpt"
      else "experiments/lib/plain_gpt.py"
    ),
    "sizes": {
      k: getattr(args, k)
      for k in (
        "width",
        "depth",
        "heads",
        "vocab",
        "seq_len",
        "batch_per_chip",
        "accum_steps",
      )
    },
    "versions": versions,
    "runs": runs,
  }
  name = (
    f"tpu_compile_{topology.replace(':', '-')}_{model}_"
    f"jax{versions['jax']}_libtpu{versions['libtpu']}.json"
  )
  path = pathlib.Path(args.out) / name
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=1) + "\n")
  print(path)


if __name__ == "__main__":
  main()
