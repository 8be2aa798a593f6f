"""The check that a loss is a mean or a sum over its batch's examples.

A step runs the loss on each device's rows of the batch (and on each
micro-batch) and averages the results for a mean over examples, or adds
them up for a sum over examples (``jnp.sum(ce * mask) / tokens`` with the
whole batch's token count a scalar batch leaf): the unsharded loss only
for those two. A loss that divides by sums it takes of its batch alone
(``jnp.sum(ce * mask) / jnp.sum(mask)``) is one of them once those sums
are the whole batch's, which the step computes first
(:mod:`zerojax._src.step.global_sums`).
:func:`check_mean_over_examples` traces the loss
abstractly, at two row counts, and reads which it is from its jaxpr
(:mod:`zerojax._src.jaxpr.batch_mean`), before anything runs: at a piece's own
rows and twice them, then confirmed at the whole batch's
(:func:`_confirmed`). A loss that
combines examples raises :class:`LossNotAMeanError`, naming what combines
them and where; one the reading cannot follow warns
(:class:`LossUnverifiedWarning`). ``per_device_loss=True`` states that
the per-device average is what is wanted (data parallelism's semantics:
batch statistics and normalizers per device) and skips the check. The
aux's own verdicts are in :mod:`zerojax._src.step.aux_check`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.jaxpr import batch_mean as _batch_mean
from zerojax._src.jaxpr import leaf_verdicts as _leaf_verdicts
from zerojax._src.records.spec import ZeroState
from zerojax._src.records.warn import warn
from zerojax._src.step.aux_check import (
  averaged_mixes,
  averaged_verdict,
  check_aux,
  summed_aux,
)
from zerojax._src.step.global_sums import GlobalSums
from zerojax._src.step.loss_call import LossCall, whole_params
from zerojax._src.step.loss_reading import (
  abstract_leaf,
  classified,
  leaf_signature,
  trusted_kind,
)


class LossNotAMeanError(ValueError):
  """The loss combines examples (it is neither a mean nor a sum over
  them), so no combination of the per-device losses is the loss on the
  whole batch."""


class LossUnverifiedWarning(UserWarning):
  """zerojax could not read whether the loss is a mean over examples."""


class ModelStateUpdateError(ValueError):
  """The loss updates its model state so that the step, which averages
  each floating leaf over devices and keeps device 0's integer leaves,
  would hold another state than the unsharded step."""


_FIX = (
  "Write the loss as a mean over examples (jnp.mean of per-example terms), "
  "as a sum over them with nothing else added, or as such a sum divided by "
  "sums the loss takes of its batch alone (jnp.sum(ce * mask) / "
  "jnp.sum(mask), which the step computes for the whole batch), or build "
  "the step with per_device_loss=True to average per-device losses on "
  "purpose (batch statistics and normalizers per device, as data "
  "parallelism computes them)."
)


def check_per_device_loss(per_device_loss, where: str):
  if not isinstance(per_device_loss, bool):
    raise TypeError(
      f"{where}: per_device_loss={per_device_loss!r} must be True (average "
      f"the loss computed on each device's rows) or False (check that it "
      f"is a mean over examples)."
    )


def check_step_loss(step, state, batch):
  """:func:`check_mean_over_examples` for a train or eval step (a
  ``CompiledStep``) on ``state`` and ``batch``, unless it was built with
  ``per_device_loss=True``."""
  if step.per_device_loss:
    return "mean"
  call = LossCall(
    has_key=state.key is not None, has_model_state=state.model_state is not None
  )

  def loss(p, b, k, ms):
    value, new_ms, aux = call(step.loss_fn, p, b, k, ms)
    return (
      value,
      aux if step.reports_aux else (),  # a dropped aux: unread
      new_ms if step.keeps_model_state else (),  # a discarded one too
    )

  return check_mean_over_examples(
    loss,
    whole_params(state.spec),
    batch,
    None if state.key is None else jax.random.key(0),
    state.model_state,
    shards=step.tx.batch_shards * step.accum_steps,
    where=step.where,
    seen=step.checked,
  )


def grad_loss_check(loss_fn, tx, has_aux, accum, per_device_loss):
  """``check(params, batch, key)``: :func:`check_mean_over_examples` for
  :func:`zerojax.value_and_grad` on ``params`` (a tree, or a
  ``ZeroState``), unless ``per_device_loss``."""
  where = "zerojax.value_and_grad"
  check_per_device_loss(per_device_loss, where)
  seen: dict = {}

  def check(params, batch, key):
    if per_device_loss:
      return "mean"
    state = params if isinstance(params, ZeroState) else None
    has_key = key is not None or (state is not None and state.key is not None)
    call = LossCall(has_key=has_key, has_model_state=False, has_aux=has_aux)
    return check_mean_over_examples(
      lambda p, b, k, ms: _loss_and_aux(call(loss_fn, p, b, k, ms)),
      params if state is None else whole_params(state.spec),
      batch,
      jax.random.key(0) if has_key else None,
      None,
      shards=tx.batch_shards * accum,
      where=where,
      seen=seen,
    )

  return check


def _loss_and_aux(out):
  loss, _, aux = out
  return loss, aux, ()


def check_mean_over_examples(
  loss, params, batch, key, model_state, *, shards: int, where: str, seen: dict
):
  """Raises or warns unless ``loss(params, batch, key, model_state)`` (the
  loss value) is a mean or a sum over the batch's examples; warns for each
  floating aux leaf the step averages that combines examples
  (:func:`_check_aux`). Returns how the devices' and micro-batches' losses
  combine into the whole batch's: ``"sum"`` for a sum over examples,
  ``"mean"`` otherwise (a mean, or a loss that could not be read).

  Args:
    loss: ``(params, batch, key, model_state) -> (scalar loss, aux)``.
    params: the params as the loss sees them (arrays or shapes).
    batch: the whole batch as the user passed it.
    key, model_state: as the loss is called with them (or None).
    shards: devices x micro-batches the rows split over.
    where: the calling API, for messages.
    seen: verdicts by batch signature, kept by the caller.
  """
  leaves, treedef = jax.tree.flatten(batch)
  signature = (treedef, tuple(leaf_signature(x) for x in leaves), shards)
  if signature in seen:
    return seen[signature]
  seen[signature] = "mean"
  rows = next(np.shape(x)[0] for x in leaves if np.ndim(x)) // shards
  # read at a piece's own rows and twice them, where JAX traces the same
  # program (at one row it drops size-1 dimensions: then at 2 and 3);
  # then confirmed at the whole batch's rows (:func:`_confirmed`)
  counts = (rows, 2 * rows) if rows > 1 else (2, 3)
  abstract = jax.tree.map(abstract_leaf, (params, key, model_state))
  first = classified(loss, abstract, treedef, leaves, counts[0])
  second = None
  if first is None and rows == 1:
    counts = (1, 1)  # a loss written for one row
    first = classified(loss, abstract, treedef, leaves, 1)
  if first is None:
    return "mean"  # the step reports the loss's error itself
  if counts[1] != counts[0]:
    second = classified(loss, abstract, treedef, leaves, counts[1])
    if second is None:  # a loss written for one batch size
      counts = (counts[0], counts[0])
  outs = [first[0][0], None if second is None else second[0][0]]
  baked = [first[1], () if second is None else second[1]]
  kind, reason = _batch_mean.verdict(outs, baked, counts)
  # the aux as the loss computes it; the loss, its model state and the
  # aux leaves that need them with the whole batch's sums over the batch,
  # where it takes any
  aux_read, state_read, given = (first, second, baked), None, None
  unverified = None  # what a reading with the sums given took on trust
  if kind in ("mixes", "unknown") and second is not None:
    with_sums = _with_global_sums(loss, abstract, treedef, leaves, counts)
    if isinstance(with_sums, str) and kind == "mixes":
      reason = with_sums  # what still combines examples with them given
    elif isinstance(with_sums, tuple):
      *state_read, kind, given, unverified = with_sums
  elif kind in ("mean", "sum") and second is not None:
    # a mean or a sum whose aux divides by a count (a masked accuracy)
    with_sums = None
    if any(averaged_mixes(aux_read, counts)):
      with_sums = _with_global_sums(loss, abstract, treedef, leaves, counts)
    if isinstance(with_sums, tuple) and with_sums[3] == kind:
      if any(summed_aux(aux_read, with_sums[:3], counts)):
        *state_read, kind, given, unverified = with_sums
  summed = ()
  if given is not None:
    summed = summed_aux(aux_read, state_read, counts)
    given = dataclasses.replace(given, aux=summed)
  also, more = [], []  # model state leaves wrong, readings, where confirmed
  if second is not None and kind in ("mean", "sum") and shards > 1:
    mode = given is not None and (unverified is None or "optimistic")
    at = [n for n in (rows, rows * shards) if n not in counts]
    ref = state_read or aux_read
    why, also, more = _confirmed(
      loss,
      abstract,
      (treedef, leaves),
      ref,
      (counts[0], *at),
      kind=kind,
      mode=mode,
    )
    if why is not None:
      kind, reason = "mixes", why
    if mode and why is None and aux_read[0][0][1]:
      # the aux as the loss computes it: read without the sums
      more = [
        (n, classified(loss, abstract, treedef, leaves, n)) for n, _ in more
      ]
      more = [(n, read) for n, read in more if _same_layout(read, first)]
  if second is not None and kind != "mixes":
    check_aux(*aux_read, counts, where, summed=summed, more=more)
    wrong = _model_state_verdicts(*(state_read or aux_read), counts, where)
    named = {leaf for leaf, _, _ in wrong}
    wrong += [w for w in also if w[0] not in named]
    if wrong:
      del seen[signature]
      raise ModelStateUpdateError(_model_state_message(where, wrong))
  if kind == "mixes":
    del seen[signature]  # raised: asked again, it raises again
    raise LossNotAMeanError(
      f"{where}: loss_fn is neither a mean nor a sum over the batch's "
      f"examples: {reason}. The step computes the loss on each device's "
      f"rows (and micro-batch) and averages the results (a mean over "
      f"examples) or adds them up (a sum), which is the loss on the whole "
      f"batch only for those two; this one would give other numbers than "
      f"the unsharded step. {_FIX}"
    )
  if unverified is not None:
    _unverified(where, unverified, "sum" if given.sums else "mean", True)
  elif kind == "unknown":
    # as the reading cannot tell, a kernel taken as per example says
    # whether the pieces' losses add up (a sum) or average (the rest)
    if (
      second is not None
      and trusted_kind(loss, abstract, treedef, leaves, counts) == "sum"
    ):
      kind = "sum"
    _unverified(where, reason, kind)
  seen[signature] = given or ("sum" if kind == "sum" else "mean")
  return seen[signature]


def _confirmed(loss, abstract, batch, ref, counts, *, kind, mode):
  """``(why the loss is not a mean or a sum after all, or None; the model
  state leaves it updates otherwise than the unsharded step; the readings
  that confirm it, as ``[(rows, reading)]``)``, from the
  loss read again at each of ``counts[1:]`` (the whole batch's rows; one
  piece's where it holds one row) against ``ref``'s reading at
  ``counts[0]``.

  The verdict reads the loss at two close row counts, where JAX traces
  the same program; a function of the row count that agrees with a mean
  or a sum at those two (``max(rows, 64)`` at 16 and 32 rows) may differ
  at the whole batch's, which the unsharded step computes with. A count
  the loss does not trace at, or where its program changes (JAX drops a
  size-1 dimension at one row), confirms nothing. ``mode``: how the sums
  over the batch were read for the verdict (see :func:`classified`)."""
  first, baked0, n0 = ref[0], ref[0][1], counts[0]
  wrong, reads = [], []
  for n in counts[1:]:
    read = classified(loss, abstract, *batch, n, sums=mode)
    if not _same_layout(read, first) or read[2][:2] != first[2][:2]:
      continue
    if mode:
      for (a, where), (b, _) in zip(first[2][2], read[2][2]):
        if len(a) != len(b) or not np.allclose(a, b, rtol=1e-6, atol=0.0):
          return _SCALED_SUM + where, [], []
    a, b = first[0][0], read[0][0]
    if n == 1 and isinstance(b, (_batch_mean.X, _batch_mean.U)):
      continue  # one row: JAX may trace another program
    got, why = _batch_mean.verdict([a, b], [baked0, read[1]], (n0, n))
    if got == "mixes":
      return why, [], []
    if got != kind and got in ("mean", "sum"):
      return _factors_differ(a, b, (n0, n), kind), [], []
    if n > 1:
      wrong += _model_state_verdicts(
        first, read, [baked0, read[1]], (n0, n), "", quiet=True
      )
    reads.append((n, read))
  return None, wrong, reads


def _same_layout(read, first) -> bool:
  """Whether ``read`` traced, with the aux and model state leaves of
  ``first`` (paths and ranks): a reading to compare leaf by leaf."""
  layout = lambda r: [
    [(path, np.ndim(x)) for path, x in r[0][k]] for k in (2, 4)
  ]
  return read is not None and layout(read) == layout(first)


def _factors_differ(a, b, rows, kind) -> str:
  factors = lambda c: ", ".join(f"{x:.4g}" for x in c.coefs)
  how = "follow 1 / rows" if kind == "mean" else "stay"
  return (
    f"sums over the examples scaled by a number that changes with the rows "
    f"other than as a {kind}'s ({how}) at some row counts: "
    f"{factors(a)} x the sums at {rows[0]} rows, {factors(b)} x at "
    f"{rows[1]}{a.at}"
  )


def _with_global_sums(loss, abstract, treedef, leaves, counts):
  """``(first, second, baked, kind, GlobalSums, unverified)`` for a loss
  that is a mean or a sum over examples once the sums over the batch it
  takes of the batch alone are the whole batch's (:mod:`zerojax._src.
  step.global_sums`), read at both row counts; for one that takes such
  sums and combines examples still, why; None for any other.

  Where the reading cannot follow a part of the loss (a kernel), it is
  read again with each equation no rule follows taken as per example
  where its shapes allow; ``unverified`` then says what was not checked
  (the step warns, as for a mean it cannot read)."""
  read = _read_with_sums(loss, abstract, treedef, leaves, counts, False)
  unverified = None
  if isinstance(read, tuple) and read[3] == "unknown":
    unverified = read[4]
    read = _read_with_sums(loss, abstract, treedef, leaves, counts, True)
    if isinstance(read, str):
      return None  # (what mixes may be the unread part's doing)
  if not isinstance(read, tuple) or read[3] not in ("mean", "sum"):
    return read if isinstance(read, str) else None
  first, second, baked, kind, _ = read
  given = GlobalSums(*first[2][:2], sums=kind == "sum")
  return first, second, baked, kind, given, unverified


def _read_with_sums(loss, abstract, treedef, leaves, counts, optimistic):
  """``(first, second, baked, kind, reason)`` of the loss read with its
  sums over the batch given, at both row counts; what mixes examples, as
  a string; None where it takes no such sums or its program changes with
  the rows."""
  how = "optimistic" if optimistic else True
  first = classified(loss, abstract, treedef, leaves, counts[0], sums=how)
  second = classified(loss, abstract, treedef, leaves, counts[1], sums=how)
  if first is None or second is None or not first[2][1]:
    return None
  if first[2][:2] != second[2][:2]:  # the program changes with the rows
    return None
  for (a, at), (b, _) in zip(first[2][2], second[2][2]):
    if len(a) != len(b) or not np.allclose(a, b, rtol=1e-6, atol=0.0):
      return _SCALED_SUM + at
  baked = [first[1], second[1]]
  kind, reason = _batch_mean.verdict([first[0][0], second[0][0]], baked, counts)
  if kind == "mixes":
    return reason
  return first, second, baked, kind, reason


_SCALED_SUM = (
  "a sum over the batch scaled by a number that changes with the rows (a "
  "mean over the batch, or a sum of values divided by its row count), "
  "which each device computes with its own rows"
)


def _model_state_verdicts(
  first, second, baked, counts, where: str, quiet: bool = False
) -> list:
  """``[(leaf, dtype, reason)]`` for each new model state leaf the step
  would hold otherwise than the unsharded step: a floating leaf (averaged
  over devices) that is not a mean over examples -- a running max, a sum,
  a variance, a constant computed from the row count; an integer or bool
  leaf (device 0's kept) that depends on the examples or their number. A
  leaf the reading cannot follow warns (unless ``quiet``)."""
  wrong = []
  for (path, a), ca, cb in zip(first[0][4], first[0][3], second[0][3]):
    leaf = f"model_state{jax.tree_util.keystr(path)}"
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      continue  # a key: device 0's, as the unsharded step draws it
    if jnp.issubdtype(a.dtype, jnp.inexact):
      kind, reason = averaged_verdict([ca, cb], baked, counts)
    else:
      kind, reason = _leaf_verdicts.kept_verdict([ca, cb])
    if kind == "mixes":
      wrong.append((leaf, a.dtype, reason))
    elif kind == "unknown" and not quiet:
      warn(
        f"{where}: zerojax could not check how the loss updates {leaf} "
        f"({reason}). The step averages a floating model state leaf over "
        f"devices and keeps device 0's integer leaves, which is the "
        f"unsharded step's state only for a mean over examples or a value "
        f"that does not depend on them.",
        LossUnverifiedWarning,
      )
  return wrong


def _model_state_message(where: str, wrong) -> str:
  leaves = "; ".join(f"{leaf} ({dtype}): {why}" for leaf, dtype, why in wrong)
  return (
    f"{where}: the loss updates its model state otherwise than the "
    f"unsharded step would: {leaves}. The step runs the loss on each "
    f"device's rows and then averages each floating model state leaf over "
    f"devices (the whole batch's value for a mean over examples, such as "
    f"a running mean) and keeps device 0's integer leaves (the whole "
    f"batch's for a value that does not depend on the batch, such as a "
    f"step counter). Return what the update needs per example as an aux "
    f"leaf (the step returns the whole batch's rows) and update the state "
    f"after the step, pass a whole-batch number (its size) as a scalar "
    f"batch leaf, or build the step with per_device_loss=True to keep data "
    f"parallelism's per-device state on purpose."
  )


def _unverified(where, reason, kind="mean", global_sums=False):
  how = (
    "averages the loss computed on each device's rows, which is the whole "
    "batch's loss only for such a mean"
  )
  if kind == "sum" or global_sums:
    given = "runs it with the whole batch's sums it divides by and "
    how = (
      f"{given if global_sums else ''}"
      f"{'adds up' if kind == 'sum' else 'averages'} the devices' losses, "
      f"taking that part as computed per example, which is the whole "
      f"batch's loss only if it is"
    )
  warn(
    f"{where}: zerojax could not check that loss_fn is a mean over the "
    f"batch's examples ({reason}). The step {how}; a loss that combines "
    f"examples (a contrastive loss, batch statistics, a normalizer summed "
    f"over the batch) would get other numbers. {_FIX}",
    LossUnverifiedWarning,
  )
