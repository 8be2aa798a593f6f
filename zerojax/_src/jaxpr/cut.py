"""Values an update reads from every leaf's input: found, computed first,
then given.

With the gradients in host memory (``offload_grads``) each chunk of the
streamed update (:mod:`zerojax._src.step.offload`) brings down its own
leaves' gradients only. An update whose every leaf reads a value made
from all the gradients -- ``clip_by_global_norm``'s norm, the finiteness
``apply_if_finite`` checks -- cannot be computed a chunk at a time as it
is written. Those values are small (a scalar each), so they are computed
first: this module finds them in the update's jaxpr (the *cut*: the
values that read two or more groups of inputs, where every output's
chain of values reading at most one group meets them), computes them in
a pass that reads one group at a time (each group's *frontier*: the
values reading that group alone that the cut is made from), and then
evaluates the update with the cut's values given. The operations are the
jaxpr's own, on the same operands, so the numbers are the whole update's.
Where the cut found first holds large values made from a small one (the
finiteness ``apply_if_finite`` checks of gradients clipped by their
global norm), it is computed in passes (:func:`passes`): the small
values first (the norm), then the cut found again with them given. A
norm inside a branch (a clip under ``apply_if_finite``) is computed
before the branch (:func:`hoist`) so that the cut reaches it.

Plain calls (``jit``, ``custom_jvp_call``...) are read through, as in
:mod:`zerojax._src.jaxpr.deps`, so a norm computed inside a jitted helper
is found; every value gets a number in the order the calls are read. A
branch (``cond``) stays one equation, each of its outputs made from the
index and the operands it reads in any branch; the outputs wanted of it
are computed by a ``lax.switch`` over the branches cut to them, so a chunk
computes its own leaves' branch outputs only. Anything else counts as
reading all its operands.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.jaxpr import deps as _deps

# the most elements the cut, or one group's frontier, may hold: the values
# the pass keeps on the device between groups (a norm is one)
LIMIT = 1 << 16


class _Lit:
  def __init__(self, val):
    self.val = val


class Flat:
  """A closed jaxpr with its plain calls inlined and every value numbered:
  the inputs ``0 .. n_in - 1`` first, then constants and equations'
  outputs in order (a value's number exceeds those it is made from)."""

  def __init__(self, closed):
    jaxpr = closed.jaxpr
    self.avals: list = []
    self.consts: dict[int, object] = {}
    self.eqns: list = []  # (equation, operand atoms, output numbers)
    # per output of a branch equation: the operand atoms it reads (the
    # index first)
    self.branch_reads: dict[int, tuple] = {}
    self._branches: dict[tuple[int, int], Flat] = {}
    self.n_in = len(jaxpr.invars)
    ins = [self._new(v.aval) for v in jaxpr.invars]
    self.outs = self._inline(jaxpr, list(closed.consts), ins)
    self.avals_out = [v.aval for v in jaxpr.outvars]
    self.made_by = {
      v: k for k, (_, _, outs) in enumerate(self.eqns) for v in outs
    }

  def _new(self, aval) -> int:
    self.avals.append(aval)
    return len(self.avals) - 1

  def _inline(self, jaxpr, consts, ins) -> list:
    env = {}
    for var, c in zip(jaxpr.constvars, consts):
      env[var] = self._new(var.aval)
      self.consts[env[var]] = c
    env.update(zip(jaxpr.invars, ins))

    def atom(v):
      return _Lit(v.val) if _deps._is_literal(v) else env[v]

    for eqn in jaxpr.eqns:
      args = [atom(v) for v in eqn.invars]
      body = _deps.call_body(eqn)
      branches = _deps.cond_branches(eqn)
      if body is not None:
        outs = self._inline(body[0], body[1], args)
      else:
        outs = [self._new(v.aval) for v in eqn.outvars]
        self.eqns.append((eqn, args, outs))
      if body is None and branches is not None:
        read = [frozenset()] * len(outs)
        for b in branches:
          read = [r | d for r, d in zip(read, _deps.dependencies(b))]
        for v, r in zip(outs, read):
          self.branch_reads[v] = (args[0], *(args[1 + q] for q in sorted(r)))
      env.update(zip(eqn.outvars, outs))
    return [atom(v) for v in jaxpr.outvars]

  def inputs_of(self, v: int) -> tuple:
    """The atoms value ``v`` (an equation's output) is made from."""
    read = self.branch_reads.get(v)
    return self.eqns[self.made_by[v]][1] if read is None else read

  def reads(self, in_sets, given=frozenset()) -> list[frozenset]:
    """Per value, the union of ``in_sets`` (one per input) it is made from;
    a value ``given`` counts as made from none."""
    out = [frozenset()] * len(self.avals)
    out[: self.n_in] = [frozenset(s) for s in in_sets]

    def union(atoms):
      return frozenset().union(*(out[a] for a in atoms if isinstance(a, int)))

    for _, args, outs in self.eqns:
      got = union(args)
      for v in outs:
        if v in given:
          continue
        out[v] = union(self.branch_reads[v]) if v in self.branch_reads else got
    return out

  def evaluate(self, args, wanted, given=None, hoisted=None) -> list:
    """The values ``wanted`` (numbers or output atoms), computing only the
    equations they need, with the values ``given`` (``{number: value}``)
    taken as they are; ``args`` per input (None: not read). ``hoisted``:
    per branch equation, per branch its :class:`Cut` (:func:`hoist`)."""
    given = {} if given is None else given
    hoisted = {} if hoisted is None else hoisted
    need = {a for a in wanted if isinstance(a, int) and a not in given}
    run = []
    for k in range(len(self.eqns) - 1, -1, -1):
      _, _, outs = self.eqns[k]
      for v in outs:
        if v in need:
          need.update(
            a
            for a in self.inputs_of(v)
            if isinstance(a, int) and a not in given
          )
      if any(v in need for v in outs):
        run.append(k)
    env = dict(self.consts)

    def get(a):
      if isinstance(a, _Lit):
        return a.val
      if a in given:
        return given[a]
      if a < self.n_in:
        if args[a] is None:
          raise ValueError(f"zerojax: internal: input {a} read, not given")
        return args[a]
      return env[a]

    for k in reversed(run):
      eqn, ins, outs = self.eqns[k]
      if outs and outs[0] in self.branch_reads:
        mine = [v for v in outs if v in need]
        env.update(zip(mine, self._switch(k, mine, get, hoisted.get(k))))
        continue
      got = eqn.primitive.bind(*[get(a) for a in ins], **eqn.params)
      env.update(zip(outs, got if eqn.primitive.multiple_results else [got]))
    return [get(a) for a in wanted]

  def _switch(self, k: int, mine, get, cuts=None) -> list:
    """Branch equation ``k``'s outputs ``mine``: a ``lax.switch`` over its
    branches, each computing those outputs only, from the operands they
    read (the others are not given). With ``cuts`` (per branch), each
    branch's cut values are computed first, whatever the index, and
    given to it."""
    eqn, ins, outs = self.eqns[k]
    branches = _deps.cond_branches(eqn)
    at = [outs.index(v) for v in mine]
    read = {a for v in mine for a in self.branch_reads[v][1:]}
    ops = [get(a) if a in read else None for a in ins[1:]]
    fns, values = [], []
    for b, closed in enumerate(branches):
      if cuts is None:
        flat = self._branches.get((k, b))
        if flat is None:
          flat = self._branches[k, b] = Flat(closed)
        values.append(None)
      else:
        flat = cuts[b].flat
        values.append(flat.evaluate(ops, cuts[b].values))
      fns.append(functools.partial(_branch, flat, at, cuts and cuts[b], b))
    return list(jax.lax.switch(get(ins[0]), fns, (ops, values)))

  def size(self, v: int) -> int:
    return int(np.prod(getattr(self.avals[v], "shape", ())))


def _branch(flat: Flat, at, cut, b: int, operands) -> list:
  """Branch ``b``'s outputs at positions ``at`` (a literal one as an
  array of its type, as the equation makes it), with its ``cut``'s values
  given (None: it has none)."""
  ops, values = operands
  given = None if cut is None else dict(zip(cut.values, values[b]))
  got = flat.evaluate(ops, [flat.outs[j] for j in at], given)
  return [
    jnp.asarray(x, flat.avals_out[j].dtype)
    if isinstance(flat.outs[j], _Lit)
    else x
    for j, x in zip(at, got)
  ]


@dataclasses.dataclass(frozen=True)
class Cut:
  """The values read from two or more groups (``values``, in order) that
  the outputs read, and per group the values read from it alone that
  they are made from (``frontier``)."""

  flat: Flat
  values: tuple[int, ...]
  frontier: tuple[tuple[int, ...], ...]

  def sizes(self) -> list[int]:
    return [self.flat.size(v) for v in self.values]


def _readers(flat: Flat, n_groups: int, out_groups) -> list[frozenset]:
  """Per value, the groups whose outputs read it (``out_groups`` as for
  :func:`find`)."""
  every = frozenset(range(n_groups))
  readers = [frozenset()] * len(flat.avals)
  for a, g in zip(flat.outs, out_groups):
    if isinstance(a, int):
      got = every if g is None else g if isinstance(g, frozenset) else {g}
      readers[a] = readers[a] | got
  for _, _, outs in reversed(flat.eqns):
    for v in outs:
      for a in flat.inputs_of(v):
        if isinstance(a, int):
          readers[a] = readers[a] | readers[v]
  return readers


def hoist(closed, groups, out_groups):
  """``closed`` with each branch's own cut computed before the branch:
  the values a branch reads that are made from two or more groups and
  read by outputs of two or more (a global norm under
  ``apply_if_finite``) are computed whatever the index, from the
  branch's operands, and given to it, so that :func:`find` on the result
  reaches them. A branch in a branch is hoisted first. The operations
  are the branch's own on the same operands, so the taken branch's
  numbers are unchanged; ``closed`` itself when no branch has a cut.
  Arguments as for :func:`find`."""
  flat = Flat(closed)
  if not flat.branch_reads:
    return closed
  touch = _touch(flat, groups)
  readers = _readers(flat, len(groups), out_groups)
  inner = {}
  for k, (eqn, args, outs) in enumerate(flat.eqns):
    if not outs or outs[0] not in flat.branch_reads:
      continue
    ops = args[1:]
    gs = [
      {q for q, a in enumerate(ops) if isinstance(a, int) and g in touch[a]}
      for g in range(len(groups))
    ]
    og = [readers[v] for v in outs]
    cuts = []
    for b in _deps.cond_branches(eqn):
      b_flat = Flat(hoist(b, gs, og))
      cuts.append(find(b_flat, gs, og))
    if any(c.values for c in cuts):
      inner[k] = cuts
  if not inner:
    return closed
  return jax.make_jaxpr(
    lambda *a: flat.evaluate(list(a), flat.outs, hoisted=inner)
  )(*closed.in_avals)


def _touch(flat: Flat, groups, given=frozenset()) -> list[frozenset]:
  """Per value, the groups it is made from (a value ``given``: none)."""
  member = [
    frozenset(g for g, s in enumerate(groups) if i in s)
    for i in range(flat.n_in)
  ]
  return flat.reads(member, given)


def find(flat: Flat, groups, out_groups, given=frozenset()) -> Cut:
  """The cut of ``flat``'s outputs over input ``groups`` (one set of input
  positions each; ``out_groups``: per output the group it belongs to, a
  frozenset of groups, or None for one every group's computation
  shares): walking back from the outputs, the first values made from two
  or more groups that outputs of two or more groups read (a global norm; a gradient clipped by it is
  read by its own group's outputs only, and computed from its operands).
  Its ``values`` are empty when no output reads two groups. Whether the
  outputs, given the cut, read one group each is the caller's to check
  (a concatenation of every gradient has no such cut). The values
  ``given`` (an earlier pass's, :func:`passes`) count as made from no
  group."""
  touch = _touch(flat, groups, given)
  readers = _readers(flat, len(groups), out_groups)
  cut, seen = set(), set()
  todo = [a for a in flat.outs if isinstance(a, int)]
  while todo:
    v = todo.pop()
    if v in seen or v in given:
      continue
    seen.add(v)
    if len(touch[v]) >= 2 and len(readers[v]) >= 2:
      cut.add(v)
    elif v in flat.made_by:
      todo.extend(a for a in flat.inputs_of(v) if isinstance(a, int))
  frontier = [set() for _ in groups]
  seen = set()
  todo = list(cut)
  while todo:
    v = todo.pop()
    if v in seen:
      continue
    seen.add(v)
    for a in flat.inputs_of(v):
      if not isinstance(a, int):
        continue
      if len(touch[a]) >= 2:
        todo.append(a)
      elif len(touch[a]) == 1:
        frontier[next(iter(touch[a]))].add(a)
  return Cut(
    flat, tuple(sorted(cut)), tuple(tuple(sorted(f)) for f in frontier)
  )


# the most passes over the groups :func:`passes` makes
MAX_PASSES = 3


def passes(flat: Flat, groups, out_groups) -> list[Cut]:
  """The cut of ``flat`` computed in passes over the groups, each pass's
  values given to the next: where the cut holds large values made from
  a small one (a gradient clipped by the global norm, whose finiteness
  decides a branch), the small values they are made from whose own
  frontier is small (the norm) are computed in a pass first, and the
  cut is found again with them given (the finiteness of each clipped
  gradient is then one group's). Empty when there is no cut; the last
  pass is the cut found last, which :func:`too_large` may refuse."""
  out, given = [], frozenset()
  while True:
    c = find(flat, groups, out_groups, given)
    if not c.values:
      return out
    first = None
    if too_large(c) is not None and len(out) < MAX_PASSES - 1:
      first = _small_first(flat, _touch(flat, groups, given), c)
    if first is None:
      return [*out, c]
    out.append(first)
    given = given | frozenset(first.values)


def _small_first(flat: Flat, touch, c: Cut) -> Cut | None:
  """The part of ``c`` a pass can compute first: of the values made from
  two or more groups that ``c``'s values are made from, the small ones
  whose frontier (the one-group values they are made from) is small,
  where a value that is not one of them reads them; None where there is
  none."""
  front: dict[int, frozenset] = {}
  for _, _, outs in flat.eqns:
    for v in outs:
      if len(touch[v]) < 2:
        continue
      f = set()
      for a in flat.inputs_of(v):
        if isinstance(a, int) and len(touch[a]) == 1:
          f.add(a)
        elif isinstance(a, int) and len(touch[a]) >= 2:
          f |= front.get(a, frozenset())
      front[v] = frozenset(f)
  mixed, todo = set(), list(c.values)
  while todo:
    v = todo.pop()
    if v in mixed:
      continue
    mixed.add(v)
    todo.extend(
      a for a in flat.inputs_of(v) if isinstance(a, int) and len(touch[a]) >= 2
    )
  small = {
    v
    for v in mixed
    if flat.size(v) <= LIMIT
    and sum(flat.size(a) for a in front.get(v, ())) <= LIMIT
  }
  edge = {v for v in small if v in c.values}
  for v in mixed - small:
    edge.update(a for a in flat.inputs_of(v) if a in small)
  if not edge:
    return None
  frontier = [set() for _ in c.frontier]
  for v in edge:
    for a in front.get(v, ()):
      frontier[next(iter(touch[a]))].add(a)
  return Cut(
    flat, tuple(sorted(edge)), tuple(tuple(sorted(f)) for f in frontier)
  )


def too_large(c: Cut) -> str | None:
  """Why the cut is not small enough to keep between groups, or None."""
  if sum(c.sizes()) > LIMIT:
    shapes = [tuple(c.flat.avals[v].shape) for v in c.values]
    return f"a value made from every leaf's gradient has shape {max(shapes, key=np.prod)}"
  for f in c.frontier:
    if sum(c.flat.size(v) for v in f) > LIMIT:
      v = max(f, key=c.flat.size)
      return (
        "a value made from one leaf's gradient, of shape "
        f"{tuple(c.flat.avals[v].shape)}, goes into one made from all"
      )
  return None
