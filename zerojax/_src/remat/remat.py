"""ZeRO-R's activation checkpoints for any block: what is kept, where, split how.

Once ZeRO has sharded the model state, the activations a backward pass
keeps from its forward pass bound the batch and the context. ZeRO-R
(arXiv 1910.02054, section 6.1) trims them three ways, and :class:`Remat`
is all three as one wrapper around a layer function ``fn(x, *args)``, the
way ``jax.checkpoint`` / ``nnx.remat`` / ``nn.remat`` are used:

* **what is kept** (``saves``): the block input only (``"input"``, the
  layer-boundary checkpoint: everything inside the block is recomputed in
  the backward pass); also the matmul outputs (``"dots"``: JAX's
  ``dots_with_no_batch_dims_saveable``); or the tensors the block tags
  with ``jax.ad_checkpoint.checkpoint_name`` (a tuple of names); or
  everything (``"all"``: no rematerialisation, as without
  ``jax.checkpoint``);
* **Pa** (``partition``): the block input split over a mesh axis (usually
  the tensor-parallel ``model`` axis) along dimension ``dim`` (the
  sequence of a ``(B, T, D)`` input by default), so each device keeps
  ``1/M`` of it; the compiler gathers it back where the block needs it
  whole (Megatron's sequence parallelism). Every other tensor the block
  keeps (``"dots"``, names) is split too, along ``dim`` when ``M``
  divides it, else along its largest dimension ``M`` divides (else kept
  whole), unless its type already splits it over the axis: each is saved
  split and used whole (:mod:`zerojax._src.remat.kept`);
* **Pa+cpu** (``offload=True``): every kept tensor goes to ``pinned_host``
  memory in the forward pass and comes back when the backward pass reaches
  its layer (inside a ``lax.scan``: one layer at a time).

The block's input (the array leaves of its first argument) goes through
:data:`LAYER_INPUT` (``checkpoint_name``), so that an offloading policy
leaves no device copy of it among the saved values.

Pa names a mesh axis: under zerojax's step (and any ``jit`` under
``jax.set_mesh``), the current abstract mesh. On an Auto axis the split is
a sharding constraint, on an Explicit one a ``jax.sharding.reshard``: the
checkpoint saves the split input and the block computes on it resharded
whole (its types are those it was written for), and the output keeps the
input's type, as ``lax.scan`` requires of a carry.
With no mesh in context (a one-device reference run) there is nothing to
split over and the call only rematerialises. What is kept, split or
offloaded is a memory choice, not a different computation: the numbers are
those of the block without the call, up to the order XLA sums in.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from zerojax._src.remat import kept
from zerojax._src.remat.recording import RECORDER, Split

# The name of each block's input (the layer-boundary checkpoint) in the
# traced program, for checkpoint policies.
LAYER_INPUT = "zerojax_layer_input"

SAVES = ("input", "dots", "all")


class RematError(ValueError):
  """A :class:`Remat` setting the model or the mesh cannot honour."""


@dataclasses.dataclass(frozen=True)
class _Policy:
  """A ``jax.checkpoint`` policy: the named values in ``names`` (and, with
  ``dots``, matmul outputs without batch dimensions) are kept, on the
  device or offloaded to pinned host memory; everything else is
  recomputed. Hashable, so ``jax.checkpoint`` caches on it."""

  names: frozenset
  dots: bool
  offload: bool

  def __call__(self, prim, *avals, **params) -> Any:
    keep = bool(self.names) and jax.checkpoint_policies.save_only_these_names(
      *self.names
    )(prim, *avals, **params)
    if not keep and self.dots:
      keep = jax.checkpoint_policies.dots_with_no_batch_dims_saveable(
        prim, *avals, **params
      )
    if not keep:
      return jax.ad_checkpoint.Recompute
    if self.offload:
      return jax.ad_checkpoint.Offloadable(src="device", dst="pinned_host")
    return jax.ad_checkpoint.Saveable


@dataclasses.dataclass(frozen=True)
class Remat:
  """ZeRO-R's activation checkpointing for one block (see module docstring).

  Attributes:
    saves: ``"input"`` (the block input only), ``"dots"`` (also the matmul
      outputs without batch dimensions), a tuple of names the block tags
      with ``jax.ad_checkpoint.checkpoint_name`` (with the input), or
      ``"all"`` (no rematerialisation: every intermediate is kept).
    partition: a mesh axis to split the block input and the tensors the
      block keeps over (Pa), or ``None``.
    dim: the input's dimension ``partition`` splits (default 1: the
      sequence of ``(B, T, D)``; negative counts from the end).
    offload: keep the saved tensors in ``pinned_host`` memory (Pa+cpu).

  ``Remat(...)(fn)`` (or :func:`remat`) wraps ``fn(x, *args) -> out``;
  ``out`` may be ``x``-shaped or a ``(carry, y)`` pair for ``lax.scan``.
  ``zerojax.nnx.scan_layers`` and ``zerojax.linen.scan_layers`` take one as
  ``remat=``.
  """

  saves: str | tuple[str, ...] = "input"
  partition: str | None = None
  dim: int = 1
  offload: bool = False

  # the name the block input carries in the traced program
  input_name: ClassVar[str] = LAYER_INPUT

  def __post_init__(self):
    saves = self.saves
    if isinstance(saves, list):
      saves = tuple(saves)
      object.__setattr__(self, "saves", saves)
    names_ok = isinstance(saves, tuple) and all(
      isinstance(n, str) and n for n in saves
    )
    if saves not in SAVES and not names_ok:
      raise RematError(
        f"zerojax.remat: saves={self.saves!r}; use 'input' (the block input "
        f"only), 'dots' (also the matmul outputs), 'all' (no "
        f"rematerialisation) or a tuple of names the block tags with "
        f"jax.ad_checkpoint.checkpoint_name."
      )
    if saves == "all" and self.offload:
      raise RematError(
        "zerojax.remat: saves='all' keeps every intermediate of the block "
        "on the device; offload=True moves kept tensors to host memory, "
        "so name what to keep (saves='input', 'dots' or names)."
      )
    if self.partition is not None and not isinstance(self.partition, str):
      raise RematError(
        f"zerojax.remat: partition={self.partition!r} must be a mesh axis "
        f"name (e.g. 'model') or None."
      )
    if not isinstance(self.dim, int) or isinstance(self.dim, bool):
      raise RematError(f"zerojax.remat: dim={self.dim!r} must be an int.")
    if not isinstance(self.offload, bool):
      raise RematError(
        f"zerojax.remat: offload={self.offload!r} must be True or False."
      )

  @property
  def policy(self) -> Callable:
    """The ``jax.checkpoint`` policy (also for ``nnx.remat`` / ``nn.remat``)."""
    names = self._kept_policy(offload=False).names
    if self.offload:
      names |= {LAYER_INPUT}
    if self.splits_kept:
      names |= {kept.KEPT}
    return _Policy(names=names, dots=self.saves == "dots", offload=self.offload)

  @property
  def splits_kept(self) -> bool:
    """Whether Pa splits tensors kept inside the block too (``saves``
    ``"dots"`` or names, with ``partition``), not only its input."""
    return self.partition is not None and self.saves not in ("input", "all")

  def _kept_policy(self, offload: bool) -> _Policy:
    names = frozenset(self.saves if isinstance(self.saves, tuple) else ())
    return _Policy(names=names, dots=self.saves == "dots", offload=offload)

  def __call__(self, fn: Callable) -> Callable:
    fn = self.on_whole_input(self.split_kept(fn))
    checkpointed = (
      fn
      if self.saves == "all"
      else jax.checkpoint(name_input(fn), policy=self.policy)
    )

    @functools.wraps(fn)
    def block(x, *args, **kwargs):
      return self.restore(checkpointed(self.split(x), *args, **kwargs), x)

    return block

  def split_kept(self, fn: Callable) -> Callable:
    """``fn`` with each tensor the policy keeps inside it split over
    ``partition`` (:mod:`zerojax._src.remat.kept`), when
    :attr:`splits_kept`; ``fn`` itself otherwise."""
    if not self.splits_kept:
      return fn
    splitting = kept.split_kept(fn, self._keeps, self._keep)

    @functools.wraps(fn)
    def block(*args, **kwargs):
      # no mesh to split over (a one-device run): the block as written
      return (fn if self._where() is None else splitting)(*args, **kwargs)

    return block

  def _keeps(self, prim, *avals, **params) -> bool:
    """Whether the block's policy keeps this equation's output."""
    return (
      self._kept_policy(offload=False)(prim, *avals, **params)
      is not jax.ad_checkpoint.Recompute
    )

  def _keep(self, v):
    """A kept tensor split over ``partition`` (see :meth:`_kept_dim`) and
    named :data:`kept.KEPT`; on an Explicit axis the block goes on with
    the tensor's own type (the split is what is saved)."""
    mesh, axes, recorder = self._where()  # split_kept runs with a mesh
    shards = self._shards(axes, mesh)
    dim = self._kept_dim(v, shards, mesh)
    if dim is None:
      return checkpoint_name(v, kept.KEPT)
    if recorder is not None:
      recorder[1].append(Split(tuple(v.shape), np.dtype(v.dtype), shards))
    if mesh.empty:
      return checkpoint_name(v, kept.KEPT)
    saved = checkpoint_name(self._constrain(v, dim, mesh, ()), kept.KEPT)
    if _axis_type(mesh, self.partition) == AxisType.Explicit:
      return jax.sharding.reshard(saved, jax.typeof(v).sharding.spec)
    return saved

  def _kept_dim(self, v, shards: int, mesh) -> int | None:
    """The dimension of kept tensor ``v`` to split in ``shards``: ``dim``
    when ``shards`` divides it, else the largest one it divides; ``None``
    (kept whole) when it divides none, or when ``v`` is already split over
    ``partition`` or over another axis there (Explicit types)."""
    if shards == 1 or v.ndim == 0:
      return None
    spec = [None] * v.ndim
    if not mesh.empty and _axis_type(mesh, self.partition) == AxisType.Explicit:
      spec = list(jax.typeof(v).sharding.spec) + [None] * v.ndim
      axis = self.partition
      if any(e == axis or (isinstance(e, tuple) and axis in e) for e in spec):
        return None
    first = self.dim % v.ndim if -v.ndim <= self.dim < v.ndim else None
    order = sorted(range(v.ndim), key=lambda d: (d != first, -v.shape[d]))
    return next(
      (d for d in order if spec[d] is None and v.shape[d] % shards == 0), None
    )

  def split(self, x, *, record: bool = True):
    """``x``'s array leaves split over ``partition`` along ``dim`` (Pa);
    ``x`` itself without ``partition`` or a mesh to split over. ``record``:
    report the split to :func:`recording` (the block input, not its
    output)."""
    where = self._where()
    if where is None:
      return x
    mesh, axes, recorder = where
    shards = self._shards(axes, mesh)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(x)
    out = []
    for path, leaf in leaves:
      if not hasattr(leaf, "shape"):
        out.append(leaf)
        continue
      dim = self._check_leaf(path, leaf, shards)
      if shards == 1:
        out.append(leaf)
        continue
      if record and recorder is not None:
        recorder[1].append(
          Split(tuple(leaf.shape), np.dtype(leaf.dtype), shards)
        )
      out.append(leaf if mesh.empty else self._constrain(leaf, dim, mesh, path))
    return jax.tree_util.tree_unflatten(treedef, out)

  def on_whole_input(self, fn: Callable) -> Callable:
    """``fn`` given its first argument whole again on an Explicit axis:
    the split input is what the checkpoint saves, and the block computes
    on the type it was written for (attention over a split sequence would
    not type-check). On an Auto axis the compiler gathers where needed."""
    if self.partition is None:
      return fn

    @functools.wraps(fn)
    def whole(x, *args, **kwargs):
      mesh = jax.sharding.get_abstract_mesh()
      if (
        mesh.empty
        or self.partition not in mesh.axis_names
        or _axis_type(mesh, self.partition) != AxisType.Explicit
      ):
        return fn(x, *args, **kwargs)
      return fn(jax.tree.map(self._unsplit, x), *args, **kwargs)

    return whole

  def _unsplit(self, leaf):
    if not hasattr(leaf, "shape") or not -leaf.ndim <= self.dim < leaf.ndim:
      return leaf
    spec = list(jax.typeof(leaf).sharding.spec)
    spec += [None] * (leaf.ndim - len(spec))
    dim = self.dim % leaf.ndim
    if spec[dim] != self.partition:
      return leaf
    spec[dim] = None
    return jax.sharding.reshard(leaf, P(*spec))

  def _where(self):
    """``(abstract mesh, axis sizes, recorder)`` to split over, or ``None``
    (no ``partition``, or no mesh and no :func:`recording` sizes)."""
    if self.partition is None:
      return None
    mesh = jax.sharding.get_abstract_mesh()
    recorder = RECORDER.get()
    axes = (
      (dict(recorder[0]) if recorder else {})
      if mesh.empty
      else dict(zip(mesh.axis_names, mesh.axis_sizes))
    )
    if mesh.empty and not axes:
      return None  # no mesh: nothing to split over
    return mesh, axes, recorder

  def restore(self, out, x):
    """The block's output with its carry (``out``, or ``out[0]`` of a
    ``(carry, y)`` pair, when shaped like ``x``) kept split on an Auto axis
    and given back ``x``'s type on an Explicit one (a scan carry's type
    cannot change)."""
    if self.partition is None:
      return out
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or self.partition not in mesh.axis_names:
      return out
    same = lambda a: (
      jax.tree.structure(a) == jax.tree.structure(x)
      and all(
        getattr(u, "shape", None) == getattr(v, "shape", None)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(x))
      )
    )
    if same(out):
      return self._like(out, x, mesh)
    if isinstance(out, tuple) and len(out) == 2 and same(out[0]):
      return (self._like(out[0], x, mesh), out[1])
    return out

  def _like(self, out, x, mesh):
    if _axis_type(mesh, self.partition) == AxisType.Explicit:
      return jax.tree.map(
        lambda o, i: (
          jax.sharding.reshard(o, jax.typeof(i).sharding.spec)
          if hasattr(o, "shape")
          else o
        ),
        out,
        x,
      )
    return self.split(out, record=False)

  def _shards(self, axes: dict, mesh) -> int:
    axis = self.partition
    if axis not in axes:
      raise RematError(
        f"zerojax.remat: partition={axis!r} names no axis of the mesh "
        f"{axes}; use one of {tuple(axes)} (usually the tensor-parallel "
        f"'model' axis), or partition=None."
      )
    if not mesh.empty and _axis_type(mesh, axis) == AxisType.Manual:
      raise RematError(
        f"zerojax.remat: partition={axis!r} is a manual axis here (the "
        f"batch is split over it by a shard_map, e.g. zerojax's step over "
        f"its data axes), so each device already holds only its rows; "
        f"partition over another axis (usually 'model')."
      )
    return int(axes[axis])

  def _check_leaf(self, path, leaf, shards: int) -> int:
    where = f"the block input{jax.tree_util.keystr(path)}"
    ndim = len(leaf.shape)
    if not -ndim <= self.dim < ndim:
      raise RematError(
        f"zerojax.remat: {where} has shape {tuple(leaf.shape)}, no dimension "
        f"{self.dim} to split over {self.partition!r}; pass dim= one of its "
        f"dimensions (e.g. the sequence)."
      )
    dim = self.dim % ndim
    if leaf.shape[dim] % shards:
      raise RematError(
        f"zerojax.remat: {where} has {leaf.shape[dim]} along dimension "
        f"{dim} (shape {tuple(leaf.shape)}), which {self.partition!r}'s "
        f"{shards} devices do not divide; use a size divisible by {shards} "
        f"or split another dimension (dim=)."
      )
    return dim

  def _constrain(self, leaf, dim: int, mesh, path):
    axis = self.partition
    if _axis_type(mesh, axis) == AxisType.Explicit:
      spec = list(jax.typeof(leaf).sharding.spec)
      spec += [None] * (leaf.ndim - len(spec))
      used = [
        i
        for i, e in enumerate(spec)
        if e == axis or (isinstance(e, tuple) and axis in e)
      ]
      if used and used != [dim]:
        raise RematError(
          f"zerojax.remat: the block input{jax.tree_util.keystr(path)} is "
          f"already split over {axis!r} along dimension {used[0]} (type "
          f"{jax.typeof(leaf)}); Pa splits dimension {dim}: pass dim={used[0]} "
          f"or partition another axis."
        )
      if spec[dim] is not None and spec[dim] != axis:
        raise RematError(
          f"zerojax.remat: the block input{jax.tree_util.keystr(path)}'s "
          f"dimension {dim} is already split over {spec[dim]!r} (type "
          f"{jax.typeof(leaf)}); pick another dim= for Pa."
        )
      spec[dim] = axis
      return jax.sharding.reshard(leaf, P(*spec))
    spec = [P.UNCONSTRAINED] * leaf.ndim
    spec[dim] = axis
    return jax.lax.with_sharding_constraint(leaf, P(*spec))


