"""The main job: train a byte-level GPT on CPython's embedded docs corpus.

    python -m zerojax.train                  # ZeRO-3, bf16 + fp32 master
    python -m zerojax.train --stage 1 --steps 100 --out runs/s1

Runs on every accelerator JAX finds (one GPU: a data axis of 1, still
ZeRO-3 through zerojax), with a model sized for it (about 300M params,
context 1024, cuDNN attention); on a CPU-only machine it creates
``--devices`` fake CPU devices (8 by default) so the sharding is real, and
trains a small model in a few minutes.
Writes ``<out>/metrics.jsonl`` (one object per logged step: ``step``,
``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, and ``eval_loss`` at
evaluations), the same scalars as TensorBoard event files in ``<out>``
(tensorboardX), ``<out>/loss.png`` and ``<out>/summary.json``, and prints a
text sample from the trained model. A loss, gradient norm or eval loss that
is not finite stops the run: nothing later is saved, exported or sampled,
``summary.json`` names the step (``diverged_at``) and the command exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
import time

from zerojax.app import run_log


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


def _setup_devices(n: int):
  """Joins a multi-process run if there is one; else every accelerator JAX
  sees (or the first ``n``), or ``n`` (default 8) fake CPU devices, created
  before JAX's backend starts, when there is no accelerator."""
  import jax

  from zerojax import distributed

  if distributed.initialize():
    devices = jax.devices()
    if n and len(devices) != n:
      raise SystemExit(
        f"zerojax.train: --devices={n} but the {jax.process_count()}-process "
        f"run has {len(devices)} devices; pass --devices {len(devices)}."
      )
    return devices
  jax.config.update("jax_num_cpu_devices", max(n or 8, 1))
  devices = jax.devices()
  if n and len(devices) < n:
    raise SystemExit(
      f"zerojax.train: --devices={n} but JAX sees {len(devices)} "
      f"{devices[0].platform} devices; pass --devices {len(devices)} (or 0: "
      f"all of them)."
    )
  return devices[:n] if n else devices


def main(config: TrainConfig) -> dict:
  """Trains, evaluates, checkpoints and writes ``config.out``; returns the
  summary (also ``summary.json``)."""
  import jax
  import numpy as np

  import zerojax
  from zerojax import distributed
  from zerojax.app import data, gpt, hf

  _require_app_dependencies()
  devices = _setup_devices(config.devices)
  pretrained, problems = _pretrained(config)
  if pretrained is not None:
    fill, problems = hf.flag_problems(config, pretrained)
    config = dataclasses.replace(config, **fill)
  config = resolve(config, devices)
  problems = problems + check(config)
  if problems:  # as argparse reports them: before any work
    print(
      "python -m zerojax.train: error: " + "; ".join(problems), file=sys.stderr
    )
    raise SystemExit(2)
  mesh = zerojax.make_mesh(config.mesh or None, devices=devices)
  main_process = distributed.is_main()  # logs, plots and prints
  say = print if main_process else (lambda *a, **k: None)
  out = pathlib.Path(config.out)
  if main_process:
    out.mkdir(parents=True, exist_ok=True)
  model = gpt.GPTConfig(
    vocab=pretrained.vocab if pretrained else 256,
    seq_len=config.seq_len,
    width=config.width,
    depth=config.depth,
    heads=config.heads,
    dropout=config.dropout,
    attention=config.attention,
    remat=config.remat,
    seq_shard=config.seq_shard or None,
  ).resolved(devices[0].platform)
  tx, schedule = _optimizer(config, mesh)
  state, start, ckpt = _initial_state(config, model, tx, say, pretrained)
  train_tokens, val_tokens = data.split(data.corpus_bytes())
  batch_at = _batches(config, tx)
  val_batches = [
    batch_at(val_tokens, config.seed + 1, i) for i in range(config.eval_batches)
  ]
  evaluate = zerojax.eval_step(
    lambda p, b, key=None: gpt.loss(p, b, model), tx
  )  # eval: no dropout

  def eval_loss(state):
    return float(
      np.mean([run_log.host(evaluate(state, b)) for b in val_batches])
    )

  n_params = gpt.num_params(model)
  say(
    f"zerojax.train: GPT {n_params:,} params, stage "
    f"{config.stage}, {config.precision}, "
    + (f"{tx.zeropp}, " if tx.zeropp.active else "")
    + f"{len(devices)} x "
    f"{devices[0].platform} devices (mesh {dict(mesh.shape)}), batch "
    f"{config.batch} x "
    f"{config.seq_len} bytes, attention {model.attention}, remat "
    f"{model.remat}",
    flush=True,
  )
  log = run_log.RunLog(
    config,
    out,
    main_process,
    schedule,
    devices,
    gpt.flops_per_token(model, n_params),
  )
  log.write({"step": start, "eval_loss": eval_loss(state)})
  train_step = zerojax.train_step(
    functools.partial(gpt.loss, config=model),
    tx,  # key= when dropout
    accum_steps=config.accum,
    gather="model",
  )
  state, preempted = _train(
    config,
    state,
    start,
    train_step,
    lambda step: batch_at(train_tokens, config.seed, step),
    eval_loss,
    log,
    ckpt,
    say,
  )
  summary = _summary(
    config,
    log,
    mesh,
    devices,
    n_params,
    preempted,
    {"attention": model.attention, "remat": model.remat},
    jax.__version__,
  )
  if main_process:
    (out / "summary.json").write_text(
      json.dumps(run_log.strict_json(summary), indent=2)
    )
    from zerojax.app import plots

    plots.loss_curve(
      log.records,
      out / "loss.png",
      title=f"GPT {n_params:,} params, ZeRO-{config.stage}",
    )
  if log.diverged is not None:
    say(_divergence(config, log, ckpt), file=sys.stderr)
    return summary
  say(
    f"done in {summary['wall_s']:.0f}s: held-out loss "
    f"{summary['first_eval_loss']:.3f} -> {summary['last_eval_loss']:.3f} "
    f"({100 * summary['eval_drop']:.0f}% lower), "
    f"{summary['tokens_per_s'] or 0:,.0f} tokens/s; wrote {out}/"
  )
  if config.export_dir and preempted is None:
    written = hf.export(state, model, config.export_dir)
    say(
      f"exported a GPT-2 checkpoint ({len(written)} files) to {config.export_dir}/"
    )
  if config.sample_len and preempted is None:
    say("sample:\n" + _sample(config, model, state))
  return summary


