"""The jitted, donated train step: gradients in ``shard_map``, update in GSPMD.

Where the collectives live, and why:

* **Gradients** are computed inside ``jax.shard_map`` over the data axis, so
  every parameter-sized collective is written by hand and XLA emits exactly
  it: stage 0 ``psum`` (all-reduce), stage 1 ``psum_scatter`` after the
  local backward (reduce-scatter), stages 2-3 ``psum_scatter`` inside the
  backward pass through :func:`zerojax.gather`, and at stage 3 the forward
  (and rematerialised backward) ``all_gather``. Left to GSPMD, the same
  layouts compile to an all-reduce of the full gradient on CPU, twice the
  bytes of a reduce-scatter.
* Every differentiated value is made device-varying first. Differentiating
  a replicated (invariant) value inside ``shard_map`` makes JAX insert the
  transpose of an implicit broadcast, an all-reduce, which would spoil the
  reduce-scatter of stages 1-3.
* **The optimizer update** runs on global arrays under ``jit``: logical
  (unpadded) views of the sharded gradient, master weights and optimizer
  state. Elementwise work stays local; the few reductions that non-
  elementwise optimizers need (global norm, trust ratios, factored moments)
  are inserted by XLA as small all-reduces. That is why every Optax
  optimizer gives the unsharded result.
* **Stage 1-2 parameters** are all-gathered back, in the compute dtype, by
  an explicit ``all_gather`` in a second ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import _gather
from zerojax._state import StateSpec, ZeroState
from zerojax._transform import ZeroTransformation

GATHER_MODES = ("auto", "model", "all")


class LossOutputError(ValueError):
  """``loss_fn`` returned something other than a scalar or (scalar, aux)."""


# --------------------------------------------------------------------------
# input checks (all before tracing, so a failed step loses nothing)
# --------------------------------------------------------------------------
def check_state(state, tx: ZeroTransformation) -> StateSpec:
  if not isinstance(state, ZeroState):
    raise TypeError(f"zerojax train step: expected a ZeroState from "
                    f"zerojax.init, got {type(state).__name__}.")
  spec = state.spec
  have = spec.tx
  if have != tx:
    diffs = [f"{f}: state has {getattr(have, f)!r}, step has "
             f"{getattr(tx, f)!r}"
             for f in ("stage", "axis_name", "policy", "min_shard_size")
             if getattr(have, f) != getattr(tx, f)]
    if have.mesh != tx.mesh:
      diffs.append("mesh: the state lives on a different mesh")
    if have.inner is not tx.inner:
      diffs.append("inner optimizer: a different optax transformation")
    raise ValueError(
        "zerojax train step: this state was laid out by another "
        "ZeroTransformation (" + "; ".join(diffs) + "). Build the step with "
        "the tx that built the state (zerojax.init(params, tx); "
        "zerojax.train_step(loss_fn, tx)). To move a state to another stage, "
        "re-init from zerojax.gather_params(state).")
  # The arrays must still match the spec (a user may have replaced params).
  # Fast path, every step: compare against a per-layout signature computed
  # once; walk the trees for a message only when something differs.
  if _signature(state) == _expected_signature(spec):
    return spec
  expected = spec.abstract()
  for name in _SECTIONS:
    got, want = getattr(state, name), getattr(expected, name)
    got_l, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_l, want_def = jax.tree_util.tree_flatten_with_path(want)
    if got_def != want_def:
      raise ValueError(
          f"zerojax train step: state.{name} has tree structure {got_def}, "
          f"but the optimizer state was built for {want_def}. Params and "
          f"optimizer state must come from the same zerojax.init call.")
    for (path, g), (_, w) in zip(got_l, want_l):
      if tuple(g.shape) != tuple(w.shape) or np.dtype(g.dtype) != w.dtype:
        raise ValueError(
            f"zerojax train step: state.{name}{jax.tree_util.keystr(path)} "
            f"is {np.dtype(g.dtype).name}{list(g.shape)}, but the state "
            f"layout expects {w.dtype.name}{list(w.shape)} (stage "
            f"{spec.stage} storage, padded). Rebuild the state with "
            f"zerojax.init instead of replacing leaves.")
  return spec


_SECTIONS = ("params", "master", "opt_state")


def _signature(state: ZeroState):
  return tuple((jax.tree.structure(getattr(state, n)),
                tuple((tuple(x.shape), np.dtype(x.dtype))
                      for x in jax.tree.leaves(getattr(state, n))))
               for n in _SECTIONS)


@functools.lru_cache(maxsize=64)
def _expected_signature(spec: StateSpec):
  return _signature(spec.abstract())


def place_batch(batch, tx: ZeroTransformation, accum_steps: int):
  """Checks the batch splits over devices x micro-batches; shards it."""
  n = tx.num_shards
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise ValueError("zerojax train step: the batch has no arrays.")
  sharding = NamedSharding(tx.mesh, P(tx.axis_name))
  rows = None
  for path, x in leaves:
    shape = np.shape(x)
    if len(shape) == 0:
      raise ValueError(
          f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} is a "
          f"scalar; every batch leaf needs a leading batch dimension to split "
          f"over the {tx.axis_name!r} axis.")
    if rows is None:
      rows = shape[0]
    elif shape[0] != rows:
      raise ValueError(
          f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} has "
          f"{shape[0]} rows but other leaves have {rows}; all batch leaves "
          f"share the leading batch dimension.")
    if shape[0] % (n * accum_steps):
      fix = -(-shape[0] // (n * accum_steps)) * n * accum_steps
      raise ValueError(
          f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} has "
          f"{shape[0]} rows, which do not split over {n} devices x "
          f"{accum_steps} micro-batches (needs a multiple of "
          f"{n * accum_steps}). Use a batch of {fix}, or change accum_steps.")

  def put(x):
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.reshard(x, sharding)
    if jax.process_count() > 1:
      raise ValueError(
          "zerojax train step: in a multi-process run the batch must be a "
          "global jax.Array; build it with "
          "jax.make_array_from_process_local_data.")
    return jax.device_put(x, sharding)
  return jax.tree.map(put, batch)


def shard_batch(local_batch, tx: ZeroTransformation, global_rows: int):
  """A global batch from the rows this process feeds.

  Each process passes only its own rows (``zerojax.distributed.local_rows``
  says which); the result is a global array sharded along the data axis,
  as a train step expects. Single-process runs may pass the whole batch.
  """
  sharding = NamedSharding(tx.mesh, P(tx.axis_name))
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
          sharding, np.asarray(x), (global_rows,) + np.shape(x)[1:]),
      local_batch)


# --------------------------------------------------------------------------
# gradients, inside shard_map
# --------------------------------------------------------------------------
def _split_micro(x, k):
  return x.reshape((k, x.shape[0] // k) + x.shape[1:])


def _grads(spec: StateSpec, loss_fn, accum_steps, gather_mode, params, batch):
  """Per-device body: returns (grads, loss, aux), grads reduced per stage."""
  tx = spec.tx
  axis, stage, n = tx.axis_name, tx.stage, tx.num_shards
  leaves = jax.tree.leaves(params)
  n_leaves = len(leaves)
  # Which params reach the loss as ShardedParam (stage 2-3, sharded leaves).
  hooked = [stage >= 2 and spec.trainable[i] and spec.shard_layouts[i].sharded
            for i in range(n_leaves)]
  gspecs = [
      _gather.GatherSpec(
          axis_name=axis,
          dim=spec.shard_layouts[i].dim - len(spec.params_avals[i].shape),
          size=spec.params_avals[i].shape[spec.shard_layouts[i].dim],
          stage=stage, reduce_dtype=spec.reduce_dtype(i))
      if hooked[i] else None for i in range(n_leaves)]

  def diff_inputs():
    out = []
    for i, x in enumerate(leaves):
      if not spec.trainable[i]:
        out.append(None)
      elif hooked[i]:
        out.append(_gather.sink_like(
            spec.shard_layouts[i].shard_shape(n), spec.reduce_dtype(i), axis))
      else:
        out.append(jax.lax.pcast(x, axis, to="varying"))
    return out

  def loss_of(diff, mb):
    model_leaves = []
    for i, x in enumerate(leaves):
      if not spec.trainable[i]:
        model_leaves.append(x)
      elif hooked[i]:
        model_leaves.append(_gather.ShardedParam(diff[i], x, gspecs[i]))
      else:
        model_leaves.append(diff[i])
    model_params = spec.unflatten_params(model_leaves)
    if gather_mode == "all":
      model_params = _gather.gather(model_params)
    out = loss_fn(model_params, mb)
    loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not hasattr(loss, "shape") or jnp.shape(loss) != ():
      raise LossOutputError(
          f"zerojax train step: loss_fn must return a scalar loss or "
          f"(loss, aux); got loss of shape {jnp.shape(loss)}.")
    return loss.astype(jnp.float32), aux

  grad_fn = jax.value_and_grad(loss_of, has_aux=True)

  def cast(g, i):
    return None if g is None else g.astype(spec.reduce_dtype(i))

  def one(mb):
    (loss, aux), g = grad_fn(diff_inputs(), mb)
    return [cast(x, i) for i, x in enumerate(g)], loss, aux

  if accum_steps == 1:
    grads, loss, aux = one(batch)
  else:
    micro = jax.tree.map(lambda x: _split_micro(x, accum_steps), batch)
    first = jax.tree.map(lambda x: x[0], micro)
    g_shape, l_shape, a_shape = jax.eval_shape(one, first)
    zeros = jax.tree.map(
        lambda s: jax.lax.pcast(jnp.zeros(s.shape, s.dtype), axis,
                                to="varying"), (g_shape, l_shape, a_shape))

    def body(carry, mb):
      out = one(mb)
      return jax.tree.map(jnp.add, carry, out), None
    (grads, loss, aux), _ = jax.lax.scan(body, zeros, micro)

  scale = 1.0 / (n * accum_steps)
  out = []
  for i, g in enumerate(grads):
    if g is None:
      out.append(None)
    elif hooked[i]:                       # already reduce-scattered
      out.append(g * scale)
    elif stage >= 1 and spec.shard_layouts[i].sharded:
      layout = spec.shard_layouts[i]
      g = jax.lax.psum_scatter(layout.to_storage(g), axis,
                               scatter_dimension=layout.dim, tiled=True)
      out.append(g * scale)
    else:                                 # stage 0, or a replicated leaf
      out.append(jax.lax.psum(g, axis) * scale)
  loss = jax.lax.psum(loss, axis) * scale
  # float aux: mean over devices and micro-batches; integer aux (counts):
  # summed over both.
  aux = jax.tree.map(lambda a: jax.lax.psum(a, axis) * scale
                     if jnp.issubdtype(a.dtype, jnp.inexact)
                     else jax.lax.psum(a, axis), aux)
  return out, loss, aux


# --------------------------------------------------------------------------
# the step
# --------------------------------------------------------------------------
def _wsc(x, spec: StateSpec, layout):
  """Constrains ``x`` (logical or storage shape) to ``layout``'s sharding."""
  return jax.lax.with_sharding_constraint(x, spec.sharding(layout))


