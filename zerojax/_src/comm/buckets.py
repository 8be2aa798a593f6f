"""CB, ZeRO-R's constant-size buffers: whole-leaf collectives in buckets.

Stage 3's gathers and gradient reduce-scatters are per layer by
construction (the model's layer scan calls :func:`zerojax.gather` on one
layer's slice). The step's other parameter-sized collectives act on whole
leaves: stage 0's gradient all-reduce, stage 1's reduce-scatter after the
backward, the all-gather of the updated shards at stages 1-2, and the
replica all-reduce of hybrid sharding. On a stacked leaf ``W[L, ...]`` each
of those grows with the depth L: in a deep model a multi-GB collective whose
output buffer is a second full copy of the leaf in flight.

:func:`bucketed` runs such a collective over the leaf's leading dimension in
buckets of at most ``bucket_bytes`` (counting the collective's full,
unsharded operand), never less than one row (one layer of a stack):

* a ``lax.fori_loop`` over the buckets, each iteration slicing its rows and
  writing the collective's result in place into the output buffer
  (``dynamic_update_slice``), so only the result and one bucket exist at
  once; the rows left over after the last whole bucket are one more call;
* a loop, not a Python list of slices: XLA's collective combiners merge
  independent collectives up to a byte threshold
  (``--xla_gpu_all_gather_combine_threshold_bytes`` and its reduce-scatter
  and all-reduce siblings), which would fuse a list of slices back into one
  leaf-sized buffer; iterations of a loop cannot be merged.

The collective inside each bucket runs over a non-leading dimension, so
it is written as one over the major dimension between explicit
transposes (:func:`zerojax._src.comm.gather.on_major_dim`): otherwise XLA's layout
assignment may transpose the whole source leaf once, outside the loop.

Only the leading dimension is split, and only when neither the data axis
nor a model axis shards it (its rows are then independent, whole on every
device); other leaves run whole. Quantized (ZeRO++) reduce-scatters are
not bucketed: their quantization blocks span the destination shard, so
splitting would change their numbers and their byte count.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np


def rows_per_bucket(shape, itemsize: float, bucket_bytes: int) -> int:
  """Rows of ``shape``'s leading dimension per bucket: as many as fit in
  ``bucket_bytes`` (``itemsize`` bytes per element of the collective's
  full operand), at least one."""
  row = itemsize * math.prod(shape[1:])
  return max(1, int(bucket_bytes // row)) if row else shape[0]


def bucketed(
  fn: Callable,
  x: jax.Array,
  full_itemsize: float,
  bucket_bytes: int | None,
  splittable: bool = True,
  into: jax.Array | None = None,
) -> jax.Array:
  """``fn(x)``, run on ``x``'s leading dimension bucket by bucket.

  ``fn`` must treat rows independently and keep the leading dimension (a
  collective over another dimension, a pad or slice of another dimension,
  a cast). ``full_itemsize``: bytes of the collective's full operand per
  element of ``x`` (an all-gather's output is N times its input).
  ``bucket_bytes=None`` or an unsplittable ``x`` runs ``fn`` once.
  ``into``: a dead array shaped and typed like the result (the old params
  an all-gather replaces) the buckets are written into, so a donated
  buffer is reused in place rather than a new one allocated."""
  if bucket_bytes is None or not splittable or x.ndim < 2:
    return fn(x)
  rows = x.shape[0]
  per = rows_per_bucket(x.shape, full_itemsize, bucket_bytes)
  if per >= rows:
    return fn(x)
  whole = rows // per
  out = _empty_like_result(fn, x, rows, per) if into is None else into

  def body(b, out):
    start = b * per
    piece = jax.lax.dynamic_slice_in_dim(x, start, per, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(out, fn(piece), start, axis=0)

  out = jax.lax.fori_loop(0, whole, body, out)
  if whole * per < rows:
    rest = jax.lax.slice_in_dim(x, whole * per, rows, axis=0)
    out = jax.lax.dynamic_update_slice_in_dim(
      out, fn(rest), whole * per, axis=0
    )
  return out


def _empty_like_result(fn, x, rows: int, per: int):
  """Zeros shaped like ``fn``'s result on all ``rows``, of its type: the
  loop's carry must be varying over the same manual axes as what the body
  writes into it, and ``lax.full_like`` keeps that type. The probe call is
  traced only for its type (dead code, removed before lowering)."""
  probe = fn(jax.lax.slice_in_dim(x, 0, per, axis=0))
  return jax.lax.full_like(probe, 0, shape=(rows,) + probe.shape[1:])


def splittable(layout) -> bool:
  """Whether a leaf's leading dimension may be split into buckets: rank >=
  2 and not sharded over the data axis or any model axis."""
  return len(layout.shape) >= 2 and layout.dim != 0 and not layout.model_axes(0)


def itemsize(dtype) -> int:
  return np.dtype(dtype).itemsize
