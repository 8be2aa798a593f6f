"""A step compiled for a machine this process does not hold, and read.

JAX compiles for a named TPU topology ahead of time with the TPU compiler
(libtpu, the ``tpu`` extra) on any machine: :func:`topology_mesh` gives a
mesh over that topology's devices, a state built abstractly on it
(``jax.eval_shape`` of :func:`zerojax.init_from`) and an abstract batch
(``jax.ShapeDtypeStruct``) lower through ``TrainStep.lower`` to the program
the pod would run, and :func:`compiled_report` reads the compiler's own
plan of it: per-device memory, collectives and how each is scheduled.
Nothing is allocated: the state is shapes only.
"""

from __future__ import annotations

import jax

from zerojax._src.diagnostics import hlo as _hlo
from zerojax._src.diagnostics import hlo_memory as _hlo_memory
from zerojax._src.diagnostics import schedule as _schedule
from zerojax._src.records.mesh import make_mesh

TPU_EXTRA = "pip install 'zerojax[tpu]'"


def topology_devices(topology: str, num_slices: int = 1) -> list:
  """The devices of TPU topology ``topology`` (``"v5e:2x2"``,
  ``"v5p:4x4x4"``, ``"v6e:16x16"``: generation, then chips per dimension),
  for compiling only; ``num_slices`` such slices joined by the data-center
  network (each device's ``slice_index`` says which). Raises a
  ``ValueError`` naming the fix when the TPU compiler is not installed or
  the name is unknown."""
  from jax.experimental import topologies

  if num_slices < 1:
    raise ValueError(f"zerojax: num_slices={num_slices} must be >= 1")
  kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
  try:
    return list(
      topologies.get_topology_desc(
        platform="tpu", topology_name=topology, **kwargs
      ).devices
    )
  except RuntimeError as e:
    if "lockfile" in str(e):
      raise ValueError(
        f"zerojax: libtpu is in use by another process on this machine "
        f"(it holds /tmp/libtpu_lockfile), so TPU topology {topology!r} "
        f"cannot be loaded here now. Compile for TPU topologies one process "
        f"at a time (or set ALLOW_MULTIPLE_LIBTPU_LOAD=1 in each). JAX "
        f"said: {str(e).splitlines()[0]}"
      ) from e
    if "not installed" in str(e) or "TPU support" in str(e):
      raise ValueError(
        f"zerojax: compiling for TPU topology {topology!r} needs the TPU "
        f"compiler (libtpu), which is not installed: {TPU_EXTRA}. No TPU "
        f"is needed to compile for one."
      ) from e
    raise _unknown(topology, e) from e
  except Exception as e:  # noqa: BLE001 -- libtpu's own error types
    raise _unknown(topology, e) from e


def _unknown(topology: str, e: Exception) -> ValueError:
  return ValueError(
    f"zerojax: libtpu does not know TPU topology {topology!r} "
    f"({str(e).splitlines()[0]}). Name a generation and the chips per "
    f"dimension: 'v5e:2x2', 'v5e:4x8', 'v5p:2x2x2', 'v5p:4x4x4', "
    f"'v6e:2x2', 'v6e:16x16' (v5p is 3-D)."
  )


def topology_mesh(
  topology: str, axes=None, *, num_slices: int = 1, **mesh_kwargs
):
  """A mesh over TPU topology ``topology``'s devices (``num_slices`` of
  them), as :func:`zerojax.make_mesh` builds one (``axes`` such as
  ``"replica=2,data=32"``, the outer axes across slices; default one
  ``data`` axis over every chip; Explicit axes unless ``axis_types=`` says
  otherwise). Its devices belong to no process here: lower abstract values
  on it, never place data."""
  return make_mesh(
    axes, devices=topology_devices(topology, num_slices), **mesh_kwargs
  )


