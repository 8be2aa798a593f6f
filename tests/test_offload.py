"""Host offload: master copy and optimizer state in ``pinned_host`` memory.

The step brings them into device memory for the update and writes them
back. The numbers must be the same as without offload (the same
operations; the offloaded step is another XLA program, so up to the order
of its float sums, :data:`TERMS`); the arrays must really live in host
memory between steps; checkpoints must move between offloaded and
non-offloaded layouts, bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy
from zerojax import checkpoint

BF16 = zerojax.Policy(param_dtype=jnp.bfloat16)
# the most float terms one result sums in a run of _train: a weight
# gradient adds the batch's 32 rows, over 3 steps
TERMS = 32 * 3
same = lambda a, b: toy.assert_same_up_to_summation_order(a, b, terms=TERMS)


def _train(stage, offload, policy=None, steps=3, optimizer=None):
  tx = zerojax.zero(
    optimizer or optax.adamw(1e-2), stage=stage, offload=offload, policy=policy
  )
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  for b in toy.batches(steps):
    state, metrics = step(state, b)
  return state, metrics


def _leaves(state):
  return [
    np.asarray(x)
    for x in jax.tree.leaves((state.params, state.master, state.opt_state))
  ]


def _kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("policy", [None, BF16], ids=["fp32", "bf16+master"])
def test_offloaded_training_equals_on_device(stage, policy):
  plain, m0 = _train(stage, False, policy)
  off, m1 = _train(stage, True, policy)
  same(_leaves(off), _leaves(plain))
  same(m1["loss"], m0["loss"])


def test_clipping_optimizer_equals_on_device_offloaded():
  opt = lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))
  a = _leaves(_train(3, False, optimizer=opt())[0])
  b = _leaves(_train(3, True, optimizer=opt())[0])
  same(b, a)


@pytest.mark.parametrize("stage", [1, 3])
def test_master_and_opt_state_live_in_host_memory_between_steps(stage):
  state, _ = _train(stage, True, BF16, steps=2)
  assert _kinds(state.master) == {"pinned_host"}
  assert _kinds(state.opt_state) == {"pinned_host"}
  assert _kinds(state.params) == {"device"}
  assert _kinds(state.step) == {"device"}
  # the byte split by memory kind is the master + optimizer state
  by_kind = zerojax.diagnostics.memory_bytes(state)
  rows = zerojax.diagnostics.layout_rows(state)
  host = sum(
    r["bytes_per_device"]
    for r in rows
    if r["section"] in ("master", "opt_state")
  )
  assert by_kind["pinned_host"] == host > 0
  assert by_kind["device"] == sum(
    r["bytes_per_device"] for r in rows if r["section"] == "params"
  )
  assert "in pinned_host memory" in zerojax.diagnostics.layout_table(state)


def test_fresh_state_is_offloaded_on_both_init_paths():
  built = {}
  for off in (False, True):
    tx = zerojax.zero(optax.adam(1e-2), stage=2, offload=off, policy=BF16)
    built[off] = (
      zerojax.init(toy.init_params(jax.random.key(0)), tx),
      zerojax.init_from(toy.init_params, tx, jax.random.key(0)),
    )
  for s in built[True]:
    assert _kinds((s.master, s.opt_state)) == {"pinned_host"}
    assert _kinds(s.params) == {"device"}
  for plain, off in zip(built[False], built[True]):
    for x, y in zip(_leaves(plain), _leaves(off)):
      assert np.array_equal(x, y)


def test_compiled_step_reads_and_writes_state_in_host_memory_space():
  # XLA's own record of where the step's buffers live: the entry layout
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, offload=True, policy=BF16)
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  hlo = step.lower(state, toy.batches(1)[0]).compile().as_text()
  spaces = zerojax.diagnostics.entry_bytes_by_memory(hlo)
  host = zerojax.diagnostics.memory_bytes(state)["pinned_host"]
  assert spaces["arguments"]["pinned_host"] == host
  assert spaces["outputs"]["pinned_host"] == host
  plain = zerojax.zero(optax.adamw(1e-2), stage=3, policy=BF16)
  pstate = zerojax.init(toy.init_params(jax.random.key(0)), plain)
  phlo = (
    zerojax.train_step(toy.loss_fn, plain)
    .lower(pstate, toy.batches(1)[0])
    .compile()
    .as_text()
  )
  assert (
    "pinned_host"
    not in zerojax.diagnostics.entry_bytes_by_memory(phlo)["arguments"]
  )


def test_gathers_eval_and_split_step_work_offloaded():
  plain, _ = _train(3, False, BF16, steps=2)
  off, _ = _train(3, True, BF16, steps=2)
  for f in (
    lambda s: zerojax.gather_params(s, master=True),
    zerojax.gather_opt_state,
  ):
    same(f(off), f(plain))
  batch = toy.batches(1, seed=5)[0]
  ev = lambda s: zerojax.eval_step(toy.loss_fn, s.spec.tx)(s, batch)
  same(ev(off), ev(plain))
  # value_and_grad + apply_gradients, the loop users write themselves
  outs = []
  for s in (plain, off):
    tx = s.spec.tx
    loss, grads = zerojax.value_and_grad(toy.loss_fn, tx)(s, batch)
    new = zerojax.apply_gradients(s, grads)
    outs.append(new)
  assert _kinds((outs[1].master, outs[1].opt_state)) == {"pinned_host"}
  same(_leaves(outs[1]), _leaves(outs[0]))


@pytest.mark.parametrize("save_offloaded", [True, False])
def test_checkpoint_moves_between_offloaded_and_on_device(
  tmp_path, save_offloaded
):
  state, _ = _train(3, save_offloaded, BF16, steps=2)
  params = toy.init_params(jax.random.key(0))
  with checkpoint.Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
    ck.save(state)
    for stage in (1, 3):
      tx = zerojax.zero(
        optax.adamw(1e-2), stage=stage, policy=BF16, offload=not save_offloaded
      )
      restored, _ = ck.restore(params, tx)
      want = "pinned_host" if not save_offloaded else "device"
      assert _kinds((restored.master, restored.opt_state)) == {want}
      for f in (
        lambda s: zerojax.gather_params(s, master=True),
        zerojax.gather_opt_state,
      ):
        for x, y in zip(
          jax.tree.leaves(f(state)), jax.tree.leaves(f(restored))
        ):
          assert np.array_equal(np.asarray(x), np.asarray(y))
      # training goes on from the restored state
      step = zerojax.train_step(toy.loss_fn, tx)
      restored, m = step(restored, toy.batches(1, seed=9)[0])
      assert np.isfinite(float(m["loss"]))


@pytest.mark.parametrize("optimizer", [optax.adamw, optax.lamb])
def test_dropin_offloads_the_optimizer_state(optimizer):
  params = toy.init_params(jax.random.key(0))
  grads = jax.grad(toy.loss_fn, allow_int=True)(params, toy.batches(1)[0])
  outs = []
  for off in (False, True):
    tx = zerojax.zero(optimizer(1e-2), stage=1, offload=off)
    opt = tx.init(params)
    for _ in range(2):
      updates, opt = tx.update(grads, opt, params)
    outs.append((updates, opt))
  assert _kinds(outs[1][1]) == {"pinned_host"}
  same(outs[1], outs[0])


def test_offloaded_update_takes_static_extra_arguments():
  # a callable extra argument is closed over by the streaming check, not
  # traced: the update streams and gives the on-device numbers
  def init(params):
    return optax.EmptyState()

  def update(grads, state, params=None, *, scale_fn, **_):
    return jax.tree.map(lambda g: -0.1 * scale_fn(g), grads), state

  inner = optax.chain(
    optax.GradientTransformationExtraArgs(init, update), optax.scale_by_adam()
  )
  outs = []
  for off in (False, True):
    tx = zerojax.zero(inner, stage=3, offload=off, policy=BF16)
    state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
    loss, grads = zerojax.value_and_grad(toy.loss_fn, tx)(
      state, toy.batches(1)[0]
    )
    outs.append(zerojax.apply_gradients(state, grads, scale_fn=lambda g: 2 * g))
  same(_leaves(outs[1]), _leaves(outs[0]))


def test_offload_flag_is_validated():
  with pytest.raises(TypeError, match="offload"):
    zerojax.zero(optax.adam(1e-3), stage=1, offload="cpu")
  assert "offload=True" in repr(
    zerojax.zero(optax.adam(1e-3), stage=1, offload=True)
  )


def test_state_and_step_must_agree_on_offload():
  params = toy.init_params(jax.random.key(0))
  state = zerojax.init(params, zerojax.zero(optax.adam(1e-2), stage=2))
  step = zerojax.train_step(
    toy.loss_fn, zerojax.zero(optax.adam(1e-2), stage=2, offload=True)
  )
  with pytest.raises(
    ValueError, match="offload: state has False, step has True"
  ):
    step(state, toy.batches(1)[0])


# --- the streamed update and the grouped init (step/offload.py) ----------
OPTIMIZERS = {
  "lamb": lambda: optax.lamb(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
  "lion": lambda: optax.lion(1e-3),
  "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_streamed_update_equals_on_device_for_coupled_optimizers(name):
  # trust ratios, factored moments, sign updates and a conditional update:
  # streamed where exact (MultiSteps' update reads every leaf: whole state)
  a = _leaves(_train(3, False, BF16, optimizer=OPTIMIZERS[name]())[0])
  b = _leaves(_train(3, True, BF16, optimizer=OPTIMIZERS[name]())[0])
  same(b, a)


def _report(optimizer, stage=3):
  tx = zerojax.zero(optimizer, stage=stage, offload=True, policy=BF16)
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  return zerojax.report(step, state, toy.batches(1)[0]), state, step


@pytest.mark.parametrize("name", ["adamw", "clip", "lamb", "adafactor"])
def test_update_streams_in_chunks_with_clipping_lamb_and_adafactor(name):
  opt = {
    "adamw": lambda: optax.adamw(1e-2),
    "clip": lambda: optax.chain(
      optax.clip_by_global_norm(0.1), optax.adamw(1e-2)
    ),
    **OPTIMIZERS,
  }[name]()
  rep, state, step = _report(opt)
  off = rep.offload
  assert off["streamed"] and off["reason"] is None
  assert off["chunks"] > 1 and off["largest_chunk_fraction"] < 0.5
  # each chunk's loads wait for the previous chunk's results: one
  # optimization barrier per chunk boundary, beyond those of the plain step
  batch = toy.batches(1)[0]
  plain_tx = zerojax.zero(opt, stage=3, policy=BF16)
  plain = zerojax.train_step(toy.loss_fn, plain_tx).lower(
    zerojax.init(toy.init_params(jax.random.key(0)), plain_tx), batch
  )
  count = lambda lowered: lowered.as_text().count("optimization_barrier")
  assert count(step.lower(state, batch)) - count(plain) == off["chunks"] - 1
  # the step reads each offloaded buffer down at most once (a leaf the
  # update never reads, e.g. Adafactor's placeholder rows, is not moved)
  # and writes every one back once
  master = sum(
    r["bytes_per_device"]
    for r in zerojax.diagnostics.layout_rows(state)
    if r["section"] == "master"
  )
  assert master < off["host_to_device_bytes"] <= off["theory_streamed_bytes"]
  assert off["device_to_host_bytes"] == off["theory_streamed_bytes"]
  assert "streamed in" in str(rep)
  # the link time each way at the stated bandwidth (default 50 GB/s)
  assert off["link_gb_s"] == 50.0
  assert off["host_to_device_s"] == off["host_to_device_bytes"] / 50e9
  assert off["device_to_host_s"] == off["device_to_host_bytes"] / 50e9
  assert "at 50 GB/s each way" in str(rep)


def test_report_states_the_link_time_at_the_bandwidth_given():
  rep, state, step = _report(optax.adamw(1e-2))
  slow = zerojax.report(step, state, toy.batches(1)[0], link_gb_s=12.5)
  off, half = rep.offload, slow.offload
  assert half["host_to_device_s"] == 4 * off["host_to_device_s"] > 0
  assert half["device_to_host_s"] == 4 * off["device_to_host_s"] > 0
  # XLA CPU has one memory: its schedule holds no host copies to overlap
  assert off["host_copies"] == {} and "host copies in the schedule: 0" in str(
    rep
  )
  with pytest.raises(ValueError, match="link_gb_s=0"):
    zerojax.report(step, state, toy.batches(1)[0], link_gb_s=0)


def test_update_coupled_through_the_state_runs_whole_and_says_why():
  rep, _, _ = _report(OPTIMIZERS["multisteps"]())
  assert not rep.offload["streamed"] and rep.offload["chunks"] == 1
  assert "reads other leaves" in rep.offload["reason"]
  assert "whole state at once" in str(rep)
