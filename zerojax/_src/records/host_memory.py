"""Which arrays of the master copy and optimizer state live in host memory
(``zero(..., offload=...)``): all, none, or whole arrays (a leaf's master
copy, each optimizer-state leaf it owns) up to a fraction of their bytes.
Read from the records alone, before anything is built."""

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


@dataclasses.dataclass(frozen=True)
class Unit:
  """One array a share is met with: param leaf ``leaf``'s master copy
  (``opt is None``) or optimizer-state leaf ``opt``, which it owns."""

  leaf: int
  opt: int | None
  size: int  # logical bytes


def share_units(leaves, opt_leaves, has_master: bool) -> list[Unit]:
  """The arrays ``offload=`` a fraction places, param by param in tree
  order (each trained leaf's master copy, when the policy keeps one, then
  the optimizer leaves it owns in the state's order): the shared leaves
  (a step count) and the owned ones of an extended dtype (a PRNG key) are
  none, and go with any array (those of their owner)."""
  owners = owner_indices(leaves, opt_leaves)
  out = []
  for i, r in enumerate(leaves):
    if not r.trainable:
      continue
    if has_master:
      out.append(Unit(i, None, r.size * np.dtype(r.master_dtype).itemsize))
    for j, (o, p) in enumerate(zip(opt_leaves, owners)):
      if p == i and not jnp.issubdtype(o.aval.dtype, jax.dtypes.extended):
        size = math.prod(o.aval.shape) * np.dtype(o.aval.dtype).itemsize
        out.append(Unit(i, j, size))
  return out


def on_host(u: Unit, leaves, opt_leaves) -> bool:
  """Whether unit ``u`` is in host memory as the records place it."""
  if u.opt is None:
    return leaves[u.leaf].place.offload
  return opt_leaves[u.opt].place.offload


def held_fraction(leaves, opt_leaves, has_master: bool) -> float:
  """The share of the units' bytes the records place in host memory."""
  units = share_units(leaves, opt_leaves, has_master)
  held = sum(u.size for u in units if on_host(u, leaves, opt_leaves))
  return held / max(sum(u.size for u in units), 1)


