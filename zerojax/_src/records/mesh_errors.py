"""JAX's errors from a loss run per device on a mesh, said as what they
mean in a zerojax step and how to fix them."""

from __future__ import annotations

import contextlib
import re

from jax.sharding import Mesh

from zerojax._src.records.mesh import explicit_names


def _restate_a_constraint(msg: str, where: str) -> str | None:
  """What to say for JAX's refusal of a sharding constraint or reshard in
  the loss, where zerojax's batch axes are manual and the mesh's other
  axes Auto; ``None`` for any other error."""
  spec = re.search(r"P\([^)]*\)", msg)
  spec = "" if spec is None else f" {spec.group(0)}"
  per_device = (
    "zerojax runs the loss once per device (jax.shard_map over "
    "the batch axes, each device's value already its own rows), "
    "and the mesh's other axes are Auto there (GSPMD places "
    "them)"
  )
  if (
    "passed to with_sharding_constraint can only refer to Auto axes" in msg
    and "Manual" in msg
  ):
    return (
      f"{where}: the loss constrains a value's sharding over a batch "
      f"axis (jax.lax.with_sharding_constraint with{spec}). "
      f"{per_device}, so a spec cannot name a batch axis. Put None in "
      f"its place (other mesh axes may stay), or drop the constraint: "
      f"the numbers are the same."
    )
  if "passed to reshard cannot contain axis names" in msg and (
    "AxisType.Manual" in msg or "AxisType.Auto" in msg
  ):
    return (
      f"{where}: the loss calls jax.sharding.reshard with{spec}. "
      f"{per_device}, so reshard can name no axis there. Use "
      f"jax.lax.with_sharding_constraint with None in place of the "
      f"batch axes (other mesh axes may stay), or drop it: the numbers "
      f"are the same."
    )
  return None


def types_refused(err: Exception) -> bool:
  """Whether ``err`` is JAX's refusal of a per-device type a plain program
  has no notion of, in code users may not own:

  * a loop (``lax.scan``, ``fori_loop``, ``while_loop``) whose carry
    starts the same on every device -- a constant, such as
    ``jnp.zeros((rows, width))``, a Flax RNN's initial carry or
    ``optax.ctc_loss``'s -- and becomes per-device in the loop;
  * branches (``lax.cond``, ``lax.switch``) of which one returns a
    constant where another returns a per-device value;
  * an output shape given as a ``jax.ShapeDtypeStruct`` that does not say
    how it varies across devices (a Pallas kernel's ``out_shape``)."""
  msg = str(err)
  if isinstance(err, TypeError):
    return ("carry" in msg or "branches" in msg) and (
      "manual axis types do not match" in msg
    )
  return isinstance(err, ValueError) and (
    "manual_axis_type" in msg
    and "ShapeDtypeStruct" in msg
    and "must not be" in msg
  )


def untyped_note(refused: Exception) -> str:
  """What a loss that failed with the per-device types off was run so
  for: JAX's refusal (:func:`types_refused`) and how to keep the types."""
  return (
    f"zerojax ran this loss with JAX's per-device types off "
    f"(jax.shard_map(check_vma=False)) because they refuse it: a loop "
    f"whose carry starts from a constant (jnp.zeros((rows, width))) and "
    f"becomes per-device, a branch returning a constant where another "
    f"returns a per-device value, or an output shape with no "
    f"manual_axis_type (a Pallas kernel's out_shape). Building such "
    f"constants from the batch (jnp.zeros_like(x[:, 0])), or giving the "
    f"shape jax.typeof(x).manual_axis_type, keeps them. JAX said: "
    f"{str(refused).splitlines()[0]}"
  )


@contextlib.contextmanager
def explain_per_device_errors(mesh: Mesh, where: str):
  """JAX's refusals of a loss inside ``jax.shard_map`` (where zerojax runs
  it per device), re-raised saying which function and what to do: a
  closed-over array typed on ``Explicit`` axes, a sharding constraint
  naming a batch axis or a reshard (:func:`_restate_a_constraint`). All
  are raised while tracing, so before any state is donated."""
  try:
    yield
  except ValueError as e:
    msg = str(e)
    said = _restate_a_constraint(msg, where)
    if said is not None:
      raise ValueError(f"{said} JAX said: {msg.splitlines()[0]}") from e
    raise
  except NotImplementedError as e:
    msg = str(e)
    if "Closing over inputs to shard_map" not in msg:
      raise
    got = (
      msg[msg.find("Got input") :].split("\n")[0] if "Got input" in msg else ""
    )
    raise ValueError(
      f"{where}: the loss closes over a jax.Array typed on the mesh's "
      f"Explicit axes {explicit_names(mesh)} ({got.rstrip('.')}). zerojax "
      f"runs the loss per device inside jax.shard_map, and JAX cannot "
      f"close over such arrays there. Pass the array to the loss as part "
      f"of the batch or the model_state, build it inside the loss, or "
      f"keep it as a NumPy array (np.asarray(x)) -- or build the mesh "
      f"with axis_types=jax.sharding.AxisType.Auto."
    ) from e
