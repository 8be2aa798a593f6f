"""Offload: the optimizer update streamed through device memory in chunks.

Which leaves are offloaded (all, or whole leaves up to a share of the
bytes) is in each leaf's record (:mod:`zerojax._src.records.host_memory`);
a leaf kept on the device is updated in place within its chunk.

With ``zero(..., offload=True)`` the master copy and the optimizer state
live in ``pinned_host`` memory. XLA computes on device-memory operands, so
the update must bring them down; left to itself XLA's scheduler may bring
all of them down at once, and the device then holds the whole state during
the update, as without offload. Here the update runs chunk by chunk --
groups of consecutive parameter leaves of at most ``1 / CHUNKS`` of the
state's bytes (a larger leaf alone; a layer stack larger than every
whole leaf a few layers per chunk: :mod:`~zerojax._src.step.offload_rows`) -- and
chunk ``k``'s loads from host memory wait, through an ``optimization_barrier``, for the stored results
of chunk ``k - 1``, or of chunk ``k - 2`` when the device has room for
chunk ``k``'s old state beside chunk ``k - 1``'s old and new within the
two largest chunks' worth the planner counts. Then chunk ``k`` comes down
while chunk ``k - 1`` is updated and chunk ``k - 2`` goes back: both
directions of the link and the update's compute at once (:attr:`Plan.after`).
A crossing stream (:func:`crossing_waits`, measured beside the default in
``experiments/``) instead has a chunk the default keeps serial wait for
the previous chunk's new values (and the stored results of the one before
that), so it comes down while the previous chunk goes back, the device
holding that chunk's new state beside its own old (:attr:`Plan.computed`).
The first chunk, and the second when it is so prefetched, may come down
while the backward pass still runs. The device holds at most twice the
largest chunk's weights and state, never the whole of it. What a backend's
scheduler makes of it is read from its compiled program
(:mod:`zerojax._src.diagnostics.schedule`; ``docs/design.md``).

Why chunks of the *same* Optax update rather than a host-side update
(``jax.experimental.compute_on``): on the supported JAX versions a
host-compute region with host-memory operands fails to trace ordinary Optax
code (``clip_by_global_norm``, LAMB and Adafactor mix memory spaces inside
it), and its signature changed between 0.10 and 0.12. Streaming runs the
inner optimizer exactly as on device, so its numbers are the on-device
numbers, for every optimizer.

Exactness. Chunk ``k`` calls the whole inner update with the other chunks'
weights and state replaced by zeros, and keeps only its own outputs. That
is the unsharded result only if those outputs do not read the other
chunks' weights or state; :func:`plan` checks it from the update's jaxpr
(:mod:`zerojax._src.jaxpr.deps`) before anything runs. Gradients, extra arguments
and the state leaves no parameter owns (``count``, a PRNG key) are given to
every chunk in full, so global-norm clipping, LAMB's trust ratio,
Adafactor's factored moments and Lion stream. An optimizer whose outputs
couple leaves through the state (``optax.MultiSteps``' conditional
update) gets the whole-state update instead: exact, not bounded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.jaxpr import deps as _deps
from zerojax._src.records import host_memory as _host_memory
from zerojax._src.records.spec import StateSpec
from zerojax._src.step import leaf_ops as _ops
from zerojax._src.step import offload_rows as _stacks

# the state is streamed in chunks of at most 1/CHUNKS of its bytes
CHUNKS = 16


def byte_groups(sizes, parts: int) -> list[list[int]]:
  """Consecutive items in groups of at most ``sum(sizes) / parts`` (a larger
  item alone). Any two neighbouring groups together exceed the budget, so
  there are fewer than ``2 * parts + 1`` groups."""
  budget = max(sum(sizes) / parts, 1)
  groups, current, held = [], [], 0
  for i, size in enumerate(sizes):
    if current and held + size > budget:
      groups.append(current)
      current, held = [], 0
    current.append(i)
    held += size
  if current:
    groups.append(current)
  return groups


def owners(spec: StateSpec) -> tuple[int | None, ...]:
  """For each optimizer-state leaf, the param leaf it belongs to, or None
  (shared)."""
  return _host_memory.owner_indices(spec.leaves, spec.opt_leaves)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How the update is streamed: param leaves per chunk, the optimizer
  leaves each chunk owns, and the shared optimizer leaves every chunk
  reads."""

  chunks: tuple[tuple[int, ...], ...]
  owned: tuple[tuple[int, ...], ...]
  shared: tuple[int, ...]
  # per chunk, the chunk whose stored results its loads wait for (None:
  # none); k - 2 where chunk k is prefetched during chunk k - 1's update
  after: tuple[int | None, ...] = ()
  # per chunk, the chunk whose new (not yet stored) values its loads wait
  # for (None: none; k - 1 in the crossing stream, :func:`crossing_waits`)
  computed: tuple[int | None, ...] = ()
  # per chunk, per param in it: the rows ``(a, b)`` of its layer stack the
  # chunk updates (None: the whole leaf); a stack larger than a chunk's
  # budget is spread over consecutive chunks (:mod:`zerojax._src.jaxpr.rows`)
  rows: tuple[tuple[tuple[int, int] | None, ...], ...] = ()
  # the update's jaxpr, which computes a stack's rows
  program: object = dataclasses.field(default=None, compare=False)

  def rows_of(self, k: int) -> tuple:
    return self.rows[k] if k < len(self.rows) else (None,) * len(self.chunks[k])

  def _waits_for_computed(self, k: int) -> bool:
    return k < len(self.computed) and self.computed[k] is not None

  def _ahead(self, k: int) -> bool:
    """Chunk ``k`` may come down while chunk ``k - 1`` is updated."""
    a = self.after[k]
    return not self._waits_for_computed(k) and (a is None or a < k - 1)

  def in_flight(self, sizes) -> float:
    """The most of ``sizes`` (per chunk) on the device at once: a chunk's
    old and new state, with the next chunk's old when it is prefetched, or
    its new state beside the next chunk's old while the two cross."""
    most = 0.0
    for k, size in enumerate(sizes):
      nxt = sizes[k + 1] if k + 1 < len(sizes) else 0
      if k + 1 < len(sizes) and self._ahead(k + 1):
        most = max(most, 2 * size + nxt)
      else:
        most = max(most, 2 * size, size + nxt)
    return most

  @property
  def prefetched(self) -> int:
    """Chunks loaded while the chunk before them is updated."""
    return sum(1 for k in range(1, len(self.after)) if self._ahead(k))

  @property
  def crossing(self) -> int:
    """Chunks loaded while the chunk before them goes back to the host."""
    return sum(
      1 for k in range(1, len(self.after)) if self._waits_for_computed(k)
    )


