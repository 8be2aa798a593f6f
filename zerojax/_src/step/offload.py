"""Offload: the optimizer update streamed through device memory in chunks.

Which arrays are offloaded (all, or whole arrays up to a share of the
bytes: a leaf's master copy, each optimizer leaf) is in each leaf's record
(:mod:`zerojax._src.records.host_memory`); an array kept on the device is
updated in place within its chunk.

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

import jax
import numpy as np

from zerojax._src.jaxpr import cut as _cut
from zerojax._src.jaxpr import deps as _deps
from zerojax._src.records import host_memory as _host_memory
from zerojax._src.records.spec import StateSpec
from zerojax._src.step import leaf_ops as _ops
from zerojax._src.step import offload_rows as _stacks
from zerojax._src.step import offload_trace as _trace

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
  # the update's jaxpr, which computes a stack's rows (with ``cut``: the
  # cut's values its last inputs)
  program: object = dataclasses.field(default=None, compare=False)
  # offloaded gradients: the values every leaf's update reads made from
  # all the gradients (a global norm), computed before the chunks
  # (:mod:`zerojax._src.jaxpr.cut`); None: there are none
  cut: object = dataclasses.field(default=None, compare=False)
  # ``program`` inlined (a :class:`~zerojax._src.jaxpr.cut.Flat`), which
  # the chunks evaluate (with the cut's values given), or None: they run
  # the optimizer's update (:func:`_program_flat`)
  flat: object = dataclasses.field(default=None, compare=False)
  # ``cut``'s values in the passes over the gradients that compute them,
  # each given the earlier passes' values (most updates: one pass)
  cut_passes: tuple = dataclasses.field(default=(), compare=False)

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


def plan(
  spec: StateSpec,
  g_avals,
  w_avals,
  extra_avals=None,
  opt_def=None,
  grads_host: bool = False,
):
  """``(Plan, None)`` when streaming gives the whole update's numbers, else
  ``(None, reason)``. Decided from shapes alone. ``grads_host``: the
  gradients are in host memory too (``offload_grads``), so each chunk is
  given only its own, and no output may read another leaf's.

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
      view(spec, train, g),
      jax.tree.unflatten(opt_def, list(o)),
      view(spec, train, w),
      jax.tree.unflatten(e_def, extra),
    )
    return jax.tree.leaves(updates), jax.tree.leaves(new)

  args = (
    *[g_avals[i] for i in train],
    *opt_avals,
    *[w_avals[i] for i in train],
    *e_leaves,
  )
  kept = _trace.traced(
    spec,
    (args, opt_def, e_def, tuple(e_all), tuple(train)),
    lambda: _deps.trace(flat_update, *args),
  )
  if kept is None:
    return None, "the inner update could not be traced to a jaxpr here"
  closed = kept.closed
  if len(closed.jaxpr.outvars) != n_g + n_o:
    return None, "the inner update returned a state of another structure"
  shared = tuple(j for j, p in enumerate(own) if p is None)
  slot = {i: k for k, i in enumerate(train)}
  n_in = 2 * n_g + n_o + len(e_leaves)
  always = (
    (frozenset() if grads_host else frozenset(range(n_g)))
    | {n_g + j for j in shared}
    | frozenset(range(2 * n_g + n_o, n_in))
  )
  cut, passes = None, ()
  if grads_host:
    passes, reason = _grads_cut(closed, n_g, own, slot, always)
    if reason:
      return None, reason
    if passes:
      cut = _cut.Cut(
        passes[0].flat,
        tuple(v for c in passes for v in c.values),
        tuple(
          tuple(sorted({v for c in passes for v in c.frontier[k]}))
          for k in range(n_g)
        ),
      )
      # the update with the cut's values as inputs after the others
      closed = jax.make_jaxpr(
        lambda *a: cut.flat.evaluate(
          a[:n_in], cut.flat.outs, dict(zip(cut.values, a[n_in:]))
        )
      )(*closed.in_avals, *[cut.flat.avals[v] for v in cut.values])
      always = always | frozenset(range(n_in, n_in + len(cut.values)))
  if cut is None:
    if kept.deps is None:
      kept.deps = _deps.dependencies(closed)
    deps = kept.deps
  else:
    deps = _deps.dependencies(closed)
  allowed = {
    i: always
    | {n_g + n_o + slot[i], slot[i]}
    | {n_g + j for j, p in enumerate(own) if p == i}
    for i in train
  }
  what = "weights, state or gradients" if grads_host else "weights or state"
  for i in train:
    if not deps[slot[i]] <= allowed[i]:
      return None, (
        f"the update of params{spec.leaves[i].path} reads other leaves' {what}"
      )
  for j, p in enumerate(own):
    if not deps[n_g + j] <= (always if p is None else allowed[p]):
      return None, (
        f"optimizer state{spec.opt_leaves[j].path} reads "
        + (f"other leaves' {what}" if p is not None else f"the leaves' {what}")
      )
  # a leaf kept on the device costs no chunk room: it joins its neighbours
  # (what the chunk moves: the weights with a master copy in host memory,
  # without one with any state there, and the state in host memory)
  sizes = [
    (
      nbytes(w_avals[i]) * spec.leaves[i].place.offload
      + sum(
        nbytes(opt_avals[j])
        for j, p in enumerate(own)
        if p == i and spec.opt_leaves[j].place.offload
      )
    )
    for i in train
  ]
  items = []  # (param, row or None, bytes)
  # without a cut the rows are the kept trace's; with one, its program's
  kept_rows = kept.rows if cut is None else {}
  rows = (
    _stack_rows(spec, closed, kept_rows, train, sizes, own) if _by_rows else {}
  )
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
    tuple(chunks),
    owned,
    shared,
    after,
    computed,
    tuple(rows),
    closed,
    cut,
    _program_flat(closed, cut, kept),
    passes,
  ), None


