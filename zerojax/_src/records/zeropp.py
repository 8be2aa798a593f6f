"""ZeRO++ settings: :class:`ZeroPP`, its nodes and its quantization blocks.

The arithmetic every reader of the settings shares: the node size
hierarchical qgZ uses, the node and cross-node device groups, the
largest quantized magnitude, and the block a buffer is cut into. The
quantized collectives themselves are :mod:`zerojax._src.comm.quantized`;
what they cost, :mod:`zerojax._src.diagnostics.cost`.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from jax.sharding import AbstractMesh

WEIGHT_BITS = (None, 8)
GRAD_BITS = (None, 8, 4)
ROUNDINGS = (None, "nearest", "stochastic")
DEFAULT_BLOCK, DEFAULT_BLOCK_INT4 = 256, 64


@dataclasses.dataclass(frozen=True)
class ZeroPP:
  """ZeRO++ communication settings for :func:`zerojax.zero` (off by default).

  Attributes:
    weight_bits: ``8`` for qwZ: stage 3's weight all-gathers (forward, and
      the rematerialised backward) move int8 blocks and fp32 scales. Stage
      3 only. ``None``: gather in the compute dtype.
    grad_bits: ``8`` or ``4`` for qgZ: the gradient reduce-scatter (stages
      1-3) runs as an all-to-all of int8 or packed int4 blocks, dequantized
      to fp32 before they are summed. ``None``: reduce-scatter in
      ``policy.reduce_dtype``.
    block_size: elements per quantization block (one fp32 scale each, so
      scales add ``4 / block_size`` bytes per element). Even, at least 2.
      ``None``: 256, or 64 with int4 gradients (0.5625 bytes per gradient
      element on the wire instead of 0.516, for a held-out loss within
      0.2% of unquantized on the main job instead of 1.5% above).
    hpz_size: hpZ's secondary partition size: the devices of one node
      (DeepSpeed's ``zero_hpz_partition_size``). Stage 3 only; it must
      divide the data axis and be smaller than it. Costs a secondary copy
      of the params, ``Ψ / hpz_size`` elements in the compute dtype per
      device during the step, and keeps the backward all-gathers inside a
      node. ``None``: off.
    grad_rounding: how qgZ rounds gradients to int8 / int4: ``"nearest"``
      or ``"stochastic"`` (unbiased: small gradients in a block with a
      large absmax survive on average instead of all rounding to zero;
      up to one step of error per element instead of half). ``None``:
      stochastic for int4, nearest for int8. Weights (qwZ) always round
      to nearest.
    node_size: devices per node along the data axis (nodes are consecutive
      runs of it), for hierarchical qgZ: gradients are summed inside the
      node before they cross, so only ``1/node_size`` of them does.
      ``None``: ``hpz_size`` if set, else the devices one process holds
      along the data axis when the mesh spans several processes, else flat
      (one node).

  Quantized collectives are lossy: results are no longer equal to
  unsharded Optax, but within the per-block bounds above (tested). Leaves
  zerojax does not shard (scalars, below ``min_shard_size``) and the
  hybrid mesh's replica all-reduce stay in full precision.

  Example:
    >>> tx = zerojax.zero(optax.adamw(3e-4), stage=3,
    ...                   zeropp=zerojax.ZeroPP(weight_bits=8, grad_bits=8))
    >>> tx.zeropp.weight_bits, tx.zeropp.grad_bits
    (8, 8)

  References:
    Wang et al., ZeRO++ (arXiv 2306.10209), sections 3.1 (qwZ) and 3.3 (qgZ).
  """

  weight_bits: int | None = None
  grad_bits: int | None = None
  block_size: int | None = None
  hpz_size: int | None = None
  node_size: int | None = None
  grad_rounding: str | None = None

  def __post_init__(self):
    if self.weight_bits not in WEIGHT_BITS:
      raise ValueError(
        f"zerojax.ZeroPP: weight_bits={self.weight_bits!r}; use "
        f"8 (int8 weight all-gather, qwZ) or None."
      )
    if self.grad_bits not in GRAD_BITS:
      raise ValueError(
        f"zerojax.ZeroPP: grad_bits={self.grad_bits!r}; use 8 "
        f"or 4 (quantized gradient reduce-scatter, qgZ) or None."
      )
    if self.block_size is not None and (
      type(self.block_size) is not int
      or self.block_size < 2
      or self.block_size % 2
    ):
      raise ValueError(
        f"zerojax.ZeroPP: block_size={self.block_size!r} must be "
        f"an even int >= 2 (int4 packs two values a byte), or "
        f"None for the default ({DEFAULT_BLOCK}; "
        f"{DEFAULT_BLOCK_INT4} with int4 gradients)."
      )

    if self.hpz_size is not None and (
      type(self.hpz_size) is not int or self.hpz_size < 2
    ):
      raise ValueError(
        f"zerojax.ZeroPP: hpz_size={self.hpz_size!r} must be "
        f"an int >= 2 (devices per node) or None."
      )
    if self.node_size is not None and (
      type(self.node_size) is not int or self.node_size < 1
    ):
      raise ValueError(
        f"zerojax.ZeroPP: node_size={self.node_size!r} must "
        f"be an int >= 1 (devices per node along the data "
        f"axis) or None."
      )
    if self.grad_rounding not in ROUNDINGS:
      raise ValueError(
        f"zerojax.ZeroPP: grad_rounding={self.grad_rounding!r}; "
        f"use 'nearest', 'stochastic' or None (stochastic for "
        f"int4 gradients, nearest for int8)."
      )
    if (
      self.node_size is not None
      and self.hpz_size is not None
      and self.node_size != self.hpz_size
    ):
      raise ValueError(
        f"zerojax.ZeroPP: hpz_size={self.hpz_size} and "
        f"node_size={self.node_size} both give the devices "
        f"of one node; set one, or the same value."
      )

  @property
  def block(self) -> int:
    """Elements per block: ``block_size``, by default 256, or 64 with int4
    gradients (whose coarser steps need smaller blocks to train as close
    to the unquantized loss; docs/design.md)."""
    if self.block_size is not None:
      return self.block_size
    return DEFAULT_BLOCK_INT4 if self.grad_bits == 4 else DEFAULT_BLOCK

  @property
  def stochastic_grads(self) -> bool:
    """Whether qgZ rounds stochastically: ``grad_rounding``, by default
    for int4 gradients only."""
    if self.grad_rounding is None:
      return self.grad_bits == 4
    return self.grad_rounding == "stochastic"

  @property
  def active(self) -> bool:
    return (
      self.weight_bits is not None
      or self.grad_bits is not None
      or self.hpz_size is not None
    )


def process_node_size(mesh, axis_name: str) -> int:
  """Devices per process along the data axis, when every line of the mesh
  along it is cut into equal consecutive runs of one process each (as
  :func:`zerojax.make_mesh` places processes); else ``0`` (unknown, and
  on an ``AbstractMesh``, which has no devices)."""
  if isinstance(mesh, AbstractMesh):
    return 0
  axis = mesh.axis_names.index(axis_name)
  lines = np.moveaxis(
    np.vectorize(lambda d: d.process_index)(mesh.devices), axis, -1
  ).reshape(-1, mesh.devices.shape[axis])
  sizes = set()
  for line in lines:
    runs = [len(list(g)) for _, g in itertools.groupby(line)]
    if len(runs) != len(set(line)) or len(set(runs)) != 1:
      return 0  # a process in two runs, or unequal runs
    sizes.add(runs[0])
  return sizes.pop() if len(sizes) == 1 else 0


def qgz_node_size(zeropp: ZeroPP, mesh, axis_name: str) -> int:
  """The node size hierarchical qgZ uses, ``0`` for flat: ``node_size``,
  else ``hpz_size``, else :func:`process_node_size`; flat when that is one
  device or the whole data axis (one node)."""
  n = int(mesh.shape[axis_name])
  k = zeropp.node_size or zeropp.hpz_size or process_node_size(mesh, axis_name)
  return k if 1 < k < n and n % k == 0 else 0


def node_groups(n: int, k: int) -> list[list[int]]:
  """Data-axis indices of each node: ``[[0..k-1], [k..2k-1], ...]``."""
  return [list(range(g * k, (g + 1) * k)) for g in range(n // k)]


def cross_groups(n: int, k: int) -> list[list[int]]:
  """The same local index in every node: ``[[l, l+k, ...] for l < k]``."""
  return [list(range(l, n, k)) for l in range(k)]


def qmax(bits: int) -> int:
  """Largest quantized magnitude: 127 for int8, 7 for int4 (symmetric)."""
  return 2 ** (bits - 1) - 1


def block_for(m: int, block: int) -> int:
  """The block size used for a buffer of ``m`` elements: ``block``, or for a
  smaller buffer ``m`` rounded up to even (one block, so that a small leaf
  is not padded up to a whole ``block``)."""
  return min(block, m + m % 2)
