"""Creating a :class:`~zerojax.ZeroState` from a params tree the caller
holds (:func:`init`: each device receives only its shard), and the
pieces :mod:`zerojax._src.step.init_from` shares: the records are planned
first (:func:`zerojax._src.records.spec.make_spec`, shapes only), then each
group of leaves is laid out straight into its layout by one program.
Non-trainable leaves are said in a warning at init (see :mod:`zerojax._src.records.spec`).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.comm import buckets as _buckets
from zerojax._src.comm import gather as _gather
from zerojax._src.jaxpr import deps as _deps
from zerojax._src.records import layout as _layout
from zerojax._src.records.spec import (
  StateSpec,
  ZeroState,
  make_spec,
)
from zerojax._src.step import leaf_ops as _ops
from zerojax._src.step import offload as _offload
from zerojax._src.step.deleted import is_concrete, reject_deleted
from zerojax._src.step.extras import with_extras


def place_leaf(x, layout, spec: StateSpec):
  """``x`` (a host or local array, the same on every process) as a global
  array in ``layout``'s storage form: each device receives only its shard."""
  sharding = spec.sharding(layout)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.jit(layout.to_storage, out_shardings=sharding)(x)
  if isinstance(x, jax.Array) and jax.process_count() == 1 and not layout.pad:
    # device to device, no host copy; an array already laid out so is used
    # as it is (the init program copies it into the state once)
    return jax.device_put(x, sharding)
  host = layout.to_storage(np.asarray(x))
  if jax.process_count() == 1:
    return jax.device_put(host, sharding)
  return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def build_plan(spec: StateSpec, grouped: bool = True):
  """``(groups, owned)``: the param leaves each init program builds (about
  ``1/8`` of the bytes each, :func:`init_groups`; one group for all unless
  ``grouped``) and the optimizer-state leaves it builds with them; the
  shared ones (``count``) go with the first group.

  A group's program runs the optimizer's ``init`` with the other groups'
  weights replaced by zeros, which is exact when each state leaf reads only
  its own param (checked from ``init``'s jaxpr, :mod:`zerojax._src.jaxpr.deps`);
  otherwise one program builds everything."""
  own = _offload.owners(spec)
  whole = ([list(range(len(spec.leaves)))], [list(range(len(own)))])
  if not grouped:
    return whole
  groups = init_groups(spec)
  train = [i for i, r in enumerate(spec.leaves) if r.trainable]
  slot = {i: k for k, i in enumerate(train)}
  deps = _deps.input_dependencies(
    lambda *w: jax.tree.leaves(
      spec.tx.inner.init(
        spec.optimizer_view(_offload.scatter(len(spec.leaves), train, w))
      )
    ),
    *[
      jax.ShapeDtypeStruct(
        spec.leaves[i].aval.shape, spec.leaves[i].master_dtype
      )
      for i in train
    ],
  )
  if deps is None or len(deps) != len(own):
    return whole
  for j, p in enumerate(own):
    if not deps[j] <= (frozenset() if p is None else {slot[p]}):
      return whole
  where = {i: g for g, group in enumerate(groups) for i in group}
  owned = [[] for _ in groups]
  for j, p in enumerate(own):
    owned[0 if p is None else where[p]].append(j)
  return groups, owned


def stage3_param(r, w):
  """New logical weights -> a stage-3 param as stored (its shard, in host
  memory with ``offload_params``)."""
  w = w.astype(r.compute_dtype)
  return _ops.stash_param(r, r.place.constrain(r.param.to_storage(w), r.param))


