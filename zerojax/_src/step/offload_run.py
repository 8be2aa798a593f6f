"""A streamed update run chunk by chunk, as its
:class:`~zerojax._src.step.offload.Plan` says: each chunk's loads from host
memory behind the results they wait for, its update, its results stored
(:mod:`zerojax._src.step.offload` says why and when it is exact)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from zerojax._src.records.spec import StateSpec
from zerojax._src.step import leaf_ops as _ops
from zerojax._src.step import offload_rows as _stacks
from zerojax._src.step.offload import Plan, owners, view


def stream(
  spec: StateSpec,
  p: Plan,
  g_view,
  w_src,
  opt_raw,
  extra_args,
  *,
  finish: Callable,
  opt_def=None,
  bases: Callable | None = None,
  g_rows=None,
  g_src=None,
  seen: Callable | None = None,
):
  """Runs the inner update chunk by chunk (see the module docstring).

  Args:
    p: from :func:`~zerojax._src.step.offload.plan`.
    g_view: per-param logical gradients on device (None for frozen).
    w_src: per-param :class:`~zerojax._src.step.leaf_ops.WeightSource`
      (None for frozen).
    opt_raw: the inner state's leaves as stored.
    finish: ``finish(i, w, u)`` -> param ``i``'s results from its weights
      and update, computed inside its chunk (e.g. the new master copy,
      stashed, and the new params).
    bases: ``bases(i)`` -> the values ``finish(i, ...)``'s results replace
      (a tree like them, None where there is none), into which a layer
      stack's results are written row by row; others are concatenated.
    g_rows: per param, ``rows(span)`` -> rows of ``g_view[i]``, which a
      stack updated by rows reads (None: sliced from ``g_view``).
    g_src: gradients in host memory (``offload_grads``): per param a
      :class:`~zerojax._src.step.leaf_ops.WeightSource` (None for frozen),
      in place of ``g_view``. Each chunk loads its own leaves' (its rows
      of a stack) with its weights and state; the others are zeros,
      which no output kept reads (checked by
      :func:`~zerojax._src.step.offload.plan`).
    seen: with ``g_src``, ``seen(i, span, g)`` is called with each
      gradient a chunk loads (rows ``span`` of a stack, None: whole), in
      the stream's order: what else reads the offloaded gradients (the
      step's grad norm) reads these, so each comes down once. What it
      returns (a sum of squares) the next chunk's loads wait for, so no
      gradient stays on the device for it.

  Returns:
    ``(per-param finish results (None for frozen), new state leaves as
    stored)``.
  """
  opt_def = spec.opt_def if opt_def is None else opt_def
  train = [i for i, s in enumerate(w_src) if s is not None]
  # offloaded gradients: each chunk replaces its own leaves' zeros
  g_flat = (
    [g_view[i] for i in train]
    if g_src is None
    else [jnp.zeros(a.shape, a.dtype) for a in (g_src[i].aval for i in train)]
  )
  g_zeros = g_flat
  own = owners(spec)
  out = _stacks.Out(len(w_src), opt_raw, bases)
  shared = {
    j: _ops.opt_logical(spec.opt_leaves[j], opt_raw[j]) for j in p.shared
  }
  e_leaves = [x for x in jax.tree.leaves(extra_args) if hasattr(x, "dtype")]
  cut_values, early = (), set()
  if p.cut is not None:  # offloaded gradients: a global norm, first
    cut_values, early = _cut_values(
      spec, p, train, g_src, shared=shared, e_leaves=e_leaves, seen=seen
    )
  stored = []  # each chunk's results, as stored
  computed = []  # each chunk's new values on the device, before storing
  squares = []  # what ``seen`` returned for the chunk's gradients
  for k, (chunk, owned) in enumerate(zip(p.chunks, p.owned)):
    spans = dict(zip(chunk, p.rows_of(k)))
    raw_w = [_stacks.rows_of(out.latest(w_src[i].raw), spans[i]) for i in chunk]
    raw_o = [
      _stacks.rows_of(out.latest(opt_raw[j]), spans[own[j]]) for j in owned
    ]
    # a stack's gradient rows are sliced after the barrier: a slice of a
    # host buffer is its own transfer, which would otherwise start as
    # early as the scheduler likes (every chunk's rows on the device at
    # once); the weights' and state's rows wait on the writes before them
    raw_g = [] if g_src is None else [g_src[i].raw for i in chunk]
    waits = []
    if p.after[k] is not None:
      waits.append([out.latest(x) for x in stored[p.after[k]]])
    if p._waits_for_computed(k):
      waits.append(computed[p.computed[k]])
    if k == 0 and cut_values:
      waits.append(list(cut_values))
    if squares:  # the previous chunk's gradients are summed and dead
      waits.append(squares)
    if waits:
      # this chunk's loads wait for those results
      (raw_w, raw_o, raw_g), _ = jax.lax.optimization_barrier(
        ((raw_w, raw_o, raw_g), waits)
      )
    if g_src is not None:  # this chunk's gradients, the others zeros
      mine_g = {
        i: g_src[i].load(_stacks.rows_of(x, spans[i]))
        for i, x in zip(chunk, raw_g)
      }
      squares = [
        seen(i, spans[i], mine_g[i])
        for i in (chunk if seen is not None else ())
        if i not in early
      ]
      g_flat = [
        mine_g[i] if i in spans and spans[i] is None else z
        for i, z in zip(train, g_zeros)
      ]
      # a stack's rows: those this chunk loaded
      g_rows = {
        i: (lambda span, x=mine_g[i]: x) for i in chunk if spans[i] is not None
      }
    w = {i: w_src[i].load(x) for i, x in zip(chunk, raw_w)}
    o = {
      j: _ops.opt_logical(spec.opt_leaves[j], x) for j, x in zip(owned, raw_o)
    }
    u, new = {}, {}
    whole = [i for i in chunk if spans[i] is None]
    if p.flat is not None and (whole or (k == 0 and p.shared)):
      u_w, new_w = _program_update(
        spec,
        p,
        train,
        g_flat,
        every_grad=g_src is None,
        w=w,
        o={**shared, **o},
        e_leaves=e_leaves,
        cut_values=cut_values,
        whole=whole,
        states=[j for j in owned if own[j] in whole]
        + (list(p.shared) if k == 0 else []),
      )
      u.update(u_w)
      new.update(new_w)
    elif whole or (k == 0 and p.shared):
      o_whole = {j: x for j, x in o.items() if own[j] in whole}
      u_w, new_w = _whole_update(
        spec,
        train,
        w_src,
        g_flat,
        w={i: w[i] for i in whole},
        o={**shared, **o_whole},
        opt_raw=opt_raw,
        extra_args=extra_args,
        opt_def=opt_def,
      )
      u.update({i: u_w[i] for i in whole})
      new.update({j: new_w[j] for j in owned if own[j] in whole})
      if k == 0:
        new.update({j: new_w[j] for j in p.shared})
    for i in chunk:
      if spans[i] is not None:
        mine = [j for j in owned if own[j] == i]
        outs = _stacks.stack_update(
          spec,
          p,
          train,
          g_flat if g_src is None else _with_whole(g_flat, train, i, g_src),
          i=i,
          w_rows=w[i],
          o={**shared, **o},
          mine=mine,
          extra_args=extra_args,
          span=spans[i],
          g_rows=None if g_rows is None else g_rows[i],
          cut_values=cut_values,
        )
        u[i] = outs[0]
        new.update(zip(mine, outs[1:]))
    computed.append(
      [u[i] for i in chunk]
      + [
        new[j]
        for j in owned
        if not jax.dtypes.issubdtype(new[j].dtype, jax.dtypes.extended)
      ]
    )
    outs = []
    for i in chunk:
      outs.extend(out.result(i, spans[i], finish(i, w[i], u[i])))
    for j in owned + (p.shared if k == 0 else ()):
      value = _ops.opt_storage(spec.opt_leaves[j], new[j])
      outs.append(out.state(j, spans.get(own[j]), value))
    stored.append(outs)
  return out.done()


def _cut_values(spec, p: Plan, train, g_src, *, shared, e_leaves, seen):
  """The values of ``p.cut`` (a global norm) from the offloaded gradients,
  in each of its passes (:attr:`Plan.cut_passes`) each brought down
  whole, alone, after the previous one's share of the pass's values is
  computed, a pass after the one before it; ``seen`` is called with each
  in the first. Returns ``(values, the params whose gradients were
  seen)``."""
  n_g, n_o = len(train), len(spec.opt_leaves)
  base = [None] * p.cut.flat.n_in
  for j, x in shared.items():
    base[n_g + j] = x
  base[2 * n_g + n_o :] = e_leaves
  given, prev, early = {}, [], set()
  for n, c in enumerate(p.cut_passes):
    for k, i in enumerate(train):
      if not c.frontier[k]:
        continue
      raw = g_src[i].raw
      if prev:
        raw, _ = jax.lax.optimization_barrier((raw, prev))
      args = list(base)
      args[k] = g_src[i].load(raw)
      prev = c.flat.evaluate(args, c.frontier[k], given)
      given.update(zip(c.frontier[k], prev))
      if seen is not None and n == 0:
        prev = [*prev, seen(i, None, args[k])]
        early.add(i)
    prev = c.flat.evaluate(base, c.values, given)
    given.update(zip(c.values, prev))
  return tuple(given[v] for v in p.cut.values), early


def _program_update(
  spec,
  p: Plan,
  train,
  g_flat,
  *,
  every_grad,
  w,
  o,
  e_leaves,
  cut_values,
  whole,
  states,
):
  """The updates of the params ``whole`` and the new state leaves
  ``states`` from the update's program (:attr:`Plan.flat`), with the
  cut's values given (:attr:`Plan.cut`); nothing else is read. The
  gradients given are those of the params in ``w``, or with
  ``every_grad`` (on the device) all of them, which a branch's predicate
  (``apply_if_finite``) reads."""
  n_g, n_o = len(train), len(spec.opt_leaves)
  program = p.flat
  args = [
    g if every_grad or i in w else None for g, i in zip(g_flat, train)
  ] + [o.get(j) for j in range(n_o)]
  args += [w.get(i) for i in train] + list(e_leaves) + list(cut_values)
  slot = {i: k for k, i in enumerate(train)}
  outs = program.evaluate(
    args,
    [program.outs[slot[i]] for i in whole]
    + [program.outs[n_g + j] for j in states],
  )
  return dict(zip(whole, outs[: len(whole)])), dict(
    zip(states, outs[len(whole) :])
  )


def _with_whole(g_flat, train, i, g_src):
  """``g_flat`` with param ``i``'s offloaded gradient whole, for an
  update that reads a stack's gradient whole as well as by rows (a
  per-leaf norm); unread, it is not computed."""
  out = list(g_flat)
  out[train.index(i)] = g_src[i].load(g_src[i].raw)
  return out


def _whole_update(
  spec, train, w_src, g_flat, *, w, o, opt_raw, extra_args, opt_def
):
  """The inner update with the weights ``w`` and state ``o`` given, the
  other leaves zeros (which no output kept reads: checked by
  :func:`~zerojax._src.step.offload.plan`); typed keys have no zeros and are read as they are.
  Returns per param its update, and the new state's leaves."""
  opt_in = [
    o[j] if j in o else _ops.opt_zeros(spec.opt_leaves[j], opt_raw[j])
    for j in range(len(opt_raw))
  ]
  w_in = [
    w[i] if i in w else jnp.zeros(a.shape, a.dtype)
    for i, a in ((i, w_src[i].aval) for i in train)
  ]
  updates, new = _ops.inner_update(
    spec,
    view(spec, train, g_flat),
    jax.tree.unflatten(opt_def, opt_in),
    view(spec, train, w_in),
    extra_args,
  )
  return spec.from_optimizer_view(updates), jax.tree.leaves(new)
