"""The state records: what zerojax decides about every leaf, from shapes alone.

:func:`make_spec` plans a :class:`StateSpec`: one :class:`LeafSpec` per
parameter leaf and one :class:`OptLeafSpec` per leaf of the inner
optimizer's state, each with its layout (:mod:`zerojax._src.records.layout`), dtypes
and the conversions between how it is stored and the logical (unpadded)
view the inner optimizer sees. :class:`ZeroState` holds the arrays laid out
by a spec. Nothing here allocates or runs a step; the layers above (init,
gradients, update, the drop-in) read these records and nothing else.

Storage per stage (``L`` = a leaf's :class:`~zerojax._src.records.layout.LeafLayout`):

* ``params``: compute dtype; replicated and logical at stages 0-2, sharded
  and padded by ``L`` at stage 3.
* ``master``: the master copy (``policy.master_dtype``) when the policy keeps
  one, else ``None``; replicated at stage 0, sharded by ``L`` at 1-3.
* ``opt_state``: the inner optimizer's state, each leaf laid out by the same
  rule applied to its own shape (so moments share their param's layout and
  Adafactor's factored rows and columns get their own).

Floating and complex parameter leaves are trained (what ``jax.grad`` can
differentiate). Other leaves (integer buffers, masks) are carried but not
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.records import host_memory as _host_memory
from zerojax._src.records import layout as _layout
from zerojax._src.records import model_axes as _model_axes
from zerojax._src.records import trees as _trees
from zerojax._src.records.config import HOST_MEMORY, ZeroConfig
from zerojax._src.records.mesh import auto_region, compute_mesh, named
from zerojax._src.records.trees import leaf_dtype


def is_trainable(dtype) -> bool:
  """Floating or complex: the leaves ``jax.grad`` differentiates."""
  return bool(jnp.issubdtype(dtype, jnp.inexact))


def is_key_dtype(dtype) -> bool:
  """A typed PRNG key's dtype (``jax.random.key``); ``None`` is not."""
  return dtype is not None and bool(
    jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  )


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a leaf's arrays live: the mesh, its data axis, and which of
  them are in host memory."""

  mesh: Mesh
  axis_name: str
  offload: bool = False  # the master copy and optimizer state
  params_host: bool = False  # the param's stage-3 shard

  def sharding(self, layout, host: bool = False) -> NamedSharding:
    """``layout``'s sharding on the caller's mesh (what the state's arrays
    carry), in host memory with ``host=True``."""
    return self.sharding_on(self.mesh, layout, host)

  def compute_sharding(self, layout, host: bool = False) -> NamedSharding:
    """The same on the all-``Auto`` compute mesh (:func:`auto_region`)."""
    return self.sharding_on(compute_mesh(self.mesh), layout, host)

  def sharding_on(self, mesh, layout, host: bool = False) -> NamedSharding:
    """``layout``'s sharding on ``mesh``."""
    s = _layout.sharding(mesh, layout, self.axis_name)
    return s.with_memory_kind(HOST_MEMORY) if host else s

  def constrain(self, x, layout):
    """``x`` (logical or storage shape) constrained to ``layout``'s sharding."""
    return jax.lax.with_sharding_constraint(x, self.compute_sharding(layout))


def gathered(layout):
  """``layout`` gathered over the data axis: the model axes kept."""
  return _layout.replicated(layout.shape, layout.model, reason="gathered")


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """Everything zerojax decides about one parameter leaf.

  Attributes:
    path: ``jax.tree_util.keystr`` of the leaf in the params tree.
    aval: logical (unpadded) shape and dtype as given to ``init``.
    trainable: floating and complex leaves are trained; others are carried.
    stacked: its leading dimension is a layer axis (never sharded).
    model: its model (tensor-parallel) spec, one tuple of mesh axes per
      dimension (``()`` when none).
    param: layout of the parameter as stored (sharded at stage 3).
    shard: layout of its master copy, gradient and moments.
    compute_dtype / master_dtype / reduce_dtype: from the policy.
    place: where the state's arrays live.
  """

  path: str
  aval: Any
  trainable: bool
  stacked: bool
  model: tuple
  param: _layout.LeafLayout
  shard: _layout.LeafLayout
  compute_dtype: Any
  master_dtype: Any
  reduce_dtype: Any
  place: Placement

  @property
  def hooked(self) -> bool:
    """Reaches a stage 2-3 loss as a ShardedParam (gathered by the model)."""
    return self.trainable and self.shard.sharded

  @property
  def size(self) -> int:
    """Logical elements."""
    return int(np.prod(self.aval.shape))

  def kept(self, param, master):
    """``(array, layout)`` of the most precise copy the state keeps of this
    leaf: the master copy when there is one, else the params."""
    return (master, self.shard) if master is not None else (param, self.param)

  @property
  def whole(self) -> bool:
    """Its gradient is replicated over every mesh axis (stage 0, or a leaf
    too small to shard, with no model axis)."""
    return not self.shard.sharded and not any(self.shard.model)


