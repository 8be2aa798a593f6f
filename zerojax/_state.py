"""Training state laid out for a ZeRO stage: :class:`ZeroState` and ``init``.

Storage per stage (``L`` = a leaf's :class:`~zerojax._layout.LeafLayout`):

* ``params``: compute dtype; replicated and logical at stages 0-2, sharded
  and padded by ``L`` at stage 3.
* ``master``: the master copy (``policy.master_dtype``) when the policy keeps
  one, else ``None``; replicated at stage 0, sharded by ``L`` at 1-3.
* ``opt_state``: the inner optimizer's state, each leaf laid out by the same
  rule applied to its own shape (so moments share their param's layout and
  Adafactor's factored rows and columns get their own).

Floating and complex parameter leaves are trained (what ``jax.grad`` can
differentiate). Other leaves (integer buffers, masks) are carried but not
trained: the inner optimizer sees ``optax.MaskedNode()`` in their place,
and :func:`init` warns naming them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import _layout, _model_axes
from zerojax._config import HOST_MEMORY, ZeroConfig

if TYPE_CHECKING:
  from zerojax._dropin import ZeroTransformation


def _is_trainable(dtype) -> bool:
  """Floating or complex: the leaves ``jax.grad`` differentiates."""
  return bool(jnp.issubdtype(dtype, jnp.inexact))


def _dtype(dtype):
  """``np.dtype`` of a leaf, or JAX's own dtype object for extended dtypes
  (typed PRNG keys in an optimizer state), which NumPy cannot interpret."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return dtype
  return np.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """Everything zerojax decides about one parameter leaf.

  Attributes:
    path: ``jax.tree_util.keystr`` of the leaf in the params tree.
    aval: logical (unpadded) shape and dtype as given to ``init``.
    trainable: floating and complex leaves are trained; others are carried.
    param: layout of the parameter as stored (sharded at stage 3).
    shard: layout of its master copy, gradient and moments.
    compute_dtype / master_dtype / reduce_dtype: from the policy.
  """

  path: str
  aval: Any
  trainable: bool
  param: _layout.LeafLayout
  shard: _layout.LeafLayout
  compute_dtype: Any
  master_dtype: Any
  reduce_dtype: Any

  @property
  def hooked(self) -> bool:
    """Reaches a stage 2-3 loss as a ShardedParam (gathered by the model)."""
    return self.trainable and self.shard.sharded


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """Static layout of a :class:`ZeroState` (hashable: part of its treedef).

  Per-parameter tuples are in ``jax.tree.leaves(params)`` order.
  """

  tx: ZeroTransformation
  params_def: Any            # PyTreeDef of the params
  params_avals: tuple        # logical jax.ShapeDtypeStruct of each param
  trainable: tuple           # bool per param: inexact leaves are trained
  param_layouts: tuple       # LeafLayout of each param as stored
  shard_layouts: tuple       # LeafLayout of each master / gradient leaf
  opt_def: Any               # PyTreeDef of the inner optimizer state
  opt_avals: tuple           # logical jax.ShapeDtypeStruct per opt leaf
  opt_layouts: tuple         # LeafLayout per opt leaf
  paths: tuple = ()          # keystr of each param leaf

  @functools.cached_property
  def leaves(self) -> tuple:
    """One :class:`LeafSpec` per param leaf, in ``jax.tree.leaves`` order."""
    return tuple(
        LeafSpec(path, a, t, pl, sl, self.compute_dtype(i),
                 self.master_dtype(i), self.reduce_dtype(i))
        for i, (path, a, t, pl, sl) in enumerate(zip(
            self.paths, self.params_avals, self.trainable, self.param_layouts,
            self.shard_layouts)))

  def records(self):
    """The :class:`LeafSpec` records in the params' tree structure."""
    return self.unflatten_params(self.leaves)

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
  def sharding(self, layout, host: bool = False) -> NamedSharding:
    """``layout``'s sharding; ``host=True`` for the master copy and the
    optimizer state, which live in host memory when ``tx.offload``."""
    s = _layout.sharding(self.tx.mesh, layout, self.tx.axis_name)
    if host and self.tx.offload:
      s = s.with_memory_kind(HOST_MEMORY)
    return s

  def fetch(self, x, layout):
    """Master / optimizer leaf ``x`` -> device memory (under ``jit``; a
    no-op without offload). XLA computes only on device-memory operands."""
    if not self.tx.offload:
      return x
    return jax.device_put(x, self.sharding(layout))

  def stash(self, x, layout):
    """Master / optimizer leaf ``x`` -> where the state keeps it (host
    memory with offload)."""
    if not self.tx.offload:
      return x
    return jax.device_put(x, self.sharding(layout, host=True))

  def shardings(self) -> "ZeroState":
    """A :class:`ZeroState` of ``NamedSharding``, for ``out_shardings``."""
    return self._build(lambda layout, dtype, host: self.sharding(layout, host))

  def abstract(self) -> "ZeroState":
    """The state as ``jax.ShapeDtypeStruct`` with shardings; allocates nothing."""
    return self._build(lambda layout, dtype, host: jax.ShapeDtypeStruct(
        layout.storage_shape, dtype, sharding=self.sharding(layout, host)))

  def _build(self, make) -> "ZeroState":
    n = len(self.params_avals)
    params = self.unflatten_params(
        [make(self.param_layouts[i], self.compute_dtype(i), False)
         for i in range(n)])
    master = None
    if self.policy.has_master:
      master = self.optimizer_view(
          [make(self.shard_layouts[i], self.master_dtype(i), True)
           if self.trainable[i] else None for i in range(n)])
    opt = jax.tree.unflatten(self.opt_def, [
        make(l, a.dtype, True) for l, a in zip(self.opt_layouts, self.opt_avals)])
    step = make(_layout.LeafLayout(()), jnp.int32, False)
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

  def replace(self, **kw) -> "ZeroState":
    return dataclasses.replace(self, **kw)


