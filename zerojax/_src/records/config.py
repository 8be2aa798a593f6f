"""What a :class:`~zerojax.ZeroTransformation` is: :class:`ZeroConfig`.

The bottom of zerojax's layers above the leaf rules (layout, mesh, policy,
ZeRO++ settings): the state records, the drop-in and ``zero()`` all read
it, and it imports none of them.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, Mesh

from zerojax._src.records import layout as _layout
from zerojax._src.records import model_axes as _model_axes
from zerojax._src.records import zeropp as _zeropp
from zerojax._src.records.mesh import DEFAULT_AXIS, compute_mesh, data_axis_size
from zerojax._src.records.policy import Policy
from zerojax._src.records.zeropp import ZeroPP

# where the master copy and optimizer state live with offload=True
HOST_MEMORY = "pinned_host"
# ~ XLA GPU's default collective combine thresholds (30 MiB): collectives
# this large already run at full link bandwidth.
DEFAULT_BUCKET_BYTES = 32 * 2**20

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
  offload: bool | float = False
  zeropp: ZeroPP = ZeroPP()
  bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
  offload_params: bool = False
  offload_grads: bool = False

  def __post_init__(self):
    """Checks every field, however the config was built (``zero()``,
    ``tx.replace(...)``, ``ZeroConfig(...)``); errors name the field and
    the fix."""
    inner = self.inner
    if not isinstance(inner, optax.GradientTransformation) and not (
      hasattr(inner, "init") and hasattr(inner, "update")
    ):
      raise TypeError(
        f"zerojax.zero: expected an optax.GradientTransformation, got "
        f"{type(inner).__name__}. Pass e.g. optax.adamw(3e-4)."
      )
    if type(self.stage) is not int or self.stage not in STAGES:
      raise ValueError(
        f"zerojax.zero: stage={self.stage!r} is not a ZeRO stage; use 0 "
        f"(plain data parallel), 1 (shard optimizer state), 2 (and "
        f"gradients) or 3 (and parameters)."
      )
    if not isinstance(self.mesh, (Mesh, AbstractMesh)):
      raise TypeError(
        f"zerojax.zero: mesh={self.mesh!r}; pass a "
        f"jax.sharding.Mesh (jax.make_mesh or "
        f"zerojax.make_mesh)."
      )
    if (
      not isinstance(self.min_shard_size, int)
      or isinstance(self.min_shard_size, bool)
      or self.min_shard_size < 0
    ):
      raise ValueError(
        f"zerojax.zero: min_shard_size={self.min_shard_size!r} "
        f"must be an int >= 0."
      )
    stacked = self.stacked
    if not (stacked is None or isinstance(stacked, bool) or callable(stacked)):
      raise TypeError(
        f"zerojax.zero: stacked={stacked!r}; pass None, a bool, "
        f"or a function (path, shape) -> bool."
      )
    data_axis_size(self.mesh, self.axis_name)
    self._check_replica_axis()
    object.__setattr__(
      self, "model_specs", _model_axes.as_lookup(self.model_specs)
    )
    _check_policy(self.policy)
    for name in ("offload", "offload_params", "offload_grads"):
      object.__setattr__(self, name, _plain_flag(getattr(self, name)))
    _check_offload(self.offload)
    self._check_offload_params()
    self._check_offload_grads()
    if (self.offload_fraction or self.offload_params) and isinstance(
      self.mesh, Mesh
    ):  # abstract
      _check_host_memory(self.mesh)
    _check_zeropp(self.zeropp, self.stage, self.mesh, self.axis_name)
    b = self.bucket_bytes
    if b is not None and (
      isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0
    ):
      raise ValueError(
        f"zerojax.zero: bucket_bytes={b!r} must be a positive int (bytes "
        f"per collective, e.g. 32 * 2**20) or None (whole leaves)."
      )

  def _check_offload_params(self):
    """Params in host memory: stage 3 (each layer's shard is brought to
    the device just before its gather), exact gathers only."""
    if not isinstance(self.offload_params, bool):
      raise TypeError(
        f"zerojax.zero: offload_params={self.offload_params!r}; pass True "
        f"(stage 3's parameter shards in host memory) or False."
      )
    if self.offload_params and self.stage != 3:
      raise ValueError(
        f"zerojax.zero: offload_params=True needs stage=3 (got "
        f"stage={self.stage}): only stage 3 gathers each layer from a "
        f"shard just before use, so only there can the shard stay in host "
        f"memory. Use stage=3, or offload= for the optimizer state."
      )
    if self.offload_params and self.zeropp.active:
      raise ValueError(
        f"zerojax.zero: offload_params=True with zeropp={self.zeropp}: "
        f"ZeRO++'s quantized and in-node gathers read the shards on the "
        f"device. Drop one of them."
      )

  def _check_offload_grads(self):
    """Gradients in host memory: each leaf's reduced shard is written
    there in the backward pass (stages 2-3), and the streamed update
    brings each chunk's gradients down beside its state, so the whole
    state must be streamed (``offload=True``)."""
    g = self.offload_grads
    if not isinstance(g, bool):
      raise TypeError(
        f"zerojax.zero: offload_grads={g!r}; pass True (the reduced "
        f"gradients in host memory) or False."
      )
    if not g:
      return
    if self.stage < 2:
      raise ValueError(
        f"zerojax.zero: offload_grads=True needs stage 2 or 3 (got "
        f"stage={self.stage}): only there is each gradient reduced to its "
        f"shard in the backward pass, where it can go to host memory. Use "
        f"stage=2 or stage=3."
      )
    if self.offload_fraction < 1.0:
      raise ValueError(
        f"zerojax.zero: offload_grads=True needs offload=True (got "
        f"offload={self.offload!r}): the update brings each chunk's "
        f"gradients down with its optimizer state, so all of the state "
        f"must be streamed. Pass offload=True."
      )
    if self.zeropp.active or self.replica_axis is not None:
      what = (
        f"zeropp={self.zeropp}"
        if self.zeropp.active
        else f"replica_axis={self.replica_axis!r}"
      )
      raise ValueError(
        f"zerojax.zero: offload_grads=True with {what}: the gradient goes "
        f"to host memory as the data axis's reduce-scatter leaves it, "
        f"before any further reduction. Drop one of them."
      )

  def _check_replica_axis(self):
    r, names = self.replica_axis, tuple(self.mesh.axis_names)
    if r is not None and (r not in names or r == self.axis_name):
      raise ValueError(
        f"zerojax.zero: replica_axis={r!r} is not a mesh axis other than "
        f"the data axis {self.axis_name!r} (the mesh has {names}). Build "
        f"the mesh with zerojax.make_mesh('replica=2,data=4')."
      )

  @property
  def offload_fraction(self) -> float:
    """The share of the master copy and optimizer state's bytes to keep
    in host memory: 1.0 for ``offload=True``, 0.0 for ``False``."""
    return float(self.offload)

  @property
  def num_shards(self) -> int:
    """Devices along the data axis: the N of the ZeRO formulas."""
    return data_axis_size(self.mesh, self.axis_name)

  @property
  def compute_mesh(self) -> Mesh | AbstractMesh:
    """The mesh with every axis ``Auto``: what zerojax's constraints and
    ``shard_map`` regions name inside :func:`zerojax._src.records.mesh.auto_region`."""
    return compute_mesh(self.mesh)

  @property
  def num_replicas(self) -> int:
    return int(self.mesh.shape[self.replica_axis]) if self.replica_axis else 1

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes the batch splits over (and ``shard_map`` is manual over):
    replica, then data."""
    return ((self.replica_axis,) if self.replica_axis else ()) + (
      self.axis_name,
    )

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
    return {
      a: int(s) for a, s in self.mesh.shape.items() if a not in self.batch_axes
    }

  def plan(
    self, shape, dtype, stacked: bool = True, model: tuple = ()
  ) -> _layout.LeafLayout:
    """The layout of a master/optimizer/gradient leaf at this stage."""
    if self.stage == 0:
      return _layout.replicated(shape, model)
    return _layout.plan_leaf(
      shape,
      dtype,
      self.num_shards,
      self.min_shard_size,
      stacked=stacked,
      model=model,
      model_sizes=self.model_axes,
    )

  def plan_param(
    self, shape, dtype, stacked: bool = True, model: tuple = ()
  ) -> _layout.LeafLayout:
    """The layout of a parameter leaf: sharded only at stage 3."""
    if self.stage < 3:
      return _layout.replicated(shape, model, reason=f"stage {self.stage}")
    return self.plan(shape, dtype, stacked, model)


