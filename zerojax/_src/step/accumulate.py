"""Gradient accumulation inside one step: micro-batches summed in a scan.

:func:`summed` runs every micro-batch in one ``lax.scan`` whose carry holds
the sums. With the reduced gradients in host memory
(``offload_grads``, :class:`HostSums`) the offloaded leaves' sums are
carried there instead: each micro-batch's backward pass brings a layer's
sum so far down as it reduces that layer's gradient, adds, and writes the
sum back (``comm/gather``'s accumulating sinks), so the device never holds
the whole gradient; the first micro-batch, traced apart, writes its
gradients as they are. Those sums leave the scan unscaled; the update scales
them as it loads them (``leaf_ops.grad_source``), the same multiply the
device's sums get after the loop, so the numbers are the same bits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zerojax._src.step import aux as _aux


@dataclasses.dataclass(frozen=True)
class HostSums:
  """Gradients summed in host memory over the micro-batches: the gather
  specs of the ``first`` micro-batch (an offloaded leaf's reduced gradient
  written as it is) and of the ``rest`` (added to the sum so far);
  ``on_host[i]``, whether gradient ``i`` is summed there; ``scale``, the
  factor those sums still need (the mean over devices and micro-batches)."""

  first: list
  rest: list
  on_host: list
  scale: float


@dataclasses.dataclass
class Unscaled:
  """Filled while tracing: per gradient, the factor its sum still needs
  where the update loads it (``None``: scaled already). ``factors`` is
  ``None`` when every gradient is scaled."""

  factors: list | None = None


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


def summed(
  one, micro, micro_key, model_state, *, axes, dims_of, host: HostSums = None
):
  """``one`` over ``k`` micro-batches in a ``lax.scan``: gradients, loss
  and aux summed, model state carried, per-example aux leaves (found by
  ``dims_of`` from the aux's shapes) joined in the device's row order.

  With ``host``, ``one(mb, key, ms, specs, sums)`` is one micro-batch's
  ``(grads, loss, aux, new_ms)`` whose offloaded gradients are ``sums``
  (their sinks: the sums so far in host memory; ``None`` for the first
  micro-batch and the device's leaves) plus its own, unscaled. The first
  micro-batch is traced apart (its gradients written as they are), the
  rest scanned. Returns ``(grads, loss, aux, new_model_state, row
  dims)``."""
  k = jax.tree.leaves(micro)[0].shape[0]
  first = jax.tree.map(lambda x: x[0], micro)
  g_shape, l_shape, a_shape, _ = jax.eval_shape(
    lambda mb: one(mb, micro_key(0), model_state), first
  )
  dims = dims_of(a_shape)
  s_shape = jax.eval_shape(lambda a: _aux.split(a, dims)[0], a_shape)
  on_host = host.on_host if host is not None else [False] * len(g_shape)

  def add(sums, out):  # one micro-batch's outputs added to the sums
    grads, loss, aux = sums
    g, l, a, ms = out
    s, rows = _aux.split(a, dims)
    grads = [
      x if h or x is None else acc + x for acc, x, h in zip(grads, g, on_host)
    ]
    return ((grads, loss + l, jax.tree.map(jnp.add, aux, s)), ms), rows

  def body(carry, xs):
    (mb, i), (sums, ms) = xs, carry
    if host is None:
      return add(sums, one(mb, micro_key(i), ms))
    so_far = [x if h else None for x, h in zip(sums[0], on_host)]
    return add(sums, one(mb, micro_key(i), ms, host.rest, so_far))

  zeros = _zeros_like((g_shape, l_shape, s_shape), axes)
  carry = (zeros, _varying(model_state, axes))
  xs, before = (micro, jnp.arange(k)), []
  if host is not None:
    carry, rows = add(
      carry[0], one(first, micro_key(0), carry[1], host.first, None)
    )
    before = [jax.tree.map(lambda x: x[None], rows)]
    # the next micro-batches' batch waits on these sums, so the second's
    # forward pass does not run beside the first's backward
    xs, carry = jax.lax.optimization_barrier(
      ((jax.tree.map(lambda x: x[1:], micro), jnp.arange(1, k)), carry)
    )
  ((grads, loss, sums), new_ms), rows = jax.lax.scan(body, carry, xs)
  if before:
    rows = jax.tree.map(lambda *r: jnp.concatenate(r), *before, rows)
  return grads, loss, _aux.merge(sums, rows, dims), new_ms, dims


def scaled(grads, host: HostSums, unscaled: Unscaled | None):
  """``grads`` with :func:`summed`'s host sums scaled to the mean where
  they are (each brought down, scaled and written back), or, given
  ``unscaled``, left for the update to scale as it loads them (``unscaled``
  learns each one's factor)."""
  if unscaled is not None:
    unscaled.factors = [host.scale if h else None for h in host.on_host]
    return grads
  down, up = jax.memory.Space.Device, jax.memory.Space.Host
  return [
    jax.device_put(jax.device_put(g, down) * host.scale, up) if h else g
    for g, h in zip(grads, host.on_host)
  ]
