"""Per-layer gathers for a loss that never calls :func:`zerojax.gather`.

A model written for plain data parallelism runs its blocks in a
``lax.scan`` over stacked weights (``W[L, ...]``) and uses every parameter
as an ordinary array. Handed :class:`~zerojax.ShardedParam` leaves it
fails, and handed the whole gathered tree it is exact but not lean: at
stage 3 every full weight is live at once, and at stages 1-3 the whole
unreduced gradient exists before it is reduce-scattered.

:func:`gather_where_used` runs such a loss as if it had been written with
the gathers in place. It traces the loss on the gathered tree, then
evaluates the traced program equation by equation with each sharded leaf
held back, unevaluated, until something uses it:

* a ``scan`` that slices the leaf as one of its scanned operands (the
  stacked-layers idiom) gets the leaf's sink and source as scanned
  operands instead, and its body gathers one layer's slice at the start
  of each iteration. The gather's backward then reduce-scatters that
  layer's cotangent inside the backward loop, and at stage 3 its forward
  all-gathers one layer at a time. The new body runs under
  ``jax.checkpoint``, as a model's own ``zerojax.gather`` is meant to: the
  backward pass saves only the body's inputs (the carry, and the layer's
  slice of the stored leaf, read in place) and runs the body again, gather
  included. A body left unchecked saves the gathered layer, or a stacked
  copy of it, for every iteration (a checkpoint policy that saves all but
  the gathered layer still stacks a copy). Where the user's body was not
  checkpointed this trades compute for memory: its forward runs twice, as
  under ``jax.checkpoint``;
* a ``jit`` (or other plain call) the leaf enters is inlined, so a scan
  inside it is reached too;
* any other use -- arithmetic, a scan that carries it or closes over it,
  a ``jax.checkpoint``, a ``cond``, the loss's output -- gathers the whole
  leaf once, where it is first used, as ``gather="all"`` does.

Only equations that use a held-back leaf are rebuilt; every other
equation is bound again with its own parameters, so the program computes
what the traced loss computes: the same numbers as the whole-tree
gather, with the collectives per layer. What the walker cannot evaluate
raises :class:`LayersUnreadable` (zerojax's limitation); the train step
then gathers the whole tree, with a warning.

Structured equations are read as the audit reads them (``jaxpr/audit.py``):
sub-programs by type, a scan's consts, carry and scanned operands by shape.
Only ``length``, ``reverse`` and ``unroll`` are read by name, from the
scan equations that are rebuilt.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend

from zerojax._src.comm import gather as _gather
from zerojax._src.jaxpr import audit as _audit

# Equations whose one sub-program runs once on their operands, 1:1, with no
# semantics of their own beyond the call: inlined when a held-back leaf
# enters them (a jax.checkpoint is not among them: it changes what the
# backward pass saves).
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call"})


class LayersUnreadable(Exception):
  """The traced loss holds an equation :func:`gather_where_used` cannot
  evaluate with its leaves held back (zerojax's limitation)."""


@dataclasses.dataclass
class Placement:
  """Where each sharded leaf (by its index in the params' leaves) was
  gathered: per layer inside a scan body, and/or whole."""

  per_layer: set = dataclasses.field(default_factory=set)
  whole: set = dataclasses.field(default_factory=set)


class _Held:
  """A sharded leaf not gathered yet: index ``i`` in the params' leaves."""

  __slots__ = ("i",)

  def __init__(self, i: int):
    self.i = i


def gather_where_used(fn, params, *args):
  """``fn(params, *args)`` with each :class:`~zerojax.ShardedParam` leaf of
  ``params`` gathered where the traced program uses it.

  Returns ``(output, placement)``: ``fn``'s output (its tree) and a
  :class:`Placement`. Errors raised while tracing ``fn`` propagate
  unchanged; :class:`LayersUnreadable` when a use cannot be evaluated.
  """
  sharded = lambda x: isinstance(x, _gather.ShardedParam)
  leaves, treedef = jax.tree.flatten(params, is_leaf=sharded)
  held = [i for i, x in enumerate(leaves) if sharded(x)]
  others = [x for x in leaves if not sharded(x)]
  sinks = [leaves[i].sink for i in held]
  srcs = [leaves[i].src for i in held]
  if any(x is None for x in sinks + srcs):
    raise LayersUnreadable("a sharded leaf without a sink or a source")

  def traced(sinks, srcs, others, args):
    it = iter(others)
    full = [
      _gather.ShardedParam(
        sinks[held.index(i)], srcs[held.index(i)], leaves[i].spec
      )
      if i in held
      else next(it)
      for i in range(len(leaves))
    ]
    return fn(_gather.gather_each(jax.tree.unflatten(treedef, full)), *args)

  flat_args = (sinks, srcs, others, args)
  closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*flat_args)
  jaxpr = closed.jaxpr
  flat = jax.tree.leaves(flat_args)
  if len(flat) != len(jaxpr.invars):
    raise LayersUnreadable(
      f"{len(jaxpr.invars)} traced inputs for {len(flat)} argument leaves"
    )
  n = len(held)
  walker = _Walker({held[k]: leaves[held[k]] for k in range(n)})
  sink_of = {jaxpr.invars[k]: held[k] for k in range(n)}
  src_of = {jaxpr.invars[n + k]: held[k] for k in range(n)}
  try:
    out = walker.run(jaxpr, closed.consts, flat, sink_of, src_of)
  except LayersUnreadable:
    raise
  except Exception as e:  # noqa: BLE001 -- an internal failure, named as such
    raise LayersUnreadable(f"{type(e).__name__}: {e}") from e
  return (
    jax.tree.unflatten(jax.tree.structure(out_shape), out),
    walker.placement,
  )


