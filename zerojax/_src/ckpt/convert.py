"""A checkpoint's saved layout read back and converted: the source spec
from its metadata, the compatibility check (before any array is read), the
arrays' restore targets, and the one jitted conversion to the target
layout (padding sliced off and added, lossless casts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from zerojax._src.ckpt.layout_json import (
  CheckpointError,
  dtype_name,
  layout_from,
)
from zerojax._src.records import layout as _layout
from zerojax._src.records.mesh import named
from zerojax._src.records.policy import Policy
from zerojax._src.records.spec import (
  StateSpec,
  ZeroState,
  is_key_dtype,
  make_spec,
)
from zerojax._src.records.zeropp import ZeroPP


def policy_from(meta) -> Policy:
  pol = meta["policy"]
  get = lambda k: None if pol[k] is None else np.dtype(pol[k])
  return Policy(
    param_dtype=get("param_dtype"),
    master_dtype=get("master_dtype"),
    reduce_dtype=get("reduce_dtype"),
  )


def _saved_tx(tx, **saved):
  """``tx`` with the checkpoint's own stage, mesh and policy (``saved``),
  and none of the target's placement or ZeRO++ options: those describe
  the target alone (where its state lives, how its step communicates),
  not the saved arrays, and some are refused at other stages or meshes
  (``offload_params`` below stage 3, qgZ at stage 0, hpZ on a mesh no
  larger than its partition)."""
  return tx.replace(
    offload=False,
    offload_params=False,
    offload_grads=False,
    zeropp=ZeroPP(),
    **saved,
  )


def source_spec(meta, params_template, tx, where) -> StateSpec:
  """The layout the checkpoint was written in, rebuilt abstractly."""
  paths, leaves = zip(
    *[
      (jax.tree_util.keystr(p), x)
      for p, x in jax.tree_util.tree_flatten_with_path(params_template)[0]
    ]
  )
  saved = {e["path"]: e for e in meta["params"]}
  missing = [p for p in paths if p not in saved]
  extra = [p for p in saved if p not in paths]
  if missing or extra:
    raise CheckpointError(
      f"zerojax checkpoint {where} is of a different model: "
      + (f"leaves {missing} are not in the checkpoint" if missing else "")
      + ("; " if missing and extra else "")
      + (f"the checkpoint has leaves {extra} the model lacks" if extra else "")
      + ". Restore it with the params template of the model that wrote it."
    )
  for p, x in zip(paths, leaves):
    if tuple(saved[p]["shape"]) != tuple(x.shape):
      raise CheckpointError(
        f"zerojax checkpoint {where}: param {p} was saved with shape "
        f"{tuple(saved[p]['shape'])}, the model has {tuple(x.shape)}. "
        f"Restore it with the model config that wrote it."
      )
  avals = jax.tree.unflatten(
    jax.tree.structure(params_template),
    [
      jax.ShapeDtypeStruct(
        tuple(saved[p]["shape"]), np.dtype(saved[p]["dtype"])
      )
      for p in paths
    ],
  )
  if "mesh" not in meta:  # written before meshes had more axes
    mesh = AbstractMesh(
      (meta["n_devices"],), (tx.axis_name,), axis_types=(AxisType.Auto,)
    )
    source_tx = _saved_tx(
      tx,
      stage=meta["stage"],
      mesh=mesh,
      policy=policy_from(meta),
      min_shard_size=meta["min_shard_size"],
    )
    return make_spec(avals, source_tx)
  names = tuple(meta["mesh"])
  mesh = AbstractMesh(
    tuple(meta["mesh"].values()),
    names,
    axis_types=(AxisType.Auto,) * len(names),
  )
  source_tx = _saved_tx(
    tx,
    stage=meta["stage"],
    mesh=mesh,
    policy=policy_from(meta),
    min_shard_size=meta["min_shard_size"],
    axis_name=meta["axis_name"],
    replica_axis=meta["replica_axis"],
    model_specs=None,
  )
  spec = make_spec(avals, source_tx)
  lay = meta["layouts"]
  return spec.with_layouts(
    param=[
      layout_from(e, r.aval.shape) for e, r in zip(lay["param"], spec.leaves)
    ],
    shard=[
      layout_from(e, r.aval.shape) for e, r in zip(lay["shard"], spec.leaves)
    ],
    opt=[
      layout_from(e, o.aval.shape) for e, o in zip(lay["opt"], spec.opt_leaves)
    ],
  )


def check_compatible(meta, source: StateSpec, target: StateSpec, where):
  saved = [
    (e["path"], tuple(e["shape"]), e["dtype"]) for e in meta["opt_state"]
  ]
  have = [
    (tuple(o.aval.shape), dtype_name(o.aval.dtype)) for o in target.opt_leaves
  ]
  if len(saved) != len(have) or any(
    (s[1], s[2]) != h for s, h in zip(saved, have)
  ):
    first = next(
      (s for s, h in zip(saved, have) if (s[1], s[2]) != h),
      saved[len(have)] if len(saved) > len(have) else None,
    )
    raise CheckpointError(
      f"zerojax checkpoint {where}: the optimizer state does not match the "
      f"target optimizer ({len(saved)} saved leaves, {len(have)} now"
      + (f"; first difference at opt_state{first[0]}" if first else "")
      + "). Restore with the optimizer that wrote the checkpoint."
    )
  for s, t in zip(source.leaves, target.leaves):
    if not t.trainable:
      continue
    src, dst = np.dtype(s.master_dtype), np.dtype(t.master_dtype)
    if np.finfo(dst).bits < np.finfo(src).bits:
      raise CheckpointError(
        f"zerojax checkpoint {where}: the saved weights are {src.name}, the "
        f"target policy would keep them in {dst.name} (lossy). Use a policy "
        f"whose master_dtype (or param dtype, with no master) is at least "
        f"{src.name}."
      )


def restore_targets(source: StateSpec, target: StateSpec) -> dict:
  """ShapeDtypeStructs of the saved arrays, with shardings on the target mesh.

  A leaf is read straight into its target sharding when it is stored with
  the same shape in both layouts; otherwise into a sharding of the target
  mesh along the saved sharded dimension if the new device count divides it,
  else replicated, and converted afterwards.
  """
  mesh, axis = target.tx.mesh, target.tx.axis_name
  n = target.tx.num_shards
  src_abs = source.abstract()

  def pick(src_sds, src_layout, dst_layout, dst_dtype):
    shape = src_sds.shape
    if (
      dst_layout is not None
      and shape == dst_layout.storage_shape
      and (np.dtype(src_sds.dtype) == np.dtype(dst_dtype))
    ):
      sharding = target.sharding(dst_layout)
    elif src_layout.sharded and shape[src_layout.dim] % n == 0:
      # the saved dimension over the target's data axis (the saved model
      # axes may not exist here)
      sharding = named(mesh, src_layout.manual_spec(axis), len(shape))
    else:
      sharding = named(mesh, P(), len(shape))
    return jax.ShapeDtypeStruct(shape, src_sds.dtype, sharding=sharding)

  params = [
    pick(s, src.param, dst.param, dst.compute_dtype)
    for s, src, dst in zip(
      jax.tree.leaves(src_abs.params), source.leaves, target.leaves
    )
  ]
  tree = {
    "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=named(mesh, P(), 0)),
    "params": source.unflatten_params(params),
  }
  if src_abs.master is not None:
    keep = target.policy.has_master
    tree["master"] = source.optimizer_view(
      [
        None
        if m is None
        else pick(m, src.shard, dst.shard if keep else None, dst.master_dtype)
        for m, src, dst in zip(
          source.masters(src_abs.master), source.leaves, target.leaves
        )
      ]
    )
  tree["opt_state"] = jax.tree.unflatten(
    source.opt_def,
    [
      key_data_struct(s, mesh)
      if is_key_dtype(s.dtype)
      else pick(s, src.layout, dst.layout, dst.aval.dtype)
      for s, src, dst in zip(
        jax.tree.leaves(src_abs.opt_state), source.opt_leaves, target.opt_leaves
      )
    ],
  )
  return tree


def key_data_struct(key_struct, mesh):
  """Where a typed key's raw data is read: replicated, its data's shape."""
  data = jax.eval_shape(jax.random.key_data, key_struct)
  return jax.ShapeDtypeStruct(
    data.shape, data.dtype, sharding=named(mesh, P(), len(data.shape))
  )


def convert_tree(tree: dict, source: StateSpec, target: StateSpec) -> ZeroState:
  """Saved layout -> target layout (under jit), with :func:`_layout.convert`
  from the most precise saved copy of each param (master, else params)."""
  convert = _layout.convert
  params = jax.tree.leaves(tree["params"])
  master = source.masters(tree.get("master"))
  best = [s.kept(p, m) for p, m, s in zip(params, master, source.leaves)]
  new_params = target.unflatten_params(
    [
      convert(x, layout, t.param, t.compute_dtype)
      for (x, layout), t in zip(best, target.leaves)
    ]
  )
  new_master = None
  if target.policy.has_master:
    new_master = target.optimizer_view(
      [
        convert(x, layout, t.shard, t.master_dtype) if t.trainable else None
        for (x, layout), t in zip(best, target.leaves)
      ]
    )
  opt = [
    convert(x, src.layout, dst.layout)
    for x, src, dst in zip(
      jax.tree.leaves(tree["opt_state"]), source.opt_leaves, target.opt_leaves
    )
  ]
  return ZeroState(
    step=tree["step"],
    params=new_params,
    master=new_master,
    opt_state=jax.tree.unflatten(target.opt_def, opt),
    spec=target,
  )
