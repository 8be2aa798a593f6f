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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.records.mesh import compute_mesh, in_caller_types
from zerojax._src.records.spec import StateSpec, ZeroState
from zerojax._src.records.trees import check_grads_tree
from zerojax._src.step import leaf_ops as _ops
from zerojax._src.step import offload as _offload
from zerojax._src.step import offload_run as _offload_run
from zerojax._src.step import state as _state

# At stages 1-3 the update begins once every gradient exists. Left free, a
# scheduler may update the leaves whose gradients are ready while the
# backward pass still holds its activations, and the two working sets add
# up (the TPU compiler's programs did; docs/design.md, "Every gradient
# before the update"). Stage 0 stays the plain data-parallel program.
_GRADS_BEFORE_UPDATE = True


def after_every_gradient(spec: StateSpec, grads):
  """``grads`` behind one ``optimization_barrier`` at stages 1-3, so no
  leaf's update is scheduled before the last gradient exists."""
  if _GRADS_BEFORE_UPDATE and spec.stage >= 1:
    return jax.lax.optimization_barrier(grads)
  return grads


def _check_opt(spec: StateSpec, opt_storage):
  leaves = jax.tree.leaves(opt_storage)
  if len(leaves) != len(spec.opt_leaves):
    raise ValueError(
      f"zerojax: the optimizer state has {len(leaves)} leaves; this "
      f"optimizer's state for these params has {len(spec.opt_leaves)}. "
      f"Pass the state that tx.init (or zerojax.init) returned."
    )
  return leaves


def run_update(
  spec: StateSpec,
  g_view,
  w_src,
  opt_storage,
  extra_args,
  *,
  finish,
  opt_def=None,
  bases=None,
  g_rows=None,
  g_src=None,
  seen=None,
):
  """The inner Optax update, then ``finish(i, w, u)`` per trained param.

  The inner optimizer sees logical, sharded views of the gradients, the
  weights (loaded from ``w_src``) and its own state, all at once; with
  offload the update is streamed through device memory chunk by chunk
  when that is exact (:mod:`zerojax._src.step.offload`).

  Args:
    g_view: per-param logical gradients (None for frozen leaves).
    w_src: per-param :class:`~zerojax._src.step.leaf_ops.WeightSource`
      (None for frozen).
    opt_storage: the inner state as stored.
    finish: ``finish(i, w, u)`` -> param ``i``'s results from its weights
      and update.
    opt_def: the tree structure to hand the inner state in (default the
      spec's).
    bases: ``bases(i)`` -> the stored values ``finish(i, ...)``'s results
      replace, where a streamed update writes a layer stack by rows
      (:func:`~zerojax._src.step.offload_run.stream`).
    g_rows: per param, ``rows(span)`` -> those rows of its gradient view
      (:func:`~zerojax._src.step.leaf_ops.grad_rows`), which a streamed
      update reads a layer stack's gradient by; None: sliced from
      ``g_view``.
    g_src: the gradients in host memory (``offload_grads``), per param a
      :class:`~zerojax._src.step.leaf_ops.WeightSource`, in place of
      ``g_view``: the update is streamed, each chunk loading its own, or
      refused with the reason; ``seen`` is called with each gradient a
      chunk loads (:func:`~zerojax._src.step.offload_run.stream`).

  Returns:
    ``(per-param finish results (None for frozen), new state leaves in
    storage layout)``.
  """
  leaves = _check_opt(spec, opt_storage)
  extra_args = {
    k: in_caller_types(spec.tx.mesh, v) if callable(v) else v
    for k, v in extra_args.items()
  }
  if spec.place.offload:
    g_avals = (
      [None if g is None else _offload.aval_of(g) for g in g_view]
      if g_src is None
      else [None if s is None else s.aval for s in g_src]
    )
    p, reason = _offload.plan(
      spec,
      g_avals,
      [None if s is None else s.aval for s in w_src],
      jax.tree.map(
        lambda x: _offload.aval_of(x) if hasattr(x, "dtype") else x, extra_args
      ),
      opt_def,
      grads_host=g_src is not None,
    )
    if p is None and g_src is not None:
      raise ValueError(
        f"zerojax: offload_grads=True, but this optimizer's update cannot "
        f"be streamed with each chunk's own gradients: {reason}. An update "
        f"may read values made from every leaf's gradient where they are "
        f"small and made from the gradients alone, in a branch or not (a "
        f"global norm, a finiteness: optax.clip_by_global_norm and "
        f"optax.apply_if_finite stream), not through a loop over the whole "
        f"state, nor made from the state too (a clip of the gradients "
        f"optax.MultiSteps accumulates). Clip per leaf (optax.clip, "
        f"optax.clip_by_block_rms), or use offload_grads=False."
      )
    if p is not None:
      return _offload_run.stream(
        spec,
        p,
        g_view,
        w_src,
        leaves,
        extra_args,
        finish=finish,
        opt_def=opt_def,
        bases=bases,
        g_rows=g_rows,
        g_src=g_src,
        seen=seen,
      )
  opt_def = spec.opt_def if opt_def is None else opt_def
  opt_logical = jax.tree.unflatten(
    opt_def, [_ops.opt_logical(o, x) for x, o in zip(leaves, spec.opt_leaves)]
  )
  w_view = [None if s is None else s.load(s.raw) for s in w_src]
  g_tree, w_tree = spec.optimizer_view(g_view), spec.optimizer_view(w_view)
  updates, new_opt = _ops.inner_update(
    spec, g_tree, opt_logical, w_tree, extra_args
  )
  new_leaves = jax.tree.leaves(new_opt)
  if len(new_leaves) != len(spec.opt_leaves):
    raise ValueError(
      "zerojax: the inner optimizer's update returned a state with "
      f"{len(new_leaves)} leaves, its init {len(spec.opt_leaves)}."
    )
  new_leaves = [
    _ops.opt_storage(o, x) for x, o in zip(new_leaves, spec.opt_leaves)
  ]
  updates = spec.from_optimizer_view(updates)
  return [
    None if s is None else finish(i, w_view[i], updates[i])
    for i, s in enumerate(w_src)
  ], new_leaves


