"""The least share of the optimizer state in host memory a device needs
(:func:`offload_fraction_needed`): every share ``zero(..., offload=f)``
reaches, weighed from the least, each first against a lower bound of its
working set priced from one plan (:func:`share_candidates`), so only the
shares that may fit are planned in full."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from zerojax._src.diagnostics import cost
from zerojax._src.diagnostics.plan_layout import plan_spec
from zerojax._src.diagnostics.planner import plan_stage
from zerojax._src.records import host_memory as _host_memory
from zerojax._src.step import offload_rows as _rows
from zerojax._src.step import offload_trace as _offload_trace

# plan_stage's arguments that price a plan, not the layouts plan_spec builds
_PLAN_ONLY = ("activations", "accum_steps")


def offload_fraction_needed(
  abstract_params,
  stage: int | None = None,
  memory_bytes: float | None = None,
  n_devices=None,
  **kwargs,
) -> float | None:
  """The least ``offload`` fraction (as :func:`zerojax.zero` takes it) with
  which a stage's device working set (:attr:`StagePlan.working_set`: model
  state, the streamed update's chunks and ``activations`` if given) fits
  ``memory_bytes`` per device: 0.0 when it fits without offload, None when
  it does not fit even with all of it offloaded. Candidates are every
  share ``zero`` reaches (whole arrays or whole leaves, the largest while
  below it, then one smaller:
  :class:`~zerojax._src.records.host_memory.ShareRule`), tried from the
  least: the device's need is not
  monotone in the share, since the streamed update holds whole arrays'
  chunks. A share is planned only where a lower bound of its working set
  fits (:func:`share_candidates`), so a model of many leaves plans a few
  shares, not every one. ``kwargs``: as :func:`plan_stage` takes them;
  with ``tx=`` the plan is that transformation's, e.g.
  ``offload_fraction_needed(abstract, memory_bytes=80e9, tx=tx)``, and
  ``tx.replace(offload=share)`` then trains with the share named. With
  the gradients in host memory (``offload_grads``) the whole state is
  streamed, so the answer is 1.0 or None."""
  if memory_bytes is None:
    raise TypeError(
      "offload_fraction_needed: give memory_bytes, the device memory the "
      "working set must fit (e.g. memory_bytes=80e9)."
    )
  if (
    isinstance(memory_bytes, bool)
    or not isinstance(memory_bytes, numbers.Real)
    or not (math.isfinite(memory_bytes) and memory_bytes > 0)
  ):
    raise ValueError(
      f"offload_fraction_needed: memory_bytes={memory_bytes!r}; give the "
      f"device memory in bytes, a finite number above 0 (e.g. 80e9)."
    )
  # every share of one model streams the same update: traced once
  with _offload_trace.traces_kept():
    return _least_share(abstract_params, stage, memory_bytes, n_devices, kwargs)


def _least_share(abstract_params, stage, memory_bytes, n_devices, kwargs):
  """:func:`offload_fraction_needed`'s search."""
  plan = lambda f: plan_stage(
    abstract_params, stage, n_devices, offload=f, **kwargs
  )
  grads = kwargs.get("offload_grads")
  if grads is None:
    config = getattr(kwargs.get("tx"), "config", None)
    grads = getattr(config, "offload_grads", False)
  if grads:
    return 1.0 if plan(True).working_set <= memory_bytes else None
  if plan(False).working_set <= memory_bytes:
    return 0.0
  shares, least = share_candidates(abstract_params, stage, n_devices, **kwargs)
  for f in shares[least <= memory_bytes]:
    if plan(float(f)).working_set <= memory_bytes:
      return float(f)
  return None