def aval_of(x):
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def nbytes(aval) -> int:
  if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
    return 0
  return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def plan(spec: StateSpec, g_avals, w_avals, extra_avals=None, opt_def=None):
  """``(Plan, None)`` when streaming gives the whole update's numbers, else
  ``(None, reason)``. Decided from shapes alone.

  Args:
    g_avals, w_avals: per-param logical gradients and weights as the
      optimizer sees them (None for frozen leaves).
    extra_avals: the update's extra arguments (a dict), arrays as
      ``jax.ShapeDtypeStruct``, if any.
    opt_def: the structure the inner state is handed in (default the
      spec's).
  """
  opt_def = spec.opt_def if opt_def is None else opt_def
  train = [i for i, w in enumerate(w_avals) if w is not None]
  if not train:
    return None, "no leaf is trained"
  own = owners(spec)
  opt_avals = [o.aval for o in spec.opt_leaves]
  # array extra arguments are inputs of the probe; others (a callable, a
  # string) are closed over as the update will see them
  e_all, e_def = jax.tree.flatten(extra_avals or {})
  e_leaves = [x for x in e_all if isinstance(x, jax.ShapeDtypeStruct)]
  n_g, n_o = len(train), len(opt_avals)

  def flat_update(*flat):
    g, o = flat[:n_g], flat[n_g : n_g + n_o]
    w, e = flat[n_g + n_o : 2 * n_g + n_o], iter(flat[2 * n_g + n_o :])
    extra = [
      next(e) if isinstance(x, jax.ShapeDtypeStruct) else x for x in e_all
    ]
    updates, new = _ops.inner_update(
      spec,
      _view(spec, train, g),
      jax.tree.unflatten(opt_def, list(o)),
      _view(spec, train, w),
      jax.tree.unflatten(e_def, extra),
    )
    return jax.tree.leaves(updates), jax.tree.leaves(new)

  closed = _deps.trace(
    flat_update,
    *[g_avals[i] for i in train],
    *opt_avals,
    *[w_avals[i] for i in train],
    *e_leaves,
  )
  if closed is None:
    return None, "the inner update could not be traced to a jaxpr here"
  deps = _deps.dependencies(closed)
  if len(deps) != n_g + n_o:
    return None, "the inner update returned a state of another structure"
  shared = tuple(j for j, p in enumerate(own) if p is None)
  always = (
    frozenset(range(n_g))
    | {n_g + j for j in shared}
    | frozenset(range(2 * n_g + n_o, 2 * n_g + n_o + len(e_leaves)))
  )
  slot = {i: k for k, i in enumerate(train)}
  allowed = {
    i: always
    | {n_g + n_o + slot[i]}
    | {n_g + j for j, p in enumerate(own) if p == i}
    for i in train
  }
  for i in train:
    if not deps[slot[i]] <= allowed[i]:
      return None, (
        f"the update of params{spec.leaves[i].path} reads other "
        f"leaves' weights or state"
      )
  for j, p in enumerate(own):
    if not deps[n_g + j] <= (always if p is None else allowed[p]):
      return None, (
        f"optimizer state{spec.opt_leaves[j].path} reads other "
        f"leaves' weights or state"
      )
  # a leaf kept on the device costs no chunk room: it joins its neighbours
  sizes = [
    (
      nbytes(w_avals[i])
      + sum(nbytes(opt_avals[j]) for j, p in enumerate(own) if p == i)
    )
    * spec.leaves[i].place.offload
    for i in train
  ]
  items = []  # (param, row or None, bytes)
  rows = _stack_rows(spec, closed, train, sizes, own) if _by_rows else {}
  for k, i in enumerate(train):
    n = rows.get(k, 0)
    if n:
      items.extend((i, r, sizes[k] / n) for r in range(n))
    else:
      items.append((i, None, sizes[k]))
  chunks, rows, chunk_bytes = [], [], []
  for g in byte_groups([b for _, _, b in items], CHUNKS):
    pieces = []
    for i, r, _ in (items[t] for t in g):
      if r is not None and pieces and pieces[-1][0] == i:
        pieces[-1] = (i, (pieces[-1][1][0], r + 1))
      else:
        pieces.append((i, None if r is None else (r, r + 1)))
    chunks.append(tuple(i for i, _ in pieces))
    rows.append(tuple(_whole_or(spec, i, span) for i, span in pieces))
    chunk_bytes.append(sum(items[t][2] for t in g))
  owned = tuple(tuple(j for j, p in enumerate(own) if p in c) for c in chunks)
  after, computed = _waits(chunk_bytes)
  return Plan(
    tuple(chunks), owned, shared, after, computed, tuple(rows), closed
  ), None


