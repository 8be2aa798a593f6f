"""Which leaves of the master copy and optimizer state live in host memory
(``zero(..., offload=...)``): all, none, or whole leaves up to a fraction
of their bytes. Read from the records alone, before anything is built."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def owner_indices(leaves, opt_leaves) -> tuple[int | None, ...]:
  """For each optimizer-state leaf, the param leaf it belongs to (matched by
  path suffix, the longest param path winning), or None (shared: a step
  count, a PRNG key)."""
  out = []
  for o in opt_leaves:
    best, best_len = None, -1
    for i, r in enumerate(leaves):
      if r.trainable and o.path.endswith(r.path) and len(r.path) > best_len:
        best, best_len = i, len(r.path)
    out.append(best)
  return tuple(out)


def offload_bytes(leaves, opt_leaves, has_master: bool) -> list[int]:
  """Per param leaf, the logical bytes offload moves to host memory for it:
  its master copy (when the policy keeps one) and the optimizer state it
  owns (0 for a frozen leaf)."""
  sizes = [
    r.size * np.dtype(r.master_dtype).itemsize
    if r.trainable and has_master
    else 0
    for r in leaves
  ]
  for o, i in zip(opt_leaves, owner_indices(leaves, opt_leaves)):
    if i is not None and not jnp.issubdtype(o.aval.dtype, jax.dtypes.extended):
      sizes[i] += math.prod(o.aval.shape) * np.dtype(o.aval.dtype).itemsize
  return sizes


def chosen_for_share(sizes, trainable, fraction: float) -> set[int]:
  """The leaves whose master copy and state ``offload=fraction`` puts in
  host memory: whole trained leaves, largest first (ties in tree order)
  while they stay below ``fraction`` of ``sizes``' total, then the
  smallest one left that reaches it. So the share reached is never above
  what taking leaves largest first until the share is reached gives (its
  last leaf is one of the completions weighed) and often well below: with
  a scanned model's few large leaves, a small share is met by a small
  stack, not by the largest."""
  total = sum(sizes)
  if fraction >= 1.0:
    return {i for i, t in enumerate(trainable) if t}
  if fraction <= 0.0 or total == 0:
    return set()
  # (a share reached exactly, up to rounding, counts as reached)
  target = fraction * total * (1 - 1e-12)
  order = sorted(
    (i for i, t in enumerate(trainable) if t), key=lambda i: (-sizes[i], i)
  )
  held, k = 0, 0
  while k < len(order) and held + sizes[order[k]] < target:
    held += sizes[order[k]]
    k += 1
  rest = [i for i in order[k:] if held + sizes[i] >= target]
  if not rest:  # every trained leaf together stays below the share
    return set(order)
  return {*order[:k], min(rest, key=lambda i: (sizes[i], i))}


def place_in_host_memory(leaves, opt_leaves, fraction: float, has_master):
  """The records with each leaf's :class:`Placement`: a trained leaf's
  master copy and optimizer state in host memory when the leaf is among
  those :func:`chosen_for_share` picks for ``fraction`` of
  :func:`offload_bytes`' total; shared optimizer leaves in host memory
  when any leaf is. Whole leaves keep each leaf's update one computation
  in one memory; a model scanned over its layers has few, large leaves,
  so the share reached can exceed the one asked (the report states
  it)."""
  sizes = offload_bytes(leaves, opt_leaves, has_master)
  host = chosen_for_share(sizes, [r.trainable for r in leaves], fraction)
  if not host:
    return tuple(leaves), tuple(opt_leaves)
  on_host = lambda p: dataclasses.replace(p, offload=True)
  owners = owner_indices(leaves, opt_leaves)
  return tuple(
    dataclasses.replace(r, place=on_host(r.place)) if i in host else r
    for i, r in enumerate(leaves)
  ), tuple(
    dataclasses.replace(o, place=on_host(o.place))
    if owners[j] is None or owners[j] in host
    else o
    for j, o in enumerate(opt_leaves)
  )


def vector_stack(r) -> bool:
  """A layer stack of vectors (biases, norm scales): its per-layer row a
  TPU's host transfer cannot slice out of a packed (bf16) tile, so its
  params and gradients stay on the device."""
  return r.stacked and len(r.aval.shape) <= 2


def params_in_host_memory(leaves):
  """The records with each trained, sharded param's stage-3 shard in host
  memory (``zero(..., offload_params=True)``): those reach the loss as
  shards gathered per layer, so each is brought to the device just before
  its gather. Other leaves (frozen, or too small to shard) stay on the
  device, where the loss reads them as they are; so do layer stacks of
  vectors (biases, norm scales: a few bytes per layer), whose per-layer
  row a TPU's host transfer cannot slice out of a packed (bf16) tile."""
  return tuple(
    dataclasses.replace(r, place=dataclasses.replace(r.place, params_host=True))
    if r.trainable and r.param.sharded and not vector_stack(r)
    else r
    for r in leaves
  )
