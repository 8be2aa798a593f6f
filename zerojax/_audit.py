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
``jax.checkpoint``, ``jit`` and custom-derivative calls (a scan slicing a
stacked layer is how a per-layer gather is meant to receive it), and through
``pvary`` (a type cast). Any other equation that reads such a value, or
returning one from the loss, is an ungathered use. Only the
``zerojax.gather`` call (a ``custom_vjp`` named :data:`GATHER_NAME`) may
consume them. The check is conservative: a use it cannot prove harmless
counts as ungathered, and the train step then takes the exact whole-tree
path (``gather="auto"``) or raises (``gather="model"``). It runs at trace
time only, once per compilation.
"""

from __future__ import annotations

import jax
import jax.extend

from zerojax._gather import GATHER_NAME

# Equations that only retag a value (no arithmetic): the taint passes through.
_PASS_THROUGH = frozenset({"pvary", "pcast"})
# Call-like equations whose single sub-jaxpr takes the operands 1:1.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _jaxpr(j):
  return getattr(j, "jaxpr", j)         # ClosedJaxpr -> Jaxpr


class _Walker:
  """Propagates 'derived from sharded param i' through a jaxpr."""

  def __init__(self):
    self.misuse: dict[int, str] = {}     # leaf index -> first offending use

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
    get = lambda v: env.get(v, frozenset()) if not _is_literal(v) else frozenset()
    for eqn in jaxpr.eqns:
      tags = [get(v) for v in eqn.invars]
      if not any(tags):
        continue
      name = eqn.primitive.name
      out = self._eqn(eqn, name, tags)
      for v, t in zip(eqn.outvars, out):
        if t:
          env[v] = t
    return [get(v) for v in jaxpr.outvars]

  def _eqn(self, eqn, name, tags):
    none = [frozenset()] * len(eqn.outvars)
    params = eqn.params
    if name == "custom_vjp_call" and _is_gather(params):
      return none                                   # the one proper use
    if name in _PASS_THROUGH:
      return [frozenset().union(*tags)] * len(eqn.outvars)
    if name == "scan":
      return self._scan(eqn, tags)
    if name == "while":
      return self._while(eqn, tags)
    if name == "cond":
      self.flag(tags[0], "cond (as the branch index)")
      outs = [self.run(_jaxpr(b), tags[1:]) for b in params["branches"]]
      return [frozenset().union(*ts) for ts in zip(*outs)]
    for key in _CALL_PARAMS:
      sub = params.get(key)
      if sub is not None and len(_jaxpr(sub).invars) == len(eqn.invars):
        return self.run(_jaxpr(sub), tags)
    self.flag(frozenset().union(*tags), name)
    return none

  def _scan(self, eqn, tags):
    p = eqn.params
    body = _jaxpr(p["jaxpr"])
    nc, ncarry = p["num_consts"], p["num_carry"]
    tags = list(tags)
    while True:                        # carries: iterate to a fixed point
      out = self.run(body, tags)
      carry = [a | b for a, b in zip(tags[nc:nc + ncarry], out[:ncarry])]
      if carry == tags[nc:nc + ncarry]:
        return out
      tags[nc:nc + ncarry] = carry

  def _while(self, eqn, tags):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = tags[:cn], tags[cn:cn + bn], list(tags[cn + bn:])
    while True:
      self.run(_jaxpr(p["cond_jaxpr"]), cconsts + carry)
      out = self.run(_jaxpr(p["body_jaxpr"]), bconsts + carry)
      new = [a | b for a, b in zip(carry, out)]
      if new == carry:
        return carry
      carry = new


def _is_gather(params) -> bool:
  """A ``custom_vjp_call`` of :func:`zerojax.gather`, told by the function it
  calls (its debug info) or, failing that, by its backward rule's name."""
  info = getattr(_jaxpr(params.get("call_jaxpr")), "debug_info", None)
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
  """
  closed = jax.make_jaxpr(fn)(*args)
  jaxpr = closed.jaxpr
  if len(jaxpr.invars) != len(tagged):
    raise RuntimeError("zerojax: could not line up the loss's inputs with its "
                       "traced program.")
  walker = _Walker()
  outs = walker.run(jaxpr, [frozenset() if t is None else frozenset({t})
                            for t in tagged])
  walker.flag(frozenset().union(*outs) if outs else frozenset(),
              "the loss's output (returned without gathering)")
  return walker.misuse