def _stack_rows(spec: StateSpec, closed, train, sizes, own) -> dict:
  """``{k: rows}`` for the trained leaves (``k``-th) streamed by rows: the
  layer stacks that can be (:func:`~zerojax._src.step.offload_rows.stack_rows`)
  larger than both a chunk's budget and every leaf streamed whole, the
  ones that set the largest chunk. A stack smaller than a whole leaf
  would not lower it, and its rows would only add transfers."""
  budget = sum(sizes) / CHUNKS
  rows = {}
  for k, i in enumerate(train):
    if sizes[k] > budget:
      n = _stacks.stack_rows(spec, closed, i, k, len(train), own)
      if n:
        rows[k] = n
  whole = max((b for k, b in enumerate(sizes) if k not in rows), default=0)
  return {k: n for k, n in rows.items() if sizes[k] > whole}


def _whole_or(spec: StateSpec, i: int, span):
  """``span``, or None where it is all of param ``i``'s rows."""
  if span is None or span == (0, spec.leaves[i].aval.shape[0]):
    return None
  return span


def default_waits(
  sizes,
) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
  """The default stream, per chunk ``(after, computed)``: the chunk whose
  stored results its loads wait for -- the one before it, or the one
  before that when this chunk's old state fits beside the previous
  chunk's old and new within twice the largest chunk (the device bytes the
  planner counts for the update): a prefetch costs no device memory beyond
  the serial stream's peak -- and no chunk's new values (``computed`` all
  None). A stream of equal chunks is therefore serial; chunks beside a
  larger one are prefetched."""
  room = 2 * max(sizes, default=0)
  after: list[int | None] = []
  for k, size in enumerate(sizes):
    if k == 0:
      after.append(None)
    elif 2 * sizes[k - 1] + size <= room:
      after.append(k - 2 if k >= 2 else None)
    else:
      after.append(k - 1)
  return tuple(after), (None,) * len(sizes)