def make_spec(params, tx: ZeroTransformation, models=None) -> StateSpec:
  """Plans every leaf's layout from shapes alone (no allocation).

  ``models``: each leaf's model spec, when ``params`` are tracers (which
  carry no sharding to read it from); see :func:`model_axes_of`."""
  if not isinstance(getattr(tx, "config", None), ZeroConfig):
    raise TypeError(
        f"zerojax: expected the ZeroTransformation returned by zerojax.zero(), "
        f"got {type(tx).__name__}. Wrap your optimizer: "
        f"tx = zerojax.zero(optax.adamw(3e-4), stage=1).")
  paths_leaves, params_def = jax.tree_util.tree_flatten_with_path(params)
  avals, paths = [], []
  for path, x in paths_leaves:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(
          f"zerojax: param leaf {jax.tree_util.keystr(path)} is a "
          f"{type(x).__name__}, not an array. Params must be a pytree of "
          f"arrays (convert Python scalars with jnp.asarray; for an Equinox "
          f"module pass eqx.filter(model, eqx.is_inexact_array)).")
    avals.append(jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype)))
    paths.append(jax.tree_util.keystr(path))
  trainable = tuple(_is_trainable(a.dtype) for a in avals)
  for p, a, t in zip(paths, avals, trainable):
    if t:
      tx.policy.check_leaf(p, a.dtype)
    if t and tx.zeropp.active and jnp.issubdtype(a.dtype, jnp.complexfloating):
      raise ValueError(
          f"zerojax: param leaf {p} is {a.dtype}, and ZeRO++ ({tx.zeropp}) "
          f"quantizes real values blockwise; complex leaves are not "
          f"supported there. Drop zeropp= for a model with complex weights.")
  stacks = tuple(_is_stack(tx.stacked, p, a.shape) for p, a in zip(paths, avals))
  if models is None:
    models = model_axes_of(params, tx)
  param_layouts = tuple(tx.plan_param(a.shape, a.dtype, st, m)
                        for a, st, m in zip(avals, stacks, models))
  shard_layouts = tuple(tx.plan(a.shape, a.dtype, st, m)
                        for a, st, m in zip(avals, stacks, models))
  policy = tx.policy
  view = jax.tree.unflatten(params_def, [
      jax.ShapeDtypeStruct(a.shape, policy.master(a.dtype)) if t
      else optax.MaskedNode() for a, t in zip(avals, trainable)])
  opt_shape = jax.eval_shape(tx.inner.init, view)
  opt_paths = [jax.tree_util.keystr(p) for p, _ in
               jax.tree_util.tree_flatten_with_path(opt_shape)[0]]
  opt_leaves, opt_def = jax.tree.flatten(opt_shape)
  opt_avals = tuple(jax.ShapeDtypeStruct(tuple(o.shape), _dtype(o.dtype))
                    for o in opt_leaves)
  # An optimizer leaf shaped like its param (a moment) shares its layout, so
  # an elementwise update stays local: match it by path suffix and shape.
  by_path = {p: (a.shape, st, m)
             for p, a, st, m in zip(paths, avals, stacks, models)}
  def opt_like(path, shape):
    for p, (pshape, st, m) in by_path.items():
      if path.endswith(p) and tuple(pshape) == tuple(shape):
        return st, m
    return True, ()
  opt_layouts = tuple(tx.plan(o.shape, o.dtype, *opt_like(p, o.shape))
                      for p, o in zip(opt_paths, opt_avals))
  return StateSpec(tx, params_def, tuple(avals), trainable, param_layouts,
                   shard_layouts, opt_def, opt_avals, opt_layouts, tuple(paths))


