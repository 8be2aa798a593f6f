"""The optimizer half of a step: the inner Optax update on global arrays.

The inner optimizer sees logical (unpadded) views of the gradient, the
weights it updates (the master copy, or the params when there is none) and
its own state, each constrained to its shard layout under ``jit``.
Elementwise work stays local to each shard; the few reductions that
non-elementwise optimizers need (global norm, trust ratios, factored
moments) are inserted by XLA as small all-reduces. That is why every Optax
optimizer gives the unsharded result.

Used by :func:`zerojax.train_step`, by :func:`apply_gradients` and by the
drop-in ``ZeroTransformation.update``: one code path for all three.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from zerojax import _gather, _layout
from zerojax._state import StateSpec, ZeroState


def constrain(x, spec: StateSpec, layout: _layout.LeafLayout):
  """``x`` (logical or storage shape) constrained to ``layout``'s sharding."""
  return jax.lax.with_sharding_constraint(x, spec.sharding(layout))


def grad_view(spec: StateSpec, g, r, where: str):
  """One gradient leaf -> its logical view in the master dtype, sharded.

  Accepts the logical shape (e.g. replicated, from ``jax.grad``) or the
  stage's storage shape (from :func:`zerojax.value_and_grad`)."""
  shape = tuple(np.shape(g))
  if shape == tuple(r.aval.shape):
    logical = g
  elif r.shard.sharded and shape == r.shard.storage_shape:
    logical = r.shard.to_logical(g)
  else:
    raise ValueError(
        f"{where}: gradient{r.path} has shape {list(shape)}; the param is "
        f"{list(r.aval.shape)} (stored as {list(r.shard.storage_shape)} at "
        f"stage {spec.stage}). Pass gradients shaped like the params, or as "
        f"returned by zerojax.value_and_grad.")
  return constrain(logical.astype(r.master_dtype), spec, r.shard)


def inner_update(spec: StateSpec, g_view, w_view, opt_storage, extra_args,
                 opt_def=None):
  """Runs the inner optimizer on logical, sharded views.

  Args:
    g_view, w_view: per-param logical gradients and weights (``None`` for
      frozen leaves).
    opt_storage: the inner state's leaves as stored.
    extra_args: keyword arguments for a ``GradientTransformationExtraArgs``.
    opt_def: the tree structure to hand the inner state in (default the
      spec's).

  Returns:
    ``(updates, new_opt_leaves)``: per-param logical updates (``None`` for
    frozen leaves) and the new state's leaves in storage layout.
  """
  opt_def = spec.opt_def if opt_def is None else opt_def
  leaves = jax.tree.leaves(opt_storage)
  if len(leaves) != len(spec.opt_layouts):
    raise ValueError(
        f"zerojax: the optimizer state has {len(leaves)} leaves; this "
        f"optimizer's state for these params has {len(spec.opt_layouts)}. "
        f"Pass the state that tx.init (or zerojax.init) returned.")
  opt_logical = jax.tree.unflatten(opt_def, [
      constrain(l.to_logical(constrain(spec.fetch(x, l), spec, l)), spec, l)
      for x, l in zip(leaves, spec.opt_layouts)])
  g_tree, w_tree = spec.optimizer_view(g_view), spec.optimizer_view(w_view)
  if isinstance(spec.tx.inner, optax.GradientTransformationExtraArgs):
    updates, new_opt = spec.tx.inner.update(g_tree, opt_logical, w_tree,
                                            **extra_args)
  else:
    updates, new_opt = spec.tx.inner.update(g_tree, opt_logical, w_tree)
  new_leaves = jax.tree.leaves(new_opt)
  if len(new_leaves) != len(spec.opt_layouts):
    raise ValueError(
        "zerojax: the inner optimizer's update returned a state with "
        f"{len(new_leaves)} leaves, its init {len(spec.opt_layouts)}.")
  new_leaves = [spec.stash(constrain(l.to_storage(x.astype(a.dtype)), spec, l),
                           l)
                for x, l, a in zip(new_leaves, spec.opt_layouts, spec.opt_avals)]
  return spec.from_optimizer_view(updates), new_leaves


