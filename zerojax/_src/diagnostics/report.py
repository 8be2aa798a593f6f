"""``zerojax.report``: what a train step costs, measured next to theory.

Its sources, each labelled:

* **state bytes per device**, measured from the state arrays' addressable
  shards (padding included), next to the ZeRO formula for the stage;
* **collectives per step**, read from the compiled HLO (while-loop bodies
  times their trip counts, each collective counted by its full buffer), next
  to the formula: stage 0 all-reduce Ψ; stages 1-2 reduce-scatter Ψ +
  all-gather Ψ; stage 3 all-gather 2Ψ + reduce-scatter Ψ (times the
  micro-batches where the stage reduces or gathers per micro-batch); on a
  mesh with a model axis each tensor-parallel leaf counts Ψ_leaf/M, and
  with a replica axis an all-reduce of Ψ/N is added; with ZeRO++ each leaf
  as zerojax runs it (int8 / packed int4 blocks and their f32 scales,
  all-to-alls for qgZ, hpZ's secondary and in-node gathers, stacked
  leaves per layer; see :func:`zerojax._src.diagnostics.cost.stage_collectives`). Measured and theory
  compare ZeRO's collectives, those over the data and replica axes; a
  model axis's own (tensor parallelism's) are in the bytes per mesh axis
  (from each collective's replica groups), as are those crossing processes;
* **saved activations per device**: what the loss's backward pass keeps
  from its forward pass on one device's batch (device and host memory; the
  layer scans' stacked part apart), from
  ``jax.ad_checkpoint.print_saved_residuals`` (see
  :mod:`zerojax._src.jaxpr.activations`; Pa's splits applied, tensor
  parallelism's not);
* **whether the loss ran with JAX's per-device types** (read from the
  compiled program's operation names: ``records/mesh.UNTYPED_SCOPE``);
  without them stage 0 with one micro-batch all-reduces the leaves the
  loss uses without ``zerojax.gather`` after the backward pass, holding
  up to the whole gradient unreduced (``unreduced_grad_bytes``, the
  bound);
* **XLA's memory analysis** of the compiled step (argument, output, temp,
  alias bytes per device). On CPU its temp figure misses buffers inside loop
  bodies; do not read it as the peak.

Theory is counted in elements (dtype-independent: XLA's CPU backend runs
bf16 collectives in f32) and in bytes of the dtype zerojax asks for.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import jax
import numpy as np

from zerojax._src.diagnostics import cost
from zerojax._src.diagnostics import hlo as _hlo
from zerojax._src.diagnostics import hlo_memory as _hlo_memory
from zerojax._src.diagnostics import measure as _measure
from zerojax._src.diagnostics import offload_stream as _offload_stream
from zerojax._src.diagnostics import report_offload as _report_offload
from zerojax._src.diagnostics import schedule as _schedule
from zerojax._src.jaxpr import activations as _activations
from zerojax._src.records.mesh import UNTYPED_SCOPE
from zerojax._src.records.spec import ZeroState
from zerojax._src.step.deleted import reject_deleted
from zerojax._src.step.steps import loss_call


def theory_collectives(state: ZeroState, accum_steps: int = 1) -> dict:
  """ZeRO's collective volume per step: ``{kind: (elements, bytes)}``
  (:func:`zerojax._src.diagnostics.cost.stage_collectives`, ideal reading; with
  ZeRO++ as laid out: its blocks are the point). A replica axis's
  all-reduce counts as ``all-reduce``, as the compiled program names it."""
  theory = cost.stage_collectives(state.spec, accum_steps, ideal=True)
  merged = collections.defaultdict(lambda: [0, 0])
  for kind, (elems, nbytes) in theory.items():
    kind = "all-reduce" if kind == cost.REPLICA_ALL_REDUCE else kind
    merged[kind][0] += elems
    merged[kind][1] += nbytes
  return {kind: tuple(v) for kind, v in merged.items()}


@dataclasses.dataclass
class Report:
  """Measured and theoretical costs of one train step; see :func:`report`."""

  stage: int
  n_devices: int
  n_params: int
  state_bytes: dict
  theory_state_bytes: dict
  collectives: list
  collective_bytes: dict
  collective_elements: dict
  theory_collective_elements: dict
  theory_collective_bytes: dict
  xla_memory: dict
  mesh: dict = dataclasses.field(default_factory=dict)
  bytes_by_axis: dict = dataclasses.field(default_factory=dict)
  cross_process_bytes: int = 0
  offload: dict = dataclasses.field(default_factory=dict)
  zero_collective_bytes: dict = dataclasses.field(default_factory=dict)
  zero_collective_elements: dict = dataclasses.field(default_factory=dict)
  activations: dict = dataclasses.field(default_factory=dict)
  per_device_types: bool = True
  unreduced_grad_bytes: int = 0

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def to_json(self, **kw) -> str:
    return json.dumps(self.to_dict(), **kw)

  def ratios(self) -> dict:
    """measured / theory: state bytes (total), and by kind the elements
    (``kind``) and bytes (``"kind bytes"``) of ZeRO's collectives, those
    over the data and replica axes (a model axis's own collectives are
    tensor parallelism's, in :attr:`bytes_by_axis`)."""
    persistent = sum(
      v for k, v in self.theory_state_bytes.items() if k != "grads"
    )  # gradients are transient
    out = {"state_bytes": sum(self.state_bytes.values()) / max(persistent, 1)}
    elems = self.zero_collective_elements or self.collective_elements
    nbytes = self.zero_collective_bytes or self.collective_bytes
    for kind, t in self.theory_collective_elements.items():
      out[kind] = elems.get(kind, 0) / t
    for kind, t in self.theory_collective_bytes.items():
      out[f"{kind} bytes"] = nbytes.get(kind, 0) / t
    return out

  def __str__(self) -> str:
    lines = [
      f"zerojax stage {self.stage}: {self.n_params:,} params over "
      f"{self.n_devices} devices",
      *self._untyped_lines(),
      "",
      "state bytes per device      measured        theory",
    ]
    cats = list(self.state_bytes) + [
      c for c in self.theory_state_bytes if c not in self.state_bytes
    ]
    for c in cats:
      m = self.state_bytes.get(c)
      t = self.theory_state_bytes.get(c)
      lines.append(
        f"  {c:<24}{'' if m is None else f'{m:>12,}':>12}  "
        f"{'' if t is None else f'{t:>12,.0f}':>12}"
        + ("  (transient)" if c == "grads" else "")
      )
    elems = self.zero_collective_elements or self.collective_elements
    lines += [
      "",
      "ZeRO's collectives per step (compiled HLO, over the "
      "batch axes)   elements        theory",
    ]
    kinds = sorted(set(elems) | set(self.theory_collective_elements))
    for kind in kinds:
      m = elems.get(kind, 0)
      t = self.theory_collective_elements.get(kind, 0)
      lines.append(f"  {kind:<38}{m:>10,}  {t:>12,}")
    if self.bytes_by_axis:
      lines += [
        "",
        f"collective bytes per step by mesh axis (mesh {self.mesh})",
      ]
      for key, b in sorted(self.bytes_by_axis.items()):
        lines.append(f"  {key:<38}{b:>14,}")
      lines.append(
        f"  {'crossing processes':<38}{self.cross_process_bytes:>14,}"
      )
    if self.offload:
      lines += _report_offload.offload_lines(self.offload)
    a = self.activations
    if a.get("error"):
      lines += ["", f"saved activations: {a['error']}"]
    elif a:
      pa = f"; Pa took off {a['partitioned']:,}" if a.get("partitioned") else ""
      lines += [
        "",
        "saved activations per device (the loss on one device's "
        "batch; Pa's splits applied, tensor parallelism's not)",
        f"  device {a['device']:>14,}   host {a['host']:>14,}   "
        f"(layer scans {a['scan']:,}{pa})",
      ]
    lines += [
      "",
      "XLA memory analysis per device (temp misses loop-body "
      "buffers on CPU): "
      + ", ".join(f"{k} {v:,}" for k, v in self.xla_memory.items()),
    ]
    return "\n".join(lines)

  def _untyped_lines(self) -> list[str]:
    if self.per_device_types:
      return []
    held = (
      f": the leaves it uses without zerojax.gather are all-reduced after "
      f"the backward pass, not where it uses them, so each device holds up "
      f"to {self.unreduced_grad_bytes:,} bytes of unreduced gradient"
      if self.unreduced_grad_bytes
      else ""
    )
    return [
      "the loss ran with JAX's per-device types off (a loop, branch or "
      f"kernel they refuse; docs/design.md){held}"
    ]

  def _repr_markdown_(self) -> str:
    rows = ["| category | measured bytes/device | theory |", "|---|---|---|"]
    for c in sorted(set(self.state_bytes) | set(self.theory_state_bytes)):
      m, t = self.state_bytes.get(c), self.theory_state_bytes.get(c)
      rows.append(
        f"| {c} | {'' if m is None else f'{m:,}'} | "
        f"{'' if t is None else f'{t:,.0f}'} |"
      )
    rows += [
      "",
      "| collective | count | elements/step | theory |",
      "|---|---|---|---|",
    ]
    counts = collections.Counter()
    for c in self.collectives:
      counts[c["kind"]] += c["count"]
    elems = self.zero_collective_elements or self.collective_elements
    for kind in sorted(set(elems) | set(self.theory_collective_elements)):
      rows.append(
        f"| {kind} | {counts[kind]} | "
        f"{elems.get(kind, 0):,} | "
        f"{self.theory_collective_elements.get(kind, 0):,} |"
      )
    return "\n".join(rows)


def report(step, state: ZeroState, batch, *, link_gb_s: float = 50.0) -> Report:
  """Compiles ``step`` for ``(state, batch)`` and reports what it costs.

  Args:
    step: a :class:`zerojax.TrainStep`.
    state: its :class:`zerojax.ZeroState`.
    batch: an example batch (only shapes matter; nothing is run).
    link_gb_s: with offload, the host link's bandwidth each way in GB/s
      that the offload section states the transfer time at (default 50:
      PCIe 5 x16 as measured in practice, about 80% of its 64 GB/s).

  Returns:
    A :class:`Report`; ``print`` it, show it in a notebook, or ``to_json()``.

  Example:
    >>> r = zerojax.report(zerojax.train_step(loss_fn, tx), state, batch)
    >>> r.stage
    1
  """
  reject_deleted(state, "zerojax.report")
  if not link_gb_s > 0:
    raise ValueError(
      f"zerojax.report: link_gb_s={link_gb_s!r} must be a positive number "
      f"of GB/s (e.g. 50 for PCIe 5 x16, 25 for PCIe 4 x16)."
    )
  compiled = step.lower(state, batch).compile()
  hlo = compiled.as_text()
  spec = state.spec
  n = spec.tx.num_shards
  mesh = spec.tx.mesh
  colls = _hlo.collectives(hlo, mesh.devices.size)
  by_axis = collections.Counter()
  crossing = 0
  for c in colls:
    by_axis[
      f"{c.kind} over {'+'.join(_hlo.collective_axes(c, mesh)) or '-'}"
    ] += c.total_bytes
    if _hlo.crosses_processes(c, mesh):
      crossing += c.total_bytes
  by_kind_b, by_kind_e = collections.Counter(), collections.Counter()
  zero_b, zero_e = collections.Counter(), collections.Counter()
  batch_axes = set(spec.tx.batch_axes)
  for c in colls:
    by_kind_b[c.kind] += c.total_bytes
    by_kind_e[c.kind] += c.total_elements
    if set(_hlo.collective_axes(c, mesh)) <= batch_axes:
      zero_b[c.kind] += c.total_bytes
      zero_e[c.kind] += c.total_elements
  theory = theory_collectives(state, step.accum_steps)
  mem = compiled.memory_analysis()
  typed = UNTYPED_SCOPE not in hlo
  return Report(
    stage=spec.stage,
    n_devices=n,
    n_params=sum(r.size for r in spec.leaves if r.trainable),
    state_bytes=_measure.state_bytes(state),
    theory_state_bytes=_measure.theory_bytes(state),
    collectives=[dataclasses.asdict(c) for c in colls],
    collective_bytes=dict(by_kind_b),
    collective_elements=dict(by_kind_e),
    theory_collective_elements={k: v[0] for k, v in theory.items()},
    theory_collective_bytes={k: v[1] for k, v in theory.items()},
    xla_memory={
      "argument": mem.argument_size_in_bytes,
      "output": mem.output_size_in_bytes,
      "temp": mem.temp_size_in_bytes,
      "alias": mem.alias_size_in_bytes,
    },
    mesh={a: int(s) for a, s in mesh.shape.items()},
    bytes_by_axis=dict(by_axis),
    cross_process_bytes=crossing,
    zero_collective_bytes=dict(zero_b),
    zero_collective_elements=dict(zero_e),
    offload=(
      _offload_traffic(state, hlo, link_gb_s, step.accum_steps)
      if spec.place.offload or spec.config.offload_params
      else {}
    ),
    activations=_saved_activations(step, state, batch),
    per_device_types=typed,
    unreduced_grad_bytes=(
      int(_measure.theory_bytes(state)["grads"])
      if not typed and spec.stage == 0 and step.accum_steps == 1
      else 0
    ),
  )


def _saved_activations(step, state: ZeroState, batch) -> dict:
  """The loss's saved residuals on one device's micro-batch, with the
  whole params in their compute dtype (see :mod:`zerojax._src.jaxpr.activations`)."""
  spec = state.spec
  shards = math.prod(spec.tx.mesh.shape[a] for a in spec.tx.batch_axes)
  rows = shards * step.accum_steps
  params = spec.unflatten_params(
    [
      jax.ShapeDtypeStruct(
        r.aval.shape, r.compute_dtype if r.trainable else r.aval.dtype
      )
      for r in spec.leaves
    ]
  )

  def local(x):  # one device's rows; scalars as they are
    shape = np.shape(x)
    if not shape:
      return x
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    # as a step would take it: a NumPy int64 batch is int32 without x64
    dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jax.ShapeDtypeStruct((shape[0] // rows,) + shape[1:], dtype)

  local = jax.tree.map(local, batch)
  call = loss_call(state)
  key = None if state.key is None else jax.random.key(0)
  model_axes = {
    a: int(n)
    for a, n in spec.tx.mesh.shape.items()
    if a not in spec.tx.batch_axes
  }
  return _activations.saved_residuals(
    lambda p, b: call(step.loss_fn, p, b, key, state.model_state)[0],
    params,
    local,
    axes=model_axes,
  )


def _offload_traffic(
  state: ZeroState, hlo: str, link_gb_s: float, accum_steps: int = 1
) -> dict:
  """How the offloaded update runs and the bytes it moves per step per
  device, next to theory and to ZeRO-Offload's host-side update
  (compute-dtype gradients down and params up); the time each direction
  takes at ``link_gb_s``; and how the compiled schedule issues its copies
  between host and device memory.

  ``host_to_device_bytes`` / ``device_to_host_bytes`` are measured from
  the compiled program: on a backend with its own memory (TPU, GPU) the
  copies it issues, loop trip counts applied, so a layer stack's shard in
  host memory counts once per layer loop
  (:func:`zerojax._src.diagnostics.hlo_memory.host_transfers`;
  activations kept in host memory add theirs); on one with a single
  memory (XLA CPU), which issues no copies, the entry buffers in host
  memory, each counted once (``measured_from`` says which). Theory: the
  planner's :attr:`StagePlan.host_to_device` and
  :attr:`StagePlan.device_to_host`. ``host_copies[kind] = {"sync",
  "async", "overlapped"}``, ``overlapped`` counting the asynchronous
  copies with a matmul scheduled while they move (a copy in a loop body
  counted once); ``across_loops``, the copies and bytes in flight while a
  layer loop (the forward or backward pass) runs and those moved while
  none does
  (:func:`zerojax._src.diagnostics.schedule.host_copies_across_loops`);
  ``outside_loops_s``, the link's time at ``link_gb_s`` for the latter,
  one direction after the other as the default stream orders them (None
  where the program issues no host copies): no pass's compute hides it
  when the layers run in loops; on one H200 it was the time offload
  added to the step (docs/results.md, "Offload on the GPU")."""
  spec = state.spec
  state_host = cost.host_state_bytes(spec)
  params_host = cost.host_param_bytes(spec)
  stacks_host = cost.host_param_bytes(spec, stacked_only=True)
  # without a master copy the update reads the params' shards once more
  update_reads = 0 if spec.policy.has_master else params_host
  # offloaded gradients: written once in the backward pass, read once by
  # the update (the grad norm reads them there), or twice
  grads_host = cost.host_grad_bytes(spec)
  compute = (
    sum(
      r.size
      * np.dtype(r.compute_dtype).itemsize
      // r.shard.model_shards(spec.tx.model_axes)
      for r in spec.leaves
      if r.trainable
    )
    / spec.tx.num_shards
  )
  moved = _hlo_memory.host_transfers(hlo)
  if moved:
    down = moved.get("host-to-device", {}).get("bytes", 0)
    up = moved.get("device-to-host", {}).get("bytes", 0)
  else:
    spaces = _hlo_memory.entry_bytes_by_memory(hlo)
    down = spaces["arguments"].get("pinned_host", 0)
    up = spaces["outputs"].get("pinned_host", 0)
  copies = {
    kind: row
    for kind, row in _schedule.summary(hlo).items()
    if kind in ("host-to-device", "device-to-host")
  }
  streamed = _offload_stream.describe(spec)
  loops = _schedule.host_copies_across_loops(hlo)
  # a global norm of the gradients, computed first, reads them once more
  # per pass; each micro-batch after the first reads the sum so far and
  # every one writes it
  grads_read = grads_host * (accum_steps + streamed.get("norm_passes", 0))
  return {
    **streamed,
    "params_on_host": bool(params_host),
    "grads_on_host": bool(grads_host),
    "host_to_device_bytes": down,
    "device_to_host_bytes": up,
    "measured_from": "host copies" if moved else "entry buffers",
    "theory_host_to_device_bytes": int(
      state_host
      + (params_host + stacks_host) * accum_steps
      + update_reads
      + grads_read
    ),
    "theory_device_to_host_bytes": int(
      state_host + params_host + grads_host * accum_steps
    ),
    "theory_host_compute_bytes": int(2 * compute),
    "link_gb_s": float(link_gb_s),
    "host_to_device_s": down / (link_gb_s * 1e9),
    "device_to_host_s": up / (link_gb_s * 1e9),
    "host_copies": copies,
    "across_loops": loops,
    "outside_loops_s": (
      sum(loops[k]["bytes_outside_loops"] for k in _schedule.HOST_KINDS)
      / (link_gb_s * 1e9)
      if loops
      else None
    ),
  }
