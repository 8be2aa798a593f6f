"""ZeRO++'s quantized collectives (qwZ, qgZ) and hpZ's secondary shard.

Wang et al., ZeRO++: Extremely Efficient Collective Communication for Giant
Model Training (arXiv 2306.10209). Stage 3 moves 3Ψ per step; ZeRO++ cuts
the bytes on the wire by quantizing them:

* **qwZ** (``weight_bits=8``): the stage-3 weight all-gather moves int8
  blocks plus one fp32 scale per block instead of the compute dtype. Each
  device quantizes its own shard, the int8 blocks and scales are gathered,
  and every device dequantizes the full weight. Forward and rematerialised
  backward gather the same shard, so both see the same (quantized) weight;
  the gradient is taken at that weight (as in ZeRO++).
* **qgZ** (``grad_bits=8`` or ``4``): the gradient reduce-scatter becomes an
  all-to-all of quantized chunks. Each device splits its full gradient into
  the N chunks the N devices own, quantizes each chunk blockwise, and sends
  chunk j to device j; the receiver **dequantizes every incoming chunk to
  fp32 first and then sums** (never a sum of quantized values: nothing
  overflows, and the error does not grow with the number of terms beyond the
  N independent rounding errors). int4 values are packed two to a byte.

Blocks: a device's buffer (one shard, or one chunk) is flattened, padded
with zeros to a multiple of ``block_size`` (a buffer smaller than that is
one block of its own size, rounded up to even) and cut into blocks; each block
has its own scale, ``absmax`` of the block, carried next to the data.
Quantized ``q = round(x / absmax * qmax)`` with ``qmax = 127`` (int8) or
``7`` (int4), so a block's dequantization error is at most ``absmax /
(2 qmax)`` per element. A block of zeros has scale 0 and dequantizes to
exact zeros; a block holding one repeated value dequantizes to that value
(it is its own absmax). Any leaf shape and any device count work: nothing
needs to divide anything, padding is never asserted on.

The padded tail of the last block and the zero padding of an uneven shard
are sliced off after dequantization, so they never reach the model.

**Nodes** (``node_size``, or one process per node): a flat all-to-all
cannot reduce anything before it crosses nodes, so flat qgZ sends
``(N - k) / N`` of every device's quantized gradient across (more than
plain stage 3's reduce-scatter, which XLA runs hierarchically). Where the
node is known, qgZ is hierarchical, as in ZeRO++: an all-to-all inside the
node sums each chunk over the node's k devices (dequantized, in fp32), and
only those node sums, requantized, cross nodes: ``1/k`` of the gradient.
Each element is then rounded twice (the error bound doubles). The node is
``ZeroPP(node_size=k)``, else ``hpz_size``, else, on several processes,
the run of devices one process holds along the data axis
(:func:`zerojax._src.records.zeropp.process_node_size`); on one process with neither set, qgZ is flat.

**hpZ** (``hpz_size=k``, the devices of one node): besides its primary
shard (1/N of each stage-3 parameter, what the optimizer updates), every
device holds, for the length of a step, a *secondary* shard: 1/k of each
parameter, replicated across the N/k nodes. It is built once per step,
before the loss, by one all-gather of the primary shards across nodes (the
devices with the same index in every node: groups ``{l, l+k, ...}``); every
per-layer gather after that, forward and rematerialised backward, runs
inside a node (groups ``{0..k-1}, {k..2k-1}, ...``). With that grouping the
secondary shard of device ``l`` holds primary chunks ``l, l+k, l+2k, ...``;
a node's gather returns them in the order (local index, node), and a local
transpose restores the weight's order. The gradient still reduce-scatters
over all N devices into the primary layout. Nodes are consecutive runs of
k devices along the data axis (``zerojax.make_mesh`` puts each process's
devices together, so with one process per node, node = process).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.records.zeropp import (
  block_for,
  cross_groups,
  node_groups,
  qmax,
)


def _blocks(x, block: int):
  """``x`` (..., m) -> (..., nb, block) in fp32, zero-padded."""
  m = x.shape[-1]
  nb = -(-m // block)
  x = x.astype(jnp.float32)
  if nb * block != m:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - m)])
  return x.reshape(x.shape[:-1] + (nb, block))


def _dither(xb):
  """Pseudo-random offsets in [0, 1), one per element of ``xb`` (fp32): an
  integer hash (a murmur3-style finaliser) of the element's bits and its
  position. Deterministic, the same on every backend, no key to thread;
  it changes whenever the value does, so from step to step it behaves as
  independent uniform noise."""
  u32 = jnp.uint32
  h = jax.lax.bitcast_convert_type(xb, u32)
  idx = jax.lax.broadcasted_iota(u32, xb.shape, xb.ndim - 1)
  for d in range(xb.ndim - 2, -1, -1):  # a flat position over all dims
    idx = idx + jax.lax.broadcasted_iota(u32, xb.shape, d) * u32(
      int(np.prod(xb.shape[d + 1 :])) & 0xFFFFFFFF
    )
  h = h ^ (idx * u32(0x9E3779B9))
  h = (h ^ (h >> 16)) * u32(0x7FEB352D)
  h = (h ^ (h >> 15)) * u32(0x846CA68B)
  h = h ^ (h >> 16)
  return (h >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def quantize(x, bits: int, block: int, stochastic: bool = False):
  """Blockwise absmax quantization of ``x`` along its last dimension.

  Returns ``(q, scale)``: ``q`` int8 of shape ``(..., nb, block)`` (int8) or
  uint8 ``(..., nb, block // 2)`` (two int4 values per byte), ``scale``
  fp32 ``(..., nb)``, the absmax of each block.

  ``stochastic``: round up with probability equal to the fractional part
  (``floor(y + u)``, ``u`` from :func:`_dither`) instead of to nearest:
  unbiased, so values below half a step are not all lost to zero, at up to
  one step of error per element instead of half. Zeros, and values at the
  block's absmax, are still exact.
  """
  xb = _blocks(x, block)
  scale = jnp.max(jnp.abs(xb), axis=-1)
  safe = jnp.where(scale > 0, scale, 1.0)[..., None]
  # x / absmax is in [-1, 1] (also for subnormal blocks), then scaled
  y = xb / safe * qmax(bits)
  y = jnp.floor(y + _dither(xb)) if stochastic else jnp.round(y)
  q = jnp.clip(y, -qmax(bits), qmax(bits))
  q = q.astype(jnp.int8)
  if bits == 4:
    nib = (q + 8).astype(jnp.uint8)  # [-7, 7] -> [1, 15]
    q = nib[..., 0::2] | (nib[..., 1::2] << 4)
  return q, scale


def dequantize(q, scale, bits: int, m: int):
  """Inverse of :func:`quantize`: fp32 ``(..., m)``."""
  if bits == 4:
    lo = (q & 0xF).astype(jnp.int8) - 8
    hi = (q >> 4).astype(jnp.int8) - 8
    q = jnp.stack([lo, hi], axis=-1).reshape(q.shape[:-1] + (2 * q.shape[-1],))
  x = q.astype(jnp.float32) / qmax(bits) * scale[..., None]
  x = x.reshape(x.shape[:-2] + (-1,))
  return x[..., :m]


def all_gather(x, axis_name, dim: int, bits: int, block: int, groups=None):
  """qwZ: ``all_gather(x, axis_name, axis=dim, tiled=True)`` moving
  ``bits``-bit blocks and fp32 scales; returns ``x.dtype``. ``groups``:
  ``axis_index_groups`` (hpZ)."""
  n = len(groups[0]) if groups else jax.lax.axis_size(axis_name)
  m = x.size
  q, scale = quantize(x.reshape(-1), bits, block_for(m, block))
  gather = lambda v: jax.lax.all_gather(
    v, axis_name, axis=0, tiled=False, axis_index_groups=groups, to="varying"
  )
  q, scale = gather(q), gather(scale)
  shards = dequantize(q, scale, bits, m).reshape((n,) + x.shape)
  full = jnp.moveaxis(shards, 0, dim)  # (..., n, x.shape[dim], ...)
  shape = list(x.shape)
  shape[dim] *= n
  return full.reshape(shape).astype(x.dtype)


def _exchange_sum(
  x, axis_name, groups, bits: int, block: int, stochastic: bool
):
  """Row ``j`` of ``x`` ``(p, m)`` goes to member ``j`` of this device's
  group, quantized; the ``p`` rows received are dequantized to fp32 and
  summed: ``(m,)``."""
  m = x.shape[-1]
  q, scale = quantize(x, bits, block_for(m, block), stochastic)
  q = jax.lax.all_to_all(q, axis_name, 0, 0, axis_index_groups=groups)
  scale = jax.lax.all_to_all(scale, axis_name, 0, 0, axis_index_groups=groups)
  return dequantize(q, scale, bits, m).sum(axis=0)


def reduce_scatter(
  x,
  axis_name,
  dim: int,
  bits: int,
  block: int,
  *,
  node: int = 0,
  stochastic: bool = False,
):
  """qgZ: ``psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)``
  as all-to-alls of quantized chunks, summed in fp32 after
  dequantization. ``x.shape[dim]`` must divide by the axis size (callers
  pad). Returns fp32.

  ``node = k`` (nodes of k devices): hierarchical, as ZeRO++'s qgZ. First
  inside the node: each device sends its in-node peer ``l`` the chunks of
  the devices with local index ``l`` in every node, and sums the k it
  receives; then across nodes: each device sends node ``g``'s member the
  node sum for it, requantized. Only ``1/k`` of the gradient crosses
  nodes; each element is rounded twice (the bound doubles)."""
  n = jax.lax.axis_size(axis_name)
  shape = list(x.shape)
  shape[dim : dim + 1] = [n, shape[dim] // n]
  chunks = jnp.moveaxis(x.reshape(shape), dim, 0)  # (n, ..., shard ...)
  shard_shape = chunks.shape[1:]
  m = int(np.prod(shard_shape))
  chunks = chunks.reshape(n, m)
  if not node:
    # chunk j goes to device j; from every device, its chunk for this one
    return _exchange_sum(
      chunks, axis_name, None, bits, block, stochastic
    ).reshape(shard_shape)
  k = node
  # chunk d = g*k + l: to in-node peer l go the chunks [g*k + l for g]
  by_peer = jnp.swapaxes(chunks.reshape(n // k, k, m), 0, 1)  # (k, n/k, m)
  node_sum = _exchange_sum(
    by_peer.reshape(k, -1),
    axis_name,
    node_groups(n, k),
    bits,
    block,
    stochastic,
  )
  out = _exchange_sum(
    node_sum.reshape(n // k, m),
    axis_name,
    cross_groups(n, k),
    bits,
    block,
    stochastic,
  )
  return out.reshape(shard_shape)


def secondary(x, axis_name, dim: int, k: int, bits: int | None, block: int):
  """hpZ: the secondary shard of primary shard ``x``, gathered across nodes
  (quantized when ``bits``): primary chunks ``l, l+k, ...`` along ``dim``."""
  n = jax.lax.axis_size(axis_name)
  groups = cross_groups(n, k)
  if bits:
    return all_gather(x, axis_name, dim, bits, block, groups)
  return jax.lax.all_gather(
    x, axis_name, axis=dim, tiled=True, axis_index_groups=groups, to="varying"
  )


def gather_in_node(x, axis_name, dim: int, k: int):
  """hpZ: the full (padded) weight from secondary shards, gathered inside
  the node, reordered from (local index, node) to the primary order."""
  n = jax.lax.axis_size(axis_name)
  full = jax.lax.all_gather(
    x,
    axis_name,
    axis=dim,
    tiled=True,
    axis_index_groups=node_groups(n, k),
    to="varying",
  )
  shape = list(full.shape)
  c = shape[dim] // n  # one primary chunk
  split = shape[:dim] + [k, n // k, c] + shape[dim + 1 :]
  full = jnp.swapaxes(full.reshape(split), dim, dim + 1)
  return full.reshape(shape)
