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

Plain calls (``jit``, ``custom_jvp_call``...) are read through, as in
:mod:`zerojax._src.jaxpr.deps`, so a norm computed inside a jitted helper
is found; every value gets a number in the order the calls are read.
Anything else counts as reading all its operands.
"""

from __future__ import annotations

import dataclasses

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
    self.n_in = len(jaxpr.invars)
    ins = [self._new(v.aval) for v in jaxpr.invars]
    self.outs = self._inline(jaxpr, list(closed.consts), ins)
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
      if body is not None:
        outs = self._inline(body[0], body[1], args)
      else:
        outs = [self._new(v.aval) for v in eqn.outvars]
        self.eqns.append((eqn, args, outs))
      env.update(zip(eqn.outvars, outs))
    return [atom(v) for v in jaxpr.outvars]

  def reads(self, in_sets) -> list[frozenset]:
    """Per value, the union of ``in_sets`` (one per input) it is made from."""
    out = [frozenset()] * len(self.avals)
    out[: self.n_in] = [frozenset(s) for s in in_sets]
    for _, args, outs in self.eqns:
      got = frozenset().union(*(out[a] for a in args if isinstance(a, int)))
      for v in outs:
        out[v] = got
    return out

  def evaluate(self, args, wanted, given=None) -> list:
    """The values ``wanted`` (numbers or output atoms), computing only the
    equations they need, with the values ``given`` (``{number: value}``)
    taken as they are; ``args`` per input (None: not read)."""
    given = {} if given is None else given
    need = {a for a in wanted if isinstance(a, int) and a not in given}
    run = []
    for k in range(len(self.eqns) - 1, -1, -1):
      _, ins, outs = self.eqns[k]
      if any(v in need for v in outs):
        run.append(k)
        need.update(a for a in ins if isinstance(a, int) and a not in given)
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
      got = eqn.primitive.bind(*[get(a) for a in ins], **eqn.params)
      env.update(zip(outs, got if eqn.primitive.multiple_results else [got]))
    return [get(a) for a in wanted]

  def size(self, v: int) -> int:
    return int(np.prod(getattr(self.avals[v], "shape", ())))


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


def find(flat: Flat, groups, out_groups) -> Cut:
  """The cut of ``flat``'s outputs over input ``groups`` (one set of input
  positions each; ``out_groups``: per output the group it belongs to, or
  None for one every group's computation shares): walking back from the
  outputs, the first values made from two or more groups that outputs of
  two or more groups read (a global norm; a gradient clipped by it is
  read by its own group's outputs only, and computed from its operands).
  Its ``values`` are empty when no output reads two groups. Whether the
  outputs, given the cut, read one group each is the caller's to check
  (a concatenation of every gradient has no such cut)."""
  member = [
    frozenset(g for g, s in enumerate(groups) if i in s)
    for i in range(flat.n_in)
  ]
  touch = flat.reads(member)
  every = frozenset(range(len(groups)))
  readers = [frozenset()] * len(flat.avals)
  for a, g in zip(flat.outs, out_groups):
    if isinstance(a, int):
      readers[a] = readers[a] | (every if g is None else {g})
  for _, args, outs in reversed(flat.eqns):
    got = frozenset().union(*(readers[v] for v in outs))
    for a in args:
      if isinstance(a, int):
        readers[a] = readers[a] | got
  cut, seen = set(), set()
  todo = [a for a in flat.outs if isinstance(a, int)]
  while todo:
    v = todo.pop()
    if v in seen:
      continue
    seen.add(v)
    if len(touch[v]) >= 2 and len(readers[v]) >= 2:
      cut.add(v)
    elif v in flat.made_by:
      todo.extend(
        a for a in flat.eqns[flat.made_by[v]][1] if isinstance(a, int)
      )
  frontier = [set() for _ in groups]
  seen = set()
  todo = list(cut)
  while todo:
    v = todo.pop()
    if v in seen:
      continue
    seen.add(v)
    for a in flat.eqns[flat.made_by[v]][1]:
      if not isinstance(a, int):
        continue
      if len(touch[a]) >= 2:
        todo.append(a)
      elif len(touch[a]) == 1:
        frontier[next(iter(touch[a]))].add(a)
  return Cut(
    flat, tuple(sorted(cut)), tuple(tuple(sorted(f)) for f in frontier)
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