def _step(state: ZeroState, batch, *, loss_fn, accum_steps, gather_mode):
  spec = state.spec
  tx = spec.tx
  axis, stage, mesh = tx.axis_name, tx.stage, tx.mesh
  n_params = len(spec.params_avals)
  params = jax.tree.leaves(state.params)

  # 1. gradients (shard_map): per param, storage form of its shard layout.
  grad_specs = [None if not t else (l.spec(axis) if stage >= 1 else P())
                for t, l in zip(spec.trainable, spec.shard_layouts)]
  param_specs = [l.spec(axis) for l in spec.param_layouts]
  local = lambda p, b: _grads(spec, loss_fn, accum_steps, gather_mode,
                              spec.unflatten_params(p), b)
  batch_specs = jax.tree.map(lambda _: P(axis), batch)
  grads, loss, aux = jax.shard_map(
      local, mesh=mesh, in_specs=(param_specs, batch_specs),
      out_specs=(grad_specs, P(), P()))(params, batch)

  # 2. the inner optimizer on logical views of global arrays (GSPMD).
  master = (spec.from_optimizer_view(state.master) if state.master is not None
            else [None] * n_params)
  g_view, w_view = [], []
  for i in range(n_params):
    if not spec.trainable[i]:
      g_view.append(None)
      w_view.append(None)
      continue
    sl = spec.shard_layouts[i]
    g = sl.to_logical(grads[i]) if stage >= 1 else grads[i]
    g_view.append(_wsc(g.astype(spec.master_dtype(i)), spec, sl))
    if master[i] is not None:
      w = sl.to_logical(master[i])
    else:
      w = spec.param_layouts[i].to_logical(params[i])
    w_view.append(_wsc(w, spec, sl))
  opt_logical = jax.tree.unflatten(spec.opt_def, [
      _wsc(l.to_logical(x), spec, l)
      for x, l in zip(jax.tree.leaves(state.opt_state), spec.opt_layouts)])
  g_tree, w_tree = spec.optimizer_view(g_view), spec.optimizer_view(w_view)
  updates, new_opt = tx.inner.update(g_tree, opt_logical, w_tree)
  new_w = spec.from_optimizer_view(optax.apply_updates(w_tree, updates))
  grad_norm = optax.tree.norm(g_tree)

  # 3. back to storage.
  new_opt_leaves = jax.tree.leaves(new_opt)
  if len(new_opt_leaves) != len(spec.opt_layouts):
    raise ValueError(
        "zerojax: the inner optimizer's update returned a state with "
        f"{len(new_opt_leaves)} leaves, its init {len(spec.opt_layouts)}.")
  new_opt = jax.tree.unflatten(spec.opt_def, [
      _wsc(l.to_storage(x.astype(a.dtype)), spec, l)
      for x, l, a in zip(new_opt_leaves, spec.opt_layouts, spec.opt_avals)])
  new_master = None
  if state.master is not None:
    new_master = spec.optimizer_view([
        None if w is None else
        _wsc(spec.shard_layouts[i].to_storage(w.astype(spec.master_dtype(i))),
             spec, spec.shard_layouts[i])
        for i, w in enumerate(new_w)])
  new_params = _new_params(spec, params, new_w)
  new_state = ZeroState(step=state.step + 1, params=new_params,
                        master=new_master, opt_state=new_opt, spec=spec)
  metrics = {"loss": loss, "grad_norm": grad_norm}
  if aux is not None:
    metrics["aux"] = aux
  return new_state, metrics


