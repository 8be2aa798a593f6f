"""``zero()``: wrap an Optax optimizer for a ZeRO stage on a mesh."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from zerojax import _layout
from zerojax._mesh import DEFAULT_AXIS, data_axis_size, make_mesh
from zerojax._policy import Policy

STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True, eq=True)
class ZeroTransformation:
  """An Optax optimizer, and where its training state lives.

  Build it with :func:`zero`. Stage ``s`` stores sharded over ``axis_name``:

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

  @property
  def num_shards(self) -> int:
    return data_axis_size(self.mesh, self.axis_name)

  def plan(self, shape, dtype) -> _layout.LeafLayout:
    """The layout of a master/optimizer/gradient leaf at this stage."""
    if self.stage == 0:
      return _layout.replicated(shape)
    return _layout.plan_leaf(shape, dtype, self.num_shards,
                             self.min_shard_size)

  def plan_param(self, shape, dtype) -> _layout.LeafLayout:
    """The layout of a parameter leaf: sharded only at stage 3."""
    if self.stage < 3:
      return _layout.LeafLayout(tuple(shape), reason=f"stage {self.stage}")
    return self.plan(shape, dtype)


def zero(
    inner: optax.GradientTransformation,
    *,
    stage: int,
    mesh: Mesh | None = None,
    axis_name: str = DEFAULT_AXIS,
    policy: Policy | None = None,
    min_shard_size: int = 0,
) -> ZeroTransformation:
  """Wraps an Optax optimizer to shard training state at a ZeRO stage.

  The inner optimizer always runs on global (logical, unpadded) arrays under
  ``jit``, so its result equals unsharded Optax for every optimizer,
  including those that are not elementwise (global-norm clipping, LAMB,
  LARS, Adafactor, ``multi_transform``).

  Args:
    inner: any ``optax.GradientTransformation``.
    stage: 0 (plain data parallel), 1, 2 or 3; see :class:`ZeroTransformation`.
    mesh: a mesh with an ``axis_name`` axis; defaults to
      :func:`zerojax.make_mesh` over all devices.
    axis_name: the data-parallel mesh axis.
    policy: mixed-precision :class:`Policy`; default keeps leaf dtypes.
    min_shard_size: leaves with fewer elements stay replicated (DeepSpeed's
      ``stage3_param_persistence_threshold``); they are listed as such by
      :func:`zerojax.layout_table`. Default 0: shard every non-scalar
      floating leaf.

  Returns:
    A :class:`ZeroTransformation` for :func:`zerojax.init` and
    :func:`zerojax.train_step`.

  Example:
    >>> tx = zerojax.zero(optax.adamw(3e-4), stage=2)

  References:
    Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models, https://arxiv.org/abs/1910.02054
  """
  if not isinstance(inner, optax.GradientTransformation) and not (
      hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
        f"zerojax.zero: expected an optax.GradientTransformation, got "
        f"{type(inner).__name__}. Pass e.g. optax.adamw(3e-4).")
  if type(stage) is not int or stage not in STAGES:
    raise ValueError(
        f"zerojax.zero: stage={stage!r} is not a ZeRO stage; use 0 (plain "
        f"data parallel), 1 (shard optimizer state), 2 (and gradients) or 3 "
        f"(and parameters).")
  if not isinstance(min_shard_size, int) or min_shard_size < 0:
    raise ValueError(
        f"zerojax.zero: min_shard_size={min_shard_size!r} must be an int >= 0.")
  mesh = make_mesh(axis_name=axis_name) if mesh is None else mesh
  data_axis_size(mesh, axis_name)
  others = {a: s for a, s in mesh.shape.items() if a != axis_name and s > 1}
  if others:
    raise ValueError(
        f"zerojax.zero: the mesh has non-trivial axes {others} besides "
        f"{axis_name!r}; zerojax shards over the data axis only and does not "
        f"compose with tensor or pipeline parallel axes yet. Pass a 1-D mesh "
        f"from zerojax.make_mesh().")
  policy = Policy() if policy is None else policy
  if not isinstance(policy, Policy):
    raise TypeError(f"zerojax.zero: policy must be a zerojax.Policy, got "
                    f"{type(policy).__name__}.")
  for name in ("param_dtype", "master_dtype", "reduce_dtype"):
    dt = getattr(policy, name)
    if dt is not None and not jnp.issubdtype(dt, jnp.floating):
      raise ValueError(f"zerojax.Policy: {name}={dt!r} is not a floating "
                       f"dtype.")
  return ZeroTransformation(inner, stage, mesh, axis_name, policy,
                            min_shard_size)
