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
  differentiate whose custom VJP rule runs its own collective over the
  batch axes is refused then (:func:`_refuse_batch_collectives`)."""
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
  with the types off, runs a collective over the batch axes in its
  backward pass that is no forward collective's transpose: a custom VJP
  rule's own (:func:`~zerojax._src.jaxpr.collectives.beyond_transposes`).

  Untyped, a rule's ``psum`` sums over devices a gradient that
  ``grad.local_grads`` sums again, and the step would train on a multiple
  of the gradient. A forward collective (a synchronized batch norm's
  ``pmean``) is differentiated exactly: its transpose sums the devices'
  cotangents, as the per-device losses' sum needs. A loss whose trace
  fails here is left to the step, which reports the failure itself;
  zerojax's own gathers are the identity on whole params, so only the
  user's collectives are found."""
  tx = prog.spec.tx
  mesh = tx.compute_mesh
  batch, key, model_state = args
  whole = whole_params(prog.spec)
  leaves, tree = jax.tree.flatten(whole)
  grad_at = [
    i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact)
  ]
  rep = NamedSharding(mesh, P())

  def loss_and_grads(diff, batch, key, model_state, differentiate):
    def loss(diff):
      full = list(leaves)
      for i, d in zip(grad_at, diff):
        full[i] = d
      return prog.call(
        prog.loss_fn, jax.tree.unflatten(tree, full), batch, key, model_state
      )[0]

    if not differentiate:
      return loss(diff)
    value, pull = jax.vjp(loss, diff)
    return value, pull(jnp.ones_like(value))

  def spec_of(x):
    return P(tx.batch_axes) if np.ndim(x) else P()

  abstract = [
    jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=rep)
    for i in grad_at
  ]

  def collectives(differentiate: bool):
    per_device = jax.shard_map(
      functools.partial(loss_and_grads, differentiate=differentiate),
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
    closed = jax.make_jaxpr(per_device)(abstract, batch, key, model_state)
    return _collectives.over_axes(closed, tx.batch_axes)

  try:
    found = _collectives.beyond_transposes(
      collectives(False), collectives(True)
    )
  except Exception:  # noqa: BLE001 -- the step reports the loss's errors
    return
  if found:
    raise ValueError(
      f"zerojax: the loss's backward pass runs {found[0]}"
      f"{f' (and {len(found) - 1} more)' if len(found) > 1 else ''}, "
      f"which is no forward collective's transpose (a custom VJP rule's "
      f"own), and the loss holds a loop, branch or kernel that JAX's "
      f"per-device types refuse. zerojax runs such a loss with the types "
      f"off, where such a collective over the batch axes "
      f"{tuple(tx.batch_axes)} sums a gradient that zerojax sums again "
      f"after the backward pass, so the step would not give the "
      f"unsharded numbers. In the rule, sum over the axes the types give "
      f"(jax.lax.psum(g, tuple(jax.typeof(g).manual_axis_type.varying - "
      f"jax.typeof(x).manual_axis_type.varying)), a no-op here), or build "
      f"the refused constant from the batch (jnp.zeros_like(x[:, 0])) so "
      f"the types stay on. JAX said: {str(refused).splitlines()[0]}"
    )