def _axis_type(mesh, axis: str):
  return mesh.axis_types[mesh.axis_names.index(axis)]


def name_input(fn: Callable) -> Callable:
  """``fn`` with the floating array leaves of its first argument passed
  through ``checkpoint_name(..., LAYER_INPUT)`` (every use of the input
  goes through the name, so a policy may offload it)."""

  def tag(v):
    dtype = getattr(v, "dtype", None)
    if dtype is None or not np.issubdtype(dtype, np.inexact):
      return v
    return checkpoint_name(v, LAYER_INPUT)

  @functools.wraps(fn)
  def named(x, *args, **kwargs):
    return fn(jax.tree.map(tag, x), *args, **kwargs)

  return named


def remat(
  fn: Callable | None = None,
  *,
  saves: str | tuple[str, ...] = "input",
  partition: str | None = None,
  dim: int = 1,
  offload: bool = False,
):
  """ZeRO-R's activation checkpoints around a layer function.

  ``zerojax.remat(block, partition="model", offload=True)`` returns the
  wrapped ``block``; without ``fn`` it returns the :class:`Remat` (a
  decorator, and what ``zerojax.nnx.scan_layers`` / ``zerojax.linen.scan_layers``
  take as ``remat=``). See :class:`Remat` for the arguments.

  Example:
    >>> def block(h, layer):
    ...   return jnp.tanh(h @ layer["kernel"]), None
    >>> block = zerojax.remat(block, saves="dots")
    >>> h, _ = jax.lax.scan(block, x, params["layers"])
    >>> h.shape
    (16, 8)

  References: Rajbhandari et al., ZeRO (arXiv 1910.02054), section 6.1
  (Pa, Pa+cpu).
  """
  r = Remat(saves=saves, partition=partition, dim=dim, offload=offload)
  return r if fn is None else r(fn)
