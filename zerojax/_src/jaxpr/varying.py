"""Where a per-device program types a per-device value as the same on every
device.

Inside ``jax.shard_map`` JAX types every value with the manual axes it
varies over. Stage 0 with one micro-batch relies on that type to sum each
replicated leaf's gradient (:func:`zerojax._src.step.grad.reduced_where_used`):
where the loss first combines the leaf with a value that varies over the
batch axes, JAX inserts an implicit ``pvary``, whose transpose is the
``psum`` of the leaf's cotangent.

A primitive whose result types the caller states -- ``jax.pure_callback``
and ``io_callback`` (their ``ShapeDtypeStruct`` results), an FFI call, a
custom kernel's abstract evaluation -- can return a value typed invariant
that in fact differs per device. Gradient that flows through such a value
meets no ``pvary`` and is never summed: the step would update with one
device's share of the gradient. :func:`dropped_varying` finds such
equations, so that the step reduces those leaves explicitly after the
backward pass instead (the same numbers as unsharded Optax either way).

A ``jax.custom_vjp`` is the other way a leaf's gradient can miss its sum.
Its backward rule is the user's, not the transpose of its forward, so no
implicit ``pvary`` in it is ever transposed: an operand typed the same on
every device (a replicated leaf passed straight in) must get a cotangent
typed so too. A rule computing it from its own rows (``x.T @ ct``) makes
JAX refuse the types; one computing it through a callback returns one
device's share, typed as the sum. :func:`custom_vjp_reach` finds the
inputs that reach an inexact ``custom_vjp`` operand not typed to vary over
all the batch axes; those leaves are then reduced explicitly.

The check is conservative. Every first-order equation whose operands vary
over a batch axis and whose array results do not is reported, unless it
is one of the collectives that sum or gather over the axis (their results
are the same on every device by construction). Equations holding
sub-programs (``jit``, ``scan``, ``cond``, ``while``, ``jax.checkpoint``,
custom derivatives) are read through their sub-programs. A type this JAX
release does not expose is reported too. :func:`custom_vjp_reach` follows
values through plain calls and ``scan`` by position (a scan's carry until
it reaches nothing more) and counts every operand of another loop or a
branch as reaching what its body reaches.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp

from zerojax._src.jaxpr import audit as _audit
from zerojax._src.jaxpr import deps as _deps

# results the same on every device by construction
_COLLECTIVES = frozenset(
  {
    "psum",
    "psum_invariant",
    "pmax",
    "pmin",
    "all_gather_invariant",
    "pbroadcast",
    "psum_invariant_start",
    "pbroadcast_start",
  }
)

UNREADABLE = "(types not readable)"


def varying_axes(aval) -> frozenset | None:
  """The manual axes ``aval`` is typed to vary over; ``None`` when this
  JAX release does not expose them."""
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  vma = getattr(aval, "vma", None)
  return None if vma is None else frozenset(vma)


def dropped_varying(jaxpr, axes) -> list[str]:
  """The primitives in ``jaxpr`` (a traced per-device program, sub-programs
  included) whose operands vary over one of ``axes`` while an array result
  is typed not to, collectives aside; :data:`UNREADABLE` once if a type
  cannot be read. Empty: every per-device value is typed as such."""
  axes = frozenset(axes)
  found: list[str] = []
  _walk(jaxpr, axes, found)
  return found


def _invariant_operands(e, axes):
  """The inexact array operands of ``e`` not typed to vary over all of
  ``axes``; ``None`` when a type cannot be read."""
  out = []
  for v in e.invars:
    aval = v.aval
    if not hasattr(aval, "shape") or not jnp.issubdtype(
      aval.dtype, jnp.inexact
    ):
      continue
    t = varying_axes(aval)
    if t is None:
      return None
    if axes - t:
      out.append(v)
  return out


def custom_vjp_reach(jaxpr, axes) -> frozenset[int] | None:
  """The positions of ``jaxpr.invars`` whose values reach an inexact
  operand of a ``jax.custom_vjp`` (sub-programs included) that is not
  typed to vary over all of ``axes``: a backward rule must return that
  operand's cotangent typed as the sum, which autodiff never makes for
  it. ``None`` when a type cannot be read."""
  try:
    return _reach(
      jaxpr,
      frozenset(axes),
      [frozenset((i,)) for i in range(len(jaxpr.invars))],
    )[1]
  except _Unreadable:
    return None


class _Unreadable(Exception):
  pass


def _reach(jaxpr, axes, in_deps):
  """``(the input positions each output of jaxpr carries, the positions
  reaching a custom_vjp operand typed invariant)``; ``in_deps``: the
  positions each input of jaxpr carries."""
  deps = dict(zip(jaxpr.invars, in_deps))

  def of(v):
    return frozenset() if hasattr(v, "val") else deps.get(v, frozenset())

  hit = frozenset()
  for e in jaxpr.eqns:
    ins = [of(v) for v in e.invars]
    if "custom_vjp" in e.primitive.name:
      bad = _invariant_operands(e, axes)
      if bad is None:
        raise _Unreadable
      hit = hit.union(*(of(v) for v in bad))
    body = _deps._call_body(e)
    if body is not None:
      outs, h = _reach(body, axes, ins)
      hit |= h
    elif e.primitive.name == "scan" and _scan_counts(e) is not None:
      outs, h = _reach_scan(e, axes, ins)
      hit |= h
    else:
      every = frozenset().union(*ins)
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        _, h = _reach(sub, axes, [every] * len(sub.invars))
        hit |= h
      outs = [every] * len(e.outvars)
    for o, d in zip(e.outvars, outs):
      deps[o] = d
  return [of(v) for v in jaxpr.outvars], hit


def _scan_counts(e):
  """``(consts, carry)`` of a scan equation from shapes
  (:func:`zerojax._src.jaxpr.audit.scan_counts`), ``None`` if they do not
  line up."""
  try:
    return _audit.scan_counts(e, e.params["jaxpr"].jaxpr)
  except (_audit.AuditUnreadable, KeyError, AttributeError):
    return None


def _reach_scan(e, axes, ins):
  """:func:`_reach` through a ``scan``: its body's inputs are the consts,
  the carry and the scanned slices, in the equation's order; the carry
  takes what the body's carry out reaches until nothing is added."""
  body = e.params["jaxpr"].jaxpr
  nc, nk = _scan_counts(e)
  carry = list(ins[nc : nc + nk])
  while True:
    outs, hit = _reach(body, axes, ins[:nc] + carry + ins[nc + nk :])
    grown = [c | o for c, o in zip(carry, outs[:nk])]
    if grown == carry:
      return carry + outs[nk:], hit
    carry = grown


def _walk(jaxpr, axes, found):
  for e in jaxpr.eqns:
    subs = list(jax.extend.core.jaxprs_in_params(e.params))
    if subs:
      for s in subs:
        _walk(s, axes, found)
      continue
    if e.primitive.name in _COLLECTIVES:
      continue
    ins = [varying_axes(v.aval) for v in e.invars if hasattr(v.aval, "shape")]
    outs = [varying_axes(v.aval) for v in e.outvars if hasattr(v.aval, "shape")]
    if any(t is None for t in ins + outs):
      if UNREADABLE not in found:
        found.append(UNREADABLE)
      continue
    wanted = frozenset().union(*ins) & axes
    if wanted and any(wanted - t for t in outs):
      found.append(e.primitive.name)
