"""Checkpoints of a :class:`zerojax.ZeroState`: Orbax checkpoints restorable
onto any mesh, device count or stage (:class:`Checkpointer`); plain params
out (:func:`export_params`); and safetensors, the Hugging Face format, in
and out with each process reading only its rows (:func:`load_safetensors`,
:func:`save_safetensors`, :func:`safetensors_shapes` to see what a file
holds)."""

from zerojax._src.ckpt.checkpoint import Checkpointer as Checkpointer
from zerojax._src.ckpt.export import export_params as export_params
from zerojax._src.ckpt.layout_json import FORMAT as FORMAT
from zerojax._src.ckpt.layout_json import CheckpointError as CheckpointError
from zerojax._src.ckpt.layout_json import describe as describe
from zerojax._src.ckpt.safetensors_files import (
  safetensors_shapes as safetensors_shapes,
)
from zerojax._src.ckpt.safetensors_io import TensorMap as TensorMap
from zerojax._src.ckpt.safetensors_io import (
  load_safetensors as load_safetensors,
)
from zerojax._src.ckpt.safetensors_io import (
  save_safetensors as save_safetensors,
)

__all__ = [
  "FORMAT",
  "CheckpointError",
  "Checkpointer",
  "TensorMap",
  "describe",
  "export_params",
  "load_safetensors",
  "safetensors_shapes",
  "save_safetensors",
]
