"""The tensors Pa splits, recorded while a program is traced (for the
saved-activation figures: the traced program carries the whole tensor,
the compiled one ``1/shards`` of it per device)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Split:
  """One tensor Pa splits (a block input or a tensor the block keeps),
  seen while tracing (for the saved-activation figures: the traced program
  carries the whole tensor, the compiled one ``1/shards`` of it per
  device)."""

  shape: tuple
  dtype: Any
  shards: int


RECORDER: contextvars.ContextVar = contextvars.ContextVar(
  "zerojax_remat_recorder", default=None
)


@contextlib.contextmanager
def recording(axes: dict[str, int] | None = None):
  """Collects the :class:`Split` of every :class:`Remat` block traced inside.

  ``axes``: mesh axis sizes to split over when the trace has no mesh in
  context (the report and the planner trace one device's program with no
  mesh); with one in context, its sizes are used."""
  splits: list[Split] = []
  token = RECORDER.set((dict(axes or {}), splits))
  try:
    yield splits
  finally:
    RECORDER.reset(token)
