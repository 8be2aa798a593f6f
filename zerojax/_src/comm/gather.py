"""The primitive a model calls to use its parameters: :func:`gather`.

Inside a ZeRO-2/3 train step, every sharded parameter reaches the loss as a
:class:`ShardedParam`: a gradient *sink* (a zero array of the local shard's
shape) and a *source* (the local shard at stage 3, the replicated full value
at stage 2). ``gather`` turns it into the full logical array:

* stage 3: ``all_gather`` of the local shard along the sharded dimension;
* stage 2: the replicated value, which is already there (no communication).

Its backward pass is the same at both stages: the incoming cotangent is
reduce-scattered (``psum_scatter``) onto the sink, right where the backward
pass produces it. Called on one layer's slice inside a ``lax.scan`` body,
that puts one reduce-scatter per layer inside the backward loop, so the full
gradient never exists at once. Under ``jax.checkpoint`` the gather is
replayed in the backward pass instead of saving the gathered weight.

Why a sink rather than differentiating the shard itself: the cotangent must
arrive in ``reduce_dtype`` with the shard's shape at stage 2 too, where no
shard-shaped input exists. The gathered value is marked device-varying so
that JAX does not insert an implicit all-reduce (the transpose of an
implicit broadcast) before our reduce-scatter.

At stages 1-2 one ``gather`` call reduces its leaves' gradients
together: leaves that share the data axis, reduce dtype and stored dtype
(and are exact and not split over a model axis) are laid end to end in
one buffer, up to the tx's ``bucket_bytes``, and reduced in one
reduce-scatter, as FSDP's flat parameter does per layer. A layer's dozen
gradients are one collective instead of a dozen: XLA CPU merges none of
them, and on GPU the grouping no longer depends on XLA's combiner
thresholds. The cost is a copy of the layer's gradient into the buffer.
Stage 3 moves each leaf alone, both ways (docs/design.md says why).

Outside a train step, or on plain arrays, ``gather`` is the identity, so a
model that calls it also runs unchanged at stages 0-1 and in evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.comm import quantized as _zeropp
from zerojax._src.records import layout as _layout
from zerojax._src.records import mesh as _mesh


@dataclasses.dataclass(frozen=True)
class GatherSpec:
  """Static description of how a :class:`ShardedParam` is gathered.

  ``dim`` counts from the end (negative), so that slicing leading (layer)
  axes, as ``lax.scan`` does, leaves it valid.
  """

  axis_name: str
  dim: int
  size: int
  stage: int
  reduce_dtype: Any
  path: str = ""  # the leaf's keystr in the params tree, for errors
  replica: tuple = ()  # other manual axes the batch splits over (HSDP)
  padded: int = 0  # size of ``dim`` in storage (0: next multiple)
  model: tuple = ()  # the leaf's model spec, per dimension (TP axes)
  weight_bits: int | None = None  # qwZ: quantized stage-3 all-gather
  grad_bits: int | None = None  # qgZ: quantized reduce-scatter
  block_size: int = 256  # elements per quantization block
  hpz: int = 0  # hpZ: ``src`` is the secondary shard
  # (1/hpz of the leaf), gathered in-node
  node: int = 0  # qgZ: hierarchical over nodes of this
  # many devices (0: flat)
  stochastic: bool = False  # qgZ: stochastic rounding
  group_bytes: int | None = None  # cap on one grouped collective's full
  # bytes (the tx's bucket_bytes; None: no cap)
  on_host: bool = False  # stage 3: ``src`` lives in host memory
  # stages 2-3 with offload_grads: the reduced gradient is scaled by this
  # (the step's mean over devices and micro-batches) and written to host
  # memory where the backward pass reduces it (None: left on the device)
  grad_to_host: float | None = None
  # with grad_to_host, over micro-batches: the sink holds the gradient
  # summed so far (in host memory), and the reduced gradient is added to it
  accumulate: bool = False


def _entries(model, ndim):
  """The last ``ndim`` per-dimension model specs (scan slices leading dims)."""
  dims = list(model)[-ndim:] if ndim else []
  dims = [()] * (ndim - len(dims)) + [tuple(a) for a in dims]
  return [None if not a else a[0] if len(a) == 1 else a for a in dims]


def over_model_shards(fn, x, model, dim=None):
  """Runs the data-axis collective ``fn`` on each model shard of ``x``.

  ``dim``: the dimension ``fn`` gathers or scatters; ``None`` for an
  elementwise collective (``psum``), which is always run per model shard.

  Inside the step's ``shard_map`` the data axis is manual and the model
  axes are automatic. XLA partitions a manual-axis collective there only on
  an operand replicated over the automatic axes: left alone it would first
  all-gather a tensor-parallel weight over ``model`` and then move the full
  weight over ``data`` (measured: Ψ over data, not Ψ/M). Made manual over
  the leaf's model axes too (a nested ``shard_map``), each device gathers
  or reduce-scatters only its model shard: Ψ/M over data, nothing over
  model. Where the data axis shares its dimension with the model
  (``P(("data", "model"))``) the model-local blocks are not contiguous
  after a gather, so that dimension enters whole over the model axes (XLA
  gathers it over ``model`` first: the bytes XLA's own route moves).

  Every data-axis collective runs this way, manual over all the automatic
  axes, even for leaves the model does not shard: XLA CPU aborts compiling
  bf16 collectives over a manual axis inside a region automatic over
  another (measured with jax 0.10.2 on the GPT at 4 x 2: "Invalid binary
  instruction opcode copy"; fine once the operand is manual everywhere).
  """
  entries = _entries(
    model, np.ndim(x)
  )  # a literal (a constant aux) has no .ndim
  mesh = jax.sharding.get_abstract_mesh()
  axes = {
    a
    for a, t, n in zip(mesh.axis_names, mesh.axis_types, mesh.axis_sizes)
    if t != jax.sharding.AxisType.Manual and n > 1
  }
  if not axes:
    return fn(x)
  if dim is not None and entries[dim] is not None:
    entries[dim] = None  # shared with the data axis: whole over model
  spec = jax.sharding.PartitionSpec(*entries)
  region = jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=spec,
    out_specs=spec,
    axis_names=axes,
    check_vma=not _mesh.untyped_now(),
  )
  # Under ``jax.checkpoint`` (identity here: nothing differentiates this
  # call, it runs inside the gather's custom VJP) so that a scan's partial
  # evaluation keeps the nested region whole: split, its scalar residuals
  # (the quantizer's constants) come out mapped over the parent's manual
  # data axis and lowering fails (JAX 0.10.2 and 0.12, measured).
  return jax.checkpoint(region, prevent_cse=False)(x)


class UngatheredParamError(TypeError):
  """A sharded parameter was used without :func:`gather`."""


@jax.tree_util.register_pytree_node_class
class ShardedParam:
  """A parameter as a ZeRO-2/3 loss sees it: call :func:`gather` to use it."""

  def __init__(self, sink, src, spec: GatherSpec):
    self.sink, self.src, self.spec = sink, src, spec

  def tree_flatten(self):
    return (self.sink, self.src), self.spec

  @classmethod
  def tree_unflatten(cls, spec, children):
    return cls(*children, spec)

  @property
  def shape(self) -> tuple[int, ...]:
    """The full (gathered, logical) shape."""
    shape = list(self.src.shape)
    shape[len(shape) + self.spec.dim] = self.spec.size
    return tuple(shape)

  @property
  def dtype(self):
    return self.src.dtype

  @property
  def ndim(self) -> int:
    return len(self.src.shape)

  def _misuse(self, *args, **kwargs):
    raise UngatheredParamError(
      f"zerojax: sharded parameter params{self.spec.path} (shape "
      f"{self.shape}) was used without "
      f"being gathered. Call zerojax.gather(params) (or on the layer's "
      f"subtree) before using it, or build the step with "
      f"zerojax.train_step(..., gather='all')."
    )

  def __getattr__(self, name):
    # Only reached for attributes a ShardedParam lacks (astype, T, ...).
    if name.startswith("__") or name in ("sink", "src", "spec"):
      raise AttributeError(name)
    self._misuse()

  __getitem__ = __array__ = __jax_array__ = _misuse
  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
  __matmul__ = __rmatmul__ = __truediv__ = __rtruediv__ = __neg__ = _misuse

  def __repr__(self):
    shape = getattr(self.src, "shape", None)
    return (
      f"ShardedParam(stage={self.spec.stage}, local_shape={shape}, "
      f"dim={self.spec.dim}; call zerojax.gather() before use)"
    )


def _is_sharded(x) -> bool:
  return isinstance(x, ShardedParam)


def gather(tree):
  """Returns ``tree`` with every :class:`ShardedParam` gathered to full.

  Call it on the parameters a layer needs, just before the layer uses them;
  inside a ``lax.scan`` over stacked layers call it in the loop body on that
  layer's slice, and wrap the body in ``jax.checkpoint`` so the gathered
  weights are gathered again in the backward pass rather than saved.
  Leaves that are not sharded (plain arrays) pass through unchanged.

  Args:
    tree: any pytree of parameters.

  Returns:
    The same tree with full (unsharded, unpadded) arrays.

  Example:
    >>> def body(h, layer_params):
    ...   w = zerojax.gather(layer_params)
    ...   return jnp.tanh(h @ w["kernel"]), None
    >>> h, _ = jax.lax.scan(jax.checkpoint(body), x, params["layers"])
    >>> h.shape
    (16, 8)
  """
  return _gather_groups(tree, _groups)


def gather_each(tree):
  """:func:`gather` with one collective per leaf: for the whole parameter
  tree at once, where a group's flat buffer would be a second copy of the
  whole gradient."""
  return _gather_groups(tree, lambda items: [[i] for i, _ in items])


def _gather_groups(tree, groups):
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_sharded)
  out = list(leaves)
  for group in groups([(i, x) for i, x in enumerate(leaves) if _is_sharded(x)]):
    specs = tuple(leaves[i].spec for i in group)
    full = zerojax_gather(
      specs,
      tuple(leaves[i].sink for i in group),
      tuple(leaves[i].src for i in group),
    )
    for i, x in zip(group, full):
      out[i] = x
  return jax.tree.unflatten(treedef, out)


def _groupable(spec: GatherSpec) -> bool:
  """Whether the leaf's reduction can share one buffer with others: at
  stages 1-2, exact (no ZeRO++), and not split over a model axis (those
  run per model shard, :func:`over_model_shards`)."""
  return spec.stage in (1, 2) and not (
    spec.weight_bits
    or spec.grad_bits
    or spec.hpz
    or any(_entries(spec.model, len(spec.model)))
  )


def _groups(items) -> list[list[int]]:
  """The ``gather`` call's sharded leaves in groups whose gradients are
  reduced in one collective each: leaves with the same axes, stage,
  reduce dtype and stored dtype, in tree order, up to ``group_bytes`` of
  full value per group; any other leaf alone."""
  groups, open_ = [], {}
  for i, x in items:
    s = x.spec
    if not _groupable(s):
      groups.append([i])
      continue
    key = (
      s.axis_name,
      s.replica,
      s.stage,
      np.dtype(s.reduce_dtype),
      np.dtype(x.src.dtype),
    )
    size = math.prod(x.shape) * max(
      np.dtype(x.src.dtype).itemsize, np.dtype(s.reduce_dtype).itemsize
    )
    g = open_.get(key)
    if g is None or (s.group_bytes is not None and g[1] + size > s.group_bytes):
      g = open_[key] = [[], 0]
      groups.append(g[0])
    g[0].append(i)
    g[1] += size
  return groups


def _check_rank(spec: GatherSpec, x):
  if x.ndim + spec.dim < 0:
    raise ValueError(
      f"zerojax.gather: a parameter sharded along its leading dimension was "
      f"sliced to rank {x.ndim} before gathering (a scan over a leaf that "
      f"is not marked as a layer stack). Mark it as stacked: "
      f"zerojax.zero(..., stacked=lambda path, shape: ...) returning True "
      f"for it, or gather it before slicing."
    )


def _full_value(spec: GatherSpec, src):
  _check_rank(spec, src)
  if spec.on_host:  # this layer's shard, brought down just before its use
    src = jax.device_put(src, jax.memory.Space.Device)
  if spec.stage == 3:
    dim = src.ndim + spec.dim
    if spec.hpz:
      gather_fn = lambda s: _zeropp.gather_in_node(
        s, spec.axis_name, dim, spec.hpz
      )
    elif spec.weight_bits:
      gather_fn = lambda s: _zeropp.all_gather(
        s, spec.axis_name, dim, spec.weight_bits, spec.block_size
      )
    else:
      gather_fn = lambda s: jax.lax.all_gather(
        s, spec.axis_name, axis=dim, tiled=True, to="varying"
      )
    full = over_model_shards(gather_fn, src, spec.model, dim)
    full = jax.lax.slice_in_dim(full, 0, spec.size, axis=dim)
    # Varying over the replica axis too: otherwise the transpose of the
    # implicit broadcast would all-reduce the full cotangent over replicas.
    return (
      jax.lax.pcast(full, spec.replica, to="varying") if spec.replica else full
    )
  return jax.lax.pcast(src, (spec.axis_name,) + spec.replica, to="varying")


def _reduce_flat(specs, cts):
  """Several leaves' cotangents (stages 1-2) reduced in one collective,
  in the shared reduce dtype: a ``psum_scatter`` of a ``[N, ...]`` buffer
  whose row ``d`` holds every leaf's block ``d`` (its sharded dimension
  padded, made major and split in N), so device ``d`` receives each
  leaf's shard ``d``."""
  spec = specs[0]
  dtype = spec.reduce_dtype
  n = jax.lax.axis_size(spec.axis_name)
  rows = []
  for g, c in zip(specs, cts):
    d = c.ndim + g.dim
    pad = (g.padded - c.shape[d]) if g.padded else -c.shape[d] % n
    if pad:
      c = _layout.pad_dim(c, d, pad)
    rows.append(jnp.moveaxis(c.astype(dtype), d, 0))
  buf = jnp.concatenate([r.reshape(n, -1) for r in rows], axis=1)
  mine = over_model_shards(
    lambda b: jax.lax.psum_scatter(
      b, spec.axis_name, scatter_dimension=0, tiled=True
    ),
    buf,
    (),
    0,
  )
  outs, at = [], 0
  for g, r, c in zip(specs, rows, cts):
    width = r.size // n
    shard = mine[0, at : at + width].reshape((r.shape[0] // n,) + r.shape[1:])
    at += width
    outs.append(jnp.moveaxis(shard, 0, c.ndim + g.dim))
  return tuple(outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def zerojax_gather(specs: tuple[GatherSpec, ...], sinks, srcs):
  """The gather of one group of leaves (:func:`_groups`) as one
  ``custom_vjp`` call, recognisable by name in a jaxpr."""
  return zerojax_gather_fwd(specs, sinks, srcs)[0]


GATHER_NAME = zerojax_gather.__name__  # read by zerojax._src.jaxpr.audit


def zerojax_gather_fwd(specs, sinks, srcs):
  """Each leaf gathered on its own: an all-gather's output is then the
  leaf itself, where a shared buffer would need a copy out of it. An
  accumulating leaf's sink (the sum so far) is kept for the backward."""
  kept = tuple(s if g.accumulate else None for g, s in zip(specs, sinks))
  return tuple(_full_value(g, s) for g, s in zip(specs, srcs)), kept


def zerojax_gather_bwd(specs, kept, cts):
  if len(specs) > 1:
    out = _reduce_flat(specs, cts)
  else:
    out = (_reduce_one(specs[0], cts[0]),)
  return tuple(_to_host(g, s, a) for g, s, a in zip(out, specs, kept)), None


def _to_host(g, spec: GatherSpec, summed=None):
  """A reduced gradient, in host memory where the leaf's gradient is
  offloaded (its sink lives there: :func:`sink_like`): added to the sum
  so far (``summed``, an accumulating leaf's sink, brought down), then
  scaled."""
  if spec.grad_to_host is None:
    return g
  if summed is not None:
    g = jax.device_put(summed, jax.memory.Space.Device) + g
  if spec.grad_to_host != 1.0:
    g = g * spec.grad_to_host
  return jax.device_put(g, jax.memory.Space.Host)


def _reduce_one(spec, ct):
  """One leaf's cotangent reduced on its own (in the reduce dtype)."""
  if spec.stage == 0:  # replicated: the cotangent summed over the data
    # axis, layer by layer, in the reduce dtype (the step scales the loss
    # before differentiating it, so the sum is the mean already)
    return over_model_shards(
      lambda c: jax.lax.psum(c.astype(spec.reduce_dtype), spec.axis_name),
      ct,
      spec.model,
    )
  dim = ct.ndim + spec.dim
  n = jax.lax.axis_size(spec.axis_name)
  pad = (spec.padded - ct.shape[dim]) if spec.padded else -ct.shape[dim] % n
  if pad:
    ct = _layout.pad_dim(ct, dim, pad)
  return over_model_shards(
    lambda c: reduce_scatter(c, spec.axis_name, dim, spec), ct, spec.model, dim
  )


def on_major_dim(collective, x, dim: int):
  """``collective(y, 0)`` on ``x`` with ``dim`` moved to the front, moved
  back after: a gather or scatter along ``dim`` as one along the major
  dimension, with the transposes written out.

  XLA runs an all-gather or reduce-scatter over the major dimension; on
  another one its layout assignment picks a layout with that dimension
  major for the operand and copies into it. Inside a bucket loop
  (``comm/buckets``) it may make that copy outside the loop, on the whole
  source leaf: stage 1's reduce-scatter of the stacked GPT gradients
  (width 512, depth 8, 8 devices, buckets of one layer) copied every big
  stack once more (compiled temp 5.80 bytes/param; the gradient itself
  is 4). With the transposes explicit the copy is the bucket's, in the
  loop body (5.14). Same elements, same collective, same bytes."""
  if dim == 0:
    return collective(x, 0)
  return jnp.moveaxis(collective(jnp.moveaxis(x, dim, 0), 0), 0, dim)


def reduce_scatter(x, axis_name, dim: int, spec: GatherSpec):
  """The gradient reduce-scatter: in ``spec.reduce_dtype``, or with qgZ as
  an all-to-all of quantized blocks summed in fp32 (then cast)."""
  if spec.grad_bits:
    return _zeropp.reduce_scatter(
      x,
      axis_name,
      dim,
      spec.grad_bits,
      spec.block_size,
      node=spec.node,
      stochastic=spec.stochastic,
    ).astype(spec.reduce_dtype)
  return on_major_dim(
    lambda y, d: jax.lax.psum_scatter(
      y, axis_name, scatter_dimension=d, tiled=True
    ),
    x.astype(spec.reduce_dtype),
    dim,
  )


zerojax_gather.defvjp(zerojax_gather_fwd, zerojax_gather_bwd)


def sink_like(src_shard_shape, dtype, axes, on_host: bool = False):
  """A zero gradient sink of the local shard's shape, device-varying over
  ``axes`` (the data axis, and the replica axis under hybrid sharding);
  in host memory where the gradient goes there (a cotangent has its
  primal's memory space). Only its cotangent is used."""
  sink = jax.lax.pcast(
    jnp.zeros(src_shard_shape, np.dtype(dtype)), axes, to="varying"
  )
  return jax.device_put(sink, jax.memory.Space.Host) if on_host else sink
