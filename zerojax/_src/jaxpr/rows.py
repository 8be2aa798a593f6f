"""Rows of a function's outputs from rows of some of its inputs.

The offloaded update streams a layer stack ``W[L, ...]`` and its optimizer
state through the device a few layers at a time
(:mod:`zerojax._src.step.offload`). That gives the whole update's numbers
only where each output row ``r`` of the stack's update and new state is
computed from row ``r`` of its inputs by the same operations, and
everything else it reads (clipping's global norm, the step count) does
not depend on the stack's weights or state. This module reads that from
the update's jaxpr and evaluates it that way.

Every value of the jaxpr gets a role from its inputs':

* *free*: it reads none of the row inputs; it can be computed whole (the
  gradients, a global norm, a bias correction).
* *row*: its leading dimension is the rows', and row ``r`` reads only row
  ``r`` of the row inputs: it is the output of an elementwise equation, or
  of a broadcast that keeps the leading dimension, whose operands are rows
  or free.
* anything else reads the row inputs some other way (a norm over the whole
  stack, as LAMB's trust ratio, or Adafactor's factored moments), or is
  the output of an equation this module does not re-bind (a change of
  mesh or sharding type, a callback, a loop: :data:`_WHOLE`). An output
  of that kind cannot be computed a few rows at a time; the caller streams
  the leaf whole.

Where a row equation needs a free value's rows and that value is itself
the output of a row equation, they are computed from its operands' rows,
so no whole-stack temporary is made for a few rows' sake. The free values
the outputs read whole are computed whole, in the jaxpr's order, and no
others: not those only other leaves' outputs read, nor a gradient whose
rows alone are read. A free input may come both whole and by rows
(:class:`Lazy`: a gradient sliced before its cast to the master dtype),
and row equations then read its rows. A branch (``cond``:
``apply_if_finite``, ``MultiSteps``) is read into (:func:`_cond`): an
output is a row where some branch makes it one and none other, and its
rows come from a ``lax.switch`` over the branches computing those rows.
Rows so computed are the same operations on the same elements as the
whole stack's; a compiler that contracts multiply-adds to FMA
instructions in other places in the two programs rounds them apart in
the last bits (docs/design.md). Plain calls (``jit``,
``custom_jvp_call``...) are read through, as in
:mod:`zerojax._src.jaxpr.deps`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zerojax._src.jaxpr import deps as _deps

# equations whose output element reads only the same element of every
# operand of the output's shape (operands of shape () are scalars, read
# whole)
_ELEMENTWISE = frozenset(
  """abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type
  cbrt ceil clamp clz complex conj convert_element_type copy copy_p cos cosh
  div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
  is_finite le lgamma digamma log log1p logistic lt max min mul ne neg
  nextafter not or population_count pow real reduce_precision rem round
  rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign
  sin sinh sqrt square sub tan tanh xor""".split()
)


# other equations re-bound as they are (whole, on free operands only): they
# read nothing but their operands and the context they are bound in is
# not theirs to change. Anything else (a change of mesh or sharding, a
# callback, a loop) is opaque: its outputs are not rows, and a
# stack whose update reads one streams whole.
_WHOLE = frozenset(
  """argmax argmin broadcast_in_dim concatenate cumsum cumprod cummax
  dot_general dynamic_slice expand_dims iota pad random_bits random_fold_in
  random_seed random_split random_unwrap random_wrap reduce_and reduce_max
  reduce_min reduce_or reduce_prod reduce_sum reshape rev slice squeeze
  threefry2x32 transpose unstack""".split()
)


class Lazy:
  """An argument given whole (``whole``) and by rows (``rows(span)``, the
  same values): an input read by rows where an equation reads it by rows
  is then never sliced from the whole value."""

  def __init__(self, whole, rows):
    self.whole, self.rows = whole, rows


class NotRows(Exception):
  """An output asked for reads the row inputs other than row by row."""


class _Value:
  """One value of the jaxpr: its role, and thunks for it whole (free
  values) and for rows ``[a, b)`` of it (free values of ``n`` leading
  rows, and row values). ``needs(kind)``: the ``(value, kind)`` pairs
  computing it ``kind`` (:data:`WHOLE` or :data:`ROWS`) reads directly."""

  def __init__(self, aval, role, whole=None, rows=None, needs=None):
    self.aval, self.role = aval, role
    self._whole, self._rows, self._needs = whole, rows, needs
    self._w = self._r = None

  def whole(self):
    if self._w is None:
      self._w = self._whole()
    return self._w

  def rows(self, span):
    if self._r is None:
      self._r = (
        self._rows() if self._rows is not None else _slice(self.whole(), span)
      )
    return self._r

  def needs(self, kind) -> list:
    if kind == ROWS and self._rows is None:
      return [(self, WHOLE)]  # sliced from the whole value
    return [] if self._needs is None else self._needs(kind)


FREE, ROW, OTHER = "free", "row", "other"
WHOLE, ROWS = "whole", "rows"  # what of a value is computed


def _slice(x, span):
  a, b = span
  return jax.lax.slice_in_dim(x, a, b, axis=0)


def _shape(v):
  return tuple(getattr(getattr(v, "aval", None), "shape", ()))


class Rows:
  """A closed jaxpr whose ``row_inputs`` are read by rows ``[a, b)`` of
  ``n``.

  ``Rows(closed, row_inputs, n).roles(outputs)`` says which outputs are
  computable by rows (no values needed); ``evaluate(args, span, outputs)``
  computes rows ``span`` of those outputs, ``args`` holding the row
  inputs' rows and the other inputs whole (``None`` for inputs the
  outputs do not read)."""

  def __init__(self, closed, row_inputs, n: int):
    self.closed, self.row_inputs, self.n = closed, frozenset(row_inputs), n

  def roles(self, outputs) -> list[str]:
    outs = self._walk(
      [None] * len(self.closed.jaxpr.invars), None, keep=self._needed(outputs)
    )
    return [outs[i].role for i in outputs]

  def evaluate(self, args, span, outputs) -> list:
    made = []
    outs = self._walk(list(args), span, made)
    for i in outputs:
      if outs[i].role == OTHER:
        raise NotRows(f"output {i} is not computable by rows")
    wanted = [outs[i] for i in outputs]
    _force(made, [(v, _kind(v)) for v in wanted])
    return [_rows_of(v, span) for v in wanted]

  def _needed(self, outputs) -> set[int]:
    """Indices of the jaxpr's equations the ``outputs`` read, directly or
    through other equations."""
    jaxpr = self.closed.jaxpr
    want = {
      jaxpr.outvars[i]
      for i in outputs
      if not _deps._is_literal(jaxpr.outvars[i])
    }
    needed = set()
    for k in range(len(jaxpr.eqns) - 1, -1, -1):
      eqn = jaxpr.eqns[k]
      if any(v in want for v in eqn.outvars):
        needed.add(k)
        want.update(v for v in eqn.invars if not _deps._is_literal(v))
    return needed

  def _walk(self, args, span, made=None, keep=None):
    jaxpr = self.closed.jaxpr
    ins = []
    for k, (var, x) in enumerate(zip(jaxpr.invars, args)):
      aval = var.aval
      if k in self.row_inputs:
        ins.append(_Value(aval, ROW, rows=lambda x=x: x))
      elif isinstance(x, Lazy):
        rows = None if span is None else (lambda x=x: x.rows(span))
        ins.append(_Value(aval, FREE, whole=lambda x=x: x.whole, rows=rows))
      else:
        ins.append(_Value(aval, FREE, whole=lambda x=x, k=k: _given(x, k)))
    made = [] if made is None else made
    return _run(
      jaxpr,
      list(self.closed.consts),
      ins,
      self.n,
      span,
      made,
      keep=keep,
    )


def _kind(value) -> str:
  return ROWS if _shape(value) else WHOLE


def _rows_of(value, span):
  """Rows of an output (a scalar free one: whole)."""
  return value.rows(span) if _shape(value) else value.whole()


def _demand(pairs, stop=frozenset()) -> tuple[set, list]:
  """The ``(value, kind)`` pairs computing ``pairs`` reads, themselves
  included, walking no further back than the values in ``stop`` (ids):
  their ``(id, kind)`` keys, and the pairs."""
  seen, todo, out = set(), list(pairs), []
  while todo:
    v, kind = todo.pop()
    if (id(v), kind) in seen:
      continue
    seen.add((id(v), kind))
    out.append((v, kind))
    if id(v) not in stop:
      todo.extend(v.needs(kind))
  return seen, out


def _force(made, pairs) -> None:
  """Computes whole, in ``made``'s order (the jaxpr's), each value that
  computing ``pairs`` reads whole, so that none is computed by a
  recursion as deep as its chain (a global norm sums every leaf). Nothing
  else is traced: not the other leaves' updates, nor a gradient's whole
  value where only its rows are read."""
  seen, _ = _demand(pairs)
  for v in made:
    if (id(v), WHOLE) in seen:
      try:
        v.whole()
      except NotRows:  # not given: raised where an output reads it
        pass


def _given(x, k):
  if x is None:
    raise NotRows(f"input {k} is read but was not given")
  return x


def _run(jaxpr, consts, ins, n, span, made, *, keep=None) -> list[_Value]:
  """Values for ``jaxpr``'s outputs; each equation's values (a call's
  included) are appended to ``made``. With ``keep`` (equation indices)
  the others are skipped, and the outputs they make are ``OTHER``."""
  env = {}
  for var, c in zip(jaxpr.constvars, consts):
    env[var] = _Value(var.aval, FREE, whole=lambda c=c: c)
  env.update(zip(jaxpr.invars, ins))

  def read(v):
    if _deps._is_literal(v):
      return _Value(getattr(v, "aval", None), FREE, whole=lambda v=v: v.val)
    return env[v]

  for k, eqn in enumerate(jaxpr.eqns):
    if keep is not None and k not in keep:
      continue
    outs = _equation(eqn, [read(v) for v in eqn.invars], n, span, made)
    made.extend(outs)
    env.update(zip(eqn.outvars, outs))
  return [
    read(v) if _deps._is_literal(v) or v in env else _Value(v.aval, OTHER)
    for v in jaxpr.outvars
  ]


def _equation(eqn, ins, n, span, made) -> list[_Value]:
  body = _deps.call_body(eqn)
  if body is not None:
    jaxpr, consts = body
    return _run(jaxpr, consts, ins, n, span, made)
  branches = _deps.cond_branches(eqn)
  if branches is not None:
    return _cond(eqn, branches, ins, n, span)
  roles = {x.role for x in ins}
  avals = [v.aval for v in eqn.outvars]
  name = getattr(eqn.primitive, "name", None)
  if name not in _ELEMENTWISE and name not in _WHOLE:
    return [_Value(a, OTHER) for a in avals]
  whole = _once(lambda: _bind(eqn, [x.whole() for x in ins]))
  mode = _row_mode(eqn, ins, n)
  if OTHER in roles or (ROW in roles and mode is None):
    return [_Value(a, OTHER) for a in avals]
  rows = None
  if mode is not None:
    rows = _once(lambda: _bind_rows(eqn, ins, mode, span))

  def needs(kind):
    if kind == WHOLE:
      return [(x, WHOLE) for x in ins]
    return [(x, ROWS if m else WHOLE) for x, m in zip(ins, mode)]

  role = ROW if ROW in roles else FREE
  return [
    _Value(
      a,
      role,
      whole=(lambda k=k: whole()[k]) if role == FREE else None,
      rows=None if rows is None else (lambda k=k: rows()[k]),
      needs=needs,
    )
    for k, a in enumerate(avals)
  ]


def _cond(eqn, branches, ins, n, span) -> list[_Value]:
  """A branch's outputs. Each branch is read with the operands' roles; an
  output is a row where some branch makes it one and none makes it
  other. The row outputs' rows are computed together, and each free
  output whole alone, by a ``lax.switch`` over the branches cut to them
  (:func:`_branch`). What of each operand the branches read is computed
  before the switch, outside it, and each branch reads those values only
  (:func:`_proxy`)."""
  avals = [v.aval for v in eqn.outvars]
  index, ops = ins[0], ins[1:]
  if index.role != FREE or _shape(index):
    return [_Value(a, OTHER) for a in avals]
  # each branch's values on the operands themselves: their roles and what
  # each reads (never computed)
  graphs = [_run(b.jaxpr, list(b.consts), ops, n, span, []) for b in branches]
  roles = []
  for j in range(len(avals)):
    got = {g[j].role for g in graphs}
    roles.append(OTHER if OTHER in got else ROW if ROW in got else FREE)
  stop = frozenset(map(id, ops))

  def switch(at, kind):
    _, reached = _demand([(g[j], kind) for g in graphs for j in at], stop)
    for v, k in reached:
      if id(v) in stop:
        try:
          v.whole() if k == WHOLE else v.rows(span)
        except NotRows:  # not given: raised where a branch reads it
          pass
    fns = [
      functools.partial(_branch, b, ops, at, kind, (n, span)) for b in branches
    ]
    return list(jax.lax.switch(index.whole(), fns))

  row = [j for j, r in enumerate(roles) if r == ROW]
  rows = _once(lambda: switch(row, ROWS))
  out = []
  for j, (a, role) in enumerate(zip(avals, roles)):
    if role == OTHER:
      out.append(_Value(a, OTHER))
      continue
    at, kind = (row, ROWS) if role == ROW else ([j], WHOLE)
    pairs = [(index, WHOLE)] + [(g[t], kind) for g in graphs for t in at]
    if role == ROW:
      t = row.index(j)
      thunks = {"rows": lambda t=t: rows()[t]}
    else:
      thunks = {"whole": lambda j=j: switch([j], WHOLE)[0]}
    out.append(_Value(a, role, **thunks, needs=lambda kind, p=pairs: p))
  return out


def _branch(closed, ops, at, kind, rows) -> list:
  """One branch's outputs ``at`` (``rows = (n, span)``: rows ``span`` of
  them, or whole), from what of the operands was computed before the
  switch."""
  (n, span), made = rows, []
  ins = [_proxy(x) for x in ops]
  outs = _run(closed.jaxpr, list(closed.consts), ins, n, span, made)
  wanted = [outs[j] for j in at]
  _force(made, [(v, kind) for v in wanted])
  got = []
  for j, v in zip(at, wanted):
    x = v.rows(span) if kind == ROWS else v.whole()
    dtype = closed.out_avals[j].dtype
    got.append(
      x if getattr(x, "dtype", None) == dtype else jnp.asarray(x, dtype)
    )
  return got


def _proxy(x) -> _Value:
  """Operand ``x`` as a branch reads it: what of it was computed before
  the switch (computed inside, a value would be the branch's and escape
  it when another equation reads it)."""

  def memo(name):
    got = getattr(x, name)
    if got is None:
      raise NotRows("a branch reads an operand that was not given")
    return got

  return _Value(
    x.aval, x.role, whole=lambda: memo("_w"), rows=lambda: memo("_r")
  )


def _once(fn):
  memo = []

  def call():
    if not memo:
      memo.append(fn())
    return memo[0]

  return call


def _bind(eqn, args):
  out = eqn.primitive.bind(*args, **eqn.params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _row_mode(eqn, ins, n):
  """Per operand, whether the equation reads it by rows (True) or whole
  (False) when computing rows of its output; None when the equation's
  output rows are not its operands' rows."""
  name = getattr(eqn.primitive, "name", None)
  if len(eqn.outvars) != 1:
    return None
  shape = _shape(eqn.outvars[0])
  if not shape or shape[0] != n:
    return None
  if name in _ELEMENTWISE:
    mode = []
    for x in ins:
      s = tuple(getattr(x.aval, "shape", ()))
      if s == shape:
        mode.append(True)
      elif s == () and x.role == FREE:
        mode.append(False)
      else:
        return None
    return mode
  if name == "broadcast_in_dim":
    dims = tuple(eqn.params["broadcast_dimensions"])
    s = tuple(ins[0].aval.shape)
    if dims and dims[0] == 0 and s[0] == n:
      return [True]
    if 0 not in dims and ins[0].role == FREE:
      return [False]
  return None


def _bind_rows(eqn, ins, mode, span):
  args = [x.rows(span) if m else x.whole() for x, m in zip(ins, mode)]
  params = dict(eqn.params)
  if eqn.primitive.name == "broadcast_in_dim":
    a, b = span
    params["shape"] = (b - a, *tuple(params["shape"])[1:])
  out = eqn.primitive.bind(*args, **params)
  return list(out) if eqn.primitive.multiple_results else [out]