def _new_params(spec: StateSpec, params, new_w):
  tx = spec.tx
  axis, stage = tx.axis_name, tx.stage
  out = list(params)
  gather_idx = []
  for i, w in enumerate(new_w):
    if w is None:
      continue
    w = w.astype(spec.compute_dtype(i))
    sl = spec.shard_layouts[i]
    if stage == 3:
      out[i] = _wsc(spec.param_layouts[i].to_storage(w), spec,
                    spec.param_layouts[i])
    elif stage >= 1 and sl.sharded:
      out[i] = _wsc(sl.to_storage(w), spec, sl)
      gather_idx.append(i)
    else:
      out[i] = _wsc(w, spec, spec.param_layouts[i])
  if gather_idx:
    # Stages 1-2: all-gather the updated shards, in compute dtype.
    layouts = [spec.shard_layouts[i] for i in gather_idx]

    def all_gather(shards):
      return [l.to_logical(jax.lax.all_gather(s, axis, axis=l.dim, tiled=True,
                                              to="invarying"))
              for s, l in zip(shards, layouts)]
    full = jax.shard_map(
        all_gather, mesh=tx.mesh,
        in_specs=([l.spec(axis) for l in layouts],),
        out_specs=[P()] * len(layouts))([out[i] for i in gather_idx])
    for i, f in zip(gather_idx, full):
      out[i] = f
  return spec.unflatten_params(out)


