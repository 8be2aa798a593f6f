"""How one array leaf is laid out over the data axis.

The rule (one function, :func:`plan_leaf`, used for params, fp32 master
weights, gradients and every optimizer-state leaf alike, so that an update is
elementwise-local whenever the optimizer is):

* Scalars, leaves that are neither floating nor complex (integer counters,
  masks, PRNG keys) and leaves with fewer
  than ``min_shard_size`` elements are replicated. The layout table says so;
  nothing is replicated silently.
* Otherwise one dimension is sharded over the data axis. For arrays of rank
  >= 2 that may be layer stacks (all of them by default; see ``stacked`` in
  :func:`zerojax.zero`) the first dimension is never chosen: it is the axis
  a layer ``scan`` slices, and a model under ZeRO-3 must be able to slice a
  stacked ``W[L, D, F]`` into per-layer shards ``W[D_data, F]``. Leaves
  marked as not stacks may use it. Among the remaining
  dimensions zerojax takes the one needing the least padding, the first
  (most major) on a tie: a collective over the major dimension of a
  layer's slice moves contiguous chunks, while one over a minor dimension
  makes XLA transpose the buffer first.
  Rank-1 arrays use their only dimension.
* When that dimension does not divide the data-parallel size N it is padded
  with zeros up to the next multiple of N, *in storage only*: the optimizer
  always sees the logical (unpadded) array, sliced out of the padded storage
  inside ``jit``. The slice and the pad line up with the shard boundaries, so
  XLA emits no collective for them, and optimizers that are not elementwise
  (Adafactor's factored moments, masks that look at shapes) see exactly the
  shapes they would see unsharded. Padding costs at most N-1 rows per leaf and
  is reported per leaf.

Tensor parallelism (a ``model`` axis, or any mesh axis other than the data
and replica axes) composes with this rule: a leaf may carry a *model spec*,
the mesh axes each of its dimensions is split over by the model itself
(``LeafLayout.model``). Those dimensions are left to XLA; the data axis
goes on a dimension the model spec does not use. Only when the model uses
every candidate dimension does the data axis share one, *major* to the
model axes: ``P(("data", "model"))``. Major because the data axis is the
manual one inside ``shard_map``: a device's manual view must be a
contiguous block, which ``("model", "data")`` is not (with it each gather
first moves the shards with a ``collective-permute``; with ``("data",
"model")`` it is a plain all-gather). The shared dimension is padded to a multiple of both sizes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.records.mesh import named


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """Storage layout of one leaf.

  Attributes:
    shape: logical (global, unpadded) shape.
    dim: the sharded dimension, or ``None`` when replicated.
    padded: size of ``dim`` in storage (a multiple of the axis size).
    reason: why a leaf is replicated (empty when sharded).
    model: per dimension, the tuple of mesh axes the model shards it over
      (tensor parallelism; left to XLA), or ``()`` when none.
  """

  shape: tuple[int, ...]
  dim: int | None = None
  padded: int = 0
  reason: str = ""
  model: tuple = ()

  @property
  def sharded(self) -> bool:
    return self.dim is not None

  @property
  def pad(self) -> int:
    return self.padded - self.shape[self.dim] if self.sharded else 0

  @property
  def storage_shape(self) -> tuple[int, ...]:
    if not self.sharded:
      return self.shape
    s = list(self.shape)
    s[self.dim] = self.padded
    return tuple(s)

  def model_shards(self, sizes: dict) -> int:
    """How many pieces the model (tensor-parallel) axes cut this leaf into,
    given the mesh's axis sizes: the divisor of its bytes per device."""
    return math.prod(int(sizes[a]) for m in self.model for a in m)

  def model_axes(self, d: int) -> tuple:
    return tuple(self.model[d]) if self.model and d < len(self.model) else ()

  def spec(self, axis_name: str) -> P:
    """The full storage spec: the data axis and the model axes."""
    entries = []
    for d in range(len(self.shape)):
      axes = ((axis_name,) if d == self.dim else ()) + self.model_axes(d)
      entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
      entries.pop()
    return P(*entries)

  def typed_spec(self, axis_name: str, explicit) -> P:
    """The logical view's spec as a sharding type on a mesh whose
    ``explicit`` axes are Explicit: those of its axes only, and the data
    axis only where it divides the logical dimension (a type cannot split
    a dimension unevenly, so a padded leaf is typed whole over the data
    axis)."""
    entries = []
    for d in range(len(self.shape)):
      axes = (
        (axis_name,) if d == self.dim and not self.pad else ()
      ) + self.model_axes(d)
      axes = tuple(a for a in axes if a in explicit)
      entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)

  def manual_spec(self, axis_name: str) -> P:
    """The spec over the data axis only: a ``shard_map`` in/out spec (the
    model axes are left automatic there)."""
    if not self.sharded:
      return P()
    return P(*([None] * self.dim + [axis_name]))

  def shard_shape(self, n: int) -> tuple[int, ...]:
    s = list(self.storage_shape)
    if self.sharded:
      s[self.dim] //= n
    return tuple(s)

  def to_storage(self, x: jax.Array) -> jax.Array:
    """Pads a logical array (JAX or NumPy) to its storage shape (no
    sharding applied)."""
    return pad_dim(x, self.dim, self.pad) if self.pad else x

  def to_logical(self, x: jax.Array) -> jax.Array:
    """Slices the padding off a storage array."""
    if not self.pad:
      return x
    return jax.lax.slice_in_dim(x, 0, self.shape[self.dim], axis=self.dim)