def stored_params(spec: StateSpec, weights, old=None) -> list:
  """Weights (logical shapes, any float dtype) -> the params as stored.

  ``weights``: one entry per param leaf, ``None`` to skip (the result
  keeps ``old``'s entry there, or ``None``). At stage 3 each leaf takes its shard layout; at
  stages 1-2 a sharded leaf's shard is all-gathered back to the replicated
  params in an explicit ``shard_map`` (left to GSPMD the layout change may
  take another route), over its layers in bounded buckets (``comm.buckets``,
  ZeRO-R's CB) with the gather on the major dimension
  (``comm.gather.on_major_dim``): the result is written bucket by bucket,
  into ``old`` (the donated params of a step) when given, never a second
  full copy. The step's update and :func:`init_from` both build params
  this way."""
  tx = spec.tx
  axis, stage = tx.axis_name, tx.stage
  old = [None] * len(spec.leaves) if old is None else list(old)
  out = [None] * len(spec.leaves)
  gather_idx, layouts = [], []
  for i, (w, r) in enumerate(zip(weights, spec.leaves)):
    if w is None:
      out[i] = old[i]
      continue
    w = w.astype(r.compute_dtype)
    if stage == 3:
      out[i] = stage3_param(r, w)
    elif stage >= 1 and r.shard.sharded:
      out[i] = r.place.constrain(r.shard.to_storage(w), r.shard)
      gather_idx.append(i)
      layouts.append(r.shard)
    else:
      out[i] = r.place.constrain(w, r.param)
  if not gather_idx:
    return out
  n = tx.num_shards

  def all_gather(shards, into):
    full = []
    for s, o, l, i in zip(shards, into, layouts, gather_idx):

      def one(x, l=l):
        return l.to_logical(
          _gather.over_model_shards(
            lambda x, d=l.dim: _gather.on_major_dim(
              lambda y, d: jax.lax.all_gather(
                y, axis, axis=d, tiled=True, to="invarying"
              ),
              x,
              d,
            ),
            x,
            l.model,
            l.dim,
          )
        )

      full.append(
        _buckets.bucketed(
          one,
          s,
          n * _buckets.itemsize(spec.leaves[i].compute_dtype),
          tx.bucket_bytes,
          _buckets.splittable(l),
          into=o,
        )
      )
    return full

  full = jax.shard_map(
    all_gather,
    mesh=tx.compute_mesh,
    in_specs=([l.manual_spec(axis) for l in layouts], [P()] * len(layouts)),
    out_specs=[P()] * len(layouts),
    axis_names={axis},
  )([out[i] for i in gather_idx], [old[i] for i in gather_idx])
  for i, f in zip(gather_idx, full):
    out[i] = f
  return out


def build_group(stored, spec: StateSpec, group, owned):
  """One init program's outputs: the params, master copy (where the
  policy keeps one; else none, so the program allocates no copy the state
  drops) and owned optimizer-state leaves of ``group``, from its leaves in
  their shard layouts (under ``jit``)."""
  convert = _layout.convert
  recs = [spec.leaves[i] for i in group]
  weights = {
    i: convert(x, r.shard, r.shard, r.master_dtype)
    for i, x, r in zip(group, stored, recs)
    if r.trainable
  }
  view = [
    None
    if not r.trainable
    else r.shard.to_logical(weights[i])
    if i in weights
    else jnp.zeros(r.aval.shape, r.master_dtype)
    for i, r in enumerate(spec.leaves)
  ]
  opt = jax.tree.leaves(spec.tx.inner.init(spec.optimizer_view(view)))
  if len(opt) != len(spec.opt_leaves):
    raise RuntimeError(
      "zerojax: optimizer state changed structure between planning and init."
    )
  by_leaf = [None] * len(spec.leaves)
  for i, x, r in zip(group, stored, recs):
    by_leaf[i] = r.shard.to_logical(x)
  built = stored_params(spec, by_leaf)
  params = [built[i] for i in group]
  master = (
    [weights[i] for i in group if i in weights]
    if spec.policy.has_master
    else []
  )
  return (
    params,
    master,
    [spec.opt_leaves[j].layout.to_storage(opt[j]) for j in owned],
  )


def group_shardings(spec: StateSpec, group, owned):
  recs = [spec.leaves[i] for i in group]
  keeps_master = spec.policy.has_master
  return (
    [r.place.sharding(r.param, host=r.place.params_host) for r in recs],
    [
      r.place.sharding(r.shard, host=r.place.offload)
      for r in recs
      if r.trainable and keeps_master
    ],
    [
      spec.opt_leaves[j].place.sharding(
        spec.opt_leaves[j].layout, host=spec.opt_leaves[j].place.offload
      )
      for j in owned
    ],
  )