def _warn_whole_tree_gather(spec: StateSpec, reason: str):
  if spec.stage < 2:
    return
  full = sum(int(np.prod(a.shape)) * np.dtype(spec.compute_dtype(i)).itemsize
             for i, a in enumerate(spec.params_avals))
  cost = (f"all {full / 2**20:.1f} MiB of full weights are live per device "
          f"at once, instead of one layer's" if spec.stage == 3 else
          f"the full gradient ({full / 2**20:.1f} MiB per device in compute "
          f"dtype) is produced before it is reduce-scattered")
  warnings.warn(
      f"zerojax stage {spec.stage}: loss_fn does not gather its own "
      f"parameters ({reason}), so zerojax gathers the whole parameter tree at "
      f"the start of the loss (correct, not lean): {cost}. To gather per "
      f"layer, run the layers in a lax.scan and call "
      f"zerojax.gather(layer_params) in the (jax.checkpoint-ed) body; pass "
      f"gather='all' to silence this, gather='model' to make it an error.",
      stacklevel=2)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """A jitted, state-donating train step; call it as ``step(state, batch)``.

  Returns ``(new_state, metrics)`` with ``metrics = {"loss", "grad_norm"}``
  (plus ``"aux"`` when the loss returns one: floating leaves averaged over
  devices and micro-batches, integer leaves -- counts -- summed). Metrics are device arrays: read them a step late to keep
  the host from stalling the device.
  """

  loss_fn: Callable
  tx: ZeroTransformation
  accum_steps: int
  gather: str
  donate: bool
  _jitted: Any = dataclasses.field(repr=False, compare=False, default=None)

  def _prepare(self, state, batch):
    check_state(state, self.tx)
    return place_batch(batch, self.tx, self.accum_steps)

  def __call__(self, state: ZeroState, batch):
    batch = self._prepare(state, batch)
    return self._jitted(state, batch)

  def lower(self, state: ZeroState, batch):
    """``jax.jit(...).lower`` of the step, e.g. to read its compiled HLO."""
    batch = self._prepare(state, batch)
    return self._jitted.lower(state, batch)


