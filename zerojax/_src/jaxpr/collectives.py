"""Which collectives a traced program runs over given mesh axes.

A loss that JAX's per-device types refuse runs untyped
(``step/per_device.py``). There a collective the loss runs over the batch
axes by name is not what it is in the typed program: a ``psum`` in a
custom VJP rule sums a gradient that zerojax sums again after the backward
pass, and no type says so. :func:`over_axes` finds such collectives, in
every sub-program (loop bodies, branches, calls), so that the step refuses
the loss instead of training on those numbers.
"""

from __future__ import annotations

import jax
import jax.extend

from zerojax._src.jaxpr.examples import where

# primitives that name mesh axes but move no value between devices
_NO_TRAFFIC = frozenset({"axis_index", "pvary", "pcast"})


def over_axes(closed, axes) -> list[str]:
  """``"<primitive> over (axes) at file:line"`` for each equation of
  ``closed`` (a ``ClosedJaxpr``), nested ones included, that communicates
  over any of the mesh ``axes``, in program order."""
  axes = frozenset(axes)
  found: list[str] = []
  _walk(getattr(closed, "jaxpr", closed), axes, found)
  return found


def _walk(jaxpr, axes, found):
  for e in jaxpr.eqns:
    named = _axis_names(e.params) & axes
    if named and e.primitive.name not in _NO_TRAFFIC:
      found.append(f"{e.primitive.name} over {tuple(sorted(named))}{where(e)}")
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
