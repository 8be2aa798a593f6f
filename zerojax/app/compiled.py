"""The reference GPT's step compiled for a TPU topology, beside the plan.

    python -m zerojax.plan --topology v5p:4x4x4 --params 8e9 --batch 1 --compile

For each stage asked for, the main job's step (the reference GPT of
:mod:`zerojax.app.gpt`, the main job's optimizer
(:func:`zerojax.app.train.recipe`: ``clip_by_global_norm`` then AdamW),
bf16 params with an fp32 master copy, offloaded as the plan is: as the
planner prices it) is lowered on abstract state and batch over the
topology's chips and compiled by the TPU compiler (libtpu: ``pip install
'zerojax[tpu]'``). Nothing is allocated: the state and the batch are
shapes only. Reported per chip from the compiled program
(:func:`zerojax.aot.compiled_report`): the peak (arguments + outputs +
temp - aliases), the planner's prediction of it when given one
(:func:`zerojax.app.planner.predicted_peak`), collectives by kind and mesh
axis with bytes, and how each is issued (asynchronous, overlapping a
matmul).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import zerojax
from zerojax import aot
from zerojax.app import gpt, train


def compile_stage(
  config: gpt.GPTConfig,
  stage: int,
  mesh,
  batch_per_device: int,
  predicted: float | None = None,
  *,
  optimizer=None,
  **offload,
) -> dict:
  """Compile the reference GPT's train step at ``stage`` on ``mesh`` (a
  :func:`zerojax.aot.topology_mesh`) for ``batch_per_device`` sequences
  per data-parallel device; returns :func:`zerojax.aot.compiled_report`'s
  dict plus ``lower_s``, ``compile_s``, ``host_peak_rss`` (this
  process's peak resident bytes: what compiling took here) and, given
  ``predicted`` (the
  planner's bytes per device), ``predicted`` and ``peak_vs_predicted``.
  ``optimizer``: the Optax optimizer (default the main job's,
  :func:`zerojax.app.train.recipe`); ``offload``: ``offload``,
  ``offload_params``, ``offload_grads`` for :func:`zerojax.zero`, as
  the plan priced them (recorded in the result)."""
  config = config.resolved("tpu")
  policy = zerojax.Policy(param_dtype=jnp.bfloat16)
  optimizer = train.recipe()[0] if optimizer is None else optimizer
  # the layer stacks as the planner lays them out with these options
  # (:func:`zerojax.app.planner.plan_gpt`)
  stacked = (
    gpt.is_layer_stack
    if offload.get("offload_params") or offload.get("offload_grads")
    else None
  )
  tx = zerojax.zero(
    optimizer, stage=stage, mesh=mesh, policy=policy, stacked=stacked, **offload
  )
  state = jax.eval_shape(
    lambda k: zerojax.init_from(lambda key: gpt.init(config, key), tx, k),
    jax.random.key(0),
  )
  rows = batch_per_device * mesh.shape["data"] * mesh.shape.get("replica", 1)
  batch = aot.abstract_batch(
    {k: ((rows, config.seq_len), jnp.int32) for k in ("x", "y")}
  )
  step = zerojax.train_step(lambda p, b: gpt.loss(p, b, config), tx)
  t0 = time.perf_counter()
  lowered = step.lower(state, batch)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  out = {
    "stage": stage,
    **offload,
    "topology": str(mesh.devices.flat[0].device_kind),
    "chips": mesh.size,
    "libtpu": _version("libtpu"),
    "lower_s": t1 - t0,
    "compile_s": time.perf_counter() - t1,
    "host_peak_rss": _peak_rss(),
  }
  out.update(aot.compiled_report(compiled, mesh))
  if predicted is not None:
    out["predicted"] = float(predicted)
    out["peak_vs_predicted"] = out["memory"]["peak"] / predicted
  return out


def _peak_rss() -> int | None:
  """This process's peak resident memory in bytes so far (Linux, macOS)."""
  try:
    import resource
  except ImportError:  # Windows
    return None
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  import sys

  return int(rss if sys.platform == "darwin" else rss * 1024)


def _version(package: str) -> str | None:
  import importlib.metadata

  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def table(rows: list[dict]) -> str:
  """A markdown table of :func:`compile_stage` results."""
  mib = lambda b: f"{b / 2**20:,.0f}"
  lines = [
    "| stage | peak MiB | planner MiB | peak / planner | temp MiB | "
    "collectives (count, MiB) | async (overlapped) | compile s |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    kinds = ", ".join(
      f"{k} {v['count']} ({mib(v['bytes'])})"
      for k, v in sorted(r["collectives"].items())
    )
    issued = ", ".join(
      f"{k} {v['async']}/{v['sync'] + v['async']} ({v['overlapped']})"
      for k, v in sorted(r["issued"].items())
    )
    ratio = r.get("peak_vs_predicted")
    lines.append(
      f"| {r['stage']} | {mib(r['memory']['peak'])} | "
      f"{mib(r['predicted']) if 'predicted' in r else '-'} | "
      f"{'-' if ratio is None else f'{ratio:.2f}'} | "
      f"{mib(r['memory']['temp'])} | {kinds} | {issued} | "
      f"{r['compile_s']:.0f} |"
    )
  return "\n".join(lines)
