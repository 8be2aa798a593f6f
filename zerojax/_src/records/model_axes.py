"""Model (tensor-parallel) shardings of parameters: reading and checking them.

A parameter's *model spec* says which mesh axes other than the data and
replica axes split each of its dimensions: the model's own tensor
parallelism, e.g. ``W[D, F_model]``. zerojax leaves those axes to XLA and
adds the data axis on another dimension (see ``records/layout.py``). A model spec
comes from, in order:

1. ``zerojax.zero(..., model_specs=...)``: a pytree of ``PartitionSpec``
   shaped like the params (from ``zerojax.linen.model_specs`` or
   ``zerojax.nnx.model_specs``, or written by hand; ``None`` for a
   replicated leaf), or a function ``(path, shape) -> PartitionSpec``
   (``path``: ``records.trees.leaf_name``, the leaf's ``keystr`` without a
   boxed leaf's ``.value`` step, so an ``nnx.State`` and its pure dict
   name their leaves alike);
2. otherwise the leaf's own ``NamedSharding`` (params already placed with
   ``jax.device_put``; under ``jit``, a tracer's type on a mesh with
   Explicit axes, ``jax.typeof(x).sharding``), minus any data or replica
   axis in it (placement over those is zerojax's to decide);
3. otherwise none: the leaf is replicated over the model axes.

Explicit specs are checked, each error naming the leaf and the fix: an axis
not in the mesh, the data or replica axis used by the model, an axis used
twice, a dimension its axes do not divide.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.records import trees as _trees


class ModelSpecError(ValueError):
  """A parameter's model sharding does not fit the mesh."""


@dataclasses.dataclass(frozen=True)
class SpecTable:
  """A params-shaped tree of ``PartitionSpec`` as a hashable lookup by path."""

  entries: tuple  # ((trees.leaf_name(path), PartitionSpec | None), ...)

  @classmethod
  def from_tree(cls, tree) -> SpecTable:
    leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is None or isinstance(x, P)
    )[0]
    out = []
    for path, s in leaves:
      if s is not None and not isinstance(s, P):
        raise TypeError(
          f"zerojax.zero: model_specs{jax.tree_util.keystr(path)} is "
          f"{s!r}; every leaf of model_specs must be a PartitionSpec or "
          f"None."
        )
      out.append((_trees.leaf_name(path), s))
    return cls(tuple(out))

  def __call__(self, path: str, shape):
    table = dict(self.entries)
    if path not in table:
      known = ", ".join(p for p, _ in self.entries[:4])
      raise ModelSpecError(
        f"zerojax: model_specs has no entry for param {path} (it has "
        f"{known}{', ...' if len(self.entries) > 4 else ''}). Pass a tree "
        f"of PartitionSpec with the params' structure, e.g. "
        f"zerojax.linen.model_specs(variables, rules) or "
        f"zerojax.nnx.model_specs(params)."
      )
    return table[path]


def as_lookup(model_specs):
  """``zero(model_specs=...)`` -> None, a callable, or a :class:`SpecTable`."""
  if model_specs is None or isinstance(model_specs, SpecTable):
    return model_specs
  if callable(model_specs) and not isinstance(model_specs, P):
    return model_specs
  return SpecTable.from_tree(model_specs)


def _entries(spec) -> list[tuple]:
  out = []
  for e in tuple(spec):
    if e is None:
      out.append(())
    elif isinstance(e, str):
      out.append((e,))
    else:
      out.append(tuple(e))
  return out


def leaf_model_axes(config, path: str, x) -> tuple:
  """The model spec of one param leaf, per dimension, checked."""
  shape = tuple(int(d) for d in x.shape)
  placement = {config.axis_name} | (
    {config.replica_axis} if config.replica_axis else set()
  )
  if config.model_specs is not None:
    spec = config.model_specs(path, shape)
    if spec is None:
      return ()
    if not isinstance(spec, P):
      raise TypeError(
        f"zerojax: model_specs for {path} returned {spec!r}, "
        f"not a PartitionSpec."
      )
    return check(config, path, shape, _entries(spec))
  if isinstance(x, jax.core.Tracer):
    sharding = getattr(jax.typeof(x), "sharding", None)  # its type, if any
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
      return ()
  else:
    sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    dims = [
      tuple(a for a in axes if a not in placement)
      for axes in _entries(sharding.spec)
    ]
    if any(dims):
      return check(config, path, shape, dims)
  return ()


def check(config, path: str, shape, dims: list[tuple]) -> tuple:
  mesh = config.mesh
  if len(dims) > len(shape):
    raise ModelSpecError(
      f"zerojax: param {path} has shape {list(shape)} but its model spec "
      f"{P(*dims)} names {len(dims)} dimensions. Give at most one entry "
      f"per dimension."
    )
  seen = set()
  for d, axes in enumerate(dims):
    for a in axes:
      if a not in mesh.axis_names:
        raise ModelSpecError(
          f"zerojax: param {path} is sharded over mesh axis {a!r} by its "
          f"model spec, but the mesh has axes {tuple(mesh.axis_names)}. "
          f"Name the mesh axes as the model's rules do (e.g. "
          f"zerojax.make_mesh('data=4,{a}=2')), or map the logical axes to "
          f"this mesh's names in your sharding rules."
        )
      if a == config.axis_name or a == config.replica_axis:
        role = "data" if a == config.axis_name else "replica"
        raise ModelSpecError(
          f"zerojax: param {path}'s model spec shards dimension {d} over "
          f"{a!r}, the {role} axis zerojax shards and replicates state "
          f"over. The model's own sharding may only use other axes (e.g. "
          f"'model'); remove {a!r} from its rules: zerojax places the "
          f"{role} axis itself."
        )
      if a in seen:
        raise ModelSpecError(
          f"zerojax: param {path}'s model spec uses mesh axis {a!r} twice."
        )
      seen.add(a)
    size = math.prod(int(mesh.shape[a]) for a in axes)
    if size > 1 and shape[d] % size:
      raise ModelSpecError(
        f"zerojax: param {path} has shape {list(shape)}; its model spec "
        f"splits dimension {d} ({shape[d]}) over {axes} of size {size}, "
        f"which does not divide it. Make the dimension a multiple of "
        f"{size} (e.g. {-(-shape[d] // size) * size}, padding it) or leave "
        f"it unsharded by the model (None in its spec)."
      )
  dims = [tuple(a for a in axes if int(mesh.shape[a]) > 1) for axes in dims]
  return tuple(dims) if any(dims) else ()
