"""What a step does to each leaf's arrays, following the records
(:mod:`zerojax._src.records.spec`): moving master and optimizer leaves
between host and device memory (offload), the views the inner optimizer
reads, its update, and the new state laid out as stored."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from zerojax._src.records.mesh import (
  call_in_caller_types,
  closes_over_caller_types,
  compute_mesh,
  explicit_names,
)
from zerojax._src.records.spec import (
  LeafSpec,
  OptLeafSpec,
  Placement,
  StateSpec,
  ZeroState,
)


@functools.lru_cache(maxsize=8)
def fresh_copy(sharding):
  """A jitted copy into ``sharding``: a buffer of its own (a donated step
  must never free the caller's array, which ``device_put`` may alias)."""
  return jax.jit(lambda x: jnp.copy(x), out_shardings=sharding)


# --- host and device memory ------------------------------------------------
def fetch(place: Placement, x, layout):
  """A master / optimizer leaf -> device memory (under ``jit``; a no-op
  without offload). XLA computes only on device-memory operands."""
  return (
    _move(place, x, layout, jax.memory.Space.Device) if place.offload else x
  )


def stash(place: Placement, x, layout):
  """A master / optimizer leaf -> where the state keeps it."""
  return _move(place, x, layout, jax.memory.Space.Host) if place.offload else x


def fetch_param(r: LeafSpec, x):
  """A param as stored -> device memory (a no-op unless its stage-3 shard
  lives in host memory: ``offload_params``)."""
  if not r.place.params_host:
    return x
  return _move(r.place, x, r.param, jax.memory.Space.Device)


def stash_param(r: LeafSpec, x):
  """A param's new stored value -> where the state keeps it."""
  if not r.place.params_host:
    return x
  return _move(r.place, x, r.param, jax.memory.Space.Host)


def _move(place: Placement, x, layout, space):
  """``x`` moved to memory ``space`` in ``layout``'s sharding. On the
  caller's own (all-``Auto``) mesh one ``device_put`` does both; on the
  abstract compute mesh of an ``Explicit`` mesh the sharding is a
  constraint and the move names only the memory space, so the program
  holds no second mesh (:func:`zerojax._src.records.mesh.compute_mesh`)."""
  mesh = compute_mesh(place.mesh)
  host = space == jax.memory.Space.Host
  if isinstance(mesh, Mesh):
    return jax.device_put(x, place.sharding_on(mesh, layout, host))
  x = jax.lax.with_sharding_constraint(
    x, place.sharding_on(mesh, layout, False)
  )
  return jax.device_put(x, space)


# --- one param leaf --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WeightSource:
  """Where an update reads one param's weights from: ``raw`` as stored (in
  host memory when offloaded), ``load(raw)`` its logical device view. The
  update loads every source at once; the offloaded update streams them
  chunk by chunk (:mod:`zerojax._src.step.offload`)."""

  raw: Any
  load: Callable

  @property
  def aval(self):
    raw = jax.ShapeDtypeStruct(np.shape(self.raw), self.raw.dtype)
    return jax.eval_shape(self.load, raw)


def weights(r: LeafSpec, param, master):
  """The weights the optimizer updates (master if kept, else the params),
  logical and in device memory."""
  x, layout = r.kept(param, master)
  x = fetch(r.place, x, layout) if master is not None else fetch_param(r, x)
  return layout.to_logical(x)


def weight_source(r: LeafSpec, param, master) -> WeightSource:
  """The copy the optimizer updates as stored, and the function bringing
  it to the optimizer's view (logical, sharded like the master copy, in
  device memory)."""
  x, _ = r.kept(param, master)
  if master is None:
    return WeightSource(
      x, lambda p: r.place.constrain(weights(r, p, None), r.shard)
    )
  return WeightSource(
    x, lambda m: r.place.constrain(weights(r, None, m), r.shard)
  )


def grad_view(r: LeafSpec, g, stage: int, where: str):
  """One gradient leaf -> its logical view in the master dtype, sharded.

  Accepts the logical shape (e.g. replicated, from ``jax.grad``) or the
  stage's storage shape (from :func:`zerojax.value_and_grad`)."""
  return _cast_grad(r, _logical_grad(r, g, stage, where))


def _logical_grad(r: LeafSpec, g, stage: int, where: str):
  shape = tuple(np.shape(g))
  if shape == tuple(r.aval.shape):
    return g
  if r.shard.sharded and shape == r.shard.storage_shape:
    return r.shard.to_logical(g)
  raise ValueError(
    f"{where}: gradient{r.path} has shape {list(shape)}; the param "
    f"is {list(r.aval.shape)} (stored as "
    f"{list(r.shard.storage_shape)} at stage {stage}). Pass "
    f"gradients shaped like the params, or as returned by "
    f"zerojax.value_and_grad."
  )


def _cast_grad(r: LeafSpec, x):
  return r.place.constrain(x.astype(r.master_dtype), r.shard)


def _conj(x):
  return x.conj() if jnp.iscomplexobj(x) else x


def grad_rows(r: LeafSpec, logical) -> Callable:
  """``rows(span)``: rows ``[a, b)`` of :func:`grad_view`'s value (its
  complex conjugate for a complex leaf), sliced from the logical gradient
  before the cast to the master dtype. The same elements in the same
  operations; a streamed update that reads a layer stack's gradient a
  few rows at a time then never makes the cast's whole copy (an fp32 copy
  of a bf16 stack)."""
  return lambda span: _conj(
    _cast_grad(r, jax.lax.slice_in_dim(logical, *span, axis=0))
  )


def _scaled(x, factor: float):
  """``x * factor`` rounded as the device's scaled sums are, behind a
  barrier (``update.after_every_gradient``). Next to the optimizer XLA
  would fold a constant factor into the optimizer's own constant multiply
  (Adam's ``(1 - b1) * g``), and keep a narrower dtype's product in
  excess precision for the cast after it; either rounds otherwise. In
  fp32 the factor alone goes behind the barrier (the product may fuse
  with what reads it), in narrower dtypes the product."""
  if jnp.finfo(x.dtype).bits >= 32:
    return x * jax.lax.optimization_barrier(jnp.asarray(factor, x.dtype))
  return jax.lax.optimization_barrier(x * factor)


def grad_source(
  r: LeafSpec, g, stage: int, where: str, factor: float | None = None
) -> WeightSource:
  """An offloaded gradient (``offload_grads``: in host memory, storage or
  logical shape) and the function bringing it, or a layer stack's rows of
  it, to :func:`grad_view`'s value (conjugated, as :func:`update_inputs`
  gives it) in device memory: moved, unpadded, multiplied by ``factor``
  (a sum over micro-batches to its mean), cast, in that order."""
  shape = tuple(np.shape(g))
  storage = shape != tuple(r.aval.shape)
  if storage:
    _logical_grad(r, g, stage, where)  # a shape it cannot be: raised here
  device = jax.memory.Space.Device

  def load(x):
    if storage:
      x = r.shard.to_logical(_move(r.place, x, r.shard, device))
    else:
      x = jax.device_put(x, device)
    if factor is not None:
      x = _scaled(x, factor)
    return _conj(_cast_grad(r, x))

  return WeightSource(g, load)


def apply_update(r: LeafSpec, w, u, keep_master: bool):
  """``(master copy as stored or None, new params' weights)`` from the
  optimizer's weights ``w`` and its update ``u``."""
  new_w = optax.apply_updates(w, u)
  master = master_storage(r, new_w) if keep_master else None
  return master, new_w.astype(r.compute_dtype)


def master_storage(r: LeafSpec, w):
  """Updated logical weights -> the master copy as stored."""
  return stash(
    r.place,
    r.place.constrain(r.shard.to_storage(w.astype(r.master_dtype)), r.shard),
    r.shard,
  )


# --- one optimizer-state leaf ----------------------------------------------
def opt_logical(o: OptLeafSpec, x):
  """As stored -> the logical view the inner optimizer reads (sharded, in
  device memory)."""
  place, layout = o.place, o.layout
  return place.constrain(
    layout.to_logical(place.constrain(fetch(place, x, layout), layout)), layout
  )


def opt_zeros(o: OptLeafSpec, raw):
  """Zeros in place of state leaf ``o`` (stored as ``raw``) for an update
  whose kept outputs do not read it; a typed PRNG key has no zeros and is
  read as it is."""
  if jax.dtypes.issubdtype(o.aval.dtype, jax.dtypes.extended):
    return opt_logical(o, raw)
  return jnp.zeros(o.aval.shape, o.aval.dtype)


def opt_storage(o: OptLeafSpec, x):
  """The inner optimizer's new value -> as stored, in the state's dtype (an
  optimizer may promote, e.g. a bf16 moment to fp32; typed PRNG keys are
  left as they are)."""
  if x.dtype != o.aval.dtype:
    x = x.astype(o.aval.dtype)
  return stash(
    o.place, o.place.constrain(o.layout.to_storage(x), o.layout), o.layout
  )


# --- one optimizer update --------------------------------------------------
def update_inputs(spec: StateSpec, state: ZeroState, grads, where: str):
  """Per param, ``(gradient views, their rows, weight sources)`` of one
  update of ``state`` with ``grads`` (per-param list, logical or storage
  shapes; ``None`` at frozen leaves, in every output); the rows as
  :func:`grad_rows` gives them. A complex leaf's gradient is conjugated:
  Optax's convention, under which every optimizer descends on
  ``jax.grad``'s gradient of a complex leaf."""
  g_view, g_rows, w_src = [], [], []
  for g, p, m, r in zip(
    grads,
    jax.tree.leaves(state.params),
    spec.masters(state.master),
    spec.leaves,
  ):
    if not r.trainable:
      g_view.append(None)
      g_rows.append(None)
      w_src.append(None)
      continue
    logical = _logical_grad(r, g, spec.stage, where)
    g_view.append(_conj(_cast_grad(r, logical)))
    g_rows.append(grad_rows(r, logical))
    w_src.append(weight_source(r, p, m))
  return g_view, g_rows, w_src


def weight_sources(spec: StateSpec, state: ZeroState) -> list:
  """Per param, :func:`weight_source` (None for frozen leaves)."""
  return [
    weight_source(r, p, m) if r.trainable else None
    for p, m, r in zip(
      jax.tree.leaves(state.params), spec.masters(state.master), spec.leaves
    )
  ]


def grad_sources(spec: StateSpec, grads, where: str, factors=None) -> list:
  """Per param, :func:`grad_source` of its offloaded gradient (None for
  frozen leaves), with its ``factors`` entry (``None``: none)."""
  factors = factors or [None] * len(grads)
  return [
    grad_source(r, g, spec.stage, where, f) if r.trainable else None
    for g, r, f in zip(grads, spec.leaves, factors)
  ]


def inner_update(spec: StateSpec, g_tree, opt_state, w_tree, extra_args):
  """The inner optimizer's ``update`` on optimizer-view trees; extra
  arguments reach it only when it takes them
  (``optax.GradientTransformationExtraArgs``).

  Inside the Auto region of a mesh with Explicit axes, an optimizer that
  closes over values typed on the caller's mesh (built inside the caller's
  ``jit`` from traced hyperparameters: ``optax.inject_hyperparams`` around
  the drop-in, a schedule of traced values) cannot combine them with the
  region's arrays; JAX refuses while tracing. Its update then runs on the
  caller's axis types, each leaf typed as it is laid out
  (:func:`_caller_specs`): the same operations on the same values."""
  run = functools.partial(_inner_update, spec.config.inner)
  try:
    return run(g_tree, opt_state, w_tree, extra_args)
  except ValueError as e:
    if not closes_over_caller_types(e):
      raise
  args = (g_tree, opt_state, w_tree, extra_args)
  mesh = spec.config.mesh
  try:
    return call_in_caller_types(
      mesh, run, args, specs=_caller_specs(spec, *args)
    )
  except ValueError as e:
    if not closes_over_caller_types(e):
      raise
    raise ValueError(
      f"zerojax: the inner optimizer closes over an array typed on "
      f"another mesh than this ZeroTransformation's ({mesh}), so its "
      f"update cannot run on either. Build the optimizer's "
      f"hyperparameters under jax.set_mesh of the transformation's "
      f"mesh (or pass mesh= the mesh they are typed on). JAX said: "
      f"{str(e).splitlines()[0]}"
    ) from e


def _note_contract(e: Exception) -> None:
  """Adds to an error the inner optimizer's ``update`` raised what it was
  called with, and, for a tree structure error, the adapter an optimizer
  that takes gradients of part of the params needs."""
  e.add_note(
    "zerojax: raised by the inner optimizer's update(grads, opt_state, "
    "params), called as Optax's contract has it: grads and params are "
    "trees shaped like the params (the gradient of the loss with respect "
    "to every trained param)."
  )
  if "pytree structure" in str(e) or "tree structure" in str(e):
    e.add_note(
      "zerojax: an optimizer that takes the gradients of part of the params "
      "(optax.lookahead takes those of params.fast) runs behind an adapter "
      "that selects them: optax.GradientTransformation(tx.init, lambda g, "
      "s, p=None: tx.update(g.fast, s, p))."
    )


def _inner_update(inner, g_tree, opt_state, w_tree, extra_args):
  try:
    if isinstance(inner, optax.GradientTransformationExtraArgs):
      return inner.update(g_tree, opt_state, w_tree, **extra_args)
    return inner.update(g_tree, opt_state, w_tree)
  except Exception as e:
    _note_contract(e)
    raise


def _caller_specs(spec: StateSpec, g_tree, opt_state, w_tree, extra_args):
  """Per leaf of ``(g_tree, opt_state, w_tree, extra_args)``, its spec as a
  type on the caller's mesh (:meth:`LeafLayout.typed_spec`): gradients and
  weights by their params' shard layout, the optimizer's leaves by theirs,
  extra arguments replicated. An uneven (padded) leaf is typed whole over
  the data axis, so it is gathered for the update."""
  explicit = set(explicit_names(spec.config.mesh))
  axis = spec.config.axis_name
  trained = [
    r.shard.typed_spec(axis, explicit) for r in spec.leaves if r.trainable
  ]
  opt = [o.layout.typed_spec(axis, explicit) for o in spec.opt_leaves]
  n_g, n_o = len(jax.tree.leaves(g_tree)), len(jax.tree.leaves(opt_state))
  if n_g != len(trained) or n_o != len(opt):  # not this spec's trees
    trained, opt = [None] * n_g, [None] * n_o
  return trained + opt + trained + [None] * len(jax.tree.leaves(extra_args))


def after_update(
  spec: StateSpec, state: ZeroState, masters, params, opt_leaves
) -> ZeroState:
  """``state`` one step on: its new master leaves (per param, None where
  frozen), params (as stored) and optimizer-state leaves (as stored)."""
  return state.replace(
    step=state.step + 1,
    params=spec.unflatten_params(params),
    master=None if state.master is None else spec.optimizer_view(masters),
    opt_state=jax.tree.unflatten(spec.opt_def, opt_leaves),
  )
