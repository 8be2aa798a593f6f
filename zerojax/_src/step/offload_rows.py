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


def may_stream_by_rows(shape) -> bool:
  """Whether a leaf of ``shape`` is a stack of matrices or more (rank 3 or
  more, two rows at least): its rows are whole tiles of every backend's
  layout (the TPU's tiles the two minor dimensions, so rows of a matrix's
  major dimension may not be: the compiler refuses a host slice of 1031
  rows of a tiled f32 matrix)."""
  return len(shape) >= 3 and shape[0] >= 2


def stack_rows(spec: StateSpec, closed, i: int, k: int, n_g: int, own) -> int:
  """Rows param ``i`` (the ``k``-th trained) may be updated by, or 0: a
  layer stack of matrices (rank 3 or more) whose weights and owned state are stored by rows (its
  leading dimension sharded over no mesh axis) and whose update computes
  each row from the same row (:class:`zerojax._src.jaxpr.rows.Rows`)."""
  r = spec.leaves[i]
  shape = tuple(r.aval.shape)
  mine = [j for j, p in enumerate(own) if p == i]
  # streamed: its master copy or any state it owns is in host memory
  streams = r.place.offload or any(
    spec.opt_leaves[j].place.offload for j in mine
  )
  if not may_stream_by_rows(shape) or not streams:
    return 0
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
  spec,
  p,
  train,
  g_flat,
  *,
  i,
  w_rows,
  o,
  mine,
  extra_args,
  span,
  g_rows=None,
  cut_values=(),
):
  """Rows ``span`` of param ``i``'s update and of its state leaves
  ``mine`` from those rows of its weights and state (``o``: by rows for
  ``mine``, whole for the shared leaves): ``[update, *new state]``.
  ``g_rows(span)``: rows of its gradient, where the update reads them by
  rows (the gradient whole where it reads it whole: a global norm).
  ``cut_values``: the values of ``p.cut``, the program's last inputs."""
  n_g, n_o, k = len(train), len(spec.opt_leaves), train.index(i)
  given = set(mine) | set(p.shared)  # not the other leaves' rows or state
  grads = list(g_flat)
  if g_rows is not None:
    grads[k] = _rows.Lazy(g_flat[k], g_rows)
  args = [*grads, *[o[j] if j in given else None for j in range(n_o)]]
  args += [w_rows if t == k else None for t in range(n_g)]
  args += [x for x in jax.tree.leaves(extra_args) if hasattr(x, "dtype")]
  args += list(cut_values)
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
  host memory included), or concatenated where there is none (a view the
  step lays out afterwards).

  Each write makes a new version of the stored buffer. Later chunks read
  their rows from the newest version (:meth:`latest`; rows no chunk has
  written, so the stored values) and wait on it, never on an older one: a
  use of an old version that the scheduler may place after the next write
  makes the compiler copy the whole buffer before writing in place (the
  GPU compiler did, a host-memory temp the size of the stacks' state)."""

  def __init__(self, n_params: int, opt_raw, bases):
    self.results = [None] * n_params
    self.opt = [None] * len(opt_raw)
    self._opt_raw = list(opt_raw)
    self._bases = bases
    # param -> (tree, per leaf: the buffer it is written into or None,
    # per leaf: its pieces where there is no buffer)
    self._parts = {}
    self._versions = {}  # id(stored buffer) -> (it, its newest version)

  def latest(self, x):
    """The newest version of stored buffer ``x`` (``x`` if none written)."""
    hit = self._versions.get(id(x))
    return x if hit is None else hit[1]

  def _write(self, buffer, rows, start: int):
    new = jax.lax.dynamic_update_slice_in_dim(
      self.latest(buffer), rows, start, axis=0
    )
    self._versions[id(buffer)] = (buffer, new)
    return buffer

  def result(self, i: int, span, res) -> list:
    """Records param ``i``'s results for rows ``span`` (None: whole);
    returns what its chunk stores (a buffer written into stands for its
    newest version: resolve with :meth:`latest`)."""
    if span is None:
      self.results[i] = res
      return jax.tree.leaves(res)
    leaves, tree = jax.tree.flatten(res)
    if i not in self._parts:
      base = None if self._bases is None else self._bases(i)
      base = [None] * len(leaves) if base is None else tree.flatten_up_to(base)
      self._parts[i] = (tree, base, [[] for _ in leaves])
    _, base, pieces = self._parts[i]
    out = []
    for b, acc, x in zip(base, pieces, leaves):
      if b is None:
        acc.append(x)
        out.append(x)
      else:
        out.append(self._write(b, x, span[0]))
    return out

  def state(self, j: int, span, value):
    """Records state leaf ``j``'s new value (rows ``span`` of it, as
    stored); returns what its chunk stores, as :meth:`result` does."""
    if span is None:
      self.opt[j] = value
      return value
    return self._write(self._opt_raw[j], value, span[0])

  def done(self):
    for i, (tree, base, pieces) in self._parts.items():
      self.results[i] = jax.tree.unflatten(
        tree,
        [
          jnp.concatenate(acc) if b is None else self.latest(b)
          for b, acc in zip(base, pieces)
        ],
      )
    for j, x in enumerate(self._opt_raw):
      if id(x) in self._versions:
        self.opt[j] = self.latest(x)
    return self.results, self.opt
