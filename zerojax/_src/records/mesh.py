"""The device mesh zerojax shards over.

zerojax shards state over one mesh axis, the data-parallel axis (``"data"``
by default). A mesh may have two more kinds of axis:

* a **replica** axis (hybrid sharding, HSDP): the batch splits over it but
  the state is replicated across it. Put it across the slow links (TPU
  slices, GPU nodes; processes here) and the data axis inside them:
  :func:`make_mesh` does, so only the Ψ/N gradient all-reduce crosses them;
* **model** axes (tensor parallelism): the model's own shardings, left to
  XLA (see ``records/model_axes.py``).

Meshes come as users build them: ``jax.make_mesh`` gives ``Explicit`` axes
(sharding in types) by default, and so does :func:`make_mesh`; ``Auto`` axes
and mixes (an ``Explicit`` data axis beside an ``Auto`` model axis) work the
same. zerojax's own work runs on an all-``Auto`` view of the mesh
(:func:`compute_mesh`) inside :func:`auto_region`: the optimizer update runs
on global arrays and relies on GSPMD propagation to insert the small
reductions that non-elementwise optimizers need (global norm, trust ratios,
factored moments), and the parameter-sized collectives are written by hand
inside ``jax.shard_map``. What leaves a region is typed on the caller's
mesh (``jax.typeof(x).sharding`` names the data axis of a sharded leaf), so
it composes with the caller's own Explicit-sharding code. See
``docs/design.md`` ("Explicit axes").
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DEFAULT_AXIS = "data"

REPLICA_AXIS = "replica"


def parse_axes(axes, n_devices: int | None = None) -> dict[str, int]:
  """``"replica=2,data=4"`` or ``{"replica": 2, "data": -1}`` -> sizes.

  One size may be -1: whatever the device count leaves for it.
  ``n_devices=None``: no device count to check against (no -1 allowed)."""
  if isinstance(axes, str):
    out = {}
    for part in axes.replace(" ", "").split(","):
      if not part:
        continue
      name, eq, size = part.partition("=")
      if not eq or not name:
        raise ValueError(
          f"zerojax mesh {axes!r}: write axes as name=size, "
          f"comma-separated, e.g. 'replica=2,data=4'."
        )
      try:
        out[name] = int(size)
      except ValueError:
        raise ValueError(
          f"zerojax mesh {axes!r}: size {size!r} of axis "
          f"{name!r} is not an integer."
        ) from None
    axes = out
  if not isinstance(axes, Mapping) or not axes:
    raise ValueError(
      f"zerojax mesh: expected axes like 'replica=2,data=4' "
      f"or a dict of sizes, got {axes!r}."
    )
  sizes = {str(k): int(v) for k, v in axes.items()}
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1 or any(v < 1 and v != -1 for v in sizes.values()):
    raise ValueError(
      f"zerojax mesh {axes}: sizes must be >= 1, with at most "
      f"one -1 (the rest of the devices)."
    )
  known = math.prod(v for v in sizes.values() if v != -1)
  if n_devices is None:
    if free:
      raise ValueError(f"zerojax mesh {axes}: give every axis a size (no -1).")
    return sizes
  if free:
    if n_devices % known:
      raise ValueError(
        f"zerojax mesh {axes}: {n_devices} devices do not "
        f"split into {known} x something."
      )
    sizes[free[0]] = n_devices // known
  if math.prod(sizes.values()) != n_devices:
    raise ValueError(
      f"zerojax mesh {sizes}: {math.prod(sizes.values())} devices, but "
      f"there are {n_devices}. Make the sizes multiply to {n_devices} (or "
      f"give one axis -1)."
    )
  return sizes


def _granules(devices) -> tuple[int, bool]:
  """How many slices (TPU multi-slice) or else processes the devices span."""
  slices = {getattr(d, "slice_index", None) for d in devices}
  if None not in slices and len(slices) > 1:
    return len(slices), True
  return len({d.process_index for d in devices}), False


def make_mesh(
  axes=None,
  *,
  axis_name: str = DEFAULT_AXIS,
  devices: Sequence[jax.Device] | None = None,
  axis_types=None,
) -> Mesh:
  """A mesh over every device of every process, laid out as pods want it.

  Args:
    axes: ``None`` for a 1-D mesh ``(axis_name,)``; or the axes in order with
      their sizes, ``"replica=2,data=4"``, ``"data=4,model=2"``,
      ``{"replica": 2, "data": -1}`` (-1: the rest). When the devices span
      several TPU slices (or, elsewhere, several processes), a ``replica``
      axis goes *across* them and every other axis *within* one (JAX's
      ``create_hybrid_device_mesh``), so state-sized collectives stay on the
      fast links and only the replica all-reduce crosses the slow ones.
      Without a replica axis, devices of several TPU slices are laid out
      slice by slice along the data axis (or the outermost axis when there
      is none), every other axis within a slice.
    axis_name: name of the data-parallel axis of the 1-D mesh.
    devices: devices to use, in order; defaults to ``jax.devices()`` (global,
      so a multi-process run gets one mesh spanning all hosts).
    axis_types: one ``jax.sharding.AxisType`` for every axis, or a tuple
      with one per axis; default ``Explicit``, as ``jax.make_mesh`` gives.

  Returns:
    A ``jax.sharding.Mesh``.

  Example:
    >>> zerojax.make_mesh().axis_names
    ('data',)
    >>> dict(zerojax.make_mesh("replica=2,data=4").shape)
    {'replica': 2, 'data': 4}
  """
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("make_mesh: got an empty device list.")
  sizes = parse_axes({axis_name: -1} if axes is None else axes, len(devices))
  names, shape = tuple(sizes), tuple(sizes.values())
  types = _axis_types(axis_types, names)
  n_gran, by_slice = _granules(devices)
  replica = REPLICA_AXIS in sizes and sizes[REPLICA_AXIS] > 1
  if n_gran > 1 and (replica or by_slice):
    # across slices: the replica axis, else the data axis (the outermost
    # axis when there is none); jax.make_mesh refuses multi-slice devices
    across = (
      REPLICA_AXIS
      if replica
      else axis_name
      if axis_name in sizes
      else DEFAULT_AXIS
      if DEFAULT_AXIS in sizes
      else names[0]
    )
    r = sizes[across]
    if r % n_gran:
      raise ValueError(
        f"zerojax.make_mesh: the devices span {n_gran} "
        f"{'slices' if by_slice else 'processes'}; a {across} axis of {r} "
        f"cannot go across them. Make the {across} size a multiple of "
        f"{n_gran}."
      )
    from jax.experimental import mesh_utils

    dcn = tuple(n_gran if n == across else 1 for n in names)
    ici = tuple(s // d for s, d in zip(shape, dcn))
    arr = mesh_utils.create_hybrid_device_mesh(
      ici, dcn, devices, process_is_granule=not by_slice
    )
    return Mesh(arr, names, axis_types=types)
  if len(names) == 1:
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)
  return Mesh(
    np.asarray(devices, dtype=object).reshape(shape), names, axis_types=types
  )


def data_axis_size(mesh: Mesh, axis_name: str) -> int:
  """Size of ``axis_name`` in ``mesh``, with an error that says the fix."""
  if axis_name not in mesh.axis_names:
    raise ValueError(
      f"zerojax: the mesh has axes {mesh.axis_names} but no {axis_name!r} "
      f"axis to shard over. Build one with zerojax.make_mesh(), or pass "
      f"axis_name= naming the data-parallel axis of your mesh."
    )
  return int(mesh.shape[axis_name])


def _axis_types(axis_types, names) -> tuple:
  if axis_types is None:
    axis_types = AxisType.Explicit
  if isinstance(axis_types, AxisType):
    return (axis_types,) * len(names)
  types = tuple(axis_types)
  if len(types) != len(names) or not all(
    isinstance(t, AxisType) for t in types
  ):
    raise ValueError(
      f"zerojax.make_mesh: axis_types={axis_types!r} for axes {names}; "
      f"give one jax.sharding.AxisType, or a tuple of {len(names)}."
    )
  return types


# --------------------------------------------------------------------------
# Explicit axes: zerojax computes on an Auto view, hands back typed arrays

# --------------------------------------------------------------------------


def explicit_names(mesh) -> tuple[str, ...]:
  """The mesh's ``Explicit`` axes (sharding in types), in mesh order."""
  return tuple(
    a
    for a, t in zip(mesh.axis_names, mesh.axis_types)
    if t == AxisType.Explicit
  )


