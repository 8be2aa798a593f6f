"""The planner: per-device memory and per-step communication before you rent.

    python -m zerojax.plan --params 7.5e9 --devices 64
    python -m zerojax.plan --params 1e12 --devices 1024 --memory-gb 32
    python -m zerojax.plan --width 4096 --depth 32 --vocab 50257 --devices 256
    python -m zerojax.plan --params 70e9 --mesh replica=4,data=256 --slices 4
    python -m zerojax.plan --params 70e9 --mesh data=64,model=8 --hardware h100
    python -m zerojax.plan --topology v5p:4x4x4 --params 8e9 --batch 1 --compile

For a GPT-shaped model (from a parameter count, or an explicit config) on N
data-parallel devices, prints for each ZeRO stage the per-device bytes of
params, master weights, optimizer moments and gradients, and the collective
bytes per step; then the largest GPT that fits ``--memory-gb`` per device at
each stage, and what stops one 2% larger (the memory it overflows and, on
the device, its largest part: :func:`what_binds`). Everything comes from
the layouts zerojax would use -- the same
:func:`zerojax.layout.make_spec` that ``zerojax.init`` runs, on abstract
shapes (``jax.eval_shape``) and an ``AbstractMesh`` of N devices -- so no
array is allocated and 1024 devices or 1T parameters cost nothing. Padding
of dimensions that do not divide N is included.

Model-state memory only, as in the ZeRO paper's Figure 1: activations,
temporary buffers and fragmentation come on top.

With ``--mesh`` (axes ``replica``, ``data``, ``model``) and ``--slices``
(TPU slices or GPU nodes; the outermost axes are split across them, as
:func:`zerojax.make_mesh` lays them out), each stage also gets its
communication per step and mesh axis: bytes each chip sends over the fast
links (ICI / NVLink) and over the slow ones (DCN / InfiniBand), and the
seconds they take at the ``--hardware`` bandwidths. The model: ring
collectives; a group of ``a`` chips moving a full buffer of ``B`` bytes
sends ``(a-1)/a B`` per chip (all-gather, reduce-scatter; twice that for an
all-reduce) over the fast links; a group spanning ``s`` slices also moves
``(s-1)/s B`` into each slice, spread over its ``a/s`` chips' slow links
(hierarchical collectives: the in-slice part moves ``(i-1)/i B`` over the
group's ``i = a/s`` chips per slice); time = fast bytes / fast bandwidth +
slow bytes / slow bandwidth (no overlap with compute). ``--collectives
ring`` instead prices one flat ring per group, whose slow hops each carry
``(a-1)/a B``: what a collective that is not decomposed by slice costs. Tensor-parallel activation
traffic over ``model`` depends on the batch and is not counted.

With ``--topology`` (a TPU topology such as ``v5p:4x4x4``) the devices are
that topology's chips; ``--compile`` then also compiles the GPT's train
step at each of ``--stages`` for it with the TPU compiler (the ``tpu``
extra; no TPU needed, nothing allocated) and prints, per chip, the
compiled peak beside the planner's prediction (model state, :func:`working_set`
and attention's backward buffers: :func:`predicted_peak`),
the collectives and how the compiler issued them (:mod:`zerojax.app.compiled`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp

import zerojax
from zerojax.app import gpt, plan_text
from zerojax.app.planner import (
  abstract_gpt,
  gpt_activations,
  largest_fitting,
  offload_needed,
  plan_gpt,
  predicted_peak,
  what_binds,
)
from zerojax.cost import (
  GB,
  HARDWARE,
  comm_time,
)


def main(argv=None):
  p = _parser()
  args = p.parse_args(argv)
  if not 0.0 <= args.offload <= 1.0:
    p.error(f"--offload {args.offload}: give a share in [0, 1]")
  if args.offload_grads and args.offload != 1.0:
    p.error(
      "--offload-grads streams each chunk's gradients with the whole state: give --offload"
    )
  if args.host_memory_gb is not None and not (args.memory_gb and args.offload):
    p.error(
      f"--host-memory-gb {args.host_memory_gb:g} bounds the host memory "
      f"of an offloaded model: give it with --memory-gb and --offload"
    )
  mesh, slices = _mesh(p, args)
  config = _config(p, args, mesh)
  asked = _stages(p, args)
  # reported: those asked, else every stage; compiled (a minute each):
  # those asked, else stage 3
  stages = asked or [0, 1, 2, 3]
  plans = [
    plan_gpt(
      abstract_gpt(config),
      s,
      mesh=mesh,
      offload=args.offload,
      offload_params=args.offload_params and s == 3,
      offload_grads=args.offload_grads and s >= 2,
    )
    for s in range(4)
  ]
  for x in plans:
    x.comm.update(
      comm_time(
        x, slices, args.hardware, args.fast_bw, args.slow_bw, args.collectives
      )
    )
  fitting, bound, needed, needed_host = {}, {}, {}, {}
  if args.memory_gb and args.offload:
    needed = {
      s: offload_needed(
        config,
        s,
        args.memory_gb * GB,
        mesh,
        offload_params=args.offload_params and s == 3,
      )
      for s in stages
    }
    needed_host = {
      s: None
      if f is None
      else plan_gpt(
        abstract_gpt(config),
        s,
        mesh=mesh,
        offload=f,
        offload_params=args.offload_params and s == 3,
      ).host
      for s, f in needed.items()
    }
  if args.memory_gb:
    for s in stages:
      c = largest_fitting(
        args.memory_gb * GB,
        s,
        args.devices,
        args.seq_len,
        offload=args.offload,
        offload_params=args.offload_params and s == 3,
        host_memory_bytes=plan_text.host_bytes(args),
        offload_grads=args.offload_grads and s >= 2,
      )
      fitting[s] = None if c is None else gpt.num_params(c)
      if c is not None:
        bound[s] = what_binds(
          c,
          args.memory_gb * GB,
          s,
          args.devices,
          offload=args.offload,
          offload_params=args.offload_params and s == 3,
          host_memory_bytes=plan_text.host_bytes(args),
          offload_grads=args.offload_grads and s >= 2,
        )
  acts = _activations(p, args, config, mesh)
  if args.zeropp and (len(mesh) > 1 or slices < 2):
    p.error("--zeropp: give --devices N and --slices S >= 2 (nodes)")
  compiled = (
    _compile(p, args, config, mesh, plans, asked or [3]) if args.compile else []
  )
  if args.json:
    print(
      json.dumps(
        {
          "config": dataclasses.asdict(config),
          "saved_activations": acts,
          "plans": [
            dict(
              dataclasses.asdict(x),
              total=x.total,
              device=x.device,
              host=x.host,
              host_to_device=x.host_to_device,
              device_to_host=x.device_to_host,
            )
            for x in plans
            if x.stage in stages
          ],
          "largest_fitting": fitting,
          "largest_fitting_bound": bound,
          "offload_needed": needed,
          "offload_needed_host_bytes": needed_host,
          "compiled": compiled,
          "argv": argv if argv is not None else sys.argv[1:],
          "jax_version": jax.__version__,
        },
        indent=2,
      )
    )
    return
  shown = [plans[s] for s in stages]
  plan_text.print_report(
    args, config, mesh, slices, shown, acts, fitting, bound
  )
  if needed:
    print(
      f"\nleast offload share (zero(..., offload=SHARE)) with which this "
      f"GPT's model state fits {args.memory_gb:g} GB per device:"
    )
    host = plan_text.host_bytes(args)
    for s, f in needed.items():
      h = needed_host[s]
      over = host is not None and h is not None and h > host
      print(
        f"  stage {s}: "
        + (
          "does not fit with all of it on the host"
          if f is None
          else "fits without offload"
          if f == 0
          else f"{f:.3f} ({h / GB:.2f} GB on the host"
          + (f", above the {host / GB:g} GB given)" if over else ")")
        )
      )
  if compiled:
    from zerojax.app import compiled as _compiled

    print(
      f"\ncompiled for {args.topology} by the TPU compiler, per chip "
      f"({args.batch} sequence(s) of {config.seq_len} per data device; "
      f"planner = model state + working set; async n/m: n of the m "
      f"collectives of a kind issued asynchronously, (k) overlapping a "
      f"matmul)"
    )
    print(_compiled.table(compiled))


def _stages(p: argparse.ArgumentParser, args) -> list[int] | None:
  """The stages ``--stages`` names, or None when it is not given."""
  if args.stages is None:
    return None
  try:
    stages = sorted({int(s) for s in args.stages.split(",")})
  except ValueError:
    p.error(f"--stages {args.stages}: give stage numbers, e.g. 1,2,3")
  if not stages or not set(stages) <= {0, 1, 2, 3}:
    p.error(f"--stages {args.stages}: stages are 0-3")
  return stages


def _compile(
  p: argparse.ArgumentParser, args, config, mesh: dict, plans, stages
) -> list[dict]:
  """Compile the GPT's step at each of ``stages`` for ``--topology``."""
  if mesh.get("model", 1) > 1:
    p.error(
      "--compile: a data (and replica) mesh only; the model axis's "
      "tensor-parallel step is not compiled here"
    )
  from zerojax import aot
  from zerojax.app import compiled as _compiled

  device_mesh = aot.topology_mesh(
    args.topology, ",".join(f"{k}={v}" for k, v in mesh.items())
  )
  out = []
  for s in stages:
    predicted = predicted_peak(
      plans[s], config, args.batch, n_devices=args.devices, plan_stage2=plans[2]
    )
    out.append(
      _compiled.compile_stage(
        config,
        s,
        device_mesh,
        args.batch,
        predicted,
        offload=args.offload,
        offload_params=args.offload_params and s == 3,
        offload_grads=args.offload_grads and s >= 2,
      )
    )
    print(
      f"compiled stage {s} for {args.topology} in {out[-1]['compile_s']:.0f} s",
      file=sys.stderr,
      flush=True,
    )
  return out


