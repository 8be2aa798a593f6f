"""The per-device program a loss runs in: :func:`over_batch_axes`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.jaxpr import collectives as _collectives
from zerojax._src.records import mesh as _mesh
from zerojax._src.records.mesh_errors import (
  types_refused,
  untyped_note,
)
from zerojax._src.step.loss_call import LossArgs, LossProgram, whole_params


def over_batch_axes(
  prog: LossProgram, body, out_specs, params, args: LossArgs, *, grads=True
):
  """``body(prog, param_leaves, batch, key, model_state)`` per device in a
  ``shard_map`` manual over the batch axes only: model (tensor-parallel)
  axes stay automatic, so XLA partitions the loss over them as the params
  say. Params enter in their stored layout, the batch split by rows, key
  and model state replicated. Training and evaluation (``grads`` False)
  alike.

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
  reduced by an explicit collective, as in the typed program. A loss to
  differentiate that runs a collective over the batch axes itself is
  refused then (:func:`_refuse_batch_collectives`)."""
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
  if grads:
    _refuse_batch_collectives(prog, args, refused)
  try:
    with _mesh.untyped():  # the regions nested in it too
      return run(dataclasses.replace(prog, typed=False))
  except Exception as e:
    e.add_note(untyped_note(refused))
    raise


def _refuse_batch_collectives(prog: LossProgram, args: LossArgs, refused):
  """Raises if the loss, differentiated on its whole params per device
  with the types off, runs a collective over the batch axes.

  Untyped, such a collective is not differentiated as the typed program
  differentiates it: a ``psum`` in a custom VJP rule, or the transpose of
  one in the forward pass, sums over devices a gradient that
  ``grad.local_grads`` sums again, and the step would train on a multiple
  of the gradient. A loss whose trace fails here is left to the step,
  which reports the failure itself; zerojax's own gathers are the
  identity on whole params, so only the user's collectives are found."""
  tx = prog.spec.tx
  mesh = tx.compute_mesh
  batch, key, model_state = args
  whole = whole_params(prog.spec)
  leaves, tree = jax.tree.flatten(whole)
  grad_at = [
    i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact)
  ]
  rep = NamedSharding(mesh, P())

  def loss_and_grads(diff, batch, key, model_state):
    def loss(diff):
      full = list(leaves)
      for i, d in zip(grad_at, diff):
        full[i] = d
      return prog.call(
        prog.loss_fn, jax.tree.unflatten(tree, full), batch, key, model_state
      )[0]

    value, pull = jax.vjp(loss, [leaves[i] for i in grad_at])
    return value, pull(jnp.ones_like(value))

  def spec_of(x):
    return P(tx.batch_axes) if np.ndim(x) else P()

  abstract = [
    jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=rep)
    for i in grad_at
  ]
  per_device = jax.shard_map(
    loss_and_grads,
    mesh=mesh,
    in_specs=(
      P(),
      jax.tree.map(spec_of, batch),
      jax.tree.map(lambda _: P(), key),
      jax.tree.map(lambda _: P(), model_state),
    ),
    out_specs=P(),
    axis_names=set(tx.batch_axes),
    check_vma=False,
  )
  try:
    closed = jax.make_jaxpr(per_device)(abstract, batch, key, model_state)
  except Exception:  # noqa: BLE001 -- the step reports the loss's errors
    return
  found = _collectives.over_axes(closed, tx.batch_axes)
  if found:
    raise ValueError(
      f"zerojax: the loss runs {found[0]}"
      f"{f' (and {len(found) - 1} more)' if len(found) > 1 else ''}, "
      f"and holds a loop, branch or kernel that JAX's per-device types "
      f"refuse. zerojax runs such a loss with the types off, where a "
      f"collective over the batch axes {tuple(tx.batch_axes)} is not "
      f"differentiated as in the typed program (a psum in a custom VJP "
      f"rule would sum a gradient zerojax sums again), so the step "
      f"would not give the unsharded numbers. Leave the reduction over "
      f"the batch to zerojax (it averages the loss and sums the "
      f"gradients itself) and drop the collective, or build the refused "
      f"constant from the batch (jnp.zeros_like(x[:, 0])) so the types "
      f"stay on. JAX said: {str(refused).splitlines()[0]}"
    )
