"""``ZeroTransformation`` as a plain Optax transformation: the drop-in path.

An existing loop keeps its shape::

    tx = zerojax.zero(optax.adamw(1e-3), stage=1)   # the only changed line
    opt_state = tx.init(params)
    @jax.jit
    def step(params, opt_state, batch):
      grads = jax.grad(loss)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

``init`` returns the inner optimizer's state with every leaf in its stage
layout (sharded over the data axis, padded where a dimension does not
divide it). ``update`` runs the inner optimizer on logical views of global
arrays (the same code as :func:`zerojax.train_step`'s update, so the result
is unsharded Optax's) and returns replicated updates in the params' layout.

What it costs against :func:`zerojax.train_step`: the loop's own
``jax.grad`` leaves the gradient reduction to GSPMD (an all-reduce of the
full gradient on CPU, where the train step reduce-scatters), and the
updates come back replicated (an all-gather of the update, where the train
step gathers the new params). ZeRO++'s qgZ (``zeropp=ZeroPP(grad_bits=...)``
at stages 1-2) is the gradient reduction's, so it needs the gradients of
:func:`zerojax.value_and_grad` (reduce-scattered, quantized, in the stage's
layout); gradients from ``jax.grad`` arrive already reduced in full
precision and are used as they are. The optimizer state is sharded exactly as at
the stage. Stage 3 (sharded params) and a master-weight policy need the
state zerojax owns: :func:`zerojax.init` + :func:`zerojax.train_step`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.records import warn as _warn
from zerojax._src.records.config import ZeroConfig
from zerojax._src.records.mesh import explicit_names, named
from zerojax._src.records.spec import StateSpec, gathered, make_spec
from zerojax._src.records.trees import check_grads_tree, path_difference
from zerojax._src.step import update as _update
from zerojax._src.step.deleted import reject_deleted
from zerojax._src.step.extras import warn_untrained
from zerojax._src.step.leaf_ops import WeightSource, grad_view


def _check_config(config, where: str):
  if config.stage == 3:
    raise ValueError(
      f"{where}: at stage 3 zerojax stores the parameters sharded, but in "
      f"an Optax loop you hold them full. Use stage 1 or 2 as a drop-in, "
      f"or zerojax.init + zerojax.train_step for stage 3."
    )
  if config.policy.has_master:
    raise ValueError(
      f"{where}: the policy keeps a {config.policy.master_dtype} master "
      f"copy, but in an Optax loop the params you hold are the weights the "
      f"optimizer updates. Drop the policy (cast params yourself), or use "
      f"zerojax.init + zerojax.train_step for bf16 params with an fp32 "
      f"master."
    )
  explicit = set(explicit_names(config.mesh))
  untyped = {
    a: s for a, s in config.model_axes.items() if s > 1 and a not in explicit
  }
  if config.model_specs is None and untyped:
    raise ValueError(
      f"{where}: the mesh has model axes {untyped} but zero() got no "
      f"model_specs; inside jit the params' shardings over Auto axes are "
      f"not part of their types, so the drop-in cannot read them. Pass "
      f"zerojax.zero(..., model_specs=...) (a tree of PartitionSpec, e.g. "
      f"zerojax.linen.model_specs(variables, rules) or "
      f"zerojax.nnx.model_specs(nnx.state(model, nnx.Param))), or make the "
      f"model axes Explicit (jax.make_mesh's default)."
    )


def _spec(config, params, where: str) -> StateSpec:
  _check_config(config, where)
  if params is None:
    raise ValueError(
      f"{where}: zerojax needs params in update "
      f"(tx.update(grads, opt_state, params)) to know each "
      f"leaf's layout."
    )
  return make_spec(params, from_config(config))


def init(config, params):
  """The inner optimizer's state for ``params``, sharded for the stage."""
  reject_deleted(params, "ZeroTransformation.init", "params")
  spec = _spec(config, params, "ZeroTransformation.init")
  leaves = jax.tree.leaves(params)
  if not any(isinstance(x, jax.core.Tracer) for x in leaves):
    warn_untrained(spec, "ZeroTransformation.init")
    _warn_off_mesh(spec, leaves)
  shardings = [
    o.place.sharding(o.layout, host=o.place.offload) for o in spec.opt_leaves
  ]

  def build(leaves):
    leaves = _hold(spec, leaves)
    view = spec.optimizer_view(
      [x if r.trainable else None for x, r in zip(leaves, spec.leaves)]
    )
    state = spec.tx.inner.init(view)
    return [
      o.layout.to_storage(x)
      for x, o in zip(jax.tree.leaves(state), spec.opt_leaves)
    ]

  stored = jax.jit(spec.region(build, shardings), out_shardings=shardings)(
    leaves
  )
  return jax.tree.unflatten(spec.opt_def, stored)


