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
checked (``jaxpr/audit.py``): a loss that touches a sharded parameter other than
through ``gather`` (a plain-JAX model, an L2 term over
``jax.tree.leaves(params)``, a ``ravel_pytree``) has each parameter
gathered where its traced program uses it (``gather="auto"``: per layer in
a scan over a stack, whole elsewhere), or is rejected
(``gather="model"``). Never silently on shards.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax._src.comm import buckets as _buckets
from zerojax._src.comm import gather as _gather
from zerojax._src.comm import quantized as _zeropp
from zerojax._src.jaxpr import audit as _audit
from zerojax._src.jaxpr import layers as _layers
from zerojax._src.jaxpr import transposes as _transposes
from zerojax._src.jaxpr import varying as _varying
from zerojax._src.records.mesh import explain_per_device_errors
from zerojax._src.records.spec import (StateSpec, ZeroState, is_key_dtype,
                                       make_spec, model_axes_of,
                                       tree_difference)
from zerojax._src.step import aux as _aux
from zerojax._src.step.batch import place_batch
from zerojax._src.step.state import reject_deleted

GATHER_MODES = ("auto", "model", "all")


class LossOutputError(ValueError):
  """``loss_fn`` returned something other than what its signature promises."""


@dataclasses.dataclass(frozen=True)
class LossCall:
  """How a loss is called and what it returns.

  ``loss_fn(params, batch[, key=][, model_state=])`` returns

  * without model state: ``loss``, or ``(loss, aux)`` (``has_aux`` True, or
    ``None`` to accept either);
  * with model state: ``(loss, new_model_state)`` or
    ``(loss, new_model_state, aux)``.
  """

  has_key: bool = False
  has_model_state: bool = False
  has_aux: bool | None = None

  def __call__(self, loss_fn, params, batch, key, model_state):
    kw = {}
    if self.has_key:
      kw["key"] = key
    if self.has_model_state:
      # Rebuilt here, inside whatever transformation calls the loss: Flax
      # NNX variables may only be mutated at the trace that created them.
      leaves, treedef = jax.tree.flatten(model_state)
      kw["model_state"] = jax.tree.unflatten(treedef, leaves)
    return self.parse(loss_fn(params, batch, **kw), model_state)

  def parse(self, out, model_state):
    """-> ``(loss as float32 scalar, new_model_state, aux)``."""
    if self.has_model_state:
      if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise LossOutputError(
            "zerojax: with model_state, loss_fn must return "
            "(loss, new_model_state) or (loss, new_model_state, aux); got "
            f"{_describe(out)}.")
      loss, new_state = out[0], out[1]
      aux = out[2] if len(out) == 3 else None
      _check_same_tree(model_state, new_state)
    elif self.has_aux is None:
      loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
      new_state = None
    elif self.has_aux:
      if not isinstance(out, tuple) or len(out) != 2:
        raise LossOutputError(f"zerojax: has_aux=True, so loss_fn must return "
                              f"(loss, aux); got {_describe(out)}.")
      (loss, aux), new_state = out, None
    else:
      loss, aux, new_state = out, None, None
    if not hasattr(loss, "shape") or jnp.shape(loss) != ():
      raise LossOutputError(
          f"zerojax: loss_fn must return a scalar loss (or a tuple starting "
          f"with one); got loss of shape {jnp.shape(loss)}.")
    return jnp.asarray(loss).astype(jnp.float32), new_state, aux


def _describe(out) -> str:
  if isinstance(out, tuple):
    return f"a tuple of {len(out)}"
  return f"{type(out).__name__} of shape {jnp.shape(out)}"


def _check_same_tree(old, new):
  diff = tree_difference(new, old)
  if diff and diff[0] == "structure":
    raise LossOutputError(
        f"zerojax: the model state returned by loss_fn has tree structure "
        f"{diff[1]}, the state given to it {diff[2]}. Return the updated "
        f"model state with the same structure (e.g. nnx.state(model, ...) "
        f"with the same filters).")
  if diff:
    _, path, b, a = diff
    raise LossOutputError(
        f"zerojax: model_state{path} went from {a.dtype}{list(a.shape)} to "
        f"{b.dtype}{list(b.shape)} in loss_fn; model state must keep its "
        f"shapes and dtypes (cast it back).")


@dataclasses.dataclass(frozen=True)
class LossProgram:
  """One gradient (or evaluation) computation's static inputs: the state's
  records, the user's loss and how it is called, the micro-batches per
  step and the gather mode (see :func:`zerojax.train_step`)."""

  spec: StateSpec
  loss_fn: Callable
  call: LossCall
  accum_steps: int = 1
  gather: str = "auto"