class _Walker:
  """Evaluates a jaxpr with sharded leaves held back (:class:`_Held`)."""

  def __init__(self, params: dict):
    self.params = params  # leaf index -> ShardedParam
    self.whole = {}  # leaf index -> its gathered value
    self.placement = Placement()

  # -- values ---------------------------------------------------------------
  def gathered(self, i: int):
    """Leaf ``i`` gathered whole (once; later uses share the value)."""
    if i not in self.whole:
      p = self.params[i]
      self.whole[i] = _gather.gather_each(p)
      self.placement.whole.add(i)
    return self.whole[i]

  def value(self, x):
    return self.gathered(x.i) if isinstance(x, _Held) else x

  def sliceable(self, i: int) -> bool:
    """Whether a scan may slice leaf ``i``'s leading dimension and gather
    each slice: that dimension is not the one the data axis shards."""
    p = self.params[i]
    return p.src.ndim + p.spec.dim >= 1

  # -- programs -------------------------------------------------------------
  def run(self, jaxpr, consts, args, sink_of=None, src_of=None):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      outs = self.held_gather(eqn, sink_of, src_of)
      if outs is None:
        outs = (
          self.eqn(eqn, ins)
          if any(isinstance(x, _Held) for x in ins)
          else _bind(eqn, ins)
        )
      env.update(zip(eqn.outvars, outs))
    return [self.value(read(v)) for v in jaxpr.outvars]

  def held_gather(self, eqn, sink_of, src_of):
    """The trace's own gather of one leaf, from its sink and source
    inputs: held back instead of run."""
    if (
      not sink_of
      or eqn.primitive.name != "custom_vjp_call"
      or not _audit.is_gather(eqn.params)
      or len(eqn.outvars) != 1
    ):
      return None
    ins = [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]
    if (
      len(ins) != 2
      or ins[0] not in sink_of
      or ins[1] not in src_of
      or sink_of[ins[0]] != src_of[ins[1]]
    ):
      return None
    return [_Held(sink_of[ins[0]])]

  def eqn(self, eqn, ins):
    name = eqn.primitive.name
    subs = _subprograms(eqn.params) if name == "scan" or name in _INLINE else []
    if name == "scan" and len(subs) == 1:
      return self.scan(eqn, subs[0], ins)
    if name in _INLINE and len(subs) == 1:
      body, consts = subs[0]
      if len(body.invars) == len(ins) and len(body.outvars) == len(eqn.outvars):
        return self.run(body, consts, ins)
    return _bind(eqn, [self.value(x) for x in ins])

  def scan(self, eqn, sub, ins):
    body, bconsts = sub
    nc, ncarry = _audit.scan_counts(eqn, body)
    start = nc + ncarry
    layered = {
      j: ins[j].i
      for j in range(start, len(ins))
      if isinstance(ins[j], _Held) and self.sliceable(ins[j].i)
    }
    if not layered:
      return _bind(eqn, [self.value(x) for x in ins])
    try:
      length, reverse = eqn.params["length"], eqn.params["reverse"]
    except KeyError as e:
      raise LayersUnreadable(
        f"scan without a '{e.args[0]}' parameter (JAX {jax.__version__})"
      ) from e
    unroll = eqn.params.get("unroll", 1)
    ins = [x if j in layered else self.value(x) for j, x in enumerate(ins)]
    consts, init = ins[:nc], ins[nc:start]
    xs = [
      (self.params[layered[j]].sink, self.params[layered[j]].src)
      if j in layered
      else ins[j]
      for j in range(start, len(ins))
    ]
    specs = {j: self.params[i].spec for j, i in layered.items()}
    closed = jax.extend.core.ClosedJaxpr(
      _without_cse_barriers(body), list(bconsts)
    )

    def step(carry, xs_t):
      # one gather call for the layer's leaves: at stages 1-2 their
      # gradients are reduced in one collective, as a model's own
      # ``zerojax.gather(layer)`` does (comm/gather.py)
      vals = dict(zip(range(start, len(ins)), xs_t))
      layer = {
        j: _gather.ShardedParam(vals[j][0], vals[j][1], specs[j]) for j in specs
      }
      vals.update(_gather.gather(layer))
      outs = jax.extend.core.jaxpr_as_fun(closed)(
        *consts, *carry, *(vals[j] for j in range(start, len(ins)))
      )
      return list(outs[:ncarry]), list(outs[ncarry:])

    carry, ys = jax.lax.scan(
      jax.checkpoint(step, prevent_cse=False),
      list(init),
      xs,
      length=length,
      reverse=reverse,
      unroll=unroll,
    )
    self.placement.per_layer.update(layered.values())
    return list(carry) + list(ys)


