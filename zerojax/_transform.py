"""``zero()``: wrap an Optax optimizer for a ZeRO stage on a mesh."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from zerojax import _buckets, _model_axes
from zerojax._config import HOST_MEMORY, STAGES, ZeroConfig
from zerojax._dropin import ZeroTransformation, from_config
from zerojax._mesh import DEFAULT_AXIS, data_axis_size, make_mesh
from zerojax._policy import Policy
from zerojax._zeropp import ZeroPP

__all__ = ["HOST_MEMORY", "STAGES", "ZeroConfig", "ZeroTransformation",
           "from_config", "zero"]

def _context_mesh(axis_name: str) -> Mesh:
  """The mesh from ``jax.set_mesh`` if one is set, else a new 1-D mesh."""
  ctx = jax.sharding.get_mesh()
  if isinstance(ctx, Mesh) and not ctx.empty:
    return ctx
  return make_mesh(axis_name=axis_name)


def zero(
    inner: optax.GradientTransformation,
    *,
    stage: int,
    mesh: Mesh | None = None,
    axis_name: str = DEFAULT_AXIS,
    policy: Policy | None = None,
    min_shard_size: int = 0,
    stacked=None,
    replica_axis: str | None = None,
    model_specs=None,
    offload: bool = False,
    zeropp: ZeroPP | None = None,
    bucket_bytes: int | None = _buckets.DEFAULT_BUCKET_BYTES,
) -> ZeroTransformation:
  """Wraps an Optax optimizer to shard training state at a ZeRO stage.

  The inner optimizer always runs on global (logical, unpadded) arrays under
  ``jit``, so its result equals unsharded Optax for every optimizer,
  including those that are not elementwise (global-norm clipping, LAMB,
  LARS, Adafactor, ``multi_transform``).

  Args:
    inner: any ``optax.GradientTransformation``.
    stage: 0 (plain data parallel), 1, 2 or 3; see :class:`ZeroTransformation`.
    mesh: a mesh with an ``axis_name`` axis; defaults to the mesh set with
      ``jax.set_mesh`` when there is one, else :func:`zerojax.make_mesh`
      over all devices.
    axis_name: the data-parallel mesh axis.
    policy: mixed-precision :class:`Policy`; default keeps leaf dtypes.
    min_shard_size: leaves with fewer elements stay replicated (DeepSpeed's
      ``stage3_param_persistence_threshold``); they are listed as such by
      :func:`zerojax.layout_table`. Default 0: shard every non-scalar
      floating leaf.
    stacked: which leaves are layer stacks (a ``lax.scan`` slices their
      leading dimension, so it is never the sharded one). ``None`` (default)
      or ``True``: every leaf of rank >= 2 may be a stack; ``False``: none
      is (any dimension may be sharded, the leading one included: e.g. an
      unstacked ``(768, 50257)`` head is sharded along 768, with no padding
      and contiguous collectives); or a function ``(path, shape) -> bool``
      of the leaf's ``jax.tree_util.keystr`` path, e.g.
      ``lambda path, shape: "blocks" in path``. A leaf wrongly marked as
      not stacked raises in :func:`zerojax.gather` when a scan slices it.
    replica_axis: a mesh axis the batch also splits over but the state is
      *replicated* across (hybrid sharding, HSDP: shard inside a slice or
      node, replicate across them). Gradients are reduce-scattered over the
      data axis, then the shards all-reduced over this axis (Ψ/N elements,
      once per step). Default: the mesh's ``"replica"`` axis if it has one.
    model_specs: the model's own (tensor-parallel) shardings over the mesh
      axes other than data and replica: a pytree of ``PartitionSpec``
      shaped like the params (see ``zerojax.linen.model_specs`` and
      ``zerojax.nnx.model_specs``), or a function ``(path, shape) ->
      PartitionSpec``. Default: read from the params' own ``NamedSharding``
      where they carry one, else replicated over those axes. Those axes are
      left to XLA; zerojax adds the data axis on another dimension.
    offload: keep the master copy and the optimizer state in host memory
      (JAX memory kind ``pinned_host``; ZeRO-Offload's placement). The step
      brings them into device memory for the update and writes them back;
      params and gradients stay on device. Same numbers as without
      (bitwise). Device memory then holds params, gradients and the
      update's working set; the host holds ``(4 + K) Ψ / N`` bytes (fp32
      master plus K bytes of optimizer state per parameter).
    zeropp: ZeRO++, a :class:`zerojax.ZeroPP`: int8 weight all-gathers at
      stage 3 (qwZ), int8 or int4 gradient reduce-scatters at stages 1-3
      (qgZ), a secondary partition inside nodes at stage 3 (hpZ). The
      quantized ones are lossy, within stated per-block bounds; off by
      default. They run in :func:`zerojax.train_step` and
      :func:`zerojax.value_and_grad` (evaluation gathers exactly).
    bucket_bytes: the most bytes one whole-leaf collective moves (ZeRO-R's
      constant-size buffers; DeepSpeed's ``reduce_bucket_size`` and
      ``allgather_bucket_size``). Stage 0's gradient all-reduce, stage 1's
      reduce-scatter, stages 1-2's all-gather of the updated params and the
      replica all-reduce run over a leaf's leading dimension (a layer
      stack's layers) in a loop of buckets this size, at least one row
      each, so no collective or its output buffer grows with depth. Default
      32 MiB; ``None``: one collective per leaf. Stage 3's gathers are per
      layer already. Same numbers either way.

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
  if not (stacked is None or isinstance(stacked, bool) or callable(stacked)):
    raise TypeError(f"zerojax.zero: stacked={stacked!r}; pass None, a bool, "
                    f"or a function (path, shape) -> bool.")
  if mesh is None:
    mesh = _context_mesh(axis_name)
  data_axis_size(mesh, axis_name)
  if replica_axis is None and "replica" in mesh.axis_names and (
      axis_name != "replica"):
    replica_axis = "replica"
  if replica_axis is not None:
    if replica_axis not in mesh.axis_names or replica_axis == axis_name:
      raise ValueError(
          f"zerojax.zero: replica_axis={replica_axis!r} is not a mesh axis "
          f"other than the data axis {axis_name!r} (the mesh has "
          f"{tuple(mesh.axis_names)}). Build the mesh with "
          f"zerojax.make_mesh('replica=2,data=4').")
  model_specs = _model_axes.as_lookup(model_specs)
  policy = Policy() if policy is None else policy
  if not isinstance(policy, Policy):
    raise TypeError(f"zerojax.zero: policy must be a zerojax.Policy, got "
                    f"{type(policy).__name__}.")
  for name in ("param_dtype", "master_dtype", "reduce_dtype"):
    dt = getattr(policy, name)
    if dt is not None and not jnp.issubdtype(dt, jnp.floating):
      raise ValueError(f"zerojax.Policy: {name}={dt!r} is not a floating "
                       f"dtype.")
  if not isinstance(offload, bool):
    raise TypeError(f"zerojax.zero: offload={offload!r}; pass True (master "
                    f"copy and optimizer state in host memory) or False.")
  if offload:
    _check_host_memory(mesh)
  zeropp = ZeroPP() if zeropp is None else zeropp
  _check_zeropp(zeropp, stage, mesh, axis_name)
  if bucket_bytes is not None and (
      isinstance(bucket_bytes, bool)
      or not isinstance(bucket_bytes, numbers.Integral)
      or bucket_bytes <= 0):
    raise ValueError(
        f"zerojax.zero: bucket_bytes={bucket_bytes!r} must be a positive int "
        f"(bytes per collective, e.g. 32 * 2**20) or None (whole leaves).")
  return from_config(ZeroConfig(inner, stage, mesh, axis_name, policy,
                                min_shard_size, stacked, replica_axis,
                                model_specs, offload, zeropp, bucket_bytes))


