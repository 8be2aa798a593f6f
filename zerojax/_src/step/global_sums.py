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

from zerojax._src.jaxpr import batch_sums as _batch_sums
from zerojax._src.step.batch import Shared, unshare
from zerojax._src.step.loss_call import LossProgram, whole_params


@dataclasses.dataclass(frozen=True)
class GlobalSums:
  """The loss check's verdict for a loss that takes sums over its batch:
  the signature of its candidates for such sums
  (:func:`~zerojax._src.jaxpr.batch_sums.candidates`, in program order),
  which of them are sums over the rows, and whether the loss with them
  given is a sum over examples (added up over devices and micro-batches)
  or a mean (averaged). The step finds them in its own trace of the loss
  by the same positions among the same candidates."""

  candidates: tuple
  picks: tuple
  sums: bool
  aux: tuple = ()  # per aux leaf: a float the step adds up


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

  def local(mb):  # one micro-batch's sums
    b = unshare(mb)
    kw = prog.call.kwargs(key, model_state)
    closed, _, paths = _traced(prog.loss_fn, whole, b, kw, given)
    free = _batch_sums.batch_inputs(whole, b, kw)
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
    prog,
    loss_fn=_given(prog.loss_fn, given),
    sums=given.sums,
    summed_aux=given.aux,
  )
  return prog, (batch, shared)


def _given(loss_fn, given: GlobalSums):
  """``loss_fn`` taking ``(batch, sums)`` for its batch: its loss and new
  model state evaluated with its own sums over the batch replaced by
  ``sums``; its aux as it computes it (a count of this piece's tokens,
  summed over devices by the step), but a float leaf that is a sum over
  examples with those sums given (a masked accuracy) with them too."""

  def loss(params, both, **kw):
    batch, values = both
    closed, tree, paths = _traced(loss_fn, params, batch, kw, given)
    plain, replaced = _batch_sums.substitute(
      closed, jax.tree.leaves((params, batch, kw)), dict(zip(paths, values))
    )
    out = jax.tree.unflatten(tree, plain)
    whole = jax.tree.unflatten(tree, replaced)
    if not isinstance(out, tuple):
      return whole
    n = 2 if "model_state" in kw else 1  # (loss[, new model state], aux)
    return (
      *whole[:n],
      *(_aux_of(a, w, given.aux) for a, w in zip(out[n:], whole[n:])),
    )

  return loss


def _aux_of(plain, whole, summed: tuple):
  """The aux as the loss computes it, but each leaf the step adds up
  with the whole batch's sums."""
  leaves, tree = jax.tree.flatten(plain)
  if len(summed) != len(leaves):
    return plain
  given = jax.tree.leaves(whole)
  return jax.tree.unflatten(
    tree, [w if s else a for a, w, s in zip(leaves, given, summed)]
  )


def _traced(loss_fn, params, batch, kw, given: GlobalSums):
  """``(closed jaxpr, output treedef, the paths of its sums over the
  batch)`` of ``loss_fn(params, batch, **kw)``; raises unless its
  candidates for such sums are those the loss check read."""
  closed, shape = jax.make_jaxpr(
    lambda p, b, kw: loss_fn(p, b, **kw), return_shape=True
  )(params, batch, kw)
  cands = _batch_sums.candidates(
    closed.jaxpr, _batch_sums.batch_inputs(params, batch, kw)
  )
  if _batch_sums.signature(cands) != given.candidates:
    raise RuntimeError(
      f"zerojax: loss_fn's program on its batch alone differs between the "
      f"loss check's trace and the step's (scalars computed from the "
      f"batch: {list(_batch_sums.signature(cands))} in the step, "
      f"{list(given.candidates)} in the check), so the step cannot find "
      f"the sums over the batch it divides by. Pass the whole batch's "
      f"counts as scalar batch leaves instead (jnp.sum(ce * mask) / "
      f"batch['tokens'])."
    )
  return closed, jax.tree.structure(shape), [cands[i][0] for i in given.picks]
