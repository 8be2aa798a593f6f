"""The GPT planner: the main job's GPT priced by zerojax's own layouts on
abstract shapes (no array allocated). Each stage's plan (:func:`plan_gpt`),
its saved activations and working set, the peak a compiled step should
reach (:func:`predicted_peak`), the largest GPT that fits a device and what
stops one 2% larger (:func:`largest_fitting`, :func:`what_binds`), and the
least offload share it needs (:func:`offload_needed`). The command line
that prints them is :mod:`zerojax.app.plan_cli` (``python -m zerojax.plan``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import zerojax
from zerojax import cost
from zerojax.app import gpt, train
from zerojax.cost import (
  StagePlan,
)


def plan_gpt(
  abstract_params,
  stage: int,
  n_devices: int | None = None,
  *,
  mesh: dict | None = None,
  model_specs=None,
  stacked=None,
  optimizer=None,
  **kwargs,
) -> StagePlan:
  """:func:`zerojax.cost.plan_stage` with the main job's defaults: its
  optimizer (:func:`zerojax.app.train.recipe`, ``clip_by_global_norm`` then
  AdamW, so with the gradients on the host they are read twice, once for
  the norm) and the reference GPT's tensor-parallel rules
  (:func:`gpt.model_specs`, :func:`gpt.is_layer_stack`) on a mesh with a
  model axis."""
  if optimizer is None:
    optimizer, _ = train.recipe()
  if mesh is not None and mesh.get("model", 1) > 1:
    model_specs = gpt.model_specs() if model_specs is None else model_specs
  if stacked is None and (
    kwargs.get("offload_params")
    or kwargs.get("offload_grads")
    or (mesh and mesh.get("model", 1) > 1)
  ):
    stacked = gpt.is_layer_stack
  return cost.plan_stage(
    abstract_params,
    stage,
    n_devices,
    mesh=mesh,
    model_specs=model_specs,
    stacked=stacked,
    optimizer=optimizer,
    **kwargs,
  )


def abstract_gpt(config: gpt.GPTConfig):
  return jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))


def gpt_activations(
  config: gpt.GPTConfig,
  batch_per_device: int,
  *,
  model: int = 1,
  dtype=None,
  platform: str | None = None,
) -> dict | None:
  """Per-device bytes the reference GPT's backward pass keeps from its
  forward pass (ZeRO-R's activation checkpoints), by where they live.

  ``config.remat`` picks the policy (``"auto"`` resolved for ``platform``),
  ``model`` is the model-axis size M the tensor-parallel activations are
  split over, and ``config.seq_shard`` (Pa) splits the layer-boundary
  residual over it too. Per layer and token, in the compute dtype
  (``config.compute_dtype``, else ``dtype``, the params' dtype, default
  fp32):

  * ``"full"``: the block input, ``D`` (``D / M`` with Pa);
  * ``"dots"``: also the matmul outputs the backward pass reads: qkv
    ``3D / M``, the attention projection ``D`` (``D / M`` with Pa) and the
    first MLP matmul ``F / M`` (the second MLP matmul only feeds an add);
  * ``"offload"``: the ``"full"`` bytes in host memory (on the device, one
    layer's input while it moves: ``per_layer``, a transient);
  * ``"none"``: not modelled (every intermediate of the block is kept;
    returns ``None``).

  Returns ``{"device", "host", "per_layer"}`` in bytes (``per_layer``: one
  layer's saved bytes wherever they live). Checked against the compiled
  step's per-layer temp growth in ``tests/test_activations.py``.
  """
  config = config.resolved(platform)
  if config.remat == "none":
    return None
  dt = config.compute_dtype or dtype or jnp.float32
  c = np.dtype(dt).itemsize
  d, f = config.width, config.mlp_ratio * config.width
  s = model if config.seq_shard else 1
  per_token = d / s
  if config.remat == "dots":
    per_token += 3 * d / model + d / s + f / model
  per_layer = batch_per_device * config.seq_len * per_token * c
  total = per_layer * config.depth
  if config.remat == "offload":
    return {"device": 0.0, "host": total, "per_layer": per_layer}
  return {"device": total, "host": 0.0, "per_layer": per_layer}


def working_set(
  config: gpt.GPTConfig,
  stage: int,
  batch_per_device: int,
  policy: zerojax.Policy | None = None,
  model: int = 1,
  n_devices: int | None = None,
) -> float:
  """Per-device bytes a GPT step needs beyond the model state (zerojax's
  layer-scanned GPT): at stage 3 the forward and the backward layer
  gathered in the compute dtype and the layer's full gradient before its
  reduce-scatter; at stages 1-2 the updated weight shard in the compute
  dtype, which the all-gather reads while it overwrites the old params,
  and at stage 1 also the reduce-scatter's output (a gradient shard) while
  the full gradient is still live; at every stage the saved activations on
  the device (:func:`gpt_activations`; fp32 residuals per layer where its
  policy is not modelled) and the logits (fp32, with their gradient); at
  stage 0 a second full gradient, the all-reduce's output (XLA does not
  all-reduce in place: measured, zerojax and a plain-jit DP step alike).
  Temporary buffers inside a layer come on top. ``n_devices``: the
  data-parallel size, needed for the shards of stages 1-2."""
  policy = (
    zerojax.Policy(param_dtype=jnp.bfloat16) if policy is None else policy
  )
  if stage in (1, 2) and not n_devices:
    raise ValueError(
      f"plan.working_set at stage {stage} needs n_devices (the data-"
      f"parallel size): the step holds shards of 1/n_devices of the "
      f"weights; pass n_devices=N"
    )
  c = np.dtype(policy.compute(jnp.float32)).itemsize
  r = np.dtype(policy.reduce(jnp.float32)).itemsize
  layer = gpt._block_params(config.width, config.mlp_ratio)
  tokens = batch_per_device * config.seq_len
  psi = gpt.num_params(config)
  gathered = (2 * c + r) * layer if stage == 3 else 0
  reduced = r * psi if stage == 0 else 0
  if stage in (1, 2):
    reduced = (c + (r if stage == 1 else 0)) * psi / n_devices
  saved = gpt_activations(
    config, batch_per_device, model=model, dtype=policy.compute(jnp.float32)
  )
  saved = (
    tokens * config.width * 4 * config.depth
    if saved is None
    else saved["device"] or saved["per_layer"]
  )
  return float(gathered + reduced + saved + 2 * tokens * config.vocab * 4)


def predicted_peak(
  plan,
  config: gpt.GPTConfig,
  batch_per_device: int,
  n_devices: int,
  model: int = 1,
  plan_stage2=None,
) -> float:
  """The planner's per-device peak of the compiled step: the model state on
  the device (``plan.device``), :func:`working_set`, and the
  one in-layer buffer set that dominates at scale, the backward pass of
  attention when it materialises its scores (``"einsum"``): the
  probabilities, their gradient and the scores' gradient, three fp32
  ``(B, H, T, T)`` buffers live together in the softmax's backward.

  At stage 1 the reference GPT's gradient is reduce-scattered layer by
  layer in the backward pass, as at stage 2 (with one micro-batch zerojax
  compiles both stages to one program), so ``plan_stage2`` (the stage-2
  plan), when given, prices stage 1."""
  config = config.resolved("tpu")
  stage = plan.stage
  if stage == 1 and plan_stage2 is not None:
    plan, stage = plan_stage2, 2
  attention = 0.0
  if config.attention == "einsum":
    attention = (
      3 * batch_per_device * (config.heads // model) * config.seq_len**2 * 4
    )
  return (
    plan.device
    + working_set(
      config, stage, batch_per_device, model=model, n_devices=n_devices
    )
    + attention
  )


def largest_fitting(
  memory_bytes: float,
  stage: int,
  n_devices: int,
  seq_len: int = 2048,
  offload: bool | float = False,
  offload_params: bool = False,
  host_memory_bytes: float | None = None,
  offload_grads: bool = False,
) -> gpt.GPTConfig | None:
  """The largest GPT (by the count search) whose model state fits: its
  device-memory part within ``memory_bytes`` per device, with ``offload``
  / ``offload_params`` / ``offload_grads``. With ``host_memory_bytes`` (the pinned host memory
  a device's process may hold) the offloaded share is not ``offload`` but
  the least one with which the device part fits (as
  :func:`offload_needed` names it), and the host part at that share must
  fit too: host memory then bounds the model only where the device cannot
  take the rest (with ``offload_grads`` the whole state is offloaded)."""

  fit = _Fit(
    memory_bytes,
    stage,
    n_devices,
    offload=offload,
    offload_params=offload_params,
    host_memory_bytes=host_memory_bytes,
    offload_grads=offload_grads,
  )

  def fits(psi: float) -> bool:
    x = fit.plan(gpt.config_for_params(psi, seq_len=seq_len))
    return x is not None and fit.overflows(x) is None

  lo, hi = 1e7, 1e7
  if not fits(lo):
    return None
  while fits(hi) and hi < 1e16:
    lo, hi = hi, hi * 4
  for _ in range(40):  # bisect in log space
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if hi / lo < 1.002:
      break
  return gpt.config_for_params(lo, seq_len=seq_len)


@dataclasses.dataclass(frozen=True)
class _Fit:
  """The bounds :func:`largest_fitting` searches under, and how it prices
  one GPT against them."""

  memory_bytes: float
  stage: int
  n_devices: int
  offload: bool | float = False
  offload_params: bool = False
  host_memory_bytes: float | None = None
  offload_grads: bool = False

  def plan(self, config):
    """The GPT's plan at the offload share the search prices it at
    (``offload``, or with a host bound the least share with which the
    device part fits; all of it with ``offload_grads``); None where no
    share fits the device."""
    share = True if self.offload_grads else self.offload
    if self.host_memory_bytes is not None and not self.offload_grads:
      share = offload_needed(
        config,
        self.stage,
        self.memory_bytes,
        {"data": self.n_devices},
        self.offload_params,
      )
      if share is None:
        return None
    return plan_gpt(
      abstract_gpt(config),
      self.stage,
      self.n_devices,
      offload=share,
      offload_params=self.offload_params,
      offload_grads=self.offload_grads,
    )

  def overflows(self, x) -> str | None:
    """Which memory plan ``x`` overflows, the device's first; None: fits."""
    if x.device > self.memory_bytes:
      return "device"
    hb = self.host_memory_bytes
    if hb is not None and x.host > hb:
      return "host"
    return None


def device_parts(x) -> dict:
  """Plan ``x``'s device bytes per device, by part: the params' shards
  kept there, the master copy and optimizer state kept there, the
  gradients, and the streamed update's chunks (they sum to ``x.device``)."""
  return {
    "params": x.params - (x.params_host if x.offload else 0.0),
    "master and optimizer": x.master
    + x.optimizer
    - (x.host_bytes if x.offload else 0.0),
    "gradients": x.grads - (x.grads_host if x.offload else 0.0),
    "update chunks": x.update_transient,
  }


def what_binds(
  config: gpt.GPTConfig,
  memory_bytes: float,
  stage: int,
  n_devices: int,
  *,
  step: float = 1.02,
  **bounds,
) -> dict:
  """What keeps a GPT ``step`` times larger than ``config`` (the one
  :func:`largest_fitting` found, with the same arguments) from fitting:
  ``memory`` (``"device"`` or ``"host"``, the one it overflows, the
  device's checked first; None where it fits: the search stopped at its
  cap), ``device_parts`` (:func:`device_parts` of that larger GPT, bytes
  per device; empty where no offload share fits its device part),
  ``host`` (its bytes per device in host memory) and ``n_params`` (its
  parameter count). ``bounds``: ``offload``, ``offload_params``,
  ``host_memory_bytes``, ``offload_grads``, as :func:`largest_fitting`
  takes them."""
  bigger = gpt.config_for_params(
    step * gpt.num_params(config), seq_len=config.seq_len
  )
  fit = _Fit(memory_bytes, stage, n_devices, **bounds)
  x = fit.plan(bigger)
  if x is None:
    return {
      "memory": "device",
      "device_parts": {},
      "host": None,
      "n_params": gpt.num_params(bigger),
    }
  return {
    "memory": fit.overflows(x),
    "device_parts": device_parts(x),
    "host": x.host,
    "n_params": gpt.num_params(bigger),
  }


def offload_needed(
  config: gpt.GPTConfig,
  stage: int,
  memory_bytes: float,
  mesh: dict,
  offload_params: bool = False,
) -> float | None:
  """:func:`zerojax.cost.offload_fraction_needed` for this GPT: the least
  ``offload`` share with which its model state fits ``memory_bytes`` per
  device (0.0: fits on the device; None: not even all on the host)."""
  kw = dict(optimizer=train.recipe()[0])
  if mesh.get("model", 1) > 1:
    kw.update(model_specs=gpt.model_specs(), stacked=gpt.is_layer_stack)
  if offload_params:
    kw.update(offload_params=True, stacked=gpt.is_layer_stack)
  return cost.offload_fraction_needed(
    abstract_gpt(config), stage, memory_bytes, mesh=mesh, **kw
  )
