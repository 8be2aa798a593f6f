"""Sharded checkpoints with Orbax: exact resume, restore onto another layout.

What is saved, per step, by ``orbax.checkpoint.CheckpointManager``
(asynchronous by default; keep-last-k; every n steps):

* ``state``: the :class:`~zerojax.ZeroState` arrays *as stored* -- params,
  master copy, optimizer state, step -- each process writing only the shards
  it holds (no gather to one host);
* ``meta`` (JSON): the layout they were stored in (stage, device count,
  mixed-precision policy, every leaf's logical shape and sharded dimension)
  and the caller's ``extra`` (e.g. the data position).

Restoring needs the target :class:`~zerojax.ZeroTransformation` and a params
template (arrays or ``jax.ShapeDtypeStruct``) for the tree structure. The
template is checked against the saved layout first (a leaf missing, a shape
changed: a clear error, before any array is read). Then each leaf is read
straight into its target sharding when its stored shape is the same under
both layouts, else into a compatible sharding on the target mesh, and one
jitted conversion moves everything to the target layout: slice off the old
padding, pad for the new device count, cast where the precision policy
changed. Slicing, padding and same-dtype copies are exact, so values come
back bitwise identical; a policy change is allowed only where it is lossless
(the target keeps at least the precision of the saved master weights).

So a run saved at stage 3 on 8 devices restores at stage 1 on 4, or at
stage 0 on 1, with no offline conversion step.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

from zerojax._src.ckpt.convert import (
  check_compatible,
  convert_tree,
  restore_targets,
  source_spec,
)
from zerojax._src.ckpt.layout_json import FORMAT, CheckpointError, describe
from zerojax._src.records.mesh import named
from zerojax._src.records.spec import (
  ZeroState,
  is_key_dtype,
  make_spec,
)
from zerojax._src.step.deleted import reject_deleted
from zerojax._src.step.dropin import ZeroTransformation


def _state_tree(state: ZeroState) -> dict:
  tree = {
    "step": state.step,
    "params": state.params,
    "opt_state": state.opt_state,
  }
  if state.master is not None:
    tree["master"] = state.master
  if state.key is not None:
    tree["key"] = _key_data(state.key)
  # typed keys in the optimizer state (optax.noisy_sgd) as their raw data
  tree["opt_state"] = jax.tree.map(_key_data, state.opt_state)
  if state.model_state is not None:
    tree["model_state"] = state.model_state
  return tree


def _state_handler(compression: bool, replica_parallel: bool):
  """Orbax's PyTree handler for the state item, with the two write
  options that cost host memory while saving (:class:`Checkpointer`)."""
  kw = {}
  if not replica_parallel:
    h = ocp.type_handlers
    kw["type_handler_registry"] = h.create_type_handler_registry(
      (int, h.ScalarHandler()),
      (float, h.ScalarHandler()),
      (np.number, h.ScalarHandler()),
      (np.ndarray, h.NumpyHandler()),
      (jax.Array, h.ArrayHandler(use_replica_parallel=False)),
      (str, h.StringHandler()),
    )
  return ocp.PyTreeCheckpointHandler(use_compression=compression, **kw)


def _is_typed_key(key) -> bool:
  return is_key_dtype(key.dtype)


def _key_data(key):
  return jax.random.key_data(key) if _is_typed_key(key) else key


def _key_meta(key) -> str | None:
  """How to rebuild the key: its PRNG implementation, or "raw" (uint32)."""
  if key is None:
    return None
  return str(jax.random.key_impl(key)) if _is_typed_key(key) else "raw"


class Checkpointer:
  """Saves and restores :class:`~zerojax.ZeroState` with Orbax.

  Args:
    directory: where step directories are written (created if missing).
    save_every: save only every ``save_every`` steps (``save`` returns False
      otherwise, unless ``force``); the first save into an empty directory
      always happens (Orbax's rule).
    keep: keep the last ``keep`` checkpoints (None: all).
    async_save: write in a background thread while training continues; call
      :meth:`wait` (or :meth:`close`) before reading what was written.
    compression: zstd-compress the arrays (Orbax's default). Costs host
      memory while saving: a compressed copy of what is written.
    replica_parallel: split the write of a replicated array (the params
      at stages 0-2) across its replicas (Orbax's default; spreads the
      writing over hosts). Each replica then saves a host copy of its
      slice; with ``False`` the first replica writes the array from
      device memory.
    Both only change how a checkpoint is written: any setting restores
    any checkpoint.

  Example:
    >>> ckpt = zerojax.checkpoint.Checkpointer("ckpt", save_every=100, keep=3)
    >>> ckpt.save(state, extra={"data_step": 1200})      # step 0: saved
    True
    >>> ckpt.wait()
    >>> state, extra = ckpt.restore(params_template, tx)   # any stage, any N
    >>> extra["data_step"]
    1200
  """

  def __init__(
    self,
    directory,
    *,
    save_every: int = 1,
    keep: int | None = 3,
    async_save: bool = True,
    compression: bool = True,
    replica_parallel: bool = True,
  ):
    if save_every < 1:
      raise ValueError(f"Checkpointer: save_every={save_every} must be >= 1.")
    self.directory = pathlib.Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        save_interval_steps=save_every,
        max_to_keep=keep,
        enable_async_checkpointing=async_save,
        create=True,
      ),
      item_handlers={
        "state": _state_handler(compression, replica_parallel),
        "meta": ocp.JsonCheckpointHandler(),
      },
    )

  # -- saving -------------------------------------------------------------
  def save(
    self, state: ZeroState, *, extra: dict | None = None, force: bool = False
  ) -> bool:
    """Starts saving ``state`` at its step; True if a save was started."""
    if not isinstance(state, ZeroState):
      raise TypeError(
        f"Checkpointer.save: expected a ZeroState, got {type(state).__name__}."
      )
    reject_deleted(state, "Checkpointer.save")
    step = int(jax.device_get(state.step))
    meta = dict(
      describe(state.spec),
      extra=extra or {},
      key=_key_meta(state.key),
      opt_keys=[
        _key_meta(x) if _is_typed_key(x) else None
        for x in jax.tree.leaves(state.opt_state)
      ],
      model_state=state.model_state is not None,
    )
    return self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(_state_tree(state)),
        meta=ocp.args.JsonSave(meta),
      ),
      force=force,
    )

  def wait(self):
    """Blocks until asynchronous saves have been committed."""
    self._manager.wait_until_finished()

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- reading ------------------------------------------------------------
  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def metadata(self, step: int | None = None) -> dict:
    step = self._pick(step)
    try:
      out = self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
      )
    except Exception as e:  # noqa: BLE001 -- re-raised with the path and fix
      raise CheckpointError(
        f"zerojax checkpoint {self.directory}/{step}: its layout metadata "
        f"could not be read ({type(e).__name__}: {e}). The step may be "
        f"corrupted; restore another step (available: {self.all_steps()})."
      ) from e
    meta = out["meta"]
    if meta.get("format") != FORMAT:
      raise CheckpointError(
        f"zerojax checkpoint {self.directory}/{step} has "
        f"format {meta.get('format')!r}, expected {FORMAT!r}."
      )
    return meta

  def _pick(self, step):
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(
        f"zerojax: no checkpoint in {self.directory} (no committed step "
        f"directories). Check the path, or start without --resume."
      )
    if step is None:
      return max(steps)
    if step not in steps:
      raise FileNotFoundError(
        f"zerojax: no checkpoint for step {step} in "
        f"{self.directory}; available steps: {steps}."
      )
    return step

  def restore(
    self,
    params_template,
    tx: ZeroTransformation,
    step: int | None = None,
    *,
    model_state_template=None,
  ) -> tuple[ZeroState, dict]:
    """Restores a step (default: the latest) into ``tx``'s layout.

    Args:
      params_template: the model's params (arrays or ShapeDtypeStructs, as
        given to :func:`zerojax.init`): their tree structure, shapes and
        dtypes. Nothing is read from them.
      tx: the target :class:`ZeroTransformation` (any stage, mesh, policy;
        the same inner optimizer).
      step: which step; default the latest committed one.
      model_state_template: the model state's structure (arrays or
        ShapeDtypeStructs), needed when the checkpoint holds model state.
        The PRNG key, when saved, is restored without a template.

    Returns:
      ``(state, extra)``: the state laid out for ``tx``, and the ``extra``
      dict given to :meth:`save`.
    """
    step = self._pick(step)
    meta = self.metadata(step)
    target = make_spec(params_template, tx)
    source = source_spec(meta, params_template, tx, self.directory / str(step))
    check_compatible(meta, source, target, self.directory / str(step))
    abstract = restore_targets(source, target)
    rep = lambda ndim: named(tx.mesh, P(), ndim)
    if meta.get("key"):
      shape = (
        (2,)
        if meta["key"] == "raw"
        else tuple(
          jax.eval_shape(
            lambda: jax.random.key_data(jax.random.key(0, impl=meta["key"]))
          ).shape
        )
      )
      abstract["key"] = jax.ShapeDtypeStruct(
        shape, jnp.uint32, sharding=rep(len(shape))
      )
    if meta.get("model_state"):
      if model_state_template is None:
        raise CheckpointError(
          f"zerojax checkpoint {self.directory}/{step} holds model state; "
          f"pass its structure: restore(params_template, tx, "
          f"model_state_template=...)."
        )
      abstract["model_state"] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
          np.shape(x), x.dtype, sharding=rep(np.ndim(x))
        ),
        model_state_template,
      )
    try:
      out = self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
            abstract,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
          )
        ),
      )
    except Exception as e:  # noqa: BLE001 -- re-raised with the path and fix
      raise CheckpointError(
        f"zerojax checkpoint {self.directory}/{step} could not be read "
        f"({type(e).__name__}: {str(e)[:300]}). It may be corrupted or "
        f"partially written; restore an earlier step (available: "
        f"{self.all_steps()}). Nothing was changed."
      ) from e
    tree = dict(out["state"])
    key, model_state = tree.pop("key", None), tree.pop("model_state", None)
    if key is not None and meta["key"] != "raw":
      key = jax.random.wrap_key_data(key, impl=meta["key"])
    impls = meta.get("opt_keys") or []
    tree["opt_state"] = jax.tree.unflatten(
      source.opt_def,
      [
        jax.random.wrap_key_data(x, impl=impl)
        if impl not in (None, "raw")
        else x
        for x, impl in zip(
          jax.tree.leaves(tree["opt_state"]),
          impls + [None] * len(source.opt_leaves),
        )
      ],
    )
    outs = target.shardings()
    convert = jax.jit(
      target.region(lambda t: convert_tree(t, source, target), outs),
      out_shardings=outs,
    )
    state = convert(tree).replace(key=key, model_state=model_state)
    return state, meta.get("extra", {})
