"""The main job's settings: :class:`TrainConfig` (each field a ``--flag``),
parsed from the command line (:func:`parse_args`, argparse), checked
(:func:`check`, each problem with its fix) and resolved for the devices
(:func:`resolve`: the automatic fields filled in)."""

from __future__ import annotations

import argparse
import dataclasses
import math


def _opt(default, help_text: str):
  return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The main job's settings; each field is a ``--flag`` (``_`` -> ``-``)."""

  stage: int = _opt(
    3,
    "ZeRO stage: 0 plain data parallel, 1 shard optimizer "
    "state, 2 and gradients, 3 and parameters",
  )
  devices: int = _opt(
    0,
    "devices; 0: every accelerator JAX sees, or 8 fake "
    "CPU devices on a CPU-only machine (which creates "
    "this many)",
  )
  mesh: str = _opt(
    "",
    "mesh axes, e.g. replica=2,data=4 (hybrid sharding: "
    "state sharded over data, replicated over replica) or "
    "data=4,model=2 (tensor parallelism over model, "
    "Megatron layout); empty: data over all devices",
  )
  width: int = _opt(0, "model width D; 0: 128 on CPU, 1024 on an accelerator")
  depth: int = _opt(
    0, "transformer blocks L; 0: 4 on CPU, 24 on an accelerator"
  )
  heads: int = _opt(
    0,
    "attention heads (must divide width); 0: 4 on CPU, "
    "width / 128 on an accelerator",
  )
  seq_len: int = _opt(
    0, "context length in bytes; 0: 128 on CPU, 1024 on an accelerator"
  )
  steps: int = _opt(400, "optimizer steps")
  batch: int = _opt(
    0,
    "global batch (sequences per step); must divide by "
    "devices x accum; 0: 32 on CPU, 16 per accelerator",
  )
  accum: int = _opt(1, "gradient-accumulation micro-batches per step")
  precision: str = _opt(
    "bf16",
    "bf16: bf16 params/compute with an fp32 master copy; fp32: everything fp32",
  )
  lr: float = _opt(
    3e-3, "peak AdamW learning rate (linear warm-up, cosine decay to 10%%)"
  )
  warmup: int = _opt(40, "warm-up steps")
  weight_decay: float = _opt(0.1, "AdamW weight decay")
  clip: float = _opt(1.0, "global-norm gradient clipping threshold")
  attention: str = _opt(
    "auto",
    "attention kernel: auto (cuDNN's fused kernel "
    "on GPU, the einsum reference elsewhere), "
    "einsum, xla, cudnn",
  )
  remat: str = _opt(
    "auto",
    "checkpoint policy of each block: auto (dots on "
    "GPU, full elsewhere), full, dots, offload "
    "(the block input in pinned host memory), none",
  )
  seq_shard: str = _opt(
    "",
    "Pa (ZeRO-R): a mesh axis the residual stream "
    "between blocks is split over along the "
    "sequence, e.g. model; empty: off",
  )
  bucket_mb: float = _opt(
    32.0,
    "CB (ZeRO-R): MiB per whole-leaf collective "
    "(stages 0-2, replica all-reduce); 0: whole "
    "leaves",
  )
  dropout: float = _opt(
    0.0,
    "residual dropout rate (0: off); keys come from "
    "the training state, distinct per step, device "
    "and micro-batch, and are checkpointed",
  )
  eval_every: int = _opt(50, "steps between held-out evaluations")
  eval_batches: int = _opt(4, "held-out batches per evaluation")
  log_every: int = _opt(10, "steps between metrics lines")
  sample_len: int = _opt(200, "bytes of text to sample at the end (0: none)")
  seed: int = _opt(0, "seed for init and data order")
  out: str = _opt("runs/gpt", "output directory")
  checkpoint_dir: str = _opt(
    "",
    "save sharded checkpoints (Orbax, "
    "asynchronous) here; empty: no checkpoints",
  )
  save_every: int = _opt(
    100, "steps between checkpoints (the last step is always saved)"
  )
  offload: float = _opt(
    0.0,
    "share of the fp32 master copy and optimizer state kept in host "
    "memory (pinned_host): --offload alone for all of it, --offload 0.5 "
    "for about half (whole arrays, a leaf's master copy or one of its "
    "moments, or whole leaves where they keep fewer bytes: the largest "
    "below the share, then the smallest that reaches it)",
  )
  offload_params: bool = _opt(
    False,
    "stage 3: the params' shards in host memory, each layer brought down "
    "before its gather (with or without --offload, any share)",
  )
  offload_grads: bool = _opt(
    False,
    "stages 2-3 with --offload: the reduced gradients in host memory too, "
    "each brought down with its chunk of the update",
  )
  weight_bits: int = _opt(
    0,
    "ZeRO++ qwZ: 8 all-gathers stage-3 weights as int8 blocks + scales; 0: off",
  )
  grad_bits: int = _opt(
    0,
    "ZeRO++ qgZ: 8 or 4 reduce-scatters gradients as "
    "int8 / int4 blocks (all-to-all, summed in fp32); "
    "0: off",
  )
  quant_block: int = _opt(
    0,
    "elements per quantization block (ZeRO++); "
    "0: the default (256, or 64 with --grad-bits 4)",
  )
  grad_rounding: str = _opt(
    "auto",
    "ZeRO++ qgZ rounding: nearest, "
    "stochastic, or auto (stochastic for "
    "int4, nearest for int8)",
  )
  hpz_size: int = _opt(
    0,
    "ZeRO++ hpZ: devices per node; a secondary copy "
    "of the params is sharded inside each node so the "
    "per-layer all-gathers stay there (stage 3); 0: off",
  )
  init_from: str = _opt(
    "",
    "fine-tune from a GPT-2 safetensors checkpoint (a "
    "save_pretrained directory, one file, or --export-dir's "
    "output), each process reading its own rows; the model's "
    "width, depth, heads and context come from it; empty: "
    "random init",
  )
  export_dir: str = _opt(
    "",
    "at the end, write the trained model here as a Hugging "
    "Face GPT-2 checkpoint (safetensors + config.json, "
    "untied head) that GPT2LMHeadModel.from_pretrained "
    "loads; empty: none",
  )
  resume: bool = _opt(
    False,
    "continue from the latest checkpoint in "
    "--checkpoint-dir (any stage or device count "
    "can restore it); it takes precedence over --init-from",
  )


