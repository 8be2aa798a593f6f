"""One process of a multi-process test (started by zerojax.launch).

python -m tests.mp_worker train   STAGE OUT        # 5 steps; process 0 saves params
python -m tests.mp_worker save    STAGE DIR        # 3 steps, checkpoint
python -m tests.mp_worker restore STAGE DIR OUT    # restore, save params
python -m tests.mp_worker die     STAGE            # process 1 dies at step 2
python -m tests.mp_worker init    COORD N ID TIMEOUT
python -m tests.mp_worker hsdp    STAGE OUT JSON   # replica=2 across processes
python -m tests.mp_worker zeropp  3 OUT JSON       # ZeRO++, node = process
python -m tests.mp_worker qgz     3 OUT JSON       # qgZ alone, node = process
python -m tests.mp_worker aux     STAGE PREFIX     # per-example aux rows
python -m tests.mp_worker safetensors STAGE DIR OUT # train, export, load back
python -m tests.mp_worker offload 3 OUT DIR       # offloaded settings, checkpoint
"""

import os
import sys
import time

import zerojax
from zerojax import distributed

# qwZ + hpZ (a node = one process's 4 devices) + hierarchical qgZ int4
ZEROPP = zerojax.ZeroPP(weight_bits=8, grad_bits=4, block_size=4, hpz_size=4)
# qgZ int8 alone: hierarchical because the mesh spans two processes
QGZ = zerojax.ZeroPP(grad_bits=8, block_size=4)