def model_axes_of(params, tx: ZeroTransformation) -> tuple:
  """Each param leaf's model spec (from ``tx``'s model_specs or the leaf's
  own ``NamedSharding``), in ``jax.tree.leaves`` order. Read it outside a
  ``jit``: a tracer has no sharding to read."""
  return tuple(_model_axes.leaf_model_axes(tx.config,
                                           jax.tree_util.keystr(p), x)
               for p, x in jax.tree_util.tree_flatten_with_path(params)[0])


def _is_stack(stacked, path: str, shape) -> bool:
  """Whether a leaf's leading dimension is a layer axis (never sharded)."""
  if stacked is None or stacked is True:
    return True
  if stacked is False:
    return False
  out = stacked(path, tuple(shape))
  if not isinstance(out, (bool, np.bool_)):
    raise TypeError(f"zerojax.zero: stacked({path!r}, {tuple(shape)}) returned "
                    f"{out!r}; it must return True (a layer stack) or False.")
  return bool(out)


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
  leaves = jax.tree.leaves(stored)
  convert = _layout.convert
  weights = [convert(x, r.shard, r.shard, r.master_dtype) if r.trainable
             else None for x, r in zip(leaves, spec.leaves)]
  opt_state = spec.tx.inner.init(spec.optimizer_view(
      [None if w is None else r.shard.to_logical(w)
       for w, r in zip(weights, spec.leaves)]))
  opt_leaves = jax.tree.leaves(opt_state)
  if len(opt_leaves) != len(spec.opt_layouts):
    raise RuntimeError("zerojax: optimizer state changed structure between "
                       "planning and init.")
  master = None
  if spec.policy.has_master:
    master = spec.optimizer_view(weights)
  return ZeroState(
      step=jnp.zeros((), jnp.int32),
      params=spec.unflatten_params(
          [convert(x, r.shard, r.param, r.compute_dtype)
           for x, r in zip(leaves, spec.leaves)]),
      master=master,
      opt_state=jax.tree.unflatten(
          spec.opt_def, [l.to_storage(x) for x, l in zip(opt_leaves, spec.opt_layouts)]),
      spec=spec)


@functools.lru_cache(maxsize=8)
def _fresh_copy(sharding):
  return jax.jit(lambda x: jnp.copy(x), out_shardings=sharding)


def _replicated(tree, spec: StateSpec):
  """Host or device values, the same on every process -> replicated arrays."""
  rep = NamedSharding(spec.tx.mesh, P())

  def put(x):
    if jax.process_count() == 1:
      # A fresh buffer: the train step donates the state, and device_put
      # may alias the caller's array (it does for replicated placement).
      return _fresh_copy(rep)(x)
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
      return jax.random.wrap_key_data(put(jax.random.key_data(x)),
                                      impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, rep, lambda i: host[i])
  return jax.tree.map(put, tree)


def _root_key(key, where: str):
  """A PRNG key from ``key`` (typed key, raw uint32 key or int seed)."""
  if key is None:
    return None
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    return jax.random.key(int(key))
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"{where}: key must be one key, got a key array of "
                       f"shape {key.shape}.")
    return key
  if dtype is not None and np.dtype(dtype) == np.uint32 and key.shape == (2,):
    return key                        # a raw jax.random.PRNGKey
  raise TypeError(
      f"{where}: key={key!r} is not a PRNG key; pass jax.random.key(seed), "
      f"jax.random.PRNGKey(seed) or an int seed.")


def _warn_idle_model_axes(spec: StateSpec, where: str):
  """A model axis no parameter is split over repeats all work along it."""
  used = {a for l in spec.shard_layouts + spec.param_layouts
          for m in l.model for a in m}
  idle = {a: n for a, n in spec.tx.model_axes.items() if n > 1 and a not in used}
  if idle:
    warnings.warn(
        f"{where}: mesh axes {idle} split no parameter (no model spec uses "
        f"them), so every device along them holds and computes the same "
        f"thing. Pass the model's shardings: zerojax.zero(..., model_specs="
        f"zerojax.linen.model_specs(variables, rules)) (or nnx.model_specs, "
        f"or a tree of PartitionSpec), or drop the axis from the mesh.",
        stacklevel=3)


