"""Flax linen models under zerojax: gather each module's params before use.

Linen's ``nn.map_variables`` is the hook: it transforms a module's
``params`` collection on the way in, so wrapping a module class with
:func:`gathered` makes it call :func:`zerojax.gather` on exactly its own
parameters, just before it runs. :func:`scan_layers` stacks a block with
``nn.scan`` (params stacked on a leading ``layers`` axis), rematerialises it
with ``nn.remat`` and gathers per iteration: under ZeRO-3 one block's full
weights are live at a time, gathered again in the backward pass.

Partition metadata (``nn.with_logical_partitioning``) is left alone: the
boxes flatten to their arrays, zerojax shards those over ``data``, and the
boxes come back on unflatten.

Example::

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = zerojax.linen.gathered(nn.Dense)(64)(x)
        x, _ = zerojax.linen.scan_layers(Block, length=8)(64)(x, None)
        return zerojax.linen.gathered(nn.Dense)(10)(x)
"""

from __future__ import annotations

import flax.linen as nn

from zerojax._src.comm.gather import gather


def gathered(module_cls):
  """``module_cls`` with its ``params`` passed through :func:`zerojax.gather`."""
  return nn.map_variables(module_cls, "params", trans_in_fn=gather, init=True)


def scan_layers(block_cls, length: int, *, remat: bool = True,
                partition_name: str = "layers", **scan_kwargs):
  """``length`` copies of ``block_cls`` in an ``nn.scan``, gathered per layer.

  ``block_cls.__call__(carry, x) -> (carry, y)`` as for ``nn.scan``. Params
  are stacked on a leading axis (named ``partition_name`` in partition
  metadata), which zerojax never shards, so each iteration gathers one
  layer's shards.
  """
  block = gathered(block_cls)
  if remat:
    block = nn.remat(block)
  return nn.scan(block, variable_axes={"params": 0},
                 split_rngs={"params": True}, length=length,
                 metadata_params={nn.PARTITION_NAME: partition_name},
                 **scan_kwargs)


def model_specs(variables, rules=None):
  """Mesh ``PartitionSpec`` of each param, from linen's logical partitioning.

  Args:
    variables: the output of ``model.init`` (or its ``"params"``), with
      ``nn.with_logical_partitioning`` / ``nn.Partitioned`` boxes.
    rules: logical-to-mesh axis rules, e.g. ``(("mlp", "model"),
      ("embed", None))``; ``None`` when the boxes already name mesh axes.

  Returns:
    A tree of ``PartitionSpec`` shaped like ``nn.unbox(params)``, for
    ``zerojax.zero(..., model_specs=...)``: the model's tensor-parallel
    layout, over which zerojax adds the data axis.
  """
  import jax
  from jax.sharding import PartitionSpec as P
  params = variables.get("params", variables) if hasattr(variables, "get") else variables
  logical = nn.get_partition_spec(params)
  if rules is None:
    return logical
  return jax.tree.map(lambda s: nn.logical_to_mesh_axes(tuple(s), rules),
                      logical, is_leaf=lambda x: isinstance(x, P))