def train_step(
    loss_fn: Callable,
    tx: ZeroTransformation,
    *,
    accum_steps: int = 1,
    gather: str = "auto",
    donate: bool = True,
) -> TrainStep:
  """Builds the jitted train step for ``tx``'s stage.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``, the mean
      loss over the (per-device micro-) batch it is given.
    tx: the :class:`ZeroTransformation` that built the state.
    accum_steps: micro-batches per step (gradient accumulation inside one
      jitted step). Stages 0-1 accumulate local full gradients and reduce
      once; stages 2-3 reduce every micro-batch into a sharded accumulator.
    gather: who gathers sharded parameters at stages 2-3. ``"model"``:
      ``loss_fn`` calls :func:`zerojax.gather` on each layer's parameters
      just before use (per-layer gathering and reduce-scatter; see that
      function). ``"all"``: zerojax gathers the whole tree before calling
      ``loss_fn`` -- correct for any loss, but at stage 3 every full weight
      is live at once, and stage 2 then differs from stage 1 only by its
      sharded accumulator. ``"auto"`` (default): ``"model"`` if the loss
      traces with sharded parameters (it gathers what it uses); if tracing
      it that way fails, warn once with the reason and the memory cost and
      fall back to ``"all"`` (a genuine bug in the loss then raises there).
    donate: donate the input state's buffers to the output state.

  Returns:
    A :class:`TrainStep`.
  """
  if gather not in GATHER_MODES:
    raise ValueError(f"zerojax.train_step: gather={gather!r}; use 'auto', "
                     f"'model' (the loss calls zerojax.gather per layer) or "
                     f"'all' (zerojax gathers the whole tree first).")
  if not isinstance(accum_steps, int) or accum_steps < 1:
    raise ValueError(f"zerojax.train_step: accum_steps={accum_steps!r} must be "
                     f"an int >= 1.")
  if not callable(loss_fn):
    raise TypeError("zerojax.train_step: loss_fn must be callable.")
  def fn(state, batch):
    mode = "model" if gather == "auto" else gather
    if gather != "auto" or state.spec.stage < 2:
      return _step(state, batch, loss_fn=loss_fn, accum_steps=accum_steps,
                   gather_mode=mode)
    try:
      return _step(state, batch, loss_fn=loss_fn, accum_steps=accum_steps,
                   gather_mode="model")
    except LossOutputError:
      raise                   # not a gathering problem: no fallback
    except Exception as e:  # noqa: BLE001 -- retried below; a real bug re-raises
      reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    _warn_whole_tree_gather(state.spec, reason)
    return _step(state, batch, loss_fn=loss_fn, accum_steps=accum_steps,
                 gather_mode="all")
  jitted = jax.jit(fn, donate_argnums=(0,) if donate else ())
  return TrainStep(loss_fn, tx, accum_steps, gather, donate, jitted)


def _eval_local(spec: StateSpec, loss_fn, params, batch):
  tx = spec.tx
  leaves = jax.tree.leaves(params)
  model = []
  for i, x in enumerate(leaves):
    layout = spec.param_layouts[i]
    if spec.stage == 3 and layout.sharded:
      gspec = _gather.GatherSpec(tx.axis_name, layout.dim - x.ndim,
                                 layout.shape[layout.dim], 3,
                                 spec.reduce_dtype(i))
      model.append(_gather.ShardedParam(jnp.zeros((), gspec.reduce_dtype),
                                        x, gspec))
    else:
      model.append(x)
  model = _gather.gather(spec.unflatten_params(model))
  out = loss_fn(model, batch)
  loss = out[0] if isinstance(out, tuple) else out
  return jax.lax.pmean(loss.astype(jnp.float32), tx.axis_name)


def eval_step(loss_fn: Callable, tx: ZeroTransformation) -> Callable:
  """A jitted ``eval(state, batch) -> mean loss`` that shards the batch.

  No gradients, no update, nothing donated. At stage 3 the weights are
  gathered inside the step (the whole tree, forward only); the state stays
  sharded.
  """
  def run(state, batch):
    spec = state.spec
    param_specs = [l.spec(tx.axis_name) for l in spec.param_layouts]
    batch_specs = jax.tree.map(lambda _: P(tx.axis_name), batch)
    fn = lambda p, b: _eval_local(spec, loss_fn, p, b)
    return jax.shard_map(fn, mesh=tx.mesh, in_specs=(param_specs, batch_specs),
                         out_specs=P())(jax.tree.leaves(state.params), batch)
  jitted = jax.jit(run)

  def evaluate(state, batch):
    check_state(state, tx)
    return jitted(state, place_batch(batch, tx, 1))
  return evaluate
