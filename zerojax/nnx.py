"""Flax NNX models under zerojax: stage-3 gathers, the layer scan, model specs."""

from zerojax._src.interop.nnx import gathered as gathered
from zerojax._src.interop.nnx import model_specs as model_specs
from zerojax._src.interop.nnx import scan_layers as scan_layers

__all__ = ["gathered", "model_specs", "scan_layers"]