def assemble(spec: StateSpec, parts) -> ZeroState:
  """Per-group outputs -> the state."""
  params = [None] * len(spec.leaves)
  master = [None] * len(spec.leaves)
  opt = [None] * len(spec.opt_leaves)
  for (group, owned), (p, m, o) in parts:
    for i, x in zip(group, p):
      params[i] = x
    for i, x in zip([i for i in group if spec.leaves[i].trainable], m):
      master[i] = x
    for j, x in zip(owned, o):
      opt[j] = x
  step = _zero_step(spec.sharding(_layout.LeafLayout(())))()
  return ZeroState(
    step=step,
    params=spec.unflatten_params(params),
    master=spec.optimizer_view(master) if spec.policy.has_master else None,
    opt_state=jax.tree.unflatten(spec.opt_def, opt),
    spec=spec,
  )


@functools.lru_cache(maxsize=8)
def _zero_step(sharding):
  return jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=sharding)


def _reject_non_params(params, where: str):
  """Module objects and functions are not a params tree: say what to pass."""
  # An nnx.Module exists only where flax.nnx is imported: looked up, not
  # imported, so a plain-JAX script does not load Flax and what it imports.
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(params, nnx.Module):
    raise TypeError(
      f"{where}: got an nnx.Module ({type(params).__name__}). Pass its "
      f"parameters, and its other variables as model_state: "
      f"graphdef, params, rest = nnx.split(model, nnx.Param, ...); "
      f"zerojax.init(params, tx, model_state=rest)."
    )
  leaves = jax.tree.leaves(params)
  if callable(params) and any(not hasattr(x, "shape") for x in leaves):
    raise TypeError(
      f"{where}: got a callable ({type(params).__name__}), not a params "
      f"tree. To build params with a function, sharded as they are "
      f"created, use zerojax.init_from(init_fn, tx, *args); for a module "
      f"object pass its array leaves."
    )


def init(
  params,
  tx: optax.GradientTransformationExtraArgs,
  *,
  key=None,
  model_state=None,
  copy: bool = False,
) -> ZeroState:
  """Lays out params, master weights and optimizer state for ``tx``'s stage.

  A param array already laid out as the state stores it (replicated on the
  mesh, as a jitted init under ``jax.set_mesh`` makes it, at stages 0-2 in
  the stored dtype) is held by the state as it is, with no copy, as
  ``flax.training.train_state.TrainState.create`` holds it. The train step
  donates the state, so, as in a data-parallel loop with donated params,
  such arrays are deleted by the first step: read the params from the
  state (:func:`gather_params`), or pass ``copy=True``. Arrays laid out
  otherwise (at stage 3, every sharded leaf) stay the caller's, alive
  while bound: ``del params`` after ``init`` frees them.

  Args:
    params: a pytree of arrays (host or device, the same on every process),
      e.g. the output of ``model.init``. For models larger than a device,
      build them sharded with :func:`init_from` instead: here the caller
      already holds one full copy.
    tx: a :class:`ZeroTransformation` from :func:`zerojax.zero`.
    key: root PRNG key for the loss (``jax.random.key(seed)``, a raw
      ``PRNGKey`` or an int seed); with it the train step calls
      ``loss_fn(params, batch, key=...)`` with a key distinct per step,
      device and micro-batch. Checkpointed with the state.
    model_state: non-trainable model state (batch-norm statistics, NNX
      non-``Param`` variables), replicated; with it the train step calls
      ``loss_fn(..., model_state=...)`` and the loss returns its new value.
    copy: give the state buffers of its own, so the arrays passed outlive
      the donated train steps (one more copy of the params while you hold
      them).

  Returns:
    A :class:`ZeroState` whose arrays are global ``jax.Array`` sharded over
    the mesh's data axis as the stage prescribes. Each device receives only
    its shard of each sharded leaf, never a full copy.

  Example:
    >>> state = zerojax.init(params, zerojax.zero(optax.adamw(1e-3), stage=3))
    >>> int(state.step)
    0
  """
  _reject_non_params(params, "zerojax.init")
  if not isinstance(copy, bool):
    raise TypeError(f"zerojax.init: copy must be True or False, got {copy!r}.")
  reject_deleted(params, "zerojax.init", "params")
  spec = make_spec(params, tx)
  leaves = jax.tree.leaves(params)
  held = [None] * len(leaves) if copy else _held_as_stored(leaves, spec)
  # offloaded: one group at a time, so the device holds one group's shards
  # and state before they go to host memory; else one program (faster to
  # compile, and the state ends up on the device anyway)
  state = build_from_stored(
    spec,
    lambda group: [
      place_leaf(leaves[i], spec.leaves[i].shard, spec) for i in group
    ],
    grouped=spec.place.offload,
    held=held,
  )
  return with_extras(state, key, model_state, "zerojax.init")


