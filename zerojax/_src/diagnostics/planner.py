"""Planning a stage before renting: model-state bytes and collective bytes
per device from zerojax's own layouts, on abstract shapes.

:func:`plan_stage` runs :func:`zerojax.layout.make_spec` on ``jax.ShapeDtypeStruct``
params and an ``AbstractMesh``, so no array is allocated and 1024 devices
cost nothing; the bytes come from :mod:`zerojax._src.diagnostics.cost`, the
formulas ``zerojax.report`` and the layout table read too.
:func:`comm_time` turns collective bytes into seconds over fast and slow
links (:mod:`~zerojax._src.diagnostics.zeropp_comm` prices ZeRO++'s
settings from a parameter count).
Model-state memory, as in the ZeRO paper's Figure 1; :func:`saved_activations`
traces a user's loss abstractly for what its backward pass keeps (ZeRO-R's
activation checkpoints), and ``plan_stage(..., activations=...)`` adds it to
the working set. Temporary buffers and fragmentation come on top.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import numpy as np

from zerojax._src.diagnostics import cost
from zerojax._src.diagnostics import offload_stream as _offload_stream
from zerojax._src.diagnostics.plan_layout import mesh_sizes, plan_spec
from zerojax._src.jaxpr import activations as _activations
from zerojax._src.records.policy import Policy
from zerojax._src.step.loss_call import LossCall

GB = 1e9

# Bytes per second per chip and direction (stated in the output).
HARDWARE = {
  # TPU v5p: ICI ~1.8e11 B/s per axis; DCN ~6e9 B/s per chip
  "tpu-v5p": {
    "fast": 1.8e11,
    "slow": 6e9,
    "fast_name": "ICI",
    "slow_name": "DCN",
  },
  # H100 SXM: NVLink 900 GB/s bidirectional; one 400 Gb/s NDR NIC per GPU
  "h100": {
    "fast": 4.5e11,
    "slow": 5e10,
    "fast_name": "NVLink",
    "slow_name": "InfiniBand",
  },
}


@dataclasses.dataclass(frozen=True)
class StagePlan:
  stage: int
  n_params: int
  n_devices: int
  params: float  # bytes per device, by category
  master: float
  optimizer: float
  grads: float
  collectives: dict  # kind -> bytes per step (full-buffer convention)
  mesh: dict = dataclasses.field(default_factory=dict)
  comm: dict = dataclasses.field(
    default_factory=dict
  )  # per axis, see comm_time
  offload: bool = False  # some master + optimizer state in host memory
  # offload: per-device bytes of master + optimizer state in host memory
  host_bytes: float = 0.0
  # offload_params: per-device bytes of the params' shards in host memory
  params_host: float = 0.0
  # offload_params: the part of params_host in layer stacks (``stacked``)
  params_host_stacked: float = 0.0
  # offload_grads: per-device bytes of the reduced gradients in host memory
  grads_host: float = 0.0
  # offload_grads with an update that reads a global norm of them: the norm
  # is computed first, each gradient brought down whole in turn; the
  # largest, a fraction of grads_host (0.0: no such pass)
  norm_first_peak_fraction: float = 0.0
  norm_first: bool = False
  # how many such passes (two where a finiteness of the clipped gradients
  # is checked: the norm's pass, then the finiteness's)
  norm_passes: int = 0
  # micro-batches per step: each reads the offloaded params' shards; with
  # offload_grads each adds its gradient to the sum in host memory (read
  # and written once more per micro-batch)
  accum_steps: int = 1
  # offload: the largest streamed chunk's share of master + optimizer
  # (zerojax._src.step.offload; 1.0 when the update runs on the whole state)
  chunk_fraction: float = 1.0
  # offload: the most of master + optimizer state on the device at once
  # during the streamed update (chunks old and new, the next prefetched)
  in_flight_fraction: float = 1.0
  # saved activations per device (saved_activations(); 0: not planned)
  activations: float = 0.0  # in the device's memory
  activations_host: float = 0.0  # offloaded to pinned host memory

  @property
  def working_set(self) -> float:
    """Device bytes of the model state (:attr:`device`) plus the saved
    activations kept on the device."""
    return self.device + self.activations

  @property
  def total(self) -> float:
    return self.params + self.master + self.optimizer + self.grads

  @property
  def update_transient(self) -> float:
    """Offload: device bytes the streamed update holds at once (a chunk of
    master + optimizer state old and new, and the next chunk loading)."""
    if not self.offload:
      return 0.0
    return max(
      min(self.in_flight_fraction, 1.0) * (self.host_bytes + self.grads_host),
      self.norm_first_peak_fraction * self.grads_host,
    )

  @property
  def host_to_device(self) -> float:
    """Offload: bytes read from host memory per step per device: the
    offloaded state once; per micro-batch, an offloaded layer stack's
    shard once per layer loop (the forward's gathers and the backward's)
    and any other offloaded param's shard once (one read serves both
    passes' gathers: XLA merges the identical copies outside a loop, as
    the TPU compiler's program shows); with no master copy the update
    reads the params' shards once more; offloaded gradients once (their
    chunk's update reads them, and the step's grad norm reads them
    there), once more per pass that computes a global norm of them first
    (:attr:`norm_passes`) and once more per micro-batch after the first
    (the sum so far, read as each layer's gradient is added to it). With
    both params and gradients on the host over several micro-batches the
    compiler may merge identical reads of the first micro-batch (traced
    apart) and the scan over the rest, so this is an upper bound there."""
    if not self.offload:
      return 0.0
    again = 0.0 if self.master else self.params_host  # the update's weights
    return (
      self.host_bytes
      + (self.params_host + self.params_host_stacked) * self.accum_steps
      + again
      + self.grads_host
      * (self.accum_steps + max(self.norm_passes, int(self.norm_first)))
    )

  @property
  def device_to_host(self) -> float:
    """Offload: bytes written back to host memory per step per device:
    the offloaded state and params' shards once, the reduced gradients
    once per micro-batch (each writes the sum so far)."""
    if not self.offload:
      return 0.0
    return (
      self.host_bytes + self.params_host + self.grads_host * self.accum_steps
    )

  @property
  def host_traffic(self) -> float:
    """Offload: host<->device bytes per step per device, both ways."""
    return self.host_to_device + self.device_to_host

  @property
  def host(self) -> float:
    """Bytes per device kept in host memory (offload: the master copy and
    optimizer state of the leaves offloaded, the params' shards with
    ``offload_params``, the reduced gradients with ``offload_grads``)."""
    if not self.offload:
      return 0.0
    return self.host_bytes + self.params_host + self.grads_host

  @property
  def device(self) -> float:
    """Bytes per device in the accelerator's own memory at its peak (with
    offload: the update's streamed chunks included)."""
    return self.total - self.host + self.update_transient


def plan_stage(
  abstract_params,
  stage: int | None = None,
  n_devices: int | None = None,
  *,
  tx=None,
  mesh: dict | None = None,
  optimizer=None,
  policy: Policy | None = None,
  model_specs=None,
  stacked=None,
  offload: bool | float | None = None,
  offload_params: bool | None = None,
  offload_grads: bool | None = None,
  activations: dict | None = None,
  accum_steps: int = 1,
) -> StagePlan:
  """Per-device bytes and collective bytes for one stage, from zerojax's layouts.

  ``tx``: a :func:`zerojax.zero` transformation, planned as built (e.g.
  ``plan_stage(jax.eval_shape(init_fn, key), tx=tx)``); ``offload*``
  given beside it replace its own. Without it, ``stage`` and
  ``n_devices`` or ``mesh`` describe the layout (AdamW, bf16 params with
  an fp32 master copy, unless ``optimizer`` and ``policy`` say otherwise).

  ``offload``: the master copy and optimizer state in host memory
  (``zero(..., offload=True)``), or that fraction of their bytes (a float,
  as ``zero`` takes it); :attr:`StagePlan.device` and
  :attr:`StagePlan.host` split the total. :func:`offload_fraction_needed`
  finds the least fraction a device's memory needs. ``offload_params``:
  stage 3's parameter shards in host memory too (the layers in use, in
  the working set, come to the device). ``offload_grads``: the reduced
  gradients in host memory too (stages 2-3 with ``offload=True``); the
  chunks the update streams then carry their gradients.

  ``mesh``: axis sizes (e.g. ``{"replica": 4, "data": 256}``); default a
  1-D data mesh of ``n_devices``. Collective bytes are per data-axis group
  (full-buffer convention), plus ``"all-reduce over replica"`` (the shard,
  hybrid sharding). ``model_specs`` / ``stacked``: as
  :func:`zerojax.zero` takes them, needed when ``mesh`` has a model axis.
  ``activations``: :func:`saved_activations`'s figure, added to
  :attr:`StagePlan.working_set`. ``accum_steps``: micro-batches per step,
  which the offloaded params' and gradients' host traffic counts."""
  if (
    isinstance(accum_steps, bool)
    or not isinstance(accum_steps, numbers.Integral)
    or accum_steps < 1
  ):
    raise ValueError(
      f"plan_stage: accum_steps={accum_steps!r}; give the micro-batches "
      f"per step, a whole number >= 1."
    )
  if tx is None and stage is not None:
    mesh = mesh_sizes(n_devices, mesh)
    n_devices = None
  spec = plan_spec(
    abstract_params,
    stage,
    n_devices,
    tx=tx,
    mesh=mesh,
    optimizer=optimizer,
    policy=policy,
    model_specs=model_specs,
    stacked=stacked,
    offload=offload,
    offload_params=offload_params,
    offload_grads=offload_grads,
  )
  tx = spec.tx
  mesh = dict(tx.config.mesh.shape)
  state = cost.stage_state_bytes(spec, ideal=False)
  optimizer_bytes = sum(
    v for k, v in state.items() if k.startswith("opt_state.")
  )
  n_params = sum(leaf.size for leaf in spec.leaves)
  colls = {
    k: v[1] for k, v in cost.stage_collectives(spec, ideal=False).items()
  }
  offloaded = spec.place.offload or tx.config.offload_params
  streamed = _offload_stream.describe(spec) if spec.place.offload else {}
  return StagePlan(
    tx.config.stage,
    n_params,
    tx.num_shards,
    state["params"],
    state.get("master", 0.0),
    optimizer_bytes,
    state.get("grads", 0.0),
    colls,
    mesh,
    offload=offloaded,
    host_bytes=cost.host_state_bytes(spec),
    params_host=cost.host_param_bytes(spec),
    params_host_stacked=cost.host_param_bytes(spec, stacked_only=True),
    grads_host=cost.host_grad_bytes(spec),
    chunk_fraction=streamed.get("largest_chunk_fraction", 1.0),
    in_flight_fraction=streamed.get("in_flight_fraction", 1.0),
    norm_first_peak_fraction=streamed.get("norm_first_peak_fraction", 0.0),
    norm_first=streamed.get("norm_first", False),
    norm_passes=streamed.get("norm_passes", 0),
    accum_steps=accum_steps,
    activations=float((activations or {}).get("device", 0)),
    activations_host=float((activations or {}).get("host", 0)),
  )


def saved_activations(
  loss_fn,
  params,
  batch,
  *,
  mesh: dict | None = None,
  compute_dtype=None,
  key=None,
  model_state=None,
) -> dict:
  """Per-device bytes ``loss_fn``'s backward pass keeps from its forward
  pass, traced abstractly (nothing is allocated or compiled).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), the
      model's own loss, as ``zerojax.train_step`` takes it.
    params: the params' shapes (``jax.eval_shape(init_fn, key)``) or arrays.
    batch: **one device's** batch (shapes or arrays).
    mesh: mesh axis sizes (``{"data": 4, "model": 2}``); the
      :class:`zerojax.Remat` blocks' Pa splits over them are applied.
    compute_dtype: the dtype floating params are used in (e.g. bf16 under
      ``Policy(compute_dtype=...)``); default their own.
    key, model_state: for a loss written for ``zerojax.init(...,
      key=..., model_state=...)``: it is called as ``loss_fn(params, batch,
      key=key, model_state=model_state)`` (dropout keys, batch statistics),
      ``key`` a PRNG key, ``model_state`` shapes or arrays.

  Returns:
    ``{"device", "host", "scan", "partitioned", "count", "lines"}``: bytes
    kept on the device, in host memory (Pa+cpu), the layer scans' stacked
    part, the bytes Pa's splits take off, the number of saved tensors, and
    each one's ``(shape, itemsize, "device" | "host", in a scan)``.
    Tensor parallelism's splits of a block's inside are not applied.
  """

  def abstract(x):
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      return jax.ShapeDtypeStruct(np.shape(x), dtype)  # e.g. NNX RNG state
    dtype = np.dtype(dtype) if dtype is not None else np.result_type(x)
    if compute_dtype is not None and np.issubdtype(dtype, np.floating):
      dtype = np.dtype(compute_dtype)
    return jax.ShapeDtypeStruct(np.shape(x), dtype)

  call = LossCall(
    has_key=key is not None, has_model_state=model_state is not None
  )
  out = _activations.saved_residuals(
    lambda p, b, ms: call(loss_fn, p, b, key, ms)[0],
    jax.tree.map(abstract, params),
    jax.tree.map(abstract, batch),
    None if model_state is None else jax.tree.map(abstract, model_state),
    axes=dict(mesh or {}),
  )
  if "error" in out:
    raise ValueError(f"zerojax.cost.saved_activations: {out['error']}")
  out.pop("unread", None)
  return out


def _slices_spanned(mesh: dict, axes: tuple, slices: int) -> tuple[int, int]:
  """(chips in one group of ``axes``, slices such a group spans): the
  device order is the mesh's, slices cut it into equal contiguous blocks."""
  names = list(mesh)
  total = math.prod(mesh.values())
  chips = total // slices
  size = math.prod(mesh[a] for a in axes)
  # the group's extent in the flat order: from its innermost axis's stride
  # to its outermost axis's span
  outer = min(names.index(a) for a in axes)
  extent = math.prod(mesh[a] for a in names[outer:])
  return size, max(1, min(slices, extent // chips))


def comm_time(
  p: StagePlan,
  slices: int = 1,
  hardware: str = "tpu-v5p",
  fast: float | None = None,
  slow: float | None = None,
  algorithm: str = "hierarchical",
) -> dict:
  """Per mesh axis: bytes per chip over fast and slow links, and seconds.

  See the module docstring for the model; ``algorithm="ring"``: one flat
  ring per group, whose slow hops each carry the whole ring's traffic."""
  hw = dict(HARDWARE[hardware])
  fast = float(hw["fast"]) if fast is None else fast
  slow = float(hw["slow"]) if slow is None else slow
  mesh = p.mesh
  batch_axes = tuple(a for a in ("replica", "data") if a in mesh)
  out = {}

  def add(label, axes, kind_factor, buffer):
    a, s = _slices_spanned(mesh, axes, slices)
    if a <= 1 or not buffer:
      return
    inside = a // s  # the group's chips in one slice
    if algorithm == "ring" and s > 1:
      sl = kind_factor * (a - 1) / a * buffer
      f = sl if inside > 1 else 0.0  # every hop crosses when inside = 1
    else:
      f = kind_factor * (inside - 1) / inside * buffer
      sl = kind_factor * (s - 1) / s * buffer / inside if s > 1 else 0.0
    e = out.setdefault(label, {"fast_bytes": 0.0, "slow_bytes": 0.0})
    e["fast_bytes"] += f
    e["slow_bytes"] += sl

  c = p.collectives
  if p.stage == 0:
    add("+".join(batch_axes), batch_axes, 2, c.get("all-reduce", 0))
  else:
    add(
      "data", ("data",), 1, c.get("reduce-scatter", 0) + c.get("all-gather", 0)
    )
    add("data", ("data",), 2, c.get("all-reduce", 0))  # replicated leaves
    if "replica" in mesh:
      add("replica", ("replica",), 2, c.get("all-reduce over replica", 0))
  for e in out.values():
    e["seconds"] = e["fast_bytes"] / fast + e["slow_bytes"] / slow
  return out
