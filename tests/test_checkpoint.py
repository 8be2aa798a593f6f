"""Sharded checkpoints: exact resume, restore across layouts, crash safety."""

import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import zerojax
from tests import toy
from zerojax import checkpoint

ROOT = pathlib.Path(__file__).parents[1]


def _worker(*args):
  proc = subprocess.run(
    [sys.executable, "-m", "tests.ckpt_worker", *map(str, args)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  return proc


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_in_a_new_process_is_bitwise_exact(tmp_path, stage):
  from tests import ckpt_worker

  params, tx, step = ckpt_worker.setup(stage)
  state = zerojax.init(params, tx)
  for b in ckpt_worker.DATA[:5]:
    state, _ = step(state, b)
  straight = [
    np.asarray(x) for x in jax.tree.leaves(zerojax.gather_params(state))
  ]
  first = _worker("first", tmp_path / "ckpt", stage, 2)
  assert first.returncode == 0, first.stderr[-2000:]
  out = tmp_path / "resumed.npz"
  second = _worker("second", tmp_path / "ckpt", stage, 5, out)
  assert second.returncode == 0, second.stderr[-2000:]
  resumed = np.load(out)
  resumed = [resumed[f"arr_{i}"] for i in range(len(resumed.files))]
  assert len(resumed) == len(straight)
  for a, b in zip(resumed, straight):
    assert np.array_equal(a, b)


def _devices(n):
  return zerojax.make_mesh(devices=jax.devices()[:n])


BF16 = zerojax.Policy(param_dtype=jnp.bfloat16)
FP32 = zerojax.Policy()

RESHARDS = {
  "8->4": ((3, 8, BF16), (3, 4, BF16)),
  "4->8": ((3, 4, BF16), (3, 8, BF16)),
  "8->1": ((3, 8, BF16), (3, 1, BF16)),
  "stage 3->1": ((3, 8, BF16), (1, 8, BF16)),
  "stage 1->3": ((1, 8, BF16), (3, 8, BF16)),
  "stage 0->3": ((0, 8, FP32), (3, 8, FP32)),
  "fp32 -> bf16+master": ((2, 8, FP32), (2, 8, BF16)),
  "bf16+master -> fp32": ((3, 8, BF16), (1, 4, FP32)),
}


@pytest.mark.parametrize("name", RESHARDS)
def test_restore_onto_another_layout_round_trips_bitwise(tmp_path, name):
  (s1, n1, p1), (s2, n2, p2) = RESHARDS[name]
  params = toy.init_params(jax.random.key(0))
  opt = optax.adamw(1e-2)
  tx1 = zerojax.zero(opt, stage=s1, mesh=_devices(n1), policy=p1)
  tx2 = zerojax.zero(opt, stage=s2, mesh=_devices(n2), policy=p2)
  state = zerojax.init(params, tx1)
  step = zerojax.train_step(toy.loss_fn, tx1)
  for b in toy.batches(2):
    state, _ = step(state, b)
  with checkpoint.Checkpointer(tmp_path / "a") as ckpt:
    ckpt.save(state)
    ckpt.wait()
    other, _ = ckpt.restore(params, tx2)
  # values identical in the new layout (the most precise copy of each param)
  for a, b in zip(
    jax.tree.leaves(zerojax.gather_params(state, master=True)),
    jax.tree.leaves(zerojax.gather_params(other, master=True)),
  ):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert other.spec.tx == tx2 and int(other.step) == 2
  # and back: every stored array, optimizer moments included, bit for bit
  with checkpoint.Checkpointer(tmp_path / "b") as ckpt:
    ckpt.save(other)
    ckpt.wait()
    back, _ = ckpt.restore(params, tx1)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    assert a.shape == b.shape and a.sharding == b.sharding
    assert np.array_equal(np.asarray(a), np.asarray(b))
  # the restored states train: in the saved layout exactly as the original
  batch = toy.batches(1, seed=7)[0]
  step1 = zerojax.train_step(toy.loss_fn, tx1, donate=False)
  want, want_m = step1(state, batch)
  got, got_m = step1(back, batch)
  chex.assert_trees_all_equal(want, got)
  # and in the new layout, from the same weights (bf16 compute may differ)
  moved, moved_m = zerojax.train_step(toy.loss_fn, tx2)(other, batch)
  assert int(moved.step) == 3
  np.testing.assert_allclose(
    float(moved_m["loss"]), float(want_m["loss"]), rtol=2e-2
  )


def test_keep_last_k_and_save_every(tmp_path):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.sgd(0.1), stage=1)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  with checkpoint.Checkpointer(tmp_path, save_every=2, keep=2) as ckpt:
    saved = []
    for b in toy.batches(6):
      state, _ = step(state, b)
      saved.append(ckpt.save(state))
    ckpt.wait()
    # Orbax always saves the first step of a run with no checkpoint yet
    assert saved == [True, True, False, True, False, True]
    assert ckpt.all_steps() == [4, 6]


def test_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
  proc = _worker("crash", tmp_path)
  assert proc.returncode == -9  # SIGKILL
  ckpt = checkpoint.Checkpointer(tmp_path)
  assert ckpt.all_steps() == [0]  # the partial step 1 is not listed
  tx = zerojax.zero(optax.adam(1e-3), stage=1)
  state, _ = ckpt.restore(
    {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}, tx
  )
  assert int(state.step) == 0 and float(state.params["w"][0, 0]) == 1.0


def _saved(tmp_path):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.adamw(1e-2), stage=3)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(zerojax.init(params, tx))
  return params, tx