@dataclasses.dataclass(frozen=True)
class ShareChoice:
  """The rule a share is met with over items of ``sizes``: whole trained
  items, largest first (ties in order) while they stay below the share,
  then the smallest one left that reaches it (:meth:`pick`). So the share
  reached is never above what taking items largest first until the share
  is reached gives (its last item is one of the completions weighed) and
  often well below: with a scanned model's few large leaves, a small
  share is met by a small stack, not by the largest. ``offload=`` applies
  it to arrays and to whole leaves (:class:`ShareRule`); :meth:`choose`
  applies it to many shares at once (the planner weighs every share
  ``zero`` reaches). ``order``: the trained items, largest first, ties in
  order; a share's choice is ``order[:k]`` plus ``order[q]`` (``q == -1``:
  ``order[:k]`` alone, every trained item together staying below the
  share)."""

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

  def pick(self, fraction: float) -> set[int]:
    """The items (indices of ``sizes``) the rule picks for one share."""
    if fraction >= 1.0:
      return set(self.order.tolist())
    if fraction <= 0.0 or self.total == 0:
      return set()
    [k], [q] = self.choose(np.array([fraction]))
    return {*self.order[:k].tolist(), *([] if q < 0 else [int(self.order[q])])}

  def held(self, k: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The bytes ``choose``'s ``(k, q)`` put in host memory."""
    prefix = np.concatenate([[0], np.cumsum(self.sizes)])
    last = (
      np.where(q >= 0, self.sizes[np.maximum(q, 0)], 0)
      if len(self.sizes)
      else 0
    )
    return prefix[k] + last


@dataclasses.dataclass(frozen=True)
class ShareRule:
  """``offload=fraction``'s rule: :class:`ShareChoice` over the arrays
  and over whole leaves (each leaf's arrays together), whichever puts
  fewer bytes in host memory, whole leaves on a tie (a leaf's update then
  reads one memory). Arrays make the shares finer, but the rule over
  them alone can meet a small share with one large array where a small
  leaf's arrays together meet it with less: fp32 AdamW's moments on the
  GPU bench's 2.7B GPT, asked 0.05, reach 0.124 (the qkv stack's first
  moment) by arrays and 0.083 (the attention output's two moments) by
  leaves. Either rule reaches each share it lists exactly, so this one
  reaches their union (:meth:`reached`). ``groups``: the arrays' indices
  per whole leaf."""

  arrays: ShareChoice
  leaves: ShareChoice
  groups: tuple[tuple[int, ...], ...]
  sizes: tuple[int, ...]  # per array

  @classmethod
  def of(cls, sizes, group_of) -> ShareRule:
    """``sizes`` per array, ``group_of`` its leaf (any hashable)."""
    keys = list(dict.fromkeys(group_of))
    where = {k: n for n, k in enumerate(keys)}
    groups = [[] for _ in keys]
    for i, g in enumerate(group_of):
      groups[where[g]].append(i)
    group_sizes = [sum(sizes[i] for i in g) for g in groups]
    return cls(
      ShareChoice.of(list(sizes), [True] * len(sizes)),
      ShareChoice.of(group_sizes, [True] * len(group_sizes)),
      tuple(tuple(g) for g in groups),
      tuple(int(x) for x in sizes),
    )

  def chosen(self, fraction: float) -> set[int]:
    """The arrays ``offload=fraction`` puts in host memory."""
    by_array = self.arrays.pick(fraction)
    by_leaf = {i for g in self.leaves.pick(fraction) for i in self.groups[g]}
    held = lambda chosen: sum(self.sizes[i] for i in chosen)
    return by_leaf if held(by_leaf) <= held(by_array) else by_array

  def reached(self) -> np.ndarray:
    """Every share the rule reaches, ascending, each reached by exactly
    that fraction."""
    return np.unique(
      np.concatenate([self.arrays.reached(), self.leaves.reached()])
    )

  def by_leaves(self, fractions: np.ndarray) -> np.ndarray:
    """Per fraction in (0, 1): whether whole leaves meet it (else arrays)."""
    leaves = self.leaves.held(*self.leaves.choose(fractions))
    return leaves <= self.arrays.held(*self.arrays.choose(fractions))


def place_in_host_memory(leaves, opt_leaves, fraction: float, has_master):
  """The records with each array's :class:`Placement`: a unit
  (:func:`share_units`) in host memory when it is among those
  :class:`ShareRule` picks for ``fraction`` of their bytes; shared
  optimizer leaves in host memory when any unit is, an owned key with its
  owner. A param leaf's ``place.offload`` says its master copy is in host
  memory (without one: any state it owns is). Whole arrays keep each
  array one buffer in one memory; a model scanned over its layers has few,
  large arrays, so the share reached can exceed the one asked (the report
  states it)."""
  units = share_units(leaves, opt_leaves, has_master)
  if fraction >= 1.0:  # every trained leaf, sized or not
    chosen = list(units)
    streams = {i for i, r in enumerate(leaves) if r.trainable}
  else:
    rule = ShareRule.of([u.size for u in units], [u.leaf for u in units])
    picked = rule.chosen(fraction)
    _warn_if_share_far_above(rule, fraction, picked)
    chosen = [units[k] for k in sorted(picked)]
    streams = {u.leaf for u in chosen}
  if not streams:
    return tuple(leaves), tuple(opt_leaves)
  masters = {u.leaf for u in chosen if u.opt is None} if has_master else streams
  states = {u.opt for u in chosen if u.opt is not None}
  sized = {u.opt for u in units if u.opt is not None}
  host = lambda p: dataclasses.replace(p, offload=True)
  owners = owner_indices(leaves, opt_leaves)
  return tuple(
    dataclasses.replace(r, place=host(r.place)) if i in masters else r
    for i, r in enumerate(leaves)
  ), tuple(
    dataclasses.replace(o, place=host(o.place))
    if owners[j] is None
    or j in states
    or (j not in sized and owners[j] in streams)
    else o
    for j, o in enumerate(opt_leaves)
  )


# how far above the asked share the reached one may lie unmentioned
_SHARE_SLACK = 0.1


def _warn_if_share_far_above(rule: ShareRule, fraction, host):
  """A warning when whole arrays put more than ``_SHARE_SLACK`` of the
  state above the share asked in host memory, naming the nearest share
  below that the arrays reach (what to pass instead)."""
  if not 0.0 < fraction < 1.0:
    return
  total = max(sum(rule.sizes), 1)
  got = sum(rule.sizes[i] for i in host) / total
  if got - fraction <= _SHARE_SLACK:
    return
  below = nearest_below(rule.reached(), fraction)
  instead = "no smaller share is reached"
  if below is not None:
    named = _shortest_reaching(rule, below)
    instead = f"offload={named:.12g} keeps {below:.1%}"
  _warn.warn(
    f"zerojax: offload={fraction:g} keeps {got:.1%} of the master "
    f"copy and optimizer state in host memory: the share is met with "
    f"whole arrays (a leaf's master copy, each of its optimizer-state "
    f"leaves), and the model's arrays reach none between "
    f"{fraction:.1%} and {got:.1%} ({instead}). Pass the share to keep, "
    f"or zerojax.cost.offload_fraction_needed(abstract_params, "
    f"memory_bytes=..., tx=tx) for the least one "
    f"with which the device's working set fits.",
  )


def nearest_below(shares: np.ndarray, fraction: float) -> float | None:
  """The largest of ``shares`` (ascending) below ``fraction``, or None (a
  share reached exactly, up to rounding, is not below)."""
  below = shares[shares < fraction * (1 - 1e-12)]
  return float(below[-1]) if len(below) else None


def _shortest_reaching(rule: ShareRule, share: float) -> float:
  """The decimal of fewest digits, not above ``share``, with which the
  rule reaches ``share`` (a rounded-up share would pass it and reach the
  next one)."""
  total = max(sum(rule.sizes), 1)
  for digits in range(2, 16):
    x = math.floor(share * 10**digits) / 10**digits
    held = sum(rule.sizes[i] for i in rule.chosen(x)) / total
    if x > 0 and abs(held - share) <= 1e-12:
      return x
  return share


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
