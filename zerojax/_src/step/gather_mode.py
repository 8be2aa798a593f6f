"""Which params the loss gathers, and how the loss is run on them.

A stage 2-3 loss's traced program is audited (``jaxpr/audit.py``): a loss
that touches a sharded parameter other than through
:func:`zerojax.gather` (a plain-JAX model, an L2 term over
``jax.tree.leaves(params)``, a ``ravel_pytree``) has each parameter
gathered where its traced program uses it (``gather="auto"``: per layer in
a scan over a stack, whole elsewhere, with a warning), or is rejected
(``gather="model"``). Never silently on shards. Stages 0-1 ask the same
audit which leaves' gradients can be reduced inside the backward pass.

Per leaf, ``gspecs[i]`` is the leaf's :class:`GatherSpec` when it reaches
the loss as a :class:`~zerojax.ShardedParam`, ``None`` otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from zerojax._src.comm import gather as _gather
from zerojax._src.comm import quantized as _zeropp
from zerojax._src.jaxpr import audit as _audit
from zerojax._src.jaxpr import layers as _layers
from zerojax._src.records import host_memory as _host_memory
from zerojax._src.records import warn as _warn
from zerojax._src.records.spec import StateSpec
from zerojax._src.step.loss_call import LossArgs, LossOutputError, LossProgram


def gather_spec(
  spec: StateSpec, r, quantized: bool = True
) -> _gather.GatherSpec:
  """Param record ``r``'s gather; ``quantized``: with the tx's ZeRO++
  settings (training), else exact (evaluation)."""
  zeropp = spec.tx.zeropp
  dim = r.shard.dim if r.shard.dim is not None else len(r.aval.shape) - 1
  return _gather.GatherSpec(
    axis_name=spec.tx.axis_name,
    dim=dim - len(r.aval.shape),
    size=r.aval.shape[dim],
    stage=spec.stage,
    reduce_dtype=r.reduce_dtype,
    path=r.path,
    replica=tuple(a for a in spec.tx.batch_axes if a != spec.tx.axis_name),
    padded=r.shard.padded,
    model=r.shard.model,
    weight_bits=zeropp.weight_bits if quantized else None,
    grad_bits=zeropp.grad_bits if quantized else None,
    block_size=zeropp.block,
    hpz=(zeropp.hpz_size or 0) if quantized and spec.stage == 3 else 0,
    node=spec.tx.qgz_node_size if quantized and zeropp.grad_bits else 0,
    stochastic=quantized and zeropp.stochastic_grads,
    group_bytes=spec.tx.bucket_bytes,
    on_host=r.place.params_host,
  )


def grad_to_host(spec: StateSpec, r) -> bool:
  """Whether param ``r``'s reduced gradient goes to host memory
  (``offload_grads``): a gathered leaf's in the backward pass, another
  once reduced. A layer stack of vectors (biases, norm scales: a few
  bytes per layer) keeps its gradient on the device, where a TPU writes
  its per-layer row (the compiler refuses that row of a packed bf16 tile
  into host memory)."""
  return (
    spec.config.offload_grads
    and r.trainable
    and not _host_memory.vector_stack(r)
  )


def hooked_leaves(spec: StateSpec) -> list[bool]:
  """Which params reach a stage 2-3 loss as ShardedParam."""
  return [spec.stage >= 2 and r.hooked for r in spec.leaves]


def model_params(spec: StateSpec, leaves, sinks, gspecs):
  """The params tree the loss sees: ShardedParam where gathered."""
  return spec.unflatten_params(
    [
      _gather.ShardedParam(sink, x, g)
      if g is not None
      else (sink if sink is not None else x)
      for x, sink, g in zip(leaves, sinks, gspecs)
    ]
  )


class GatherMode(NamedTuple):
  """How the loss is run (:func:`resolve_gather`): ``mode`` is ``"model"``,
  ``"all"`` or ``"layers"``; ``reason`` what the audit found, for the
  ``"layers"`` warning."""

  mode: str
  reason: str = ""


def resolve_gather(
  spec: StateSpec, mode: str, probe, args, tagged, what: str
) -> GatherMode:
  """How to run this loss (:class:`GatherMode`); raises or warns as the mode says.

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
    return GatherMode("all" if mode == "all" else "model")
  try:
    misuse = _audit.ungathered_uses(probe, args, tagged)
  except _audit.AuditUnreadable as e:
    # zerojax's limitation, not the loss's: said as such, never as a misuse
    if mode == "model":
      raise RuntimeError(
        f"zerojax {what}, gather='model': {e}. zerojax cannot prove the "
        f"loss only gathers its sharded parameters, so it will not run it "
        f"on shards. Use gather='all' (the whole tree gathered first: "
        f"exact, not lean) and report the primitive to zerojax."
      ) from e
    warn_unreadable(spec, str(e), what)
    return GatherMode("all")
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
      raise error  # noqa: B904 -- the loss's own error, as it is
    reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  else:
    if not misuse:
      return GatherMode("model")
    uses = "; ".join(
      f"params{spec.leaves[i].path} by {prim}"
      for i, prim in sorted(misuse.items())[:5]
    )
    more = f" (and {len(misuse) - 5} more)" if len(misuse) > 5 else ""
    reason = f"used without zerojax.gather: {uses}{more}"
    if mode == "model":
      raise _gather.UngatheredParamError(
        f"zerojax {what}, gather='model': sharded parameters are {reason}. "
        f"Their shards are not the parameter: call zerojax.gather on "
        f"them first, or use gather='auto' (default: each gathered where "
        f"the loss uses it, one layer at a time inside a lax.scan over "
        f"stacked weights) or 'all' (the whole tree at the start of the "
        f"loss)."
      )
  return GatherMode("layers", reason)


