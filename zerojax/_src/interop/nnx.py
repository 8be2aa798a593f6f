"""Flax NNX models under zerojax: split, gather, merge.

NNX's pure split/merge is the hook. zerojax hands the loss the model's
``nnx.Param`` state with sharded leaves; :func:`gathered` splits a
sub-module, gathers its state and merges it back for one call, and
:func:`scan_layers` runs a stacked block (built with ``nnx.vmap``) in a
``lax.scan`` whose ``jax.checkpoint``-ed body gathers one layer's weights at
a time -- under ZeRO-3, gathered in the forward loop and again in the
backward loop.

The training loop uses the functional NNX pattern::

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    def loss_fn(params, batch):
      return loss(nnx.merge(graphdef, params, rest), batch)
    state = zerojax.init(params, tx)

Outside a train step (plain arrays) both helpers reduce to calling the
module, so the same model code runs unsharded.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from zerojax._src.comm.gather import gather
from zerojax._src.remat.remat import Remat


def gathered(module: nnx.Module) -> nnx.Module:
  """``module`` with its parameters gathered (full) for use.

  Only ``nnx.Param`` variables are gathered (into a new view); every other
  variable (batch statistics, RNG counters) is the module's own object, so
  what a call writes to it (BatchNorm's running averages) lands in
  ``module``."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  return nnx.merge(graphdef, gather(params), rest)


def scan_layers(
  stacked: nnx.Module,
  carry,
  *,
  call: Callable = lambda layer, carry: layer(carry),
  remat: bool | Remat = True,
):
  """Runs ``carry = call(layer_i, carry)`` over the stacked layers.

  Args:
    stacked: a module whose variables have a leading layer axis (e.g. built
      with ``nnx.vmap``).
    carry: the input of the first layer.
    call: how to apply one layer; default ``layer(carry)``.
    remat: ``True``: the body under ``jax.checkpoint`` (only the layer
      input is kept; weights re-gathered in backward); a
      :class:`zerojax.Remat` (``zerojax.remat(partition="model",
      offload=True)``): ZeRO-R's choice of what is kept, Pa, Pa+cpu;
      ``False``: every intermediate kept.

  Returns:
    The output of the last layer.
  """
  graphdef, params, rest = nnx.split(stacked, nnx.Param, ...)

  def body(carry, layer):
    layer_params, layer_rest = layer
    module = nnx.merge(graphdef, gather(layer_params), layer_rest)
    out = call(module, carry)
    return out, nnx.state(module, nnx.Not(nnx.Param))  # updated stats

  if remat is True:
    remat = Remat()
  if remat:
    body = remat(body)
  carry, new_rest = jax.lax.scan(body, carry, (params, rest))
  nnx.update(stacked, new_rest)  # e.g. each layer's BatchNorm averages
  return carry


def model_specs(params, rules=None):
  """Mesh ``PartitionSpec`` of each param, from NNX sharding metadata.

  Args:
    params: an ``nnx.State`` of parameters (``nnx.split(model, nnx.Param,
      ...)[1]``) whose variables carry sharding metadata
      (``nnx.with_partitioning``).
    rules: logical-to-mesh axis rules when the metadata names logical axes,
      e.g. ``(("mlp", "model"),)``; ``None`` when it names mesh axes.

  Returns:
    A tree of ``PartitionSpec`` with the params' structure, for
    ``zerojax.zero(..., model_specs=...)``. Params created under
    ``jax.set_mesh`` already carry these shardings, and zerojax reads them
    without this.
  """
  from flax.linen import logical_to_mesh_axes
  from jax.sharding import PartitionSpec as P

  specs = nnx.get_partition_spec(params)
  leaf = lambda x: isinstance(x, P)
  if rules is None:
    return specs
  return jax.tree.map(
    lambda s: logical_to_mesh_axes(tuple(s), rules), specs, is_leaf=leaf
  )