class _Static:
  """A non-array extra argument, passed to ``jit`` as static: compared by
  value when hashable, else by identity."""

  def __init__(self, value):
    self.value = value
    try:
      self._key = ("value", hash(value), value)
    except TypeError:
      self._key = ("id", id(value))

  def __hash__(self):
    return hash(self._key[:2])

  def __eq__(self, other):
    return isinstance(other, _Static) and (
      self._key[0] == other._key[0]
      and (
        self.value is other.value
        if self._key[0] == "id"
        else self._key[1:] == other._key[1:]
      )
    )


def _is_array_like(x) -> bool:
  return isinstance(
    x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)
  ) or hasattr(x, "__jax_array__")


def split_extra_args(extra_args: dict):
  """``(arrays, static)``: extra ``update`` arguments whose leaves are all
  arrays or numbers (traced by ``jit``), and the rest (callables such as
  ``optax.contrib.sophia``'s ``obj_fn``, strings) as a hashable tuple for a
  static argument. :func:`join_extra_args` puts them back together."""
  arrays, static = {}, []
  for k, v in extra_args.items():
    if all(_is_array_like(x) for x in jax.tree.leaves(v)):
      arrays[k] = v
    else:
      static.append((k, _Static(v)))
  return arrays, tuple(sorted(static, key=lambda kv: kv[0]))


def join_extra_args(arrays: dict, static: tuple) -> dict:
  return {**arrays, **{k: v.value for k, v in static}}


