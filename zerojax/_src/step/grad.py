"""Gradients for a ZeRO stage, inside ``shard_map``: :func:`value_and_grad`.

Per device, the loss runs on its rows of the batch. Which collective
reduces the gradient depends on the stage:

* stage 0: with one micro-batch, an all-reduce where the loss uses each
  param, inside the backward (:func:`reduced_where_used`); with several,
  ``psum`` of the accumulated local gradient: one all-reduce;
* stage 1: with one micro-batch, a reduce-scatter inside the backward as
  at stages 2-3, through the loss's own per-layer gathers or, for a loss
  that does not gather, through those :func:`run_loss` puts into its scans
  (``jaxpr/layers.py``); otherwise (several micro-batches, a loss the
  audit cannot read) full local gradients, accumulated over
  micro-batches, then one ``psum_scatter`` per leaf: a reduce-scatter;
* stages 2-3: the model calls :func:`zerojax.gather` per layer (or
  :func:`run_loss` puts the calls into its scans); its custom VJP
  reduce-scatters each layer's cotangent where the backward pass makes it
  (see ``comm/gather.py``).

Every other differentiated value is made device-varying first:
differentiating a replicated value inside ``shard_map`` makes JAX insert the transpose of an
implicit broadcast, an all-reduce, that would spoil the reduce-scatter.

Before the loss is differentiated at stages 2-3, its traced program is
checked (``step/gather_mode.py``): never silently on shards.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax._src.jaxpr import audit as _audit
from zerojax._src.jaxpr import transposes as _transposes
from zerojax._src.records.mesh_errors import explain_per_device_errors
from zerojax._src.records.spec import ZeroState, make_spec, model_axes_of
from zerojax._src.step import accumulate as _accumulate
from zerojax._src.step import aux as _aux
from zerojax._src.step.batch import place_batch
from zerojax._src.step.custom_vjp import (
  direct_where_typed,
  restate_custom_vjp_types,
)
from zerojax._src.step.deleted import reject_deleted
from zerojax._src.step.gather_mode import (
  GatherMode,
  diff_inputs,
  gather_mode,
  gather_spec,
  gathered_by_the_loss,
  grad_to_host,
  hooked_leaves,
  reduce_in_backward,
  run_loss,
  secondary_shards,
)
from zerojax._src.step.global_sums import as_sums, with_global_sums
from zerojax._src.step.loss_call import (
  LossArgs,
  LossCall,
  LossProgram,
  check_options,
)
from zerojax._src.step.loss_check import grad_loss_check
from zerojax._src.step.per_device import over_batch_axes
from zerojax._src.step.reduce import (
  reduce_grads,
  reduce_outputs,
  reduced_where_used,
)


def local_grads(
  prog: LossProgram,
  leaves,
  batch,
  key,
  model_state,
  *,
  found: _aux.RowDims | None = None,
  unscaled: _accumulate.Unscaled | None = None,
):
  """Per-device body: ``(grads, loss, aux_reduced, aux_rows,
  new_model_state)``, reduced.

  ``grads[i]``: the shard (storage layout) of a sharded leaf at stages 1-3,
  the all-reduced full gradient otherwise, ``None`` for frozen leaves. The
  aux comes as :func:`zerojax._src.step.aux.split`'s two trees (batch means
  and counts reduced; this device's per-example rows, stacked), and
  ``found`` learns which leaves are per-example. Gradients summed over
  micro-batches in host memory are scaled here, or with ``unscaled`` left
  for the update to scale as it loads them (``unscaled`` learns the
  factors).
  """
  spec, tx = prog.spec, prog.spec.tx
  axes = tx.batch_axes  # every axis the batch splits over
  k = prog.accum_steps
  prog, batch = with_global_sums(prog, batch, key, model_state, axes)
  micro = batch if k == 1 else jax.tree.map(lambda x: _split_micro(x, k), batch)
  first = micro if k == 1 else jax.tree.map(lambda x: x[0], micro)
  hooked = hooked_leaves(spec)
  # untyped (a loop, branch or kernel JAX's per-device types refuse):
  # nothing is summed by them, so every leaf is reduced after the backward
  direct = reduced_where_used(spec, k) if prog.typed else [False] * len(hooked)
  how = GatherMode("model")
  if reduce_in_backward(spec, k, prog.gather, direct):
    gathered, mode = gathered_by_the_loss(
      prog, leaves, LossArgs(first, key, model_state)
    )
    how = GatherMode(mode)
    hooked = [h and not d for h, d in zip(gathered, direct)]
  # the aux's means are averaged over devices and micro-batches, the loss
  # and its gradient too unless the loss is a sum over examples;
  # offloaded gradients are scaled where they are reduced (with several
  # micro-batches: summed in host memory, scaled after)
  mean = 1.0 / (tx.batch_shards * k)
  scale = 1.0 if prog.sums else mean
  gspecs = [
    (
      dataclasses.replace(gather_spec(spec, r), grad_to_host=scale)
      if grad_to_host(spec, r)
      else gather_spec(spec, r)
    )
    if h
    else None
    for r, h in zip(spec.leaves, hooked)
  ]
  if tx.stage == 3 and tx.zeropp.hpz_size:
    leaves = secondary_shards(spec, leaves, hooked)
  if key is not None:
    key = jax.random.fold_in(key, jax.lax.axis_index(axes))
  micro_key = lambda i: None if key is None else jax.random.fold_in(key, i)
  if tx.stage >= 2:
    how = gather_mode(
      prog,
      leaves,
      diff_inputs(spec, leaves, hooked),
      gspecs,
      LossArgs(first, micro_key(0), model_state),
      "train step",
    )
  diff_in = diff_inputs(spec, leaves, hooked, direct)

  # Stage 0 with one micro-batch reduces inside the backward pass (leaves
  # reduced where used, gathered leaves): the loss is scaled before it is
  # differentiated, so each sum made there is the mean, with no scaled copy
  # of the gradient made after it.
  seed = scale if tx.stage == 0 and k == 1 else 1.0

  def objective(mb, key, ms, gs=gspecs):  # what one micro-batch differentiates
    def f(diff):
      loss, new_ms, aux = run_loss(
        prog, leaves, diff, gs, how, LossArgs(mb, key, ms)
      )
      return loss * seed, (loss, new_ms, aux)

    return f

  if any(direct):
    direct = direct_where_typed(
      jax.make_jaxpr(objective(first, micro_key(0), model_state))(
        diff_in
      ).jaxpr,
      axes,
      direct,
      diff_in,
    )
    diff_in = diff_inputs(spec, leaves, hooked, direct)

  host_sums = None
  if spec.config.offload_grads and k > 1:
    host_sums = _host_sums(spec, gspecs, scale)
    _check_gathered_once(
      spec, objective, (first, micro_key(0), model_state), host_sums, diff_in
    )

  def one(mb, key, ms, gs=gspecs, sums=None):
    # one micro-batch's loss and gradients (with ``sums``: the host sums
    # so far in the offloaded leaves' sinks)
    f = objective(mb, key, ms, gs)
    diff = (
      diff_in
      if sums is None
      else [d if a is None else a for d, a in zip(diff_in, sums)]
    )
    # stage 0 (one micro-batch: the sums are in the backward) sums each
    # weight gradient before autodiff's transpose, as GSPMD does; on XLA
    # CPU stages 1-3 keep the transpose out of the dot, which then stays a
    # YNNPACK fusion (jaxpr/transposes.py; GPU and TPU dots take
    # transposed operands as they are)
    grad_fn = _transposes.rewrite_for_dots(
      jax.value_and_grad(f, has_aux=True),
      sums=tx.stage == 0 and k == 1,
      barriers=tx.stage >= 1 and _on_cpu(tx.mesh),
    )
    try:
      (_, (loss, new_ms, aux)), g = grad_fn(diff)
    except ValueError as err:
      restate_custom_vjp_types(err, axes)
      raise
    g = [
      None if x is None else x.astype(r.reduce_dtype)
      for x, r in zip(g, spec.leaves)
    ]
    return g, loss, aux, new_ms

  dims_of = lambda aux: _aux.row_dims(
    aux,
    lambda mb: objective(mb, micro_key(0), model_state)(diff_in)[1][2],
    first,
  )
  if k == 1:
    grads, loss, aux, new_ms = one(micro, micro_key(0), model_state)
    dims = dims_of(aux)
  else:
    grads, loss, aux, new_ms, dims = _accumulate.summed(
      one,
      micro,
      micro_key,
      model_state,
      axes=axes,
      dims_of=dims_of,
      host=host_sums,
    )
    if host_sums is not None:
      grads = _accumulate.scaled(grads, host_sums, unscaled)
  if found is not None:
    found.set(dims)
  return (
    reduce_grads(spec, grads, hooked, scale / seed, direct),
    *reduce_outputs(
      loss,
      aux,
      new_ms,
      axes,
      mean,
      dims,
      loss_scale=scale,
      summed=prog.summed_aux,
    ),
  )


def _split_micro(x, k):
  return x.reshape((k, x.shape[0] // k) + x.shape[1:])


def _host_sums(spec, gspecs, scale) -> _accumulate.HostSums:
  """How offloaded gradients are summed over micro-batches in host memory
  (:func:`zerojax._src.step.accumulate.summed`)."""
  on_host = [g is not None and g.grad_to_host is not None for g in gspecs]

  def specs(accumulate):
    return [
      dataclasses.replace(g, grad_to_host=1.0, accumulate=accumulate)
      if h
      else g
      for g, h in zip(gspecs, on_host)
    ]

  return _accumulate.HostSums(specs(False), specs(True), on_host, scale)


def _check_gathered_once(spec, objective, args, sums, diff_in):
  """Summing in the sinks needs each offloaded gradient to arrive once per
  micro-batch: a leaf gathered twice, in a loop's carry or constants, or
  under a branch would add the sum so far more than once or not at all.
  Raises before anything runs, naming the leaf."""
  leaves = [d for d in diff_in if d is not None]
  tags = [
    i if h else None
    for i, (d, h) in enumerate(zip(diff_in, sums.on_host))
    if d is not None
  ]
  found = _audit.gathered_other_than_once(
    lambda diff: objective(*args, sums.rest)(_with_leaves(diff_in, diff))[0],
    (leaves,),
    tags,
  )
  if found:
    i, how = next(iter(found.items()))
    raise ValueError(
      f"zerojax: offload_grads=True with accum_steps > 1 sums each "
      f"gradient in host memory as the backward pass reduces it, which "
      f"needs each parameter gathered once per micro-batch; "
      f"params{spec.leaves[i].path} is gathered {how}. Gather "
      f"it once (a shared weight: gather it once and reuse the value), "
      f"use accum_steps=1, or offload_grads=False."
    )


def _with_leaves(diff_in, leaves):
  it = iter(leaves)
  return [None if d is None else next(it) for d in diff_in]


def _on_cpu(mesh) -> bool:
  """Whether ``mesh``'s devices are CPUs (an abstract mesh, which has no
  devices: whether the default backend is)."""
  if isinstance(mesh, jax.sharding.Mesh):
    return mesh.devices.flat[0].platform == "cpu"
  return jax.default_backend() == "cpu"


# --------------------------------------------------------------------------
# global: the shard_map around it

# --------------------------------------------------------------------------


def sharded_grads(
  prog: LossProgram,
  params,
  batch,
  key,
  model_state,
  *,
  found: _aux.RowDims | None = None,
  unscaled: _accumulate.Unscaled | None = None,
):
  """Runs :func:`local_grads` per device; grads as global arrays.

  Returns ``(grads, loss, (aux_reduced, aux_rows), new_model_state)``: the
  aux in :mod:`zerojax._src.step.aux`'s two trees, for
  :func:`zerojax._src.step.aux.merge` with ``found`` (filled while
  tracing) once out of the Auto region; ``unscaled`` as in
  :func:`local_grads`."""
  tx = prog.spec.tx
  grad_specs = [
    None
    if not r.trainable
    else (r.shard.manual_spec(tx.axis_name) if tx.stage >= 1 else P())
    for r in prog.spec.leaves
  ]
  grads, loss, reduced, rows, new_ms = over_batch_axes(
    prog,
    functools.partial(local_grads, found=found, unscaled=unscaled),
    (grad_specs, P(), P(), _aux.rows_spec(tx.batch_axes), P()),
    params,
    LossArgs(batch, key, model_state),
  )
  return grads, loss, (reduced, rows), new_ms


def value_and_grad(
  loss_fn: Callable,
  tx,
  *,
  has_aux: bool = False,
  accum_steps: int = 1,
  gather: str = "auto",
  per_device_loss: bool = False,
) -> Callable:
  """Sharded ``jax.value_and_grad`` for ``tx``'s stage, returning gradients
  in the stage's layout.

  The gradient half of :func:`zerojax.train_step`, usable alone: the loss
  runs per device on its rows of the batch inside ``shard_map``, and the
  gradient is all-reduced (stage 0), reduce-scattered after the backward
  (stage 1), or reduce-scattered layer by layer through
  :func:`zerojax.gather` (stages 2-3).

  Args:
    loss_fn: ``loss_fn(params, batch[, key=])`` returning the mean (or the
      sum) loss over its rows, or ``(loss, aux)`` with ``has_aux=True``;
      the devices' means are averaged, their sums added up.
    tx: a :class:`zerojax.ZeroTransformation`.
    has_aux: as in ``jax.value_and_grad``. The aux is the loss's on the
      whole batch: a leaf whose shape follows the batch's rows
      (per-example) comes back with all rows in batch order, sharded by
      rows; other floating leaves are averaged over devices and
      micro-batches (batch means), integer ones (counts) summed
      (:mod:`zerojax._src.step.aux`).
    accum_steps: micro-batches per call (accumulated inside).
    gather: as in :func:`zerojax.train_step`.
    per_device_loss: as in :func:`zerojax.train_step`.

  Returns:
    ``fn(params, batch, *, key=None) -> (value, grads)`` with ``value`` the
    loss, or ``(loss, aux)``. ``params`` is the params tree as you hold it
    (stages 0-2: replicated) or a :class:`zerojax.ZeroState` (any stage;
    needed at stage 3, whose params are stored sharded; its step key is
    used when it carries one). ``grads`` has the params' structure: at
    stage 0 the full gradient, replicated; at stages 1-3 each sharded leaf
    as its storage shard (padded like the master copy, sharded over the
    data axis), ready for ``tx.update`` or :func:`zerojax.apply_gradients`.
    With ``key``, the loss is called with ``key=`` folded per device and
    micro-batch. Jitted; nothing is donated. It may be called inside a
    ``jit`` of your own, beside :func:`zerojax.apply_gradients` (one
    program: donate the state there).

  Example:
    >>> grad_fn = zerojax.value_and_grad(loss_fn, tx)
    >>> loss, grads = grad_fn(params, batch)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(loss > 0)
    True
  """
  check_options(loss_fn, gather, accum_steps, "zerojax.value_and_grad")
  check_loss = grad_loss_check(
    loss_fn, tx, has_aux, accum_steps, per_device_loss
  )

  @functools.partial(jax.jit, static_argnums=(3, 4))
  def run(params, batch, key, models, sums):
    if isinstance(params, ZeroState):
      spec, model, ms = params.spec, params.params, params.model_state
      if key is None and params.key is not None:
        key = jax.random.fold_in(params.key, params.step)
    else:
      spec, model, ms = make_spec(params, tx, models), params, None
    call = LossCall(
      has_key=key is not None, has_model_state=False, has_aux=has_aux
    )

    found = _aux.RowDims()

    def body(model, batch, key, ms):
      if not isinstance(params, ZeroState):
        model = spec.unflatten_params(
          [
            r.place.constrain(x, r.param)
            for x, r in zip(jax.tree.leaves(model), spec.leaves)
          ]
        )
      grads, loss, (reduced, rows), _ = sharded_grads(
        LossProgram(spec, loss_fn, call, accum_steps, gather, sums=sums),
        model,
        batch,
        key,
        ms,
        found=found,
      )
      return [g for g in grads if g is not None], loss, reduced, rows

    outs = (
      [spec.sharding(r.shard) for r in spec.leaves if r.trainable],
      spec.replicated(),
      spec.replicated(),
      _aux.rows_sharding(spec.tx.mesh, spec.tx.batch_axes),
    )
    grads, loss, reduced, rows = spec.region(body, outs)(model, batch, key, ms)
    aux = _aux.merge(reduced, rows, found.dims)
    grads = iter(grads)
    grads = [next(grads) if r.trainable else None for r in spec.leaves]
    grads = spec.unflatten_params(
      [
        g if g is not None else np.zeros(r.aval.shape, jax.dtypes.float0)
        for g, r in zip(grads, spec.leaves)
      ]
    )
    return ((loss, aux) if has_aux else loss), grads

  def fn(params, batch, *, key=None):
    if isinstance(params, ZeroState):
      if params.model_state is not None:
        raise ValueError(
          "zerojax.value_and_grad: this state carries model_state, whose "
          "update value_and_grad cannot return; use zerojax.train_step."
        )
      if params.spec.tx.config != tx.config:
        raise ValueError(
          "zerojax.value_and_grad: the state was laid out by "
          "another ZeroTransformation than this one."
        )
    elif tx.stage == 3:
      raise ValueError(
        "zerojax.value_and_grad at stage 3: the parameters are stored "
        "sharded, so pass the ZeroState from zerojax.init (not a params "
        "tree): grad_fn(state, batch)."
      )
    reject_deleted(
      params,
      "zerojax.value_and_grad",
      "state" if isinstance(params, ZeroState) else "params",
    )
    # A params tree's model shardings are read here, outside the jit.
    models = (
      None if isinstance(params, ZeroState) else model_axes_of(params, tx)
    )
    placed = place_batch(batch, tx, accum_steps)
    sums = as_sums(check_loss(params, batch, key))
    with explain_per_device_errors(tx.mesh, "zerojax.value_and_grad"):
      return run(params, placed, key, models, sums)

  return fn
