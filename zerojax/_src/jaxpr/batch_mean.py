"""Whether a loss is a mean over its batch's examples, read from its jaxpr.

zerojax runs the loss on each device's rows of the batch (and on each
micro-batch) and averages the results. That equals the loss on the whole
batch exactly when the loss is a mean over examples: ``c * sum_r g(row r)
+ k``, with ``g`` reading only its own row, ``c`` proportional to
``1 / rows`` and ``k`` independent of the batch. A contrastive loss (every
example against every other), batch statistics inside the loss, a mean
normalized by a count summed over the batch (tokens) or a sum over the
rows is not: on each device it is computed from that device's rows alone.

:func:`classify` interprets a jaxpr abstractly. Each value gets one class:

* ``C`` -- does not depend on the batch's rows (params, constants, scalar
  batch leaves), with the axes along which it is the same everywhere (a
  broadcast) and, for an ``iota``, the axis it counts along;
* ``R`` -- per example: a row axis ``d`` of size ``rows * m`` whose block
  ``[i*m, (i+1)*m)`` reads only example ``i`` (``m`` > 1 after a reshape
  that flattens rows with tokens);
* ``S`` -- linear in a sum over the rows, with the literal coefficients
  it was scaled by (one per term of a sum of such sums);
* ``X`` -- mixes examples (the reason): the loss is not a mean;
* ``U`` -- cannot be followed (a kernel, a collective, a reordering): no
  verdict.

The classification is run on two traces, at two row counts; a loss that
is ``S`` in both is a mean when every coefficient times the rows is the
same in both (``jnp.mean`` divides by the rows, a sum loss or a fixed
divisor does not).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from zerojax._src.jaxpr import audit as _audit
from zerojax._src.jaxpr import batch_sums as _batch_sums
from zerojax._src.jaxpr import deps as _deps
from zerojax._src.jaxpr import examples_indexing as _indexing
from zerojax._src.jaxpr import examples_layout as _layout
from zerojax._src.jaxpr import row_count as _row_count
from zerojax._src.jaxpr.classes import RK, C, Mixes, R, S, U, Unknown, X
from zerojax._src.jaxpr.examples import (
  BAKED,
  CUMULATIVE,
  ELEMENTWISE,
  REDUCE,
  SCATTERS,
  bake,
  baked,
  const,
  elementwise,
  fold,
  nonzero,
  where,
)


def classify(closed, in_classes, sums=None) -> tuple[list, tuple]:
  """``(the class of each output of closed, the factors baked into the
  examples' terms)`` for a ClosedJaxpr given its inputs' classes; with
  ``sums`` (a :class:`~zerojax._src.jaxpr.batch_sums.Recorder`), its
  candidates that sum the rows are taken as the whole batch's (given)."""
  consts = [const(np.asarray(c)) for c in closed.consts]
  token = BAKED.set([])
  try:
    with _batch_sums.recording(sums):
      outs = _run(closed.jaxpr, consts + list(in_classes))
    return outs, tuple(BAKED.get())
  finally:
    BAKED.reset(token)


def _run(jaxpr, ins):
  env = dict(zip(list(jaxpr.constvars) + list(jaxpr.invars), ins))
  # a body read with fewer classes than inputs: its consts
  for v in list(jaxpr.constvars) + list(jaxpr.invars):
    env.setdefault(v, C())

  def of(v):
    if hasattr(v, "val"):
      return const(np.asarray(v.val))
    return env[v]

  path = _batch_sums.base()
  for i, e in enumerate(jaxpr.eqns):
    ins = [of(v) for v in e.invars]
    if path is None:
      outs = _eqn(e, ins)
    else:  # reading with the batch's sums given
      with _batch_sums.within((*path, i), e):
        outs = _batch_sums.visit((*path, i), ins, _eqn(e, ins))
    for o, cls in zip(e.outvars, outs):
      env[o] = cls
  return [of(v) for v in jaxpr.outvars]


def verdict(outs, baked, rows, sums: bool = True) -> tuple[str, str]:
  """``("mean" | "sum" | "mixes" | "unknown", reason)`` from the loss's
  class in traces at ``rows[0]`` and ``rows[1]`` rows, and the factors each
  trace baked into the examples' terms (``outs[1]`` None: the loss could
  not be traced at the second). ``"sum"``: a sum over examples at factors
  that do not change with the rows and nothing added, so the devices'
  losses add up to the whole batch's; with ``sums`` False (a value the
  step averages) a sum is ``"mixes"``."""
  a, b = outs
  for c in (a, b):
    if isinstance(c, X):
      return "mixes", c.reason
  if b is not None:
    reason = _row_count.differs(baked)
    if reason is None and isinstance(a, C) and isinstance(b, C):
      reason = _row_count.constant_differs(a, b)
    if reason is not None:
      return "mixes", reason
  for c in (a, b):
    if isinstance(c, U):
      return "unknown", c.reason
  if isinstance(a, C):
    return "mean", ""
  if not isinstance(a, S):
    return "unknown", "a loss that is not a scalar"
  if b is None:
    return "unknown", (
      "the loss takes only one batch size, so its divisor cannot be read"
    )
  if not isinstance(b, S) or len(a.coefs) != len(b.coefs):
    return "unknown", "the loss's structure changes with the batch size"
  if _row_count.factors_differ(baked):
    return "unknown", (
      "each example's term is scaled by a number that changes with the "
      "batch size"
    )
  close = lambda x, y: math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-30)
  pairs = list(zip(a.coefs, b.coefs))
  if all(close(ca * rows[0], cb * rows[1]) for ca, cb in pairs):
    return "mean", ""
  factors = (
    f"{', '.join(f'{ca:.4g}' for ca, _ in pairs)} x the sums at {rows[0]} "
    f"rows, {', '.join(f'{cb:.4g}' for _, cb in pairs)} x at "
    f"{rows[1]}"
  )
  if not sums:
    return "mixes", (
      f"a sum over the examples not divided by their number (a sum, or a "
      f"fixed divisor): {factors}, where a mean's factors follow 1 / rows"
      f"{a.at}"
    )
  if all(close(ca, cb) for ca, cb in pairs):
    if not (a.offset or b.offset):
      return "sum", ""
    return "mixes", (
      f"a sum over the examples plus a term that is not one (a penalty or "
      f"a constant), which each device would add once{a.at}"
    )
  follows = [close(ca * rows[0], cb * rows[1]) for ca, cb in pairs]
  stays = [close(ca, cb) for ca, cb in pairs]
  if all(f or s for f, s in zip(follows, stays)):
    return "mixes", (
      f"sums over the examples weighed apart, a mean added to a sum or to "
      f"a ratio over the batch's counts: {factors}, where a mean's factors "
      f"follow 1 / rows and a sum's stay{a.at}. The step can average the "
      f"pieces' losses or add them up, not both: write the mean's term as "
      f"its sum divided by the whole batch's number of terms, passed as a "
      f"scalar batch leaf (jnp.sum(z) / batch['n']), or by a count the "
      f"loss takes of its batch (jnp.sum(z * mask) / jnp.sum(mask))"
    )
  return "mixes", (
    f"sums over the examples weighed apart (a divisor that changes with the "
    f"rows other than as 1 / rows): {factors}, where a mean's factors "
    f"follow 1 / rows and a sum's stay{a.at}"
  )


