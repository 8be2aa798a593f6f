"""``zero()``: wrap an Optax optimizer for a ZeRO stage on a mesh."""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh

from zerojax._src.records.config import DEFAULT_BUCKET_BYTES, ZeroConfig
from zerojax._src.records.mesh import DEFAULT_AXIS, make_mesh
from zerojax._src.records.policy import Policy
from zerojax._src.records.zeropp import ZeroPP
from zerojax._src.step.dropin import ZeroTransformation, from_config

__all__ = ["ZeroConfig", "ZeroTransformation", "from_config", "zero"]


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
  offload: bool | float = False,
  zeropp: ZeroPP | None = None,
  bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
  offload_params: bool = False,
  offload_grads: bool = False,
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
      :func:`zerojax.diagnostics.layout_table`. Default 0: shard every non-scalar
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
      PartitionSpec`` (``path``: the leaf's ``keystr``, without a boxed
      leaf's ``.value``). Default: read from the params' own ``NamedSharding``
      where they carry one, else replicated over those axes. Those axes are
      left to XLA; zerojax adds the data axis on another dimension.
    offload: keep the master copy and the optimizer state in host memory
      (JAX memory kind ``pinned_host``; ZeRO-Offload's placement). The step
      brings them into device memory for the update and writes them back;
      params and gradients stay on device. Same numbers as without:
      bitwise where the compiler contracts no multiply-adds (the suite's
      CPU flags); where it contracts them to FMA (XLA's default CPU
      flags), the streamed update is compiled apart from the whole one
      and may round the last bits apart: layer stacks updated a few
      layers at a time, and on one device whole leaves too
      (``docs/design.md``). Device memory then holds
      params, gradients and the update's working set; the host holds
      ``(4 + K) Ψ / N`` bytes (fp32 master plus K bytes of optimizer
      state per parameter). A float in ``[0, 1]`` offloads that fraction
      of those bytes: whole arrays (a leaf's master copy, each of its
      optimizer-state leaves), the largest while they stay below it,
      then the smallest that reaches it, or whole leaves chosen so when
      they keep fewer bytes on the host; the rest stays on the device
      (``zerojax.report(...).offload["host_fraction"]`` gives the share
      reached, and a warning names the nearest share below the one asked
      when the one reached lies over 10 points above it;
      ``zerojax.cost.offload_fraction_needed(abstract_params,
      memory_bytes=..., tx=tx)`` gives the least share with which a
      device's working set fits).
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

    offload_params: stage 3 only: keep the parameters' shards in host
      memory too (ZeRO-Infinity's CPU tier). Each layer's shard comes to
      the device just before its gather, in the forward pass and again in
      the backward, and the updated shards go back. Same numbers as
      without. Layer stacks of vectors stay on the device, and every leaf
      is a stack unless ``stacked`` says otherwise. The TPU compiler
      streams the layers; the peak falls where a device's share of the
      params is large and can rise where it is small
      (``docs/results.md``).
    offload_grads: stages 2-3 with ``offload=True``: keep the reduced
      gradients in host memory too (ZeRO-Offload's gradient placement).
      Each leaf's shard goes to the host as the backward pass reduces it,
      layer by layer inside a scan, and the streamed update brings each
      chunk's gradients down with its state, so the device never holds
      the whole gradient (layer stacks of vectors keep theirs there; the
      TPU compiler's peaks: ``docs/results.md``). Same numbers as
      without. zerojax's own gradient half places them
      (:func:`zerojax.train_step`, :func:`zerojax.value_and_grad`); the
      Optax drop-in's ``update`` takes the caller's gradients where they
      are. Each leaf's update may read its own gradient
      (Adam, LAMB, Adafactor, per-leaf clipping) and small values made
      from all of them (``optax.clip_by_global_norm``'s norm,
      ``optax.apply_if_finite``'s finiteness, in a branch or not:
      computed first, each gradient brought down whole in turn, so they
      come down twice, three times for the finiteness of gradients a
      global norm clipped); an update that mixes gradients otherwise, or
      makes such a value from the state too (a clip under
      ``optax.MultiSteps``), is refused while tracing. With
      ``accum_steps > 1`` the sum over micro-batches is kept in host memory
      too: each micro-batch's backward pass brings a layer's sum down as it
      reduces that layer's gradient, adds it and writes it back (the
      gradients cross the link once more each way per micro-batch), which
      needs each param gathered once per micro-batch (a weight gathered
      twice, or inside a loop from outside it, is refused naming it).
      Without a global
      norm the step's ``grad_norm`` is summed from the gradients each
      chunk loads, so a layer stack updated a few layers per chunk adds
      its rows' sums: its last bits may differ from the norm without
      ``offload_grads`` (the state's do not).

  Returns:
    A :class:`ZeroTransformation` for :func:`zerojax.init` and
    :func:`zerojax.train_step`.

  Example:
    >>> tx = zerojax.zero(optax.adamw(3e-4), stage=2)
    >>> tx.stage, tx.axis_name
    (2, 'data')

  References:
    Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models, https://arxiv.org/abs/1910.02054
  """
  if mesh is None:
    mesh = _context_mesh(axis_name)
  return from_config(
    ZeroConfig(
      inner,
      stage,
      mesh,
      axis_name,
      Policy() if policy is None else policy,
      min_shard_size,
      stacked,
      _default_replica_axis(mesh, axis_name, replica_axis),
      model_specs,
      offload,
      ZeroPP() if zeropp is None else zeropp,
      bucket_bytes,
      offload_params,
      offload_grads,
    )
  )


def _default_replica_axis(mesh, axis_name: str, replica_axis):
  """The mesh's ``"replica"`` axis when none is named (hybrid sharding)."""
  names = getattr(mesh, "axis_names", ()) or ()
  if replica_axis is None and "replica" in names and axis_name != "replica":
    return "replica"
  return replica_axis
