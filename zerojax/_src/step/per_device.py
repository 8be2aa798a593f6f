"""The per-device program a loss runs in: :func:`over_batch_axes`."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from zerojax._src.records import mesh as _mesh
from zerojax._src.records.mesh_errors import (
  types_refused,
  untyped_note,
)
from zerojax._src.step.loss_call import LossArgs, LossProgram


def over_batch_axes(prog: LossProgram, body, out_specs, params, args: LossArgs):
  """``body(prog, param_leaves, batch, key, model_state)`` per device in a
  ``shard_map`` manual over the batch axes only: model (tensor-parallel)
  axes stay automatic, so XLA partitions the loss over them as the params
  say. Params enter in their stored layout, the batch split by rows, key
  and model state replicated. Training and evaluation alike.

  JAX types each per-device value with the axes it varies over, and
  refuses a loop whose carry starts the same on every device and becomes
  per-device (a Flax RNN's zero carry, ``optax.ctc_loss``'s), branches of
  which one returns a constant and another a per-device value, and a
  kernel's output shape that does not say how it varies
  (:func:`~zerojax._src.records.mesh_errors.types_refused`). Such a loss
  is traced again with those types off (``check_vma=False``,
  ``prog.typed`` False): the forward values are the same, and no implicit
  sum of the typed program is relied on -- every differentiated leaf is
  made varying and reduced explicitly (``grad.local_grads``), every output
  reduced by an explicit collective, as in the typed program."""
  batch, key, model_state = args
  tx = prog.spec.tx
  param_specs = [r.param.manual_spec(tx.axis_name) for r in prog.spec.leaves]
  batch_specs = jax.tree.map(lambda _: P(tx.batch_axes), batch)
  rep = lambda t: jax.tree.map(lambda _: P(), t)

  def run(prog):
    return jax.shard_map(
      functools.partial(body, prog),
      mesh=tx.compute_mesh,
      in_specs=(param_specs, batch_specs, rep(key), rep(model_state)),
      out_specs=out_specs,
      axis_names=set(tx.batch_axes),
      check_vma=prog.typed,
    )(jax.tree.leaves(params), batch, key, model_state)

  try:
    return run(prog)
  except (TypeError, ValueError) as e:
    if not (prog.typed and types_refused(e)):
      raise
    refused = e
  try:
    with _mesh.untyped():  # the regions nested in it too
      return run(dataclasses.replace(prog, typed=False))
  except Exception as e:
    e.add_note(untyped_note(refused))
    raise