def _first_bad(ins):
  for c in ins:
    if isinstance(c, X):
      return c
  for c in ins:
    if isinstance(c, U):
      return c
  return None


def _eqn(e, ins):
  name = e.primitive.name
  n_out = len(e.outvars)
  bad = _first_bad(ins)
  if bad is not None:
    return [bad] * n_out
  if (
    name != "scan"
    and any(isinstance(c, RK) for c in ins)
    and _deps.call_body(e) is None
  ):
    return [
      U(f"rows split into chunks, read other than by a scan{where(e)}")
    ] * n_out
  if all(isinstance(c, C) for c in ins) and not _has_body(e):
    out = fold(e, ins) if n_out == 1 else C()
    if out.val is None and out.fill is None and not out.noise:
      out = dataclasses.replace(out, lits=_row_count.lits(ins))
    return [out] * n_out
  if name in ELEMENTWISE or name in ("dot_general", "concatenate", "stack"):
    _row_count.note(e, name, ins)
  try:
    if name in ELEMENTWISE:
      return [elementwise(e, name, ins)] * n_out
    rule = _RULES.get(name)
    if rule is not None:
      return rule(e, ins)
    body = _deps.call_body(e)
    if body is not None:
      jaxpr, consts = body
      start = len(BAKED.get())
      outs = _run(jaxpr, [const(np.asarray(c)) for c in consts] + ins)
      _row_count.locate(start, e)
      return [_located(c, e) for c in outs]
  except Unknown as u:
    return [U(f"{u.args[0]}{where(e)}")] * n_out
  except Mixes as x:
    return [X(f"{x.args[0]}{where(e)}")] * n_out
  except Exception:  # noqa: BLE001 -- a form this JAX release writes
    return [U(f"{name}, in a form zerojax does not read{where(e)}")] * n_out
  return _batch_sums.assumed(e, ins) or [U(f"{name}{where(e)}")] * n_out


_LINE = re.compile(r" at [^ ]+:\d+$")  # where() of an equation


