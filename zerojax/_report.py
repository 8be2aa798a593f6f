"""``zerojax.report``: what a train step costs, measured next to theory.

Three sources, each labelled:

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
  leaves per layer; see :func:`_theory_zeropp`). Measured and theory
  compare ZeRO's collectives, those over the data and replica axes; a
  model axis's own (tensor parallelism's) are in the bytes per mesh axis
  (from each collective's replica groups), as are those crossing processes;
* **saved activations per device**: what the loss's backward pass keeps
  from its forward pass on one device's batch (device and host memory; the
  layer scans' stacked part apart), from
  ``jax.ad_checkpoint.print_saved_residuals`` (see
  :mod:`zerojax._activations`; model-axis splits not applied);
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

import numpy as np

import jax

from zerojax import _activations, _hlo, _inspect, _offload, _zeropp
from zerojax._spec import ZeroState
from zerojax._step import loss_call


def theory_collectives(state: ZeroState, accum_steps: int = 1) -> dict:
  """ZeRO's collective volume per step: ``{kind: (elements, bytes)}``."""
  spec = state.spec
  if spec.tx.zeropp.active:
    return _theory_zeropp(spec, accum_steps)
  k = accum_steps
  elems = rbytes = cbytes = 0
  sizes = spec.tx.model_axes
  for r in spec.leaves:
    if not r.trainable:
      continue
    # a tensor-parallel leaf: each data-axis group moves its model shard
    size = r.size // r.shard.model_shards(sizes)
    elems += size
    rbytes += size * np.dtype(r.reduce_dtype).itemsize
    cbytes += size * np.dtype(r.compute_dtype).itemsize
  stage = spec.stage
  if stage == 0:
    return {"all-reduce": (elems, rbytes)}
  rs = 1 if stage == 1 else k
  ag = {1: 1, 2: 1, 3: 2 * k}[stage]
  out = {"reduce-scatter": (rs * elems, rs * rbytes),
         "all-gather": (ag * elems, ag * cbytes)}
  if spec.tx.replica_axis:     # hybrid: the shard, summed over replicas once
    n = spec.tx.num_shards
    out["all-reduce"] = (elems // n, rbytes // n)
  return out



def _local_elements(spec, r) -> int:
  """Elements of leaf ``r``'s shard that one device's data-axis collective
  moves: the storage shard over the data axis, cut by the model axes
  except on the dimension it shares with the data axis (that one enters
  whole over the model axes; see ``_gather.over_model_shards``)."""
  sizes, n = spec.tx.model_axes, spec.tx.num_shards
  m = 1
  for d, size in enumerate(r.shard.storage_shape):
    if d == r.shard.dim:
      m *= size // n
    else:
      m *= size // math.prod(int(sizes[a]) for a in r.shard.model_axes(d))
  return m


def _quantized(rows: int, m: int, bits: int, block: int) -> tuple[int, int]:
  """``(elements, bytes)`` of :func:`_zeropp.quantize` on ``rows`` rows of
  ``m``: int8 (or packed int4) blocks and one f32 scale per block."""
  b = _zeropp.block_for(m, block)
  nb = -(-m // b)
  data = rows * nb * b * bits // 8
  return data + rows * nb, data + 4 * rows * nb


def _theory_zeropp(spec, k: int) -> dict:
  """ZeRO++'s collectives per step, each leaf as zerojax runs it: stacked
  leaves gathered and reduce-scattered per layer (the GPT's scan), blocks
  padded as :mod:`zerojax._zeropp` pads them, full-buffer convention.

  * weight all-gathers (stage 3) per micro-batch, stacked leaves in the
    forward and again in the rematerialised backward, others once (their
    gathered value is saved for the backward): the compute dtype, or with
    qwZ the int8 blocks and scales of every shard; with hpZ, once per step the secondary (``1/hpz`` of the
    leaf, quantized with qwZ) across nodes, then in-node gathers of the
    whole leaf in the compute dtype;
  * the gradient: a reduce-scatter in the reduce dtype, or with qgZ an
    all-to-all of every device's quantized chunks (two when hierarchical:
    the whole gradient inside the node, ``1/node`` of it across);
  * a replica axis adds the shard's full-precision all-reduce.
  """
  tx, stage = spec.tx, spec.stage
  zpp, n = tx.zeropp, tx.num_shards
  node, hpz = tx.qgz_node_size, (zpp.hpz_size or 0) if stage == 3 else 0
  out = collections.defaultdict(lambda: [0, 0])

  def add(kind, elems, nbytes, times=1):
    out[kind][0] += times * elems
    out[kind][1] += times * nbytes

  def plain(kind, elems, dtype, times=1):     # a full-precision collective
    add(kind, elems, elems * np.dtype(dtype).itemsize, times)
  for r in spec.leaves:
    if not r.trainable:
      continue
    if not r.shard.sharded:        # replicated: all-reduced, full precision
      plain("all-reduce", r.size // r.shard.model_shards(tx.model_axes),
            r.reduce_dtype)
      continue
    per_layer = stage >= 2 and r.stacked and r.shard.dim != 0
    layers = r.shard.storage_shape[0] if per_layer else 1
    m = _local_elements(spec, r) // layers       # one call's local shard
    calls = k * layers if stage >= 2 else 1
    # gathered again in the backward where rematerialised (the layer scan)
    gathers = k * layers * (2 if per_layer else 1)
    if stage < 3:                   # stages 1-2: the new params, gathered
      plain("all-gather", n * m * layers, r.compute_dtype)
    elif hpz:                       # the secondary once, then in-node
      if zpp.weight_bits:
        add("all-gather", *_quantized(n // hpz, m * layers, zpp.weight_bits,
                                      zpp.block))
      else:
        plain("all-gather", n // hpz * m * layers, r.compute_dtype)
      plain("all-gather", n * m, r.compute_dtype, gathers)
    elif zpp.weight_bits:
      add("all-gather", *_quantized(n, m, zpp.weight_bits, zpp.block), gathers)
    else:
      plain("all-gather", n * m, r.compute_dtype, gathers)
    if zpp.grad_bits and node:
      add("all-to-all", *_quantized(node, n // node * m, zpp.grad_bits,
                                    zpp.block), calls)
      add("all-to-all", *_quantized(n // node, m, zpp.grad_bits,
                                    zpp.block), calls)
    elif zpp.grad_bits:
      add("all-to-all", *_quantized(n, m, zpp.grad_bits, zpp.block),
          calls)
    else:
      plain("reduce-scatter", n * m, r.reduce_dtype, calls)
    if tx.replica_axis:
      plain("all-reduce", m * layers, r.reduce_dtype)
  return {kind: tuple(v) for kind, v in out.items()}


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

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def to_json(self, **kw) -> str:
    return json.dumps(self.to_dict(), **kw)

  def ratios(self) -> dict:
    """measured / theory: state bytes (total), and by kind the elements
    (``kind``) and bytes (``"kind bytes"``) of ZeRO's collectives, those
    over the data and replica axes (a model axis's own collectives are
    tensor parallelism's, in :attr:`bytes_by_axis`)."""
    persistent = sum(v for k, v in self.theory_state_bytes.items()
                     if k != "grads")          # gradients are transient
    out = {"state_bytes": sum(self.state_bytes.values()) / max(persistent, 1)}
    elems = self.zero_collective_elements or self.collective_elements
    nbytes = self.zero_collective_bytes or self.collective_bytes
    for kind, t in self.theory_collective_elements.items():
      out[kind] = elems.get(kind, 0) / t
    for kind, t in self.theory_collective_bytes.items():
      out[f"{kind} bytes"] = nbytes.get(kind, 0) / t
    return out

  def __str__(self) -> str:
    lines = [f"zerojax stage {self.stage}: {self.n_params:,} params over "
             f"{self.n_devices} devices", "",
             "state bytes per device      measured        theory"]
    cats = list(self.state_bytes) + [c for c in self.theory_state_bytes
                                     if c not in self.state_bytes]
    for c in cats:
      m = self.state_bytes.get(c)
      t = self.theory_state_bytes.get(c)
      lines.append(f"  {c:<24}{'' if m is None else f'{m:>12,}':>12}  "
                   f"{'' if t is None else f'{t:>12,.0f}':>12}"
                   + ("  (transient)" if c == "grads" else ""))
    elems = self.zero_collective_elements or self.collective_elements
    lines += ["", "ZeRO's collectives per step (compiled HLO, over the "
              "batch axes)   elements        theory"]
    kinds = sorted(set(elems) | set(self.theory_collective_elements))
    for kind in kinds:
      m = elems.get(kind, 0)
      t = self.theory_collective_elements.get(kind, 0)
      lines.append(f"  {kind:<38}{m:>10,}  {t:>12,}")
    if self.bytes_by_axis:
      lines += ["", f"collective bytes per step by mesh axis (mesh "
                f"{self.mesh})"]
      for key, b in sorted(self.bytes_by_axis.items()):
        lines.append(f"  {key:<38}{b:>14,}")
      lines.append(f"  {'crossing processes':<38}{self.cross_process_bytes:>14,}")
    if self.offload:
      o = self.offload
      how = (f"streamed in {o['chunks']} chunks (largest "
             f"{o['largest_chunk_fraction']:.1%} of the offloaded state)"
             if o["streamed"] else f"whole state at once ({o['reason']})")
      lines += ["", f"offload: update {how}",
                f"  host->device bytes/step per device   "
                f"{o['host_to_device_bytes']:>14,}  theory "
                f"{o['theory_streamed_bytes']:>14,}",
                f"  device->host bytes/step per device   "
                f"{o['device_to_host_bytes']:>14,}  theory "
                f"{o['theory_streamed_bytes']:>14,}",
                f"  (ZeRO-Offload's host-side update would move "
                f"{o['theory_host_compute_bytes']:,}: compute-dtype "
                f"gradients down, params up)"]
    a = self.activations
    if a.get("error"):
      lines += ["", f"saved activations: {a['error']}"]
    elif a:
      lines += ["", "saved activations per device (the loss on one device's "
                "batch, before model-axis splits)",
                f"  device {a['device']:>14,}   host {a['host']:>14,}   "
                f"(layer scans {a['scan']:,})"]
    lines += ["", "XLA memory analysis per device (temp misses loop-body "
              "buffers on CPU): " + ", ".join(
                  f"{k} {v:,}" for k, v in self.xla_memory.items())]
    return "\n".join(lines)

  def _repr_markdown_(self) -> str:
    rows = ["| category | measured bytes/device | theory |", "|---|---|---|"]
    for c in sorted(set(self.state_bytes) | set(self.theory_state_bytes)):
      m, t = self.state_bytes.get(c), self.theory_state_bytes.get(c)
      rows.append(f"| {c} | {'' if m is None else f'{m:,}'} | "
                  f"{'' if t is None else f'{t:,.0f}'} |")
    rows += ["", "| collective | count | elements/step | theory |", "|---|---|---|---|"]
    counts = collections.Counter()
    for c in self.collectives:
      counts[c["kind"]] += c["count"]
    elems = self.zero_collective_elements or self.collective_elements
    for kind in sorted(set(elems) | set(self.theory_collective_elements)):
      rows.append(f"| {kind} | {counts[kind]} | "
                  f"{elems.get(kind, 0):,} | "
                  f"{self.theory_collective_elements.get(kind, 0):,} |")
    return "\n".join(rows)


def report(step, state: ZeroState, batch) -> Report:
  """Compiles ``step`` for ``(state, batch)`` and reports what it costs.

  Args:
    step: a :class:`zerojax.TrainStep`.
    state: its :class:`zerojax.ZeroState`.
    batch: an example batch (only shapes matter; nothing is run).

  Returns:
    A :class:`Report`; ``print`` it, show it in a notebook, or ``to_json()``.
  """
  compiled = step.lower(state, batch).compile()
  hlo = compiled.as_text()
  spec = state.spec
  n = spec.tx.num_shards
  mesh = spec.tx.mesh
  colls = _hlo.collectives(hlo, mesh.devices.size)
  by_axis = collections.Counter()
  crossing = 0
  for c in colls:
    by_axis[f"{c.kind} over {'+'.join(_hlo.axes_of(c, mesh)) or '-'}"] += (
        c.total_bytes)
    if _hlo.crosses_processes(c, mesh):
      crossing += c.total_bytes
  by_kind_b, by_kind_e = collections.Counter(), collections.Counter()
  zero_b, zero_e = collections.Counter(), collections.Counter()
  batch_axes = set(spec.tx.batch_axes)
  for c in colls:
    by_kind_b[c.kind] += c.total_bytes
    by_kind_e[c.kind] += c.total_elements
    if set(_hlo.axes_of(c, mesh)) <= batch_axes:
      zero_b[c.kind] += c.total_bytes
      zero_e[c.kind] += c.total_elements
  theory = theory_collectives(state, step.accum_steps)
  mem = compiled.memory_analysis()
  return Report(
      stage=spec.stage, n_devices=n,
      n_params=sum(r.size for r in spec.leaves if r.trainable),
      state_bytes=_inspect.state_bytes(state),
      theory_state_bytes=_inspect.theory_bytes(state),
      collectives=[dataclasses.asdict(c) for c in colls],
      collective_bytes=dict(by_kind_b), collective_elements=dict(by_kind_e),
      theory_collective_elements={k: v[0] for k, v in theory.items()},
      theory_collective_bytes={k: v[1] for k, v in theory.items()},
      xla_memory={"argument": mem.argument_size_in_bytes,
                  "output": mem.output_size_in_bytes,
                  "temp": mem.temp_size_in_bytes,
                  "alias": mem.alias_size_in_bytes},
      mesh={a: int(s) for a, s in mesh.shape.items()},
      bytes_by_axis=dict(by_axis), cross_process_bytes=crossing,
      zero_collective_bytes=dict(zero_b), zero_collective_elements=dict(zero_e),
      offload=_offload_traffic(state, hlo) if spec.place.offload else {},
      activations=_saved_activations(step, state, batch))


def _saved_activations(step, state: ZeroState, batch) -> dict:
  """The loss's saved residuals on one device's micro-batch, with the
  whole params in their compute dtype (see :mod:`zerojax._activations`)."""
  spec = state.spec
  shards = math.prod(spec.tx.mesh.shape[a] for a in spec.tx.batch_axes)
  rows = shards * step.accum_steps
  params = spec.unflatten_params([
      jax.ShapeDtypeStruct(r.aval.shape,
                           r.compute_dtype if r.trainable else r.aval.dtype)
      for r in spec.leaves])
  def local(x):                  # one device's rows; scalars as they are
    shape = np.shape(x)
    if not shape:
      return x
    return jax.ShapeDtypeStruct((shape[0] // rows,) + shape[1:],
                                np.result_type(x))
  local = jax.tree.map(local, batch)
  call = loss_call(state)
  key = None if state.key is None else jax.random.key(0)
  return _activations.saved_residuals(
      lambda p, b: call(step.loss_fn, p, b, key, state.model_state)[0],
      params, local)


def _offload_traffic(state: ZeroState, hlo: str) -> dict:
  """How the offloaded update runs and the bytes it moves per step per
  device: measured from the compiled program's entry buffers in host
  memory (each read down once and written back once), next to theory
  (the offloaded state, each way) and to ZeRO-Offload's host-side update
  (compute-dtype gradients down and params up)."""
  spec = state.spec
  spaces = _hlo.entry_bytes_by_memory(hlo)
  host = _inspect.memory_bytes(state).get("pinned_host", 0)
  compute = sum(r.size * np.dtype(r.compute_dtype).itemsize
                // r.shard.model_shards(spec.tx.model_axes)
                for r in spec.leaves if r.trainable) / spec.tx.num_shards
  return {**_offload.describe(spec),
          "host_to_device_bytes": spaces["arguments"].get("pinned_host", 0),
          "device_to_host_bytes": spaces["outputs"].get("pinned_host", 0),
          "theory_streamed_bytes": host,
          "theory_host_compute_bytes": int(2 * compute)}
