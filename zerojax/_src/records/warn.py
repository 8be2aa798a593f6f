"""Warnings attributed to the caller's own line: the first frame outside
zerojax and the libraries a step runs through (JAX, Flax, Optax, Orbax),
so a script or a notebook cell shows its own line, and Python's
once-per-location rule counts locations there. A fixed ``stacklevel``
would name a zerojax line whenever the call arrives by another path (a
jitted trace, the drop-in, a checkpoint restore)."""

from __future__ import annotations

import sys
import warnings

# top-level packages whose frames are passed over
_THROUGH = frozenset(
  {"zerojax", "jax", "jaxlib", "flax", "optax", "orbax", "chex"}
  | {"contextlib", "functools"}
)


def _passed_over(frame) -> bool:
  name = frame.f_globals.get("__name__", "")
  return name.split(".", 1)[0] in _THROUGH


def warn(message: str, category: type[Warning] = UserWarning) -> None:
  """``warnings.warn(message, category)`` at the first caller frame outside
  zerojax and the libraries it calls through."""
  level, frame = 2, sys._getframe(1)
  while frame is not None and _passed_over(frame):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)