def share_candidates(
  abstract_params, stage: int, n_devices=None, **kwargs
) -> tuple[np.ndarray, np.ndarray]:
  """Every share ``zero(..., offload=f)`` reaches, ascending, and a lower
  bound of its plan's :attr:`StagePlan.working_set`, priced from one plan
  with everything offloaded and the arrays ``zero``'s rule
  (:class:`~zerojax._src.records.host_memory.ShareRule`) picks: what
  stays on the device exactly, plus the least the streamed update can
  hold (a chunk's old and new state, a chunk at least the largest array
  streamed whole or one row of a stack of matrices, which may stream by
  rows: :mod:`zerojax._src.step.offload`)."""
  full = plan_stage(abstract_params, stage, n_devices, offload=True, **kwargs)
  spec = plan_spec(
    abstract_params,
    stage,
    n_devices,
    offload=True,
    **{k: v for k, v in kwargs.items() if k not in _PLAN_ONLY},
  )
  units = _host_memory.share_units(
    spec.leaves, spec.opt_leaves, spec.policy.has_master
  )
  rule = _host_memory.ShareRule.of(
    [u.size for u in units], [u.leaf for u in units]
  )
  shares = rule.reached()
  per_unit, shared = cost.host_state_bytes_by_unit(spec, units)
  size = [float(u.size) for u in units]
  # a chunk carries a param's arrays in host memory together, at least
  # one row of them where the stream may split its leaf by rows (the rule
  # :func:`~zerojax._src.step.offload_rows.stack_rows` starts from)
  least = [
    u.size / r.aval.shape[0]
    if _rows.may_stream_by_rows(r.aval.shape)
    else u.size
    for u, r in ((u, spec.leaves[u.leaf]) for u in units)
  ]
  by_arrays = _bound(
    rule.arrays, shares, [u.leaf for u in units], per_unit, size, least
  )
  whole = lambda x: [sum(x[i] for i in g) for g in rule.groups]
  by_leaves = _bound(
    rule.leaves,
    shares,
    [units[g[0]].leaf for g in rule.groups],
    whole(per_unit),
    whole(size),
    whole(least),
  )
  below = shares < 1.0
  leaves = np.zeros(len(shares), dtype=bool)
  leaves[below] = rule.by_leaves(shares[below])
  streamed = np.where(leaves, by_leaves.streamed, by_arrays.streamed)
  host = np.where(leaves, by_leaves.host, by_arrays.host) + shared
  resident = (
    full.total + full.activations - (host + full.params_host + full.grads_host)
  )
  return shares, resident + streamed * (host + full.grads_host)


class _Priced(NamedTuple):
  host: np.ndarray  # per share, the chosen items' host bytes
  streamed: np.ndarray  # per share, the least share of them a chunk holds


def _bound(choice, shares, param, host, size, least) -> _Priced:
  """Per share, what ``choice`` (over items of bytes ``size``, in host
  memory ``host``, a chunk holding at least ``least`` of each, owned by
  params ``param``) picks: the chosen items' host bytes, and twice the
  most of ``least`` one param's chosen items hold together over their
  bytes (a chunk's old and new state)."""
  below = shares < 1.0
  kk = np.full(len(shares), len(choice.order))
  q = np.full(len(shares), -1)
  kk[below], q[below] = choice.choose(shares[below])

  def over_chosen(x):
    """The sum of per-item ``x`` over each share's items."""
    x = np.array([x[i] for i in choice.order], dtype=np.float64)
    run = np.concatenate([[0.0], np.cumsum(x)])
    extra = np.where(q >= 0, x[np.maximum(q, 0)], 0.0) if len(x) else 0.0
    return run[kk] + extra

  held = _largest_param(param, choice, least, kk, q)
  return _Priced(
    over_chosen(host),
    np.minimum(2 * held / np.maximum(over_chosen(size), 1), 1.0),
  )


def _largest_param(param_of, choice, least, kk, q) -> np.ndarray:
  """Per share (``order[:kk]`` and ``order[q]``), the most of ``least``
  one param's (``param_of`` each item's) chosen items hold together."""
  n = len(choice.order)
  if not n:
    return np.zeros(len(kk))
  param = np.array([param_of[u] for u in choice.order])
  _, param = np.unique(param, return_inverse=True)
  x = np.array([least[u] for u in choice.order], dtype=np.float64)
  # per prefix length, each param's sum and the largest of them
  held = np.zeros((n + 1, param.max() + 1))
  held[1:][np.arange(n), param] = x
  held = np.cumsum(held, axis=0)
  largest = held.max(axis=1)
  qq = np.maximum(q, 0)
  with_q = held[kk, param[qq]] + x[qq]
  return np.where(q >= 0, np.maximum(largest[kk], with_q), largest[kk])
