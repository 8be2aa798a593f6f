"""The device mesh zerojax shards over.

zerojax needs one mesh axis, the data-parallel axis (``"data"`` by default).
The mesh is built with ``AxisType.Auto``: the optimizer update runs on global
arrays under ``jax.jit`` and relies on GSPMD propagation to insert the small
reductions that non-elementwise optimizers need (global norm, trust ratios,
factored moments), while the parameter-sized collectives are written by hand
inside ``jax.shard_map``. ``Explicit`` axes would turn each of those inner
reductions into a sharding-type error for the user to resolve.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

DEFAULT_AXIS = "data"


def make_mesh(
    *, axis_name: str = DEFAULT_AXIS, devices: Sequence[jax.Device] | None = None
) -> Mesh:
  """A 1-D mesh ``(axis_name,)`` over every device of every process.

  Args:
    axis_name: name of the data-parallel axis.
    devices: devices to use, in order; defaults to ``jax.devices()`` (global,
      so a multi-process run gets one mesh spanning all hosts).

  Returns:
    A ``jax.sharding.Mesh`` with ``Auto`` axis type.

  Example:
    >>> mesh = zerojax.make_mesh()
    >>> mesh.axis_names
    ('data',)
  """
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("make_mesh: got an empty device list.")
  return jax.make_mesh(
      (len(devices),), (axis_name,), axis_types=(AxisType.Auto,),
      devices=devices,
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
