"""The gradient program rewritten so that XLA CPU keeps its dots whole.

At stage 0 a trainable leaf enters the loss replicated, and JAX inserts an
implicit ``pvary`` where the loss first combines it with its batch rows.
The backward pass sums that cotangent over the batch axes there: a
``psum`` of the weight's gradient, one layer at a time inside a scan. For
``y = x @ W`` the gradient is ``transpose(dot_general(x, dy))``: the dot
yields ``W``'s transpose, and autodiff transposes it back. So the traced
program is ``psum(transpose(dot))``.

XLA CPU then folds the transpose into the dot's operands. The folded dot
contracts transposed operands, which XLA CPU's YNNPACK fusions do not take,
so it runs on Eigen instead. Eigen allocates its packing buffers on every
call: one such dot per weight of each layer, on each device, every step.
Plain ``jax.jit`` data parallelism does not get this. GSPMD puts its
all-reduce on the dot's output, before the transpose, and the dot stays
a YNNPACK fusion.

:func:`rewrite_for_dots` (``sums=True``, stage 0) writes the program the
way GSPMD has it: ``transpose(psum(dot))``. The sum is elementwise, so it
is the same sum of the same numbers.

At stages 1-3 the gradient is reduce-scattered from a layout built out of
the transposed cotangents (a layer's leaves concatenated, the sharded
dimension first), so no collective sits right behind the transpose to
move. There ``barriers=True`` puts an ``optimization_barrier`` between a
dot and the transpose of its output: XLA can no longer fold the one into
the other, the dot stays a YNNPACK fusion, and the transpose is a copy of
its own (as in the plain loop after its all-reduce). The barrier is the
identity on values. The train step sets it on CPU devices only: GPU and
TPU dots take transposed operands as they are, and there the barrier
would only force the dot's output into memory before its transpose.

Only a sum or transpose whose operand is used nowhere else is rewritten.
The program is otherwise bound again equation by equation, sub-programs
(scan bodies, ``jax.checkpoint``, ``jit``) included, with their own
parameters.
"""

from __future__ import annotations

import jax
import jax.extend

# sums over devices that keep their operand's shape
_SUMS = frozenset({"psum_invariant", "psum"})


