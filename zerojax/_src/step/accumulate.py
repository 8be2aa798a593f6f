"""Gradient accumulation inside one step: micro-batches summed in a scan.

:func:`summed` runs every micro-batch in one ``lax.scan`` whose carry holds
the sums. With the reduced gradients in host memory (``offload_grads``)
:func:`summed_on_host` carries them there instead: each micro-batch's
backward pass brings a layer's sum so far down as it reduces that layer's
gradient, adds, and writes the sum back (``comm/gather``'s accumulating
sinks), so the device never holds the whole gradient. The first
micro-batch writes its gradient as it is and the last scales the sum to
the mean, the same operations in the same order as the device's sums and
their scaling after the loop, so the numbers are the same bits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zerojax._src.step import aux as _aux


def _zeros_like(shapes, axes):
  return jax.tree.map(
    lambda s: jax.lax.pcast(jnp.zeros(s.shape, s.dtype), axes, to="varying"),
    shapes,
  )


def _varying(model_state, axes):
  if model_state is None:
    return None
  return jax.tree.map(
    lambda x: jax.lax.pcast(x, axes, to="varying"), model_state
  )


def summed(one, micro, micro_key, model_state, *, axes, dims_of):
  """``one`` over ``k`` micro-batches in a ``lax.scan``: gradients, loss
  and aux summed, model state carried, per-example aux leaves (found by
  ``dims_of`` from the aux's shapes) joined in the device's row order.
  Returns ``(grads, loss, aux, new_model_state, row dims)``."""
  k = jax.tree.leaves(micro)[0].shape[0]
  first = jax.tree.map(lambda x: x[0], micro)
  g_shape, l_shape, a_shape, _ = jax.eval_shape(
    lambda mb: one(mb, micro_key(0), model_state), first
  )
  dims = dims_of(a_shape)
  s_shape = jax.eval_shape(lambda a: _aux.split(a, dims)[0], a_shape)
  zeros = _zeros_like((g_shape, l_shape, s_shape), axes)

  def body(carry, xs):
    acc, ms = carry
    mb, i = xs
    g, loss, aux, ms = one(mb, micro_key(i), ms)
    summed, rows = _aux.split(aux, dims)
    return (jax.tree.map(jnp.add, acc, (g, loss, summed)), ms), rows

  ((grads, loss, sums), new_ms), rows = jax.lax.scan(
    body, (zeros, _varying(model_state, axes)), (micro, jnp.arange(k))
  )
  return grads, loss, _aux.merge(sums, rows, dims), new_ms, dims


@dataclasses.dataclass(frozen=True)
class HostSums:
  """The gather specs of :func:`summed_on_host`'s three kinds of
  micro-batch: the first (its reduced gradient written as it is), the
  middle ones (added to the sum in host memory), the last (added, then
  scaled to the mean). ``on_host[i]``: whether gradient ``i`` is summed
  there."""

  first: list
  middle: list
  last: list
  on_host: list


def summed_on_host(
  one, micro, micro_key, model_state, sums: HostSums, *, axes, dims_of
):
  """:func:`summed`, with the offloaded gradients summed in host memory.

  ``one(mb, key, ms, gspecs, host_sums)`` is one micro-batch's
  ``(grads, loss, aux, new_ms)``; ``host_sums[i]``, where not ``None``,
  is gradient ``i``'s sum so far, its sink. The first and last
  micro-batches are traced apart from the scan over the middle ones,
  since their specs differ. Same returns as :func:`summed`."""
  k = jax.tree.leaves(micro)[0].shape[0]
  at = lambda i: jax.tree.map(lambda x: x[i], micro)
  on_host = sums.on_host

  def split(g):  # the device's sums and the host's
    dev = [None if h else x for x, h in zip(g, on_host)]
    return dev, [x if h else None for x, h in zip(g, on_host)]

  def add(a, b):
    return [None if x is None else x + y for x, y in zip(a, b)]

  ms = _varying(model_state, axes)
  g, loss, aux, ms = one(at(0), micro_key(0), ms, sums.first, None)
  dims = dims_of(jax.eval_shape(lambda: aux))
  aux_sum, rows0 = _aux.split(aux, dims)
  dev, host = split(g)

  def step(carry, mb, i, specs):
    (dev, loss, aux_sum), host, ms = carry
    g, l, a, ms = one(mb, micro_key(i), ms, specs, host)
    s, rows = _aux.split(a, dims)
    g_dev, host = split(g)
    return (
      (add(dev, g_dev), loss + l, jax.tree.map(jnp.add, aux_sum, s)),
      host,
      ms,
    ), rows

  # each micro-batch's batch is tied to the sums before it, so none of
  # their forward passes runs beside another's (a scan's iterations are
  # ordered already; the first and last micro-batch are not in it)
  after = jax.lax.optimization_barrier
  carry = ((dev, loss, aux_sum), host, ms)
  rows = [jax.tree.map(lambda x: x[None], rows0)]
  if k > 2:
    middle, carry = after((jax.tree.map(lambda x: x[1 : k - 1], micro), carry))
    carry, mid = jax.lax.scan(
      lambda c, xs: step(c, xs[0], xs[1], sums.middle),
      carry,
      (middle, jnp.arange(1, k - 1)),
    )
    rows.append(mid)
  last_mb, carry = after((at(k - 1), carry))
  carry, last = step(carry, last_mb, k - 1, sums.last)
  rows.append(jax.tree.map(lambda x: x[None], last))
  (dev, loss, aux_sum), host, ms = carry
  grads = [h if d is None else d for d, h in zip(dev, host)]
  rows = jax.tree.map(lambda *r: jnp.concatenate(r), *rows)
  return grads, loss, _aux.merge(aux_sum, rows, dims), ms, dims