def compute_mesh(mesh: Mesh) -> Mesh | AbstractMesh:
  """``mesh`` with every axis ``Auto``: the mesh zerojax's constraints and
  ``shard_map`` regions name (``mesh`` itself when it is all ``Auto``).

  For a mesh with ``Explicit`` axes, inside :func:`auto_region`, this is the
  *abstract* mesh the region makes current, not a second concrete ``Mesh``:
  ``jit`` requires every concrete sharding in a program to share one mesh
  once the program holds a primitive that needs its devices while
  lowering (cuDNN's fused attention, ``jax.pure_callback``), and the
  step's arguments carry the caller's ``Explicit`` mesh. Shardings on an
  abstract mesh take the program's devices.

  The one exception: a region traced with no mesh to take devices from (no
  ``jax.set_mesh``, no argument typed on the mesh -- the drop-in's
  ``update`` in a user's ``jit`` on arrays of one device) names the
  concrete all-``Auto`` mesh, whose shardings give the program its devices.
  """
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  if _CONCRETE_VIEW.get():
    return _concrete_auto(mesh)
  return _abstract_auto(mesh)


# set while a region is traced with no other source of devices (above)

_CONCRETE_VIEW = contextvars.ContextVar("zerojax_concrete_view", default=False)


@functools.lru_cache(maxsize=32)
def _abstract_auto(mesh: Mesh) -> AbstractMesh:
  return mesh.abstract_mesh.update_axis_types(
    {a: AxisType.Auto for a in mesh.axis_names}
  )


