"""Which sharded parameters a loss uses other than through :func:`gather`.

At stages 2-3 a loss receives each sharded parameter as a
:class:`~zerojax.ShardedParam`, a pytree node whose two array children (a
zero gradient sink and the local shard) are meaningless on their own. A loss
that reaches them some other way -- ``jax.tree.leaves(params)`` for an L2
term, ``optax.tree.norm(params)``, ``ravel_pytree(params)``, a
``jax.tree.map`` -- would compute on the shard (a wrong value at stage 3)
and send no gradient back through the reduce-scatter (a wrong gradient at
stages 2 and 3), with no error from JAX.

So zerojax reads the loss's traced program before using it. Starting from
the children of every :class:`ShardedParam`, it follows each value through
the jaxpr: into the bodies of ``scan``, ``while``, ``cond``,
``jax.checkpoint``, ``jit``, ``shard_map`` and custom-derivative calls (a
scan slicing a stacked layer is how a per-layer gather is meant to receive
it), and through ``pvary`` (a type cast). Any other equation that reads
such a value, or returning one from the loss, is an ungathered use. Only
the ``zerojax.gather`` call (a ``custom_vjp`` named :data:`GATHER_NAME`)
may consume them.

How the structured equations are read. JAX renames the parameters of its
structured primitives between releases (``scan`` lost ``num_consts`` and
``num_carry`` in 0.11), so the walker reads none of them by name. It finds
sub-programs by type (any ``Jaxpr`` / ``ClosedJaxpr`` among the
parameters) and lines their inputs and outputs up with the equation's from
counts and shapes alone: a ``scan``'s scanned inputs and stacked outputs
are the ones with one more dimension than the body's, and its carry is what
comes before them; a ``while``'s carry is its body's outputs; a ``cond``'s
operands follow its index. When an equation holds a sub-program that these
rules cannot line up, the walker raises :class:`AuditUnreadable` naming the
primitive and the JAX version: zerojax's limitation, never reported as a
misuse by the loss.

The check is conservative: a use it cannot prove harmless counts as
ungathered, and the train step then takes the exact whole-tree path
(``gather="auto"``) or raises (``gather="model"``). It runs at trace time
only, once per compilation.
"""

from __future__ import annotations

import jax
import jax.extend

from zerojax._src.comm.gather import GATHER_NAME

# Equations that only retag a value (no arithmetic): the taint passes through.
_PASS_THROUGH = frozenset({"pvary", "pcast"})
# Equations that call one sub-program once, its inputs and outputs 1:1 with
# the equation's (jit, remat, custom derivatives, shard_map, ...).
_CALL_LIKE = frozenset(
  {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "named_call",
    "remat",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "custom_lin",
    "shard_map",
    "xla_call",
    "custom_transpose_call",
  }
)


class AuditUnreadable(Exception):
  """zerojax could not line up a structured equation of the loss's traced
  program (its limitation, not the loss's fault)."""

  def __init__(self, primitive: str, detail: str):
    self.primitive = primitive
    super().__init__(
      f"zerojax could not read a '{primitive}' equation of the loss's "
      f"traced program ({detail}; JAX {jax.__version__})"
    )


def _jaxpr(j):
  return getattr(j, "jaxpr", j)  # ClosedJaxpr -> Jaxpr


def _subprograms(params) -> list:
  """Every sub-program among an equation's parameters, by type."""
  kinds = (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)
  out = []
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, kinds):
        out.append(_jaxpr(v))
  return out


def _ndim(v) -> int:
  return len(getattr(v.aval, "shape", ()))


