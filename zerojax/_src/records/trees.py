"""Leaves of pytrees: a leaf's name (:func:`leaf_name`) and dtype
(:func:`leaf_dtype`), and where two trees differ: the first leaf whose
shape or dtype differs (:func:`tree_difference`), or the first leaf that
stands at another key path (:func:`path_difference`), or the subtree
another tree's leaves stand under (:func:`subtree_under`). They name a
leaf by its path, for errors that say where: :func:`check_grads_tree`
raises one before gradients are applied."""

from __future__ import annotations

import jax
import numpy as np


def leaf_dtype(dtype):
  """``np.dtype`` of a leaf, or JAX's own dtype object for extended dtypes
  (typed PRNG keys in an optimizer state), which NumPy cannot interpret."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return dtype
  return np.dtype(dtype)


def leaf_name(key_path) -> str:
  """A leaf's key path as a ``keystr`` string, without the ``.value`` step
  a boxed leaf (a Linen ``Partitioned``, an NNX ``Variable``) flattens
  through: a leaf of an ``nnx.State`` and the same leaf of its pure dict
  (what ``nnx.Optimizer`` hands the optimizer) have one name."""
  return jax.tree_util.keystr(
    tuple(
      k
      for k in key_path
      if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")
    )
  )


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
  dict (:func:`leaf_name`)."""
  if jax.tree.structure(got) == want_def:
    return None
  paths = lambda tree: [
    leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]
  got_p = paths(got)
  want_p = paths(jax.tree.unflatten(want_def, [0] * want_def.num_leaves))
  for i in range(max(len(got_p), len(want_p))):
    g = got_p[i] if i < len(got_p) else "(none)"
    w = want_p[i] if i < len(want_p) else "(none)"
    if g != w:
      return g, w
  return None


def subtree_under(got, want_def) -> str | None:
  """The key path (``keystr``) of the subtree of tree structure
  ``want_def`` whose leaves are named as tree ``got``'s, each under it
  (``.fast`` for gradients of ``optax.LookaheadParams``' fast params),
  or ``None`` when there is none."""
  got_p = [
    leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(got)[0]
  ]
  want_p = [
    leaf_name(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(
      jax.tree.unflatten(want_def, [0] * want_def.num_leaves)
    )[0]
  ]
  if not got_p or len(got_p) >= len(want_p):
    return None
  for i, w in enumerate(want_p):
    if w.endswith(got_p[0]) and w != got_p[0]:
      prefix = w[: len(w) - len(got_p[0])]
      if want_p[i : i + len(got_p)] == [prefix + g for g in got_p]:
        return prefix
  return None


def check_grads_tree(grads, params_def, where: str) -> None:
  """Raises unless the gradients' leaves stand at the params' key paths:
  a gradient is applied to the param in its place, so another tree with
  as many leaves of the same shapes would update the wrong params."""
  diff = path_difference(grads, params_def)
  if diff is None:
    return
  under = subtree_under(grads, params_def)
  fix = (
    f"They are the params{under}'s: a wrapper that updates its params "
    f"from gradients of part of them goes around the drop-in, e.g. "
    f"optax.lookahead(zerojax.zero(inner, ...), ...)."
    if under
    else "Pass gradients with the params' structure, as "
    "zerojax.value_and_grad (or jax.grad) returns them."
  )
  raise ValueError(
    f"{where}: the gradients' tree is not the params': gradient "
    f"{diff[0]} stands where the params have {diff[1]} "
    f"({len(jax.tree.leaves(grads))} gradient leaves, "
    f"{params_def.num_leaves} param leaves). {fix}"
  )
