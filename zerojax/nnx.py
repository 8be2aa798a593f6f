"""Flax NNX models under zerojax: split, gather, merge.

NNX's pure split/merge is the hook. zerojax hands the loss the model's
``nnx.Param`` state with sharded leaves; :func:`gathered` splits a
sub-module, gathers its state and merges it back for one call, and
:func:`scan` runs a stacked block (built with ``nnx.vmap``) in a
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

from zerojax._gather import gather


def gathered(module: nnx.Module) -> nnx.Module:
  """``module`` with its parameters gathered (full) for use.

  Only ``nnx.Param`` variables are gathered (into a new view); every other
  variable (batch statistics, RNG counters) is the module's own object, so
  what a call writes to it (BatchNorm's running averages) lands in
  ``module``."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  return nnx.merge(graphdef, gather(params), rest)


def scan(stacked: nnx.Module, carry, *,
         call: Callable = lambda layer, carry: layer(carry),
         remat: bool = True):
  """Runs ``carry = call(layer_i, carry)`` over the stacked layers.

  Args:
    stacked: a module whose variables have a leading layer axis (e.g. built
      with ``nnx.vmap``).
    carry: the input of the first layer.
    call: how to apply one layer; default ``layer(carry)``.
    remat: wrap the body in ``jax.checkpoint`` (re-gather in backward).

  Returns:
    The output of the last layer.
  """
  graphdef, params, rest = nnx.split(stacked, nnx.Param, ...)

  def body(carry, layer):
    layer_params, layer_rest = layer
    module = nnx.merge(graphdef, gather(layer_params), layer_rest)
    out = call(module, carry)
    return out, nnx.state(module, nnx.Not(nnx.Param))   # updated stats

  if remat:
    body = jax.checkpoint(body)
  carry, new_rest = jax.lax.scan(body, carry, (params, rest))
  nnx.update(stacked, new_rest)        # e.g. each layer's BatchNorm averages
  return carry