def test_checkpoint_of_another_model(tmp_path):
  params, tx = _saved(tmp_path)
  ckpt = checkpoint.Checkpointer(tmp_path)
  missing = {k: v for k, v in params.items() if k != "head"}
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r"has leaves \[\"\['head'\]\"\] the model lacks",
  ):
    ckpt.restore(missing, tx)
  changed = dict(params, head=jnp.zeros((7, 6)))
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r"param \['head'\] was saved with shape \(7, 5\), "
    r"the model has \(7, 6\)",
  ):
    ckpt.restore(changed, tx)
  with pytest.raises(
    checkpoint.CheckpointError, match="optimizer state does not match"
  ):
    ckpt.restore(params, zerojax.zero(optax.sgd(0.1, momentum=0.9), stage=3))


def test_directory_without_checkpoint(tmp_path):
  with pytest.raises(
    FileNotFoundError, match="no checkpoint in .* start without --resume"
  ):
    checkpoint.Checkpointer(tmp_path / "empty").restore({}, None)


def test_corrupted_checkpoint(tmp_path):
  params, tx = _saved(tmp_path)
  victims = [
    p
    for p in (tmp_path / "0").rglob("*")
    if p.is_file() and p.stat().st_size > 100 and "meta" not in str(p)
  ]
  assert victims
  for p in victims:
    p.write_bytes(b"\0garbage" * 10)
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r"could not be read .* restore an earlier step",
  ):
    checkpoint.Checkpointer(tmp_path).restore(params, tx)


def test_export_full_precision_params(tmp_path):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, policy=BF16)
  state = zerojax.init(params, tx)
  state, _ = zerojax.train_step(toy.loss_fn, tx)(state, toy.batches(1)[0])
  full = checkpoint.export_params(state, tmp_path / "export")
  master = zerojax.gather_params(state, master=True)
  assert full["embed"].dtype == np.float32 and full["embed"].shape == (13, 7)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(master)):
    assert isinstance(a, np.ndarray) and np.array_equal(a, np.asarray(b))
  # loads with plain Orbax, no zerojax involved
  loaded = ocp.StandardCheckpointer().restore(tmp_path / "export")
  assert np.array_equal(np.asarray(loaded["layers"]["w"]), full["layers"]["w"])