# the stream plan() builds; experiments set it to crossing_waits to compare
_waits = default_waits
# whether a layer stack larger than every whole leaf is streamed by rows
# (:mod:`zerojax._src.step.offload_rows`); experiments turn it off to
# measure the whole-leaf stream beside it (docs/results.md)
_by_rows = True


def crossing_waits(
  sizes,
) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
  """The crossing stream, per chunk ``(after, computed)``: loads wait for
  the stored results of the chunk two before and, where the default would
  keep them serial, for the previous chunk's new values (computed, not yet
  stored), so the chunk comes down while the previous one goes back: both
  directions of the link at once. The device may then hold the previous
  chunk's new state beside this chunk's old: within twice the largest
  chunk, which the planner counts for either stream; what a compiler's
  peak makes of it is measured (``docs/design.md``). Selected by setting
  ``_waits`` to it."""
  after, _ = default_waits(sizes)
  computed = tuple(a if k and a == k - 1 else None for k, a in enumerate(after))
  return tuple(k - 2 if k >= 2 else None for k in range(len(sizes))), computed


def scatter(n: int, index, values) -> list:
  """A list of ``n`` Nones with ``values`` at positions ``index``."""
  out = [None] * n
  for i, v in zip(index, values):
    out[i] = v
  return out


def _view(spec, train, leaves):
  return spec.optimizer_view(scatter(len(spec.leaves), train, leaves))


