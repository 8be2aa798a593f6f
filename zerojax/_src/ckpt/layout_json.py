"""The JSON description of a state's layout that a checkpoint carries:
stage, mesh, policy and every leaf's layout, shape and dtype."""

from __future__ import annotations

import jax
import numpy as np

from zerojax._src.records import layout as _layout
from zerojax._src.records.spec import StateSpec

FORMAT = "zerojax-checkpoint-1"


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored as asked; the message says why."""


def dtype_name(dt) -> str | None:
  """A dtype as the metadata spells it (``key<fry>`` for a typed key)."""
  if dt is None:
    return None
  if jax.dtypes.issubdtype(dt, jax.dtypes.extended):
    return str(dt)
  return np.dtype(dt).name


def _layout_json(layout: _layout.LeafLayout) -> dict:
  return {
    "dim": layout.dim,
    "padded": layout.padded,
    "model": [list(m) for m in layout.model],
  }


def layout_from(entry: dict, shape) -> _layout.LeafLayout:
  return _layout.LeafLayout(
    tuple(shape),
    dim=entry["dim"],
    padded=entry["padded"],
    reason="" if entry["dim"] is not None else "saved replicated",
    model=tuple(tuple(m) for m in entry["model"]),
  )


def describe(spec: StateSpec) -> dict:
  """The JSON description of a state's layout that a checkpoint carries."""
  pol = spec.policy
  return {
    "format": FORMAT,
    "stage": spec.stage,
    "n_devices": spec.tx.num_shards,
    "min_shard_size": spec.tx.min_shard_size,
    # the mesh and every leaf's layout, so that any other mesh (1-D,
    # hybrid, tensor-parallel) can read it
    "mesh": {a: int(n) for a, n in spec.tx.mesh.shape.items()},
    "axis_name": spec.tx.axis_name,
    "replica_axis": spec.tx.replica_axis,
    "layouts": {
      "param": [_layout_json(r.param) for r in spec.leaves],
      "shard": [_layout_json(r.shard) for r in spec.leaves],
      "opt": [_layout_json(o.layout) for o in spec.opt_leaves],
    },
    "policy": {
      "param_dtype": dtype_name(pol.param_dtype),
      "master_dtype": dtype_name(pol.master_dtype),
      "reduce_dtype": dtype_name(pol.reduce_dtype),
    },
    "params": [_aval_json(r) for r in spec.leaves],
    "opt_state": [_aval_json(o) for o in spec.opt_leaves],
  }


def _aval_json(record) -> dict:
  a = record.aval
  return {
    "path": record.path,
    "shape": list(a.shape),
    "dtype": dtype_name(a.dtype),
  }
