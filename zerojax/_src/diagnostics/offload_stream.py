"""How an offloaded update streams, from shapes alone: the share of the
state in host memory, its chunks, and the most of it on the device at once
(:func:`describe`; read by :func:`zerojax.report` and the planner)."""

from __future__ import annotations

import jax

from zerojax._src.records import host_memory as _host_memory
from zerojax._src.records.spec import StateSpec
from zerojax._src.step import offload as _offload


def describe(spec: StateSpec, extra_avals=None) -> dict:
  """How an offloaded state's update runs, from shapes alone:
  ``{"host_fraction", "asked_fraction", "streamed", "chunks", "prefetched",
  "crossing", "in_flight_fraction", "largest_chunk_fraction", "norm_first",
  "norm_first_peak_fraction", "norm_passes", "reason"}``: the share
  of the master copy and optimizer state's bytes kept in host memory and
  the share ``offload=`` asked (whole arrays meet it from above); the
  chunks loaded while the one before them is updated
  (:attr:`~zerojax._src.step.offload.Plan.prefetched`), and those loaded while its results go back
  (:attr:`~zerojax._src.step.offload.Plan.crossing`);
  the most of the offloaded bytes on the device at once
  (:meth:`~zerojax._src.step.offload.Plan.in_flight`); the fraction of them the largest chunk holds;
  whether a global norm of offloaded gradients is computed before the
  chunks, the most of the gradients on the device while it is, and in
  how many passes (:func:`_norm_first`); ``reason``: why the whole state is updated at
  once."""
  return {
    "host_fraction": host_fraction(spec),
    "asked_fraction": spec.config.offload_fraction,
    **_stream(spec, extra_avals),
  }


def host_fraction(spec: StateSpec) -> float:
  """The share of the master copy and optimizer state's bytes (those of
  trained leaves) kept in host memory."""
  return _host_memory.held_fraction(
    spec.leaves, spec.opt_leaves, spec.policy.has_master
  )


def _stream(spec: StateSpec, extra_avals) -> dict:
  w_avals, g_avals = [], []
  for r in spec.leaves:
    if not r.trainable:
      w_avals.append(None)
      g_avals.append(None)
      continue
    dtype = r.master_dtype if spec.policy.has_master else r.compute_dtype
    w_avals.append(jax.ShapeDtypeStruct(r.aval.shape, dtype))
    g_avals.append(jax.ShapeDtypeStruct(r.aval.shape, r.master_dtype))
  p, reason = _offload.plan(
    spec, g_avals, w_avals, extra_avals, grads_host=spec.config.offload_grads
  )
  if p is None:
    return {
      "streamed": False,
      "chunks": 1,
      "stacks_by_rows": 0,
      "prefetched": 0,
      "crossing": 0,
      "in_flight_fraction": 1.0,
      "largest_chunk_fraction": 1.0,
      "norm_first": False,
      "norm_first_peak_fraction": 0.0,
      "norm_passes": 0,
      "reason": reason,
    }
  own = _offload.owners(spec)
  # the bytes the stream moves for param i: its weights with its master
  # copy in host memory (without one: with any of its state) and the
  # state it owns there
  w_host = lambda i: spec.leaves[i].place.offload
  o_host = lambda j: spec.opt_leaves[j].place.offload

  def share(i, span):  # the fraction of param i's rows a chunk holds
    if span is None:
      return 1.0
    return (span[1] - span[0]) / spec.leaves[i].aval.shape[0]

  sizes = [
    sum(
      share(i, s)
      * (
        _offload.nbytes(w_avals[i]) * w_host(i)
        + sum(
          _offload.nbytes(spec.opt_leaves[j].aval)
          for j in o
          if own[j] == i and o_host(j)
        )
      )
      for i, s in zip(c, p.rows_of(k))
    )
    for k, (c, o) in enumerate(zip(p.chunks, p.owned))
  ]
  total = sum(
    _offload.nbytes(a)
    for i, a in enumerate(w_avals)
    if a is not None and w_host(i)
  ) + sum(
    _offload.nbytes(spec.opt_leaves[j].aval)
    for j, q in enumerate(own)
    if q is not None and o_host(j)
  )
  return {
    "streamed": True,
    "chunks": len(p.chunks),
    "stacks_by_rows": len(
      {i for c, r in zip(p.chunks, p.rows) for i, s in zip(c, r) if s}
    ),
    "prefetched": p.prefetched,
    "crossing": p.crossing,
    "in_flight_fraction": p.in_flight(sizes) / max(total, 1),
    "largest_chunk_fraction": max(sizes) / max(total, 1),
    **_norm_first(spec, p, g_avals),
    "reason": None,
  }


def _norm_first(spec: StateSpec, p, g_avals) -> dict:
  """With offloaded gradients and an update that reads a global norm of
  them (:attr:`~zerojax._src.step.offload.Plan.cut`): the norm is computed
  first, each gradient the norm reads loaded whole in turn, so every one
  comes down twice; ``norm_first_peak_fraction``: the largest of them, a
  fraction of the offloaded gradients' bytes; ``norm_passes``: how many
  such passes (each gradient comes down once more per pass: two where
  the finiteness of gradients clipped by the norm is checked)."""
  if p.cut is None:
    return {
      "norm_first": False,
      "norm_first_peak_fraction": 0.0,
      "norm_passes": 0,
    }
  train = [a for a in g_avals if a is not None]
  read = [_offload.nbytes(a) for a, f in zip(train, p.cut.frontier) if f]
  total = sum(_offload.nbytes(a) for a in train)
  return {
    "norm_first": True,
    "norm_first_peak_fraction": max(read, default=0) / max(total, 1),
    "norm_passes": len(p.cut_passes),
  }