def scan_counts(eqn, body) -> tuple[int, int]:
  """``(consts, carry)`` of a scan equation, from shapes alone.

  Inputs are consts, carry, scanned xs; outputs carry, stacked ys. A
  scanned input (stacked output) has one more dimension than the body's
  value; consts and carry have the same."""
  ins, outs = list(eqn.invars), list(eqn.outvars)
  if len(body.invars) != len(ins) or len(body.outvars) != len(outs):
    raise AuditUnreadable(
      "scan",
      f"{len(ins)} inputs / {len(outs)} outputs "
      f"against a body of {len(body.invars)} / "
      f"{len(body.outvars)}",
    )
  same_in = [_ndim(a) == _ndim(b) for a, b in zip(ins, body.invars)]
  same_out = [_ndim(a) == _ndim(b) for a, b in zip(outs, body.outvars)]
  n_unscanned = same_in.index(False) if False in same_in else len(ins)
  ncarry = same_out.index(False) if False in same_out else len(outs)
  ok = (
    all(not s for s in same_in[n_unscanned:])
    and all(not s for s in same_out[ncarry:])
    and ncarry <= n_unscanned
    and all(
      _ndim(a) == _ndim(b) + 1
      for a, b in zip(ins[n_unscanned:], body.invars[n_unscanned:])
    )
  )
  nconsts = n_unscanned - ncarry
  if ok:
    carry_in = body.invars[nconsts:n_unscanned]
    ok = all(
      a.aval.shape == b.aval.shape
      for a, b in zip(carry_in, body.outvars[:ncarry])
    )
  if not ok:
    raise AuditUnreadable(
      "scan", "carry and scanned operands do not line up by shape"
    )
  return nconsts, ncarry


class _Walker:
  """Propagates 'derived from sharded param i' through a jaxpr."""

  def __init__(self):
    self.misuse: dict[int, str] = {}  # leaf index -> first offending use

  def flag(self, tags, what):
    for t in tags:
      self.misuse.setdefault(t, what)

  def run(self, jaxpr, in_tags):
    """Walks ``jaxpr`` with ``in_tags[k]`` (frozenset of leaf indices) on
    its k-th invar; returns the tags of its outvars."""
    env = {}
    for v, t in zip(jaxpr.invars, in_tags):
      if t:
        env[v] = t
    get = lambda v: (
      env.get(v, frozenset()) if not _is_literal(v) else frozenset()
    )
    for eqn in jaxpr.eqns:
      tags = [get(v) for v in eqn.invars]
      if not any(tags):
        continue
      out = self._eqn(eqn, eqn.primitive.name, tags)
      for v, t in zip(eqn.outvars, out):
        if t:
          env[v] = t
    return [get(v) for v in jaxpr.outvars]

  def _eqn(self, eqn, name, tags):
    none = [frozenset()] * len(eqn.outvars)
    if name == "custom_vjp_call" and is_gather(eqn.params):
      return none  # the one proper use
    if name in _PASS_THROUGH:
      return [frozenset().union(*tags)] * len(eqn.outvars)
    subs = _subprograms(eqn.params)
    if not subs:  # arithmetic on a shard: a misuse
      self.flag(frozenset().union(*tags), name)
      return none
    if name == "scan" and len(subs) == 1:
      return self._scan(eqn, subs[0], tags)
    if name == "while" and len(subs) == 2:
      return self._while(eqn, subs, tags)
    if name == "cond":
      return self._cond(eqn, subs, tags)
    if name in _CALL_LIKE:
      body = _call_body(eqn, subs)
      if body is not None:
        return self.run(body, tags)
    raise AuditUnreadable(
      name,
      f"{len(subs)} sub-program(s) that do not "
      f"line up with its {len(eqn.invars)} inputs",
    )

  def _cond(self, eqn, branches, tags):
    if any(
      len(b.invars) != len(eqn.invars) - 1 or len(b.outvars) != len(eqn.outvars)
      for b in branches
    ):
      raise AuditUnreadable(
        "cond", "branches do not take the operands after the index"
      )
    self.flag(tags[0], "cond (as the branch index)")
    outs = [self.run(b, tags[1:]) for b in branches]
    return [frozenset().union(*ts) for ts in zip(*outs)]

  def _scan(self, eqn, body, tags):
    nc, ncarry = scan_counts(eqn, body)
    tags = list(tags)
    while True:  # carries: iterate to a fixed point
      out = self.run(body, tags)
      carry = [a | b for a, b in zip(tags[nc : nc + ncarry], out[:ncarry])]
      if carry == tags[nc : nc + ncarry]:
        return out
      tags[nc : nc + ncarry] = carry

  def _while(self, eqn, subs, tags):
    cond, body = _while_parts(eqn, subs)
    ncarry = len(eqn.outvars)
    bn, cn = len(body.invars) - ncarry, len(cond.invars) - ncarry
    cconsts, bconsts, carry = (
      tags[:cn],
      tags[cn : cn + bn],
      list(tags[cn + bn :]),
    )
    while True:
      self.flag(
        frozenset().union(*self.run(cond, cconsts + carry)),
        "while (in the loop condition)",
      )
      out = self.run(body, bconsts + carry)
      new = [a | b for a, b in zip(carry, out)]
      if new == carry:
        return carry
      carry = new


