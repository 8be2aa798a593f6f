"""``init_from``: a :class:`~zerojax.ZeroState` built by running the
initialiser sharded, so no device holds the full params (stage 3) and at
stages 1-3 each program builds about an eighth of the bytes."""

from __future__ import annotations

import jax
import optax

from zerojax._src.records import layout as _layout
from zerojax._src.records.spec import StateSpec, ZeroState, make_spec
from zerojax._src.step.extras import with_extras
from zerojax._src.step.state import (
  assemble,
  build_group,
  build_plan,
  group_shardings,
)


def init_from(
  init_fn,
  tx: optax.GradientTransformationExtraArgs,
  *args,
  key=None,
  model_state=None,
) -> ZeroState:
  """Builds params with ``init_fn(*args)`` already sharded, then the state.

  Shapes come from ``jax.eval_shape``; then ``jit`` with sharded
  ``out_shardings`` runs ``init_fn`` and lays out params, master weights and
  optimizer state, so no device ever holds the full parameters at stage 3
  (XLA partitions the initialisation), and at stages 1-3 the programs each
  build about an eighth of the bytes (:func:`init_groups`). Use it for
  models larger than a device.

  Args:
    init_fn: a function returning the params pytree, e.g.
      ``lambda k: model.init(k, x)["params"]``.
    tx: a :class:`ZeroTransformation`.
    *args: arguments of ``init_fn`` (e.g. a PRNG key).
    key, model_state: as for :func:`init`.

  Example:
    >>> init_fn = lambda k: {"w": jax.random.normal(k, (16, 8))}
    >>> state = zerojax.init_from(init_fn, tx, jax.random.key(0),
    ...                           key=jax.random.key(1))
    >>> state.params["w"].shape
    (16, 8)
  """
  if not callable(init_fn):
    raise TypeError(
      f"zerojax.init_from: init_fn must be callable, got "
      f"{type(init_fn).__name__}; for a params tree use "
      f"zerojax.init(params, tx)."
    )
  spec = make_spec(jax.eval_shape(init_fn, *args), tx)
  parts = [
    ((group, owned), program(*args))
    for (group, owned), program in init_programs(spec, init_fn)
  ]
  return with_extras(
    assemble(spec, parts), key, model_state, "zerojax.init_from"
  )


def init_programs(spec: StateSpec, init_fn) -> list:
  """``init_from``'s programs: ``((group, owned), jitted)`` per group of
  param leaves, each ``jitted(*args)`` running ``init_fn`` and laying out
  that group's params, master copy (if the policy keeps one) and owned
  optimizer-state leaves (one group for all unless the state is sharded
  or offloaded)."""
  # Sharded or offloaded state: one jit per group of leaves. XLA drops the
  # other leaves' work (their random number generation), so the
  # initialiser's temporaries and the group's master copy and optimizer
  # state exist for one group at a time, never for the whole model at once.
  # Stage 0 replicates everything, so every device ends up holding the whole
  # state and groups bound nothing: one program (the programs' freed
  # buffers otherwise stay in the host allocator's arenas and raise a CPU
  # process's peak RSS), whose initialiser runs split
  # over the data axis (_drawn_split) so no device holds a whole draw's
  # temporaries.
  grouped = spec.place.offload or spec.stage > 0
  split = spec.stage == 0 and not spec.place.offload
  programs = []
  for group, owned in zip(*build_plan(spec, grouped=grouped)):

    def build(*a, group=group, owned=owned):
      leaves = jax.tree.leaves(init_fn(*a))
      if split:
        leaves = [_drawn_split(spec, r, x) for r, x in zip(spec.leaves, leaves)]
      return build_group(
        [spec.leaves[i].shard.to_storage(leaves[i]) for i in group],
        spec,
        group,
        owned,
      )

    outs = group_shardings(spec, group, owned)
    programs.append(
      ((group, owned), jax.jit(spec.region(build, outs), out_shardings=outs))
    )
  return programs


def _drawn_split(spec: StateSpec, record, x):
  """A stage-0 param leaf as ``init_fn`` makes it, split over the data
  axis where a dimension divides evenly: XLA then partitions the
  initialiser and all-gathers the replicated result, so each device draws
  ``1/N`` of the leaf (with ``jax_threefry_partitionable``, JAX's default;
  the values are the same either way), where a replicated initialiser has
  every device draw every leaf, with every device's temporaries live at
  once."""
  layout = _layout.plan_leaf(
    x.shape,
    x.dtype,
    spec.tx.num_shards,
    0,
    stacked=False,
    model=record.shard.model,
    model_sizes=spec.tx.model_axes,
  )
  if not layout.sharded or layout.pad:
    return x
  return record.place.constrain(x, layout)