def _pretrained(config: TrainConfig):
  """``(the --init-from checkpoint or None, problems)``, from its headers
  (with ``--resume`` too: the restored model has its dimensions)."""
  from zerojax.app import hf
  from zerojax.checkpoint import CheckpointError

  if not config.init_from:
    return None, []
  try:
    return hf.inspect(config.init_from), []
  except CheckpointError as e:
    return None, [str(e)]


def _require_app_dependencies():
  """The main job's own dependencies (the library needs neither), checked
  before any work."""
  import importlib.util

  missing = [
    m for m in ("tqdm", "matplotlib") if importlib.util.find_spec(m) is None
  ]
  if missing:
    print(
      f"python -m zerojax.train: error: the main job needs "
      f"{' and '.join(missing)} (not needed by the zerojax library); "
      f"install them with: pip install 'zerojax[app]'",
      file=sys.stderr,
    )
    raise SystemExit(2)


def _divergence(config: TrainConfig, log: run_log.RunLog, ckpt) -> str:
  """Why the run stopped early, what it kept, and the flags that fix it."""
  rec, last = log.diverged or {}, log.last_finite
  bad = ", ".join(
    f"{k} {rec[k]}"
    for k in ("loss", "grad_norm", "eval_loss")
    if k in rec and not math.isfinite(rec[k])
  )
  saved = sorted(ckpt.all_steps()) if ckpt is not None else []
  return (
    f"zerojax.train: error: the run diverged: {bad} at step {rec.get('step')}"
    + (f" (finite at step {last})" if last is not None else "")
    + f"; stopped after step {log.stopped_at}, exported and sampled nothing"
    + (
      ""
      if ckpt is None
      else f", and saved no checkpoint in {config.checkpoint_dir}"
      if not saved
      else f"; {config.checkpoint_dir} holds steps "
      f"{', '.join(map(str, saved))}, each saved after a step whose loss "
      f"and gradient norm were finite (its update may still be the one that "
      f"diverged: the loss after it was not read)"
    )
    + f". Lower --lr (now {config.lr:g}), lengthen --warmup (now "
    f"{config.warmup}) or lower --clip (now {config.clip:g})."
  )


