"""A loss normalized by a count over its batch, run with the whole batch's
count: :func:`with_global_sums`.

The loss check (:mod:`zerojax._src.step.loss_check`) finds, in a loss
that is neither a mean nor a sum over examples, the sums over the rows it
takes of the batch alone (``jnp.sum(mask)``; the reading is in
:mod:`zerojax._src.jaxpr.batch_sums`). When the loss with those sums
given is a mean or a sum over examples, its verdict is a
:class:`GlobalSums`. The per-device program then computes those sums for
each of its micro-batches, adds them over micro-batches and devices, and
runs the loss with each of its own sums replaced by the whole batch's:
each device's loss is its examples' share of the unsharded loss, and the
step adds the shares up (or averages them, for a mean).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.jaxpr import batch_mean as _batch_mean
from zerojax._src.jaxpr import batch_sums as _batch_sums
from zerojax._src.step.batch import Shared, unshare
from zerojax._src.step.loss_call import LossProgram, whole_params


@dataclasses.dataclass(frozen=True)
class GlobalSums:
  """The loss check's verdict for a loss that takes sums over its batch:
  their dtypes, in the order the loss computes them, and whether the loss
  with them given is a sum over examples (added up over devices and
  micro-batches) or a mean (averaged)."""

  dtypes: tuple
  sums: bool


def as_sums(verdict):
  """The step's static ``sums`` argument from a loss check's verdict:
  ``True`` for a sum over examples, a :class:`GlobalSums`, or ``False``."""
  return verdict if isinstance(verdict, GlobalSums) else verdict == "sum"


def with_global_sums(prog: LossProgram, batch, key, model_state, axes):
  """``(prog, batch)`` for a per-device program over ``axes`` whose loss
  takes sums over its batch (``prog.sums`` a :class:`GlobalSums`): the
  batch with the whole batch's sums added (as scalar leaves every
  micro-batch shares), the loss reading them in place of its own. Any
  other program comes back as it is."""
  given = prog.sums
  if not isinstance(given, GlobalSums):
    return prog, batch
  k = prog.accum_steps
  whole = whole_params(prog.spec)
  n = len(given.dtypes)

  def local(mb):  # one micro-batch's sums
    b = unshare(mb)
    kw = prog.call.kwargs(key, model_state)
    closed, _, paths = _traced(prog.loss_fn, whole, b, kw, n)
    free = _free_flags(whole, b, kw)
    return _batch_sums.capture(
      closed, jax.tree.leaves((whole, b, kw)), free, paths
    )

  if k == 1:
    values = local(batch)
  else:
    micro = jax.tree.map(
      lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch
    )
    values = [jnp.sum(v, axis=0) for v in jax.vmap(local)(micro)]
  values = [jax.lax.psum(v, axes) for v in values]
  rows = next(np.shape(x)[0] for x in jax.tree.leaves(batch))
  shared = tuple(Shared(jnp.broadcast_to(v, (rows,))) for v in values)
  prog = dataclasses.replace(
    prog, loss_fn=_given(prog.loss_fn, n), sums=given.sums
  )
  return prog, (batch, shared)


def _given(loss_fn, n: int):
  """``loss_fn`` taking ``(batch, sums)`` for its batch: its loss and new
  model state evaluated with its own sums over the batch replaced by
  ``sums``; its aux as it computes it (a count of this piece's tokens is
  summed over devices by the step, a ratio averaged and warned about, as
  for any loss)."""

  def loss(params, both, **kw):
    batch, values = both
    closed, tree, paths = _traced(loss_fn, params, batch, kw, n)
    plain, given = _batch_sums.substitute(
      closed, jax.tree.leaves((params, batch, kw)), dict(zip(paths, values))
    )
    out, out_given = (
      jax.tree.unflatten(tree, plain),
      jax.tree.unflatten(tree, given),
    )
    if not isinstance(out, tuple):
      return out_given
    if "model_state" in kw:  # (loss, new model state[, aux])
      return (*out_given[:2], *out[2:])
    return (out_given[0], *out[1:])  # (loss, aux)

  return loss


def _traced(loss_fn, params, batch, kw, n: int):
  """``(closed jaxpr, output treedef, the paths of its sums over the
  batch)`` of ``loss_fn(params, batch, **kw)``; raises unless it takes
  the ``n`` sums the loss check found."""
  closed, shape = jax.make_jaxpr(
    lambda p, b, kw: loss_fn(p, b, **kw), return_shape=True
  )(params, batch, kw)
  free = _free_flags(params, batch, kw)
  classes = [
    _batch_mean.R(0) if f and np.ndim(x) else _batch_mean.C()
    for f, x in zip(free, jax.tree.leaves((params, batch, kw)))
  ]
  rec = _batch_sums.Recorder(_batch_sums.candidates(closed.jaxpr, free))
  _batch_mean.classify(closed, classes, sums=rec)
  if len(rec.found) != n:
    raise RuntimeError(
      f"zerojax: loss_fn takes {len(rec.found)} sums over its batch in the "
      f"step's program, where the loss check found {n}; the step cannot "
      f"give it the whole batch's. A loss whose program changes with its "
      f"batch's size can pass the whole batch's counts as scalar batch "
      f"leaves instead."
    )
  return closed, jax.tree.structure(shape), rec.found


def _free_flags(params, batch, kw) -> list[bool]:
  """Which flat inputs of ``(params, batch, kw)`` are the batch's."""
  count = lambda t: len(jax.tree.leaves(t))
  return [False] * count(params) + [True] * count(batch) + [False] * count(kw)