def _positive(kind):
  """An argparse type: a ``kind`` number above zero."""

  def parse(text: str):
    try:
      x = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
        f"{text!r} is not {'an integer' if kind is int else 'a number'}"
      ) from None
    if not (x > 0 and math.isfinite(x)):
      raise argparse.ArgumentTypeError(f"{text}: give a finite number above 0")
    return x

  return parse


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m zerojax.plan",
    description="Per-device model-state memory and per-step collective "
    "bytes of each ZeRO stage, from zerojax's own layouts "
    "(bf16 params and gradients, fp32 master and AdamW moments) and "
    "the main job's optimizer (clip_by_global_norm, then AdamW).",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--params",
    type=_positive(float),
    help="parameter count of a GPT-shaped model, e.g. 7.5e9",
  )
  p.add_argument(
    "--width", type=_positive(int), help="explicit GPT width (with --depth)"
  )
  p.add_argument("--depth", type=_positive(int), help="explicit GPT depth")
  p.add_argument(
    "--vocab", type=_positive(int), default=50257, help="with --width/--depth"
  )
  p.add_argument(
    "--seq-len", type=_positive(int), default=2048, help="context length"
  )
  p.add_argument(
    "--devices",
    type=int,
    default=None,
    help="data-parallel devices N (a 1-D mesh)",
  )
  p.add_argument(
    "--mesh",
    default=None,
    help="mesh axes instead of --devices, e.g. "
    "replica=4,data=256 or data=64,model=8",
  )
  p.add_argument(
    "--slices",
    type=int,
    default=None,
    help="TPU slices / GPU nodes the devices span (default: the "
    "replica axis size, else 1)",
  )
  p.add_argument(
    "--hardware",
    choices=sorted(HARDWARE),
    default="tpu-v5p",
    help="link bandwidth defaults",
  )
  p.add_argument(
    "--fast-bw",
    type=_positive(float),
    default=None,
    help="in-slice bytes/s per chip (overrides --hardware)",
  )
  p.add_argument(
    "--slow-bw",
    type=_positive(float),
    default=None,
    help="cross-slice bytes/s per chip (overrides --hardware)",
  )
  p.add_argument(
    "--collectives",
    choices=["hierarchical", "ring"],
    default="hierarchical",
    help="how a collective spanning slices is priced",
  )
  p.add_argument(
    "--memory-gb",
    type=_positive(float),
    default=None,
    help="also find the largest GPT whose model state fits this "
    "many GB (1e9 bytes) per device, at each stage",
  )
  p.add_argument(
    "--host-memory-gb",
    type=_positive(float),
    default=None,
    help="with --memory-gb and --offload: the largest GPT must also "
    "fit this many GB (1e9 bytes) of pinned host memory per device "
    "(its master copy, optimizer state and offloaded params)",
  )
  p.add_argument(
    "--offload",
    type=float,
    nargs="?",
    const=1.0,
    default=0.0,
    metavar="SHARE",
    help="master copy and optimizer state in host memory "
    "(zero(..., offload=True)), or SHARE of their bytes "
    "(zero(..., offload=SHARE)): device and host GB apart; "
    "--memory-gb then bounds device memory and names the least "
    "share this GPT needs per stage",
  )
  p.add_argument(
    "--offload-params",
    action="store_true",
    help="stage 3 also with its parameter shards in host memory "
    "(zero(..., offload_params=True))",
  )
  p.add_argument(
    "--offload-grads",
    action="store_true",
    help="stages 2-3 also with the reduced gradients in host memory "
    "(zero(..., offload_grads=True)); needs --offload",
  )
  p.add_argument(
    "--zeropp",
    action="store_true",
    help="also stage 3's communication per step with ZeRO++ "
    "(qwZ, qgZ, hpZ with nodes = --slices) on a 1-D data "
    "mesh of --devices",
  )
  p.add_argument(
    "--batch",
    type=_positive(int),
    default=None,
    help="also the saved activations per device (ZeRO-R) for "
    "this many sequences per data-parallel device, by "
    "remat policy, with and without Pa on a model axis",
  )
  p.add_argument(
    "--topology",
    default=None,
    help="a TPU topology (e.g. v5p:4x4x4, v6e:16x16): its chips "
    "are the devices (a data axis over all, or --mesh)",
  )
  p.add_argument(
    "--compile",
    action="store_true",
    help="with --topology and --batch: also compile the GPT's "
    "train step for it with the TPU compiler (pip install "
    "'zerojax[tpu]'; no TPU needed) and report each "
    "stage's compiled peak, collectives and overlap",
  )
  p.add_argument(
    "--stages",
    default=None,
    help="the stages to report (and with --compile to compile), e.g. 1,2,3 "
    "(default: every stage; with --compile, stage 3)",
  )
  p.add_argument("--json", action="store_true", help="print JSON instead")
  return p


