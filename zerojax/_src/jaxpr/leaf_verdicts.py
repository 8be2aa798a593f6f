"""Verdicts on values the step combines over devices other than by
averaging, from their :mod:`batch_mean` classes in traces at two row
counts: a leaf summed (an integer aux leaf: a count?), one joined row by
row (a per-example aux leaf: each row its own example's?), one of which a
device's is kept (an integer model state leaf: the same on every
device?)."""

from __future__ import annotations

import math

import numpy as np

from zerojax._src.jaxpr import row_count as _row_count
from zerojax._src.jaxpr.classes import C, R, S, U, X
from zerojax._src.jaxpr.examples import element_value


def count_verdict(outs, baked, rows) -> str | None:
  """Why a leaf that the step sums over devices and micro-batches (an
  integer aux leaf) is not the whole batch's value, from its classes in
  traces at ``rows[0]`` and ``rows[1]`` rows (:func:`verdict`'s ``outs``
  and ``baked``); ``None`` when it is a count -- a sum over the examples
  with fixed factors, a constant proportional to the rows (a row count
  from a shape), zero -- or cannot be read."""
  a, b = outs
  for c in (a, b):
    if isinstance(c, X):
      return c.reason
  if any(isinstance(c, U) for c in (a, b)):
    return None
  if isinstance(a, C) and isinstance(b, C):
    va, vb = element_value(a), element_value(b)
    if va is not None and vb is not None:
      if va == 0 == vb or va * rows[1] == vb * rows[0]:
        return None
      if va != vb:
        return "a number that grows with the rows otherwise than a count"
    return (
      "it does not depend on the examples, so the sum over devices is "
      "that many times the value"
    )
  if isinstance(a, S) and isinstance(b, S):
    if a.coefs != b.coefs or _row_count.factors_differ(baked):
      return "a sum over the examples scaled by a factor that follows the rows"
  return None


def kept_verdict(outs) -> tuple[str, str]:
  """``("same" | "mixes" | "unknown", reason)`` for a value of which the
  step keeps one device's (an integer model state leaf), from its classes
  in two traces: the whole batch's only when it depends neither on the
  examples nor on their number."""
  a, b = outs
  for c in outs:
    if isinstance(c, X):
      return "mixes", c.reason
    if isinstance(c, U):
      return "unknown", c.reason
  if isinstance(a, C) and isinstance(b, C):
    reason = _row_count.constant_differs(a, b)
    return ("mixes", reason) if reason else ("same", "")
  return "mixes", (
    "it depends on the examples (a count over them), so device 0's counts "
    "only its rows"
  )


def per_row_verdict(outs, baked, dim: int) -> tuple[str, str]:
  """``("rows" | "mixes" | "unknown", reason)`` for a value whose axis
  ``dim`` follows the rows, from its classes in two traces (as
  :func:`verdict`'s): ``"rows"`` when each row is its own example's value
  (joining the devices' rows gives the whole batch's), or when it is the
  same along the rows."""
  for c in outs:
    if isinstance(c, X):
      return "mixes", c.reason
    if isinstance(c, U):
      return "unknown", c.reason
    if isinstance(c, S):
      return "mixes", f"a sum over the batch's rows, spread over them{c.at}"
    if isinstance(c, C) and not _same_along(c, dim):
      if c.pos == dim:
        return "mixes", (
          "a position along the batch's rows (an iota), which each device "
          "counts from its own first row"
        )
      return "unknown", "a value that differs along the rows by position"
    if isinstance(c, R) and c.d != dim:
      return "unknown", "its examples on another axis than its rows"
    if not isinstance(c, (C, R)):
      return "unknown", "a layout of the rows zerojax does not read"
  a, b = outs
  if isinstance(a, R) and isinstance(b, R):
    if not math.isclose(a.scale, b.scale, rel_tol=1e-5, abs_tol=1e-30):
      return "mixes", (
        f"each row scaled by a number that follows the batch size "
        f"({a.scale:.4g} at one, {b.scale:.4g} at another)"
      )
    if _row_count.factors_differ(baked):
      return "unknown", (
        "each example's term is scaled by a number that changes with the "
        "batch size"
      )
  return "rows", ""


def _same_along(c: C, dim: int) -> bool:
  """Whether the constant ``c`` is the same along axis ``dim`` (a fill,
  an axis it is uniform along, or a random draw: independent per row)."""
  if dim in c.uniform or c.fill is not None or c.noise:
    return True
  if c.val is not None and np.ndim(c.val) > dim:
    v = np.asarray(c.val)
    return bool(np.all(v == np.take(v, [0], axis=dim)))
  return False
