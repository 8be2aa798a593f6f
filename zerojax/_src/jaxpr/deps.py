"""Which outputs of a function depend on which of its inputs.

The offloaded update and init (:mod:`zerojax._src.step.offload`) run an Optax
function on one chunk of the leaves at a time, the others replaced by
zeros. That is exact only when the chunk's outputs do not read the other
leaves, so it is checked first, from the function's jaxpr.

The analysis is conservative: every output of an equation depends on every
input of it, except for plain calls (``pjit``, ``closed_call``,
``custom_jvp_call``, ``custom_vjp_call``, ``remat``), whose body is read
the same way with its inputs and outputs matched by position. The body is
found by shape (a param holding a jaxpr with as many inputs and outputs as
the equation), not by a param name, so a JAX version that names or nests it
differently only makes the answer more conservative. A branch (``cond``,
as ``lax.cond``, ``lax.switch`` and ``optax.apply_if_finite`` write it)
is read per output: each depends on the branch index and on what that
output reads in any branch (:func:`cond_branches` finds them by shape
too). Loops (``scan``, ``while``) count as reading all their operands. A
separable function may thus be called coupled -- the exact whole-state path
is then taken -- but a coupled one is never called separable.
"""

from __future__ import annotations

import jax


def _is_literal(v) -> bool:
  # a jaxpr Literal carries its value; a Var does not
  return hasattr(v, "val")


def input_dependencies(fn, *flat_args) -> list[frozenset[int]] | None:
  """For each flat output of ``fn(*flat_args)``, the positions of the flat
  inputs it depends on.

  Args:
    fn: a function of ``len(flat_args)`` arrays returning a pytree.
    flat_args: arrays or ``jax.ShapeDtypeStruct``.

  Returns:
    One ``frozenset`` of input positions per leaf of the output, or ``None``
    when the function could not be traced to a jaxpr here (the caller then
    takes the path that needs no such knowledge).
  """
  closed = trace(fn, *flat_args)
  return None if closed is None else dependencies(closed)


def trace(fn, *flat_args):
  """``fn``'s closed jaxpr at ``flat_args``, or None when it cannot be
  traced here (or takes another number of inputs)."""
  try:
    closed = jax.make_jaxpr(fn)(*flat_args)
  except Exception:  # noqa: BLE001 - any failure means "unknown", not an error
    return None
  return closed if len(closed.jaxpr.invars) == len(flat_args) else None


def dependencies(closed) -> list[frozenset[int]]:
  """:func:`input_dependencies` of a closed jaxpr."""
  n = len(closed.jaxpr.invars)
  return _propagate(closed.jaxpr, [frozenset((i,)) for i in range(n)])


_CALLS = frozenset(
  {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "remat",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "custom_lin",
  }
)
_NONE = frozenset()


def _propagate(jaxpr, in_deps):
  deps = dict(zip(jaxpr.invars, in_deps))

  def of(v):
    return _NONE if _is_literal(v) else deps.get(v, _NONE)

  for eqn in jaxpr.eqns:
    ins = [of(v) for v in eqn.invars]
    body = _call_body(eqn)
    branches = cond_branches(eqn)
    if body is not None:
      outs = _propagate(body, ins)
    elif branches is not None:
      outs = [ins[0]] * len(eqn.outvars)
      for b in branches:
        outs = [o | d for o, d in zip(outs, _propagate(b.jaxpr, ins[1:]))]
    else:
      outs = [_NONE.union(*ins)] * len(eqn.outvars)
    for o, d in zip(eqn.outvars, outs):
      deps[o] = d
  return [of(v) for v in jaxpr.outvars]


def _call_body(eqn):
  """The jaxpr a plain call equation runs, or None (then: all-to-all)."""
  if getattr(eqn.primitive, "name", None) not in _CALLS:
    return None
  for value in getattr(eqn, "params", {}).values():
    body = getattr(value, "jaxpr", value)  # ClosedJaxpr -> Jaxpr
    if (
      hasattr(body, "eqns")
      and hasattr(body, "invars")
      and len(body.invars) == len(eqn.invars)
      and len(body.outvars) == len(eqn.outvars)
    ):
      return body
  return None


def call_body(eqn):
  """``(jaxpr, consts)`` a plain call equation runs, or None."""
  if getattr(eqn.primitive, "name", None) not in _CALLS:
    return None
  for value in getattr(eqn, "params", {}).values():
    body = getattr(value, "jaxpr", value)
    if (
      hasattr(body, "eqns")
      and len(body.invars) == len(eqn.invars)
      and len(body.outvars) == len(eqn.outvars)
    ):
      consts = list(getattr(value, "consts", ()))
      if len(consts) != len(body.constvars):
        return None
      return body, consts
  return None


def cond_branches(eqn):
  """The branches (closed jaxprs) of a ``cond`` equation -- its first
  operand the branch index, the others every branch's inputs -- or None."""
  if getattr(eqn.primitive, "name", None) != "cond":
    return None
  branches = getattr(eqn, "params", {}).get("branches")
  if not isinstance(branches, (tuple, list)) or not branches:
    return None
  for b in branches:
    body = getattr(b, "jaxpr", None)
    if (
      not hasattr(body, "eqns")
      or len(body.invars) != len(eqn.invars) - 1
      or len(body.outvars) != len(eqn.outvars)
      or len(getattr(b, "consts", ())) != len(body.constvars)
    ):
      return None
  return tuple(branches)