def _program_flat(closed, cut, kept):
  """:attr:`Plan.flat`: the program inlined where the chunks evaluate it
  (with a cut, or a branch whose outputs each chunk cuts to its own);
  None where they run the optimizer's own update. Without a cut, kept
  beside the update's trace (``kept``)."""
  if cut is None and kept.flat_known:
    return kept.flat
  flat = _cut.Flat(closed)
  flat = flat if cut is not None or flat.branch_reads else None
  if cut is None:
    kept.flat, kept.flat_known = flat, True
  return flat


def _grads_cut(closed, n_g: int, own, slot, allowed):
  """``(passes, None)``: the values every leaf's update reads that are
  made from all the gradients (:mod:`zerojax._src.jaxpr.cut`), computed
  before the chunks from each gradient in turn, in one pass or more
  (:func:`~zerojax._src.jaxpr.cut.passes`; empty: there are none); or
  ``(None, reason)`` when they are not small, or are made from weights or
  state too (which the pass does not bring down)."""
  out_groups = list(range(n_g)) + [None if p is None else slot[p] for p in own]
  groups = [{k} for k in range(n_g)]
  # a norm inside a branch (a clip under apply_if_finite), computed first
  flat = _cut.Flat(_cut.hoist(closed, groups, out_groups))
  passes = _cut.passes(flat, groups, out_groups)
  if not passes:
    return (), None
  c = passes[-1]
  big = _cut.too_large(c)
  if big:
    return None, f"{big}, too large to compute before the update"
  reads = flat.reads([{i} for i in range(flat.n_in)])
  ok = allowed | frozenset(range(n_g))
  every = [
    v for c in passes for v in (*c.values, *(v for f in c.frontier for v in f))
  ]
  for v in every:
    if not reads[v] <= ok:
      eqn = flat.eqns[flat.made_by[v]][0] if v in flat.made_by else None
      return None, (
        f"a value made from every leaf's gradient ({eqn.primitive.name if eqn else 'an input'}, "
        f"shape {tuple(flat.avals[v].shape)}) is made from the weights or "
        "state too"
      )
  return tuple(passes), None


def _stack_rows(spec: StateSpec, closed, known, train, sizes, own) -> dict:
  """``{k: rows}`` for the trained leaves (``k``-th) streamed by rows: the
  layer stacks that can be (:func:`~zerojax._src.step.offload_rows.stack_rows`)
  larger than both a chunk's budget and every leaf streamed whole, the
  ones that set the largest chunk. A stack smaller than a whole leaf
  would not lower it, and its rows would only add transfers."""
  budget = sum(sizes) / CHUNKS
  rows = {}
  for k, i in enumerate(train):
    if sizes[k] > budget:
      # a leaf with bytes to stream is in host memory, and then its rows
      # depend on the program alone: known per leaf once read
      if k not in known:
        known[k] = _stacks.stack_rows(spec, closed, i, k, len(train), own)
      n = known[k]
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


def view(spec, train, leaves):
  """Per-param leaves of the trained params -> the optimizer's view."""
  return spec.optimizer_view(scatter(len(spec.leaves), train, leaves))
