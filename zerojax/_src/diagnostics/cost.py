"""What a stage costs: the one set of formulas zerojax's figures come from.

The planner (:mod:`zerojax.cost`, ``python -m zerojax.plan``), the theory
column of :func:`zerojax.report` and the layout table all read these, on
the same :class:`~zerojax.layout.StateSpec` records, in one of two readings:

* **ideal** (``ideal=True``): the ZeRO paper's figures for the stage:
  logical (unpadded) sizes, divided by N where the stage shards a category
  (params at stage 3; master and optimizer state at 1-3; gradients at
  2-3), every trainable leaf in the stage's collectives. What
  ``zerojax.report`` sets next to the measured step.
* **as laid out** (``ideal=False``): what zerojax really stores and moves:
  each leaf's stored shard (padding included, small leaves left
  replicated), stacked leaves gathered and reduce-scattered per layer
  (stages 2-3; at stage 3 again in the rematerialised backward), other
  leaves gathered once and kept for the backward, replicated leaves
  all-reduced, ZeRO++'s quantized blocks with their scales. What the
  planner reports.

Collective sizes use the full-buffer convention: the bytes of the whole
buffer one data-axis group gathers or reduces (a ring moves ``(N-1)/N`` of
it per device).
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np

from zerojax._src.records import host_memory as _host_memory
from zerojax._src.records import zeropp as _zeropp

REPLICA_ALL_REDUCE = "all-reduce over replica"


def layout_bytes(layout, n: int, model_sizes: dict, itemsize: int) -> float:
  """Bytes of one device's stored shard of a leaf laid out as ``layout``."""
  return (
    math.prod(layout.shard_shape(n))
    / layout.model_shards(model_sizes)
    * itemsize
  )


def stage_state_bytes(spec, *, ideal: bool) -> dict[str, float]:
  """Per-device bytes of the model state, by category: ``params``,
  ``master`` (with a master-weight policy), ``grads`` (the gradient buffer
  in ``reduce_dtype``, transient within a step: full at stages 0-1, a shard
  at 2-3) and ``opt_state.<field>`` for each optimizer-state field."""
  n, stage, sizes = spec.tx.num_shards, spec.stage, spec.tx.model_axes
  out: dict[str, float] = collections.defaultdict(float)

  def add(category, layout, size, dtype, sharded_at: int):
    # a PRNG key's dtype is not NumPy's; its itemsize is its key data's
    itemsize = dtype.itemsize if _extended(dtype) else np.dtype(dtype).itemsize
    if ideal:
      out[category] += (
        size
        / layout.model_shards(sizes)
        * itemsize
        / (n if stage >= sharded_at else 1)
      )
    else:
      out[category] += layout_bytes(layout, n, sizes, itemsize)

  for r in spec.leaves:
    add("params", r.param, r.size, r.compute_dtype, 3)
    if not r.trainable:
      continue
    if spec.policy.has_master:
      add("master", r.shard, r.size, r.master_dtype, 1)
    if ideal or stage >= 2:
      add("grads", r.shard, r.size, r.reduce_dtype, 2)
    else:  # a full gradient at stages 0-1
      out["grads"] += (
        r.size / r.shard.model_shards(sizes) * np.dtype(r.reduce_dtype).itemsize
      )
  for o in spec.opt_leaves:
    size = math.prod(o.aval.shape)
    sharded_at = 1 if o.aval.shape else 4  # scalars (count) stay whole
    add(f"opt_state.{o.field}", o.layout, size, o.aval.dtype, sharded_at)
  return dict(out)


def host_state_bytes(spec) -> float:
  """Per-device bytes of the master copy and optimizer state kept in host
  memory (``zero(..., offload=...)``), as laid out."""
  n, sizes = spec.tx.num_shards, spec.tx.model_axes
  out = 0.0
  for r in spec.leaves:
    if r.trainable and r.place.offload and spec.policy.has_master:
      out += layout_bytes(r.shard, n, sizes, np.dtype(r.master_dtype).itemsize)
  for o in spec.opt_leaves:
    if o.place.offload and not _extended(o.aval.dtype):
      out += layout_bytes(o.layout, n, sizes, np.dtype(o.aval.dtype).itemsize)
  return out