def _whole_tree_cost(spec: StateSpec) -> str:
  full = sum(
    int(np.prod(r.aval.shape)) * np.dtype(r.compute_dtype).itemsize
    for r in spec.leaves
  )
  return (
    f"all {full / 2**20:.1f} MiB of full weights are live per device "
    f"at once, instead of one layer's"
    if spec.stage == 3
    else f"the full gradient ({full / 2**20:.1f} MiB per device in compute "
    f"dtype) is produced before it is reduce-scattered"
  )


def warn_unreadable(spec: StateSpec, reason: str, what: str):
  _warn.warn(
    f"zerojax stage {spec.stage} {what}: {reason}, so it cannot prove that "
    f"the loss uses its sharded parameters only through zerojax.gather. "
    f"To stay exact it gathers the whole parameter tree at the start of "
    f"the loss (not lean): {_whole_tree_cost(spec)}. This is a limitation "
    f"of zerojax with this JAX release, not a fault in your loss; please "
    f"report it. gather='all' silences this warning.",
  )


def warn_whole_tree_gather(spec: StateSpec, reason: str, what: str):
  cost = _whole_tree_cost(spec)
  _warn.warn(
    f"zerojax stage {spec.stage} {what}: loss_fn does not only gather its "
    f"parameters ({reason}), so zerojax gathers the whole parameter tree "
    f"at the start of the loss (exact, not lean): {cost}. To gather per "
    f"layer, run the layers in a lax.scan over their stacked weights "
    f"(zerojax then gathers one layer per iteration), or call "
    f"zerojax.gather(layer_params) in the (jax.checkpoint-ed) body; pass "
    f"gather='all' to silence this, gather='model' to make it an error.",
  )


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
    _warn.warn(
      f"zerojax stage {spec.stage} {what}: {names}{more} are gathered per "
      f"layer inside the loss's lax.scan and also whole, because the loss "
      f"uses them outside the scan too (e.g. a penalty over the whole "
      f"tree), so their full "
      f"{'values are' if spec.stage == 3 else 'gradients are'} live per "
      f"device at once (exact, not lean). Use them only inside the scan to "
      f"keep them per layer; gather='all' silences this.",
    )


def diff_inputs(spec: StateSpec, leaves, hooked, direct=None):
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
      axes = (
        tx.batch_axes
        if tx.stage >= 1
        else tuple(a for a in tx.batch_axes if a != tx.axis_name)
      )
      out.append(
        _gather.sink_like(
          r.shard.shard_shape(tx.num_shards),
          r.reduce_dtype,
          axes,
          on_host=grad_to_host(spec, r),
        )
      )
    else:
      out.append(jax.lax.pcast(x, tx.batch_axes, to="varying"))
  return out


def secondary_shards(spec: StateSpec, leaves, hooked):
  """hpZ: each sharded param's secondary shard, gathered across nodes once
  per step (outside the loss, its remat and the micro-batch loop), per
  model shard as every data-axis collective (``over_model_shards``; left
  to XLA it gathers the weights over ``model`` first, more than the
  theory's elements)."""
  tx = spec.tx
  zpp = tx.zeropp
  return [
    _gather.over_model_shards(
      lambda y, r=r: _zeropp.secondary(
        y, tx.axis_name, r.shard.dim, zpp.hpz_size, zpp.weight_bits, zpp.block
      ),
      x,
      r.shard.model,
      r.shard.dim,
    )
    if h
    else x
    for x, h, r in zip(leaves, hooked, spec.leaves)
  ]