@functools.lru_cache(maxsize=32)
def _concrete_auto(mesh: Mesh) -> Mesh:
  return Mesh(
    mesh.devices,
    mesh.axis_names,
    axis_types=(AxisType.Auto,) * len(mesh.axis_names),
  )


def _typed_on(mesh: Mesh, tree) -> bool:
  """Whether an array in ``tree`` is typed on ``mesh`` (so the program
  takes its devices from it)."""
  want = mesh.abstract_mesh
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      sharding = getattr(jax.typeof(x), "sharding", None)
      if sharding is not None and sharding.mesh == want:
        return True
  return False


def named(mesh, spec: P, ndim: int) -> NamedSharding:
  """``NamedSharding(mesh, spec)``; on a mesh with ``Explicit`` axes the
  spec has one entry per dimension, as JAX's types write it (so an array
  zerojax places equals, sharding for sharding, the one a step returns,
  and a caller's jitted loop is not compiled twice for ``P()`` vs
  ``P(None, None)``)."""
  if explicit_names(mesh) and len(spec) < ndim:
    spec = P(*spec, *([None] * (ndim - len(spec))))
  return NamedSharding(mesh, spec)


def typed(sharding: NamedSharding) -> NamedSharding:
  """What ``sharding`` is as a type on its mesh: only its ``Explicit`` axes
  (``Auto`` axes are placement, not type), in device memory."""
  explicit = set(explicit_names(sharding.mesh))

  def keep(entry):
    if entry is None:
      return None
    axes = tuple(
      a
      for a in ((entry,) if isinstance(entry, str) else entry)
      if a in explicit
    )
    return None if not axes else axes[0] if len(axes) == 1 else axes

  return NamedSharding(sharding.mesh, P(*(keep(e) for e in sharding.spec)))


def in_caller_types(mesh: Mesh, fn: Callable) -> Callable:
  """``fn``, a callable of the caller's (an optimizer's ``obj_fn``), called
  from inside :func:`auto_region` back on the caller's axis types, its
  array arguments replicated: so arrays it closes over, typed on the
  caller's Explicit mesh, meet arguments of the same mesh (as unsharded
  Optax would call it)."""
  if not explicit_names(mesh) or not callable(fn):
    return fn

  @functools.wraps(fn)
  def call(*args, **kwargs):
    current = jax.sharding.get_abstract_mesh()
    if current.empty or current != compute_mesh(mesh).abstract_mesh:
      return fn(*args, **kwargs)  # not inside a region
    return call_in_caller_types(mesh, fn, args, kwargs)

  return call


