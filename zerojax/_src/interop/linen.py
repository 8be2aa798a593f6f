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
from zerojax._src.remat.remat import Remat, name_input


def gathered(module_cls):
  """``module_cls`` with its ``params`` passed through :func:`zerojax.gather`."""
  return nn.map_variables(module_cls, "params", trans_in_fn=gather, init=True)


def scan_layers(
  block_cls,
  length: int,
  *,
  remat: bool | Remat = True,
  partition_name: str = "layers",
  **scan_kwargs,
):
  """``length`` copies of ``block_cls`` in an ``nn.scan``, gathered per layer.

  ``block_cls.__call__(carry, x) -> (carry, y)`` as for ``nn.scan``. Params
  are stacked on a leading axis (named ``partition_name`` in partition
  metadata), which zerojax never shards, so each iteration gathers one
  layer's shards.

  ``remat``: ``True``: ``nn.remat`` (the layer input kept, the rest
  recomputed); a :class:`zerojax.Remat` (``zerojax.remat(saves="dots",
  partition="model", offload=True)``): ZeRO-R's choice of what is kept, Pa,
  Pa+cpu; ``False``: every intermediate kept.
  """
  block = gathered(block_cls)
  if remat is True:
    remat = Remat()
  if remat:
    block = _remat(block, remat)
  return nn.scan(
    block,
    variable_axes={"params": 0},
    split_rngs={"params": True},
    length=length,
    metadata_params={nn.PARTITION_NAME: partition_name},
    **scan_kwargs,
  )


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

  params = (
    variables.get("params", variables)
    if hasattr(variables, "get")
    else variables
  )
  logical = nn.get_partition_spec(params)
  if rules is None:
    return logical
  return jax.tree.map(
    lambda s: nn.logical_to_mesh_axes(tuple(s), rules),
    logical,
    is_leaf=lambda x: isinstance(x, P),
  )


def _remat(block_cls, r: Remat):
  """``block_cls`` under ``nn.remat`` with ``r``'s policy, its input named
  inside the remat (so the policy may offload it) and split / restored by
  ``r`` outside it (so the saved input is the split one). Subclasses keep
  their base's name, so the params tree is the one ``nn.remat`` gives."""

  def subclass(base, call):
    cls = type(base.__name__, (base,), {"__call__": call})
    cls.__qualname__ = base.__qualname__
    return cls

  if r.saves == "all":

    def whole_call(self, carry, *args, **kwargs):
      call = super(inner, self).__call__
      return r.on_whole_input(call)(carry, *args, **kwargs)

    inner = subclass(block_cls, whole_call)
  else:

    def named_call(self, carry, *args, **kwargs):
      call = super(named, self).__call__
      if not self.is_initializing() and not self.scope.mutable:
        # re-traced from a jaxpr: no variable may be written inside
        call = r.split_kept(call)
      return name_input(r.on_whole_input(call))(carry, *args, **kwargs)

    named = subclass(block_cls, named_call)
    inner = nn.remat(named, policy=r.policy)

  def split_call(self, carry, *args, **kwargs):
    out = super(outer, self).__call__(r.split(carry), *args, **kwargs)
    return r.restore(out, carry)

  outer = subclass(inner, split_call)
  return outer
