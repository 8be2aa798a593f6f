"""What a new state gets besides its layout: the root PRNG key and the
model state (replicated), and the warnings about leaves that will not be
trained and mesh axes nothing uses."""

from __future__ import annotations

import jax
import numpy as np

from zerojax._src.records import warn as _warn
from zerojax._src.records.spec import (
  StateSpec,
  ZeroState,
  is_key_dtype,
)
from zerojax._src.records.trees import leaf_dtype
from zerojax._src.step.leaf_ops import fresh_copy


def _replicated(tree, spec: StateSpec):
  """Host or device values, the same on every process -> replicated arrays."""

  def put(x):
    rep = spec.replicated(np.ndim(x))
    if jax.process_count() == 1:
      # A fresh buffer: the train step donates the state, and device_put
      # may alias the caller's array (it does for replicated placement).
      return fresh_copy(rep)(x)
    if is_key_dtype(getattr(x, "dtype", None)):
      return jax.random.wrap_key_data(
        put(jax.random.key_data(x)), impl=jax.random.key_impl(x)
      )
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, rep, lambda i: host[i])

  return jax.tree.map(put, tree)


def _root_key(key, where: str):
  """A PRNG key from ``key`` (typed key, raw uint32 key or int seed)."""
  if key is None:
    return None
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    return jax.random.key(int(key))
  dtype = getattr(key, "dtype", None)
  if is_key_dtype(dtype):
    if key.shape != ():
      raise ValueError(
        f"{where}: key must be one key, got a key array of shape {key.shape}."
      )
    return key
  if dtype is not None and np.dtype(dtype) == np.uint32 and key.shape == (2,):
    return key  # a raw jax.random.PRNGKey
  raise TypeError(
    f"{where}: key={key!r} is not a PRNG key; pass jax.random.key(seed), "
    f"jax.random.PRNGKey(seed) or an int seed."
  )


def _warn_idle_model_axes(spec: StateSpec, where: str):
  """A model axis no parameter is split over repeats all work along it."""
  used = {
    a
    for r in spec.leaves
    for l in (r.shard, r.param)
    for m in l.model
    for a in m
  }
  idle = {
    a: n for a, n in spec.tx.model_axes.items() if n > 1 and a not in used
  }
  if idle:
    _warn.warn(
      f"{where}: mesh axes {idle} split no parameter (no model spec uses "
      f"them), so every device along them holds and computes the same "
      f"thing. Pass the model's shardings: zerojax.zero(..., model_specs="
      f"zerojax.linen.model_specs(variables, rules)) (or nnx.model_specs, "
      f"or a tree of PartitionSpec), or drop the axis from the mesh.",
    )


def warn_untrained(spec: StateSpec, where: str):
  """Leaves zerojax carries but does not train are said, not only listed."""
  frozen = [
    (r.path, leaf_dtype(r.aval.dtype)) for r in spec.leaves if not r.trainable
  ]
  if not frozen:
    return
  names = ", ".join(f"params{p} ({d})" for p, d in frozen[:4])
  more = f" and {len(frozen) - 4} more" if len(frozen) > 4 else ""
  _warn.warn(
    f"{where}: {names}{more} are neither floating nor complex, so they are "
    f"carried unchanged and not trained (jax.grad cannot differentiate "
    f"them, so Optax would not train them either). Pass such buffers as "
    f"model_state (or drop them from the params) to silence this.",
  )


def with_extras(state: ZeroState, key, model_state, where: str) -> ZeroState:
  warn_untrained(state.spec, where)
  _warn_idle_model_axes(state.spec, where)
  key = _root_key(key, where)
  if model_state is not None:
    for path, x in jax.tree_util.tree_flatten_with_path(model_state)[0]:
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
          f"{where}: model_state leaf {jax.tree_util.keystr(path)} is a "
          f"{type(x).__name__}, not an array."
        )
  extras = _replicated({"key": key, "model_state": model_state}, state.spec)
  return state.replace(**extras)
