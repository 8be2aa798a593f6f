"""The jitted, donated train step: :func:`value_and_grad`'s half, then
:func:`apply_gradients`'s half, in one ``jit``.

* **Gradients** (``step/grad.py``) are computed inside ``jax.shard_map`` over the
  data axis, so every parameter-sized collective is written by hand and XLA
  emits exactly it: stage 0 ``psum`` (all-reduce), stage 1 ``psum_scatter``
  after the local backward (reduce-scatter), stages 2-3 ``psum_scatter``
  inside the backward pass through :func:`zerojax.gather`, and at stage 3
  the forward (and rematerialised backward) ``all_gather``. Left to GSPMD,
  the same layouts compile to an all-reduce of the full gradient on CPU,
  twice the bytes of a reduce-scatter.
* **The optimizer update** (``step/update.py``) runs on global arrays under
  ``jit``: logical views of the sharded gradient, master weights and
  optimizer state, so every Optax optimizer gives the unsharded result.
  Stage 1-2 parameters are all-gathered back, in the compute dtype.
* **Randomness and model state**: a state built with ``key=`` hands the loss
  ``fold_in(fold_in(fold_in(key, step), device), micro_batch)``; one built
  with ``model_state=`` threads it through the micro-batches and averages
  its floating leaves over the data axis.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding

from zerojax._src.records.config import HOST_MEMORY
from zerojax._src.records.mesh_errors import explain_per_device_errors
from zerojax._src.records.spec import StateSpec, ZeroState
from zerojax._src.records.trees import leaf_dtype, tree_difference
from zerojax._src.step import accumulate as _accumulate
from zerojax._src.step import aux as _aux
from zerojax._src.step import grad as _grad
from zerojax._src.step import update as _update
from zerojax._src.step.batch import place_batch
from zerojax._src.step.deleted import reject_deleted
from zerojax._src.step.dropin import ZeroTransformation
from zerojax._src.step.global_sums import as_sums
from zerojax._src.step.loss_call import (
  LossCall,
  LossProgram,
  check_options,
)
from zerojax._src.step.loss_check import check_per_device_loss, check_step_loss

# --------------------------------------------------------------------------
# input checks (all before tracing, so a failed step loses nothing)

# --------------------------------------------------------------------------


def config_differences(have, want) -> list[str]:
  """Every configuration field in which two transformations differ."""
  diffs = []
  for f in dataclasses.fields(have.config):
    a, b = getattr(have, f.name), getattr(want, f.name)
    if f.name == "inner":
      if a is not b and a != b:
        diffs.append("inner optimizer: a different optax transformation")
    elif f.name == "mesh":
      if a != b:
        diffs.append("mesh: the state lives on a different mesh")
    elif a != b:
      diffs.append(f"{f.name}: state has {a!r}, step has {b!r}")
  return diffs


def check_state(state, tx: ZeroTransformation) -> StateSpec:
  if not isinstance(state, ZeroState):
    raise TypeError(
      f"zerojax train step: expected a ZeroState from "
      f"zerojax.init, got {type(state).__name__}."
    )
  spec = state.spec
  have = spec.tx
  if have != tx:
    raise ValueError(
      "zerojax train step: this state was laid out by another "
      "ZeroTransformation ("
      + "; ".join(config_differences(have, tx))
      + "). Build the step with the tx that built the state "
      "(zerojax.init(params, tx); zerojax.train_step(loss_fn, tx)). To "
      "move a state to another stage, re-init from "
      "zerojax.gather_params(state)."
    )
  # The arrays must still match the spec (a user may have replaced params).
  # Fast path, every step: compare against a per-layout signature computed
  # once; walk the trees for a message only when something differs.
  if _signature(state) == _expected_signature(spec):
    return spec
  expected = spec.abstract()
  for name in _SECTIONS:
    diff = tree_difference(getattr(state, name), getattr(expected, name))
    if diff and diff[0] == "structure":
      raise ValueError(
        f"zerojax train step: state.{name} has tree structure {diff[1]}, "
        f"but the optimizer state was built for {diff[2]}. Params and "
        f"optimizer state must come from the same zerojax.init call."
      )
    if diff:
      _, path, g, w = diff
      raise ValueError(
        f"zerojax train step: state.{name}{path} is "
        f"{leaf_dtype(g.dtype)}{list(g.shape)}, but the state layout "
        f"expects {leaf_dtype(w.dtype)}{list(w.shape)} (stage "
        f"{spec.stage} storage, padded). Rebuild the state with "
        f"zerojax.init instead of replacing leaves."
      )
  return spec


_SECTIONS = ("params", "master", "opt_state")


def _signature(state: ZeroState):
  return tuple(
    (
      jax.tree.structure(getattr(state, n)),
      tuple(
        (tuple(x.shape), leaf_dtype(x.dtype))
        for x in jax.tree.leaves(getattr(state, n))
      ),
    )
    for n in _SECTIONS
  )


@functools.lru_cache(maxsize=64)
def _expected_signature(spec: StateSpec):
  return _signature(spec.abstract())


# --------------------------------------------------------------------------
# the train step: gradients (shard_map), then the update (GSPMD)

# --------------------------------------------------------------------------


def loss_call(state: ZeroState) -> LossCall:
  return LossCall(
    has_key=state.key is not None,
    has_model_state=state.model_state is not None,
    has_aux=None,
  )


def step_key(state: ZeroState):
  """The step's key: ``fold_in(root, step)`` (devices and micro-batches fold
  in their own index inside the step)."""
  return (
    None if state.key is None else jax.random.fold_in(state.key, state.step)
  )


def _step(
  state: ZeroState,
  batch,
  extra_args,
  *,
  loss_fn,
  accum_steps,
  gather_mode,
  with_grad_norm=True,
  found=None,
  sums=False,
):
  """``(new state, metrics, (aux_reduced, aux_rows))``; ``found`` learns
  which aux leaves are per-example (:mod:`zerojax._src.step.aux`);
  ``sums``: the loss is a sum over examples (the loss check's verdict)."""
  spec = state.spec
  prog = LossProgram(
    spec, loss_fn, loss_call(state), accum_steps, gather_mode, sums=sums
  )
  unscaled = _accumulate.Unscaled()  # host sums scaled as they are loaded
  grads, loss, aux, new_ms = _grad.sharded_grads(
    prog,
    state.params,
    batch,
    step_key(state),
    state.model_state,
    found=found,
    unscaled=unscaled,
  )
  grads = _update.after_every_gradient(spec, grads)
  if isinstance(spec.tx.inner, optax.GradientTransformationExtraArgs):
    extra_args = {"value": loss, **extra_args}
  new_state, grad_norm = _update.update_state(
    state, grads, extra_args, "zerojax train step", unscaled.factors
  )
  if new_ms is not None:
    new_state = new_state.replace(model_state=new_ms)
  # Left out, the norm is an unused value in the jitted step: XLA drops it.
  metrics = (
    {"loss": loss, "grad_norm": grad_norm} if with_grad_norm else {"loss": loss}
  )
  return new_state, metrics, aux


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """A jitted program over a :class:`ZeroState`: checks the state against
  ``tx`` and places the batch before each call."""

  loss_fn: Callable
  tx: ZeroTransformation
  gather: str
  accum_steps: int
  _jitted: Any = dataclasses.field(repr=False, compare=False, default=None)
  per_device_loss: bool = False
  reports_aux: bool = True  # an eval step built without has_aux drops it
  keeps_model_state: bool = True  # an eval step discards its update
  checked: dict = dataclasses.field(  # loss_check's verdicts by batch shape
    repr=False, compare=False, default_factory=dict
  )
  where = "zerojax step"

  def _prepare(self, state, batch, extra_args=None):
    """The jitted program's arguments: the state, the batch placed, the
    extra args split (a train step's), and whether the loss is a sum over
    examples (added up over devices and micro-batches, not averaged)."""
    check_state(state, self.tx)
    placed = place_batch(batch, self.tx, self.accum_steps)
    extra = () if extra_args is None else _update.split_extra_args(extra_args)
    return state, placed, *extra, as_sums(check_step_loss(self, state, batch))

  def _run(self, where: str, state, *args):
    """The jitted call; a deleted state leaf is refused first, by path."""
    reject_deleted(state, where)
    with explain_per_device_errors(self.tx.mesh, where):
      return self._jitted(state, *args)


@dataclasses.dataclass(frozen=True)
class TrainStep(CompiledStep):
  """A jitted, state-donating train step; call it as ``step(state, batch)``.

  ``batch`` is a pytree of arrays sharing a leading batch dimension, split
  over the batch axes (and micro-batches); a scalar leaf (a loss weight,
  a temperature) is the same for every example and reaches the loss as
  the scalar, as a plain ``jit`` argument would, a new value retracing
  nothing.

  ``step(state, batch, **extra_args)`` returns ``(new_state, metrics)`` with
  ``metrics = {"loss", "grad_norm"}`` (``"grad_norm"`` unless built with
  ``grad_norm=False``; plus ``"aux"`` when the loss returns one, as the
  loss gives it on the whole batch: a per-example leaf, whose shape follows
  the batch's rows, with every row in batch order, sharded by rows; other
  floating leaves averaged over devices and micro-batches, integer leaves
  -- counts -- summed; :mod:`zerojax._src.step.aux`).
  ``extra_args`` go to the inner optimizer's update (an
  ``optax.GradientTransformationExtraArgs``), after ``value=`` (the step's
  mean loss), which is always passed. Metrics are device
  arrays: read them a step late to keep the host from stalling the device.
  """

  donate: bool = True
  grad_norm: bool = True
  where = "zerojax.train_step"

  def __call__(self, state: ZeroState, batch, **extra_args):
    args = self._prepare(state, batch, extra_args)
    return self._run("zerojax.train_step", *args)

  def lower(self, state: ZeroState, batch, **extra_args):
    """``jax.jit(...).lower`` of the step, e.g. to read its compiled HLO.
    ``state`` may be abstract (``jax.eval_shape`` of ``zerojax.init_from``)
    where its leaves carry their shardings (an Explicit mesh)."""
    state = abstract_ready(state, "TrainStep.lower")
    args = self._prepare(state, batch, extra_args)
    with explain_per_device_errors(self.tx.mesh, "zerojax.train_step"):
      return self._jitted.lower(*args)

  def trace(self, state: ZeroState, batch, **extra_args):
    """``jax.jit(...).trace`` of the step: its jaxpr, or a lowering for
    another platform (``.lower(lowering_platforms=("cuda",))`` shows the
    GPU program, host-memory placements included, from a CPU machine)."""
    state = abstract_ready(state, "TrainStep.trace")
    args = self._prepare(state, batch, extra_args)
    with explain_per_device_errors(self.tx.mesh, "zerojax.train_step"):
      return self._jitted.trace(*args)


def abstract_ready(state, where: str):
  """``state`` as lowered: an abstract scalar with no sharding (the step
  counter, which ``jax.eval_shape`` leaves untyped on some JAX versions)
  gets the replicated sharding the real state's has, so the program is
  the real state's. Any other abstract leaf with no sharding would be
  lowered as laid out by XLA's choice, not the stage's: a different
  program, so it is refused. (``jax.eval_shape`` keeps shardings only where
  they are part of the arrays' types: on Explicit axes.)"""
  _check_abstract(state, where)
  if not isinstance(state, ZeroState):
    return state
  replicated = state.spec.replicated()
  state = jax.tree.map(
    lambda x: (
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
      if (
        isinstance(x, jax.ShapeDtypeStruct)
        and not x.shape
        and getattr(x, "sharding", None) is None
      )
      else x
    ),
    state,
  )
  place = state.spec.place
  if not (place.offload or state.spec.config.offload_params):
    return state

  # offloaded: the master copy and the optimizer state live in host memory
  # and the rest in device memory, kinds jax.eval_shape does not keep in the
  # leaves' shardings (lowered without them, the program would read the
  # offloaded leaves from device memory)
  def kind(memory):
    return lambda x: (
      jax.ShapeDtypeStruct(
        x.shape,
        x.dtype,
        sharding=NamedSharding(place.mesh, x.sharding.spec, memory_kind=memory),
      )
      if (
        isinstance(x, jax.ShapeDtypeStruct)
        and isinstance(x.sharding, NamedSharding)
        and x.sharding.memory_kind is None
      )
      else x
    )

  spec = state.spec
  where_kept = lambda host: kind(HOST_MEMORY) if host else kind("device")
  master = state.master
  if master is not None:
    master = spec.optimizer_view(
      [
        None if x is None else where_kept(r.place.offload)(x)
        for x, r in zip(spec.masters(master), spec.leaves)
      ]
    )
  opt = jax.tree.unflatten(
    jax.tree.structure(state.opt_state),
    [
      where_kept(o.place.offload)(x)
      for x, o in zip(jax.tree.leaves(state.opt_state), spec.opt_leaves)
    ],
  )
  params = spec.unflatten_params(
    [
      where_kept(r.place.params_host)(x)
      for x, r in zip(jax.tree.leaves(state.params), spec.leaves)
    ]
  )
  state = state.replace(params=params, master=master, opt_state=opt)
  return jax.tree.map(kind("device"), state)


def _check_abstract(state, where: str):
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    if (
      isinstance(x, jax.ShapeDtypeStruct)
      and x.shape
      and getattr(x, "sharding", None) is None
    ):
      raise ValueError(
        f"{where}: the abstract state's leaf state{jax.tree_util.keystr(path)}"
        f" (shape {tuple(x.shape)}) carries no sharding, so the program "
        f"would not be the one the real state gets. jax.eval_shape keeps "
        f"shardings on Explicit mesh axes (jax.make_mesh's default); on "
        f"Auto axes build the state (zerojax.init_from), or give each leaf "
        f"its sharding (jax.ShapeDtypeStruct(..., sharding=...))."
      )


def train_step(
  loss_fn: Callable,
  tx: ZeroTransformation,
  *,
  accum_steps: int = 1,
  gather: str = "auto",
  donate: bool = True,
  grad_norm: bool = True,
  per_device_loss: bool = False,
) -> TrainStep:
  """Builds the jitted train step for ``tx``'s stage.

  It is :func:`zerojax.value_and_grad` followed by
  :func:`zerojax.apply_gradients`, compiled together and donating the state.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning the mean (or the sum)
      loss over the (per-device micro-) batch it is given, or
      ``(loss, aux)``; the devices' means are averaged, their sums added
      up (the loss check reads which the loss is). When the
      state carries a key (``zerojax.init(..., key=)``) it is called with
      ``key=`` as well, distinct per step, device and micro-batch; when it
      carries model state, with ``model_state=``, and returns
      ``(loss, new_model_state)`` or ``(loss, new_model_state, aux)``.
    tx: the :class:`ZeroTransformation` that built the state.
    accum_steps: micro-batches per step (gradient accumulation inside one
      jitted step). Stages 0-1 accumulate local full gradients and reduce
      once; stages 2-3 reduce every micro-batch into a sharded accumulator.
    gather: who gathers sharded parameters at stages 2-3. ``"model"``:
      ``loss_fn`` calls :func:`zerojax.gather` on each layer's parameters
      just before use, and any other use of a sharded parameter is an error.
      ``"all"``: zerojax gathers the whole tree before calling ``loss_fn`` --
      exact for any loss, but at stage 3 every full weight is live at once.
      ``"auto"`` (default): ``"model"`` when the loss's traced program uses
      sharded parameters only through ``gather``; otherwise (a loss written
      for plain data parallelism, an L2 term over
      ``jax.tree.leaves(params)``) zerojax gathers each parameter where the
      traced loss uses it: one layer per iteration inside a ``lax.scan``
      over stacked weights (whose body then runs under
      ``jax.checkpoint``), the whole leaf anywhere else. It warns once,
      with the reason and the memory cost, when no leaf could be gathered
      per layer or a leaf is also used whole. At stage 1 (one
      micro-batch) the same walk reduce-scatters a plain loss's layer
      gradients inside its backward loop. Either way the result is the
      unsharded one. Other errors in the loss propagate unchanged.
    donate: donate the input state's buffers to the output state.
    per_device_loss: ``False`` (default): a loss that is neither a mean
      nor a sum over examples (nor one divided by counts of its batch
      alone, ``jnp.sum(ce * mask) / jnp.sum(mask)``, run with the whole
      batch's) raises :class:`zerojax.errors.LossNotAMeanError` before
      anything runs (:mod:`zerojax._src.step.loss_check`). ``True``:
      average the per-device losses on purpose (data parallelism's).
    grad_norm: report the global norm of the step's gradient (the
      optimizer's input, after the reduction) as ``metrics["grad_norm"]``.
      It reads the whole gradient once more: at stage 0, where every
      device holds all of it, each sums the squares of a 1/N slice. With
      ``False`` the step computes no norm, as a plain loop that logs none.
      An optimizer's own ``optax.clip_by_global_norm`` is unaffected.

  Returns:
    A :class:`TrainStep`.

  Example:
    >>> step = zerojax.train_step(loss_fn, tx)
    >>> state, metrics = step(state, batch)
    >>> int(state.step), sorted(metrics)
    (1, ['grad_norm', 'loss'])
  """
  check_options(loss_fn, gather, accum_steps, "zerojax.train_step")
  check_per_device_loss(per_device_loss, "zerojax.train_step")
  if not isinstance(grad_norm, bool):
    raise TypeError(
      f"zerojax.train_step: grad_norm={grad_norm!r} must be "
      f"True (report metrics['grad_norm']) or False."
    )

  def fn(state, batch, arrays, static, sums):
    found = _aux.RowDims()

    def body(state, batch, arrays):
      return _step(
        state,
        batch,
        _update.join_extra_args(arrays, static),
        loss_fn=loss_fn,
        accum_steps=accum_steps,
        gather_mode=gather,
        with_grad_norm=grad_norm,
        found=found,
        sums=sums,
      )

    spec = state.spec
    new, metrics, (reduced, rows) = spec.region(
      body,
      (
        spec.shardings_like(state),
        spec.replicated(),
        (
          spec.replicated(),
          _aux.rows_sharding(spec.tx.mesh, spec.tx.batch_axes),
        ),
      ),
    )(state, batch, arrays)
    if reduced is not None:
      metrics["aux"] = _aux.merge(reduced, rows, found.dims)
    return new, metrics

  jitted = jax.jit(
    fn, donate_argnums=(0,) if donate else (), static_argnums=(3, 4)
  )
  return TrainStep(
    loss_fn=loss_fn,
    tx=tx,
    gather=gather,
    accum_steps=accum_steps,
    _jitted=jitted,
    donate=donate,
    grad_norm=grad_norm,
    per_device_loss=per_device_loss,
  )