def update_state(state: ZeroState, grads, extra_args, where: str):
  """``state`` after one optimizer update with ``grads`` (per-param list,
  storage or logical; ``None`` for frozen). Returns ``(state, grad_norm)``."""
  spec = state.spec
  params = jax.tree.leaves(state.params)
  master = (spec.from_optimizer_view(state.master) if state.master is not None
            else [None] * len(params))
  g_view, w_view = [], []
  for g, p, m, r in zip(grads, params, master, spec.leaves):
    if not r.trainable:
      g_view.append(None)
      w_view.append(None)
      continue
    g_view.append(grad_view(spec, g, r, where))
    w = (r.shard.to_logical(spec.fetch(m, r.shard)) if m is not None
         else r.param.to_logical(p))
    w_view.append(constrain(w, spec, r.shard))
  updates, new_opt = inner_update(spec, g_view, w_view, state.opt_state,
                                  extra_args)
  new_w = [None if w is None else optax.apply_updates(w, u)
           for w, u in zip(w_view, updates)]
  new_master = None
  if state.master is not None:
    new_master = spec.optimizer_view([
        None if w is None else spec.stash(
            constrain(r.shard.to_storage(w.astype(r.master_dtype)), spec,
                      r.shard), r.shard)
        for w, r in zip(new_w, spec.leaves)])
  new_state = state.replace(
      step=state.step + 1, params=new_params(spec, params, new_w),
      master=new_master, opt_state=jax.tree.unflatten(spec.opt_def, new_opt))
  grad_norm = optax.tree.norm([g for g in g_view if g is not None])
  return new_state, grad_norm


def new_params(spec: StateSpec, params, new_w):
  """Updated weights -> params as stored (stages 1-2: all-gathered back)."""
  tx = spec.tx
  axis, stage = tx.axis_name, tx.stage
  out = list(params)
  gather_idx = []
  for i, (w, r) in enumerate(zip(new_w, spec.leaves)):
    if w is None:
      continue
    w = w.astype(r.compute_dtype)
    if stage == 3:
      out[i] = constrain(r.param.to_storage(w), spec, r.param)
    elif stage >= 1 and r.shard.sharded:
      out[i] = constrain(r.shard.to_storage(w), spec, r.shard)
      gather_idx.append(i)
    else:
      out[i] = constrain(w, spec, r.param)
  if gather_idx:
    # Stages 1-2: all-gather the updated shards, in compute dtype, in an
    # explicit shard_map (left to GSPMD the layout change may take another
    # route).
    layouts = [spec.leaves[i].shard for i in gather_idx]

    def all_gather(shards):
      return [l.to_logical(_gather.over_model_shards(
          lambda x, d=l.dim: jax.lax.all_gather(x, axis, axis=d, tiled=True,
                                                to="invarying"),
          s, l.model, l.dim)) for s, l in zip(shards, layouts)]
    full = jax.shard_map(
        all_gather, mesh=tx.mesh,
        in_specs=([l.manual_spec(axis) for l in layouts],),
        out_specs=[P()] * len(layouts), axis_names={axis})(
            [out[i] for i in gather_idx])
    for i, f in zip(gather_idx, full):
      out[i] = f
  return spec.unflatten_params(out)


def apply_gradients(state: ZeroState, grads, **extra_args) -> ZeroState:
  """The optimizer half of :func:`zerojax.train_step`, usable alone.

  Args:
    state: a :class:`zerojax.ZeroState`.
    grads: gradients with the params' structure, as returned by
      :func:`zerojax.value_and_grad` (the stage's layout) or full and
      replicated (e.g. from ``jax.grad`` at stages 0-2).
    **extra_args: forwarded to the inner optimizer's update when it is an
      ``optax.GradientTransformationExtraArgs`` (e.g. ``value=loss`` for
      ``optax.contrib.reduce_on_plateau``).

  Returns:
    The new state (step + 1). Jitted; the input state is not donated.
  """
  if not isinstance(state, ZeroState):
    raise TypeError(f"zerojax.apply_gradients: expected a ZeroState, got "
                    f"{type(state).__name__}.")
  flat = jax.tree.leaves(grads)
  if len(flat) != len(state.spec.leaves):
    raise ValueError(
        f"zerojax.apply_gradients: grads have {len(flat)} leaves, the params "
        f"{len(state.spec.leaves)}. Pass gradients with the params' structure.")
  for g, r in zip(flat, state.spec.leaves):
    if r.trainable:
      _check_shape(state.spec, g, r)
  return _apply_jit(state, grads, extra_args)


def _check_shape(spec, g, r):
  shape = tuple(np.shape(g))
  if shape not in (tuple(r.aval.shape), tuple(r.shard.storage_shape)):
    raise ValueError(
        f"zerojax.apply_gradients: gradient{r.path} has shape {list(shape)}; "
        f"the param is {list(r.aval.shape)} (stored as "
        f"{list(r.shard.storage_shape)} at stage {spec.stage}).")


@jax.jit
def _apply_jit(state, grads, extra_args):
  spec = state.spec
  flat = [g if r.trainable else None
          for g, r in zip(jax.tree.leaves(grads), spec.leaves)]
  new, _ = update_state(state, flat, extra_args, "zerojax.apply_gradients")
  return new