def host_state_bytes_by_unit(spec, units) -> tuple[list[float], float]:
  """Per-device bytes of the master copy and optimizer state that offload
  puts in host memory, wherever each array now is: per unit of ``units``
  (:func:`~zerojax._src.records.host_memory.share_units`: a leaf's master
  copy, an optimizer leaf it owns), and the shared optimizer leaves' (a
  step count), which go with any unit."""
  n, sizes = spec.tx.num_shards, spec.tx.model_axes

  def laid_out(u):
    if u.opt is None:
      r = spec.leaves[u.leaf]
      return layout_bytes(r.shard, n, sizes, np.dtype(r.master_dtype).itemsize)
    o = spec.opt_leaves[u.opt]
    return layout_bytes(o.layout, n, sizes, np.dtype(o.aval.dtype).itemsize)

  owners = _host_memory.owner_indices(spec.leaves, spec.opt_leaves)
  shared = sum(
    layout_bytes(o.layout, n, sizes, np.dtype(o.aval.dtype).itemsize)
    for o, i in zip(spec.opt_leaves, owners)
    if i is None and not _extended(o.aval.dtype)
  )
  return [laid_out(u) for u in units], float(shared)


def host_param_bytes(spec, *, stacked_only: bool = False) -> float:
  """Per-device bytes of the params' shards kept in host memory
  (``zero(..., offload_params=True)``), as laid out; ``stacked_only``:
  of the layer stacks' alone."""
  n, sizes = spec.tx.num_shards, spec.tx.model_axes
  return sum(
    layout_bytes(r.param, n, sizes, np.dtype(r.compute_dtype).itemsize)
    for r in spec.leaves
    if r.place.params_host and (r.stacked or not stacked_only)
  )


def host_grad_bytes(spec) -> float:
  """Per-device bytes of the reduced gradients kept in host memory
  (``zero(..., offload_grads=True)``): each trained leaf's shard in its
  reduce dtype, layer stacks of vectors' excepted (kept on the device)."""
  if not spec.config.offload_grads:
    return 0.0
  n, sizes = spec.tx.num_shards, spec.tx.model_axes
  return sum(
    layout_bytes(r.shard, n, sizes, np.dtype(r.reduce_dtype).itemsize)
    for r in spec.leaves
    if r.trainable and not _host_memory.vector_stack(r)
  )


def _extended(dtype) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def stage_collectives(
  spec, accum_steps: int = 1, *, ideal: bool
) -> dict[str, tuple[int, int]]:
  """The step's collectives: ``{kind: (elements, bytes)}`` per step, with
  ``accum_steps`` micro-batches. Kinds: ``all-reduce``, ``reduce-scatter``,
  ``all-gather``, ``all-to-all`` (qgZ) and, with a replica axis,
  :data:`REPLICA_ALL_REDUCE` (the shard summed over replicas)."""
  if ideal and not spec.tx.zeropp.active:
    return _ideal_collectives(spec, accum_steps)
  return _laid_out_collectives(spec, accum_steps)