def stream(
  spec: StateSpec,
  p: Plan,
  g_view,
  w_src,
  opt_raw,
  extra_args,
  *,
  finish: Callable,
  opt_def=None,
  bases: Callable | None = None,
  g_rows=None,
):
  """Runs the inner update chunk by chunk (see the module docstring).

  Args:
    p: from :func:`plan`.
    g_view: per-param logical gradients on device (None for frozen).
    w_src: per-param :class:`~zerojax._src.step.leaf_ops.WeightSource`
      (None for frozen).
    opt_raw: the inner state's leaves as stored.
    finish: ``finish(i, w, u)`` -> param ``i``'s results from its weights
      and update, computed inside its chunk (e.g. the new master copy,
      stashed, and the new params).
    bases: ``bases(i)`` -> the values ``finish(i, ...)``'s results replace
      (a tree like them, None where there is none), into which a layer
      stack's results are written row by row; others are concatenated.
    g_rows: per param, ``rows(span)`` -> rows of ``g_view[i]``, which a
      stack updated by rows reads (None: sliced from ``g_view``).

  Returns:
    ``(per-param finish results (None for frozen), new state leaves as
    stored)``.
  """
  opt_def = spec.opt_def if opt_def is None else opt_def
  train = [i for i, s in enumerate(w_src) if s is not None]
  g_flat = [g_view[i] for i in train]
  own = owners(spec)
  out = _stacks.Out(len(w_src), opt_raw, bases)
  shared = {
    j: _ops.opt_logical(spec.opt_leaves[j], opt_raw[j]) for j in p.shared
  }
  stored = []  # each chunk's results, as stored
  computed = []  # each chunk's new values on the device, before storing
  for k, (chunk, owned) in enumerate(zip(p.chunks, p.owned)):
    spans = dict(zip(chunk, p.rows_of(k)))
    raw_w = [_stacks.rows_of(out.latest(w_src[i].raw), spans[i]) for i in chunk]
    raw_o = [
      _stacks.rows_of(out.latest(opt_raw[j]), spans[own[j]]) for j in owned
    ]
    waits = []
    if p.after[k] is not None:
      waits.append([out.latest(x) for x in stored[p.after[k]]])
    if p._waits_for_computed(k):
      waits.append(computed[p.computed[k]])
    if waits:
      # this chunk's loads wait for those results
      (raw_w, raw_o), _ = jax.lax.optimization_barrier(((raw_w, raw_o), waits))
    w = {i: w_src[i].load(x) for i, x in zip(chunk, raw_w)}
    o = {
      j: _ops.opt_logical(spec.opt_leaves[j], x) for j, x in zip(owned, raw_o)
    }
    u, new = {}, {}
    whole = [i for i in chunk if spans[i] is None]
    if whole or (k == 0 and p.shared):
      o_whole = {j: x for j, x in o.items() if own[j] in whole}
      u_w, new_w = _whole_update(
        spec,
        train,
        w_src,
        g_flat,
        w={i: w[i] for i in whole},
        o={**shared, **o_whole},
        opt_raw=opt_raw,
        extra_args=extra_args,
        opt_def=opt_def,
      )
      u.update({i: u_w[i] for i in whole})
      new.update({j: new_w[j] for j in owned if own[j] in whole})
      if k == 0:
        new.update({j: new_w[j] for j in p.shared})
    for i in chunk:
      if spans[i] is not None:
        mine = [j for j in owned if own[j] == i]
        outs = _stacks.stack_update(
          spec,
          p,
          train,
          g_flat,
          i=i,
          w_rows=w[i],
          o={**shared, **o},
          mine=mine,
          extra_args=extra_args,
          span=spans[i],
          g_rows=None if g_rows is None else g_rows[i],
        )
        u[i] = outs[0]
        new.update(zip(mine, outs[1:]))
    computed.append(
      [u[i] for i in chunk]
      + [
        new[j]
        for j in owned
        if not jax.dtypes.issubdtype(new[j].dtype, jax.dtypes.extended)
      ]
    )
    outs = []
    for i in chunk:
      outs.extend(out.result(i, spans[i], finish(i, w[i], u[i])))
    for j in owned + (p.shared if k == 0 else ()):
      value = _ops.opt_storage(spec.opt_leaves[j], new[j])
      outs.append(out.state(j, spans.get(own[j]), value))
    stored.append(outs)
  return out.done()


def _whole_update(
  spec, train, w_src, g_flat, *, w, o, opt_raw, extra_args, opt_def
):
  """The inner update with the weights ``w`` and state ``o`` given, the
  other leaves zeros (which no output kept reads: checked by
  :func:`plan`); typed keys have no zeros and are read as they are.
  Returns per param its update, and the new state's leaves."""
  opt_in = [
    o[j] if j in o else _ops.opt_zeros(spec.opt_leaves[j], opt_raw[j])
    for j in range(len(opt_raw))
  ]
  w_in = [
    w[i] if i in w else jnp.zeros(a.shape, a.dtype)
    for i, a in ((i, w_src[i].aval) for i in train)
  ]
  updates, new = _ops.inner_update(
    spec,
    _view(spec, train, g_flat),
    jax.tree.unflatten(opt_def, opt_in),
    _view(spec, train, w_in),
    extra_args,
  )
  return spec.from_optimizer_view(updates), jax.tree.leaves(new)