def run_loss(
  prog: LossProgram,
  leaves,
  diff,
  gspecs,
  how: GatherMode,
  args: LossArgs,
  *,
  what: str = "train step",
):
  """The user's loss on the params the model sees (:func:`model_params`:
  :class:`~zerojax.ShardedParam` for gathered leaves): ``(loss,
  new_model_state, aux)``. ``mode`` (:func:`resolve_gather`): ``"model"``
  as they are, ``"all"`` on the whole gathered tree, ``"layers"`` with
  each gathered where the traced loss uses it (``jaxpr/layers.py``; the
  whole tree, with a warning, where that walk cannot read the loss)."""
  params = model_params(prog.spec, leaves, diff, gspecs)
  mb, key, model_state = args
  mode = how.mode
  if mode == "layers":
    call = lambda p, *a: prog.call(prog.loss_fn, p, *a)
    try:
      out, placed = _layers.gather_where_used(
        call, params, mb, key, model_state
      )
    except _layers.LayersUnreadable as e:
      if prog.spec.stage >= 2:
        warn_unreadable(prog.spec, str(e), what)
      mode = "all"
    else:
      if prog.spec.stage >= 2:
        warn_placement(prog.spec, placed, how.reason, what)
      return out
  if mode == "all":
    params = _gather.gather_each(params)
  return prog.call(prog.loss_fn, params, mb, key, model_state)


def _probe(prog: LossProgram, leaves, diff, gspecs, args: LossArgs):
  """``(probe, args, tagged)`` for the audit: the loss on
  :class:`~zerojax.ShardedParam` leaves whose sinks and sources are
  arguments, tagged with their param's index."""
  hooked = [g is not None for g in gspecs]
  sinks = [d if h else None for d, h in zip(diff, hooked)]
  srcs = [x if h else None for x, h in zip(leaves, hooked)]
  tags = [i for i, h in enumerate(hooked) if h] * 2

  def probe(sinks, srcs, mb, k, ms, gather_all=False):
    d = [s if h else d for s, d, h in zip(sinks, diff, hooked)]
    ls = [s if h else x for s, x, h in zip(srcs, leaves, hooked)]
    return run_loss(
      prog,
      ls,
      d,
      gspecs,
      GatherMode("all" if gather_all else "model"),
      LossArgs(mb, k, ms),
    )

  probe_args = (sinks, srcs, *args)
  n_rest = len(jax.tree.leaves(probe_args)) - len(tags)
  return probe, probe_args, tags + [None] * n_rest


def gather_mode(
  prog: LossProgram, leaves, diff, gspecs, args: LossArgs, what: str
) -> GatherMode:
  """Whether the traced loss gathers what it uses
  (:func:`resolve_gather` on a probe of one micro-batch, the gathered
  leaves' sinks and sources tagged). Training and evaluation alike."""
  probe, probe_args, tagged = _probe(prog, leaves, diff, gspecs, args)
  return resolve_gather(prog.spec, prog.gather, probe, probe_args, tagged, what)


def reduce_in_backward(spec: StateSpec, k: int, gather: str, direct) -> bool:
  """Whether a stage 0-1 step with one micro-batch asks the audit which
  leaves the loss gathers (:func:`gathered_by_the_loss`): at stage 0 for
  the leaves :func:`reduced_where_used` leaves out, at stage 1 for its
  sharded leaves (not with qgZ, whose blocks span a whole leaf's shard)."""
  if k != 1 or gather == "all":
    return False
  if spec.stage == 0:
    return not all(d or not r.trainable for d, r in zip(direct, spec.leaves))
  return spec.stage == 1 and spec.tx.zeropp.grad_bits is None


def gathered_by_the_loss(
  prog: LossProgram, leaves, args: LossArgs
) -> tuple[list[bool], str]:
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
  cand = [
    r.trainable
    and len(r.aval.shape) >= 1
    and (spec.stage == 0 or r.shard.sharded)
    for r in spec.leaves
  ]
  if not any(cand):
    return cand, "model"
  gspecs = [
    gather_spec(spec, r) if h else None for r, h in zip(spec.leaves, cand)
  ]
  diff = diff_inputs(spec, leaves, cand)
  probe, probe_args, tagged = _probe(prog, leaves, diff, gspecs, args)
  try:
    misuse = _audit.ungathered_uses(probe, probe_args, tagged)
  except LossOutputError:
    raise
  except _audit.AuditUnreadable:
    return [False] * len(cand), "model"
  except Exception:  # noqa: BLE001 -- the loss rejects ShardedParam leaves
    misuse = {i for i, h in enumerate(cand) if h}
  if misuse and spec.stage == 1:
    return cand, "layers"
  return [h and i not in misuse for i, h in enumerate(cand)], "model"
