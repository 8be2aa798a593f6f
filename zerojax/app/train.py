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

import dataclasses
import functools
import json
import math
import pathlib
import sys
import time

from zerojax.app import run_log
from zerojax.app.train_config import TrainConfig, check, parse_args, resolve


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


def recipe(config: TrainConfig | None = None):
  """The main job's Optax optimizer, unwrapped: ``clip_by_global_norm``
  then AdamW (decay on matrices only) on a warmup-cosine schedule, for
  ``config`` (default: :class:`TrainConfig`'s defaults). Returns
  ``(optimizer, schedule)``; :mod:`zerojax.plan` plans with it."""
  config = TrainConfig() if config is None else config
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
