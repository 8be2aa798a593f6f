"""What a :class:`~zerojax.ZeroTransformation` is: :class:`ZeroConfig`.

The bottom of zerojax's layers above the leaf rules (layout, mesh, policy,
ZeRO++ settings): the state records, the drop-in and ``zero()`` all read
it, and it imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from jax.sharding import Mesh

from zerojax import _buckets, _layout, _zeropp
from zerojax._mesh import DEFAULT_AXIS, compute_mesh, data_axis_size
from zerojax._policy import Policy
from zerojax._zeropp import ZeroPP

# where the master copy and optimizer state live with offload=True
HOST_MEMORY = "pinned_host"

STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True, eq=True)
class ZeroConfig:
  """What a :class:`ZeroTransformation` is: an optimizer, a stage, a mesh.

  Stage ``s`` stores sharded over ``axis_name``:

  ========  ==================  =========  ==========
  stage     optimizer state     gradients  parameters
  ========  ==================  =========  ==========
  0 (DP)    replicated          replicated replicated
  1         sharded             sharded    replicated
  2         sharded             sharded*   replicated
  3         sharded             sharded*   sharded
  ========  ==================  =========  ==========

  (*) reduce-scattered layer by layer during the backward pass when the loss
  calls :func:`zerojax.gather` per layer; the accumulator is sharded.
  """

  inner: optax.GradientTransformation
  stage: int
  mesh: Mesh
  axis_name: str = DEFAULT_AXIS
  policy: Policy = Policy()
  min_shard_size: int = 0
  stacked: Any = None
  replica_axis: str | None = None
  model_specs: Any = None
  offload: bool = False
  zeropp: ZeroPP = ZeroPP()
  bucket_bytes: int | None = _buckets.DEFAULT_BUCKET_BYTES

  @property
  def num_shards(self) -> int:
    """Devices along the data axis: the N of the ZeRO formulas."""
    return data_axis_size(self.mesh, self.axis_name)

  @property
  def compute_mesh(self) -> Mesh:
    """The mesh with every axis ``Auto``: what zerojax's constraints and
    ``shard_map`` regions name inside :func:`zerojax._mesh.auto_region`."""
    return compute_mesh(self.mesh)

  @property
  def num_replicas(self) -> int:
    return int(self.mesh.shape[self.replica_axis]) if self.replica_axis else 1

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes the batch splits over (and ``shard_map`` is manual over):
    replica, then data."""
    return ((self.replica_axis,) if self.replica_axis else ()) + (
        self.axis_name,)

  @property
  def batch_shards(self) -> int:
    return self.num_replicas * self.num_shards

  @property
  def qgz_node_size(self) -> int:
    """Devices per node hierarchical qgZ sums over before crossing nodes;
    ``0``: flat (see :class:`zerojax.ZeroPP`)."""
    return _zeropp.qgz_node_size(self.zeropp, self.mesh, self.axis_name)

  @property
  def model_axes(self) -> dict[str, int]:
    """Mesh axes left to XLA (tensor parallelism), with their sizes."""
    return {a: int(s) for a, s in self.mesh.shape.items()
            if a not in self.batch_axes}

  def plan(self, shape, dtype, stacked: bool = True,
           model: tuple = ()) -> _layout.LeafLayout:
    """The layout of a master/optimizer/gradient leaf at this stage."""
    if self.stage == 0:
      return _layout.replicated(shape, model)
    return _layout.plan_leaf(shape, dtype, self.num_shards,
                             self.min_shard_size, stacked=stacked,
                             model=model, model_sizes=self.model_axes)

  def plan_param(self, shape, dtype, stacked: bool = True,
                 model: tuple = ()) -> _layout.LeafLayout:
    """The layout of a parameter leaf: sharded only at stage 3."""
    if self.stage < 3:
      return _layout.replicated(shape, model, reason=f"stage {self.stage}")
    return self.plan(shape, dtype, stacked, model)