def compiled_report(compiled, mesh) -> dict:
  """What the compiler planned for one device of ``mesh``.

  ``compiled``: a ``jax.stages.Compiled`` (``step.lower(...).compile()``).
  Returns ``{"memory": {argument, output, temp, alias, peak bytes},
  "collectives": {kind: {"count", "bytes", "wire"}}, "bytes_by_axis":
  {"kind@axes": bytes}, "written_as": {"asked as written": {"count",
  "bytes"}}, "issued": {kind: {"sync", "async", "overlapped"}}}``:
  peak = arguments + outputs + temp - aliases (the compiler's own plan);
  collectives counted per step (loop trip counts applied), each by its full
  buffer (:mod:`zerojax._src.diagnostics.hlo`) and by the bytes a chip
  sends for it (``wire``: :func:`_ring_wire`); ``written_as`` the
  collectives the compiler wrote as another kind, read from their op_name
  (the TPU compiler writes some all-gathers as all-reduces of a
  zero-padded buffer; a rewritten collective it merged with others loses
  its op_name and is not counted there); ``across_slices`` the
  collectives between slices (a multi-slice topology: the compiler writes
  the program for one slice and moves these over the data-center network
  as megascale transfers; ``bytes``: the buffers each chip hands over,
  ``wire``: what it sends between slices, :func:`_dcn_wire`);
  ``host_transfers`` the copies between host and device memory per step
  (:func:`zerojax._src.diagnostics.hlo_memory.host_transfers`; ``memory`` then
  also has the host bytes); ``issued`` from the
  scheduled program (:mod:`zerojax._src.diagnostics.schedule`), a loop
  body's collective once."""
  m = compiled.memory_analysis()
  memory = {
    name: int(getattr(m, f"{name}_size_in_bytes"))
    for name in ("argument", "output", "temp", "alias")
  }
  memory["peak"] = (
    memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
  )
  for name in ("argument", "output", "temp"):  # host memory (offload)
    host = getattr(m, f"host_{name}_size_in_bytes", 0)
    if host:
      memory[f"host_{name}"] = int(host)
  text = compiled.as_text()
  kinds: dict = {}
  written_as: dict = {}
  slice_of = [getattr(d, "slice_index", 0) or 0 for d in mesh.devices.flat]
  across: dict = {}
  for c in _hlo.collectives(text, mesh.size):
    groups = c.groups or (tuple(range(mesh.size)),)
    if c.across_slices or (
      len(set(slice_of)) > 1
      and any(len({slice_of[i] for i in g}) > 1 for g in groups)
    ):
      row = across.setdefault(c.kind, {"count": 0, "bytes": 0, "wire": 0.0})
      row["count"] += c.count
      row["bytes"] += c.total_bytes
      row["wire"] += _dcn_wire(c, len(set(slice_of)))
    row = kinds.setdefault(c.kind, {"count": 0, "bytes": 0, "wire": 0.0})
    row["count"] += c.count
    row["bytes"] += c.total_bytes
    row["wire"] += _ring_wire(c)
    if c.written_for:
      row = written_as.setdefault(
        f"{c.written_for} as {c.kind}", {"count": 0, "bytes": 0}
      )
      row["count"] += c.count
      row["bytes"] += c.total_bytes
  by_axis = {
    f"{kind}@{axes}": n
    for (kind, axes), n in sorted(  # axes: "a+b"
      _hlo.bytes_by_axis(text, mesh).items()
    )
  }
  return {
    "memory": memory,
    "collectives": kinds,
    "bytes_by_axis": by_axis,
    "written_as": written_as,
    "across_slices": across,
    "host_transfers": _hlo_memory.host_transfers(text),
    "issued": _schedule.summary(text),
    "host_copy_cycles": _schedule.host_copy_cycles(text),
    "host_copies_across_loops": _schedule.host_copies_across_loops(text),
  }


def _ring_wire(c) -> float:
  """Bytes one chip sends for collective ``c`` per step, as a ring of its
  group (``g`` chips) moves a full buffer ``B``: ``(g-1)/g B`` for an
  all-gather, a reduce-scatter or an all-to-all, twice that for an
  all-reduce, ``B`` for a collective-permute. A transfer between slices
  is priced by :func:`_dcn_wire` in ``across_slices`` instead (0 here)."""
  if c.across_slices:
    return 0.0
  g = max(c.group_size, 1)
  share = (g - 1) / g
  return c.total_bytes * {
    "all-reduce": 2 * share,
    "collective-permute": 1.0,
  }.get(c.kind, share)


def _dcn_wire(c, slices: int) -> float:
  """Bytes one chip sends to other slices for a transfer of ``c`` between
  ``slices`` slices: the operand each chip hands to the megascale runtime
  is its own piece for an all-gather (sent to each other slice), the group's
  whole buffer for a reduce-scatter or an all-to-all (all but its own
  slice's share leaves), and for an all-reduce both of those phases.
  (The planner's ``slow_bytes`` is the same count, :func:`zerojax.cost.comm_time`.)"""
  share = (slices - 1) / slices
  factor = {
    "all-gather": slices - 1,
    "reduce-scatter": share,
    "all-to-all": share,
    "all-reduce": 2 * share,
  }.get(c.kind, 1.0)
  return c.total_bytes * factor


def abstract_batch(shapes: dict) -> dict:
  """``{name: (shape, dtype)}`` -> a batch of ``jax.ShapeDtypeStruct`` (a
  step's ``lower`` types it as it places a real batch)."""
  return {k: jax.ShapeDtypeStruct(tuple(s), d) for k, (s, d) in shapes.items()}
