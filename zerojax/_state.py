"""Training state laid out for a ZeRO stage: :class:`ZeroState` and ``init``.

Storage per stage (``L`` = a leaf's :class:`~zerojax._layout.LeafLayout`):

* ``params``: compute dtype; replicated and logical at stages 0-2, sharded
  and padded by ``L`` at stage 3.
* ``master``: the master copy (``policy.master_dtype``) when the policy keeps
  one, else ``None``; replicated at stage 0, sharded by ``L`` at 1-3.
* ``opt_state``: the inner optimizer's state, each leaf laid out by the same
  rule applied to its own shape (so moments share their param's layout and
  Adafactor's factored rows and columns get their own).

Non-floating parameter leaves (integer buffers, masks) are carried but not
trained: the inner optimizer sees ``optax.MaskedNode()`` in their place.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import _layout
from zerojax._transform import ZeroTransformation


def _is_floating(dtype) -> bool:
  return bool(jnp.issubdtype(dtype, jnp.floating))


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """Static layout of a :class:`ZeroState` (hashable: part of its treedef).

  Per-parameter tuples are in ``jax.tree.leaves(params)`` order.
  """

  tx: ZeroTransformation
  params_def: Any            # PyTreeDef of the params
  params_avals: tuple        # logical jax.ShapeDtypeStruct of each param
  trainable: tuple           # bool per param: floating leaves are trained
  param_layouts: tuple       # LeafLayout of each param as stored
  shard_layouts: tuple       # LeafLayout of each master / gradient leaf
  opt_def: Any               # PyTreeDef of the inner optimizer state
  opt_avals: tuple           # logical jax.ShapeDtypeStruct per opt leaf
  opt_layouts: tuple         # LeafLayout per opt leaf

  @property
  def policy(self):
    return self.tx.policy

  @property
  def stage(self) -> int:
    return self.tx.stage

  # --- trees ------------------------------------------------------------
  def unflatten_params(self, leaves):
    return jax.tree.unflatten(self.params_def, list(leaves))

  def optimizer_view(self, leaves):
    """A params-shaped tree, ``MaskedNode`` at frozen leaves."""
    return self.unflatten_params(
        [x if t else optax.MaskedNode() for x, t in zip(leaves, self.trainable)])

  def from_optimizer_view(self, tree):
    """Per-param list of an optimizer-view tree's leaves (None if frozen)."""
    it = iter(jax.tree.leaves(tree))
    return [next(it) if t else None for t in self.trainable]

  def compute_dtype(self, i):
    dt = self.params_avals[i].dtype
    return self.policy.compute(dt) if self.trainable[i] else np.dtype(dt)

  def master_dtype(self, i):
    return self.policy.master(self.params_avals[i].dtype)

  def reduce_dtype(self, i):
    return self.policy.reduce(self.params_avals[i].dtype)

  # --- shardings and shapes ----------------------------------------------
  def sharding(self, layout) -> NamedSharding:
    return _layout.sharding(self.tx.mesh, layout, self.tx.axis_name)

  def shardings(self) -> "ZeroState":
    """A :class:`ZeroState` of ``NamedSharding``, for ``out_shardings``."""
    return self._build(lambda layout, dtype: self.sharding(layout))

  def abstract(self) -> "ZeroState":
    """The state as ``jax.ShapeDtypeStruct`` with shardings; allocates nothing."""
    return self._build(lambda layout, dtype: jax.ShapeDtypeStruct(
        layout.storage_shape, dtype, sharding=self.sharding(layout)))

  def _build(self, make) -> "ZeroState":
    n = len(self.params_avals)
    params = self.unflatten_params(
        [make(self.param_layouts[i], self.compute_dtype(i)) for i in range(n)])
    master = None
    if self.policy.has_master:
      master = self.optimizer_view(
          [make(self.shard_layouts[i], self.master_dtype(i)) if self.trainable[i]
           else None for i in range(n)])
    opt = jax.tree.unflatten(self.opt_def, [
        make(l, a.dtype) for l, a in zip(self.opt_layouts, self.opt_avals)])
    step = make(_layout.LeafLayout(()), jnp.int32)
    return ZeroState(step=step, params=params, master=master, opt_state=opt,
                     spec=self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ZeroState:
  """Params, master weights, optimizer state and step, laid out for a stage.

  Attributes:
    step: int32 scalar, replicated: optimizer steps taken.
    params: the model parameters in compute dtype (sharded at stage 3).
    master: master copy in ``policy.master_dtype`` (sharded at stages 1-3),
      or ``None`` when the policy keeps none.
    opt_state: the inner Optax state (sharded at stages 1-3).
    spec: static :class:`StateSpec` (stage, mesh, per-leaf layouts).
  """

  step: jax.Array
  params: Any
  master: Any
  opt_state: Any
  spec: StateSpec = dataclasses.field(metadata=dict(static=True))

  def replace(self, **kw) -> "ZeroState":
    return dataclasses.replace(self, **kw)


def make_spec(params, tx: ZeroTransformation) -> StateSpec:
  """Plans every leaf's layout from shapes alone (no allocation)."""
  if not isinstance(tx, ZeroTransformation):
    raise TypeError(
        f"zerojax: expected the ZeroTransformation returned by zerojax.zero(), "
        f"got {type(tx).__name__}. Wrap your optimizer: "
        f"tx = zerojax.zero(optax.adamw(3e-4), stage=1).")
  paths_leaves, params_def = jax.tree_util.tree_flatten_with_path(params)
  avals = []
  for path, x in paths_leaves:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(
          f"zerojax.init: param leaf {jax.tree_util.keystr(path)} is a "
          f"{type(x).__name__}, not an array. Params must be a pytree of "
          f"arrays (convert Python scalars with jnp.asarray).")
    avals.append(jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype)))
  trainable = tuple(_is_floating(a.dtype) for a in avals)
  param_layouts = tuple(tx.plan_param(a.shape, a.dtype) for a in avals)
  shard_layouts = tuple(tx.plan(a.shape, a.dtype) for a in avals)
  policy = tx.policy
  view = jax.tree.unflatten(params_def, [
      jax.ShapeDtypeStruct(a.shape, policy.master(a.dtype)) if t
      else optax.MaskedNode() for a, t in zip(avals, trainable)])
  opt_shape = jax.eval_shape(tx.inner.init, view)
  opt_leaves, opt_def = jax.tree.flatten(opt_shape)
  opt_avals = tuple(jax.ShapeDtypeStruct(tuple(o.shape), np.dtype(o.dtype))
                    for o in opt_leaves)
  opt_layouts = tuple(tx.plan(o.shape, o.dtype) for o in opt_avals)
  return StateSpec(tx, params_def, tuple(avals), trainable, param_layouts,
                   shard_layouts, opt_def, opt_avals, opt_layouts)


