"""The batch a step takes: checked, then split over the batch axes.

Both the gradient half (:func:`zerojax.value_and_grad`) and the train and
eval steps place their batch with :func:`place_batch`; multi-process
training builds global batches from each process's rows with
:func:`shard_batch`.

A scalar batch leaf (a loss weight, a temperature, a schedule's value) is
the same for every example, as it is for a plain ``jit`` step's argument.
It travels broadcast to the batch's rows, in a :class:`Shared` node, so
every split of the batch (over devices, micro-batches, the aux's row
probe) splits it with the rest and needs no case of its own; the loss is
handed the scalar back (:func:`unshare`), with its dtype and weak type.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.records.mesh import named
from zerojax._src.step.leaf_ops import fresh_copy


class Shared:
  """A scalar batch leaf broadcast to the batch's rows (``rows[i]`` is the
  scalar for every ``i``); a pytree node whose one child is that array."""

  def __init__(self, rows):
    self.rows = rows

  def __repr__(self):
    return f"Shared({self.rows!r})"


jax.tree_util.register_pytree_with_keys(
  Shared,
  lambda s: (((jax.tree_util.GetAttrKey("rows"), s.rows),), None),
  lambda _, children: Shared(children[0]),
  lambda s: ((s.rows,), None),
)


def unshare(batch):
  """The batch as the user's loss takes it: each :class:`Shared` node back
  to its scalar."""
  return jax.tree.map(
    lambda x: x.rows[0] if isinstance(x, Shared) else x,
    batch,
    is_leaf=lambda x: isinstance(x, Shared),
  )


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
    _check_array(path, x)
    shape = np.shape(x)
    if len(shape) == 0:
      continue  # a scalar: the same for every example (Shared)
    if rows is None:
      rows = shape[0]
    elif shape[0] != rows:
      raise ValueError(
        f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} has "
        f"{shape[0]} rows but other leaves have {rows}; all batch leaves "
        f"share the leading batch dimension (a value the same for every "
        f"example may be a scalar leaf, or closed over by loss_fn)."
      )
    if shape[0] % (n * accum_steps):
      fix = -(-shape[0] // (n * accum_steps)) * n * accum_steps
      raise ValueError(
        f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} has "
        f"{shape[0]} rows, which do not split over {n} devices x "
        f"{accum_steps} micro-batches (needs a multiple of "
        f"{n * accum_steps}). Use a batch of {fix}, or change accum_steps."
      )
  if rows is None:
    raise ValueError(
      f"zerojax train step: every batch leaf is a scalar; the batch needs "
      f"at least one leaf with a leading batch dimension to split over the "
      f"{' x '.join(map(repr, tx.batch_axes))} axes."
    )

  def put(x):
    if np.ndim(x) == 0:
      return Shared(_broadcast(x, rows, batch_sharding(tx, 1)))
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


_NUMBERS = (bool, int, float, complex, np.generic, np.ndarray)


def _check_array(path, x):
  """A batch leaf is what a ``jit`` argument may be: an array (JAX's or
  NumPy's, of a numeric dtype) or a number."""
  if isinstance(x, (jax.Array, jax.core.Tracer, jax.ShapeDtypeStruct)):
    return
  if isinstance(x, _NUMBERS):
    dtype = np.asarray(x).dtype  # ml_dtypes' (bfloat16, float8) included
    if jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_):
      return
  what = type(x).__name__
  if isinstance(x, (np.ndarray, np.generic)):
    what = f"NumPy {what} of dtype {np.asarray(x).dtype}"
  raise TypeError(
    f"zerojax train step: batch leaf {jax.tree_util.keystr(path)} has type "
    f"{what}; batch leaves are numeric arrays or numbers (what a jitted "
    f"step takes). Close over other values in loss_fn, or encode them "
    f"as arrays."
  )


def _broadcast(x, rows: int, sharding: NamedSharding):
  """Scalar ``x`` -> ``rows`` copies split as the batch's rows are, keeping
  its dtype and weak type (a Python float stays weak, as a ``jit``
  argument is)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(
      (rows,), x.dtype, sharding=sharding, weak_type=x.weak_type
    )
  if isinstance(x, jax.core.Tracer):
    return fresh_copy(sharding)(jnp.broadcast_to(x, (rows,)))
  return _broadcaster(rows, sharding)(x)


@functools.lru_cache(maxsize=64)
def _broadcaster(rows: int, sharding: NamedSharding):
  return jax.jit(lambda x: jnp.broadcast_to(x, (rows,)), out_shardings=sharding)


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
  Scalar leaves (the same value on every process) are returned as they
  are; the step shares them with every example.
  """
  return jax.tree.map(
    lambda x: (
      x
      if np.ndim(x) == 0  # a scalar: the same on every process (Shared)
      else jax.make_array_from_process_local_data(
        batch_sharding(tx, np.ndim(x)),
        np.asarray(x),
        (global_rows,) + np.shape(x)[1:],
      )
    ),
    local_batch,
  )