def _while_parts(eqn, subs):
  """``(cond, body)`` of a while equation: inputs are cond consts, body
  consts, carry; the body returns the carry, the cond one boolean."""
  ncarry = len(eqn.outvars)
  shapes = [v.aval.shape for v in eqn.outvars]

  def fits(cond, body):
    cn, bn = len(cond.invars) - ncarry, len(body.invars) - ncarry
    return (
      cn >= 0
      and bn >= 0
      and cn + bn + ncarry == len(eqn.invars)
      and len(cond.outvars) == 1
      and str(cond.outvars[0].aval.dtype) == "bool"
      and [v.aval.shape for v in body.outvars] == shapes
      and [v.aval.shape for v in body.invars[bn:]] == shapes
      and [v.aval.shape for v in cond.invars[cn:]] == shapes
    )

  for cond, body in ((subs[0], subs[1]), (subs[1], subs[0])):
    if fits(cond, body):
      return cond, body
  raise AuditUnreadable("while", "cond, body and carry do not line up")


def _call_body(eqn, subs):
  """The sub-program a call-like equation runs on its operands 1:1."""
  for s in subs:
    if len(s.invars) == len(eqn.invars) and len(s.outvars) == len(eqn.outvars):
      return s
  return None


def is_gather(params) -> bool:
  """A ``custom_vjp_call`` of :func:`zerojax.gather`, told by the function it
  calls (its debug info) or, failing that, by its backward rule's name."""
  for sub in _subprograms(params):
    info = getattr(sub, "debug_info", None)
    src = getattr(info, "func_src_info", None) or ""
    if src:
      return src.split(" ")[0] == GATHER_NAME
  return f"{GATHER_NAME}_bwd" in str(params.get("bwd", ""))


def _is_literal(v) -> bool:
  return isinstance(v, jax.extend.core.Literal)


def ungathered_uses(fn, args, tagged) -> dict[int, str]:
  """Traces ``fn(*args)`` and reports ungathered uses of tagged inputs.

  Args:
    fn: the function to trace (abstractly; nothing runs).
    args: its arguments (arrays or tracers).
    tagged: for each leaf of ``jax.tree.leaves(args)``, the sharded-param
      index it belongs to, or ``None``.

  Returns:
    ``{param index: the primitive that used it}``, empty when every tagged
    value reaches the loss only through ``zerojax.gather``.

  Raises:
    AuditUnreadable: the traced program holds an equation the walker cannot
      line up (errors raised while tracing ``fn`` propagate unchanged).
  """
  closed = jax.make_jaxpr(fn)(*args)
  jaxpr = closed.jaxpr
  if len(jaxpr.invars) != len(tagged):
    raise AuditUnreadable(
      "(the loss itself)",
      f"{len(jaxpr.invars)} traced inputs for {len(tagged)} argument leaves",
    )
  walker = _Walker()
  try:
    outs = walker.run(
      jaxpr, [frozenset() if t is None else frozenset({t}) for t in tagged]
    )
  except AuditUnreadable:
    raise
  except Exception as e:  # noqa: BLE001 -- an internal failure, named as such
    raise AuditUnreadable("?", f"{type(e).__name__}: {e}") from e
  walker.flag(
    frozenset().union(*outs) if outs else frozenset(),
    "the loss's output (returned without gathering)",
  )
  return walker.misuse