def _place(x, layout, spec: StateSpec):
  """``x`` (a host or local array, the same on every process) as a global
  array in ``layout``'s storage form: each device receives only its shard."""
  sharding = spec.sharding(layout)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.jit(layout.to_storage, out_shardings=sharding)(x)
  host = np.asarray(x)
  if layout.pad:
    widths = [(0, 0)] * host.ndim
    widths[layout.dim] = (0, layout.pad)
    host = np.pad(host, widths)
  if jax.process_count() == 1:
    return jax.device_put(host, sharding)
  return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def _build_state(stored, spec: StateSpec) -> ZeroState:
  """Params in their shard layouts -> the state's storage (under ``jit``)."""
  policy = spec.policy
  leaves = [l.to_logical(x) for x, l in
            zip(jax.tree.leaves(stored), spec.shard_layouts)]
  compute = [x.astype(spec.compute_dtype(i)) for i, x in enumerate(leaves)]
  weights = [x.astype(spec.master_dtype(i)) if t else None
             for i, (x, t) in enumerate(zip(leaves, spec.trainable))]
  opt_state = spec.tx.inner.init(spec.optimizer_view(weights))
  opt_leaves = jax.tree.leaves(opt_state)
  if len(opt_leaves) != len(spec.opt_layouts):
    raise RuntimeError("zerojax: optimizer state changed structure between "
                       "planning and init.")
  store = lambda x, l: l.to_storage(x)
  master = None
  if policy.has_master:
    master = spec.optimizer_view(
        [store(w, l) if w is not None else None
         for w, l in zip(weights, spec.shard_layouts)])
  return ZeroState(
      step=jnp.zeros((), jnp.int32),
      params=spec.unflatten_params(
          [store(x, l) for x, l in zip(compute, spec.param_layouts)]),
      master=master,
      opt_state=jax.tree.unflatten(
          spec.opt_def, [store(x, l) for x, l in zip(opt_leaves, spec.opt_layouts)]),
      spec=spec)


