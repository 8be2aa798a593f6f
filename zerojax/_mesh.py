"""The device mesh zerojax shards over.

zerojax shards state over one mesh axis, the data-parallel axis (``"data"``
by default). A mesh may have two more kinds of axis:

* a **replica** axis (hybrid sharding, HSDP): the batch splits over it but
  the state is replicated across it. Put it across the slow links (TPU
  slices, GPU nodes; processes here) and the data axis inside them:
  :func:`make_mesh` does, so only the Ψ/N gradient all-reduce crosses them;
* **model** axes (tensor parallelism): the model's own shardings, left to
  XLA (see ``_model_axes.py``).

Meshes are built with ``AxisType.Auto``: the optimizer update runs on global
arrays under ``jax.jit`` and relies on GSPMD propagation to insert the small
reductions that non-elementwise optimizers need (global norm, trust ratios,
factored moments), while the parameter-sized collectives are written by hand
inside ``jax.shard_map``. ``Explicit`` axes would turn each of those inner
reductions into a sharding-type error for the user to resolve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DEFAULT_AXIS = "data"
REPLICA_AXIS = "replica"


def parse_axes(axes, n_devices: int | None) -> dict[str, int]:
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
        raise ValueError(f"zerojax mesh {axes!r}: write axes as name=size, "
                         f"comma-separated, e.g. 'replica=2,data=4'.")
      try:
        out[name] = int(size)
      except ValueError:
        raise ValueError(f"zerojax mesh {axes!r}: size {size!r} of axis "
                         f"{name!r} is not an integer.") from None
    axes = out
  if not isinstance(axes, Mapping) or not axes:
    raise ValueError(f"zerojax mesh: expected axes like 'replica=2,data=4' "
                     f"or a dict of sizes, got {axes!r}.")
  sizes = {str(k): int(v) for k, v in axes.items()}
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1 or any(v < 1 and v != -1 for v in sizes.values()):
    raise ValueError(f"zerojax mesh {axes}: sizes must be >= 1, with at most "
                     f"one -1 (the rest of the devices).")
  known = math.prod(v for v in sizes.values() if v != -1)
  if n_devices is None:
    if free:
      raise ValueError(f"zerojax mesh {axes}: give every axis a size (no -1).")
    return sizes
  if free:
    if n_devices % known:
      raise ValueError(f"zerojax mesh {axes}: {n_devices} devices do not "
                       f"split into {known} x something.")
    sizes[free[0]] = n_devices // known
  if math.prod(sizes.values()) != n_devices:
    raise ValueError(
        f"zerojax mesh {sizes}: {math.prod(sizes.values())} devices, but "
        f"there are {n_devices}. Make the sizes multiply to {n_devices} (or "
        f"give one axis -1).")
  return sizes


def _granules(devices) -> tuple[int, bool]:
  """How many slices (TPU multi-slice) or else processes the devices span."""
  slices = {getattr(d, "slice_index", None) for d in devices}
  if None not in slices and len(slices) > 1:
    return len(slices), True
  return len({d.process_index for d in devices}), False


def make_mesh(axes=None, *, axis_name: str = DEFAULT_AXIS,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over every device of every process, laid out as pods want it.

  Args:
    axes: ``None`` for a 1-D mesh ``(axis_name,)``; or the axes in order with
      their sizes, ``"replica=2,data=4"``, ``"data=4,model=2"``,
      ``{"replica": 2, "data": -1}`` (-1: the rest). When the devices span
      several TPU slices (or, elsewhere, several processes), a ``replica``
      axis goes *across* them and every other axis *within* one (JAX's
      ``create_hybrid_device_mesh``), so state-sized collectives stay on the
      fast links and only the replica all-reduce crosses the slow ones.
    axis_name: name of the data-parallel axis of the 1-D mesh.
    devices: devices to use, in order; defaults to ``jax.devices()`` (global,
      so a multi-process run gets one mesh spanning all hosts).

  Returns:
    A ``jax.sharding.Mesh`` with ``Auto`` axis types.

  Example:
    >>> zerojax.make_mesh().axis_names
    ('data',)
    >>> zerojax.make_mesh("replica=2,data=4").shape
    {'replica': 2, 'data': 4}
  """
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("make_mesh: got an empty device list.")
  sizes = parse_axes({axis_name: -1} if axes is None else axes, len(devices))
  names, shape = tuple(sizes), tuple(sizes.values())
  types = (AxisType.Auto,) * len(names)
  n_gran, by_slice = _granules(devices)
  if n_gran > 1 and REPLICA_AXIS in sizes and sizes[REPLICA_AXIS] > 1:
    r = sizes[REPLICA_AXIS]
    if r % n_gran:
      raise ValueError(
          f"zerojax.make_mesh: the devices span {n_gran} "
          f"{'slices' if by_slice else 'processes'}; a replica axis of {r} "
          f"cannot go across them. Make the replica size a multiple of "
          f"{n_gran}.")
    from jax.experimental import mesh_utils
    dcn = tuple(n_gran if n == REPLICA_AXIS else 1 for n in names)
    ici = tuple(s // d for s, d in zip(shape, dcn))
    arr = mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, process_is_granule=not by_slice)
    return Mesh(arr, names, axis_types=types)
  if len(names) == 1:
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), names,
              axis_types=types)


def data_axis_size(mesh: Mesh, axis_name: str) -> int:
  """Size of ``axis_name`` in ``mesh``, with an error that says the fix."""
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"zerojax: the mesh has axes {mesh.axis_names} but no {axis_name!r} "
        f"axis to shard over. Build one with zerojax.make_mesh(), or pass "
        f"axis_name= naming the data-parallel axis of your mesh."
    )
  return int(mesh.shape[axis_name])
