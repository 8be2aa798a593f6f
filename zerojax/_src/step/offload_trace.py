"""The streamed update's trace, kept while a planner weighs placements.

:func:`zerojax._src.step.offload.plan` traces the inner optimizer's update
to a jaxpr and reads it (which outputs read which inputs, which stacks
update by rows). Where the master copy and the state live does not enter
that program: the trace is of shapes, and a placement only changes how the
update is chunked. A planner weighing many shares of one model
(:func:`zerojax.cost.offload_fraction_needed`) would otherwise trace the
same update once per share, most of each plan's time; within
:func:`traces_kept` each update is traced once and what is read from it is
kept beside it. Outside it (every training step's build) nothing is kept.

A trace is reused only for a spec equal to the one it was traced for in
everything but the placements (the config's ``offload*`` fields, each
record's :class:`~zerojax._src.records.spec.Placement`), with the same
inputs, so the inner optimizer is the same object and every layout, shape
and dtype the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

from zerojax._src.records.spec import StateSpec

_PLACEMENT_FIELDS = frozenset({"offload", "offload_params", "offload_grads"})

# the traces kept within traces_kept() (None: none are kept)
_KEPT: contextvars.ContextVar[list[tuple[tuple, Kept | None]] | None] = (
  contextvars.ContextVar("zerojax_offload_traces", default=None)
)


@dataclasses.dataclass
class Kept:
  """One update's trace and what has been read from it: ``deps`` (the
  inputs each output reads), ``flat`` (the program inlined, or None where
  the chunks run the optimizer's own update), ``rows`` (per trained leaf,
  the rows its stack updates by, 0 where it cannot)."""

  closed: Any
  deps: Any = None
  flat: Any = dataclasses.field(default=None)
  flat_known: bool = False
  rows: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def traces_kept():
  """Within it, :func:`traced` keeps each update's trace for the specs
  that differ from its own only in placements (nested: the outer keeps)."""
  if _KEPT.get() is not None:
    yield
    return
  token = _KEPT.set([])
  try:
    yield
  finally:
    _KEPT.reset(token)


def traced(spec: StateSpec, key: tuple, trace) -> Kept | None:
  """``trace()``'s result (a closed jaxpr, or None) as a :class:`Kept`,
  reused within :func:`traces_kept` for a spec of the same program and
  the same ``key`` (the trace's inputs); None when it cannot be traced."""
  kept = _KEPT.get()
  if kept is None:
    closed = trace()
    return None if closed is None else Kept(closed)
  whole = (_program_of(spec), key)
  for k, entry in kept:
    if _same(k, whole):
      return entry
  closed = trace()
  entry = None if closed is None else Kept(closed)
  kept.append((whole, entry))
  return entry


def _program_of(spec: StateSpec) -> tuple:
  """What of ``spec`` enters the update's program: all but placements."""
  config = spec.config
  fields = tuple(
    (f.name, getattr(config, f.name))
    for f in dataclasses.fields(config)
    if f.name not in _PLACEMENT_FIELDS
  )
  unplaced = lambda r: dataclasses.replace(
    r, place=dataclasses.replace(r.place, offload=False, params_host=False)
  )
  return (
    fields,
    spec.params_def,
    tuple(map(unplaced, spec.leaves)),
    spec.opt_def,
    tuple(map(unplaced, spec.opt_leaves)),
  )


def _same(a, b) -> bool:
  """``a == b``, False where a field cannot be compared (an array)."""
  try:
    return bool(a == b)
  except Exception:  # noqa: BLE001 - not comparable: not reused
    return False
