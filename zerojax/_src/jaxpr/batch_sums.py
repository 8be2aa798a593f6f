"""Sums over the batch that a loss takes of the batch alone: found in its
jaxpr, computed for the whole batch first, and put back where the loss
takes them.

A loss normalized by a count over its batch -- ``jnp.sum(ce * mask) /
jnp.sum(mask)``, ``jnp.mean(ce, where=mask)``, ``/ jnp.maximum(
jnp.sum(mask), 1)`` -- is not a mean over examples: on each device (and
micro-batch) it would divide by that piece's own count. Its divisor,
though, reads nothing but the batch, so the step can compute it for the
whole batch before the loss runs, and run the loss with that value in
place of its own piece's. The loss is then a sum over examples with a
divisor that does not depend on the piece, which the step adds up.

* :func:`candidates`: the equations of a loss's jaxpr (and of the
  ``jax.jit`` calls in it, as ``jnp.mean(where=)`` is) that read only the
  batch and give a scalar;
* :class:`Recorder`: set while :mod:`zerojax._src.jaxpr.batch_mean` reads
  the jaxpr, it takes each candidate the reading finds to be a sum over
  the rows (class ``S``, no constant added, from per-example values) as a
  value that does not depend on the rows (class ``C``): the whole batch's
  sum. The reading of the rest then says whether the loss is a mean or a
  sum over examples with those sums given;
* :func:`capture` evaluates the jaxpr's batch-only equations up to those
  sums (the params, key and model state left out: nothing the sums read);
* :func:`substitute` evaluates the whole jaxpr with the sums replaced by
  given values.

A sum over rows is additive over any split of the rows, so the whole
batch's is the sum over devices and micro-batches of each one's. Where a
piece's mask is all zero its own ``0 / 0`` never runs: the divisor the
loss reads is the whole batch's.

Equations are named by their path: their index in the jaxpr, then in the
``jax.jit`` bodies that hold them. Two traces of one loss (the check's,
the step's, where JAX adds per-device type casts) differ in paths but
not in the order the sums come in, so they are matched by order.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
from jax.extend import core as jex

from zerojax._src.jaxpr.classes import C, R, S
from zerojax._src.jaxpr.varying import varying_axes
from zerojax._src.remat.kept import jit_body

_RECORDER: contextvars.ContextVar = contextvars.ContextVar(
  "batch_sums", default=None
)
_PATH: contextvars.ContextVar = contextvars.ContextVar(
  "batch_sums_path", default=None
)
_ABSENT = object()  # a value the evaluation was not given (params, key)


@dataclasses.dataclass
class Recorder:
  """The candidates' paths, and those found to be sums over the rows, in
  the order the reading met them, with the literal factors each sum's
  terms were scaled by (a factor that changes with the rows, as
  ``jnp.sum(mask / rows)`` has, is not the whole batch's: two traces at
  two row counts must agree on them)."""

  candidates: frozenset
  found: list = dataclasses.field(default_factory=list)
  coefs: list = dataclasses.field(default_factory=list)  # (factors, where)
  optimistic: bool = False  # read a kernel as per example (:func:`assumed`)


@contextlib.contextmanager
def recording(recorder: Recorder | None):
  """Reads under it take ``recorder``'s sums as given (no-op for None)."""
  if recorder is None:
    yield
    return
  token, path = _RECORDER.set(recorder), _PATH.set(())
  try:
    yield
  finally:
    _PATH.reset(path)
    _RECORDER.reset(token)


def base():
  """The path of the jaxpr being read (None: not followed)."""
  return _PATH.get()


@contextlib.contextmanager
def within(here, e):
  """The body of equation ``e`` at path ``here`` is read at that path
  when it is a ``jax.jit`` call, not followed otherwise."""
  token = _PATH.set(here if jit_body(e) is not None else None)
  try:
    yield
  finally:
    _PATH.reset(token)


def visit(here, ins, outs) -> list:
  """``outs`` of the equation at path ``here``, with a candidate that
  sums per-example values over the rows taken as given."""
  rec = _RECORDER.get()
  if rec is None or here not in rec.candidates or len(outs) != 1:
    return outs
  (out,) = outs
  if (
    isinstance(out, S) and not out.offset and any(isinstance(c, R) for c in ins)
  ):
    rec.found.append(here)
    rec.coefs.append((out.coefs, out.at))
    return [C()]
  return outs


def assumed(e, ins) -> list | None:
  """In an optimistic reading, the classes of an equation no rule follows
  (a kernel) taken as per example: every per-example input laid out alike
  and every output with as many rows along that axis. None otherwise."""
  rec = _RECORDER.get()
  if rec is None or not rec.optimistic:
    return None
  rows = [(c, v) for c, v in zip(ins, e.invars) if isinstance(c, R)]
  if not rows or not all(isinstance(c, (R, C)) for c in ins):
    return None
  first, var = rows[0]
  if any((c.d, c.m) != (first.d, first.m) for c, _ in rows):
    return None
  size = var.aval.shape[first.d]
  for v in e.outvars:
    shape = getattr(v.aval, "shape", ())
    if len(shape) <= first.d or shape[first.d] != size:
      return None
  return [R(first.d, first.m)] * len(e.outvars)


def candidates(jaxpr, free) -> tuple:
  """``((path, primitive, dtype), ...)`` of the equations of ``jaxpr``
  (its inputs the batch's where ``free``) that read the batch and nothing
  but the batch and constants, and give one scalar, in program order."""
  out: list = []
  _free(jaxpr, [(f, f) for f in free], (), out)
  return tuple(out)