def call_in_caller_types(
  mesh: Mesh, fn: Callable, args: tuple, kwargs: dict | None = None, specs=None
):
  """``fn(*args, **kwargs)`` from inside :func:`auto_region`, run back on
  the caller's axis types (``jax.sharding.explicit_axes`` over the mesh's
  Explicit axes), so that arrays ``fn`` closes over, typed on the caller's
  mesh, meet arguments typed on the same mesh.

  ``specs``: one ``PartitionSpec`` (or ``None``: replicated) per leaf of
  ``(args, kwargs)`` in flatten order; the array leaves are typed so, and
  leaves that are not arrays pass as they are. Give the specs the arrays
  are already laid out by and no data moves. The outputs come back ``Auto``
  (placed where ``fn`` left them)."""
  explicit = explicit_names(mesh)
  leaves, tree = jax.tree.flatten((args, kwargs or {}))
  arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
  specs = [None] * len(leaves) if specs is None else list(specs)
  if len(specs) != len(leaves):
    raise ValueError(
      f"zerojax internal: {len(specs)} specs for {len(leaves)} leaves"
    )

  def body(*xs):
    ls = list(leaves)
    for i, x in zip(arrays, xs):
      ls[i] = x
    a, k = jax.tree.unflatten(tree, ls)
    return fn(*a, **k)

  in_sharding = tuple(P() if specs[i] is None else specs[i] for i in arrays)
  return jax.sharding.explicit_axes(
    body, axes=explicit, in_sharding=in_sharding
  )(*[leaves[i] for i in arrays])


def closes_over_caller_types(error: Exception) -> bool:
  """Whether ``error`` is JAX's refusal of a value typed on a mesh with
  Explicit axes inside :func:`auto_region` (all Auto there): what a
  function raises when it closes over such a value (a traced
  hyperparameter an optimizer was built with inside the caller's ``jit``)
  and combines it with the region's arrays."""
  msg = str(error).lower()
  return (
    isinstance(error, ValueError)
    and "context mesh" in msg
    and "should match" in msg
    and "explicit" in msg
  )


def auto_region(mesh: Mesh, fn: Callable, out_shardings) -> Callable:
  """``fn`` (called under ``jit``) with every axis of ``mesh`` ``Auto``.

  On a mesh with ``Explicit`` axes, ``fn`` runs inside
  ``jax.sharding.auto_axes``: its array arguments lose their sharding
  types, GSPMD places what ``fn`` computes (zerojax's constraints and
  ``shard_map`` name :func:`compute_mesh`), and each output is resharded to
  its entry of ``out_shardings`` (a pytree prefix of ``NamedSharding`` on
  ``mesh``), as a type: ``jax.typeof(out).sharding`` says how it is split.
  On an all-``Auto`` mesh ``fn`` is returned as it is.
  """
  explicit = explicit_names(mesh)
  if not explicit:
    return fn
  current = jax.sharding.get_abstract_mesh()
  if not current.empty and current == compute_mesh(mesh).abstract_mesh:
    return fn  # already inside a region on this mesh
  if not current.empty and current != mesh.abstract_mesh:
    raise ValueError(
      f"zerojax: the mesh set with jax.set_mesh ({current}) is not the "
      f"mesh this ZeroTransformation shards over ({mesh}). Build the "
      f"transformation under the same jax.set_mesh, or pass mesh= the "
      f"mesh you set."
    )
  outs = jax.tree.map(
    lambda s: typed(s) if isinstance(s, NamedSharding) else s, out_shardings
  )
  region = jax.sharding.auto_axes(fn, axes=explicit, out_sharding=outs)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    if not current.empty or _typed_on(mesh, (args, kwargs)):
      return region(*args, **kwargs)
    token = _CONCRETE_VIEW.set(True)  # compute_mesh: no devices else
    try:
      return region(*args, **kwargs)
    finally:
      _CONCRETE_VIEW.reset(token)

  return call


# Set while tracing a per-device program with JAX's per-device types off
# (``step/per_device.py``): the regions nested in it are untyped too.
_UNTYPED: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "zerojax_untyped", default=False
)


# The name scope of a per-device program traced untyped: its operations'
# names in the compiled program say so (``zerojax.report``, profiles).
UNTYPED_SCOPE = "zerojax_untyped_loss"


@contextlib.contextmanager
def untyped():
  """Nested regions traced inside run without per-device types; all that
  is traced inside is named under :data:`UNTYPED_SCOPE`."""
  token = _UNTYPED.set(True)
  try:
    with jax.named_scope(UNTYPED_SCOPE):
      yield
  finally:
    _UNTYPED.reset(token)


def untyped_now() -> bool:
  """Whether a region traced now runs without per-device types."""
  return _UNTYPED.get()
