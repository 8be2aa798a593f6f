"""Which collectives a traced program runs over given mesh axes, and which
of a gradient program's are the loss's own backward rules'.

A loss that JAX's per-device types refuse runs untyped
(``step/per_device.py``). There a forward collective is differentiated
as before -- its transpose (a ``psum``'s is a ``psum``, an
``all_gather``'s a reduce-scatter) sums the devices' cotangents, which
the per-device losses' sum needs -- but a collective a custom VJP rule
runs by name is the rule's own: a ``psum`` there sums a gradient that
zerojax sums again after the backward pass, and no type says so.
:func:`beyond_transposes` finds those: the gradient program's
collectives over the batch axes from a line of the user's code that no
forward collective comes from, in every sub-program (loop bodies,
branches, calls).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.extend

from zerojax._src.jaxpr.examples import user_frames, where

# primitives that name mesh axes but move no value between devices
_NO_TRAFFIC = frozenset({"axis_index", "pvary", "pcast"})


class Collective(NamedTuple):
  name: str
  axes: tuple
  at: str  # " at file:line" of the user's code, or ""
  frames: tuple = ()  # the user's frames it was traced under

  def __str__(self) -> str:
    return f"{self.name} over {self.axes}{self.at}"


def over_axes(closed, axes) -> list[Collective]:
  """Each equation of ``closed`` (a ``ClosedJaxpr``), nested ones
  included, that communicates over any of the mesh ``axes``, in program
  order."""
  found: list[Collective] = []
  _walk(getattr(closed, "jaxpr", closed), frozenset(axes), found)
  return found


def beyond_transposes(forward, differentiated) -> list[Collective]:
  """The collectives of ``differentiated`` (a loss and its backward pass)
  traced under other frames of the user's code than any of ``forward``'s
  (the loss alone): a backward rule's own. JAX gives a transposed
  equation, and a rematerialized one, the traceback of the forward
  equation it comes from, so those share its frames; a helper the rule
  shares with the forward pass is told apart by the frames above it. One
  traced under no user frame (library code only) is not counted."""
  seen = {c.frames for c in forward}
  return [c for c in differentiated if c.frames and c.frames not in seen]


def _walk(jaxpr, axes, found):
  for e in jaxpr.eqns:
    named = _axis_names(e.params) & axes
    if named and e.primitive.name not in _NO_TRAFFIC:
      found.append(
        Collective(
          e.primitive.name, tuple(sorted(named)), where(e), user_frames(e)
        )
      )
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      _walk(sub, axes, found)


def _axis_names(params) -> frozenset:
  """The mesh axis names among an equation's ``axes`` / ``axis_name``
  parameters (strings; reductions' ``axes`` hold array dimensions)."""
  names = set()
  for key in ("axes", "axis_name"):
    value = params.get(key)
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, str):
        names.add(v)
  return frozenset(names)