class _OnceWalker(_Walker):
  """Counts the :func:`zerojax.gather` calls each tagged input reaches.

  A tag is a leaf index, or ``(index, where)`` once the value has entered
  a place where one traced call stands for more than one call, or for
  none: a loop's constants or carry, a branch. A gather reached by such a
  tag, or reached twice, is flagged with ``where``, and so is any use
  other than a gather's. A scan's body is walked to its carry's fixed
  point uncounted, then once counted."""

  def __init__(self):
    super().__init__()
    self.count: dict[int, int] = {}
    self.counting = True

  def flag(self, tags, what):
    for t in tags:
      self.misuse.setdefault(t[0] if isinstance(t, tuple) else t, what)

  @staticmethod
  def _within(tags, where):
    return frozenset(t if isinstance(t, tuple) else (t, where) for t in tags)

  def _eqn(self, eqn, name, tags):
    if name == "custom_vjp_call" and is_gather(eqn.params):
      for t in frozenset().union(*tags):
        if isinstance(t, tuple):
          self.misuse.setdefault(*t)
        elif self.counting:
          self.count[t] = self.count.get(t, 0) + 1
      return [frozenset()] * len(eqn.outvars)
    if name not in _PASS_THROUGH and not _subprograms(eqn.params):
      self.flag(frozenset().union(*tags), f"through {name}")
      return [frozenset()] * len(eqn.outvars)
    return super()._eqn(eqn, name, tags)

  def _cond(self, eqn, branches, tags):
    where = "under a branch (cond)"
    return super()._cond(eqn, branches, [self._within(t, where) for t in tags])

  def _scan(self, eqn, body, tags):
    nc, ncarry = scan_counts(eqn, body)
    where = "in a scan's constants or carry (once per iteration)"
    tags = [
      self._within(t, where) if k < nc + ncarry else t
      for k, t in enumerate(tags)
    ]
    counting, self.counting = self.counting, False
    try:  # the carry's tags to their fixed point, uncounted
      while True:
        out = self.run(body, tags)
        carry = [
          a | self._within(b, where)
          for a, b in zip(tags[nc : nc + ncarry], out[:ncarry])
        ]
        if carry == tags[nc : nc + ncarry]:
          break
        tags[nc : nc + ncarry] = carry
    finally:
      self.counting = counting
    return self.run(body, tags)

  def _while(self, eqn, subs, tags):
    where = "in a while loop"
    return super()._while(eqn, subs, [self._within(t, where) for t in tags])


def gathered_other_than_once(fn, args, tagged) -> dict[int, str]:
  """Traces ``fn(*args)``; for each tagged input (``tagged`` as in
  :func:`ungathered_uses`) that does not reach exactly one
  :func:`zerojax.gather` call, run once, ``{index: how}``. An input
  gathered nowhere is not reported (its cotangent is zero)."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  if len(jaxpr.invars) != len(tagged):
    raise AuditUnreadable(
      "(the loss itself)",
      f"{len(jaxpr.invars)} traced inputs for {len(tagged)} argument leaves",
    )
  walker = _OnceWalker()
  walker.run(
    jaxpr, [frozenset() if t is None else frozenset({t}) for t in tagged]
  )
  found = dict(walker.misuse)
  for i, n in walker.count.items():
    if n > 1:
      found.setdefault(i, f"{n} times")
  return found
