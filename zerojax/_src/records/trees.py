"""Where two trees differ: the first leaf whose shape or dtype differs
(:func:`tree_difference`), or the first leaf that stands at another key
path (:func:`path_difference`). Both name the leaf by its path, for
errors that say where."""

from __future__ import annotations

import jax

from zerojax._src.records.spec import leaf_dtype


def tree_difference(got, want):
  """Where two trees of arrays first differ: ``None`` when they match,
  ``("structure", got_def, want_def)``, or ``("leaf", path, got, want)``
  for the first leaf whose shape or dtype differs (``path``: keystr)."""
  got_l, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_l, want_def = jax.tree_util.tree_flatten_with_path(want)
  if got_def != want_def:
    return ("structure", got_def, want_def)
  for (path, g), (_, w) in zip(got_l, want_l):
    if tuple(g.shape) != tuple(w.shape) or leaf_dtype(g.dtype) != leaf_dtype(
      w.dtype
    ):
      return ("leaf", jax.tree_util.keystr(path), g, w)
  return None


def path_difference(got, want_def):
  """Where the leaves of tree ``got`` first stand at other key paths than
  those of tree structure ``want_def``: ``None`` when both name the same
  leaves in the same order, else ``(got_path, want_path)`` as ``keystr``
  strings, ``"(none)"`` where one tree has no leaf left.

  Containers that name leaves alike pass: a ``FrozenDict`` for a
  ``dict``, a list for a tuple, and a Flax ``nnx.State`` for its pure
  dict (a variable's ``.value`` step is not part of the name)."""
  if jax.tree.structure(got) == want_def:
    return None
  paths = lambda tree: [
    jax.tree_util.keystr(
      tuple(
        k
        for k in p
        if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")
      )
    )
    for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]
  got_p = paths(got)
  want_p = paths(jax.tree.unflatten(want_def, [0] * want_def.num_leaves))
  for i in range(max(len(got_p), len(want_p))):
    g = got_p[i] if i < len(got_p) else "(none)"
    w = want_p[i] if i < len(want_p) else "(none)"
    if g != w:
      return g, w
  return None