def _mesh(p: argparse.ArgumentParser, args) -> tuple[dict, int]:
  """The mesh's axis sizes and the slices it spans, checked."""
  if (args.params is None) == (args.width is None):
    p.error("give either --params or --width and --depth")
  if args.width is not None and args.depth is None:
    p.error("--width needs --depth")
  if args.compile and not (args.topology and args.batch):
    p.error(
      "--compile needs --topology (the TPU to compile for) and --batch "
      "(sequences per data-parallel device)"
    )
  if args.topology is not None:
    if args.devices is not None:
      p.error("--topology gives the devices; drop --devices")
    from zerojax import aot

    try:
      args.topology_devices = len(aot.topology_devices(args.topology))
    except ValueError as e:
      p.error(f"--topology: {e}")
    if args.mesh is None:
      args.devices = args.topology_devices
  if (args.devices is None) == (args.mesh is None):
    p.error("give either --devices or --mesh")
  if args.mesh is not None:
    try:
      mesh = zerojax.layout.parse_axes(args.mesh, None)
    except ValueError as e:
      p.error(f"--mesh {args.mesh}: {e}")
    if "data" not in mesh:
      p.error(f"--mesh {args.mesh} has no data axis")
  else:
    if args.devices < 1:
      p.error(f"--devices={args.devices} must be >= 1")
    mesh = {"data": args.devices}
  if args.topology and math.prod(mesh.values()) != args.topology_devices:
    p.error(
      f"--mesh {args.mesh} has {math.prod(mesh.values())} devices; "
      f"topology {args.topology} has {args.topology_devices} chips"
    )
  args.devices = mesh["data"]
  slices = args.slices or mesh.get("replica", 1)
  if math.prod(mesh.values()) % slices:
    p.error(
      f"--slices={slices} does not divide the "
      f"{math.prod(mesh.values())} devices"
    )
  return mesh, slices


