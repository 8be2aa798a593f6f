"""Values that do not depend on the examples but on their number.

The loss check reads the loss traced at two row counts. A value of class
``C`` (independent of the examples) may still be computed from the row
count: a regularizer divided by ``x.shape[0]``, ``jnp.log(rows)`` added to
a mean. Each device computes it with its own rows, so the average of the
per-device losses is not the whole batch's loss (nor its gradient). The
reading tracks a known number that scales per-example values or sums (a
mean's divisor: ``scaled`` and ``linear`` in :mod:`examples`); every other
constant that meets them is recorded here by its fingerprint, and a record
that differs between the two traces combines the examples' number into
the loss.

Where a slice, dynamic slice or pad cuts the axes beside the rows, and a
table the examples look up (a gather's operand, ``jnp.searchsorted``'s
bins), are recorded the same way, with their shapes.

A constant whose value is not known (a product of params with a literal)
carries ``C.lits``, the known numbers folded into it, so a
``sum(w ** 2) / rows`` differs between the traces as ``rows`` does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zerojax._src.jaxpr.classes import C
from zerojax._src.jaxpr.examples import BAKED, element_value, shape_of, where


@dataclasses.dataclass(frozen=True)
class Const:
  """A constant that met per-example values or sums, by its fingerprint
  and shape; the equation it met them in (for the message) is not
  compared."""

  fp: tuple
  shape: tuple
  e: object = dataclasses.field(compare=False)


def fingerprint(c: C) -> tuple | None:
  """What ``c``'s value is made of: its value when known, else the known
  numbers folded into it; None for neither (a param, a scalar batch leaf:
  the same at every row count)."""
  v = element_value(c)
  if v is not None:
    a = np.asarray(v)
    return ("value", a.dtype.str, a.tobytes())
  if c.val is not None:
    a = np.asarray(c.val)
    return ("array", a.shape, a.dtype.str, hash(a.tobytes()))
  if c.lits:
    return ("folded", c.lits)
  return None


def lits(ins) -> frozenset:
  """``C.lits`` of a constant folded from ``ins`` whose value is not
  known: the fingerprints of the known numbers folded into them. An
  array's is left out: one with the rows' shape (an iota over them)
  differs between the traces by its shape alone. A set, so a loop's carry
  settles (:func:`joined`)."""
  out = frozenset()
  for c in ins:
    if isinstance(c, C):
      out |= c.lits
      p = fingerprint(c)
      if p is not None and p[0] == "value":
        out |= {p}
  return out


def joined(a: C, b: C) -> frozenset:
  """``C.lits`` of a loop carry or branch output that is ``a`` or ``b``."""
  return lits([a, b])


def note(e, name: str, ins):
  """Records each constant among ``ins`` that an equation ``name``
  combines with per-example values or sums, except a known factor (every
  element alike) of a product or a quotient's divisor, which the reading
  tracks."""
  for i, c in enumerate(ins):
    if not isinstance(c, C) or c.noise:
      continue
    factor = name in ("mul", "dot_general") or (name == "div" and i == 1)
    if factor and element_value(c) is not None:
      continue
    fp = fingerprint(c)
    if fp is not None:
      BAKED.get().append(Const(fp, shape_of(e.invars[i]), e))


def note_whole(e, i: int, c: C):
  """Records constant operand ``i`` of ``e`` (an array the examples are
  looked up in: ``jnp.searchsorted``'s sorted values) by its shape and
  fingerprint together, so one whose size follows the rows
  (``jnp.arange(rows)``) differs between the traces too."""
  fp = ("whole", shape_of(e.invars[i]), fingerprint(c), c.pos is not None)
  BAKED.get().append(Const(fp, (), e))


def note_placed(e, placed: tuple):
  """Records where a slice, dynamic slice or pad cuts the axes other than
  the rows (``x[:, rows // 2]`` differs between the traces)."""
  BAKED.get().append(Const(("placed", placed), (), e))


def locate(start: int, e):
  """Names the call ``e`` as where each constant recorded from ``start``
  on met the examples, where its own equation names no line of the
  user's code (a jitted library function's body, traced from elsewhere)."""
  records = BAKED.get()
  for k in range(start, len(records)):
    x = records[k]
    if isinstance(x, Const) and not where(x.e):
      records[k] = dataclasses.replace(x, e=e)


def factors_differ(baked) -> bool:
  """Whether the two traces baked other factors into the examples' terms
  (their constants' records left out)."""
  a, b = (tuple(x for x in t if not isinstance(x, Const)) for t in baked)
  return a != b


def differs(baked) -> str | None:
  """Why the two traces' constants (their records in ``baked``) show the
  loss depends on the row count, or None."""
  a = [x for x in baked[0] if isinstance(x, Const)]
  b = [x for x in baked[1] if isinstance(x, Const)]
  if len(a) != len(b):
    return None  # the program's structure changes: read elsewhere
  for x, y in zip(a, b):
    if x.shape != y.shape:
      continue  # with the rows' shape (positions along them): read by class
    if x != y:
      return _reason(where(x.e))
  return None


def constant_differs(a: C, b: C) -> str | None:
  """Why a loss (or aux leaf) of class ``C`` in both traces differs
  between them, or None."""
  if fingerprint(a) != fingerprint(b):
    return _reason("")
  return None


def _reason(at: str) -> str:
  return (
    f"a value computed from the batch's row count enters it other than as "
    f"a mean's divisor{at} (a regularizer divided by x.shape[0], a "
    f"log of the batch size): each device computes it with its own rows, "
    f"so it changes with how the batch is split; pass such a number as a "
    f"scalar batch leaf (the whole batch's size) instead"
  )