def warn_untrained(spec: StateSpec, where: str):
  """Leaves zerojax carries but does not train are said, not only listed."""
  frozen = [(r.path, _dtype(r.aval.dtype)) for r in spec.leaves
            if not r.trainable]
  if not frozen:
    return
  names = ", ".join(f"params{p} ({d})" for p, d in frozen[:4])
  more = f" and {len(frozen) - 4} more" if len(frozen) > 4 else ""
  warnings.warn(
      f"{where}: {names}{more} are neither floating nor complex, so they are "
      f"carried unchanged and not trained (jax.grad cannot differentiate "
      f"them, so Optax would not train them either). Pass such buffers as "
      f"model_state (or drop them from the params) to silence this.",
      stacklevel=3)


def _with_extras(state: ZeroState, key, model_state, where: str) -> ZeroState:
  warn_untrained(state.spec, where)
  _warn_idle_model_axes(state.spec, where)
  key = _root_key(key, where)
  if model_state is not None:
    for path, x in jax.tree_util.tree_flatten_with_path(model_state)[0]:
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{where}: model_state leaf {jax.tree_util.keystr(path)} is a "
            f"{type(x).__name__}, not an array.")
  extras = _replicated({"key": key, "model_state": model_state}, state.spec)
  return state.replace(**extras)


def _reject_non_params(params, where: str):
  """Module objects and functions are not a params tree: say what to pass."""
  try:
    from flax import nnx
    if isinstance(params, nnx.Module):
      raise TypeError(
          f"{where}: got an nnx.Module ({type(params).__name__}). Pass its "
          f"parameters, and its other variables as model_state: "
          f"graphdef, params, rest = nnx.split(model, nnx.Param, ...); "
          f"zerojax.init(params, tx, model_state=rest).")
  except ImportError:    # pragma: no cover - flax is a dependency
    pass
  leaves = jax.tree.leaves(params)
  if callable(params) and any(not hasattr(x, "shape") for x in leaves):
    raise TypeError(
        f"{where}: got a callable ({type(params).__name__}), not a params "
        f"tree. To build params with a function, sharded as they are "
        f"created, use zerojax.init_from(init_fn, tx, *args); for a module "
        f"object pass its array leaves.")


def init(params, tx: ZeroTransformation, *, key=None,
         model_state=None) -> ZeroState:
  """Lays out params, master weights and optimizer state for ``tx``'s stage.

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

  Returns:
    A :class:`ZeroState` whose arrays are global ``jax.Array`` sharded over
    the mesh's data axis as the stage prescribes. Each device receives only
    its shard of each sharded leaf, never a full copy.

  Example:
    >>> state = zerojax.init(params, zerojax.zero(optax.adamw(1e-3), stage=3))
  """
  _reject_non_params(params, "zerojax.init")
  spec = make_spec(params, tx)
  stored = spec.unflatten_params([
      _place(x, l, spec) for x, l in zip(jax.tree.leaves(params),
                                         spec.shard_layouts)])
  state = _build(stored, spec)
  return _with_extras(state, key, model_state, "zerojax.init")


def _build(stored, spec):
  return _build_jit(spec)(stored)


@functools.lru_cache(maxsize=64)
def _build_jit(spec):
  return jax.jit(lambda p: _build_state(p, spec), out_shardings=spec.shardings())


def init_from(init_fn, tx: ZeroTransformation, *args, key=None,
              model_state=None) -> ZeroState:
  """Builds params with ``init_fn(*args)`` already sharded, then the state.

  Shapes come from ``jax.eval_shape``; then one ``jit`` with sharded
  ``out_shardings`` runs ``init_fn`` and lays out params, master weights and
  optimizer state, so no device ever holds the full parameters (XLA
  partitions the initialisation). Use it for models larger than a device.

  Args:
    init_fn: a function returning the params pytree, e.g.
      ``lambda k: model.init(k, x)["params"]``.
    tx: a :class:`ZeroTransformation`.
    *args: arguments of ``init_fn`` (e.g. a PRNG key).
    key, model_state: as for :func:`init`.

  Example:
    >>> state = zerojax.init_from(lambda k: gpt.init(cfg, k), tx,
    ...                           jax.random.key(0), key=jax.random.key(1))
  """
  if not callable(init_fn):
    raise TypeError(f"zerojax.init_from: init_fn must be callable, got "
                    f"{type(init_fn).__name__}; for a params tree use "
                    f"zerojax.init(params, tx).")
  spec = make_spec(jax.eval_shape(init_fn, *args), tx)
  stored = [None] * len(spec.leaves)
  for group in _init_groups(spec):
    # One jit per group of leaves: XLA drops the other leaves' work (their
    # random number generation), so the initialiser's temporaries -- about
    # twice the shard it produces, on CPU -- exist for one group at a time,
    # never for the whole model at once.
    def build_group(*a, group=group):
      leaves = jax.tree.leaves(init_fn(*a))
      return [spec.shard_layouts[i].to_storage(leaves[i]) for i in group]
    out = jax.jit(build_group, out_shardings=[
        spec.sharding(spec.shard_layouts[i]) for i in group])(*args)
    for i, x in zip(group, out):
      stored[i] = x
  # the shards are ours: donated, so the state's params (or master) reuse
  # their buffers where the layouts agree, instead of a second copy
  with warnings.catch_warnings():
    # where no state leaf has a shard's shape and dtype (e.g. bf16 params,
    # or a master in host memory) the donation simply frees it
    warnings.filterwarnings("ignore", message="Some donated buffers")
    state = _build_donating(spec)(spec.unflatten_params(stored))
  return _with_extras(state, key, model_state, "zerojax.init_from")