def _without_cse_barriers(body):
  """``body`` (a scan's) with its own ``jax.checkpoint``s built with
  ``prevent_cse=False``.

  ``prevent_cse=True`` (``jax.checkpoint``'s default) puts an
  optimization barrier on the checkpoint's inputs in the backward pass.
  Here those inputs are the layer's *gathered* weights, so the barrier
  makes every all-gather finish before the block's recomputation starts:
  the TPU compiler then issues them synchronously (docs/design.md). Inside a scan, and under this walk's own
  ``jax.checkpoint(prevent_cse=False)``, the barrier is not needed (JAX's
  ``jax.checkpoint`` documentation: CSE is already prevented in a scan);
  the policy and the numbers are unchanged."""
  eqns = [
    e.replace(params=dict(e.params, prevent_cse=False))
    if e.primitive.name in _REMAT and e.params.get("prevent_cse")
    else e
    for e in body.eqns
  ]
  return body.replace(eqns=eqns)


# jax.checkpoint's primitive, by its name in the supported JAX versions
_REMAT = frozenset({"remat2", "checkpoint"})


def _subprograms(params) -> list:
  """``(jaxpr, consts)`` of every sub-program among an equation's
  parameters, found by type (as :func:`audit._subprograms`)."""
  out = []
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        out.append((v.jaxpr, v.consts))
      elif isinstance(v, jax.extend.core.Jaxpr):
        if v.constvars:
          raise LayersUnreadable("an open sub-program with constants")
        out.append((v, []))
  return out


def _bind(eqn, ins):
  """The equation run again on ``ins``, with its own parameters."""
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*ins, **params)
  return out if eqn.primitive.multiple_results else [out]