def _hold(spec: StateSpec, p_leaves):
  """The caller's params pinned where a drop-in loop holds them: replicated
  over the data axis, sharded over model axes as the model says. (Left
  free under an outer ``jit``, XLA may pick an input layout for them that
  JAX cannot express, e.g. a (2,) leaf tiled 2 x 4 over 8 devices.)"""
  return [
    r.place.constrain(p, gathered(r.param))
    for p, r in zip(p_leaves, spec.leaves)
  ]


def _warn_off_mesh(spec: StateSpec, leaves):
  """Params not on the mesh come back from the first step on it, so a
  user's jitted step compiles a second time: say how to place them."""
  mesh_devices = set(spec.tx.mesh.devices.flat)
  off = [
    r.path
    for x, r in zip(leaves, spec.leaves)
    if not (
      isinstance(x, jax.Array)
      and x.committed
      and set(x.sharding.device_set) == mesh_devices
    )
  ]
  if off and len(mesh_devices) > 1:
    what = (
      (
        f"params{off[0]}"
        + (f" and {len(off) - 1} more leaves" if len(off) > 1 else "")
      )
      if off[0]
      else ("the params")
    )
    verb = "is" if len(off) == 1 and off[0] else "are"
    _warn.warn(
      f"ZeroTransformation.init: {what} "
      f"{verb} not placed on the mesh's {len(mesh_devices)} devices, so the "
      f"first update returns them there and a jitted step compiles a "
      f"second time. Create the params under jax.set_mesh(tx.mesh), or "
      f"place them first: params = jax.device_put(params, "
      f"jax.sharding.NamedSharding(tx.mesh, jax.sharding.PartitionSpec())).",
    )


def update(config, grads, state, params, **extra_args):
  """Optax ``update``: replicated updates in the params' structure.

  Jitted (once per configuration and shapes), so it also works in a loop
  that is not: the sharding constraints need a ``jit`` around them. Extra
  arguments that are arrays are traced; any others (callables, strings,
  Python numbers) reach the inner optimizer as they are."""
  _check_config(config, "ZeroTransformation.update")  # cheap, eager
  for tree, what in (
    (state, "opt_state"),
    (params, "params"),
    (grads, "grads"),
  ):  # before the jitted call
    reject_deleted(tree, "ZeroTransformation.update", what)
  if params is None:
    _spec(config, params, "ZeroTransformation.update")  # raises the fix
  # Called eagerly with uncommitted gradients (jax.grad outside jit), let
  # them be replicated, as they are: left free, XLA may pick an input
  # layout JAX cannot express. Traced or committed values are left alone
  # (a gradient sharded by zerojax.value_and_grad stays sharded).
  commit = lambda x: (
    x
    if isinstance(x, jax.core.Tracer)
    or (isinstance(x, jax.Array) and x.committed)
    else jax.device_put(x, named(config.mesh, P(), np.ndim(x)))
  )
  grads = jax.tree.map(commit, grads)
  arrays, static = _update.split_extra_args(extra_args)
  return _update_jitted(config, static)(grads, state, params, arrays)


@functools.lru_cache(maxsize=32)
def _update_jitted(config, static):
  return jax.jit(functools.partial(_update_body, config, static))


def _update_body(config, static, grads, state, params, arrays):
  where = "ZeroTransformation.update"
  spec = _spec(config, params, where)
  g_leaves, g_def = jax.tree.flatten(grads)
  p_leaves, p_def = jax.tree.flatten(params)
  check_grads_tree(grads, p_def, where)
  diff = path_difference(state, spec.opt_def)
  if diff is not None:
    raise ValueError(
      f"{where}: the optimizer state is not the one tx.init builds for "
      f"these params: opt_state{diff[0]} stands where tx.init(params) "
      f"has opt_state{diff[1]}. Pass the state that tx.init returned for "
      f"params of this tree."
    )
  for x, o in zip(jax.tree.leaves(state), spec.opt_leaves):
    if tuple(np.shape(x)) != tuple(o.layout.storage_shape):
      raise ValueError(
        f"{where}: opt_state{o.path} has shape {list(np.shape(x))}; for "
        f"these params tx.init stores it as {list(o.layout.storage_shape)} "
        f"(logical {list(o.aval.shape)}). Pass the state that tx.init "
        f"returned for these params."
      )
  # (frozen leaves' gradients -- float0 -- never enter the region)
  g_leaves = [g if r.trainable else None for g, r in zip(g_leaves, spec.leaves)]
  outs = (
    [_typed_like(p, r) for p, r in zip(p_leaves, spec.leaves)],
    [o.place.sharding(o.layout, host=o.place.offload) for o in spec.opt_leaves],
  )
  updates, new_opt = spec.region(
    functools.partial(_update_region, spec, static), outs
  )(g_leaves, jax.tree.leaves(state), p_leaves, arrays)
  return (
    jax.tree.unflatten(g_def, updates),
    jax.tree.unflatten(jax.tree.structure(state), new_opt),
  )