def update_state(state: ZeroState, grads, extra_args, where: str, factors=None):
  """``state`` after one optimizer update with ``grads`` (per-param list,
  storage or logical; ``None`` for frozen). Returns ``(state, grad_norm)``.
  ``factors``: per param, what its gradient in host memory is still to be
  multiplied by as it is loaded (``None``: nothing; host sums over
  micro-batches, :mod:`zerojax._src.step.accumulate`).

  Four calls: the records give the optimizer's inputs
  (:func:`~zerojax._src.step.leaf_ops.update_inputs`; a complex leaf's gradient conjugated,
  Optax's convention), whose global norm is the step's metric; the inner
  optimizer runs (:func:`run_update`; streamed when offloaded); the new
  weights are laid out as the params are stored
  (:func:`~zerojax._src.step.state.stored_params`: all-gathered at stages
  1-2) and go into the state (:func:`~zerojax._src.step.leaf_ops.after_update`)."""
  spec = state.spec
  g_src, pieces, grad_norm = None, [], None
  if factors is not None and not spec.config.offload_grads:
    raise AssertionError(
      "zerojax internal error: gradient factors without offload_grads"
    )
  if spec.config.offload_grads:
    # the norm sums each gradient as it is loaded (a global norm's pass,
    # or its chunk): a stack updated by rows adds its rows' sums (the
    # last bits may differ from the whole stack's sum; the state's do
    # not)
    g_src = _ops.grad_sources(spec, grads, where, factors)
    w_src = _ops.weight_sources(spec, state)
    g_view = g_rows = [None] * len(grads)
  else:
    g_view, g_rows, w_src = _ops.update_inputs(spec, state, grads, where)
    w_src = _shards_before_update(spec, state, g_view, w_src)
    pieces = [
      (g, r.whole) for g, r in zip(g_view, spec.leaves) if g is not None
    ]
    grad_norm = _global_norm(pieces, spec.place.mesh)
  keep_master = state.master is not None
  stage3 = spec.stage == 3

  def finish(i, w, u):
    # at stage 3 each param is laid out (and stashed) inside its chunk of
    # a streamed update, so no chunk's new params wait for the others
    master, new = _ops.apply_update(spec.leaves[i], w, u, keep_master)
    return master, _state.stage3_param(spec.leaves[i], new) if stage3 else new

  old = jax.tree.leaves(state.params)
  old_masters = spec.masters(state.master)
  done, new_opt = run_update(
    spec,
    g_view,
    w_src,
    state.opt_state,
    extra_args,
    finish=finish,
    g_rows=g_rows,
    g_src=g_src,
    seen=lambda i, span, g: _seen(
      pieces, g, spec.leaves[i].whole and span is None, spec.place.mesh
    ),
    bases=lambda i: (
      old_masters[i],
      old[i] if stage3 and spec.leaves[i].place.params_host else None,
    ),
  )
  if g_src is not None:  # the pieces' sums of squares, as they came
    grad_norm = _norm_of(pieces)
  done = [(None, None) if d is None else d for d in done]
  if stage3:
    params = [o if w is None else w for o, (_, w) in zip(old, done)]
  else:
    params = _state.stored_params(spec, [w for _, w in done], old)
  return _ops.after_update(
    spec, state, [m for m, _ in done], params, new_opt
  ), grad_norm


def _seen(squares: list, g, whole: bool, mesh):
  """Appends a loaded gradient's sum of squares and returns it: the
  stream's next loads wait for it, so the gradient is not kept on the
  device for the step's norm."""
  squares.append(_square_sum(g, whole, mesh))
  return squares[-1]


def _shards_before_update(spec: StateSpec, state: ZeroState, g_view, w_src):
  """At stages 1-2 without a master copy the weights the update reads are
  slices of the replicated params, and the new params are all-gathered
  into the same (donated) buffers. Left to the scheduler, a slice may be
  read after the gather began, and XLA then keeps a whole copy of every
  old param (the TPU compiler's programs hold one full-size buffer per
  large param without this). Every weight's shard is sliced out first,
  behind one barrier with the gradients, so the old params are dead
  before the first new one lands (docs/design.md, "Every gradient before
  the update"). A master copy or an offloaded state is a shard already,
  and on a data axis of one device nothing is sliced: unchanged."""
  if not (
    _GRADS_BEFORE_UPDATE
    and spec.stage in (1, 2)
    and state.master is None
    and not spec.place.offload
    and spec.config.num_shards > 1
  ):
    return w_src
  loaded = [None if s is None else s.load(s.raw) for s in w_src]
  _, loaded = jax.lax.optimization_barrier((g_view, loaded))
  return [
    None if x is None else _ops.WeightSource(x, _identity) for x in loaded
  ]


def _identity(x):
  return x


NORM_BLOCKS = 16  # most blocks a whole gradient's norm is summed in


def _split_over_devices(g, mesh):
  """``g`` (replicated on every device of ``mesh``) constrained to split
  over all of them along its first dimension they divide: each device then
  reads only its slice, and XLA sums the slices' partial sums with a
  scalar all-reduce. ``None`` when no dimension divides (or one device)."""
  n = mesh.size
  dims = [d for d in range(g.ndim) if n > 1 and g.shape[d] % n == 0]
  if not dims:
    return None
  names = tuple(mesh.axis_names)
  spec = P(*([None] * dims[0] + [names[0] if len(names) == 1 else names]))
  return jax.lax.with_sharding_constraint(
    g, NamedSharding(compute_mesh(mesh), spec)
  )