def rewrite_for_dots(fn, *, sums: bool = True, barriers: bool = False):
  """``fn`` with its traced program rewritten; same outputs, same pytree.

  ``sums``: each ``psum(transpose(a))`` runs as ``transpose(psum(a))``.
  ``barriers``: each ``transpose(dot_general(..))`` runs as
  ``transpose(optimization_barrier(dot_general(..)))``."""
  if not (sums or barriers):
    return fn
  rules = _Rules(sums, barriers)

  def wrapped(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = rules.rewrite(closed.jaxpr)
    if jaxpr is not None:
      closed = jax.extend.core.ClosedJaxpr(jaxpr, closed.consts)
    outs = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return wrapped


def count_sums_of_transposes(jaxpr) -> int:
  """How many sums over devices in ``jaxpr`` (sub-programs included) take
  a transpose's output: what :func:`rewrite_for_dots` removes (``sums``)."""
  return _count_fed(jaxpr, _SUMS, "transpose")


def count_transposed_dots(jaxpr) -> int:
  """How many transposes in ``jaxpr`` (sub-programs included) take a
  ``dot_general``'s output directly: what :func:`rewrite_for_dots` keeps
  apart (``barriers``)."""
  return _count_fed(jaxpr, {"transpose"}, "dot_general")


def _count_fed(jaxpr, consumers, producer_name: str) -> int:
  """Equations named in ``consumers`` whose first operand is a
  ``producer_name`` equation's output, in ``jaxpr`` and its sub-programs."""
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  n = 0
  for e in jaxpr.eqns:
    if e.primitive.name in consumers and e.invars:
      src = producer.get(e.invars[0])
      n += src is not None and src.primitive.name == producer_name
    n += sum(
      _count_fed(s, consumers, producer_name)
      for s in jax.extend.core.jaxprs_in_params(e.params)
    )
  return n


class _Rules:
  """The rewrite of one program and its sub-programs."""

  def __init__(self, sums: bool, barriers: bool):
    self.sums, self.barriers = sums, barriers
    self._barrier = None

  def barrier_primitive(self):
    """``optimization_barrier``'s primitive, as JAX traces the public
    function."""
    if self._barrier is None:
      eqn = jax.make_jaxpr(jax.lax.optimization_barrier)(0.0).jaxpr.eqns[0]
      self._barrier = (eqn.primitive, dict(eqn.params))
    return self._barrier

  def rewrite(self, jaxpr):
    """``jaxpr`` rewritten, or ``None`` when nothing in it changes."""
    uses: dict = {}
    for v in [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars):
      if isinstance(v, jax.extend.core.Var):
        uses[v] = uses.get(v, 0) + 1
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    only_use = lambda e, name: (
      len(e.invars) == 1
      and isinstance(e.invars[0], jax.extend.core.Var)
      and uses[e.invars[0]] == 1
      and e.invars[0] in producer
      and producer[e.invars[0]].primitive.name == name
    )
    summed_after = lambda e: (
      self.sums
      and e.primitive.name in _SUMS
      and len(e.outvars) == 1
      and only_use(e, "transpose")
    )
    # transposes placed after the sum they feed, not where they were
    moved = {id(producer[e.invars[0]]) for e in jaxpr.eqns if summed_after(e)}
    out: list = []
    changed = False
    for e in jaxpr.eqns:
      if id(e) in moved:
        continue
      params = self.rewrite_params(e.params)
      if params is not None:
        e = e.replace(params=params)
        changed = True
      if summed_after(e):
        t = producer[e.invars[0]]
        summed = jax.extend.core.Var(
          _untransposed(e.outvars[0].aval, t.params["permutation"])
        )
        out += [
          e.replace(invars=list(t.invars), outvars=[summed]),
          t.replace(invars=[summed], outvars=list(e.outvars)),
        ]
        changed = True
      elif (
        self.barriers
        and e.primitive.name == "transpose"
        and only_use(e, "dot_general")
      ):
        prim, bparams = self.barrier_primitive()
        held = jax.extend.core.Var(e.invars[0].aval)
        out += [
          jax.extend.core.new_jaxpr_eqn(
            list(e.invars),
            [held],
            prim,
            dict(bparams),
            jax.extend.core.no_effects,
            e.source_info,
            e.ctx,
          ),
          e.replace(invars=[held]),
        ]
        changed = True
      else:
        out.append(e)
    return jaxpr.replace(eqns=out) if changed else None

  def rewrite_params(self, params):
    """An equation's parameters with its sub-programs rewritten, or
    ``None`` when none changes."""
    out, changed = dict(params), False
    for name, value in params.items():
      many = isinstance(value, (tuple, list))
      new = [self.rewrite_program(v) for v in (value if many else (value,))]
      if any(n is not None for n in new):
        kept = [
          v if n is None else n
          for v, n in zip(value if many else (value,), new)
        ]
        out[name] = type(value)(kept) if many else kept[0]
        changed = True
    return out if changed else None

  def rewrite_program(self, value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
      jaxpr = self.rewrite(value.jaxpr)
      return (
        None
        if jaxpr is None
        else jax.extend.core.ClosedJaxpr(jaxpr, value.consts)
      )
    if isinstance(value, jax.extend.core.Jaxpr):
      return self.rewrite(value)
    return None


def _untransposed(aval, perm):
  """The aval whose ``transpose(.., perm)`` is ``aval``: shape and
  sharding spec permuted back, everything else (dtype, the axes it
  varies over) kept."""
  shape = [0] * len(perm)
  for i, p in enumerate(perm):
    shape[p] = aval.shape[i]
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return aval.update(shape=tuple(shape))
  spec = list(spec) + [None] * (len(perm) - len(spec))
  back = [None] * len(perm)
  for i, p in enumerate(perm):
    back[p] = spec[i]
  return aval.update(
    shape=tuple(shape),
    sharding=sharding.update(spec=jax.sharding.PartitionSpec(*back)),
  )