def parse_args(argv=None) -> TrainConfig:
  parser = argparse.ArgumentParser(
    prog="python -m zerojax.train",
    description="Train a byte-level GPT on CPython's pydoc topics with "
    "zerojax (no download needed).",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  for f in dataclasses.fields(TrainConfig):
    flag = "--" + f.name.replace("_", "-")
    kw = dict(type=type(f.default), default=f.default, help=f.metadata["help"])
    if isinstance(f.default, bool):
      kw = dict(
        action=argparse.BooleanOptionalAction,
        default=f.default,
        help=f.metadata["help"],
      )
    if f.name == "offload":
      kw.update(nargs="?", const=1.0)
    if f.name == "stage":
      kw["choices"] = [0, 1, 2, 3]
    if f.name == "precision":
      kw["choices"] = ["bf16", "fp32"]
    if f.name == "weight_bits":
      kw["choices"] = [0, 8]
    if f.name == "grad_bits":
      kw["choices"] = [0, 8, 4]
    if f.name == "attention":
      from zerojax.app import gpt

      kw["choices"] = list(gpt.ATTENTION)
    if f.name == "remat":
      from zerojax.app import gpt

      kw["choices"] = list(gpt.REMAT)
    parser.add_argument(flag, dest=f.name, **kw)
  args = parser.parse_args(argv)
  config = TrainConfig(**vars(args))
  problems = check(config)
  if problems:
    parser.error("; ".join(problems))
  return config


def check(config: TrainConfig) -> list[str]:
  """What is wrong with ``config``, each with its fix. Fields left at 0
  (auto) are checked once :func:`resolve` has filled them in."""
  problems = []
  positive = (
    "steps",
    "accum",
    "eval_every",
    "eval_batches",
    "log_every",
    "save_every",
  )
  auto = ("devices", "width", "depth", "heads", "seq_len", "batch")
  problems += [
    f"--{n.replace('_', '-')}={getattr(config, n)} must be >= 1"
    for n in positive
    if getattr(config, n) < 1
  ]
  problems += [
    f"--{n.replace('_', '-')}={getattr(config, n)} must be >= 1 "
    f"(or 0: automatic)"
    for n in auto
    if getattr(config, n) < 0
  ]
  for n, zero_ok in (("lr", False), ("clip", False), ("weight_decay", True)):
    x = getattr(config, n)
    if not (math.isfinite(x) and (x >= 0 if zero_ok else x > 0)):
      problems.append(
        f"--{n.replace('_', '-')}={x} must be a finite number "
        f"{'>= 0' if zero_ok else 'above 0'}"
      )
  if config.warmup < 0:
    problems.append(f"--warmup={config.warmup} must be >= 0")
  if not 0.0 <= config.offload <= 1.0:
    problems.append(
      f"--offload={config.offload} must be a share in [0, 1] "
      f"(--offload alone: all of it)"
    )
  if config.offload_params and config.stage != 3:
    problems.append(
      f"--offload-params needs --stage 3 (got --stage {config.stage}): "
      f"only stage 3 gathers each layer from its shard"
    )
  if config.offload_grads and (config.stage < 2 or config.offload != 1.0):
    problems.append(
      f"--offload-grads needs --stage 2 or 3 and --offload (all of it); got "
      f"--stage {config.stage} --offload {config.offload}"
    )
  if config.width and config.heads and config.width % config.heads:
    problems.append(
      f"--heads={config.heads} does not divide --width={config.width}"
    )
  from zerojax.app import gpt

  if config.attention not in gpt.ATTENTION:
    problems.append(
      f"--attention={config.attention}: use one of {', '.join(gpt.ATTENTION)}"
    )
  if config.remat not in gpt.REMAT:
    problems.append(
      f"--remat={config.remat}: use one of {', '.join(gpt.REMAT)}"
    )
  if not (math.isfinite(config.bucket_mb) and config.bucket_mb >= 0):
    problems.append(
      f"--bucket-mb={config.bucket_mb} must be a finite number >= 0 "
      f"(0: whole leaves)"
    )
  splits, over = config.devices, f"--devices={config.devices}"
  axes = {"data": config.devices}
  # with --devices automatic, a mesh that sizes every axis is checked now;
  # one with a -1 size once resolve() knows the device count
  if config.mesh and (config.devices or "-1" not in config.mesh):
    from zerojax.layout import parse_axes

    try:
      axes = parse_axes(config.mesh, config.devices or None)
    except ValueError as e:
      problems.append(f"--mesh={config.mesh}: {e}")
      axes = {"data": config.devices}
    if "data" not in axes:
      problems.append(f"--mesh={config.mesh} has no data axis")
    splits = axes.get("data", 1) * axes.get("replica", 1)
    over = f"the {splits} replica x data devices of --mesh={config.mesh}"
  elif config.mesh:
    axes = None
  if (
    axes is not None
    and config.seq_shard
    and (
      config.seq_shard in ("data", "replica") or config.seq_shard not in axes
    )
  ):
    problems.append(
      f"--seq-shard={config.seq_shard} is not a model axis of the mesh "
      f"({', '.join(axes)}); e.g. --mesh data=4,model=2 --seq-shard model"
    )
  if config.batch and splits and config.batch % (splits * config.accum):
    m = splits * config.accum
    problems.append(
      f"--batch={config.batch} does not split over {over} x "
      f"--accum={config.accum}; use a multiple of {m} "
      f"(e.g. {-(-config.batch // m) * m})"
    )
  if not 0.0 <= config.dropout < 1.0:
    problems.append(f"--dropout={config.dropout} must be in [0, 1)")
  if config.grad_rounding not in ("auto", "nearest", "stochastic"):
    problems.append(
      f"--grad-rounding={config.grad_rounding!r}: use auto, "
      f"nearest or stochastic"
    )
  if config.quant_block and (config.quant_block < 2 or config.quant_block % 2):
    problems.append(
      f"--quant-block={config.quant_block} must be even and >= 2 "
      f"(or 0: the default)"
    )
  data = splits // ((axes or {}).get("replica", 1) if config.mesh else 1)
  if (
    config.hpz_size
    and data
    and (
      config.hpz_size < 2
      or data % config.hpz_size
      or config.hpz_size >= data
      or config.stage != 3
    )
  ):
    problems.append(
      f"--hpz-size={config.hpz_size} must divide the {data} data "
      f"devices, be >= 2 and smaller than them, at --stage 3 "
      f"(e.g. --hpz-size {max(2, data // 2)} for 2 nodes)"
    )
  if config.weight_bits and config.stage != 3:
    problems.append(
      f"--weight-bits={config.weight_bits} quantizes stage 3's "
      f"weight all-gathers; use --stage 3"
    )
  if config.grad_bits and config.stage == 0:
    problems.append(f"--grad-bits={config.grad_bits} needs --stage >= 1")
  if config.resume and not config.checkpoint_dir:
    problems.append("--resume needs --checkpoint-dir")
  return problems


def resolve(config: TrainConfig, devices) -> TrainConfig:
  """``config`` with its automatic (0) fields filled in for ``devices``:
  a small model on CPU, one sized to show an accelerator otherwise."""
  accel = devices[0].platform != "cpu"
  n = len(devices)
  width = config.width or (1024 if accel else 128)
  fill = dict(
    devices=config.devices or n,
    width=width,
    depth=config.depth or (24 if accel else 4),
    heads=config.heads or (max(1, width // 128) if accel else 4),
    seq_len=config.seq_len or (1024 if accel else 128),
  )
  if not config.batch:
    splits = n
    if config.mesh:
      from zerojax.layout import parse_axes

      axes = parse_axes(config.mesh, n)
      splits = axes.get("data", 1) * axes.get("replica", 1)
    fill["batch"] = (16 * splits if accel else max(32, splits)) * config.accum
  return dataclasses.replace(config, **fill)