def _check_policy(policy):
  if not isinstance(policy, Policy):
    raise TypeError(
      f"zerojax.zero: policy must be a zerojax.Policy, got "
      f"{type(policy).__name__}."
    )
  for name in ("param_dtype", "master_dtype", "reduce_dtype"):
    dt = getattr(policy, name)
    if dt is not None and not jnp.issubdtype(dt, jnp.floating):
      raise ValueError(
        f"zerojax.Policy: {name}={dt!r} is not a floating dtype."
      )


def _check_zeropp(zeropp, stage: int, mesh: Mesh, axis_name: str):
  """Where each ZeRO++ setting applies; errors name the setting and fix."""
  if not isinstance(zeropp, ZeroPP):
    raise TypeError(
      f"zerojax.zero: zeropp must be a zerojax.ZeroPP, got "
      f"{type(zeropp).__name__}; e.g. zeropp=zerojax.ZeroPP("
      f"weight_bits=8, grad_bits=8)."
    )
  stage3_only = {
    "weight_bits": "quantizes stage 3's weight all-gathers (none in the "
    "model when the params are replicated)",
    "hpz_size": "keeps a secondary copy of stage 3's sharded params "
    "inside each node",
  }
  for name, what in stage3_only.items():
    value = getattr(zeropp, name)
    if value is not None and stage != 3:
      raise ValueError(
        f"zerojax.zero: ZeroPP({name}={value}) {what}, but stage={stage} "
        f"keeps the params replicated. Use stage=3, or {name}=None."
      )
  if zeropp.grad_bits is not None and stage == 0:
    raise ValueError(
      f"zerojax.zero: ZeroPP(grad_bits={zeropp.grad_bits}) quantizes the "
      f"gradient reduce-scatter of stages 1-3; stage 0 all-reduces "
      f"instead. Use stage >= 1, or grad_bits=None."
    )
  n = data_axis_size(mesh, axis_name)
  for name in ("hpz_size", "node_size"):
    k = getattr(zeropp, name)
    if k is not None and n % k:
      raise ValueError(
        f"zerojax.zero: ZeroPP({name}={k}) must divide the data axis "
        f"({axis_name!r} has {n} devices): the devices of one node, e.g. "
        f"{name}={n // 2} for 2 nodes."
      )
  if zeropp.hpz_size is not None and zeropp.hpz_size >= n:
    raise ValueError(
      f"zerojax.zero: ZeroPP(hpz_size={zeropp.hpz_size}) must be smaller "
      f"than the data axis ({axis_name!r} has {n} devices): the devices "
      f"of one node, e.g. hpz_size={n // 2} for 2 nodes."
    )