def _typed_like(p, r):
  """The update of param ``p``: typed as ``p`` is when ``p`` carries a type
  on the transformation's mesh (an Explicit mesh), else the param's layout."""
  mesh = r.place.mesh
  s = getattr(jax.typeof(p), "sharding", None)
  if (
    isinstance(s, NamedSharding)
    and not s.mesh.empty
    and s.mesh == mesh.abstract_mesh
  ):
    return NamedSharding(mesh, s.spec)
  return r.place.sharding(gathered(r.param))


def _update_region(spec, static, g_leaves, state, p_leaves, arrays):
  """The update on the caller's params (logical, replicated) and the
  state's leaves, inside the region: per-param updates and new leaves."""
  where = "ZeroTransformation.update"
  # The params are the caller's, replicated over the data axis: pin them
  # so, then view them sharded. Gradients in the params' shape are pinned
  # the same way where their storage differs (padding); in any other shape
  # they are the stage's storage, already sharded.
  p_leaves = _hold(spec, p_leaves)
  g_view, w_src = [], []
  for g, p, r in zip(g_leaves, p_leaves, spec.leaves):
    if not r.trainable:
      g_view.append(None)
      w_src.append(None)
      continue
    if (
      tuple(np.shape(g)) == tuple(r.aval.shape)
      and r.aval.shape != r.shard.storage_shape
    ):
      g = r.place.constrain(g, gathered(r.param))
    g_view.append(grad_view(r, g, spec.stage, where))
    w_src.append(
      WeightSource(
        p, functools.partial(lambda x, r: r.place.constrain(x, r.shard), r=r)
      )
    )
  updates, new_opt = _update.run_update(
    spec,
    g_view,
    w_src,
    state,
    _update.join_extra_args(arrays, static),
    finish=lambda i, w, u: u,
  )
  out = [
    jnp.zeros_like(p)
    if u is None
    else spec.leaves[i].place.constrain(u, gathered(spec.leaves[i].param))
    for i, (u, p) in enumerate(zip(updates, p_leaves))
  ]
  return out, new_opt


@dataclasses.dataclass(frozen=True)
class _Init:
  config: ZeroConfig

  def __call__(self, params):
    return init(self.config, params)


@dataclasses.dataclass(frozen=True)
class _Update:
  config: ZeroConfig

  def __call__(self, updates, state, params=None, **extra_args):
    return update(self.config, updates, state, params, **extra_args)


class ZeroTransformation(optax.GradientTransformationExtraArgs):
  """An Optax optimizer wrapped for a ZeRO stage: a real Optax transformation.

  Build it with :func:`zerojax.zero`. Two ways to use it:

  * with :func:`zerojax.init` and :func:`zerojax.train_step` (all stages;
    the lean path: reduce-scatter, per-layer gathers, fp32 master);
  * as a drop-in Optax ``GradientTransformationExtraArgs`` in an existing
    loop (stages 0-2): ``tx.init(params)`` returns the inner optimizer's
    state laid out sharded over the data axis (leaves padded where a
    dimension does not divide the axis), and
    ``tx.update(grads, state, params, **extra_args)`` takes replicated
    gradients (e.g. from ``jax.grad``) or gradients in the stage's layout
    (from :func:`zerojax.value_and_grad`) and returns updates in the
    params' (replicated) layout, for ``optax.apply_updates``. Works in
    ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.

  Its fields ``init``/``update`` are Optax's; the configuration is
  :attr:`config`, whose fields and properties read through the
  transformation too (``tx.stage``, ``tx.mesh``, ``tx.num_shards``, ...;
  see :class:`ZeroConfig`).
  """

  __slots__ = ()

  @property
  def config(self) -> ZeroConfig:
    return self.init.config

  def __getattr__(self, name):
    # only reached when normal lookup fails: the config's public attributes
    if (
      not name.startswith("_")
      and hasattr(ZeroConfig, name)
      or (name in _CONFIG_FIELDS)
    ):
      return getattr(self.config, name)
    raise AttributeError(
      f"{type(self).__name__!r} object has no attribute {name!r}"
    )

  def __dir__(self):
    return sorted(
      set(super().__dir__())
      | _CONFIG_FIELDS
      | {n for n in dir(ZeroConfig) if not n.startswith("_")}
    )

  def replace(self, **changes) -> ZeroTransformation:
    """The same transformation with some configuration fields changed."""
    return from_config(dataclasses.replace(self.config, **changes))

  def __repr__(self):
    c = self.config
    extra = ""
    if c.replica_axis:
      extra += f", replica_axis={c.replica_axis!r} ({c.num_replicas})"
    if c.model_axes:
      extra += f", model_axes={c.model_axes}"
    if c.offload:
      extra += f", offload={c.offload!r}"
    if c.zeropp.active:
      extra += f", zeropp={c.zeropp}"
    return (
      f"ZeroTransformation(stage={c.stage}, axis_name={c.axis_name!r}, "
      f"num_shards={c.num_shards}{extra}, policy={c.policy})"
    )


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ZeroConfig))


def from_config(config: ZeroConfig) -> ZeroTransformation:
  return ZeroTransformation(_Init(config), _Update(config))