def main(mode, *rest):
  if mode == "init":
    coord, n, pid, timeout = rest
    distributed.initialize(coord, int(n), int(pid), timeout_s=int(timeout))
    return
  distributed.initialize()
  import jax
  import numpy as np
  import optax

  from tests import toy
  from zerojax import checkpoint

  stage = int(rest[0])
  params = toy.init_params(jax.random.key(0))
  mesh = zerojax.make_mesh("replica=2,data=4") if mode == "hsdp" else None
  tx = zerojax.zero(
    optax.adamw(1e-2),
    stage=stage,
    mesh=mesh,
    zeropp={"zeropp": ZEROPP, "qgz": QGZ}.get(mode),
  )
  step = zerojax.train_step(toy.loss_fn, tx)
  rows = distributed.local_rows(zerojax.batch_sharding(tx), 32)
  batches = [
    zerojax.shard_batch({k: v[rows] for k, v in b.items()}, tx, 32)
    for b in toy.batches(5, seed=11)
  ]

  def save_params(state, out):
    full = zerojax.gather_params(state)
    if distributed.is_main():
      np.savez(
        out, *[np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(full)]
      )

  def crossing(t):
    """The collectives of ``t``'s train step that span both processes."""
    hlo = (
      zerojax.train_step(toy.loss_fn, t)
      .lower(zerojax.init(params, t), batches[0])
      .compile()
      .as_text()
    )
    return [
      {
        "kind": c.kind,
        "dtype": c.dtype,
        "count": c.count,
        "axes": list(zerojax.diagnostics.collective_axes(c, t.mesh)),
        "groups": [list(g) for g in c.groups],
        "elements": c.total_elements,
        "bytes": c.total_bytes,
      }
      for c in zerojax.diagnostics.collectives(hlo, 8)
      if zerojax.diagnostics.crosses_processes(c, t.mesh)
    ]

  if mode in ("zeropp", "qgz", "hsdp"):
    import json

    state = zerojax.init(params, tx)
    # which collectives cross processes, for this setting and the plain
    # 1-D mesh at the same stage
    table = {
      mode: crossing(tx),
      "plain": crossing(zerojax.zero(optax.adamw(1e-2), stage=stage)),
      "process_of": [d.process_index for d in tx.mesh.devices.reshape(-1)],
      "qgz_node_size": tx.qgz_node_size,
    }
    if mode == "hsdp":
      table["shard_elements"] = sum(
        int(np.prod(r.shard.storage_shape)) // tx.num_shards
        for r in state.spec.leaves
        if r.trainable and r.shard.sharded
      )
      table["replica_is_process"] = all(
        d.process_index == r
        for r in range(2)
        for d in tx.mesh.devices[r].reshape(-1)
      )
    for b in batches:
      state, _ = step(state, b)
    save_params(state, rest[1])
    if distributed.is_main():
      with open(rest[2], "w") as f:
        json.dump(table, f)
  elif mode == "aux":
    import jax.numpy as jnp

    def loss_rows(p, b):
      loss = toy.loss_fn(p, b)
      return loss, {
        "x_rows": b["x"].astype(jnp.float32) * b["w"] * (1 + 0 * loss),
        "rows": jnp.asarray(b["x"].shape[0]),
      }

    state = zerojax.init(params, tx)
    # a scalar batch leaf (the same on both processes), broadcast to the
    # global batch's rows across processes
    state, m = zerojax.train_step(loss_rows, tx)(state, dict(batches[0], w=2.0))
    _, e = zerojax.eval_step(loss_rows, tx, has_aux=True)(
      state, zerojax.shard_batch({"w": np.float32(2.0)}, tx, 32) | batches[1]
    )
    # each process writes the rows its devices hold, keyed by first row
    for name, aux in (("train", m["aux"]), ("eval", e)):
      np.savez(
        f"{rest[1]}_{name}_{jax.process_index()}.npz",
        rows=np.asarray(aux["rows"].addressable_data(0)),
        **{
          str(s.index[0].start or 0): np.asarray(s.data)
          for s in aux["x_rows"].addressable_shards
        },
      )
  elif mode == "safetensors":
    # trained, the files dealt out to both processes (each gathers every
    # leaf), read back by both, each reading its own devices' rows
    state = zerojax.init(params, tx)
    for b in batches:
      state, _ = step(state, b)
    names = lambda path, shape: path
    mine = checkpoint.save_safetensors(
      state, rest[1], mapping=names, max_shard_bytes=64
    )
    shards = [f for f in mine if f.suffix == ".safetensors"]
    assert shards and all(
      (int(f.name[6:11]) - 1) % 2 == jax.process_index() for f in shards
    ), (jax.process_index(), mine)
    back = checkpoint.load_safetensors(
      rest[1], tx, jax.eval_shape(lambda: params), mapping=names
    )
    trained = jax.tree.leaves(zerojax.gather_params(state, master=True))
    loaded = jax.tree.leaves(zerojax.gather_params(back))
    assert all(
      np.array_equal(np.asarray(a.addressable_data(0)), b.addressable_data(0))
      for a, b in zip(trained, loaded)
    )
    save_params(back, rest[2])
  elif mode == "offload":
    # stage 3 with the whole state, half of it, or the whole state and the
    # params' shards in host memory, each beside the same run on the
    # device: the params after
    # five steps, whether they have the same bits, and a checkpoint of the
    # offloaded state saved after three steps and restored on the device
    # (continued for two), against the uninterrupted run
    import json

    settings = {
      "all": dict(offload=True),
      "half": dict(offload=0.5),
      "params": dict(offload=True, offload_params=True),
    }

    def run(kw, stop=None):
      t = zerojax.zero(optax.adamw(1e-2), stage=stage, **kw)
      state = zerojax.init(params, t)
      s = zerojax.train_step(toy.loss_fn, t)
      for b in batches[:stop]:
        state, _ = s(state, b)
      return state

    def full(state):
      return [
        np.asarray(x.addressable_data(0))
        for x in jax.tree.leaves(zerojax.gather_params(state))
      ]

    plain = full(run({}))
    same = {}
    for name, kw in settings.items():
      state = run(kw)
      kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
      same[name] = {
        "bits": all(np.array_equal(a, b) for a, b in zip(full(state), plain)),
        "host": "pinned_host" in kinds,
      }
    with checkpoint.Checkpointer(rest[2]) as ckpt:
      ckpt.save(run(settings["params"], stop=3))
    on_device = zerojax.zero(optax.adamw(1e-2), stage=stage)
    with checkpoint.Checkpointer(rest[2]) as ckpt:
      state, _ = ckpt.restore(params, on_device)
    s = zerojax.train_step(toy.loss_fn, on_device)
    for b in batches[3:]:
      state, _ = s(state, b)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
    same["restored"] = {
      "bits": all(np.array_equal(a, b) for a, b in zip(full(state), plain)),
      "host": "pinned_host" in kinds,
    }
    if distributed.is_main():
      np.savez(rest[1] + ".npz", *plain)
      with open(rest[1] + ".json", "w") as f:
        json.dump(same, f)
  elif mode == "train":
    state = zerojax.init(params, tx)
    for b in batches:
      state, _ = step(state, b)
    save_params(state, rest[1])
  elif mode == "save":
    state = zerojax.init(params, tx)
    for b in batches[:3]:
      state, _ = step(state, b)
    with checkpoint.Checkpointer(rest[1]) as ckpt:
      ckpt.save(state)
  elif mode == "restore":
    with checkpoint.Checkpointer(rest[1]) as ckpt:
      state, _ = ckpt.restore(params, tx)
    save_params(state, rest[2])
  elif mode == "die":
    state = zerojax.init(params, tx)
    for i in range(1000):
      if i == 2 and jax.process_index() == 1:
        print("process 1: dying", flush=True)
        os.kill(os.getpid(), 9)
      if i == 2:
        print(f"process 0: peer dies now; t={time.time():.3f}", flush=True)
      state, m = step(state, batches[i % 5])
      float(m["loss"].addressable_data(0))


if __name__ == "__main__":
  main(*sys.argv[1:])