def init(params, tx: ZeroTransformation, *args) -> ZeroState:
  """Lays out params, master weights and optimizer state for ``tx``'s stage.

  Args:
    params: a pytree of arrays (host or device, the same on every process),
      e.g. the output of ``model.init``; or a function ``params(*args)``
      returning one, which is then run under ``jit`` with sharded outputs so
      the full parameters are never materialised on one device (use this for
      models larger than a device).
    tx: a :class:`ZeroTransformation` from :func:`zerojax.zero`.
    *args: arguments of ``params`` when it is a function (e.g. a PRNG key).

  Returns:
    A :class:`ZeroState` whose arrays are global ``jax.Array`` sharded over
    the mesh's data axis as the stage prescribes. Each device receives only
    its shard of each sharded leaf, never a full copy.

  Example:
    >>> state = zerojax.init(params, zerojax.zero(optax.adamw(1e-3), stage=3))
    >>> state = zerojax.init(lambda k: model.init(k, x), tx, jax.random.key(0))
  """
  if callable(params):
    fn = params
    spec = make_spec(jax.eval_shape(fn, *args), tx)
    build = lambda *a: _build_state(
        jax.tree.map(lambda x, l: l.to_storage(x), fn(*a),
                     spec.unflatten_params(spec.shard_layouts)), spec)
    return jax.jit(build, out_shardings=spec.shardings())(*args)
  spec = make_spec(params, tx)
  stored = spec.unflatten_params([
      _place(x, l, spec) for x, l in zip(jax.tree.leaves(params),
                                         spec.shard_layouts)])
  build = jax.jit(lambda p: _build_state(p, spec), out_shardings=spec.shardings())
  return build(stored)


def _gather(state: ZeroState, use_master: bool):
  spec = state.spec
  out = []
  params = jax.tree.leaves(state.params)
  master = (spec.from_optimizer_view(state.master)
            if use_master and state.master is not None else [None] * len(params))
  for i, (p, m) in enumerate(zip(params, master)):
    if m is not None:
      out.append(spec.shard_layouts[i].to_logical(m))
    else:
      out.append(spec.param_layouts[i].to_logical(p))
  return spec.unflatten_params(out)


def gather_params(state: ZeroState, *, master: bool = False):
  """The full, unsharded params (replicated on every device).

  Args:
    state: a :class:`ZeroState`.
    master: return the master copy (e.g. fp32) where the policy keeps one,
      instead of the compute-dtype params. Use it for export.

  Returns:
    A pytree shaped like the params given to :func:`init`.
  """
  if not isinstance(state, ZeroState):
    raise TypeError(f"zerojax.gather_params: expected a ZeroState, got "
                    f"{type(state).__name__}.")
  return _gather_replicated(state, bool(master))


@functools.partial(jax.jit, static_argnums=1)
def _gather_replicated(state: ZeroState, use_master: bool):
  """Compiled once per state layout (the spec is part of the treedef)."""
  rep = NamedSharding(state.spec.tx.mesh, P())
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rep),
                      _gather(state, use_master))
