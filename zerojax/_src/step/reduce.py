"""The reductions of a step's outputs over the batch axes: each leaf's
gradient (all-reduce, reduce-scatter, or summed where the loss used it),
the loss and aux, the model state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.comm import buckets as _buckets
from zerojax._src.comm import gather as _gather
from zerojax._src.records.spec import StateSpec, is_key_dtype
from zerojax._src.step import aux as _aux
from zerojax._src.step.gather_mode import gather_spec, grad_to_host


def reduced_where_used(spec: StateSpec, accum_steps: int) -> list[bool]:
  """Stage 0, one micro-batch: the trainable leaves differentiated as they
  enter the ``shard_map``, replicated (invariant over the batch axes).

  Where the loss first combines such a leaf with its rows of the batch, JAX
  inserts an implicit broadcast to device-varying; its transpose is a
  ``psum`` of the cotangent right there. In a layer scan that is one
  all-reduce per layer inside the backward loop, as plain data parallelism
  gets from GSPMD, for any loss, whether or not it calls
  :func:`zerojax.gather`: the step never holds a whole unreduced gradient
  beside its all-reduced copy. The sum is the one the all-reduce after the
  backward would make (the loss is a mean over each device's rows, the
  gradient the sum of the devices' gradients, scaled once).

  Only where the gradient is reduced in the dtype it is computed in (the
  stored param's): a policy that reduces in another dtype keeps the
  explicit, cast reduction. With several micro-batches the local gradients
  are accumulated first and reduced once per step instead.

  Nor where the mesh has a model axis and the gradient is narrower than 32
  bits: JAX's ``psum`` then runs over the manual data axis inside a region
  automatic over the model axis, which XLA CPU aborts compiling in bf16
  ("Invalid binary instruction opcode copy", JAX 0.10.2); the explicit
  reduction runs manual over every axis (:func:`over_model_shards`)."""
  if spec.stage != 0 or accum_steps != 1:
    return [False] * len(spec.leaves)
  tx = spec.tx
  model_axis = any(
    n > 1 for a, n in tx.mesh.shape.items() if a not in tx.batch_axes
  )
  return [
    r.trainable
    and np.dtype(r.reduce_dtype) == np.dtype(r.compute_dtype)
    and not (model_axis and np.dtype(r.reduce_dtype).itemsize < 4)
    for r in spec.leaves
  ]


def reduce_grads(spec: StateSpec, grads, hooked, scale: float, direct):
  """Each leaf's gradient reduced over the batch axes and scaled to the
  mean: leaves :func:`reduced_where_used` are summed already, gathered
  leaves reduce-scattered already (summed over the replica axis here),
  other sharded leaves reduce-scattered, the rest all-reduced. Whole-leaf collectives run over the leaf's rows (a stack's
  layers) in buckets of at most ``tx.bucket_bytes`` (ZeRO-R's CB); the
  replica sum (hybrid sharding: Ψ/N elements cross it) once per step."""
  tx = spec.tx
  axis, axes, bucket = tx.axis_name, tx.batch_axes, tx.bucket_bytes
  replica = tuple(a for a in axes if a != axis)

  def psum(g, over, layout):
    if not over:
      return g
    return _gather.over_model_shards(
      lambda x: jax.lax.psum(x, over), g, layout.model
    )

  out = []
  for g, r, h, d in zip(grads, spec.leaves, hooked, direct):
    if g is None:
      out.append(None)
      continue
    size = _buckets.itemsize(g.dtype)
    to_host = grad_to_host(spec, r)
    if h and to_host:  # reduced, scaled and in host memory already
      out.append(g)
      continue
    if d:  # summed where the loss used it
      out.append(g if scale == 1.0 else g * scale)
    elif h and tx.stage == 0:  # all-reduced and scaled already
      out.append(
        _buckets.bucketed(
          lambda x, r=r: psum(x, replica, r.param),
          g,
          size,
          bucket if replica else None,
          _buckets.splittable(r.param),
        )
      )
    elif h:  # already reduce-scattered
      fn = lambda x, r=r: psum(x, replica, r.shard) * scale
      out.append(
        _buckets.bucketed(
          fn, g, size, bucket if replica else None, _buckets.splittable(r.shard)
        )
      )
    elif tx.stage >= 1 and r.shard.sharded:
      gs = gather_spec(spec, r)

      def fn(x, r=r, gs=gs):
        x = _gather.over_model_shards(
          lambda y, dim=r.shard.dim: _gather.reduce_scatter(y, axis, dim, gs),
          r.shard.to_storage(x),
          r.shard.model,
          r.shard.dim,
        )
        return psum(x, replica, r.shard) * scale

      # qgZ's blocks span the destination shard: not split (``buckets``)
      out.append(
        _buckets.bucketed(
          fn,
          g,
          size,
          None if gs.grad_bits else bucket,
          _buckets.splittable(r.shard),
        )
      )
    else:  # stage 0, or a replicated leaf
      fn = lambda x, r=r: psum(x, axes, r.param) * scale
      out.append(
        _buckets.bucketed(fn, g, size, bucket, _buckets.splittable(r.param))
      )
    if to_host:  # a leaf reduced after the backward pass
      out[-1] = jax.device_put(out[-1], jax.memory.Space.Host)
  return out


def reduce_outputs(
  loss, aux, new_ms, axes, scale: float, dims, *, loss_scale=None, summed=()
):
  """The loss and float aux as means over devices and micro-batches
  (``scale``: 1 / their number; the loss scaled by ``loss_scale`` when
  given, 1 for a sum over examples), integer aux (counts) and the float
  aux leaves ``summed`` flags summed,
  per-example aux stacked for the devices' rows
  (:mod:`zerojax._src.step.aux`), the model state synchronised. Returns
  ``(loss, aux_reduced, aux_rows, new_model_state)``."""
  loss = jax.lax.psum(loss, axes) * (
    scale if loss_scale is None else loss_scale
  )
  reduced, rows = _aux.split(aux, dims)
  leaves, tree = jax.tree.flatten(reduced)
  added = list(summed) if len(summed) == len(leaves) else [False] * len(leaves)
  reduced = jax.tree.unflatten(
    tree,
    [
      a
      if d is not None
      else _psum(a, axes) * scale
      if jnp.issubdtype(a.dtype, jnp.inexact) and not s
      else _psum(a, axes)
      for a, d, s in zip(leaves, dims or (None,) * len(leaves), added)
    ],
  )
  if new_ms is not None:
    new_ms = jax.tree.map(lambda x: sync_model_state(x, axes), new_ms)
  return loss, reduced, _aux.per_device(rows, dims), new_ms


def _psum(x, axes):
  """``psum`` over manual ``axes``, run manual over any automatic (model)
  axes too: see ``comm/gather.over_model_shards`` (XLA CPU aborts on bf16
  collectives in partially automatic regions)."""
  return _gather.over_model_shards(lambda v: jax.lax.psum(v, axes), x, ())


def sync_model_state(x, axis):
  """Floating state: mean over the batch axes (synchronised batch norm);
  anything else (counters, keys): device 0's value, on every device."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return _psum(x, axis) / jax.lax.axis_size(axis)
  if is_key_dtype(x.dtype):
    impl = jax.random.key_impl(x)
    return jax.random.wrap_key_data(
      sync_model_state(jax.random.key_data(x), axis), impl=impl
    )
  first = jax.lax.axis_index(axis) == 0
  return _psum(jnp.where(first, x, jnp.zeros_like(x)), axis)