def build_from_stored(
  spec: StateSpec, stored, *, grouped: bool, held=None, keep_stored=False
):
  """The state from its param leaves, a group at a time: ``stored(group)``
  gives the group's leaves in their shard layouts' storage form (global
  arrays); one program per group makes the params, master copy and
  optimizer state from them. ``held[i]``: an array the state keeps as
  leaf ``i``'s params as it is (None: built). ``keep_stored``: a stored
  leaf already laid out and typed as the state's param is kept as it is
  (the caller made it for this state and keeps no reference), so the
  program does not copy it."""
  held = list(held or [None] * len(spec.leaves))
  parts = []
  for group, owned in zip(*build_plan(spec, grouped=grouped)):
    leaves = stored(group)
    if keep_stored:
      for i, x in zip(group, leaves):
        held[i] = _as_param(x, spec.leaves[i], spec)
    keep = tuple(held[i] is not None for i in group)
    if all(keep) and not owned and not spec.policy.has_master:
      p, m, o = [], [], []  # nothing to build: no program
    else:
      p, m, o = _build_jit(spec, tuple(group), tuple(owned), keep)(leaves)
    p = iter(p)
    p = [held[i] if k else next(p) for i, k in zip(group, keep)]
    parts.append(((group, owned), (p, m, o)))
  return assemble(spec, parts)


def _held_as_stored(leaves, spec: StateSpec) -> list:
  """Per param leaf, the caller's array as the state's stored param (its
  buffers, the state's exact sharding) where it is laid out as the state
  stores it; else ``None``. A buffer at two leaves is copied: the donated
  step must not take one buffer twice."""
  concrete = [is_concrete(x) for x in leaves]
  seen = {}
  for x, c in zip(leaves, concrete):
    if c:
      seen[id(x)] = seen.get(id(x), 0) + 1
  return [
    _as_param(x, r, spec) if c and seen[id(x)] == 1 else None
    for x, c, r in zip(leaves, concrete, spec.leaves)
  ]


def _as_param(x, r, spec: StateSpec):
  """``x``'s buffers as the state's stored param of leaf ``r`` (its exact
  sharding), or None where ``x`` is not laid out and typed as that param."""
  target = spec.sharding(r.param)
  ok = (
    isinstance(x.sharding, NamedSharding)
    and x.sharding.mesh == target.mesh
    and x.sharding.memory_kind == target.memory_kind
    and x.sharding.is_equivalent_to(target, x.ndim)
    and x.dtype == r.compute_dtype
    and tuple(x.shape) == tuple(r.param.storage_shape)
  )
  if not ok:
    return None
  return jax.make_array_from_single_device_arrays(
    x.shape, target, [s.data for s in x.addressable_shards]
  )


@functools.lru_cache(maxsize=256)
def _build_jit(spec, group, owned, keep):
  """The init program of one group; its params output leaves out those the
  state holds as the caller passed them (``keep``)."""
  params, master, opt = group_shardings(spec, group, owned)
  outs = ([s for s, k in zip(params, keep) if not k], master, opt)

  def build(stored):
    p, m, o = build_group(stored, spec, group, owned)
    return [x for x, k in zip(p, keep) if not k], m, o

  return jax.jit(spec.region(build, outs), out_shardings=outs)


def init_groups(spec: StateSpec, parts: int = 8) -> list[list[int]]:
  """Consecutive param leaves in groups of at most ``1/parts`` of the
  bytes (a larger leaf alone). Any two neighbouring groups together exceed
  the budget, so there are fewer than ``2 * parts + 1`` groups: that many
  small jits of ``init_fn``, each traced anew."""
  return _offload.byte_groups(
    [r.size * np.dtype(r.aval.dtype).itemsize for r in spec.leaves], parts
  )