def _plain_flag(value):
  """A NumPy bool or float (a flag read from an array or a config file)
  as the Python one, so the config compares, hashes and prints as the
  same setting given plainly."""
  if isinstance(value, np.bool_):
    return bool(value)
  if isinstance(value, np.floating):
    return float(value)
  return value


def _check_offload(offload):
  """``offload``: a bool, or the fraction of the state in host memory."""
  if isinstance(offload, bool):
    return
  real = isinstance(offload, numbers.Real) and not isinstance(
    offload, numbers.Integral
  )
  if not real or not 0.0 <= float(offload) <= 1.0:
    raise (TypeError if not real else ValueError)(
      f"zerojax.zero: offload={offload!r}; pass True (master copy and "
      f"optimizer state in host memory), False, or the fraction of their "
      f"bytes to keep in host memory as a float in [0, 1], e.g. "
      f"offload=0.5 (zerojax.cost.offload_fraction_needed(abstract_"
      f"params, memory_bytes=..., tx=tx) names the least share with "
      f"which a device's working set fits)."
    )


def _check_host_memory(mesh: Mesh):
  """Offload needs a ``pinned_host`` memory on every device of the mesh.
  Checked on this process's devices: another process's list no memories
  here (a multi-host job, or a TPU topology compiled for ahead of time)."""
  devices = list(mesh.devices.flat)
  own = [d for d in devices if d.process_index == jax.process_index()]
  for d in own or devices:
    try:
      kinds = {m.kind for m in d.addressable_memories()}
    except Exception:  # noqa: BLE001 -- a backend without memory kinds
      kinds = set()
    if HOST_MEMORY not in kinds:
      raise ValueError(
        f"zerojax.zero(offload=True): device {d} has memories "
        f"{sorted(kinds) or 'of no named kind'}, no {HOST_MEMORY!r}; this "
        f"backend cannot hold the optimizer state in host memory. Use "
        f"offload=False (or a higher stage to shrink it)."
      )