def recipe(config: TrainConfig = TrainConfig()):
  """The main job's Optax optimizer, unwrapped: ``clip_by_global_norm``
  then AdamW (decay on matrices only) on a warmup-cosine schedule.
  Returns ``(optimizer, schedule)``; :mod:`zerojax.plan` plans with it."""
  import jax
  import optax

  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    config.lr,
    min(config.warmup, config.steps // 2),
    config.steps,
    end_value=config.lr * 0.1,
  )
  optimizer = optax.chain(
    optax.clip_by_global_norm(config.clip),
    optax.adamw(
      schedule,
      weight_decay=config.weight_decay,
      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1 and x.shape[-1] != 1, p),
    ),
  )
  return optimizer, schedule


def _optimizer(config: TrainConfig, mesh):
  """The ZeRO-wrapped AdamW (clipped, cosine schedule) and its schedule."""
  import jax.numpy as jnp

  import zerojax
  from zerojax.app import gpt

  optimizer, schedule = recipe(config)
  policy = (
    zerojax.Policy(param_dtype=jnp.bfloat16)
    if config.precision == "bf16"
    else zerojax.Policy()
  )
  tp = any(
    mesh.shape[a] > 1 for a in mesh.axis_names if a not in ("data", "replica")
  )
  zeropp = zerojax.ZeroPP(
    weight_bits=config.weight_bits or None,
    grad_bits=config.grad_bits or None,
    block_size=config.quant_block or None,
    grad_rounding=(
      None if config.grad_rounding == "auto" else config.grad_rounding
    ),
    hpz_size=config.hpz_size or None,
  )
  tx = zerojax.zero(
    optimizer,
    stage=config.stage,
    mesh=mesh,
    policy=policy,
    model_specs=gpt.model_specs() if tp else None,
    stacked=gpt.is_layer_stack if tp or config.offload_params else None,
    offload=float(config.offload),
    offload_params=config.offload_params,
    offload_grads=config.offload_grads,
    bucket_bytes=(int(config.bucket_mb * 2**20) if config.bucket_mb else None),
    zeropp=zeropp,
  )
  return tx, schedule


def _initial_state(config: TrainConfig, model, tx, say, pretrained=None):
  """``(state, first step, checkpointer or None)``: restored with
  ``--resume``, else loaded from ``--init-from``'s checkpoint, else
  created sharded under ``jit`` (with dropout, the state carries the root
  key)."""
  import jax

  import zerojax
  from zerojax import checkpoint
  from zerojax.app import gpt

  init_params = lambda key: gpt.init(model, key)
  key = jax.random.key(config.seed)
  ckpt = None
  if config.checkpoint_dir:
    ckpt = checkpoint.Checkpointer(
      config.checkpoint_dir, save_every=config.save_every, keep=3
    )
  if not config.resume and pretrained is not None:
    from zerojax.app import hf

    state = hf.load(
      pretrained,
      model,
      tx,
      key=jax.random.fold_in(key, 1) if config.dropout else None,
    )
    say(f"zerojax.train: initialised from {pretrained.path}", flush=True)
    return state, 0, ckpt
  if not config.resume:
    state = zerojax.init_from(
      init_params,
      tx,
      key,
      key=jax.random.fold_in(key, 1) if config.dropout else None,
    )
    zerojax.launch.release_free_heap()  # the init programs ran once
    return state, 0, ckpt
  state, extra = ckpt.restore(jax.eval_shape(init_params, key), tx)
  if config.dropout and state.key is None:  # saved by a run without
    state = state.replace(
      key=jax.device_put(
        jax.random.fold_in(key, 1),
        jax.sharding.NamedSharding(tx.mesh, jax.sharding.PartitionSpec()),
      )
    )
  start = int(extra["data_step"])
  say(
    f"zerojax.train: resumed from {config.checkpoint_dir} at step {start}",
    flush=True,
  )
  return state, start, ckpt


def _batches(config: TrainConfig, tx):
  """``batch_at(tokens, seed, step)``: this process's rows of a step's
  batch, placed as the step expects."""
  import zerojax
  from zerojax import distributed
  from zerojax.app import data

  rows = distributed.local_rows(zerojax.batch_sharding(tx), config.batch)

  def batch_at(tokens, seed, step):
    local = data.batch_at(
      tokens,
      seed=seed,
      step=step,
      batch=config.batch,
      seq_len=config.seq_len,
      rows=rows,
    )
    return zerojax.shard_batch(local, tx, config.batch)

  return batch_at


