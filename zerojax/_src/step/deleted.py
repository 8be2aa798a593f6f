"""A state (or params) whose arrays were donated to a step and deleted,
refused by path before anything runs."""

from __future__ import annotations

import jax


def is_concrete(x) -> bool:
  """An array with buffers (not a tracer: ``init`` may run under a trace)."""
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def deleted_leaf(tree):
  """``(path, array)`` of the first deleted array in ``tree``, or ``None``.
  One pass over the leaves; paths are built only when one is deleted."""
  if not any(is_concrete(x) and x.is_deleted() for x in jax.tree.leaves(tree)):
    return None
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if is_concrete(x) and x.is_deleted():
      return jax.tree_util.keystr(path), x
  return None


def reject_deleted(tree, where: str, what: str = "state"):
  """Raises a zerojax error naming ``tree``'s first deleted leaf, if any.

  Called before a program runs: JAX 0.10's compiled-call fast path does
  not always refuse a deleted (donated) buffer, and the process can die
  inside the runtime (measured on 0.10.2: SIGSEGV on the third call of a
  train step given a state it had donated, and on the first eager drop-in
  update after a user's jitted step donated the optimizer state). The
  check is one ``is_deleted`` per leaf."""
  found = deleted_leaf(tree)
  if not found:
    return
  path, x = found
  if what == "state":
    raise ValueError(
      f"{where}: state{path} {x.dtype}{list(x.shape)} has been deleted. "
      f"The train step donates the state it is given: go on with the "
      f"state it returns (state, metrics = step(state, batch)). Or this "
      f"state shares the buffers of params it was built from with another "
      f"state or array that a step took: zerojax.init holds params "
      f"already laid out as it stores them without a copy; pass copy=True "
      f"to zerojax.init for a state of its own."
    )
  raise ValueError(
    f"{where}: {what}{path} {x.dtype}{list(x.shape)} has been deleted, "
    f"most likely donated to a step: a zerojax train step (it donates "
    f"the state, and a state holds the params it was built from without "
    f"a copy) or a jitted step with donate_argnums. Pass live arrays: "
    f"what that step returned (zerojax.gather_params(state) for a "
    f"state's params), or build the state with copy=True to keep the "
    f"arrays you pass."
  )
