"""A layer stack streamed through device memory a few rows at a time.

A stack ``W[L, ...]`` larger than a chunk's budget (the offloaded state's
bytes over :data:`~zerojax._src.step.offload.CHUNKS`) would otherwise be
one chunk, alone: at 7B the MLP matrices' Adam moments are 17 GB, so the
stream's fill, its drain and the update's peak are a whole stack's. Where
the stack's weights and owned state are stored by rows (its leading
dimension sharded over no mesh axis: zerojax never shards a stack's
layer axis) and its update computes each row from the same row
(:mod:`zerojax._src.jaxpr.rows`: elementwise updates such as Adam, Lion or
SGD with momentum, behind global-norm clipping), its rows are spread over
consecutive chunks like any other leaves. Each chunk reads its rows from
the stored buffers (a slice of host memory), computes them from the
update's jaxpr, and writes them back into the buffers they replace
(``dynamic_update_slice`` into the donated buffer). An update
that reads the stack whole (LAMB's trust ratio, Adafactor's factored
moments) streams it whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax._src.jaxpr import rows as _rows
from zerojax._src.records.spec import StateSpec


def stack_rows(spec: StateSpec, closed, i: int, k: int, n_g: int, own) -> int:
  """Rows param ``i`` (the ``k``-th trained) may be updated by, or 0: a
  layer stack of matrices (rank 3 or more) whose weights and owned state are stored by rows (its
  leading dimension sharded over no mesh axis) and whose update computes
  each row from the same row (:class:`zerojax._src.jaxpr.rows.Rows`)."""
  r = spec.leaves[i]
  shape = tuple(r.aval.shape)
  # a stack of matrices or more: its rows are whole tiles of every
  # backend's layout (the TPU's tiles the two minor dimensions, so rows of
  # a matrix's major dimension may not be: the compiler refuses a host
  # slice of 1031 rows of a tiled f32 matrix)
  if len(shape) < 3 or shape[0] < 2 or not r.place.offload:
    return 0
  mine = [j for j, p in enumerate(own) if p == i]
  layouts = [r.shard, r.param] + [spec.opt_leaves[j].layout for j in mine]
  if any(x.dim == 0 or x.model_axes(0) for x in layouts):
    return 0
  for j in mine:
    a = spec.opt_leaves[j].aval
    extended = jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
    if extended or tuple(a.shape)[:1] != shape[:1]:
      return 0
  n_o = len(spec.opt_leaves)
  program = _rows.Rows(
    closed, {n_g + n_o + k} | {n_g + j for j in mine}, shape[0]
  )
  roles = program.roles([k] + [n_g + j for j in mine])
  return shape[0] if _rows.OTHER not in roles else 0


def rows_of(x, span):
  return x if span is None else jax.lax.slice_in_dim(x, *span, axis=0)


def stack_update(
  spec, p, train, g_flat, *, i, w_rows, o, mine, extra_args, span
):
  """Rows ``span`` of param ``i``'s update and of its state leaves
  ``mine`` from those rows of its weights and state (``o``: by rows for
  ``mine``, whole for the shared leaves): ``[update, *new state]``."""
  n_g, n_o, k = len(train), len(spec.opt_leaves), train.index(i)
  given = set(mine) | set(p.shared)  # not the other leaves' rows or state
  args = [*g_flat, *[o[j] if j in given else None for j in range(n_o)]]
  args += [w_rows if t == k else None for t in range(n_g)]
  args += [x for x in jax.tree.leaves(extra_args) if hasattr(x, "dtype")]
  program = _rows.Rows(
    p.program,
    {n_g + n_o + k} | {n_g + j for j in mine},
    spec.leaves[i].aval.shape[0],
  )
  return program.evaluate(args, span, [k] + [n_g + j for j in mine])


class Out:
  """Each param's ``finish`` results and each state leaf's new value, put
  together from its chunks: a layer stack's rows are written into the
  value they replace (``dynamic_update_slice`` into the donated buffer,
  host memory included), or concatenated where there is
  none (a view the step lays out afterwards)."""

  def __init__(self, n_params: int, opt_raw, bases):
    self.results = [None] * n_params
    self.opt = [None] * len(opt_raw)
    self._opt_raw = list(opt_raw)
    self._bases = bases
    self._parts = {}  # param -> (tree, per leaf: pieces or [buffer], written)

  def result(self, i: int, span, res) -> list:
    """Records param ``i``'s results for rows ``span`` (None: whole);
    returns the arrays its chunk stores."""
    if span is None:
      self.results[i] = res
      return jax.tree.leaves(res)
    leaves, tree = jax.tree.flatten(res)
    if i not in self._parts:
      base = None if self._bases is None else self._bases(i)
      base = [None] * len(leaves) if base is None else tree.flatten_up_to(base)
      self._parts[i] = (
        tree,
        [[] if b is None else [b] for b in base],
        [b is not None for b in base],
      )
    _, acc, written = self._parts[i]
    for t, x in enumerate(leaves):
      if written[t]:
        acc[t][0] = _write_rows(acc[t][0], x, span[0])
      else:
        acc[t].append(x)
    return [a[0] if w else x for a, w, x in zip(acc, written, leaves)]

  def state(self, j: int, span, value):
    """Records state leaf ``j``'s new value (rows ``span`` of it, as
    stored); returns the array its chunk stores."""
    if span is not None:
      value = self._opt_raw[j] = _write_rows(self._opt_raw[j], value, span[0])
    self.opt[j] = value
    return value

  def done(self):
    for i, (tree, acc, written) in self._parts.items():
      self.results[i] = jax.tree.unflatten(
        tree,
        [a[0] if w else jnp.concatenate(a) for a, w in zip(acc, written)],
      )
    return self.results, self.opt


def _write_rows(buffer, rows, start: int):
  return jax.lax.dynamic_update_slice_in_dim(buffer, rows, start, axis=0)
