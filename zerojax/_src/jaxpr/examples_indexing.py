""":mod:`zerojax._src.jaxpr.batch_mean`'s rules for indexing: a gather
or a scatter keeps the examples apart where each output row reads only its
own example's rows, and weighs them by position where it picks rows by
known indices."""

from __future__ import annotations

import dataclasses

import numpy as np

from zerojax._src.jaxpr import row_count as _row_count
from zerojax._src.jaxpr.classes import IX, C, Mixes, R, S, Unknown
from zerojax._src.jaxpr.examples import bake, shape_of


def gather(e, ins):
  operand, indices = ins[0], ins[1]
  dn = e.params["dimension_numbers"]
  sizes = e.params["slice_sizes"]
  op_shape = shape_of(e.invars[0])
  out_rank = len(shape_of(e.outvars[0]))
  offset = tuple(dn.offset_dims)
  batch_out = [i for i in range(out_rank) if i not in offset]
  op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  if isinstance(operand, S) or isinstance(indices, S):
    raise Unknown("a gather with a sum over the batch")
  if isinstance(operand, C):
    if isinstance(indices, R):
      # a table the examples look up: the same in every piece of the batch
      _row_count.note_whole(e, 0, operand)
      return [R(batch_out[indices.d], indices.m)]
    raise Unknown("a gather with an index built from the rows")
  if isinstance(indices, R):
    bake(indices.scale)
  # operand per example
  if isinstance(indices, IX):
    comps = [indices.comps[j] for j, d in enumerate(dn.start_index_map)]
    ok = (
      operand.m == 1
      and operand.d in dn.start_index_map
      and comps[list(dn.start_index_map).index(operand.d)] == "I"
      and operand.d in dn.collapsed_slice_dims
      and not op_batching
    )
    if ok:
      return [R(batch_out[indices.d], 1, operand.scale)]
    raise Unknown("a gather across the rows")
  if isinstance(indices, C) and operand.d in dn.start_index_map:
    picked = _picked_rows(e, indices, operand)
    if picked is not None:
      return picked
  if operand.d in op_batching:
    j = idx_batching[list(op_batching).index(operand.d)]
    if (isinstance(indices, R) and indices.d == j) or (
      isinstance(indices, C) and j in indices.uniform
    ):
      return [R(batch_out[j], operand.m, operand.scale)]
    raise Unknown("a batched gather across the rows")
  kept = [
    i
    for i in range(len(op_shape))
    if i not in dn.collapsed_slice_dims and i not in op_batching
  ]
  if (
    isinstance(indices, C)
    and operand.d in kept
    and operand.d not in dn.start_index_map
    and sizes[operand.d] == op_shape[operand.d]
  ):
    return [dataclasses.replace(operand, d=offset[kept.index(operand.d)])]
  raise Unknown("a gather across the rows")


def _picked_rows(e, indices: C, operand: R):
  """Examples gathered by known constant indices: the same rows in order
  are the examples themselves; a pick that takes some row more often than
  another (``jnp.take(losses, jnp.array([0, 1, 2]))``) weighs examples by
  their position in the batch, which a device counts from its own rows."""
  dn = e.params["dimension_numbers"]
  if (
    indices.val is None
    or operand.m != 1
    or operand.d not in dn.collapsed_slice_dims
    or getattr(dn, "operand_batching_dims", ())
  ):
    return None
  vec = np.asarray(indices.val)
  at = vec[..., list(dn.start_index_map).index(operand.d)]
  n = shape_of(e.invars[0])[operand.d]
  if _uneven(at, n):
    raise Mixes(
      "a gather of examples at fixed positions in the batch (a device "
      "counts its own rows from 0)"
    )
  if vec.shape == (n, 1) and np.array_equal(at, np.arange(n)):
    out_rank = len(shape_of(e.outvars[0]))
    (out,) = [i for i in range(out_rank) if i not in dn.offset_dims]
    return [R(out, 1, operand.scale)]
  return None