def _config(p: argparse.ArgumentParser, args, mesh: dict) -> gpt.GPTConfig:
  """The GPT to plan. On a model axis the vocabulary is padded to a
  multiple of it (as the main job pads it); the block's own dimensions are
  the model's shape and an axis that does not divide them is refused."""
  if args.params is not None:
    try:
      config = gpt.config_for_params(args.params, seq_len=args.seq_len)
    except ValueError as e:
      p.error(f"--params {args.params:g}: {e}")
  else:
    config = gpt.GPTConfig(
      vocab=args.vocab,
      seq_len=args.seq_len,
      width=args.width,
      depth=args.depth,
      heads=max(1, args.width // 128),
    )
  m = mesh.get("model", 1)
  if m == 1:
    return config
  bad = [
    f"{name} {d}"
    for name, d in (
      ("heads", config.heads),
      ("width", config.width),
      ("MLP width", config.mlp_ratio * config.width),
    )
    if d % m
  ]
  if bad:
    g = math.gcd(config.heads, config.width, config.mlp_ratio * config.width)
    fits = max(k for k in range(1, m) if g % k == 0)
    p.error(
      f"--mesh {args.mesh}: the model axis ({m}) must divide the "
      f"block's tensor-parallel dimensions, but not {', '.join(bad)}; "
      f"pick a model axis that divides them (e.g. model={fits}) or "
      f"another --width."
    )
  return dataclasses.replace(config, vocab=-(-config.vocab // m) * m)


def _activations(p, args, config, mesh: dict) -> dict:
  """Saved activations by remat policy, with and without Pa (``--batch``)."""
  if not args.batch:
    return {}
  if args.batch < 1:
    p.error(f"--batch={args.batch} must be >= 1")
  m = mesh.get("model", 1)
  acts = {}
  for remat in ("full", "dots", "offload"):
    for pa in (False, True) if m > 1 else (False,):
      c = dataclasses.replace(
        config, remat=remat, seq_shard="model" if pa else None
      )
      acts[f"{remat}{' + Pa' if pa else ''}"] = gpt_activations(
        c, args.batch, model=m, dtype=jnp.bfloat16
      )
  return acts


if __name__ == "__main__":
  main()
