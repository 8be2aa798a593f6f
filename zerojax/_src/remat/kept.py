"""Every tensor a block keeps, passed through a function of the caller's
(Pa: split over a mesh axis, then named) before the backward pass saves it.

A checkpoint policy decides which values of a block are saved, but not
how they are laid out: the saved value is the producing operation's output,
whole. To split the kept matmul outputs (and the tensors a block tags with
``checkpoint_name``) as Pa splits the block input, :func:`split_kept` traces
the block to a jaxpr and evaluates it again, equation by equation; after
each equation the policy keeps, the output goes through ``keep``, which
splits it, names the split value :data:`KEPT` (``checkpoint_name``) and
may give the rest of the block back its layout: a policy that saves
:data:`KEPT` saves the split value, and the original output is needed by
nothing the backward pass reads. Calls to ``jax.jit`` functions inside
the block are evaluated the same way, inside; other higher-order
equations (a nested ``scan``, ``cond``, custom derivative) are bound as
they are, so the policy keeps what it keeps inside them, whole.

Public API only: ``jax.make_jaxpr`` and ``jax.extend.core``'s equations,
re-bound with their primitives in their context (as ``jax.core.eval_jaxpr``
binds them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.extend import core as jex

# The name of every kept tensor after its split, for checkpoint policies.
KEPT = "zerojax_kept"

# The primitive of a jax.jit call inside a traced function.
_JIT = "jit"


def split_kept(fn: Callable, keeps: Callable, keep: Callable) -> Callable:
  """``fn`` with the output of every equation ``keeps(prim, *avals,
  **params)`` is true of passed through ``keep`` (which names what is to
  be saved :data:`KEPT`).

  ``fn(*args, **kwargs)`` may take and return any pytrees; the numbers are
  those of ``fn`` (``keep`` must not change values, only their layout).
  """

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    closed, out_shape = jax.make_jaxpr(
      lambda *a: fn(*a, **kwargs), return_shape=True
    )(*args)
    flat = _eval(
      closed.jaxpr, closed.consts, jax.tree.leaves(args), keeps, keep
    )
    return jax.tree.unflatten(jax.tree.structure(out_shape), flat)

  return wrapped


def _eval(jaxpr, consts, args, keeps, keep) -> list:
  env = {}

  def read(v):
    return v.val if isinstance(v, jex.Literal) else env[v]

  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = jit_body(eqn)
    if inner is not None and _has_kept(inner[0], keeps):
      outs = _eval(*inner, ins, keeps, keep)
    else:
      with eqn.ctx.manager:  # e.g. jax.experimental.compute_on
        outs = eqn.primitive.bind(
          *ins, **eqn.primitive.get_bind_params(eqn.params)
        )
      if not eqn.primitive.multiple_results:
        outs = [outs]
      if keeps(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params):
        outs = [keep(o) for o in outs]
    for var, val in zip(eqn.outvars, outs):
      if not isinstance(var, jex.DropVar):
        env[var] = val
  return [read(v) for v in jaxpr.outvars]


def jit_body(eqn):
  """``(jaxpr, consts)`` of a ``jax.jit`` call equation (a closed jaxpr on
  JAX 0.10, an open one without constants on 0.12), else ``None``."""
  inner = eqn.params.get("jaxpr")
  if eqn.primitive.name != _JIT:
    return None
  if isinstance(inner, jex.ClosedJaxpr):
    return inner.jaxpr, inner.consts
  if isinstance(inner, jex.Jaxpr) and not inner.constvars:
    return inner, []
  return None


def _has_kept(jaxpr, keeps) -> bool:
  """Whether ``jaxpr`` or a jit call in it has an equation ``keeps`` is
  true of."""
  for eqn in jaxpr.eqns:
    inner = jit_body(eqn)
    if inner is not None:
      if _has_kept(inner[0], keeps):
        return True
    elif keeps(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params):
      return True
  return False
