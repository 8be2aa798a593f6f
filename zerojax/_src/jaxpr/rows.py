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
so no whole-stack temporary is made for a few rows' sake; the other free
values the outputs read are computed whole, in the jaxpr's order (those
only other leaves' outputs read are not traced). A free input may come
both whole and by rows (:class:`Lazy`: a gradient sliced before its cast
to the master dtype), and row equations then read its rows. Rows so
computed are the same operations on the same elements as the whole
stack's; a compiler that contracts multiply-adds to FMA instructions in
other places in the two programs rounds them apart in the last bits
(docs/design.md). Plain calls (``jit``, ``custom_jvp_call``...) are read through, as in
:mod:`zerojax._src.jaxpr.deps`.
"""

from __future__ import annotations

import jax

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
# callback, a loop or branch) is opaque: its outputs are not rows, and a
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
  rows, and row values)."""

  def __init__(self, aval, role, whole=None, rows=None):
    self.aval, self.role = aval, role
    self._whole, self._rows = whole, rows
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


FREE, ROW, OTHER = "free", "row", "other"


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
    made, marks = [], []
    outs = self._walk(list(args), span, made, marks)
    for i in outputs:
      if outs[i].role == OTHER:
        raise NotRows(f"output {i} is not computable by rows")
    # the free values the outputs read, whole, in the jaxpr's order, so
    # that none is computed by a recursion as deep as its chain (a global
    # norm sums every leaf); the other leaves' updates are never traced
    needed = self._needed(outputs)
    for k, (start, end) in enumerate(marks):
      if k not in needed:
        continue
      for value in made[start:end]:
        if value.role == FREE:
          try:
            value.whole()
          except NotRows:
            pass
    return [
      outs[i].rows(span) if outs[i].role == ROW else _rows_of(outs[i], span)
      for i in outputs
    ]

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

  def _walk(self, args, span, made=None, marks=None, keep=None):
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
      marks=marks,
      keep=keep,
    )


def _rows_of(value, span):
  """Rows of a free output (one that reads no row input)."""
  return value.rows(span) if _shape(value) else value.whole()


def _given(x, k):
  if x is None:
    raise NotRows(f"input {k} is read but was not given")
  return x


def _run(
  jaxpr, consts, ins, n, span, made, *, marks=None, keep=None
) -> list[_Value]:
  """Values for ``jaxpr``'s outputs; each equation's values (a call's
  included) are appended to ``made``, and with ``marks`` given, each
  equation's ``(start, end)`` there. With ``keep`` (equation indices) the
  others are skipped, and the outputs they make are ``OTHER``."""
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
    start = len(made)
    outs = _equation(eqn, [read(v) for v in eqn.invars], n, span, made)
    made.extend(outs)
    env.update(zip(eqn.outvars, outs))
    if marks is not None:
      marks.append((start, len(made)))
  return [
    read(v) if _deps._is_literal(v) or v in env else _Value(v.aval, OTHER)
    for v in jaxpr.outvars
  ]


def _equation(eqn, ins, n, span, made) -> list[_Value]:
  body = _deps.call_body(eqn)
  if body is not None:
    jaxpr, consts = body
    return _run(jaxpr, consts, ins, n, span, made)
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
  role = ROW if ROW in roles else FREE
  return [
    _Value(
      a,
      role,
      whole=(lambda k=k: whole()[k]) if role == FREE else None,
      rows=None if rows is None else (lambda k=k: rows()[k]),
    )
    for k, a in enumerate(avals)
  ]


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
