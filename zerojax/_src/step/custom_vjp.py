"""A loss's ``jax.custom_vjp`` rules under ``shard_map``: which leaves an
implicit sum can reach (:func:`direct_where_typed`), and JAX's refusal of a
backward rule's per-device types said as a zerojax error with its fix."""

from __future__ import annotations

import re

from zerojax._src.jaxpr import varying as _varying


def direct_where_typed(jaxpr, axes, direct, diff_in) -> list[bool]:
  """``direct`` less the leaves whose implicit sum JAX's types cannot make
  in the traced forward loss ``jaxpr`` (its inputs: ``diff_in``'s arrays).

  Where the loss types a per-device value as the same on every device (a
  callback's result, say), no implicit sum reaches the gradient through
  it: every leaf is reduced explicitly after the backward. A leaf reaching
  a ``jax.custom_vjp`` operand typed the same on every device is, alone:
  the user's backward rule, not autodiff's transpose, makes its
  cotangent (:mod:`zerojax._src.jaxpr.varying`)."""
  if _varying.dropped_varying(jaxpr, axes):
    return [False] * len(direct)
  reach = _varying.custom_vjp_reach(jaxpr, axes)
  if reach is None:
    return [False] * len(direct)
  if len(jaxpr.invars) != sum(x is not None for x in diff_in):
    return [False] * len(direct)
  position = [None] * len(direct)  # jaxpr input of each leaf
  for p, i in enumerate(i for i, x in enumerate(diff_in) if x is not None):
    position[i] = p
  return [d and position[i] not in reach for i, d in enumerate(direct)]


def restate_custom_vjp_types(err: ValueError, axes) -> None:
  """JAX's refusal of a ``custom_vjp`` backward rule whose output's
  per-device type differs from its input's, said as what it means in a
  zerojax step, with the fix for the direction JAX names; other errors
  pass."""
  msg = str(err)
  if not ("Custom VJP bwd rule" in msg and "manual axis types" in msg):
    return
  found = re.search(
    r"output of type (\S+) corresponding to an input of "
    r"type (\S+?),\s+so",
    msg,
  )
  out_varies, in_varies = (
    (None, None)
    if found is None
    else ("{V:" in found.group(1), "{V:" in found.group(2))
  )
  where = (
    f"In a zerojax step the loss runs once per device (jax.shard_map "
    f"over the batch axes {tuple(axes)}), and JAX requires each "
    f"cotangent typed as its input is: per device, or the same on "
    f"every device."
  )
  if in_varies and not out_varies:
    what = (
      "returns a gradient typed the same on every device for an "
      "input that varies per device: a value made by jax.pure_callback "
      "or an FFI call is typed so whatever it holds, and each device's "
      "gradient is its own rows' share until zerojax sums it."
    )
    fix = (
      "type it per device like its input: `g = jax.lax.pcast(g, "
      "tuple(jax.typeof(x).manual_axis_type.varying - "
      "jax.typeof(g).manual_axis_type.varying), to='varying')`"
    )
  elif out_varies and not in_varies:
    what = (
      "returns a per-device gradient for an input every device holds "
      "the same (an array the loss closes over, say): its gradient is "
      "the sum of the devices' shares."
    )
    fix = (
      "sum it over the devices it varies over: `g = jax.lax.psum(g, "
      "tuple(jax.typeof(g).manual_axis_type.varying - "
      "jax.typeof(x).manual_axis_type.varying))`, or return "
      "`jnp.zeros_like(x)` if the input needs no gradient"
    )
  else:
    what = "returns a gradient typed otherwise than its input."
    fix = (
      "type it as its input: jax.lax.pcast(..., to='varying') for an "
      "input that varies per device, jax.lax.psum over the extra axes "
      "for one that does not"
    )
  raise ValueError(
    f"zerojax: a jax.custom_vjp in the loss has a backward rule that "
    f"{what} {where} In the backward rule, for input x and its gradient "
    f"g, {fix} (each a no-op outside a per-device program). JAX said: "
    f"{msg.splitlines()[0]}"
  ) from err
