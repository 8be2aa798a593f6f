"""How a user's loss is called and what it must return: the call rules
(:class:`LossCall`), one computation's static inputs (:class:`LossProgram`),
its traced arguments (:class:`LossArgs`) and the options' checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zerojax._src.records.spec import StateSpec
from zerojax._src.records.trees import tree_difference
from zerojax._src.step.batch import unshare

GATHER_MODES = ("auto", "model", "all")


class LossOutputError(ValueError):
  """``loss_fn`` returned something other than what its signature promises."""


@dataclasses.dataclass(frozen=True)
class LossCall:
  """How a loss is called and what it returns.

  ``loss_fn(params, batch[, key=][, model_state=])`` returns

  * without model state: ``loss``, or ``(loss, aux)`` (``has_aux`` True, or
    ``None`` to accept either);
  * with model state: ``(loss, new_model_state)`` or
    ``(loss, new_model_state, aux)``.
  """

  has_key: bool = False
  has_model_state: bool = False
  has_aux: bool | None = None

  def __call__(self, loss_fn, params, batch, key, model_state):
    kw = self.kwargs(key, model_state)
    return self.parse(loss_fn(params, unshare(batch), **kw), model_state)

  def kwargs(self, key, model_state) -> dict:
    """The keyword arguments the loss takes besides params and batch."""
    kw = {}
    if self.has_key:
      kw["key"] = key
    if self.has_model_state:
      # Rebuilt here, inside whatever transformation calls the loss: Flax
      # NNX variables may only be mutated at the trace that created them.
      leaves, treedef = jax.tree.flatten(model_state)
      kw["model_state"] = jax.tree.unflatten(treedef, leaves)
    return kw

  def parse(self, out, model_state):
    """-> ``(loss as a scalar of at least float32, new_model_state, aux)``:
    a bf16 loss is summed over devices and micro-batches in float32, a
    float64 one (``jax_enable_x64``) stays float64."""
    if self.has_model_state:
      if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise LossOutputError(
          "zerojax: with model_state, loss_fn must return "
          "(loss, new_model_state) or (loss, new_model_state, aux); got "
          f"{_describe(out)}."
        )
      loss, new_state = out[0], out[1]
      aux = out[2] if len(out) == 3 else None
      _check_same_tree(model_state, new_state)
    elif self.has_aux is None:
      loss, aux = (
        out if isinstance(out, tuple) and len(out) == 2 else (out, None)
      )
      new_state = None
    elif self.has_aux:
      if not isinstance(out, tuple) or len(out) != 2:
        raise LossOutputError(
          f"zerojax: has_aux=True, so loss_fn must return "
          f"(loss, aux); got {_describe(out)}."
        )
      (loss, aux), new_state = out, None
    else:
      loss, aux, new_state = out, None, None
    if not hasattr(loss, "shape") or jnp.shape(loss) != ():
      raise LossOutputError(
        f"zerojax: loss_fn must return a scalar loss (or a tuple starting "
        f"with one); got loss of shape {jnp.shape(loss)}."
      )
    loss = jnp.asarray(loss)
    return (
      loss.astype(jnp.promote_types(loss.dtype, jnp.float32)),
      new_state,
      aux,
    )


def _describe(out) -> str:
  if isinstance(out, tuple):
    return f"a tuple of {len(out)}"
  return f"{type(out).__name__} of shape {jnp.shape(out)}"


def _check_same_tree(old, new):
  diff = tree_difference(new, old)
  if diff and diff[0] == "structure":
    raise LossOutputError(
      f"zerojax: the model state returned by loss_fn has tree structure "
      f"{diff[1]}, the state given to it {diff[2]}. Return the updated "
      f"model state with the same structure (e.g. nnx.state(model, ...) "
      f"with the same filters)."
    )
  if diff:
    _, path, b, a = diff
    raise LossOutputError(
      f"zerojax: model_state{path} went from {a.dtype}{list(a.shape)} to "
      f"{b.dtype}{list(b.shape)} in loss_fn; model state must keep its "
      f"shapes and dtypes (cast it back)."
    )


@dataclasses.dataclass(frozen=True)
class LossProgram:
  """One gradient (or evaluation) computation's static inputs: the state's
  records, the user's loss and how it is called, the micro-batches per
  step and the gather mode (see :func:`zerojax.train_step`).

  ``typed``: whether the per-device program keeps JAX's per-device types
  (``jax.shard_map``'s ``check_vma``); ``False`` for a loss those types
  refuse (:func:`zerojax._src.step.per_device.over_batch_axes`).
  ``sums``: the loss is a sum over examples (the loss check's verdict), so
  the devices' and micro-batches' losses and gradients are added up, not
  averaged; ``summed_aux``: per aux leaf, a float added up likewise
  (:mod:`zerojax._src.step.global_sums`)."""

  spec: StateSpec
  loss_fn: Callable
  call: LossCall
  accum_steps: int = 1
  gather: str = "auto"
  typed: bool = True
  sums: bool = False
  summed_aux: tuple = ()


class LossArgs(NamedTuple):
  """A loss call's traced arguments besides the params: one (micro-)batch
  of this device's rows, the key folded for it, the model state."""

  batch: Any
  key: Any
  model_state: Any


def whole_params(spec: StateSpec):
  """The params as a loss sees them gathered: whole, each trained leaf in
  its compute dtype (shapes only)."""
  return spec.unflatten_params(
    [
      jax.ShapeDtypeStruct(
        r.aval.shape, r.compute_dtype if r.trainable else r.aval.dtype
      )
      for r in spec.leaves
    ]
  )


def check_options(loss_fn, gather, accum_steps, where):
  if gather not in GATHER_MODES:
    raise ValueError(
      f"{where}: gather={gather!r}; use 'auto', "
      f"'model' (the loss calls zerojax.gather per layer) or "
      f"'all' (zerojax gathers the whole tree first)."
    )
  if not isinstance(accum_steps, int) or accum_steps < 1:
    raise ValueError(
      f"{where}: accum_steps={accum_steps!r} must be an int >= 1."
    )
  if not callable(loss_fn):
    raise TypeError(f"{where}: loss_fn must be callable.")
