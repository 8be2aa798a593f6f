"""Flax glue: NNX and Linen models under stage-3 gathers and the layer scan."""
