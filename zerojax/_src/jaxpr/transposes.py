"""Sums over devices moved ahead of the transposes JAX's autodiff adds.

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
call: four such dots per layer on a GPT block, on each device, every step.
Plain ``jax.jit`` data parallelism does not get this. GSPMD puts its
all-reduce on the dot's output, before the transpose, and the dot stays
a YNNPACK fusion.

:func:`reduce_before_transpose` writes the program the way GSPMD has it:
``transpose(psum(dot))``. The sum is elementwise, so it is the same sum
of the same numbers. ``experiments/dot_forms.py`` counts the dots left
to Eigen and the pages a step faults in, against the plain loop's
(``docs/results.md``).

Only a sum whose operand is a ``transpose`` used nowhere else is moved.
The program is otherwise bound again equation by equation, sub-programs
(scan bodies, ``jax.checkpoint``, ``jit``) included, with their own
parameters.
"""

from __future__ import annotations

import jax
import jax.extend

# sums over devices that keep their operand's shape
_SUMS = frozenset({"psum_invariant", "psum"})


def reduce_before_transpose(fn):
  """``fn`` with each ``psum(transpose(a))`` in its traced program run as
  ``transpose(psum(a))``; same outputs, same pytree."""
  def wrapped(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = _rewrite(closed.jaxpr)
    if jaxpr is not None:
      closed = jax.extend.core.ClosedJaxpr(jaxpr, closed.consts)
    outs = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
  return wrapped


def count_sums_of_transposes(jaxpr) -> int:
  """How many sums over devices in ``jaxpr`` (sub-programs included) take
  a transpose's output: what :func:`reduce_before_transpose` removes."""
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  n = 0
  for e in jaxpr.eqns:
    if e.primitive.name in _SUMS and len(e.invars) == 1:
      src = producer.get(e.invars[0])
      n += src is not None and src.primitive.name == "transpose"
    n += sum(count_sums_of_transposes(s)
             for s in jax.extend.core.jaxprs_in_params(e.params))
  return n


def _rewrite(jaxpr):
  """``jaxpr`` rewritten, or ``None`` when nothing in it changes."""
  uses: dict = {}
  for v in [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars):
    if isinstance(v, jax.extend.core.Var):
      uses[v] = uses.get(v, 0) + 1
  producer = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.outvars}
  moved: set = set()               # transposes now placed after their sum
  out: list = []
  changed = False
  for e in jaxpr.eqns:
    params = _rewrite_params(e.params)
    if params is not None:
      e = e.replace(params=params)
      changed = True
    src = (producer.get(e.invars[0]) if e.primitive.name in _SUMS
           and len(e.invars) == 1 and len(e.outvars) == 1
           and isinstance(e.invars[0], jax.extend.core.Var) else None)
    t = None if src is None else jaxpr.eqns[src]
    if t is None or t.primitive.name != "transpose" or uses[e.invars[0]] != 1:
      out.append(e)
      continue
    summed = jax.extend.core.Var(_untransposed(e.outvars[0].aval,
                                               t.params["permutation"]))
    out += [e.replace(invars=list(t.invars), outvars=[summed]),
            t.replace(invars=[summed], outvars=list(e.outvars))]
    moved.add(id(t))
    changed = True
  if not changed:
    return None
  return jaxpr.replace(eqns=[e for e in out if id(e) not in moved])


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
  return aval.update(shape=tuple(shape), sharding=sharding.update(
      spec=jax.sharding.PartitionSpec(*back)))


def _rewrite_params(params):
  """An equation's parameters with its sub-programs rewritten, or ``None``
  when none changes."""
  out, changed = dict(params), False
  for name, value in params.items():
    many = isinstance(value, (tuple, list))
    new = [_rewrite_program(v) for v in (value if many else (value,))]
    if any(n is not None for n in new):
      kept = [v if n is None else n
              for v, n in zip(value if many else (value,), new)]
      out[name] = type(value)(kept) if many else kept[0]
      changed = True
  return out if changed else None


def _rewrite_program(value):
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    jaxpr = _rewrite(value.jaxpr)
    return None if jaxpr is None else jax.extend.core.ClosedJaxpr(
        jaxpr, value.consts)
  if isinstance(value, jax.extend.core.Jaxpr):
    return _rewrite(value)
  return None