def scatter(e, ins):
  """A scatter (``x.at[...].set/add``, ``jax.ops.segment_sum`` per
  example) is per example where each output row reads only its own rows:
  the rows a window axis the updates cover whole with the same indices for
  every row, or a batching axis of operand, indices and updates alike."""
  if len(ins) != 3 or any(isinstance(c, (S, IX)) for c in ins):
    raise Unknown(f"{e.primitive.name} with a sum or an index over the rows")
  operand, indices, updates = ins
  dn = e.params["dimension_numbers"]
  op_rank = len(shape_of(e.invars[0]))
  op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
  window = [
    a
    for a in range(op_rank)
    if a not in dn.inserted_window_dims and a not in op_batching
  ]
  up_rank = len(shape_of(e.invars[2]))
  scattered = [a for a in range(up_rank) if a not in dn.update_window_dims]
  rows = [c for c in ins if isinstance(c, R)]
  d = _operand_rows(operand, updates, dn, window, scattered, idx_batching)
  if d is None or any(c.m != rows[0].m for c in rows):
    raise Unknown(f"{e.primitive.name} of the examples across the rows")
  if d in window:
    ud = dn.update_window_dims[window.index(d)]
    same = isinstance(indices, C) and (
      shape_of(e.invars[2])[ud] == shape_of(e.invars[0])[d]
    )
  elif d in op_batching:  # indices and updates batched along it too
    j = idx_batching[op_batching.index(d)]
    ud = scattered[j]
    same = _along(indices, j)
  else:  # the rows are scattered into
    ud, same = None, False
  if same and _along(operand, d) and _along(updates, ud):
    for c in rows:
      bake(c.scale)
    return [R(d, rows[0].m)]
  _written_rows(e, operand, indices)
  raise Unknown(f"{e.primitive.name} of the examples across the rows")


def _written_rows(e, operand, indices) -> None:
  """Raises where known indices write into some examples' rows and not
  others' (``losses.at[0].set(0.0)``): a weight by position in the batch,
  which a device counts from its own rows."""
  dn = e.params["dimension_numbers"]
  to_op = list(dn.scatter_dims_to_operand_dims)
  if not (
    isinstance(operand, R)
    and operand.m == 1
    and operand.d in to_op
    and isinstance(indices, C)
    and indices.val is not None
  ):
    return
  at = np.asarray(indices.val)[..., to_op.index(operand.d)]
  if _uneven(at, shape_of(e.invars[0])[operand.d]):
    raise Mixes(
      f"{e.primitive.name} into examples at fixed positions in the batch "
      f"(a device counts its own rows from 0)"
    )


def _uneven(at, n: int) -> bool:
  """Whether known row positions ``at`` (of ``n`` rows) reach outside the
  rows or take some row more often than another."""
  counts = np.bincount(np.ravel(at).clip(-1, n) + 1, minlength=n + 2)
  return bool(counts[0] or counts[-1] or len(set(counts[1:-1])) != 1)


def _operand_rows(operand, updates, dn, window, scattered, idx_batching):
  """The operand axis that holds the rows: the operand's own, or the one
  the updates' rows land on (a window axis or a batching axis)."""
  if isinstance(operand, R):
    return operand.d
  if not isinstance(updates, R):
    return None
  ud = updates.d
  if ud in dn.update_window_dims:
    return window[list(dn.update_window_dims).index(ud)]
  j = scattered.index(ud)
  if j in idx_batching:
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    return op_batching[idx_batching.index(j)]
  return None


def _along(c, axis: int) -> bool:
  """Whether ``c`` is the examples along ``axis`` or the same along it."""
  if isinstance(c, R):
    return c.d == axis
  return isinstance(c, C) and axis in c.uniform


def high_level(e, ins):
  """An equation that JAX (0.12 on) writes as one high-level primitive
  (``call_hi_primitive``, the primitive in its ``_prim`` parameter), read
  by that primitive's name: ``jnp.searchsorted``'s; others cannot be
  followed."""
  prim = e.params.get("_prim")
  name = getattr(prim, "name", None)
  if name == "searchsorted":
    return search_sorted(e, getattr(prim, "params", {}), ins)
  raise Unknown(f"{name or 'a high-level primitive'}")


def search_sorted(e, params, ins):
  """``jnp.searchsorted`` (``interp`` and ``digitize`` call it): each
  query's position in a sorted array that reads no example is per example
  as the query is."""
  sorted_, query = ins
  if (
    params.get("batch_dims", 0)
    or not isinstance(sorted_, C)
    or not isinstance(query, R)
  ):
    raise Unknown("a searchsorted over the batch's values")
  _row_count.note_whole(e, 0, sorted_)
  bake(query.scale)
  return [dataclasses.replace(query, scale=1.0)]