def _check_zeropp(zeropp, stage: int, mesh: Mesh, axis_name: str):
  """Where each ZeRO++ setting applies; errors name the setting and fix."""
  if not isinstance(zeropp, ZeroPP):
    raise TypeError(f"zerojax.zero: zeropp must be a zerojax.ZeroPP, got "
                    f"{type(zeropp).__name__}; e.g. zeropp=zerojax.ZeroPP("
                    f"weight_bits=8, grad_bits=8).")
  stage3_only = {
      "weight_bits": "quantizes stage 3's weight all-gathers (none in the "
                     "model when the params are replicated)",
      "hpz_size": "keeps a secondary copy of stage 3's sharded params "
                  "inside each node"}
  for name, what in stage3_only.items():
    value = getattr(zeropp, name)
    if value is not None and stage != 3:
      raise ValueError(
          f"zerojax.zero: ZeroPP({name}={value}) {what}, but stage={stage} "
          f"keeps the params replicated. Use stage=3, or {name}=None.")
  if zeropp.grad_bits is not None and stage == 0:
    raise ValueError(
        f"zerojax.zero: ZeroPP(grad_bits={zeropp.grad_bits}) quantizes the "
        f"gradient reduce-scatter of stages 1-3; stage 0 all-reduces "
        f"instead. Use stage >= 1, or grad_bits=None.")
  n = data_axis_size(mesh, axis_name)
  for name in ("hpz_size", "node_size"):
    k = getattr(zeropp, name)
    if k is not None and n % k:
      raise ValueError(
          f"zerojax.zero: ZeroPP({name}={k}) must divide the data axis "
          f"({axis_name!r} has {n} devices): the devices of one node, e.g. "
          f"{name}={n // 2} for 2 nodes.")
  if zeropp.hpz_size is not None and zeropp.hpz_size >= n:
    raise ValueError(
        f"zerojax.zero: ZeroPP(hpz_size={zeropp.hpz_size}) must be smaller "
        f"than the data axis ({axis_name!r} has {n} devices): the devices "
        f"of one node, e.g. hpz_size={n // 2} for 2 nodes.")


def _check_host_memory(mesh: Mesh):
  """Offload needs a ``pinned_host`` memory on every device of the mesh."""
  for d in mesh.devices.flat:
    try:
      kinds = {m.kind for m in d.addressable_memories()}
    except Exception:     # a backend without memory kinds
      kinds = set()
    if HOST_MEMORY not in kinds:
      raise ValueError(
          f"zerojax.zero(offload=True): device {d} has memories "
          f"{sorted(kinds) or 'of no named kind'}, no {HOST_MEMORY!r}; this "
          f"backend cannot hold the optimizer state in host memory. Use "
          f"offload=False (or a higher stage to shrink it).")