def _init_groups(spec: StateSpec, parts: int = 8) -> list[list[int]]:
  """Consecutive param leaves in groups of at most ``1/parts`` of the
  bytes (a larger leaf alone). Any two neighbouring groups together exceed
  the budget, so there are fewer than ``2 * parts + 1`` groups: that many
  small jits of ``init_fn``, each traced anew."""
  sizes = [int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
           for a in spec.params_avals]
  budget = max(sum(sizes) / parts, 1)
  groups, current, held = [], [], 0
  for i, size in enumerate(sizes):
    if current and held + size > budget:
      groups.append(current)
      current, held = [], 0
    current.append(i)
    held += size
  if current:
    groups.append(current)
  return groups


@functools.lru_cache(maxsize=64)
def _build_donating(spec):
  return jax.jit(lambda p: _build_state(p, spec), out_shardings=spec.shardings(),
                 donate_argnums=0)


def _gather(state: ZeroState, use_master: bool):
  spec = state.spec
  master = (spec.from_optimizer_view(state.master)
            if use_master and state.master is not None
            else [None] * len(spec.leaves))
  return spec.unflatten_params([
      r.shard.to_logical(spec.fetch(m, r.shard)) if m is not None
      else r.param.to_logical(p)
      for p, m, r in zip(jax.tree.leaves(state.params), master, spec.leaves)])


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
  return _gather_replicated(state.replace(key=None, model_state=None),
                            bool(master))


@functools.partial(jax.jit, static_argnums=1)
def _gather_replicated(state: ZeroState, use_master: bool):
  """Compiled once per state layout (the spec is part of the treedef)."""
  spec = state.spec
  return spec.unflatten_params([
      jax.lax.with_sharding_constraint(x, spec.sharding(_full(r.param)))
      for x, r in zip(jax.tree.leaves(_gather(state, use_master)),
                      spec.leaves)])


def gather_leaf(state: ZeroState, index: int, *, master: bool = False):
  """Param leaf ``index`` (``jax.tree.leaves`` order) full and unpadded,
  replicated; the rest of the state is not touched (export, inspection)."""
  spec = state.spec
  r = spec.leaves[index]
  m = spec.from_optimizer_view(state.master)[index] if (
      master and state.master is not None) else None
  if m is not None:
    return _gather_one(m, r.shard, spec, True)
  return _gather_one(jax.tree.leaves(state.params)[index], r.param, spec, False)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _gather_one(x, layout, spec, is_master):
  if is_master:
    x = spec.fetch(x, layout)
  return jax.lax.with_sharding_constraint(layout.to_logical(x),
                                          spec.sharding(_full(layout)))


def _full(layout):
  """``layout`` gathered over the data axis: the model axes kept."""
  return _layout.replicated(layout.shape, layout.model, reason="gathered")


def gather_opt_state(state: ZeroState):
  """The inner optimizer's state, full and unpadded (replicated): what
  unsharded Optax would hold, e.g. to inspect moments or compare runs."""
  if not isinstance(state, ZeroState):
    raise TypeError(f"zerojax.gather_opt_state: expected a ZeroState, got "
                    f"{type(state).__name__}.")
  return _gather_opt_jit(state.replace(key=None, model_state=None))


@jax.jit
def _gather_opt_jit(state: ZeroState):
  spec = state.spec
  return jax.tree.unflatten(spec.opt_def, [
      jax.lax.with_sharding_constraint(l.to_logical(spec.fetch(x, l)),
                                       spec.sharding(_full(l)))
      for x, l in zip(jax.tree.leaves(state.opt_state), spec.opt_layouts)])