def _train(
  config: TrainConfig,
  state,
  start: int,
  train_step,
  batch_for,
  eval_loss,
  log: run_log.RunLog,
  ckpt,
  say,
):
  """Steps ``start + 1 .. config.steps``: ``(state, preempted step or
  None)``. Checkpoints asynchronously every ``save_every`` steps; on a
  preemption (SIGTERM on any process) every process saves the same step
  and stops; ``--resume`` continues."""
  import zerojax
  from zerojax import distributed

  log.bar.update(start)
  log.stopped_at = start
  preempted = None
  for step in range(start + 1, config.steps + 1):
    if log.diverged is not None:  # read at the last step, or before the first
      break
    state, metrics = train_step(state, batch_for(step))
    if step == start + 1:  # the step compiled on this call
      zerojax.launch.release_free_heap()
    log.bar.update(1)
    log.stopped_at = step
    extra = {"data_step": step, "seed": config.seed}
    if distributed.preemption_point(step):
      preempted = step
      saved = ckpt is not None and log.finite_at(step, metrics)
      if saved:
        ckpt.save(state, extra=extra, force=True)
      say(
        f"zerojax.train: preempted; stopping at step {step}"
        + (
          f", saved to {config.checkpoint_dir}"
          if saved
          else " (no --checkpoint-dir: nothing saved)"
          if ckpt is None
          else " (its loss is not finite: nothing saved)"
        ),
        flush=True,
      )
      log.window_steps += 1
      break
    if ckpt is not None and (
      step % config.save_every == 0 or step == config.steps
    ):
      if not log.finite_at(step, metrics):
        break  # a diverged state is never saved
      ckpt.save(state, extra=extra, force=True)
    is_eval = step % config.eval_every == 0 or step == config.steps
    log.after_step(step, metrics, is_eval)
    if is_eval and log.diverged is None:
      log.evaluation(step, eval_loss(state))
  log.close()
  if ckpt is not None:
    ckpt.close()  # waits for the last asynchronous save
  log.wall_s = time.perf_counter() - log.t_start
  return state, preempted


def _summary(
  config: TrainConfig,
  log: run_log.RunLog,
  mesh,
  devices,
  n_params: int,
  preempted,
  model: dict,
  jax_version: str,
) -> dict:
  import numpy as np

  from zerojax.app import mfu

  evals = [r["eval_loss"] for r in log.records if "eval_loss" in r]
  speeds = [r["tokens_per_s"] for r in log.records if "tokens_per_s" in r]
  speed = float(np.median(speeds)) if speeds else None
  return {
    "stage": config.stage,
    "n_devices": len(devices),
    "mesh": dict(mesh.shape),
    "preempted_at": preempted,
    "n_params": n_params,
    "steps": config.steps,
    "wall_s": log.wall_s,
    "first_eval_loss": evals[0],
    "last_eval_loss": evals[-1],
    "eval_drop": (
      1 - evals[-1] / evals[0] if math.isfinite(evals[-1] / evals[0]) else None
    ),
    "diverged_at": None if log.diverged is None else log.diverged["step"],
    "stopped_at": log.stopped_at,
    "tokens_per_s": speed,
    "flops_per_token": log.flops_per_token,
    "mfu": mfu.mfu(speed, log.flops_per_token, devices),
    "device_kind": devices[0].device_kind,
    "platform": devices[0].platform,
    "jax_version": jax_version,
    "model": model,
    "config": dataclasses.asdict(config),
  }


def _sample(config: TrainConfig, model, state) -> str:
  """Text the trained model writes after the prompt ``"The "``."""
  import jax
  import numpy as np

  import zerojax
  from zerojax.app import data, gpt

  # on the host, then one device: the sample needs no mesh, and a model
  # axis's split of the params (typed on an Explicit mesh) would not
  # type-check in a forward written for zerojax's step
  full = jax.device_get(zerojax.gather_params(state))
  prompt = np.frombuffer(b"The ", dtype=np.uint8).astype(np.int32)
  n = min(config.sample_len, config.seq_len - len(prompt))
  sample = jax.jit(lambda p, x, k: gpt.generate(p, x, n, k, model))(
    full, prompt, jax.random.key(config.seed)
  )
  return data.decode(run_log.host(sample))


if __name__ == "__main__":
  main(parse_args())
