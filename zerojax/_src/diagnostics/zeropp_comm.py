"""ZeRO++'s link bytes before renting: stage 3's bytes per chip and step
over fast and slow links with quantized gathers and reductions and a
secondary partition, from a parameter count (the paper's figures)."""

from __future__ import annotations

from zerojax._src.diagnostics import cost
from zerojax._src.records.zeropp import ZeroPP

ZEROPP_ROWS = (
  ("stage 3", {}),
  ("qwZ", dict(weight_bits=8)),
  ("qgZ int8", dict(grad_bits=8)),
  ("qgZ int4", dict(grad_bits=4)),
  ("qgZ int8, flat (nodes unknown)", dict(grad_bits=8, nodes_known=False)),
  ("hpZ", dict(hpz=True)),
  ("qwZ + hpZ + qgZ int8", dict(weight_bits=8, grad_bits=8, hpz=True)),
  ("qwZ + hpZ + qgZ int4", dict(weight_bits=8, grad_bits=4, hpz=True)),
)


def zeropp_comm(
  n_params: int,
  n_devices: int,
  slices: int,
  *,
  weight_bits=None,
  grad_bits=None,
  hpz=False,
  block=None,
  param_bytes=2,
  fast=1.8e11,
  slow=6e9,
  nodes_known=True,
) -> dict:
  """Stage 3's bytes per chip and step over fast and slow links, with
  ZeRO++ settings (``zerojax.ZeroPP``) on a data axis of ``n_devices``
  spanning ``slices`` nodes of ``k = n_devices / slices`` chips.

  Per collective (Ψ elements, ``w`` bytes per gathered element: the param
  dtype, or 1 + 4/block with qwZ; ``g``: the reduce dtype, or 1 or 0.5 +
  4/block with qgZ), hierarchical like :func:`comm_time`:

  * weight all-gathers, forward and backward: ``2 x`` a gather of Ψw over
    all chips; with hpZ instead one gather of Ψw/k across nodes (the
    secondary) and ``2 x`` in-node gathers of Ψ·param_bytes;
  * gradients: reduce-scatter of Ψg; qgZ the hierarchical all-to-all
    (zerojax knows the node: ``node_size``, ``hpz_size`` or one process
    per node): Ψg inside the node, Ψg/k across; with ``nodes_known=False``
    a flat all-to-all, whose cross-node share ``(n-k)/n`` cannot be
    reduced in the node first.

  Padding to blocks and devices is left out (below 1% at these sizes)."""
  n, s = n_devices, slices
  k = n // s
  block = block or ZeroPP(weight_bits=weight_bits, grad_bits=grad_bits).block
  w = (
    cost.wire_bytes_per_element(weight_bits, block)
    if weight_bits
    else param_bytes
  )
  g = (
    cost.wire_bytes_per_element(grad_bits, block) if grad_bits else param_bytes
  )
  f = sl = 0.0

  def hier(buffer, times=1):  # gather / reduce-scatter over all n
    nonlocal f, sl
    f += times * (k - 1) / k * buffer
    sl += times * ((s - 1) / s * buffer / k if s > 1 else 0.0)

  if hpz and s > 1:
    sl += (s - 1) / s * n_params * w / k  # the secondary, once
    f += 2 * (k - 1) / k * n_params * param_bytes  # in-node gathers
  else:
    hier(n_params * w, 2)
  if grad_bits and nodes_known and s > 1:
    f += (k - 1) / k * n_params * g
    sl += (s - 1) / s * n_params * g / k
  elif grad_bits:  # flat all-to-all
    f += (k - 1) / n * n_params * g
    sl += (n - k) / n * n_params * g
  else:
    hier(n_params * param_bytes)
  return {"fast_bytes": f, "slow_bytes": sl, "seconds": f / fast + sl / slow}