# --------------------------------------------------------------------------
# per device
# --------------------------------------------------------------------------
def _split_micro(x, k):
  return x.reshape((k, x.shape[0] // k) + x.shape[1:])


def gather_spec(spec: StateSpec, r, quantized: bool = True) -> _gather.GatherSpec:
  """Param record ``r``'s gather; ``quantized``: with the tx's ZeRO++
  settings (training), else exact (evaluation)."""
  zeropp = spec.tx.zeropp
  dim = r.shard.dim if r.shard.dim is not None else len(r.aval.shape) - 1
  return _gather.GatherSpec(
      axis_name=spec.tx.axis_name, dim=dim - len(r.aval.shape),
      size=r.aval.shape[dim], stage=spec.stage,
      reduce_dtype=r.reduce_dtype, path=r.path,
      replica=tuple(a for a in spec.tx.batch_axes if a != spec.tx.axis_name),
      padded=r.shard.padded, model=r.shard.model,
      weight_bits=zeropp.weight_bits if quantized else None,
      grad_bits=zeropp.grad_bits if quantized else None,
      block_size=zeropp.block,
      hpz=(zeropp.hpz_size or 0) if quantized and spec.stage == 3 else 0,
      node=spec.tx.qgz_node_size if quantized and zeropp.grad_bits else 0,
      stochastic=quantized and zeropp.stochastic_grads,
      group_bytes=spec.tx.bucket_bytes)


def hooked_leaves(spec: StateSpec) -> list[bool]:
  """Which params reach a stage 2-3 loss as ShardedParam."""
  return [spec.stage >= 2 and r.hooked for r in spec.leaves]


def model_params(spec, leaves, sinks, hooked, gspecs):
  """The params tree the loss sees: ShardedParam where hooked."""
  return spec.unflatten_params([
      _gather.ShardedParam(sinks[i], x, gspecs[i]) if hooked[i] else
      (sinks[i] if sinks[i] is not None else x)
      for i, x in enumerate(leaves)])


def resolve_gather(spec: StateSpec, mode: str, probe, args, tagged,
                   what: str) -> tuple[str, str]:
  """``(mode, reason)`` for this loss; raises or warns as the mode says.

  ``mode``: ``"model"`` (the loss gathers what it uses), ``"all"`` (the
  whole tree gathered first: asked for, or the audit cannot read the
  loss), or ``"layers"`` (``gather="auto"`` and a loss that uses some
  sharded parameter without ``zerojax.gather``: :func:`run_loss` gathers
  each where the traced loss uses it, per layer inside a scan over a stack;
  ``reason`` says what the audit found, for its warning).

  ``probe(*args, gather_all=False)`` calls the loss on ShardedParam leaves
  (or, with ``gather_all``, on the gathered tree); ``tagged`` gives, per
  leaf of ``args``, the param index it belongs to (None: not a param).
  """
  if mode == "all" or not any(t is not None for t in tagged):
    return ("all" if mode == "all" else "model"), ""
  try:
    misuse = _audit.ungathered_uses(probe, args, tagged)
  except _audit.AuditUnreadable as e:
    # zerojax's limitation, not the loss's: said as such, never as a misuse
    if mode == "model":
      raise RuntimeError(
          f"zerojax {what}, gather='model': {e}. zerojax cannot prove the "
          f"loss only gathers its sharded parameters, so it will not run it "
          f"on shards. Use gather='all' (the whole tree gathered first: "
          f"exact, not lean) and report the primitive to zerojax.") from e
    warn_unreadable(spec, str(e), what)
    return "all", ""
  except _gather.UngatheredParamError as e:
    if mode == "model":
      raise
    reason = str(e).splitlines()[0]
  except LossOutputError:
    raise
  except Exception as e:  # noqa: BLE001 -- told apart just below
    if mode == "model":
      raise
    # A library may reject the unfamiliar ShardedParam leaf with its own
    # error (Flax checks shapes). Trace the loss on the gathered tree: if
    # that fails too, the bug is the loss's own, and that error is raised,
    # once and unchanged; if it succeeds, the ShardedParam was the problem.
    error = None
    try:
      jax.make_jaxpr(lambda *a: probe(*a, gather_all=True))(*args)
    except Exception as e2:  # noqa: BLE001 -- re-raised as it is
      error = e2
    if error is not None:
      raise error
    reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  else:
    if not misuse:
      return "model", ""
    uses = "; ".join(f"params{spec.leaves[i].path} by {prim}"
                     for i, prim in sorted(misuse.items())[:5])
    more = f" (and {len(misuse) - 5} more)" if len(misuse) > 5 else ""
    reason = f"used without zerojax.gather: {uses}{more}"
    if mode == "model":
      raise _gather.UngatheredParamError(
          f"zerojax {what}, gather='model': sharded parameters are {reason}. "
          f"Their shards are not the parameter: call zerojax.gather on "
          f"them first, or use gather='auto' (default: each gathered where "
          f"the loss uses it, one layer at a time inside a lax.scan over "
          f"stacked weights) or 'all' (the whole tree at the start of the "
          f"loss).")
  return "layers", reason


def _whole_tree_cost(spec: StateSpec) -> str:
  full = sum(int(np.prod(r.aval.shape)) * np.dtype(r.compute_dtype).itemsize
             for r in spec.leaves)
  return (f"all {full / 2**20:.1f} MiB of full weights are live per device "
          f"at once, instead of one layer's" if spec.stage == 3 else
          f"the full gradient ({full / 2**20:.1f} MiB per device in compute "
          f"dtype) is produced before it is reduce-scattered")


def warn_unreadable(spec: StateSpec, reason: str, what: str):
  warnings.warn(
      f"zerojax stage {spec.stage} {what}: {reason}, so it cannot prove that "
      f"the loss uses its sharded parameters only through zerojax.gather. "
      f"To stay exact it gathers the whole parameter tree at the start of "
      f"the loss (not lean): {_whole_tree_cost(spec)}. This is a limitation "
      f"of zerojax with this JAX release, not a fault in your loss; please "
      f"report it. gather='all' silences this warning.", stacklevel=3)


def warn_whole_tree_gather(spec: StateSpec, reason: str, what: str):
  cost = _whole_tree_cost(spec)
  warnings.warn(
      f"zerojax stage {spec.stage} {what}: loss_fn does not only gather its "
      f"parameters ({reason}), so zerojax gathers the whole parameter tree "
      f"at the start of the loss (exact, not lean): {cost}. To gather per "
      f"layer, run the layers in a lax.scan over their stacked weights "
      f"(zerojax then gathers one layer per iteration), or call "
      f"zerojax.gather(layer_params) in the (jax.checkpoint-ed) body; pass "
      f"gather='all' to silence this, gather='model' to make it an error.",
      stacklevel=3)


def warn_placement(spec: StateSpec, placed, reason: str, what: str):
  """After a ``"layers"`` run (stages 2-3): the whole-tree warning when no
  leaf could be gathered per layer; a warning naming the leaves gathered
  per layer and also whole (used outside their scan too), whose full
  values (stage 3) or full gradients are then live at once."""
  if not placed.per_layer:
    warn_whole_tree_gather(spec, reason, what)
    return
  both = sorted(placed.per_layer & placed.whole)
  if both:
    names = ", ".join(f"params{spec.leaves[i].path}" for i in both[:5])
    more = f" (and {len(both) - 5} more)" if len(both) > 5 else ""
    warnings.warn(
        f"zerojax stage {spec.stage} {what}: {names}{more} are gathered per "
        f"layer inside the loss's lax.scan and also whole, because the loss "
        f"uses them outside the scan too (e.g. a penalty over the whole "
        f"tree), so their full "
        f"{'values are' if spec.stage == 3 else 'gradients are'} live per "
        f"device at once (exact, not lean). Use them only inside the scan to "
        f"keep them per layer; gather='all' silences this.", stacklevel=3)


def local_grads(prog: LossProgram, leaves, batch, key, model_state,
                found: _aux.RowDims | None = None):
  """Per-device body: ``(grads, loss, aux_reduced, aux_rows,
  new_model_state)``, reduced.

  ``grads[i]``: the shard (storage layout) of a sharded leaf at stages 1-3,
  the all-reduced full gradient otherwise, ``None`` for frozen leaves. The
  aux comes as :func:`zerojax._src.step.aux.split`'s two trees (batch means
  and counts reduced; this device's per-example rows, stacked), and
  ``found`` learns which leaves are per-example.
  """
  spec, tx = prog.spec, prog.spec.tx
  axes = tx.batch_axes               # every axis the batch splits over
  k = prog.accum_steps
  micro = (batch if k == 1 else
           jax.tree.map(lambda x: _split_micro(x, k), batch))
  first = micro if k == 1 else jax.tree.map(lambda x: x[0], micro)
  hooked = hooked_leaves(spec)
  direct = reduced_where_used(spec, k)
  mode, reason = "model", ""
  if _reduce_in_backward(spec, k, prog.gather, direct):
    gathered, mode = _gathered_by_the_loss(prog, leaves, first, key,
                                           model_state)
    hooked = [h and not d for h, d in zip(gathered, direct)]
  gspecs = [gather_spec(spec, r) if h else None
            for r, h in zip(spec.leaves, hooked)]
  if tx.stage == 3 and tx.zeropp.hpz_size:
    leaves = _secondary_shards(spec, leaves, hooked)
  if key is not None:
    key = jax.random.fold_in(key, jax.lax.axis_index(axes))
  micro_key = lambda i: None if key is None else jax.random.fold_in(key, i)
  if tx.stage >= 2:
    mode, reason = gather_mode(prog, leaves, _diff_inputs(spec, leaves, hooked),
                               hooked, gspecs, first, micro_key(0),
                               model_state, "train step")
  diff_in = _diff_inputs(spec, leaves, hooked, direct)

  scale = 1.0 / (tx.batch_shards * k)
  # Stage 0 with one micro-batch reduces inside the backward pass (leaves
  # reduced where used, gathered leaves): the loss is scaled before it is
  # differentiated, so each sum made there is the mean, with no scaled copy
  # of the gradient made after it.
  seed = scale if tx.stage == 0 and k == 1 else 1.0

  def objective(mb, key, ms):        # what one micro-batch differentiates
    def f(diff):
      loss, new_ms, aux = run_loss(prog, leaves, diff, hooked, gspecs,
                                   mode, mb, key, ms, reason)
      return loss * seed, (loss, new_ms, aux)
    return f

  if any(direct):
    direct = _direct_where_typed(
        jax.make_jaxpr(objective(first, micro_key(0), model_state))(
            diff_in).jaxpr, axes, direct, diff_in)
    diff_in = _diff_inputs(spec, leaves, hooked, direct)

  def one(mb, key, ms):              # one micro-batch's loss and gradients
    f = objective(mb, key, ms)
    # stage 0 (one micro-batch: the sums are in the backward) sums each
    # weight gradient before autodiff's transpose, as GSPMD does; on XLA
    # CPU stages 1-3 keep the transpose out of the dot, which then stays a
    # YNNPACK fusion (jaxpr/transposes.py; GPU and TPU dots take
    # transposed operands as they are)
    grad_fn = _transposes.rewrite_for_dots(
        jax.value_and_grad(f, has_aux=True), sums=tx.stage == 0 and k == 1,
        barriers=tx.stage >= 1 and _on_cpu(tx.mesh))
    try:
      (_, (loss, new_ms, aux)), g = grad_fn(diff_in)
    except ValueError as err:
      _restate_custom_vjp_types(err, axes)
      raise
    g = [None if x is None else x.astype(r.reduce_dtype)
         for x, r in zip(g, spec.leaves)]
    return g, loss, aux, new_ms

  dims_of = lambda aux: _aux.row_dims(
      aux, lambda mb: objective(mb, micro_key(0), model_state)(diff_in)[1][2],
      first)
  if k == 1:
    grads, loss, aux, new_ms = one(micro, micro_key(0), model_state)
    dims = dims_of(aux)
  else:
    grads, loss, aux, new_ms, dims = _accumulate(
        one, micro, first, micro_key, model_state, k, axes, dims_of)
  if found is not None:
    found.set(dims)
  return (_reduce_grads(spec, grads, hooked, scale / seed, direct),
          *reduce_outputs(loss, aux, new_ms, axes, scale, dims))


def _direct_where_typed(jaxpr, axes, direct, diff_in) -> list[bool]:
  """``direct`` less the leaves whose implicit sum JAX's types cannot make
  in the traced forward loss ``jaxpr`` (its inputs: ``diff_in``'s arrays).

  Where the loss types a per-device value as the same on every device (a
  callback's result, say), no implicit sum reaches the gradient through
  it: every leaf is reduced explicitly after the backward. A leaf reaching
  a ``jax.custom_vjp`` operand typed the same on every device is, alone:
  the user's backward rule, not autodiff's transpose, makes its
  cotangent (:mod:`zerojax._src.jaxpr.varying`)."""
  if _varying.dropped_varying(jaxpr, axes):
    return [False] * len(direct)
  reach = _varying.custom_vjp_reach(jaxpr, axes)
  if reach is None:
    return [False] * len(direct)
  if len(jaxpr.invars) != sum(x is not None for x in diff_in):
    return [False] * len(direct)
  position = [None] * len(direct)       # jaxpr input of each leaf
  for p, i in enumerate(i for i, x in enumerate(diff_in) if x is not None):
    position[i] = p
  return [d and position[i] not in reach for i, d in enumerate(direct)]


def _restate_custom_vjp_types(err: ValueError, axes) -> None:
  """JAX's refusal of a ``custom_vjp`` backward rule whose output's
  per-device type differs from its input's, said as what it means in a
  zerojax step, with the fix for the direction JAX names; other errors
  pass."""
  msg = str(err)
  if not ("Custom VJP bwd rule" in msg and "manual axis types" in msg):
    return
  found = re.search(r"output of type (\S+) corresponding to an input of "
                    r"type (\S+?),\s+so", msg)
  out_varies, in_varies = (None, None) if found is None else (
      "{V:" in found.group(1), "{V:" in found.group(2))
  where = (f"In a zerojax step the loss runs once per device (jax.shard_map "
           f"over the batch axes {tuple(axes)}), and JAX requires each "
           f"cotangent typed as its input is: per device, or the same on "
           f"every device.")
  if in_varies and not out_varies:
    what = ("returns a gradient typed the same on every device for an "
            "input that varies per device: a value made by jax.pure_callback "
            "or an FFI call is typed so whatever it holds, and each device's "
            "gradient is its own rows' share until zerojax sums it.")
    fix = ("type it per device like its input: `g = jax.lax.pcast(g, "
           "tuple(jax.typeof(x).manual_axis_type.varying - "
           "jax.typeof(g).manual_axis_type.varying), to='varying')`")
  elif out_varies and not in_varies:
    what = ("returns a per-device gradient for an input every device holds "
            "the same (an array the loss closes over, say): its gradient is "
            "the sum of the devices' shares.")
    fix = ("sum it over the devices it varies over: `g = jax.lax.psum(g, "
           "tuple(jax.typeof(g).manual_axis_type.varying - "
           "jax.typeof(x).manual_axis_type.varying))`, or return "
           "`jnp.zeros_like(x)` if the input needs no gradient")
  else:
    what = "returns a gradient typed otherwise than its input."
    fix = ("type it as its input: jax.lax.pcast(..., to='varying') for an "
           "input that varies per device, jax.lax.psum over the extra axes "
           "for one that does not")
  raise ValueError(
      f"zerojax: a jax.custom_vjp in the loss has a backward rule that "
      f"{what} {where} In the backward rule, for input x and its gradient "
      f"g, {fix} (each a no-op outside a per-device program). JAX said: "
      f"{msg.splitlines()[0]}") from err


def _on_cpu(mesh) -> bool:
  """Whether ``mesh``'s devices are CPUs (an abstract mesh, which has no
  devices: whether the default backend is)."""
  if isinstance(mesh, jax.sharding.Mesh):
    return mesh.devices.flat[0].platform == "cpu"
  return jax.default_backend() == "cpu"


def _secondary_shards(spec: StateSpec, leaves, hooked):
  """hpZ: each sharded param's secondary shard, gathered across nodes once
  per step (outside the loss, its remat and the micro-batch loop), per
  model shard as every data-axis collective (``over_model_shards``; left
  to XLA it gathered the weights over ``model`` first: all-gather elements
  1.20x the theory's on a 4 x 2 mesh)."""
  tx = spec.tx
  zpp = tx.zeropp
  return [_gather.over_model_shards(
              lambda y, r=r: _zeropp.secondary(
                  y, tx.axis_name, r.shard.dim, zpp.hpz_size,
                  zpp.weight_bits, zpp.block),
              x, r.shard.model, r.shard.dim)
          if h else x for x, h, r in zip(leaves, hooked, spec.leaves)]


def reduced_where_used(spec: StateSpec, accum_steps: int) -> list[bool]:
  """Stage 0, one micro-batch: the trainable leaves differentiated as they
  enter the ``shard_map``, replicated (invariant over the batch axes).

  Where the loss first combines such a leaf with its rows of the batch, JAX
  inserts an implicit broadcast to device-varying; its transpose is a
  ``psum`` of the cotangent right there. In a layer scan that is one
  all-reduce per layer inside the backward loop, as plain data parallelism
  gets from GSPMD, for any loss, whether or not it calls
  :func:`zerojax.gather`: the step never holds a whole unreduced gradient
  beside its all-reduced copy. The sum is the one the all-reduce after the
  backward would make (the loss is a mean over each device's rows, the
  gradient the sum of the devices' gradients, scaled once).

  Only where the gradient is reduced in the dtype it is computed in (the
  stored param's): a policy that reduces in another dtype keeps the
  explicit, cast reduction. With several micro-batches the local gradients
  are accumulated first and reduced once per step instead.

  Nor where the mesh has a model axis and the gradient is narrower than 32
  bits: JAX's ``psum`` then runs over the manual data axis inside a region
  automatic over the model axis, which XLA CPU aborts compiling in bf16
  ("Invalid binary instruction opcode copy", JAX 0.10.2); the explicit
  reduction runs manual over every axis (:func:`over_model_shards`)."""
  if spec.stage != 0 or accum_steps != 1:
    return [False] * len(spec.leaves)
  tx = spec.tx
  model_axis = any(n > 1 for a, n in tx.mesh.shape.items()
                   if a not in tx.batch_axes)
  return [r.trainable and np.dtype(r.reduce_dtype) == np.dtype(r.compute_dtype)
          and not (model_axis and np.dtype(r.reduce_dtype).itemsize < 4)
          for r in spec.leaves]


def _diff_inputs(spec: StateSpec, leaves, hooked, direct=None):
  """What the loss is differentiated with respect to: a gradient sink per
  gathered leaf (its cotangent arrives reduce-scattered), the leaf as it
  is (replicated) where :func:`reduced_where_used` says so, the leaf made
  varying over the batch axes otherwise, ``None`` for frozen leaves."""
  tx = spec.tx
  direct = direct or [False] * len(leaves)
  out = []
  for x, r, h, d in zip(leaves, spec.leaves, hooked, direct):
    if not r.trainable:
      out.append(None)
    elif d:
      out.append(x)
    elif h:
      # the cotangent arrives reduced over the data axis (stage 0: summed,
      # replicated over it; stages 1-3: reduce-scattered, one shard each)
      axes = tx.batch_axes if tx.stage >= 1 else tuple(
          a for a in tx.batch_axes if a != tx.axis_name)
      out.append(_gather.sink_like(r.shard.shard_shape(tx.num_shards),
                                   r.reduce_dtype, axes))
    else:
      out.append(jax.lax.pcast(x, tx.batch_axes, to="varying"))
  return out


def run_loss(prog: LossProgram, leaves, diff, hooked, gspecs,
             mode: str, mb, key, model_state, reason: str = "",
             what: str = "train step"):
  """The user's loss on the params the model sees (:func:`model_params`:
  :class:`~zerojax.ShardedParam` for gathered leaves): ``(loss,
  new_model_state, aux)``. ``mode`` (:func:`resolve_gather`): ``"model"``
  as they are, ``"all"`` on the whole gathered tree, ``"layers"`` with
  each gathered where the traced loss uses it (``jaxpr/layers.py``; the
  whole tree, with a warning, where that walk cannot read the loss)."""
  params = model_params(prog.spec, leaves, diff, hooked, gspecs)
  if mode == "layers":
    call = lambda p, *a: prog.call(prog.loss_fn, p, *a)
    try:
      out, placed = _layers.gather_where_used(call, params, mb, key,
                                              model_state)
    except _layers.LayersUnreadable as e:
      if prog.spec.stage >= 2:
        warn_unreadable(prog.spec, str(e), what)
      mode = "all"
    else:
      if prog.spec.stage >= 2:
        warn_placement(prog.spec, placed, reason, what)
      return out
  if mode == "all":
    params = _gather.gather_each(params)
  return prog.call(prog.loss_fn, params, mb, key, model_state)


def _probe(prog: LossProgram, leaves, diff, hooked, gspecs, mb, key,
           model_state):
  """``(probe, args, tagged)`` for the audit: the loss on
  :class:`~zerojax.ShardedParam` leaves whose sinks and sources are
  arguments, tagged with their param's index."""
  sinks = [d if h else None for d, h in zip(diff, hooked)]
  srcs = [x if h else None for x, h in zip(leaves, hooked)]
  tags = [i for i, h in enumerate(hooked) if h] * 2

  def probe(sinks, srcs, mb, k, ms, gather_all=False):
    d = [s if h else d for s, d, h in zip(sinks, diff, hooked)]
    ls = [s if h else x for s, x, h in zip(srcs, leaves, hooked)]
    return run_loss(prog, ls, d, hooked, gspecs,
                    "all" if gather_all else "model", mb, k, ms)

  args = (sinks, srcs, mb, key, model_state)
  n_rest = len(jax.tree.leaves(args)) - len(tags)
  return probe, args, tags + [None] * n_rest


def gather_mode(prog: LossProgram, leaves, diff, hooked, gspecs, mb, key,
                model_state, what: str) -> tuple[str, str]:
  """``(mode, reason)``: whether the traced loss gathers what it uses
  (:func:`resolve_gather` on a probe of one micro-batch, the gathered
  leaves' sinks and sources tagged). Training and evaluation alike."""
  probe, args, tagged = _probe(prog, leaves, diff, hooked, gspecs, mb, key,
                               model_state)
  return resolve_gather(prog.spec, prog.gather, probe, args, tagged, what)


def _reduce_in_backward(spec: StateSpec, k: int, gather: str,
                        direct) -> bool:
  """Whether a stage 0-1 step with one micro-batch asks the audit which
  leaves the loss gathers (:func:`_gathered_by_the_loss`): at stage 0 for
  the leaves :func:`reduced_where_used` leaves out, at stage 1 for its
  sharded leaves (not with qgZ, whose blocks span a whole leaf's shard)."""
  if k != 1 or gather == "all":
    return False
  if spec.stage == 0:
    return not all(d or not r.trainable for d, r in zip(direct, spec.leaves))
  return spec.stage == 1 and spec.tx.zeropp.grad_bits is None


def _gathered_by_the_loss(prog: LossProgram, leaves, mb, key,
                          model_state) -> tuple[list[bool], str]:
  """Stages 0-1, one micro-batch: ``(hooked, mode)``, the trainable leaves
  (at stage 1 the sharded ones) whose gradients are reduced inside the
  backward pass, and how the loss is run (:func:`run_loss`).

  Hooked leaves' gradients are reduced where the gather's backward
  produces them, layer by layer inside the backward pass -- all-reduced at
  stage 0, reduce-scattered at stage 1, as at stage 2 -- instead of after
  it: the step never holds the whole unreduced gradient beside its
  reduction.

  * A loss that reaches them only through :func:`zerojax.gather` (a
    model's per-layer gathers): all of them, ``"model"``.
  * At stage 1, a loss that uses some of them without it (a model written
    for plain data parallelism): all of them, ``"layers"``, so a scan over
    stacked layers reduce-scatters each layer's gradient in its backward
    loop, and any other use reduces its leaf's whole gradient.
  * At stage 0 such a loss: only the leaves it gathers, ``"model"``.
  * A loss the audit cannot read: none, ``"model"`` (reduced after the
    backward). The same numbers either way, and nothing to warn about.

  With several micro-batches stage 1 keeps the full local gradient and
  reduces once per step instead."""
  spec = prog.spec
  cand = [r.trainable and len(r.aval.shape) >= 1
          and (spec.stage == 0 or r.shard.sharded) for r in spec.leaves]
  if not any(cand):
    return cand, "model"
  gspecs = [gather_spec(spec, r) if h else None
            for r, h in zip(spec.leaves, cand)]
  diff = _diff_inputs(spec, leaves, cand)
  probe, args, tagged = _probe(prog, leaves, diff, cand, gspecs, mb, key,
                               model_state)
  try:
    misuse = _audit.ungathered_uses(probe, args, tagged)
  except LossOutputError:
    raise
  except _audit.AuditUnreadable:
    return [False] * len(cand), "model"
  except Exception:  # noqa: BLE001 -- the loss rejects ShardedParam leaves
    misuse = {i for i, h in enumerate(cand) if h}
  if misuse and spec.stage == 1:
    return cand, "layers"
  return [h and i not in misuse for i, h in enumerate(cand)], "model"


def _accumulate(one, micro, first, micro_key, model_state, k: int, axes,
                dims_of):
  """``one`` over ``k`` micro-batches in a ``lax.scan``: gradients, loss
  and aux summed, model state carried, per-example aux leaves (found by
  ``dims_of`` from the aux's shapes) joined in the device's row order.
  Returns ``(grads, loss, aux, new_model_state, row dims)``."""
  g_shape, l_shape, a_shape, _ = jax.eval_shape(
      lambda mb: one(mb, micro_key(0), model_state), first)
  dims = dims_of(a_shape)
  s_shape = jax.eval_shape(lambda a: _aux.split(a, dims)[0], a_shape)
  zeros = jax.tree.map(
      lambda s: jax.lax.pcast(jnp.zeros(s.shape, s.dtype), axes, to="varying"),
      (g_shape, l_shape, s_shape))

  def body(carry, xs):
    acc, ms = carry
    mb, i = xs
    g, loss, aux, ms = one(mb, micro_key(i), ms)
    summed, rows = _aux.split(aux, dims)
    return (jax.tree.map(jnp.add, acc, (g, loss, summed)), ms), rows
  ms0 = (None if model_state is None else
         jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"),
                      model_state))
  ((grads, loss, summed), new_ms), rows = jax.lax.scan(
      body, (zeros, ms0), (micro, jnp.arange(k)))
  return grads, loss, _aux.merge(summed, rows, dims), new_ms, dims


def _reduce_grads(spec: StateSpec, grads, hooked, scale: float, direct):
  """Each leaf's gradient reduced over the batch axes and scaled to the
  mean: leaves :func:`reduced_where_used` are summed already, gathered
  leaves reduce-scattered already (summed over the replica axis here),
  other sharded leaves reduce-scattered, the rest all-reduced. Whole-leaf collectives run over the leaf's rows (a stack's
  layers) in buckets of at most ``tx.bucket_bytes`` (ZeRO-R's CB); the
  replica sum (hybrid sharding: Ψ/N elements cross it) once per step."""
  tx = spec.tx
  axis, axes, bucket = tx.axis_name, tx.batch_axes, tx.bucket_bytes
  replica = tuple(a for a in axes if a != axis)

  def psum(g, over, layout):
    if not over:
      return g
    return _gather.over_model_shards(lambda x: jax.lax.psum(x, over), g,
                                     layout.model)
  out = []
  for g, r, h, d in zip(grads, spec.leaves, hooked, direct):
    if g is None:
      out.append(None)
      continue
    size = _buckets.itemsize(g.dtype)
    if d:                                 # summed where the loss used it
      out.append(g if scale == 1.0 else g * scale)
    elif h and tx.stage == 0:               # all-reduced and scaled already
      out.append(_buckets.bucketed(
          lambda x, r=r: psum(x, replica, r.param), g, size,
          bucket if replica else None, _buckets.splittable(r.param)))
    elif h:                               # already reduce-scattered
      fn = lambda x, r=r: psum(x, replica, r.shard) * scale
      out.append(_buckets.bucketed(fn, g, size, bucket if replica else None,
                                   _buckets.splittable(r.shard)))
    elif tx.stage >= 1 and r.shard.sharded:
      gs = gather_spec(spec, r)

      def fn(x, r=r, gs=gs):
        x = _gather.over_model_shards(
            lambda y, d=r.shard.dim: _gather.reduce_scatter(y, axis, d, gs),
            r.shard.to_storage(x), r.shard.model, r.shard.dim)
        return psum(x, replica, r.shard) * scale
      # qgZ's blocks span the destination shard: not split (``buckets``)
      out.append(_buckets.bucketed(fn, g, size,
                                   None if gs.grad_bits else bucket,
                                   _buckets.splittable(r.shard)))
    else:                                 # stage 0, or a replicated leaf
      fn = lambda x, r=r: psum(x, axes, r.param) * scale
      out.append(_buckets.bucketed(fn, g, size, bucket,
                                   _buckets.splittable(r.param)))
  return out


def reduce_outputs(loss, aux, new_ms, axes, scale: float, dims):
  """The loss and float aux as means over devices and micro-batches,
  integer aux (counts) summed, per-example aux stacked for the devices'
  rows (:mod:`zerojax._src.step.aux`), the model state synchronised.
  Returns ``(loss, aux_reduced, aux_rows, new_model_state)``."""
  loss = jax.lax.psum(loss, axes) * scale
  reduced, rows = _aux.split(aux, dims)
  leaves, tree = jax.tree.flatten(reduced)
  reduced = jax.tree.unflatten(tree, [
      a if d is not None else
      _psum(a, axes) * scale if jnp.issubdtype(a.dtype, jnp.inexact)
      else _psum(a, axes) for a, d in zip(leaves, dims or (None,) * len(leaves))])
  if new_ms is not None:
    new_ms = jax.tree.map(lambda x: sync_model_state(x, axes), new_ms)
  return loss, reduced, _aux.per_device(rows, dims), new_ms


def _psum(x, axes):
  """``psum`` over manual ``axes``, run manual over any automatic (model)
  axes too: see ``comm/gather.over_model_shards`` (XLA CPU aborts on bf16
  collectives in partially automatic regions)."""
  return _gather.over_model_shards(lambda v: jax.lax.psum(v, axes), x, ())


def sync_model_state(x, axis):
  """Floating state: mean over the batch axes (synchronised batch norm);
  anything else (counters, keys): device 0's value, on every device."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return _psum(x, axis) / jax.lax.axis_size(axis)
  if is_key_dtype(x.dtype):
    impl = jax.random.key_impl(x)
    return jax.random.wrap_key_data(sync_model_state(jax.random.key_data(x), axis),
                                    impl=impl)
  first = jax.lax.axis_index(axis) == 0
  return _psum(jnp.where(first, x, jnp.zeros_like(x)), axis)


# --------------------------------------------------------------------------
# global: the shard_map around it
# --------------------------------------------------------------------------
def over_batch_axes(prog: LossProgram, body, out_specs, params, batch, key,
                    model_state):
  """``body(prog, param_leaves, batch, key, model_state)`` per device in a
  ``shard_map`` manual over the batch axes only: model (tensor-parallel)
  axes stay automatic, so XLA partitions the loss over them as the params
  say. Params enter in their stored layout, the batch split by rows, key
  and model state replicated. Training and evaluation alike."""
  tx = prog.spec.tx
  param_specs = [r.param.manual_spec(tx.axis_name) for r in prog.spec.leaves]
  batch_specs = jax.tree.map(lambda _: P(tx.batch_axes), batch)
  rep = lambda t: jax.tree.map(lambda _: P(), t)
  return jax.shard_map(
      functools.partial(body, prog), mesh=tx.compute_mesh,
      in_specs=(param_specs, batch_specs, rep(key), rep(model_state)),
      out_specs=out_specs, axis_names=set(tx.batch_axes))(
          jax.tree.leaves(params), batch, key, model_state)


def sharded_grads(prog: LossProgram, params, batch, key, model_state,
                  found: _aux.RowDims | None = None):
  """Runs :func:`local_grads` per device; grads as global arrays.

  Returns ``(grads, loss, (aux_reduced, aux_rows), new_model_state)``: the
  aux in :mod:`zerojax._src.step.aux`'s two trees, for
  :func:`zerojax._src.step.aux.merge` with ``found`` (filled while
  tracing) once out of the Auto region."""
  tx = prog.spec.tx
  grad_specs = [None if not r.trainable else
                (r.shard.manual_spec(tx.axis_name) if tx.stage >= 1 else P())
                for r in prog.spec.leaves]
  grads, loss, reduced, rows, new_ms = over_batch_axes(
      prog, functools.partial(local_grads, found=found),
      (grad_specs, P(), P(), _aux.rows_spec(tx.batch_axes), P()),
      params, batch, key, model_state)
  return grads, loss, (reduced, rows), new_ms


def value_and_grad(loss_fn: Callable, tx, *, has_aux: bool = False,
                   accum_steps: int = 1, gather: str = "auto") -> Callable:
  """Sharded ``jax.value_and_grad`` for ``tx``'s stage, returning gradients
  in the stage's layout.

  The gradient half of :func:`zerojax.train_step`, usable alone: the loss
  runs per device on its rows of the batch inside ``shard_map``, and the
  gradient is all-reduced (stage 0), reduce-scattered after the backward
  (stage 1), or reduce-scattered layer by layer through
  :func:`zerojax.gather` (stages 2-3).

  Args:
    loss_fn: ``loss_fn(params, batch[, key=])`` returning the mean loss over
      its rows, or ``(loss, aux)`` with ``has_aux=True``.
    tx: a :class:`zerojax.ZeroTransformation`.
    has_aux: as in ``jax.value_and_grad``. The aux is the loss's on the
      whole batch: a leaf whose shape follows the batch's rows
      (per-example) comes back with all rows in batch order, sharded by
      rows; other floating leaves are averaged over devices and
      micro-batches (batch means), integer ones (counts) summed
      (:mod:`zerojax._src.step.aux`).
    accum_steps: micro-batches per call (accumulated inside).
    gather: as in :func:`zerojax.train_step`.

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
    micro-batch. Jitted; nothing is donated.

  Example:
    >>> grad_fn = zerojax.value_and_grad(loss_fn, tx)
    >>> loss, grads = grad_fn(params, batch)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
  """
  check_options(loss_fn, gather, accum_steps, "zerojax.value_and_grad")

  @functools.partial(jax.jit, static_argnums=3)
  def run(params, batch, key, models):
    if isinstance(params, ZeroState):
      spec, model, ms = params.spec, params.params, params.model_state
      if key is None and params.key is not None:
        key = jax.random.fold_in(params.key, params.step)
    else:
      spec, model, ms = make_spec(params, tx, models), params, None
    call = LossCall(has_key=key is not None, has_model_state=False,
                    has_aux=has_aux)

    found = _aux.RowDims()

    def body(model, batch, key, ms):
      if not isinstance(params, ZeroState):
        model = spec.unflatten_params([
            r.place.constrain(x, r.param)
            for x, r in zip(jax.tree.leaves(model), spec.leaves)])
      grads, loss, (reduced, rows), _ = sharded_grads(
          LossProgram(spec, loss_fn, call, accum_steps, gather), model,
          batch, key, ms, found)
      return [g for g in grads if g is not None], loss, reduced, rows
    outs = ([spec.sharding(r.shard) for r in spec.leaves if r.trainable],
            spec.replicated(), spec.replicated(),
            _aux.rows_sharding(spec.tx.mesh, spec.tx.batch_axes))
    grads, loss, reduced, rows = spec.region(body, outs)(model, batch, key, ms)
    aux = _aux.merge(reduced, rows, found.dims)
    grads = iter(grads)
    grads = [next(grads) if r.trainable else None for r in spec.leaves]
    grads = spec.unflatten_params([
        g if g is not None else np.zeros(r.aval.shape, jax.dtypes.float0)
        for g, r in zip(grads, spec.leaves)])
    return ((loss, aux) if has_aux else loss), grads

  def fn(params, batch, *, key=None):
    if isinstance(params, ZeroState):
      if params.model_state is not None:
        raise ValueError(
            "zerojax.value_and_grad: this state carries model_state, whose "
            "update value_and_grad cannot return; use zerojax.train_step.")
      if params.spec.tx.config != tx.config:
        raise ValueError("zerojax.value_and_grad: the state was laid out by "
                         "another ZeroTransformation than this one.")
    elif tx.stage == 3:
      raise ValueError(
          "zerojax.value_and_grad at stage 3: the parameters are stored "
          "sharded, so pass the ZeroState from zerojax.init (not a params "
          "tree): grad_fn(state, batch).")
    reject_deleted(params, "zerojax.value_and_grad",
                   "state" if isinstance(params, ZeroState) else "params")
    # A params tree's model shardings are read here, outside the jit.
    models = (None if isinstance(params, ZeroState)
              else model_axes_of(params, tx))
    batch = place_batch(batch, tx, accum_steps)
    with explain_per_device_errors(tx.mesh, "zerojax.value_and_grad"):
      return run(params, batch, key, models)
  return fn


def check_options(loss_fn, gather, accum_steps, where):
  if gather not in GATHER_MODES:
    raise ValueError(f"{where}: gather={gather!r}; use 'auto', "
                     f"'model' (the loss calls zerojax.gather per layer) or "
                     f"'all' (zerojax gathers the whole tree first).")
  if not isinstance(accum_steps, int) or accum_steps < 1:
    raise ValueError(f"{where}: accum_steps={accum_steps!r} must be "
                     f"an int >= 1.")
  if not callable(loss_fn):
    raise TypeError(f"{where}: loss_fn must be callable.")
