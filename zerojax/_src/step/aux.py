"""The loss's aux over devices and micro-batches: the unsharded value.

The loss runs once per device and micro-batch, on its rows of the batch.
Each aux leaf is combined into what the same loss returns on the whole
batch, by what the leaf is:

* **per-example** (a dimension that follows the batch's rows: per-example
  losses, a mask, token counts per row): the rows of every micro-batch and
  device, in batch order, as one global array sharded by rows over the
  batch axes -- what a plain ``jax.jit`` of the loss over a row-sharded
  batch returns;
* **floating** otherwise: a batch mean (the mean over devices and
  micro-batches, which hold equal rows);
* **integer** otherwise (counts): summed.

A per-example leaf is told apart by its shape alone (:func:`row_dims`): the
loss is traced once more, abstractly (nothing computed), on a micro-batch
with every batch leaf's rows doubled, and a leaf dimension that doubles
with them follows the rows. A per-example leaf must be computed row by row
(row ``i`` from example ``i``), as a batch mean must be a mean: those are
the values whose device pieces make the unsharded one.

How the pieces travel: the per-device program returns the batch means and
counts reduced (replicated), and each per-example leaf stacked along a new
leading axis (one entry per device, sharded over the batch axes); both
trees keep the aux's structure, a placeholder where a leaf is of the other
kind, so their shardings are fixed before the loss is traced. Which leaves
are per-example is only known while tracing, so :class:`RowDims` carries it
out, and :func:`merge` puts the rows in place after the step's Auto region
(on an Explicit mesh the per-example leaf is then typed by rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class RowDims:
  """Filled while a step is traced: per aux leaf, the dimension that
  follows the batch's rows, or ``None`` (a batch mean or a count)."""

  def __init__(self):
    self.dims: tuple | None = None

  def set(self, dims):
    self.dims = tuple(dims)


def row_dims(aux, aux_on, mb) -> tuple:
  """Per leaf of ``aux`` (one micro-batch's, per device), the dimension
  that follows the batch's rows, or ``None``.

  ``aux_on(mb)`` computes the aux of micro-batch ``mb``. A loss that cannot take twice the rows
  (a fixed batch size inside) gives no verdict: every leaf is then a mean
  or a count. A leaf whose shape changes with the rows otherwise than by
  one dimension doubling is refused, naming it."""
  flat = jax.tree_util.tree_flatten_with_path(aux)[0]
  none = (None,) * len(flat)
  if not any(np.ndim(a) for _, a in flat):
    return none
  doubled = jax.tree.map(
    lambda x: jnp.concatenate([x, x]) if np.ndim(x) else x, mb
  )
  try:
    probe = jax.eval_shape(aux_on, doubled)
  except Exception:  # noqa: BLE001 -- a fixed batch size in the loss
    return none
  probed = jax.tree.leaves(probe)
  if len(probed) != len(flat):
    return none
  dims = []
  for (path, a), b in zip(flat, probed):
    shape, grown = tuple(np.shape(a)), tuple(b.shape)
    if shape == grown:
      dims.append(None)
      continue
    moved = [d for d, (m, n) in enumerate(zip(shape, grown)) if m != n]
    if (
      len(shape) != len(grown)
      or len(moved) != 1
      or grown[moved[0]] != 2 * shape[moved[0]]
    ):
      raise ValueError(
        f"zerojax: the loss's aux{jax.tree_util.keystr(path)} has shape "
        f"{shape} on each device, and {grown} when the device's rows "
        f"double: it changes with the batch, but not as one dimension of "
        f"rows. zerojax can combine a per-example leaf (one dimension "
        f"follows the rows), a batch mean (floats) or a count (integers). "
        f"Return the per-example values, or reduce them over the batch "
        f"inside the loss."
      )
    dims.append(moved[0])
  return tuple(dims)


def split(aux, dims):
  """``(reduced, rows)``: ``aux`` as two trees of its structure, the
  per-example leaves (``dims[i]`` not None) in ``rows`` and the others in
  ``reduced``, each with a scalar zero in the other's places."""
  leaves, tree = jax.tree.flatten(aux)
  hole = lambda: jnp.zeros((), jnp.float32)
  reduced = [hole() if d is not None else a for a, d in zip(leaves, dims)]
  rows = [a if d is not None else hole() for a, d in zip(leaves, dims)]
  return jax.tree.unflatten(tree, reduced), jax.tree.unflatten(tree, rows)


def per_device(rows, dims):
  """The per-device program's output for the ``rows`` tree: each
  per-example leaf with a leading axis of one (its device's entry), each
  placeholder as one zero, so every leaf is sharded by that axis."""
  leaves, tree = jax.tree.flatten(rows)
  return jax.tree.unflatten(
    tree,
    [
      a[None] if d is not None else jnp.zeros((1,), jnp.float32)
      for a, d in zip(leaves, dims)
    ],
  )


def rows_spec(batch_axes) -> P:
  """The stacked rows' spec, in and out of the per-device program."""
  return P(tuple(batch_axes))


def rows_sharding(mesh, batch_axes) -> NamedSharding:
  return NamedSharding(mesh, rows_spec(batch_axes))


def merge(reduced, stacked, dims):
  """One aux tree from :func:`split`'s two: the reduced leaves, and each
  per-example leaf's entries along ``stacked``'s leading axis (devices, or
  one device's micro-batches) joined along its row dimension in order --
  entry ``j`` holds rows ``j*m .. (j+1)*m - 1``, as the batch is split."""
  if reduced is None:
    return None
  r_leaves, tree = jax.tree.flatten(reduced)
  s_leaves = jax.tree.leaves(stacked)
  dims = dims or (None,) * len(r_leaves)
  out = []
  for a, s, d in zip(r_leaves, s_leaves, dims):
    if d is None:
      out.append(a)
      continue
    moved = jnp.moveaxis(s, 0, d)
    shape = moved.shape
    out.append(
      moved.reshape(shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2 :])
    )
  return jax.tree.unflatten(tree, out)
