"""Checkpoints of a :class:`zerojax.ZeroState` with Orbax, restorable onto any
mesh, device count or stage; :func:`export_params` writes plain params."""

from zerojax._src.ckpt.checkpoint import Checkpointer as Checkpointer
from zerojax._src.ckpt.export import export_params as export_params
from zerojax._src.ckpt.layout_json import FORMAT as FORMAT
from zerojax._src.ckpt.layout_json import CheckpointError as CheckpointError
from zerojax._src.ckpt.layout_json import describe as describe

__all__ = [
  "FORMAT",
  "CheckpointError",
  "Checkpointer",
  "describe",
  "export_params",
]