def _located(c, e):
  """A verdict from a call's body (a jitted library function, whose body
  JAX may have traced from another line first) that names no line of the
  user's code names the call's."""
  if isinstance(c, (X, U)) and not _LINE.search(c.reason):
    return dataclasses.replace(c, reason=f"{c.reason}{where(e)}")
  return c


def _has_body(e) -> bool:
  return any(True for _ in jax.extend.core.jaxprs_in_params(e.params))


def _loop_join(a, b):
  if a == b:
    return a
  for c in (a, b):
    if isinstance(c, (X, U)):
      return c
  if isinstance(a, C) and isinstance(b, C):
    return C(a.uniform & b.uniform, lits=_row_count.joined(a, b))
  if isinstance(a, S) and isinstance(b, S):
    # a sum accumulated over the iterations (a chunked loss): its terms'
    # factors as a set, each checked to follow 1 / rows like any other
    return S(
      tuple(sorted(set(a.coefs) | set(b.coefs))),
      a.at or b.at,
      a.offset or b.offset,
    )
  if isinstance(a, R) and isinstance(b, R) and a.layout == b.layout:
    bake(b.scale)
    return baked(a)
  for x, y in ((a, b), (b, a)):
    if isinstance(x, C) and isinstance(y, R) and y.d in x.uniform:
      return baked(y)
    if isinstance(x, C) and isinstance(y, S):
      return dataclasses.replace(y, offset=y.offset or nonzero(x))
  return U("a loop carry that changes its layout over the rows")


def _scan(e, ins):
  p = e.params
  body = p["jaxpr"]
  if "num_consts" in p and "num_carry" in p:
    nc, nk = p["num_consts"], p["num_carry"]
  else:  # JAX releases that do not name them: from shapes
    nc, nk = _audit.scan_counts(e, body.jaxpr)
  consts, carry, xs = ins[:nc], list(ins[nc : nc + nk]), ins[nc + nk :]
  if any(isinstance(c, R) and c.d == 0 for c in xs):
    return _scan_over_rows(e, ins, nc, nk)
  chunks = any(isinstance(c, RK) for c in xs)
  if chunks:
    _running_sums(body.jaxpr, nc, nk)
    if any(isinstance(c, C) and 0 not in c.uniform for c in xs):
      # an iteration count or a per-chunk weight: chunks weighed apart
      raise Unknown("a scan over chunks of rows with a value per chunk")
  sliced = []
  for c in xs:
    if isinstance(c, RK):
      if c.d != 0:
        raise Unknown("a scan over chunks of rows along another axis")
      sliced.append(R(0, c.m, c.scale))  # one chunk's examples
    elif isinstance(c, R):
      sliced.append(dataclasses.replace(c, d=c.d - 1))
    elif isinstance(c, C):
      sliced.append(
        C(frozenset(a - 1 for a in c.uniform if a > 0), lits=c.lits)
      )
    else:
      sliced.append(c)
  for _ in range(8):
    outs = _run(
      body.jaxpr,
      [const(np.asarray(x)) for x in body.consts]
      + list(consts)
      + carry
      + sliced,
    )
    joined = [_loop_join(c, o) for c, o in zip(carry, outs[:nk])]
    if joined == carry:
      break
    carry = joined
  else:
    raise Unknown("a scan whose carry does not settle")
  if chunks and any(isinstance(c, R) for c in carry):
    # summed elementwise over the chunks, a carry adds up different examples
    raise Unknown("a running sum over chunks of rows that keeps the rows")
  ys = []
  for c in outs[nk:]:
    if chunks and isinstance(c, R):
      ys.append(RK(0, c.m, c.scale) if c.d == 0 else U("a chunk's rows moved"))
    elif isinstance(c, R):
      ys.append(dataclasses.replace(c, d=c.d + 1))
    elif isinstance(c, C):
      ys.append(C(frozenset(a + 1 for a in c.uniform), lits=c.lits))
    else:
      ys.append(c)
  return carry + ys


def _running_sums(jb, nc: int, nk: int) -> list[bool]:
  """Per carry of a scan body ``jb``: True for a running sum (``carry +
  term``, the carry used nowhere else, a weakly typed carry's cast
  aside), False for one passed through; raises :class:`Unknown` for any
  other carry, which could order or weigh the examples."""
  uses: dict = {}
  for v in [v for q in jb.eqns for v in q.invars] + list(jb.outvars):
    if not hasattr(v, "val"):
      uses[v] = uses.get(v, 0) + 1
  made = {o: q for q in jb.eqns for o in q.outvars}
  users = {v: q for q in jb.eqns for v in q.invars if not hasattr(v, "val")}
  summed = []
  for k in range(nk):
    cin, cout = jb.invars[nc + k], jb.outvars[k]
    while (  # a weakly typed carry's cast
      uses.get(cin) == 1
      and cin in users
      and users[cin].primitive.name in ("convert_element_type", "copy")
    ):
      cin = users[cin].outvars[0]
    q = made.get(cout)
    if cout is jb.invars[nc + k]:
      summed.append(False)
    elif (
      q is not None
      and q.primitive.name in ("add", "add_any")
      and cin in q.invars
      and uses.get(cin) == 1
      and uses.get(cout) == 1
    ):
      summed.append(True)
    else:
      raise Unknown(
        "a scan over the batch's rows whose carry is not a running sum"
      )
  return summed