def pad_dim(x, dim: int, amount: int):
  """``x`` with ``amount`` zeros appended along ``dim``: the one padding
  rule (storage layouts, reduce-scatter buffers). A NumPy array stays on
  the host (``init`` pads there, before any device sees the leaf)."""
  widths = [(0, 0)] * x.ndim
  widths[dim] = (0, amount)
  return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def plan_leaf(
  shape,
  dtype,
  n: int,
  min_shard_size: int,
  *,
  stacked: bool = True,
  model: tuple = (),
  model_sizes: dict | None = None,
) -> LeafLayout:
  """The layout of a leaf of ``shape``/``dtype`` over ``n`` devices.

  ``stacked``: the leaf's leading dimension is a layer axis (a scan slices
  it), so it is never the sharded one. Leaves that are not stacks may be
  sharded along any dimension, the leading one included. ``model``: the
  leaf's model spec (per dimension, a tuple of mesh axes), with
  ``model_sizes`` the sizes of those axes.
  """
  shape = tuple(int(d) for d in shape)
  model = tuple(tuple(m) for m in model)
  if not any(model):
    model = ()
  if len(shape) == 0:
    return LeafLayout(shape, reason="scalar")
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return LeafLayout(shape, reason=f"{dtype} (carried)", model=model)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return LeafLayout(
      shape, reason=f"{np.dtype(dtype).name} (not trained)", model=model
    )
  size = math.prod(shape)
  if size < min_shard_size:
    return LeafLayout(
      shape, reason=f"{size} < min_shard_size={min_shard_size}", model=model
    )
  if size == 0:
    return LeafLayout(shape, reason="empty", model=model)
  sizes = model_sizes or {}
  msize = lambda d: math.prod(
    sizes[a] for a in (model[d] if d < len(model) else ())
  )
  candidates = (
    range(1, len(shape)) if len(shape) >= 2 and stacked else range(len(shape))
  )
  free = [d for d in candidates if msize(d) == 1]
  candidates = free or list(candidates)
  padded = lambda d: -(-shape[d] // (n * msize(d))) * n * msize(d)
  # least padding; on a tie the first (most major) candidate.
  dim = max(candidates, key=lambda d: (shape[d] - padded(d), -d))
  return LeafLayout(shape, dim=dim, padded=padded(dim), model=model)


def convert(x, src: LeafLayout, dst: LeafLayout, dtype=None):
  """``x`` stored in layout ``src`` -> stored in layout ``dst`` (and ``dtype``).

  The one conversion between layouts (init, step, checkpoint, gather): slice
  off ``src``'s padding, cast, pad for ``dst``. Exact for same-dtype copies.
  Sharding is the caller's (a constraint or ``out_shardings``).
  """
  x = src.to_logical(x)
  if dtype is not None and x.dtype != dtype:
    x = x.astype(dtype)
  return dst.to_storage(x)


def replicated(shape, model: tuple = (), reason: str = "stage 0") -> LeafLayout:
  model = tuple(tuple(m) for m in model)
  return LeafLayout(
    tuple(shape), reason=reason, model=model if any(model) else ()
  )


def sharding(mesh, layout: LeafLayout, axis_name: str) -> NamedSharding:
  return named(mesh, layout.spec(axis_name), len(layout.storage_shape))