@dataclasses.dataclass(frozen=True)
class OptLeafSpec:
  """One leaf of the inner optimizer's state: its path in that state, the
  optimizer's name for it (``mu``, ``nu``, ``count``), its logical shape
  and dtype, and its layout."""

  path: str
  field: str
  aval: Any
  layout: _layout.LeafLayout
  place: Placement


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """Static layout of a :class:`ZeroState` (hashable: part of its treedef).

  Attributes:
    tx: the :class:`~zerojax.ZeroTransformation` it was planned for.
    params_def: tree structure of the params.
    leaves: one :class:`LeafSpec` per param leaf (``jax.tree.leaves`` order).
    opt_def: tree structure of the inner optimizer's state.
    opt_leaves: one :class:`OptLeafSpec` per leaf of that state.
  """

  tx: optax.GradientTransformationExtraArgs
  params_def: Any
  leaves: tuple[LeafSpec, ...]
  opt_def: Any
  opt_leaves: tuple[OptLeafSpec, ...]

  @property
  def config(self) -> ZeroConfig:
    return self.tx.config

  @property
  def policy(self):
    return self.config.policy

  @property
  def stage(self) -> int:
    return self.config.stage

  @functools.cached_property
  def place(self) -> Placement:
    """The state's placement: ``offload`` when any leaf of the master
    copy or optimizer state lives in host memory."""
    c = self.config
    host = any(r.place.offload for r in self.leaves) or any(
      o.place.offload for o in self.opt_leaves
    )
    return Placement(c.mesh, c.axis_name, host)

  def sharding(self, layout, host: bool = False) -> NamedSharding:
    return self.place.sharding(layout, host)

  def region(self, fn, out_shardings):
    """``fn`` run with the mesh's axes ``Auto``, outputs typed as
    ``out_shardings`` (:func:`zerojax._src.records.mesh.auto_region`)."""
    return auto_region(self.config.mesh, fn, out_shardings)

  def replicated(self, ndim: int = 0) -> NamedSharding:
    return named(self.config.mesh, P(), ndim)

  # --- trees ------------------------------------------------------------
  def records(self):
    """The :class:`LeafSpec` records in the params' tree structure."""
    return self.unflatten_params(self.leaves)

  def unflatten_params(self, leaves):
    return jax.tree.unflatten(self.params_def, list(leaves))

  def params_avals(self):
    """The params as ``jax.ShapeDtypeStruct`` (logical shapes)."""
    return self.unflatten_params([r.aval for r in self.leaves])

  def opt_avals(self):
    """The inner optimizer's state as ``jax.ShapeDtypeStruct``."""
    return jax.tree.unflatten(self.opt_def, [o.aval for o in self.opt_leaves])

  def optimizer_view(self, leaves):
    """A params-shaped tree, ``MaskedNode`` at frozen leaves."""
    return self.unflatten_params(
      [
        x if r.trainable else optax.MaskedNode()
        for x, r in zip(leaves, self.leaves)
      ]
    )

  def from_optimizer_view(self, tree):
    """Per-param list of an optimizer-view tree's leaves (None if frozen)."""
    it = iter(jax.tree.leaves(tree))
    return [next(it) if r.trainable else None for r in self.leaves]

  def masters(self, master):
    """Per-param list of a state's master leaves (all None without one)."""
    if master is None:
      return [None] * len(self.leaves)
    return self.from_optimizer_view(master)

  # --- shardings and shapes ----------------------------------------------
  def shardings(self) -> ZeroState:
    """A :class:`ZeroState` of ``NamedSharding``, for ``out_shardings``."""
    return self._build(lambda layout, dtype, host: self.sharding(layout, host))

  def shardings_like(self, state: ZeroState) -> ZeroState:
    """:meth:`shardings` for ``state``, its key and model state replicated."""
    return self.shardings().replace(
      key=None if state.key is None else self.replicated(),
      model_state=jax.tree.map(
        lambda x: self.replicated(np.ndim(x)), state.model_state
      ),
    )

  def abstract(self) -> ZeroState:
    """The state as ``jax.ShapeDtypeStruct`` with shardings; allocates nothing."""
    return self._build(
      lambda layout, dtype, host: jax.ShapeDtypeStruct(
        layout.storage_shape, dtype, sharding=self.sharding(layout, host)
      )
    )

  def _build(self, make) -> ZeroState:
    params = self.unflatten_params(
      [make(r.param, r.compute_dtype, r.place.params_host) for r in self.leaves]
    )
    master = None
    if self.policy.has_master:
      master = self.optimizer_view(
        [
          make(r.shard, r.master_dtype, r.place.offload)
          if r.trainable
          else None
          for r in self.leaves
        ]
      )
    opt = jax.tree.unflatten(
      self.opt_def,
      [make(o.layout, o.aval.dtype, o.place.offload) for o in self.opt_leaves],
    )
    step = make(_layout.LeafLayout(()), jnp.int32, False)
    return ZeroState(
      step=step, params=params, master=master, opt_state=opt, spec=self
    )

  def with_layouts(self, param, shard, opt) -> StateSpec:
    """The same records with other layouts (a checkpoint's saved ones)."""
    return dataclasses.replace(
      self,
      leaves=tuple(
        dataclasses.replace(r, param=p, shard=s)
        for r, p, s in zip(self.leaves, param, shard)
      ),
      opt_leaves=tuple(
        dataclasses.replace(o, layout=l) for o, l in zip(self.opt_leaves, opt)
      ),
    )


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
    key: the root PRNG key (replicated), or ``None``. Each step hands the
      loss ``fold_in(fold_in(fold_in(key, step), device), micro_batch)``.
    model_state: non-trainable model state (batch-norm statistics, NNX
      non-``Param`` variables; replicated), or ``None``.
    spec: static :class:`StateSpec` (stage, mesh, per-leaf layouts).
  """

  step: jax.Array
  params: Any
  master: Any
  opt_state: Any
  spec: StateSpec = dataclasses.field(metadata=dict(static=True))
  key: Any = None
  model_state: Any = None

  def replace(self, **kw) -> ZeroState:
    return dataclasses.replace(self, **kw)


def make_spec(
  params, tx: optax.GradientTransformationExtraArgs, models=None
) -> StateSpec:
  """Plans every leaf's layout from shapes alone (no allocation).

  What :func:`zerojax.init` lays out, before anything is allocated: e.g.
  ``zerojax.layout.make_spec(jax.eval_shape(init_fn, key), tx).leaves`` lists each
  param's stored shape, sharding and dtypes.

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    tx: a :class:`~zerojax.ZeroTransformation`.
    models: each leaf's model spec, when ``params`` are tracers (which
      carry no sharding to read it from); see :func:`model_axes_of`.
  """
  if not isinstance(getattr(tx, "config", None), ZeroConfig):
    raise TypeError(
      f"zerojax: expected the ZeroTransformation returned by zerojax.zero(), "
      f"got {type(tx).__name__}. Wrap your optimizer: "
      f"tx = zerojax.zero(optax.adamw(3e-4), stage=1)."
    )
  paths_leaves, params_def = jax.tree_util.tree_flatten_with_path(params)
  avals, paths = [], []
  for path, x in paths_leaves:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(
        f"zerojax: param leaf {jax.tree_util.keystr(path)} is a "
        f"{type(x).__name__}, not an array. Params must be a pytree of "
        f"arrays (convert Python scalars with jnp.asarray; for an Equinox "
        f"module pass eqx.filter(model, eqx.is_inexact_array))."
      )
    avals.append(jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype)))
    paths.append(jax.tree_util.keystr(path))
  if models is None:
    models = model_axes_of(params, tx)
  config: ZeroConfig = tx.config
  policy = config.policy
  place = Placement(config.mesh, config.axis_name, False)
  leaves = []
  for path, aval, model in zip(paths, avals, models):
    trainable = is_trainable(aval.dtype)
    if trainable:
      policy.check_leaf(path, aval.dtype)
      if config.zeropp.active and jnp.issubdtype(
        aval.dtype, jnp.complexfloating
      ):
        raise ValueError(
          f"zerojax: param leaf {path} is {aval.dtype}, and ZeRO++ "
          f"({config.zeropp}) quantizes real values blockwise; complex leaves "
          f"are not supported there. Drop zeropp= for a model with complex "
          f"weights."
        )
    stacked = _is_stack(config.stacked, path, aval.shape)
    leaves.append(
      LeafSpec(
        path,
        aval,
        trainable,
        stacked,
        tuple(model),
        param=config.plan_param(aval.shape, aval.dtype, stacked, model),
        shard=config.plan(aval.shape, aval.dtype, stacked, model),
        compute_dtype=(
          policy.compute(aval.dtype) if trainable else np.dtype(aval.dtype)
        ),
        master_dtype=policy.master(aval.dtype),
        reduce_dtype=policy.reduce(aval.dtype),
        place=place,
      )
    )
  view = jax.tree.unflatten(
    params_def,
    [
      jax.ShapeDtypeStruct(r.aval.shape, r.master_dtype)
      if r.trainable
      else optax.MaskedNode()
      for r in leaves
    ],
  )
  opt_shape = jax.eval_shape(config.inner.init, view)
  opt_paths_leaves, opt_def = jax.tree_util.tree_flatten_with_path(opt_shape)
  opt_leaves = []
  for p, o in opt_paths_leaves:
    path = jax.tree_util.keystr(p)
    aval = jax.ShapeDtypeStruct(tuple(o.shape), leaf_dtype(o.dtype))
    stacked, model = _param_like(leaves, path, aval.shape)
    opt_leaves.append(
      OptLeafSpec(
        path,
        _field(p),
        aval,
        config.plan(aval.shape, aval.dtype, stacked, model),
        place,
      )
    )
  leaves, opt_leaves = _host_memory.place_in_host_memory(
    leaves, opt_leaves, config.offload_fraction, policy.has_master
  )
  if config.offload_params:
    leaves = _host_memory.params_in_host_memory(leaves)
  return StateSpec(tx, params_def, tuple(leaves), opt_def, tuple(opt_leaves))


def _field(path) -> str:
  """The optimizer's name for a state leaf: the last attribute on its path
  (``mu``, ``nu``, ``count``), not counting NNX Variable nodes (``value``)."""
  names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
  while names and names[-1] == "value" and len(names) > 1:
    names.pop()
  return names[-1] if names else "leaf"


def _param_like(leaves, path: str, shape):
  """``(stacked, model spec)`` for an optimizer leaf: a leaf shaped like its
  param (a moment) shares its layout, so an elementwise update stays local;
  it is matched by path suffix and shape."""
  for r in leaves:
    if path.endswith(r.path) and tuple(r.aval.shape) == tuple(shape):
      return r.stacked, r.model
  return True, ()


def model_axes_of(params, tx: optax.GradientTransformationExtraArgs) -> tuple:
  """Each param leaf's model spec (from ``tx``'s model_specs or the leaf's
  own ``NamedSharding``), in ``jax.tree.leaves`` order. Read it outside a
  ``jit``: a tracer has no sharding to read."""
  return tuple(
    _model_axes.leaf_model_axes(tx.config, _trees.leaf_name(p), x)
    for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
  )


def _is_stack(stacked, path: str, shape) -> bool:
  """Whether a leaf's leading dimension is a layer axis (never sharded)."""
  if stacked is None or stacked is True:
    return True
  if stacked is False:
    return False
  out = stacked(path, tuple(shape))
  if not isinstance(out, (bool, np.bool_)):
    raise TypeError(
      f"zerojax.zero: stacked({path!r}, {tuple(shape)}) returned "
      f"{out!r}; it must return True (a layer stack) or False."
    )
  return bool(out)