def test_a_checkpoint_written_before_the_records_redesign_restores(tmp_path):
  """tests/data/ckpt_before_records was written by zerojax at commit 7831a1e
  (StateSpec as parallel tuples): stage 2, bf16 params + fp32 master,
  AdamW, uneven leaves, 3 steps. Today's code reads it bitwise at other
  stages, and describes the same layout in the same metadata."""
  import shutil

  data = ROOT / "tests" / "data" / "ckpt_before_records"
  shutil.copytree(data / "ckpt", tmp_path / "ckpt")  # Orbax may write beside
  expected = np.load(data / "expected.npz")
  params = {
    "w": jax.ShapeDtypeStruct((13, 7), jnp.float32),
    "b": jax.ShapeDtypeStruct((5,), jnp.float32),
    "layers": {"k": jax.ShapeDtypeStruct((3, 10, 4), jnp.float32)},
  }
  bf16 = zerojax.Policy(param_dtype=jnp.bfloat16)
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
    meta = ckpt.metadata()
    same = zerojax.zero(optax.adamw(1e-2), stage=2, policy=bf16)
    fresh = checkpoint.describe(zerojax.layout.make_spec(params, same))
    assert {k: meta[k] for k in fresh} == fresh  # the on-disk format
    for stage in (1, 3):
      tx = zerojax.zero(optax.adamw(1e-2), stage=stage, policy=bf16)
      state, extra = ckpt.restore(params, tx)
      assert extra == {"data_step": 3} and int(state.step) == 3
      got = {
        f"master{jax.tree_util.keystr(p)}": np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(
          zerojax.gather_params(state, master=True)
        )[0]
      }
      got.update(
        {
          f"opt{jax.tree_util.keystr(p)}": np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(
            zerojax.gather_opt_state(state)
          )[0]
        }
      )
      assert sorted(got) == sorted(expected.files)
      for name in expected.files:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.parametrize(
  "write,read",
  [
    (dict(compression=False, replica_parallel=False), {}),
    ({}, dict(compression=False, replica_parallel=False)),
  ],
)
def test_lean_save_options_read_back_bitwise_either_way(tmp_path, write, read):
  """``compression`` and ``replica_parallel`` change only how arrays are
  written (their host-memory cost is measured in docs/results.md): a
  stage-2 state, whose params are replicated, written with one setting
  comes back bit for bit through a Checkpointer with the other."""
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.adamw(1e-2), stage=2, policy=BF16)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  for b in toy.batches(2):
    state, _ = step(state, b)
  with checkpoint.Checkpointer(tmp_path, async_save=False, **write) as ckpt:
    ckpt.save(state)
  with checkpoint.Checkpointer(tmp_path, **read) as ckpt:
    back, _ = ckpt.restore(params, tx)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    assert a.shape == b.shape and a.sharding == b.sharding
    assert np.array_equal(np.asarray(a), np.asarray(b))


# target options that only some stages or meshes accept: the checkpoint's
# own stage and mesh may not (offload_params needs stage 3, offload_grads
# stage 2-3 with offload=True, qgZ a stage above 0, hpZ a mesh larger
# than its partition)
STAGE_BOUND_TARGETS = {
  "offload_params": dict(stage=3, offload_params=True),
  "offload_grads": dict(stage=3, offload=True, offload_grads=True),
  "qgZ": dict(stage=2, zeropp=zerojax.ZeroPP(grad_bits=8)),
  "hpZ": dict(stage=3, zeropp=zerojax.ZeroPP(hpz_size=4)),
}


@pytest.mark.parametrize("target", STAGE_BOUND_TARGETS)
@pytest.mark.parametrize("saved", [(0, 8), (1, 4)])
def test_restore_into_options_the_saved_stage_does_not_take(
  tmp_path, saved, target
):
  """A stage-0 checkpoint of 8 devices, or a stage-1 one of 4, restores
  into a target whose options the saved stage or mesh would refuse: the
  saved layout is read as saved, the target's options apply to the
  target alone."""
  stage, n = saved
  params = toy.init_params(jax.random.key(0))
  opt = optax.adamw(1e-2)
  tx1 = zerojax.zero(opt, stage=stage, mesh=_devices(n), policy=BF16)
  state = zerojax.init(params, tx1)
  state, _ = zerojax.train_step(toy.loss_fn, tx1)(state, toy.batches(1)[0])
  tx2 = zerojax.zero(opt, policy=BF16, **STAGE_BOUND_TARGETS[target])
  with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(state)
    restored, _ = ckpt.restore(params, tx2)
  assert restored.spec.tx == tx2
  chex.assert_trees_all_equal(
    zerojax.gather_params(restored, master=True),
    zerojax.gather_params(state, master=True),
  )
  chex.assert_trees_all_equal(
    zerojax.gather_opt_state(restored), zerojax.gather_opt_state(state)
  )
  _, m = zerojax.train_step(toy.loss_fn, tx2)(restored, toy.batches(1)[0])
  assert np.isfinite(float(m["loss"]))