def batch_inputs(params, batch, rest) -> list[bool]:
  """``free`` for :func:`candidates` of a program traced on ``(params,
  batch, *rest)``: which of its flat inputs are the batch's."""
  count = lambda t: len(jax.tree.leaves(t))
  return [False] * count(params) + [True] * count(batch) + [False] * count(rest)


def signature(cands) -> tuple:
  """What two traces of one loss share of its :func:`candidates`."""
  return tuple(f"{name}:{dtype}" for _, name, dtype in cands)


def _free(jaxpr, flags, path, out) -> list:
  """Per output of ``jaxpr``, ``(free, reads the batch)``."""
  env = dict(zip(jaxpr.invars, flags))
  of = lambda v: (
    (True, False) if isinstance(v, jex.Literal) else env.get(v, (True, False))
  )  # literals and constants: free, not the batch
  for i, e in enumerate(jaxpr.eqns):
    here = (*path, i)
    ins = [of(v) for v in e.invars]
    free = all(f for f, _ in ins)
    batch = free and any(b for _, b in ins)
    if batch and len(e.outvars) == 1 and e.outvars[0].aval.shape == ():
      out.append((here, e.primitive.name, str(e.outvars[0].aval.dtype)))
    inner = jit_body(e)
    if inner is not None:
      outs = _free(inner[0], ins, here, out)
    else:
      outs = [(free, batch)] * len(e.outvars)
    for v, f in zip(e.outvars, outs):
      env[v] = f
  return [of(v) for v in jaxpr.outvars]


def capture(closed, args, free, paths) -> list:
  """The values at ``paths`` of ``closed`` evaluated on ``args`` where
  ``free`` (the batch's leaves), nothing else given."""
  got: dict = {}
  ins = [a if f else _ABSENT for a, f in zip(args, free)]
  _eval(closed.jaxpr, closed.consts, ins, (), _Given({}, frozenset(paths), got))
  missing = [p for p in paths if got.get(p, _ABSENT) is _ABSENT]
  if missing:
    raise RuntimeError(
      f"zerojax: the batch's sums at {missing} could not be computed from "
      f"the batch alone."
    )
  return [got[p] for p in paths]


def substitute(closed, args, values: dict) -> tuple[list, list]:
  """``closed``'s outputs on ``args`` twice: as it computes them, and
  with the equation at each path of ``values`` giving that value (cast to
  its type) instead. Only the equations that read a replaced value run
  twice."""
  plain, alt = _eval(
    closed.jaxpr, closed.consts, args, (), _Given(values, frozenset(), {})
  )
  return plain, [p if a is None else a for p, a in zip(plain, alt)]


@dataclasses.dataclass(frozen=True)
class _Given:
  subs: dict  # path -> the value its equation gives instead
  want: frozenset  # paths whose values to keep in ``got``
  got: dict


def _eval(jaxpr, consts, args, path, given: _Given, alts=None):
  """``(outputs, their replaced values or None)`` of ``jaxpr``."""
  env: dict = {}
  alt: dict = {}  # var -> its value with the replacements, where it differs
  read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
  read_alt = lambda v: (
    alt.get(v, read(v)) if not isinstance(v, jex.Literal) else v.val
  )
  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val, a in zip(jaxpr.invars, args, alts or [None] * len(args)):
    env[var] = val
    if a is not None:
      alt[var] = a
  marked = [*given.subs, *given.want]
  for i, eqn in enumerate(jaxpr.eqns):
    here = (*path, i)
    ins = [read(v) for v in eqn.invars]
    inner = jit_body(eqn)
    if inner is not None and any(p[: len(here)] == here for p in marked):
      alts_in = [
        alt.get(v) if not isinstance(v, jex.Literal) else None
        for v in eqn.invars
      ]
      outs, outs_alt = _eval(*inner, ins, here, given, alts_in)
    else:
      outs = _bind(eqn, ins)
      outs_alt = [None] * len(outs)
      if any(v in alt for v in eqn.invars if not isinstance(v, jex.Literal)):
        outs_alt = _bind(eqn, [read_alt(v) for v in eqn.invars])
      if here in given.subs:
        outs_alt = [_as(given.subs[here], eqn.outvars[0].aval)]
    if here in given.want:
      given.got[here] = outs[0]
    for var, val, a in zip(eqn.outvars, outs, outs_alt):
      if not isinstance(var, jex.DropVar):
        env[var] = val
        if a is not None:
          alt[var] = a
  outs = [read(v) for v in jaxpr.outvars]
  return outs, [
    None if isinstance(v, jex.Literal) else alt.get(v) for v in jaxpr.outvars
  ]


def _bind(eqn, ins) -> list:
  """``eqn`` applied to ``ins`` (absent where any input is)."""
  if any(x is _ABSENT for x in ins):
    return [_ABSENT] * len(eqn.outvars)
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
  return list(outs) if eqn.primitive.multiple_results else [outs]


def _as(value, aval):
  """``value`` typed as ``aval``: its dtype, and varying over the manual
  axes ``aval`` varies over (a per-device program's batch sum does)."""
  value = jax.numpy.asarray(value).astype(aval.dtype)
  axes = varying_axes(aval) or frozenset()
  have = varying_axes(jax.typeof(value)) or frozenset()
  if axes - have:
    value = jax.lax.pcast(value, tuple(sorted(axes - have)), to="varying")
  return value
