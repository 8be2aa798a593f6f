"""The GSPMD peers: ZeRO layouts written the way MaxText / Flax NNX users do.

Plain ``jax.jit`` with ``NamedSharding`` on params and optimizer state, no
``shard_map``; XLA's SPMD partitioner chooses the collectives.

* ``fsdp``: params (fp32 master, cast to the compute dtype inside the loss)
  and optimizer state sharded over ``data`` -- the layout of ZeRO-3.
* ``zero1``: params replicated, optimizer state sharded -- ZeRO-1's layout.
* ``dp``: params and optimizer state replicated -- plain data parallelism.
* ``dropin``: the ``zero1`` loop with zerojax's Optax drop-in
  (``zerojax.zero(optimizer, stage=1)``) as its optimizer, the optimizer
  state in the drop-in's own layout.

Each leaf is sharded along its largest dimension that divides the device
count, as hand-written FSDP rules do; leaves with no such dimension are
replicated. The peers are GSPMD code, written for ``Auto`` axes: they run
on an ``Auto`` mesh over the given mesh's devices.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _fsdp_spec(x, n, axis="data"):
  dims = [d for d in range(x.ndim) if x.shape[d] % n == 0]
  if not dims or x.ndim == 0:
    return P()
  d = max(dims, key=lambda d: (x.shape[d], -d))
  return P(*([None] * d + [axis]))


def make_peer(kind, loss_fn, optimizer, params, mesh, compute_dtype=None):
  """Returns ``(step, params, opt_state)`` laid out for the ``kind`` peer."""
  jitted, param_sh, opt_sh, _ = peer_program(
    kind, loss_fn, optimizer, params, mesh, compute_dtype
  )
  # arrays already laid out so are used as they are (no copy; the step
  # donates them), others are resharded
  params = jax.device_put(params, param_sh)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  return jitted, params, opt_state


def peer_program(kind, loss_fn, optimizer, params, mesh, compute_dtype=None):
  """``(jitted step, params shardings, optimizer-state shardings, batch
  sharding)`` of the ``kind`` peer, from params' shapes alone: lower it
  with abstract values (``jax.ShapeDtypeStruct``) for a target whose
  devices this process cannot place data on."""
  mesh = jax.sharding.Mesh(
    mesh.devices,
    mesh.axis_names,
    axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names),
  )
  n = mesh.shape["data"]
  sharded = jax.tree.map(
    lambda x: NamedSharding(mesh, _fsdp_spec(x, n)), params
  )
  rep = jax.tree.map(lambda x: NamedSharding(mesh, P()), params)
  param_sh = sharded if kind == "fsdp" else rep
  if kind == "dropin":
    import zerojax

    optimizer = zerojax.zero(optimizer, stage=1, mesh=mesh)
    typed = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      params,
      rep,
    )
    opt_sh = jax.jit(optimizer.init).lower(typed).compile().output_shardings
  else:
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt_sh = jax.tree.map(
      lambda x: NamedSharding(mesh, P() if kind == "dp" else _fsdp_spec(x, n)),
      opt_shapes,
    )
  batch_sh = NamedSharding(mesh, P("data"))

  def step(params, opt_state, batch):
    def loss(p):
      if compute_dtype is not None:
        p = jax.tree.map(lambda x: x.astype(compute_dtype), p)
      return loss_fn(p, batch)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": value}

  jitted = jax.jit(
    step,
    in_shardings=(param_sh, opt_sh, batch_sh),
    out_shardings=(param_sh, opt_sh, None),
    donate_argnums=(0, 1),
  )
  return jitted, param_sh, opt_sh, batch_sh
