""":mod:`zerojax._src.jaxpr.batch_mean`'s rules for the primitives that
move, reduce, combine or index values: where each keeps the row axis of a
per-example value, and which of them combine examples."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from zerojax._src.jaxpr import row_count as _row_count
from zerojax._src.jaxpr.classes import IX, RK, C, Mixes, R, S, Unknown
from zerojax._src.jaxpr.examples import (
  bake,
  baked,
  fold,
  nonzero,
  scalar,
  shape_of,
  where,
)


def broadcast_in_dim(e, ins):
  c = ins[0]
  if isinstance(c, S):
    return [c]
  if isinstance(c, R):
    dims = e.params["broadcast_dimensions"]
    if shape_of(e.invars[0])[c.d] != shape_of(e.outvars[0])[dims[c.d]]:
      raise Unknown("a broadcast along the rows")
    return [dataclasses.replace(c, d=dims[c.d])]
  if isinstance(c, IX):
    raise Unknown("a broadcast of an index built from the rows")
  return [fold(e, ins)]


def reshape(e, ins):
  c = ins[0]
  if isinstance(c, S):
    return [c]
  if not isinstance(c, R):
    raise Unknown("a reshape of an index built from the rows")
  s, t = shape_of(e.invars[0]), shape_of(e.outvars[0])
  rows = s[c.d] // c.m
  if math.prod(s[: c.d]) != 1 or e.params.get("dimensions") is not None:
    raise Unknown("a reshape of rows that are not the leading axis")
  for k, size in enumerate(t):
    if size == 1:
      continue
    if math.prod(t[:k]) == 1 and size % rows == 0:
      return [dataclasses.replace(c, d=k, m=size // rows)]
    if (  # chunks of whole examples: (rows * m, ...) -> (n, rows / n * m, ...)
      math.prod(t[:k]) == 1
      and k + 1 < len(t)
      and rows % size == 0
      and size * t[k + 1] == s[c.d]
    ):
      return [RK(k, c.m, c.scale)]
    break
  raise Unknown("a reshape that splits the rows")


def transpose(e, ins):
  c, perm = ins[0], e.params["permutation"]
  if isinstance(c, S):
    return [c]
  if isinstance(c, R):
    return [dataclasses.replace(c, d=list(perm).index(c.d))]
  raise Unknown("a transpose of an index built from the rows")


def squeeze(e, ins):
  c = ins[0]
  if isinstance(c, S):
    return [c]
  if not isinstance(c, R):
    raise Unknown("a squeeze of an index built from the rows")
  dims = e.params["dimensions"]
  if c.d in dims:
    raise Unknown("a squeeze of the rows")
  return [dataclasses.replace(c, d=c.d - sum(1 for x in dims if x < c.d))]


def reduce(e, ins):
  c, name = ins[0], e.primitive.name
  axes = tuple(e.params["axes"])
  if isinstance(c, S):
    if name == "reduce_sum":
      return [c]
    raise Mixes(f"{name} over a sum over the batch")
  if not isinstance(c, R):
    raise Unknown(f"{name} of an index built from the rows")
  if c.d not in axes:
    d = c.d - sum(1 for a in axes if a < c.d)
    if name != "reduce_sum":
      c = baked(c)
    return [dataclasses.replace(c, d=d)] * len(e.outvars)
  if name == "reduce_sum":
    return [S((c.scale,), where(e))]
  raise Mixes(f"{name} over the batch's rows (not a mean over examples)")


def cumulative(e, ins):
  c = ins[0]
  if isinstance(c, R) and e.params["axis"] != c.d:
    return [c]
  if isinstance(c, R):
    raise Mixes(f"{e.primitive.name} along the batch's rows")
  raise Unknown(f"{e.primitive.name} of a sum over the batch")


def reduce_window(e, ins):
  """Pooling (``reduce_window_sum/max/min``): per example when its window
  spans one row, with no stride, padding or dilation along the rows."""
  c, name, p = ins[0], e.primitive.name, e.params
  if isinstance(c, S):
    raise Unknown(f"{name} of a sum over the batch")
  if not isinstance(c, R):
    raise Unknown(f"{name} of an index built from the rows")
  d = c.d
  if (
    p["window_dimensions"][d] == 1
    and p["window_strides"][d] == 1
    and tuple(p["padding"][d]) == (0, 0)
    and p["base_dilation"][d] == 1
  ):
    return [c if name == "reduce_window_sum" else baked(c)]
  if c.m == 1:
    raise Mixes(f"{name} with a window over the batch's rows")
  raise Unknown(f"{name} with a window across the flattened rows")


def fft(e, ins):
  """An FFT over the trailing axes: per example when the rows are not
  among them."""
  c = ins[0]
  rank = len(shape_of(e.invars[0]))
  if isinstance(c, R) and c.d < rank - len(e.params["fft_lengths"]):
    return [baked(c)]
  if isinstance(c, R) and c.m == 1:
    raise Mixes("an FFT over the batch's rows")
  raise Unknown("an FFT across the rows or of a sum over the batch")


def conv(e, ins):
  """A convolution of the examples with a constant kernel (a param) runs
  on each entry of its batch axis alone: per example where those are the
  rows (no ``batch_group_count``, which mixes entries)."""
  lhs, rhs = ins
  dn = e.params["dimension_numbers"]
  if (
    isinstance(lhs, R)
    and isinstance(rhs, C)
    and e.params["batch_group_count"] == 1
    and lhs.d == dn.lhs_spec[0]
  ):
    return [R(dn.out_spec[0], lhs.m, lhs.scale * scalar(rhs))]
  if isinstance(lhs, S) or isinstance(rhs, S):
    raise Unknown("a convolution with a sum over the batch")
  raise Unknown("a convolution across the rows or of per-example kernels")


def along_rows(e, ins, name, full, placed=None):
  """slice / dynamic_slice / pad / rev: per example when the rows are
  untouched (``full``). ``placed(d)``: where it cuts the other axes,
  recorded (:func:`~zerojax._src.jaxpr.row_count.note_placed`) so that a
  place computed from the row count differs between the loss check's
  traces."""
  c = ins[0]
  if isinstance(c, S):
    return [c]
  if not isinstance(c, R):
    raise Unknown(f"{name} of an index built from the rows")
  if any(not isinstance(i, C) for i in ins[1:]):
    raise Unknown(f"{name} at a place read from the batch")
  if not full(c.d):
    if c.m == 1:
      raise Mixes(f"{name} of the batch's rows (drops or reorders examples)")
    raise Unknown(f"{name} across the flattened rows")
  if placed is not None:
    _row_count.note_placed(e, placed(c.d))
  return [c]


def _others(d, values) -> tuple:
  return tuple(v for a, v in enumerate(values) if a != d)


def static_slice(e, ins):
  s = shape_of(e.invars[0])
  start, limit = e.params["start_indices"], e.params["limit_indices"]
  strides = e.params.get("strides") or (1,) * len(s)
  return along_rows(
    e,
    ins,
    "a slice",
    lambda d: start[d] == 0 and limit[d] == s[d] and strides[d] == 1,
    lambda d: _others(d, tuple(zip(start, limit, strides))),
  )


def dynamic_slice(e, ins):
  s = shape_of(e.invars[0])
  sizes = e.params["slice_sizes"]
  places = [
    _row_count.fingerprint(c) if isinstance(c, C) else None for c in ins[1:]
  ]
  return along_rows(
    e,
    ins,
    "a dynamic slice",
    lambda d: sizes[d] == s[d],
    lambda d: _others(d, tuple(zip(places, sizes))),
  )


def pad(e, ins):
  cfg = e.params["padding_config"]
  return along_rows(
    e,
    ins[:1],
    "a pad",
    lambda d: tuple(cfg[d]) == (0, 0, 0),
    lambda d: _others(d, tuple(tuple(x) for x in cfg)),
  )


def rev(e, ins):
  dims = e.params["dimensions"]
  return along_rows(e, ins, "a reversal", lambda d: d not in dims)


def sort(e, ins):
  dim = e.params["dimension"]
  rows = [c for c in ins if isinstance(c, R)]
  if any(isinstance(c, (S, IX)) for c in ins) or not rows:
    raise Unknown("a sort of a sum over the batch")
  if any(c.layout != rows[0].layout for c in rows):
    raise Unknown("a sort of differently laid out per-example values")
  if rows[0].d == dim:
    raise Mixes("a sort along the batch's rows")
  return [baked(c) for c in rows[:1]] * len(e.outvars)


def top_k(e, ins):
  c = ins[0]
  if isinstance(c, R) and c.d != len(shape_of(e.invars[0])) - 1:
    return [baked(c)] * 2
  if isinstance(c, R):
    raise Mixes("top_k along the batch's rows")
  raise Unknown("top_k of a sum over the batch")


def split(e, ins):
  c, axis = ins[0], e.params["axis"]
  if isinstance(c, S) or (isinstance(c, R) and c.d != axis):
    return [c] * len(e.outvars)
  raise Unknown("a split of the rows")


def concatenate(e, ins):
  return _concatenate(
    e.params["dimension"], [shape_of(v) for v in e.invars], ins
  )


def stack(e, ins):
  """``jnp.stack``: each input given a new axis of size 1, concatenated
  along it."""
  axis = e.params["axis"]
  shapes = [
    tuple(shape_of(v)[:axis]) + (1,) + tuple(shape_of(v)[axis:])
    for v in e.invars
  ]
  return _concatenate(axis, shapes, [_with_axis(c, axis) for c in ins])


def unstack(e, ins):
  """``jnp.unstack``: each index along ``axis`` as its own value."""
  c, axis, n = ins[0], e.params["axis"], len(e.outvars)
  if isinstance(c, S):
    return [c] * n
  if not isinstance(c, R):
    raise Unknown("an unstack of an index built from the rows")
  if c.d == axis:
    if c.m == 1:
      raise Mixes("an unstack of the batch's rows (each example apart)")
    raise Unknown("an unstack across the flattened rows")
  return [dataclasses.replace(c, d=c.d - (c.d > axis))] * n


def _with_axis(c, axis: int):
  """``c`` with a new axis of size 1 at ``axis``."""
  if isinstance(c, R):
    return dataclasses.replace(c, d=c.d + (c.d >= axis))
  if isinstance(c, C):
    return dataclasses.replace(
      c,
      uniform=frozenset(u + (u >= axis) for u in c.uniform) | {axis},
      val=None if c.val is None else np.expand_dims(np.asarray(c.val), axis),
      pos=None if c.pos is None else c.pos + (c.pos >= axis),
    )
  if isinstance(c, S):
    return c
  raise Unknown("a stack of an index built from the rows")


def _concatenate(dim: int, shapes, ins):
  rows = [c for c in ins if isinstance(c, R)]
  last = len(shapes[0]) - 1
  iotas = [c for c in ins if isinstance(c, C) and c.pos is not None]
  if dim == last and all(s[dim] == 1 for s in shapes) and rows and iotas:
    d = rows[0].d
    if all(c.layout == (d, 1) for c in rows) and all(c.pos == d for c in iotas):
      comps = tuple(
        "I" if isinstance(c, C) and c.pos == d else "D" for c in ins
      )
      return [IX(d, comps)]
  if not rows and not any(isinstance(c, IX) for c in ins):
    # sums (and constants) side by side, jnp.stack([mean_a, mean_b]):
    # each element is linear in the sums, as their S says
    sums = [c for c in ins if isinstance(c, S)]
    at = next((c.at for c in sums if c.at), "")
    off = any(c.offset if isinstance(c, S) else nonzero(c) for c in ins)
    return [S(sum((c.coefs for c in sums), ()), at, off)]
  if any(isinstance(c, (S, IX)) for c in ins):
    raise Unknown("a concatenation of sums over the batch")
  first = rows[0]
  if first.d == dim and first.m == 1 and any(isinstance(c, C) for c in ins):
    raise Mixes("a concatenation of the batch's rows with rows of no example")
  if any(c.layout != first.layout for c in rows) or first.d == dim:
    raise Unknown("a concatenation along the rows")
  for c in ins:
    if isinstance(c, C) and first.d not in c.uniform:
      raise Unknown("a concatenation with a value that varies over rows")
  if any(c.scale != first.scale for c in rows) or any(
    isinstance(c, C) for c in ins
  ):
    for c in rows:
      bake(c.scale)
    return [dataclasses.replace(first, scale=1.0)]
  return [first]


def dot_general(e, ins):
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  a, b = ins
  la, rk = len(shape_of(e.invars[0])), len(shape_of(e.invars[1]))
  if isinstance(a, S) or isinstance(b, S):
    if isinstance(a, C) or isinstance(b, C):
      return [a if isinstance(a, S) else b]
    raise Mixes("a product of a sum over the batch with the batch")
  if isinstance(a, IX) or isinstance(b, IX):
    raise Unknown("a product with an index built from the rows")
  free_a = [i for i in range(la) if i not in lc and i not in lb]
  free_b = [i for i in range(rk) if i not in rc and i not in rb]

  def position(side, d):
    if side == 0:
      if d in lb:
        return list(lb).index(d)
      return len(lb) + free_a.index(d)
    if d in rb:
      return list(rb).index(d)
    return len(lb) + len(free_a) + free_b.index(d)

  def with_const(r, side, dims, c):
    """``r`` (operand ``side``) times the constant ``c``; ``dims``: the
    contracting and batch dimensions of ``r``'s side, then ``c``'s."""
    contract, batch, other_contract, other_batch = dims
    k = r.scale * scalar(c)  # a known factor, every element alike
    if r.d in contract:
      if other_contract[list(contract).index(r.d)] in c.uniform:
        return [S((k,), where(e))]
      if c.val is not None and r.m == 1:  # known to differ over rows
        raise Mixes(
          "a sum over the examples weighted by a constant that differs from "
          "row to row (a weight by position in the batch)"
        )
      raise Unknown("a sum over rows weighted by a value that varies over rows")
    if r.d in batch and other_batch[list(batch).index(r.d)] not in c.uniform:
      raise Unknown("a batched product with a value that varies over rows")
    return [dataclasses.replace(r, d=position(side, r.d), scale=k)]

  if isinstance(a, R) and isinstance(b, C):
    return with_const(a, 0, (lc, lb, rc, rb), b)
  if isinstance(a, C) and isinstance(b, R):
    return with_const(b, 1, (rc, rb, lc, lb), a)
  # both per example
  if a.m != b.m:
    raise Unknown("a product of differently laid out per-example values")
  if a.d in lb and rb[list(lb).index(a.d)] == b.d:
    return [R(list(lb).index(a.d), a.m, a.scale * b.scale)]
  if a.d in lc and rc[list(lc).index(a.d)] == b.d:
    return [S((a.scale * b.scale,), where(e))]
  if a.d not in lc and a.d not in lb and b.d not in rc and b.d not in rb:
    raise Mixes(
      "a product of every example with every other (a contrastive or "
      "similarity matrix over the batch)"
    )
  raise Unknown("a product that mixes the rows")
