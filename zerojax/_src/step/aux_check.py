"""The check that a loss's aux is what the step's combination of it over
devices and micro-batches needs: :func:`check_aux` warns for each leaf
whose combined value is not the unsharded loss's (read from the loss's
jaxpr, :mod:`zerojax._src.jaxpr.batch_mean`, by
:mod:`zerojax._src.step.loss_check`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.jaxpr import batch_mean as _batch_mean
from zerojax._src.jaxpr import leaf_verdicts as _leaf_verdicts
from zerojax._src.records.warn import warn


class AuxNotAMeanWarning(UserWarning):
  """A floating aux leaf the step averages over devices combines examples,
  so the step reports another number than the unsharded loss gives."""


class AuxNotACountWarning(UserWarning):
  """An integer or bool aux leaf the step sums over devices is not a count
  over the examples (a constant, a maximum, one example's value), so the
  step reports another number than the unsharded loss gives."""


class AuxNotPerExampleWarning(UserWarning):
  """An aux leaf whose shape follows the batch's rows, which the step joins
  row by row from the devices' pieces, is not computed row by row (a sort,
  a cumulative sum, a normalization over the rows, a position), so the
  step reports another array than the unsharded loss gives."""


class AuxUnverifiedWarning(UserWarning):
  """zerojax could not read whether an aux leaf is what the step's
  combination over devices needs (a mean over examples for a float, a
  count for an integer, each row its own example's for a leaf with the
  batch's rows), so the step's value may differ from the unsharded
  loss's."""


def averaged_mixes(read, counts) -> list[bool]:
  """Per aux leaf, whether it is a float the step averages that is not a
  mean over examples (``read``: ``(first, second, baked)``)."""
  (a_read, b_read, baked) = read
  return [
    a.shape == b.shape
    and jnp.issubdtype(a.dtype, jnp.inexact)
    and averaged_verdict([ca, cb], baked, counts)[0] == "mixes"
    for (_, a), (_, b), ca, cb in zip(
      a_read[0][2], b_read[0][2], a_read[0][1], b_read[0][1]
    )
  ]


def summed_aux(plain, given, counts) -> tuple:
  """Per aux leaf, whether the step adds it up with the whole batch's
  sums over the batch given (:mod:`zerojax._src.step.global_sums`): a
  float that is not a mean over examples as the loss computes it, but a
  sum over them once those sums are the whole batch's -- a masked
  accuracy, the loss itself. ``plain`` and ``given``: ``(first, second,
  baked)`` read without and with those sums."""
  ga, gb, g_baked = given
  return tuple(
    mixes and _batch_mean.verdict([wa, wb], g_baked, counts)[0] == "sum"
    for mixes, wa, wb in zip(averaged_mixes(plain, counts), ga[0][1], gb[0][1])
  )


def check_aux(first, second, baked, counts, where: str, *, summed=(), more=()):
  """Warns for each aux leaf whose combination over devices and
  micro-batches is not the unsharded loss's value: a floating leaf (the
  step averages it) that is not a mean over examples -- a ratio of sums
  (a masked accuracy), a maximum over the batch; an integer or bool leaf
  (the step sums it) that is not a count over them -- a constant, a
  maximum, one example's value; a leaf whose shape follows the rows (the
  step joins it row by row) whose rows are not each their own example's
  value -- a sort, a cumulative sum, a normalization over the rows, a
  position along them. A leaf the reading cannot follow warns that it is
  unchecked; one the step adds up (``summed``) is not warned about.
  ``more``: ``[(rows, reading)]`` at further row counts (the whole
  batch's), each compared with ``first`` for the leaves the step averages
  or sums."""
  (classes_a, shapes_a), (classes_b, shapes_b) = first[0][1:3], second[0][1:3]
  for i, ((path, a), (_, b), ca, cb) in enumerate(
    zip(shapes_a, shapes_b, classes_a, classes_b)
  ):
    if i < len(summed) and summed[i]:
      continue
    leaf = f"the loss's aux{jax.tree_util.keystr(path)}"
    unread = next((c for c in (ca, cb) if isinstance(c, _batch_mean.U)), None)
    if unread is not None:
      _warn_unread(where, leaf, a.dtype, a.shape != b.shape, unread.reason)
      continue
    if a.shape != b.shape:  # per example: joined row by row
      dims = [i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
      if len(dims) != 1:
        continue  # no rows to join: the step refuses it by leaf
      kind, reason = _leaf_verdicts.per_row_verdict([ca, cb], baked, dims[0])
      if kind == "unknown":
        _warn_unread(where, leaf, a.dtype, True, reason)
      elif kind == "mixes":
        _warn_per_row(where, leaf, reason)
      continue
    pairs = [([ca, cb], baked, counts)] + [
      ([ca, read[0][1][i]], [baked[0], read[1]], (counts[0], n))
      for n, read in more
      if read[0][2][i][1].shape == a.shape
      and not isinstance(read[0][1][i], (_batch_mean.X, _batch_mean.U))
    ]
    if jnp.issubdtype(a.dtype, jnp.inexact):  # bfloat16 too
      for outs, factors, rows in pairs:
        kind, reason = averaged_verdict(outs, factors, rows)
        if kind == "mixes":
          _warn_mean(where, leaf, reason)
          break
      continue
    reason = None
    for outs, factors, rows in pairs:
      reason = reason or _leaf_verdicts.count_verdict(outs, factors, rows)
    if a.dtype == np.bool_:
      reason = reason or "a bool, which the step sums as a count"
    if reason is not None:
      warn(
        f"{where}: {leaf} ({a.dtype}) is not a count over the batch's "
        f"examples ({reason}). The step sums an integer or bool aux leaf "
        f"over devices and micro-batches, which is the whole batch's value "
        f"only for a count (jnp.sum of per-example values), so it reports "
        f"another number than the unsharded loss gives. Return it per "
        f"example (a leaf with the batch's rows, which the step keeps row "
        f"by row), as a count, or as a float mean over examples.",
        AuxNotACountWarning,
      )


def averaged_verdict(outs, baked, counts) -> tuple[str, str]:
  """:func:`~zerojax._src.jaxpr.batch_mean.verdict` for a value the step
  averages over devices and micro-batches (a float aux or model state
  leaf): a sum over examples is then another number, as is any value that
  is not a mean."""
  return _batch_mean.verdict(outs, baked, counts, sums=False)


def _warn_unread(where: str, leaf: str, dtype, per_row: bool, reason: str):
  if per_row:
    how = (
      "joins an aux leaf with the batch's rows from the devices' and "
      "micro-batches' rows, which is the whole batch's value only when "
      "each row is computed from its own example"
    )
  else:
    how = (
      f"{'averages' if jnp.issubdtype(dtype, jnp.inexact) else 'sums'} a "
      f"{dtype} aux leaf over devices and micro-batches, which is the whole "
      f"batch's value only for a mean over examples (a float) or a count "
      f"(an integer)"
    )
  warn(
    f"{where}: zerojax could not check {leaf} ({dtype}): {reason}. The "
    f"step {how}, so it may report another value than the unsharded loss "
    f"gives. Return per-example values (each row from its own example), "
    f"counts or float means over examples, and combine them after the "
    f"step.",
    AuxUnverifiedWarning,
  )


def _warn_per_row(where: str, leaf: str, reason: str):
  warn(
    f"{where}: {leaf} has the batch's rows but is not computed row by row "
    f"({reason}). The step joins such a leaf from the devices' and "
    f"micro-batches' rows, so it reports another array than the unsharded "
    f"loss gives: each device's piece of it. Return per-example values "
    f"(each row from its own example) and combine them after the step.",
    AuxNotPerExampleWarning,
  )


def _warn_mean(where: str, leaf: str, reason: str):
  warn(
    f"{where}: {leaf} is not a mean over the batch's examples ({reason}). "
    f"The step averages a floating aux leaf over devices and "
    f"micro-batches, which is the whole batch's value only for such a "
    f"mean, so it reports another number than the unsharded loss gives. "
    f"Return it per example (a leaf with the batch's rows, which the step "
    f"keeps row by row) or its numerator and denominator as integer counts "
    f"(summed), and combine them after the step.",
    AuxNotAMeanWarning,
  )
