"""The batch a step takes: checked, then split over the batch axes.

Both the gradient half (:func:`zerojax.value_and_grad`) and the train and
eval steps place their batch with :func:`place_batch`; multi-process
training builds global batches from each process's rows with
:func:`shard_batch`.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.records.mesh import named
from zerojax._src.step.leaf_ops import fresh_copy


def place_batch(
  batch, tx: optax.GradientTransformationExtraArgs, accum_steps: int
):
  """Checks the batch splits over devices x micro-batches; shards it. A
  ``jax.ShapeDtypeStruct`` leaf (an abstract batch, for ``lower``) comes
  back with the batch's sharding, whatever sharding it carried."""
  n = tx.batch_shards
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise ValueError("zerojax train step: the batch has no arrays.")
  rows = None
  for path, x in leaves:
    shape = np.shape(x)
    if len(shape) == 0:
      raise ValueError(
        f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} is a "
        f"scalar; every batch leaf needs a leading batch dimension to split "
        f"over the {' x '.join(map(repr, tx.batch_axes))} axes."
      )
    if rows is None:
      rows = shape[0]
    elif shape[0] != rows:
      raise ValueError(
        f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} has "
        f"{shape[0]} rows but other leaves have {rows}; all batch leaves "
        f"share the leading batch dimension."
      )
    if shape[0] % (n * accum_steps):
      fix = -(-shape[0] // (n * accum_steps)) * n * accum_steps
      raise ValueError(
        f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} has "
        f"{shape[0]} rows, which do not split over {n} devices x "
        f"{accum_steps} micro-batches (needs a multiple of "
        f"{n * accum_steps}). Use a batch of {fix}, or change accum_steps."
      )

  def put(x):
    sharding = batch_sharding(tx, np.ndim(x))
    if isinstance(x, jax.ShapeDtypeStruct):
      # an abstract batch (lowering for a target whose devices this process
      # cannot place data on): typed as the real batch would be placed
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.core.Tracer):
      # traced: the step runs inside the caller's own jit; laid out there
      return fresh_copy(sharding)(x)
    if isinstance(x, jax.Array) and _same_split(x.sharding, sharding, x.ndim):
      return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      # resharded under jit, across processes too (jax.reshard
      # refuses Auto axes)
      return fresh_copy(sharding)(x)
    if jax.process_count() > 1:
      raise ValueError(
        "zerojax train step: in a multi-process run the batch must be a "
        "global jax.Array; build it with "
        "jax.make_array_from_process_local_data."
      )
    return jax.device_put(x, sharding)

  return jax.tree.map(put, batch)


@functools.lru_cache(maxsize=64)
def _same_split(have, want: NamedSharding, ndim: int) -> bool:
  """``have`` splits an array as ``want`` does, on the same mesh, however
  the spec is spelled (``P("data")`` or ``P("data", None)``). Cached: it
  runs for every batch leaf of every step."""
  return getattr(have, "mesh", None) == want.mesh and have.is_equivalent_to(
    want, ndim
  )


@functools.lru_cache(maxsize=64)
def _batch_sharding(mesh, axes: tuple, ndim: int) -> NamedSharding:
  return named(mesh, P(axes[0] if len(axes) == 1 else axes), ndim)


def batch_sharding(
  tx: optax.GradientTransformationExtraArgs, ndim: int = 1
) -> NamedSharding:
  """Rows split over the batch axes (replica, then data); replicated over
  model axes. ``ndim``: the batch leaf's rank (on a mesh with Explicit
  axes the spec names every dimension, as JAX's types do)."""
  return _batch_sharding(tx.mesh, tx.batch_axes, ndim)


def shard_batch(
  local_batch, tx: optax.GradientTransformationExtraArgs, global_rows: int
):
  """A global batch from the rows this process feeds.

  Each process passes only its own rows (``zerojax.distributed.local_rows``
  says which); the result is a global array sharded along the data axis,
  as a train step expects. Single-process runs may pass the whole batch.
  """
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(
      batch_sharding(tx, np.ndim(x)),
      np.asarray(x),
      (global_rows,) + np.shape(x)[1:],
    ),
    local_batch,
  )