def _ideal_collectives(spec, k: int) -> dict:
  """ZeRO's volume: Ψ all-reduced at stage 0; Ψ reduce-scattered and
  gathered at 1-2 (per micro-batch at 2), 2Ψ gathered per micro-batch at 3."""
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
  out = {
    "reduce-scatter": (rs * elems, rs * rbytes),
    "all-gather": (ag * elems, ag * cbytes),
  }
  if spec.tx.replica_axis:  # hybrid: the shard, summed over replicas once
    n = spec.tx.num_shards
    out[REPLICA_ALL_REDUCE] = (elems // n, rbytes // n)
  return out


def local_elements(spec, r) -> int:
  """Elements of leaf ``r``'s shard that one device's data-axis collective
  moves: the storage shard over the data axis, cut by the model axes
  except on the dimension it shares with the data axis (that one enters
  whole over the model axes; see ``gather.over_model_shards``)."""
  sizes, n = spec.tx.model_axes, spec.tx.num_shards
  m = 1
  for d, size in enumerate(r.shard.storage_shape):
    if d == r.shard.dim:
      m *= size // n
    else:
      m *= size // math.prod(int(sizes[a]) for a in r.shard.model_axes(d))
  return m


def quantized(rows: int, m: int, bits: int, block: int) -> tuple[int, int]:
  """``(elements, bytes)`` ZeRO++ quantization makes of ``rows`` rows of
  ``m`` elements: int8 (or packed int4) blocks and one fp32 scale per
  block (:func:`zerojax._src.comm.quantized.quantize`)."""
  b = _zeropp.block_for(m, block)
  nb = -(-m // b)
  data = rows * nb * b * bits // 8
  return data + rows * nb, data + 4 * rows * nb


def wire_bytes_per_element(bits: int, block: int) -> float:
  """Bytes on the wire per quantized element, scales included (large
  buffers: whole blocks)."""
  return bits / 8 + 4 / block


def _laid_out_collectives(spec, k: int) -> dict:
  """Each leaf's collectives as zerojax runs them (the module docstring's
  second reading), ZeRO++ included:

  * weight all-gathers (stage 3) per micro-batch, stacked leaves in the
    forward and again in the rematerialised backward, others once; with
    qwZ the int8 blocks and scales of every shard; with hpZ, once per step
    the secondary (``1/hpz`` of the leaf, quantized with qwZ) across
    nodes, then in-node gathers of the whole leaf in the compute dtype;
  * stages 1-2: the updated params, gathered once;
  * the gradient: a reduce-scatter in the reduce dtype (per micro-batch and
    layer at stages 2-3), or with qgZ an all-to-all of every device's
    quantized chunks (two when hierarchical: the whole gradient inside
    the node, ``1/node`` of it across);
  * a replica axis adds the shard's full-precision all-reduce.
  """
  tx, stage = spec.tx, spec.stage
  zpp, n = tx.zeropp, tx.num_shards
  node = tx.qgz_node_size if zpp.grad_bits else 0
  hpz = (zpp.hpz_size or 0) if stage == 3 else 0
  out = collections.defaultdict(lambda: [0, 0])

  def add(kind, elems, nbytes, times=1):
    out[kind][0] += times * elems
    out[kind][1] += times * nbytes

  def plain(kind, elems, dtype, times=1):  # a full-precision collective
    add(kind, elems, elems * np.dtype(dtype).itemsize, times)

  for r in spec.leaves:
    if not r.trainable:
      continue
    if not r.shard.sharded:  # replicated: all-reduced, full precision
      plain(
        "all-reduce",
        r.size // r.shard.model_shards(tx.model_axes),
        r.reduce_dtype,
      )
      continue
    per_layer = stage >= 2 and r.stacked and r.shard.dim != 0
    layers = r.shard.storage_shape[0] if per_layer else 1
    m = local_elements(spec, r) // layers  # one call's local shard
    calls = k * layers if stage >= 2 else 1
    # gathered again in the backward where rematerialised (the layer scan)
    gathers = k * layers * (2 if per_layer else 1)
    if stage < 3:  # stages 1-2: the new params, gathered
      plain("all-gather", n * m * layers, r.compute_dtype)
    elif hpz:  # the secondary once, then in-node
      if zpp.weight_bits:
        add(
          "all-gather",
          *quantized(n // hpz, m * layers, zpp.weight_bits, zpp.block),
        )
      else:
        plain("all-gather", n // hpz * m * layers, r.compute_dtype)
      plain("all-gather", n * m, r.compute_dtype, gathers)
    elif zpp.weight_bits:
      add("all-gather", *quantized(n, m, zpp.weight_bits, zpp.block), gathers)
    else:
      plain("all-gather", n * m, r.compute_dtype, gathers)
    if zpp.grad_bits and node:
      add(
        "all-to-all",
        *quantized(node, n // node * m, zpp.grad_bits, zpp.block),
        calls,
      )
      add(
        "all-to-all", *quantized(n // node, m, zpp.grad_bits, zpp.block), calls
      )
    elif zpp.grad_bits:
      add("all-to-all", *quantized(n, m, zpp.grad_bits, zpp.block), calls)
    else:
      plain("reduce-scatter", n * m, r.reduce_dtype, calls)
    if tx.replica_axis:
      plain(REPLICA_ALL_REDUCE, m * layers, r.reduce_dtype)
  return {kind: tuple(v) for kind, v in out.items()}
