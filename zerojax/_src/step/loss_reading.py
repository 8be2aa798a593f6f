"""The loss traced abstractly at a row count, and its jaxpr classified.

:func:`classified` is what :mod:`zerojax._src.step.loss_check` reads at each
row count: the classes of the loss, its aux and its new model state
(:mod:`zerojax._src.jaxpr.batch_mean`), the factors baked into examples, and
the sums over the batch it takes (:mod:`zerojax._src.jaxpr.batch_sums`).
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import numpy as np

from zerojax._src.jaxpr import batch_mean as _batch_mean
from zerojax._src.jaxpr import batch_sums as _batch_sums
from zerojax._src.step.batch import Shared


def classified(loss, abstract, treedef, leaves, rows, sums=False):
  """``((the loss's class, its aux leaves' classes, their paths and
  shapes, the new model state's classes, their paths and shapes), the
  factors baked into examples, (the signature of the candidates for sums
  over the batch, which of them are such sums))`` traced with ``rows``
  rows per device, or
  None when it does not trace so; with ``sums``, those sums are read as
  the whole batch's (given), else none is taken (``"optimistic"``: and an
  equation no rule follows is taken as per example where it can be;
  ``"kernels"``: only that)."""
  local = jax.tree.unflatten(treedef, [_piece_leaf(x, rows) for x in leaves])
  try:
    with _own_trace_cache():
      closed, shape = jax.make_jaxpr(loss, return_shape=True)(
        abstract[0], local, *abstract[1:]
      )
  except Exception:  # noqa: BLE001 -- the step itself reports the loss's errors
    return None
  classes = (
    [_batch_mean.C()] * len(jax.tree.leaves(abstract[0]))
    + [
      _batch_mean.R(0) if np.ndim(x) else _batch_mean.C()
      for x in jax.tree.leaves(local)
    ]
    + [_batch_mean.C()] * len(jax.tree.leaves(abstract[1:]))
  )
  rec, cands = None, ()
  if sums:
    if sums != "kernels":
      free = _batch_sums.batch_inputs(abstract[0], local, abstract[1:])
      cands = _batch_sums.candidates(closed.jaxpr, free)
    rec = _batch_sums.Recorder(
      frozenset(p for p, _, _ in cands),
      optimistic=sums in ("optimistic", "kernels"),
    )
  outs, baked = _batch_mean.classify(closed, classes, sums=rec)
  aux = jax.tree_util.tree_flatten_with_path(shape[1])[0]
  state = jax.tree_util.tree_flatten_with_path(shape[2])[0]
  n = 1 + len(aux)
  paths = [p for p, _, _ in cands]
  found = (
    _batch_sums.signature(cands),
    () if rec is None else tuple(paths.index(p) for p in rec.found),
    () if rec is None else tuple(rec.coefs),
  )
  return (outs[0], outs[1:n], aux, outs[n:], state), baked, found


@contextlib.contextmanager
def _own_trace_cache():
  """Traces under it keep their own entries in ``jax.jit``'s trace cache.

  The check traces the loss at a device's own rows, as the report's
  reading of its saved activations does, which records each
  :class:`zerojax.Remat` block while tracing it: a ``jax.jit`` inside the
  loss that the check had traced first would be taken from the cache
  there, unrecorded. The cache's key holds the configs that can change a
  trace; NumPy rank promotion set to ``"warn"`` (or ``"allow"`` where the
  user warns or raises) traces the same program under another key."""
  other = "warn" if jax.config.jax_numpy_rank_promotion == "allow" else "allow"
  with warnings.catch_warnings(), jax.numpy_rank_promotion(other):
    warnings.filterwarnings(
      "ignore", message="Following NumPy automatic rank promotion"
    )
    yield


def trusted_kind(loss, abstract, treedef, leaves, counts) -> str:
  """The loss's verdict with each equation no rule follows (a kernel)
  taken as per example where its shapes allow."""
  read = [
    classified(loss, abstract, treedef, leaves, n, sums="kernels")
    for n in counts
  ]
  if read[0] is None or read[1] is None:
    return "unknown"
  outs, baked = [r[0][0] for r in read], [r[1] for r in read]
  return _batch_mean.verdict(outs, baked, counts)[0]


def leaf_signature(x):
  return (np.shape(x), _dtype(x), _weak(x))


def _dtype(x):
  dtype = getattr(x, "dtype", None)
  return jax.dtypes.canonicalize_dtype(
    dtype if dtype is not None else np.result_type(x)
  )


def _weak(x) -> bool:
  if isinstance(x, (bool, int, float, complex)):
    return not isinstance(x, bool)
  return bool(getattr(x, "weak_type", False))


def _piece_leaf(x, rows: int):
  """A batch leaf as one device's micro-batch of ``rows`` rows sees it."""
  if isinstance(x, Shared):
    x = x.rows[0]
  dtype = _dtype(x)
  if not np.ndim(x):
    return jax.ShapeDtypeStruct((), dtype, weak_type=_weak(x))
  return jax.ShapeDtypeStruct((rows,) + tuple(np.shape(x)[1:]), dtype)


def abstract_leaf(x):
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return x
