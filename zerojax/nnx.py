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
  """A copy of ``module`` whose parameters are gathered (full) for use."""
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, gather(state))


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
  graphdef, state = nnx.split(stacked)

  def body(carry, layer_state):
    layer = nnx.merge(graphdef, gather(layer_state))
    return call(layer, carry), None

  if remat:
    body = jax.checkpoint(body)
  carry, _ = jax.lax.scan(body, carry, state)
  return carry
