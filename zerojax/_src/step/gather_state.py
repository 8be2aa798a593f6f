"""A :class:`~zerojax.ZeroState`'s leaves full, unpadded and replicated:
what unsharded Optax would hold (export, inspection, comparison)."""

from __future__ import annotations

import functools

import jax

from zerojax._src.records.mesh import auto_region
from zerojax._src.records.spec import ZeroState, gathered
from zerojax._src.step.deleted import reject_deleted
from zerojax._src.step.leaf_ops import fetch, weights


def gather_params(state: ZeroState, *, master: bool = False):
  """The full, unsharded params (replicated on every device).

  Args:
    state: a :class:`ZeroState`.
    master: return the master copy (e.g. fp32) where the policy keeps one,
      instead of the compute-dtype params. Use it for export.

  Returns:
    A pytree shaped like the params given to :func:`init`.

  Example:
    >>> full = zerojax.gather_params(state)
    >>> full["layers"]["kernel"].shape
    (4, 8, 8)
  """
  if not isinstance(state, ZeroState):
    raise TypeError(
      f"zerojax.gather_params: expected a ZeroState, got "
      f"{type(state).__name__}."
    )
  spec = state.spec
  masters = spec.masters(state.master if master else None)
  reject_deleted(state, "zerojax.gather_params")
  return spec.unflatten_params(
    _gather_weights(jax.tree.leaves(state.params), masters, tuple(spec.leaves))
  )


@functools.partial(jax.jit, static_argnums=2)
def _gather_weights(params, masters, records):
  """Each leaf's weights (``masters[i]`` where given, else ``params[i]``)
  full and replicated over the data axis. Keyed on the params' records
  alone: states of one params layout share the program, whatever their
  optimizer, and it takes no optimizer state as arguments."""
  if not records:
    return []

  def body(params, masters):
    return [
      r.place.constrain(weights(r, p, m), gathered(r.param))
      for p, m, r in zip(params, masters, records)
    ]

  outs = [r.place.sharding(gathered(r.param)) for r in records]
  return auto_region(records[0].place.mesh, body, outs)(params, masters)


def gather_leaf(state: ZeroState, index: int, *, master: bool = False):
  """Param leaf ``index`` (``jax.tree.leaves`` order) full and unpadded,
  replicated; the rest of the state is not touched (export, inspection)."""
  spec = state.spec
  m = spec.masters(state.master if master else None)[index]
  p = None if m is not None else jax.tree.leaves(state.params)[index]
  reject_deleted([p, m], f"zerojax.gather_leaf({index})", "leaf")
  return _gather_weights([p], [m], (spec.leaves[index],))[0]


def gather_opt_state(state: ZeroState):
  """The inner optimizer's state, full and unpadded (replicated): what
  unsharded Optax would hold, e.g. to inspect moments or compare runs."""
  if not isinstance(state, ZeroState):
    raise TypeError(
      f"zerojax.gather_opt_state: expected a ZeroState, got "
      f"{type(state).__name__}."
    )
  reject_deleted(state, "zerojax.gather_opt_state")
  return _gather_opt_jit(state.replace(key=None, model_state=None))


@jax.jit
def _gather_opt_jit(state: ZeroState):
  spec = state.spec

  def body(leaves):
    return [
      o.place.constrain(
        o.layout.to_logical(fetch(o.place, x, o.layout)), gathered(o.layout)
      )
      for x, o in zip(leaves, spec.opt_leaves)
    ]

  outs = [spec.sharding(gathered(o.layout)) for o in spec.opt_leaves]
  return jax.tree.unflatten(
    spec.opt_def, spec.region(body, outs)(jax.tree.leaves(state.opt_state))
  )
