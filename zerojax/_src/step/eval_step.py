"""The evaluation step: the loss forward only, per device, with the
model's own per-layer gathers (exact, never quantized)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax._src.records.mesh_errors import explain_per_device_errors
from zerojax._src.records.spec import ZeroState
from zerojax._src.step import aux as _aux
from zerojax._src.step.gather_mode import gather_mode, gather_spec, run_loss
from zerojax._src.step.global_sums import with_global_sums
from zerojax._src.step.loss_call import (
  LossArgs,
  LossCall,
  LossProgram,
  check_options,
)
from zerojax._src.step.loss_check import check_per_device_loss
from zerojax._src.step.per_device import over_batch_axes
from zerojax._src.step.reduce import reduce_outputs
from zerojax._src.step.steps import CompiledStep, abstract_ready, step_key
from zerojax._src.step.transform import ZeroTransformation

# --------------------------------------------------------------------------
# evaluation: forward only, the model's own per-layer gathers


# --------------------------------------------------------------------------


def _eval_local(
  prog: LossProgram,
  leaves,
  batch,
  key,
  model_state,
  found: _aux.RowDims | None = None,
):
  """Per-device forward pass: the loss, averaged over the batch axes; with
  ``found`` (``has_aux``), ``(loss, aux_reduced, aux_rows)`` as in
  training (:mod:`zerojax._src.step.aux`)."""
  prog, batch = with_global_sums(
    prog, batch, key, model_state, prog.spec.tx.batch_axes
  )
  spec = prog.spec
  tx = spec.tx
  hooked = [spec.stage == 3 and r.param.sharded for r in spec.leaves]
  gspecs = [
    gather_spec(spec, r, quantized=False) if h else None
    for r, h in zip(spec.leaves, hooked)
  ]
  # A sink of the shard's shape (never differentiated, so never computed).
  sinks = [
    jnp.zeros(r.param.shard_shape(tx.num_shards), r.reduce_dtype) if h else None
    for r, h in zip(spec.leaves, hooked)
  ]
  if key is not None:
    key = jax.random.fold_in(key, jax.lax.axis_index(tx.batch_axes))
  how = gather_mode(
    prog, leaves, sinks, gspecs, LossArgs(batch, key, model_state), "eval step"
  )

  def run(batch):
    return run_loss(
      prog,
      leaves,
      sinks,
      gspecs,
      how,
      LossArgs(batch, key, model_state),
      what="eval step",
    )

  loss, _, aux = run(batch)
  mean = 1.0 / tx.batch_shards
  scale = 1.0 if prog.sums else mean  # a sum over examples adds up
  if found is None:
    reduce = jax.lax.psum if prog.sums else jax.lax.pmean
    return reduce(loss, tx.batch_axes)
  dims = _aux.row_dims(aux, lambda mb: run(mb)[2], batch)
  found.set(dims)
  loss, reduced, rows, _ = reduce_outputs(
    loss,
    aux,
    None,
    tx.batch_axes,
    mean,
    dims,
    loss_scale=scale,
    summed=prog.summed_aux,
  )
  return loss, reduced, rows


@dataclasses.dataclass(frozen=True)
class EvalStep(CompiledStep):
  """A jitted ``eval(state, batch) -> mean loss`` (``(mean loss, aux)``
  when built with ``has_aux=True``); nothing is donated (one batch per
  call: ``accum_steps`` is 1)."""

  where = "zerojax.eval_step"

  def __call__(self, state: ZeroState, batch):
    return self._run("zerojax.eval_step", *self._prepare(state, batch))

  def lower(self, state: ZeroState, batch):
    """``jax.jit(...).lower`` of the eval step (e.g. for its memory);
    ``state`` and ``batch`` may be abstract, as for :meth:`TrainStep.lower`."""
    state = abstract_ready(state, "EvalStep.lower")
    args = self._prepare(state, batch)
    with explain_per_device_errors(self.tx.mesh, "zerojax.eval_step"):
      return self._jitted.lower(*args)


def eval_step(
  loss_fn: Callable,
  tx: ZeroTransformation,
  *,
  gather: str = "auto",
  has_aux: bool = False,
  per_device_loss: bool = False,
) -> EvalStep:
  """A jitted ``eval(state, batch) -> mean loss`` that shards the batch.

  No gradients, no update, nothing donated. At stage 3 the loss sees the
  same :class:`ShardedParam` leaves as in training, so a model that gathers
  per layer holds one layer's full weights at a time in evaluation too (a
  forward-only gather per layer); a loss that does not has its scans over
  stacked layers gathered per layer and any other use gathered whole
  (``gather="auto"``) -- exact either way.
  With a key in the state, the loss gets ``key=`` (fixed across calls:
  ``fold_in(key, step)``, then the device); with model state,
  ``model_state=`` and its returned update is discarded.

  With ``has_aux=True`` the loss returns ``(loss, aux)`` (with model state
  ``(loss, new_model_state, aux)``) and the step ``(mean loss, aux)``, the
  aux combined as :func:`train_step`'s: per-example leaves with every row
  in batch order (sharded by rows), batch means averaged, counts summed.
  Otherwise an aux the loss returns is dropped. ``per_device_loss``: as
  in :func:`train_step` (the loss must be a mean over examples unless
  ``True``).
  """
  check_options(loss_fn, gather, 1, "zerojax.eval_step")
  check_per_device_loss(per_device_loss, "zerojax.eval_step")
  if not isinstance(has_aux, bool):
    raise TypeError(
      f"zerojax.eval_step: has_aux={has_aux!r} must be True "
      f"(return (mean loss, aux)) or False."
    )

  def run(state, batch, sums):
    spec = state.spec
    if not has_aux:
      return spec.region(
        lambda state, batch: _run(state, batch, sums), spec.replicated()
      )(state, batch)
    found = _aux.RowDims()
    loss, reduced, rows = spec.region(
      lambda state, batch: _run(state, batch, sums, found),
      (
        spec.replicated(),
        spec.replicated(),
        _aux.rows_sharding(spec.tx.mesh, spec.tx.batch_axes),
      ),
    )(state, batch)
    return loss, _aux.merge(reduced, rows, found.dims)

  def _run(state, batch, sums, found=None):
    call = LossCall(
      has_key=state.key is not None,
      has_model_state=state.model_state is not None,
      has_aux=True if has_aux and state.model_state is None else None,
    )
    prog = LossProgram(state.spec, loss_fn, call, gather=gather, sums=sums)
    args = LossArgs(batch, step_key(state), state.model_state)
    if found is None:
      return over_batch_axes(
        prog, _eval_local, P(), state.params, args, grads=False
      )
    return over_batch_axes(
      prog,
      functools.partial(_eval_local, found=found),
      (P(), P(), _aux.rows_spec(prog.spec.tx.batch_axes)),
      state.params,
      args,
      grads=False,
    )

  return EvalStep(
    loss_fn=loss_fn,
    tx=tx,
    gather=gather,
    accum_steps=1,
    _jitted=jax.jit(run, static_argnums=2),
    per_device_loss=per_device_loss,
    reports_aux=has_aux,
    keeps_model_state=False,
  )