def _scan_over_rows(e, ins, nc: int, nk: int):
  """A scan over the batch's rows (a loss computed chunk by chunk over its
  rows or tokens, each chunk within one example), read as the same
  program batched: when every carry is a running sum (``carry + term``,
  the carry used nowhere else) or passed through, the scan is ``init +
  sum_j term(xs[j])`` with ``ys[j]`` from ``xs[j]`` alone, which is
  ``jax.vmap`` of its body over the rows and a sum: that program's
  classes are the scan's. Any other use of a carry (a running maximum, a
  decay) orders or weighs the examples: unread."""
  body = e.params["jaxpr"]
  summed = _running_sums(body.jaxpr, nc, nk)
  body_fn = jax.extend.core.jaxpr_as_fun(body)

  def batched(consts, carry, xs):
    start = [jnp.zeros_like(c) if s else c for c, s in zip(carry, summed)]
    outs = jax.vmap(lambda x: body_fn(*consts, *start, *x))(xs)
    totals = [
      c + jnp.sum(t, axis=0) if s else c
      for c, t, s in zip(carry, outs[:nk], summed)
    ]
    return totals + list(outs[nk:])

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in e.invars]
  try:
    closed = jax.make_jaxpr(batched)(
      avals[:nc], avals[nc : nc + nk], avals[nc + nk :]
    )
  except Exception as err:  # noqa: BLE001 -- a body vmap cannot batch
    raise Unknown("a scan over the batch's rows") from err
  return _run(
    closed.jaxpr, [const(np.asarray(c)) for c in closed.consts] + list(ins)
  )


def _while(e, ins):
  p = e.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, carry = ins[:cn], ins[cn : cn + bn], list(ins[cn + bn :])
  body, cond = p["body_jaxpr"], p["cond_jaxpr"]
  for _ in range(8):
    outs = _run(
      body.jaxpr,
      [const(np.asarray(x)) for x in body.consts] + list(bconsts) + carry,
    )
    joined = [_loop_join(c, o) for c, o in zip(carry, outs)]
    if joined == carry:
      break
    carry = joined
  else:
    raise Unknown("a while loop whose carry does not settle")
  (pred,) = _run(
    cond.jaxpr,
    [const(np.asarray(x)) for x in cond.consts] + list(cconsts) + carry,
  )
  if not isinstance(pred, C):
    raise Unknown("a while loop whose length depends on the batch")
  return carry


def _cond(e, ins):
  if not isinstance(ins[0], C):
    raise Unknown("a branch chosen by the batch")
  branches = e.params["branches"]
  outs = None
  for b in branches:
    got = _run(b.jaxpr, [const(np.asarray(x)) for x in b.consts] + ins[1:])
    outs = (
      got if outs is None else [_loop_join(x, y) for x, y in zip(outs, got)]
    )
  return outs


_RULES = {
  "broadcast_in_dim": _layout.broadcast_in_dim,
  "reshape": _layout.reshape,
  "transpose": _layout.transpose,
  "squeeze": _layout.squeeze,
  "slice": _layout.static_slice,
  "dynamic_slice": _layout.dynamic_slice,
  "pad": _layout.pad,
  "rev": _layout.rev,
  "sort": _layout.sort,
  "top_k": _layout.top_k,
  "concatenate": _layout.concatenate,
  "stack": _layout.stack,
  "unstack": _layout.unstack,
  "split": _layout.split,
  "dot_general": _layout.dot_general,
  "conv_general_dilated": _layout.conv,
  "fft": _layout.fft,
  "reduce_window_sum": _layout.reduce_window,
  "reduce_window_max": _layout.reduce_window,
  "reduce_window_min": _layout.reduce_window,
  "gather": _indexing.gather,
  "call_hi_primitive": _indexing.high_level,
  "scan": _scan,
  "while": _while,
  "cond": _cond,
}
_RULES.update({n: _indexing.scatter for n in SCATTERS})
_RULES.update({n: _indexing.scatter for n in ("scatter-min", "scatter-max")})
_RULES.update({n: _layout.reduce for n in REDUCE})
_RULES.update({n: _layout.cumulative for n in CUMULATIVE})