def _global_norm(grads, mesh):
  """The gradients' global L2 norm; ``grads``: ``(gradient, whole)`` pairs
  (:func:`_square_sum` each, then :func:`_norm_of`)."""
  return _norm_of([_square_sum(g, w, mesh) for g, w in grads])


def _square_sum(g, whole: bool, mesh):
  """One gradient's sum of squares, in at least fp32 (real).

  A whole gradient (replicated over every mesh axis: stage 0, small
  leaves) must not be squared into a temporary of its size: ``sum(g **
  2)`` materialises ``g ** 2`` where the backend does not fuse the square
  into its reduction (XLA CPU at ``tests/conftest.py``'s flags, where it
  shares the square with the optimizer's second moment). In its sum's
  dtype (fp32: real, not cast) it goes behind an ``optimization_barrier``
  (XLA cannot share the barrier's output's square with the optimizer's:
  common-subexpression elimination), and each device then squares and
  sums only its slice of it (:func:`_split_over_devices`): 1/N of the
  reads of a replicated sum, the square fused into the reduction, no
  temporary. Otherwise (a bf16 leaf summed in fp32, complex) it is summed
  on every device in at most :data:`NORM_BLOCKS` blocks of leading rows (a
  stack's layers), so only one block is cast and squared at a time. A
  sharded gradient is summed at once: its square is a shard's, and a
  reshape or blocks over a sharded dimension would add collectives."""

  dt = jnp.promote_types(jnp.finfo(g.dtype).dtype, jnp.float32)  # real

  def sq(x):
    return jnp.sum(jnp.square(x.astype(dt)))

  if whole and g.dtype == dt:
    g = jax.lax.optimization_barrier(g)
    split = _split_over_devices(g, mesh)
    return sq(g if split is None else split)
  g = jnp.abs(g) if jnp.iscomplexobj(g) else g
  rows = g.shape[0] if g.ndim >= 2 else 1
  if not whole or rows == 1:
    return sq(g)
  n = min(rows, NORM_BLOCKS)
  per = rows // n
  total = jax.lax.fori_loop(
    0,
    n,
    lambda i, acc: acc + sq(jax.lax.dynamic_slice_in_dim(g, i * per, per)),
    jnp.zeros((), dt),
  )
  if n * per < rows:  # rows left after whole blocks
    total = total + sq(jax.lax.slice_in_dim(g, n * per, rows))
  return total


def _norm_of(squares):
  """The global norm from each piece's sum of squares, in their order."""
  dt = functools.reduce(
    jnp.promote_types, (s.dtype for s in squares), jnp.dtype(jnp.float32)
  )
  return jnp.sqrt(sum((s.astype(dt) for s in squares), jnp.zeros((), dt)))


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
    raise TypeError(
      f"zerojax.apply_gradients: expected a ZeroState, got "
      f"{type(state).__name__}."
    )
  flat = jax.tree.leaves(grads)
  check_grads_tree(grads, state.spec.params_def, "zerojax.apply_gradients")
  for g, r in zip(flat, state.spec.leaves):
    if r.trainable:
      _check_shape(state.spec, g, r)
  arrays, static = split_extra_args(extra_args)
  _state.reject_deleted(state, "zerojax.apply_gradients")
  _state.reject_deleted(grads, "zerojax.apply_gradients", "grads")
  return _apply_jit(state, grads, arrays, static)


def _check_shape(spec, g, r):
  shape = tuple(np.shape(g))
  if shape not in (tuple(r.aval.shape), tuple(r.shard.storage_shape)):
    raise ValueError(
      f"zerojax.apply_gradients: gradient{r.path} has shape {list(shape)}; "
      f"the param is {list(r.aval.shape)} (stored as "
      f"{list(r.shard.storage_shape)} at stage {spec.stage})."
    )


@functools.partial(jax.jit, static_argnums=3)
def _apply_jit(state, grads, arrays, static):
  spec = state.spec
  flat = [
    g if r.trainable else None
    for g, r in zip(jax.tree.leaves(grads), spec.leaves)
  ]

  def body(state, flat, arrays):
    new, _ = update_state(
      state,
      after_every_gradient(spec, flat),
      join_extra_args(arrays, static),
      "zerojax.apply_gradients",
    )
    return new

  return spec.region(body, spec.shardings_like(state))(state, flat, arrays)
