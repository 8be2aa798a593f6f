"""Which leaves of the master copy and optimizer state live in host memory
(``zero(..., offload=...)``): all, none, or whole leaves up to a fraction
of their bytes. Read from the records alone, before anything is built."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.records import warn as _warn


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
  if fraction >= 1.0:
    return {i for i, t in enumerate(trainable) if t}
  if fraction <= 0.0 or sum(sizes) == 0:
    return set()
  c = ShareChoice.of(sizes, trainable)
  [k], [q] = c.choose(np.array([fraction]))
  return {*c.order[:k].tolist(), *([] if q < 0 else [int(c.order[q])])}


@dataclasses.dataclass(frozen=True)
class ShareChoice:
  """:func:`chosen_for_share`'s rule for many shares at once (the planner
  weighs every share ``zero`` reaches). ``order``: the trained leaves,
  largest first, ties in tree order; a share's choice is ``order[:k]``
  plus ``order[q]`` (``q == -1``: ``order[:k]`` alone, every trained leaf
  together staying below the share)."""

  order: np.ndarray
  sizes: np.ndarray  # sizes[order]
  total: int

  @classmethod
  def of(cls, sizes, trainable) -> ShareChoice:
    order = sorted(
      (i for i, t in enumerate(trainable) if t), key=lambda i: (-sizes[i], i)
    )
    return cls(
      np.array(order, dtype=np.int64),
      np.array([sizes[i] for i in order], dtype=np.int64),
      int(sum(sizes)),
    )

  def reached(self) -> np.ndarray:
    """Every share the rule reaches, ascending, each reached by exactly
    that fraction: a prefix of the largest leaves and one more leaf (one
    of each size suffices: equal sizes reach equal shares)."""
    trained = self.sizes[self.sizes > 0]
    prefixes = np.concatenate([[0], np.cumsum(trained)])
    distinct = np.unique(trained)
    # a size is among trained[k:] while k is at most its last position
    last = np.searchsorted(-trained, -distinct, side="right") - 1
    k = np.arange(len(trained))[:, None]
    reached = (prefixes[:-1, None] + distinct[None, :])[k <= last[None, :]]
    return np.unique(np.minimum(reached / max(self.total, 1), 1.0))

  def choose(self, fractions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(k, q)`` per fraction in (0, 1)."""
    s, n = self.sizes, len(self.sizes)
    prefix = np.concatenate([[0], np.cumsum(s)])
    # (a share reached exactly, up to rounding, counts as reached)
    target = np.asarray(fractions, np.float64) * self.total * (1 - 1e-12)
    # the largest leaves while they stay below the share
    k = np.searchsorted(prefix[1:], target, side="left")
    # those after them that reach it from there: order[k:m] (sizes fall)
    need = target - prefix[k]
    m = np.searchsorted(-s, -need, side="right")
    reached = (k < n) & (m > k)
    # the smallest of those, the first in tree order among equal sizes
    last = np.clip(m - 1, 0, max(n - 1, 0))
    first_of_size = np.searchsorted(-s, -s[last], side="left") if n else last
    q = np.where(reached, np.maximum(k, first_of_size), -1)
    return np.where(reached, k, n), q


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
  trainable = [r.trainable for r in leaves]
  host = chosen_for_share(sizes, trainable, fraction)
  _warn_if_share_far_above(sizes, trainable, fraction, host)
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


# how far above the asked share the reached one may lie unmentioned
_SHARE_SLACK = 0.1


def _warn_if_share_far_above(sizes, trainable, fraction, host):
  """A warning when whole leaves put more than ``_SHARE_SLACK`` of the
  state above the share asked in host memory, naming the nearest share
  below that the leaves reach (what to pass instead)."""
  if not 0.0 < fraction < 1.0:
    return
  total = max(sum(sizes), 1)
  got = sum(sizes[i] for i in host) / total
  if got - fraction <= _SHARE_SLACK:
    return
  shares = ShareChoice.of(sizes, trainable).reached()
  below = shares[shares < fraction * (1 - 1e-12)]
  instead = (
    f"offload={float(below[-1]):.4g} keeps {float(below[-1]):.1%}"
    if len(below)
    else "no smaller share is reached"
  )
  _warn.warn(
    f"zerojax: offload={fraction:g} keeps {got:.1%} of the master "
    f"copy and optimizer state in host memory: the share is met with "
    f"whole leaves, and the model's leaves reach none between "
    f"{fraction:.1%} and {got:.1%} ({instead}). Pass the share to keep, "
    f"or zerojax.cost.offload_fraction_needed(...) for the least one "
    f"with which the device's working set fits.",
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
