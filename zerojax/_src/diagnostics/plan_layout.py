"""The layouts a plan prices (:func:`plan_spec`): a user's ``zerojax.zero``
transformation as built, or ``zerojax.zero``'s on an abstract mesh of the
axis sizes asked, as the records :func:`zerojax.layout.make_spec` builds
from abstract params. :func:`~zerojax._src.diagnostics.planner.plan_stage`
prices them; nothing is allocated."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, AxisType

from zerojax._src.records.config import ZeroConfig
from zerojax._src.records.policy import Policy
from zerojax._src.records.spec import make_spec
from zerojax._src.step.transform import zero

# the optimizer a plan prices unless given one: one object, so the plans
# of one model's shares stream one update, traced once
# (:mod:`zerojax._src.step.offload_trace`)
_DEFAULT_OPTIMIZER = optax.adamw(1e-4)


def plan_spec(
  abstract_params,
  stage: int | None = None,
  n_devices: int | None = None,
  *,
  tx=None,
  mesh: dict | None = None,
  optimizer=None,
  policy: Policy | None = None,
  model_specs=None,
  stacked=None,
  offload: bool | float | None = None,
  offload_params: bool | None = None,
  offload_grads: bool | None = None,
):
  """The records :func:`plan_stage` prices: ``tx``'s layouts (with the
  placement arguments given changing its own), or ``zerojax.zero``'s on an
  abstract mesh of ``mesh``'s axis sizes (AdamW and bf16 params with an
  fp32 master copy by default)."""
  placement = dict(
    offload=offload, offload_params=offload_params, offload_grads=offload_grads
  )
  if tx is not None:
    layout = dict(
      n_devices=n_devices,
      mesh=mesh,
      optimizer=optimizer,
      policy=policy,
      model_specs=model_specs,
      stacked=stacked,
    )
    return make_spec(abstract_params, _tx_to_plan(tx, stage, layout, placement))
  if stage is None:
    raise TypeError(
      "plan_stage: give the stage to plan (0-3), or tx= (a "
      "zerojax.zero(...) transformation, whose stage, mesh, optimizer "
      "and policy the plan takes)."
    )
  offload = False if offload is None else offload
  offload_params = False if offload_params is None else offload_params
  offload_grads = False if offload_grads is None else offload_grads
  mesh = mesh_sizes(n_devices, mesh)
  amesh = AbstractMesh(
    tuple(mesh.values()), tuple(mesh), axis_types=(AxisType.Auto,) * len(mesh)
  )
  optimizer = _DEFAULT_OPTIMIZER if optimizer is None else optimizer
  policy = Policy(param_dtype=jnp.bfloat16) if policy is None else policy
  tp = mesh.get("model", 1) > 1
  if tp and model_specs is None:
    raise ValueError(
      f"plan_stage: the mesh has a model axis of {mesh['model']} but no "
      f"model_specs; pass model_specs= (a tree of PartitionSpec for the "
      f"params, as zerojax.zero takes) so the planner knows which leaves "
      f"the model axis splits."
    )
  tx = zero(
    optimizer,
    stage=stage,
    mesh=amesh,
    policy=policy,
    model_specs=model_specs if tp else None,
    stacked=stacked,
    offload=offload,
    offload_params=offload_params,
    offload_grads=offload_grads,
  )
  return make_spec(abstract_params, tx)


def _tx_to_plan(tx, stage, layout: dict, placement: dict):
  """``tx`` with the placement arguments given (``offload``, ...) in place
  of its own; a layout argument it already fixes, or another stage, is
  refused by name."""
  config = getattr(tx, "config", None)
  if not isinstance(config, ZeroConfig):
    raise TypeError(
      f"plan_stage(tx=...): got {type(tx).__name__}; pass "
      f"the transformation zerojax.zero(...) returns."
    )
  given = [k for k, v in layout.items() if v is not None]
  if given:
    raise TypeError(
      f"plan_stage(tx=...): the transformation already sets "
      f"{', '.join(given)}; drop {'it' if len(given) == 1 else 'them'}, or "
      f"plan without tx= to try another layout."
    )
  if stage is not None and stage != config.stage:
    raise ValueError(
      f"plan_stage: stage={stage} but tx is stage {config.stage}; drop "
      f"stage= (the plan takes tx's), or pass tx.replace(stage={stage})."
    )
  changes = {k: v for k, v in placement.items() if v is not None}
  try:
    return tx.replace(**changes) if changes else tx
  except (TypeError, ValueError) as e:
    given = ", ".join(f"{k}={v!r}" for k, v in changes.items())
    raise type(e)(f"plan_stage(tx=..., {given}): {e}") from e


def mesh_sizes(n_devices, mesh) -> dict:
  """The axis sizes to plan on: ``mesh``, else a data axis of
  ``n_devices``; each a whole number of devices, at least 1."""
  if mesh is None and n_devices is None:
    raise TypeError(
      "plan_stage: give n_devices= (a 1-D data axis, e.g. n_devices=8) or "
      "mesh= (axis sizes, e.g. mesh={'data': 8, 'model': 2}), or tx=."
    )
  given = "n_devices" if mesh is None else "mesh"
  sizes = {"data": n_devices} if mesh is None else dict(mesh)
  bad = {
    k: v
    for k, v in sizes.items()
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1
  }
  if bad:
    raise ValueError(
      f"plan_stage: {given}={n_devices if mesh is None else mesh!r}: "
      f"axis sizes are whole numbers of devices, at least 1 (got "
      f"{', '.join(f'{k}={v!r}' for k, v in bad.items())})."
    )
  return {k: int(v) for k, v in sizes.items()}
