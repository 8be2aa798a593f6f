"""Host offload: master copy and optimizer state in ``pinned_host`` memory.

The step brings them into device memory for the update and writes them
back. The numbers must be the same as without offload (the same
operations; the offloaded step is another XLA program, so up to the order
of its float sums, :data:`TERMS`); the arrays must really live in host
memory between steps; checkpoints must move between offloaded and
non-offloaded layouts, bit for bit.
"""

import dataclasses
import functools
import math
import re
import warnings

import chex
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


def _train(stage, offload, policy=None, steps=3, optimizer=None, **kw):
  tx = zerojax.zero(
    optimizer or optax.adamw(1e-2),
    stage=stage,
    offload=offload,
    policy=policy,
    **kw,
  )
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  for b in toy.batches(steps):
    state, metrics = step(state, b)
  return state, metrics


def _leaves(state):
  """The state's leaves as NumPy arrays (a PRNG key as its key data)."""
  key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  return [
    np.asarray(jax.random.key_data(x) if key(x) else x)
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


KINDS = {
  True: {"pinned_host"},
  False: {"device"},
  0.5: {"pinned_host", "device"},
}


@pytest.mark.parametrize(
  "saved,restored_as", [(True, False), (False, True), (0.5, True), (False, 0.5)]
)
def test_checkpoint_moves_between_offloaded_and_on_device(
  tmp_path, saved, restored_as
):
  state, _ = _train(3, saved, BF16, steps=2)
  params = toy.init_params(jax.random.key(0))
  with checkpoint.Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
    ck.save(state)
    for stage in (1, 3):
      tx = zerojax.zero(
        optax.adamw(1e-2), stage=stage, policy=BF16, offload=restored_as
      )
      restored, _ = ck.restore(params, tx)
      assert _kinds((restored.master, restored.opt_state)) == KINDS[restored_as]
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
  for off in (False, True, 0.5):
    tx = zerojax.zero(optimizer(1e-2), stage=1, offload=off)
    opt = tx.init(params)
    for _ in range(2):
      updates, opt = tx.update(grads, opt, params)
    outs.append((updates, opt))
    assert _kinds(opt) == KINDS[off]
  same(outs[1], outs[0])
  chex.assert_trees_all_equal(outs[2], outs[0])


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
  for bad, error in (
    ("cpu", TypeError),
    (1, TypeError),
    (1.5, ValueError),
    (-0.1, ValueError),
    (float("nan"), ValueError),
  ):
    with pytest.raises(error, match=f"offload={bad!r}.*fraction"):
      zerojax.zero(optax.adam(1e-3), stage=1, offload=bad)
  # NumPy's bools and floats are the same settings as Python's
  for given, plain in ((np.True_, True), (np.float32(0.25), 0.25)):
    tx = zerojax.zero(optax.adam(1e-3), stage=1, offload=given)
    assert type(tx.offload) is type(plain) and tx.offload == plain
    assert f"offload={plain!r}" in repr(tx)
  tx = zerojax.zero(optax.adam(1e-3), stage=3, offload_params=np.True_)
  assert tx.config.offload_params is True
  assert "offload=True" in repr(
    zerojax.zero(optax.adam(1e-3), stage=1, offload=True)
  )
  assert "offload=0.25" in repr(
    zerojax.zero(optax.adam(1e-3), stage=1, offload=0.25)
  )


# --- partial offload: whole arrays up to a fraction of the bytes ----------
PARTIAL_OPTIMIZERS = {
  "adamw": lambda: optax.adamw(1e-2),
  "clip+adamw": lambda: optax.chain(
    optax.clip_by_global_norm(0.1), optax.adamw(1e-2)
  ),
  "lamb": lambda: optax.lamb(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}


# stage 2 lays the state out as stage 1 does (only the gradients' reduction
# differs): its cases run in the slow suite, stages 1 and 3 in the default
STAGES = [1, pytest.param(2, marks=pytest.mark.slow), 3]


@pytest.mark.parametrize("name", sorted(PARTIAL_OPTIMIZERS))
@pytest.mark.parametrize("stage", STAGES)
def test_partial_and_full_offload_equal_no_offload_bitwise(stage, name):
  """Offloading is a placement, not another computation: on XLA CPU the
  state after three steps has the same bits with none, half or all of
  it in host memory, for coupled updates (global-norm clipping, trust
  ratios, factored moments) too."""
  opt = PARTIAL_OPTIMIZERS[name]
  plain = _leaves(_train(stage, False, BF16, optimizer=opt())[0])
  for off in (0.5, True):
    state, _ = _train(stage, off, BF16, optimizer=opt())
    assert _kinds(state.master) == KINDS[off]
    chex.assert_trees_all_equal(_leaves(state), plain)


def _arrays_by_leaf(state):
  """``{param path: {"master" | moment name: memory kind}}`` for the
  state's master copy and the optimizer leaves each param owns."""
  rows = zerojax.diagnostics.layout_rows(state)
  out = {
    r["path"].removeprefix("params"): {}
    for r in rows
    if r["section"] == "params"
  }
  for r in rows:
    if r["section"] == "master":
      out[r["path"].removeprefix("master")]["master"] = r["memory"]
    if r["section"] == "opt_state":
      for leaf, kinds in out.items():
        if r["path"].endswith(leaf):
          kinds[r["category"].removeprefix("opt_state.")] = r["memory"]
  return out


def _largest_then_smallest(sizes, fraction):
  """The items of ``sizes`` taken largest first while below ``fraction``
  of their total, then the smallest one left that reaches it."""
  target = fraction * sum(sizes)
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  held, k = 0, 0
  while k < len(order) and held + sizes[order[k]] < target:
    held += sizes[order[k]]
    k += 1
  rest = [i for i in order[k:] if held + sizes[i] >= target]
  return {
    *order[:k],
    *([min(rest, key=lambda i: (sizes[i], i))] if rest else []),
  }


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.9])
def test_partial_offload_keeps_the_fewer_bytes_of_arrays_or_whole_leaves(
  fraction,
):
  """The share is met twice, with whole arrays (a leaf's master copy,
  each of its moments) and with whole leaves (its arrays together), each
  largest first while below the share, then the smallest that reaches
  it; host memory gets whichever holds fewer bytes (whole leaves on a
  tie), never more than largest first all the way; the step count goes
  with them."""
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, offload=fraction, policy=BF16)
  params = toy.init_params(jax.random.key(0))
  state = zerojax.init(params, tx)
  rows = [
    r
    for r in zerojax.diagnostics.layout_rows(state)
    if r["section"] in ("master", "opt_state")
    and r["category"] != "opt_state.count"
  ]
  leaves = [
    r["path"].removeprefix("master") for r in rows if r["section"] == "master"
  ]
  leaf_of = [
    max((p for p in leaves if r["path"].endswith(p)), key=len) for r in rows
  ]
  # every array is fp32: bytes go as its logical size
  sizes = [math.prod(r["shape"]) for r in rows]
  on_host = {i for i, r in enumerate(rows) if r["memory"] == "pinned_host"}
  by_array = _largest_then_smallest(sizes, fraction)
  whole = [sum(n for n, g in zip(sizes, leaf_of) if g == p) for p in leaves]
  by_leaf = {
    i
    for i, g in enumerate(leaf_of)
    if leaves.index(g) in _largest_then_smallest(whole, fraction)
  }
  held = lambda chosen: sum(sizes[i] for i in chosen)
  assert on_host == (by_leaf if held(by_leaf) <= held(by_array) else by_array)
  total = sum(sizes)
  assert fraction * total <= held(on_host) <= min(held(by_leaf), held(by_array))
  largest_first = 0  # largest first until the share is reached
  for n in sorted(sizes, reverse=True):
    if largest_first >= fraction * total:
      break
    largest_first += n
  assert held(on_host) <= largest_first
  share = zerojax.report(
    zerojax.train_step(toy.loss_fn, tx), state, toy.batches(1)[0]
  ).offload["host_fraction"]
  assert share == pytest.approx(held(on_host) / total)
  assert state.opt_state[0].count.sharding.memory_kind == "pinned_host"


def test_a_small_share_is_met_by_a_smaller_array_than_the_largest():
  """A share below the largest array's goes to the smallest array that
  reaches it (the head's master copy, its leaf the third largest), not
  to the largest, and the planner prices the same placement."""
  params = toy.init_params(jax.random.key(0))
  trained = {
    jax.tree_util.keystr(k): x.size
    for k, x in jax.tree_util.tree_flatten_with_path(params)[0]
    if jnp.issubdtype(x.dtype, jnp.floating)
  }
  assert sorted(trained.values(), reverse=True).index(trained["['head']"]) == 2
  # AdamW: a master copy and two moments per element, each an array
  fraction = trained["['head']"] / (3 * sum(trained.values()))
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, offload=fraction, policy=BF16)
  state = zerojax.init(params, tx)
  on_host = [
    (leaf, name)
    for leaf, kinds in _arrays_by_leaf(state).items()
    for name, kind in kinds.items()
    if kind == "pinned_host"
  ]
  assert on_host == [("['head']", "master")]
  plan = zerojax.cost.plan_stage(
    jax.eval_shape(lambda: params),
    3,
    tx.num_shards,
    policy=BF16,
    offload=fraction,
  )
  assert plan.host == zerojax.diagnostics.memory_bytes(state)["pinned_host"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(
  "name,policy,fraction",
  [
    ("adamw", BF16, 0.2),  # masters of two leaves on the host, moments not
    ("clip+adamw", BF16, 0.15),  # a stack's master alone
    ("adamw", None, 0.2),  # no master: a stack's first moment alone
    ("adafactor", BF16, 0.4),  # a stack's master, its factored moments not
  ],
  ids=["adamw-masters", "clip-stack", "fp32-mu", "adafactor-factors"],
)
def test_a_leafs_master_copy_and_moments_in_different_memories_train_bitwise(
  stage, name, policy, fraction
):
  """A share met with single arrays puts a leaf's master copy and its
  optimizer leaves in different memories; the streamed update brings
  down what is on the host and updates the rest in place: the same bits
  as no offload after three steps."""
  opt = PARTIAL_OPTIMIZERS[name]
  plain = _leaves(_train(stage, False, policy, optimizer=opt())[0])
  state, _ = _train(stage, fraction, policy, optimizer=opt())
  # some leaf's arrays (without a master copy: its moments) lie apart
  split = [
    leaf
    for leaf, kinds in _arrays_by_leaf(state).items()
    if len(set(kinds.values())) > 1
  ]
  assert split, _arrays_by_leaf(state)
  chex.assert_trees_all_equal(_leaves(state), plain)


def test_a_share_reached_far_above_the_one_asked_warns_with_the_share_below():
  """A model whose one stack holds most of the bytes reaches no share
  between its head's (5.8%) and one of the stack's arrays (a third
  of the state), by arrays or by whole leaves: asking 0.1 keeps 30.9% on
  the host and warns, naming the nearest share below; a share met within
  10 points does not warn, nor does the share named, which is reached
  exactly."""
  params = {
    "stack": jnp.ones((4, 16, 16)),
    "bias": jnp.ones((16,)),
    "head": jnp.ones((16, 4)),
  }
  sizes = {"stack": 1024, "bias": 16, "head": 64}
  total = 3 * sum(sizes.values())  # a master copy and two moments each
  tx = zerojax.zero(optax.adamw(1e-2), stage=1, offload=0.1, policy=BF16)
  with pytest.warns(UserWarning, match=r"offload=0.1 keeps 30.9%") as got:
    state = zerojax.init(params, tx)
  [msg] = [str(w.message) for w in got if "keeps" in str(w.message)]
  named = re.search(r"offload=([0-9.]+) keeps ([0-9.]+)%", msg.split("(", 1)[1])
  assert named, msg
  assert float(named[1]) < 0.1
  assert float(named[2]) == pytest.approx(100 * 3 * 64 / total, abs=0.05)
  assert _arrays_host_share(state) == pytest.approx(1024 / total)

  def loss(p, x):
    h = jnp.tanh(jnp.einsum("bi,lij->bj", x, p["stack"]) + p["bias"][None, :])
    return jnp.mean(h @ p["head"])

  step = zerojax.train_step(loss, tx)
  text = str(zerojax.report(step, state, jnp.ones((8, 16))))
  want = "30.9% of master + optimizer state on the host (offload=0.1 asked"
  assert want in text
  for share, reached in (
    (float(named[1]), float(named[2]) / 100),
    (0.3, 1024 / total),
  ):
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      other = zerojax.zero(
        optax.adamw(1e-2), stage=1, offload=share, policy=BF16
      )
      other_state = zerojax.init(params, other)
    assert not [w for w in seen if "keeps" in str(w.message)]
    assert _arrays_host_share(other_state) == pytest.approx(reached, abs=1e-3)


def _arrays_host_share(state):
  """The share of the master copy's and moments' elements on the host."""
  rows = [
    r
    for r in zerojax.diagnostics.layout_rows(state)
    if r["section"] in ("master", "opt_state") and r["shape"]
  ]
  n = lambda r: math.prod(r["shape"])
  return sum(n(r) for r in rows if r["memory"] == "pinned_host") / sum(
    n(r) for r in rows
  )


def _host_share(state):
  """The share of the state's master copy + optimizer bytes on the host."""
  return zerojax.report(
    zerojax.train_step(toy.loss_fn, state.spec.tx), state, toy.batches(1)[0]
  ).offload["host_fraction"]


def test_host_bytes_per_step_in_the_compiled_program_equal_the_planners():
  """The planner's host figures for a fraction are the bytes the compiled
  step really reads down and writes back, and what the state holds."""
  params = toy.init_params(jax.random.key(0))
  abstract = jax.eval_shape(lambda: params)
  for off in (0.5, True):
    tx = zerojax.zero(optax.adamw(1e-2), stage=3, offload=off, policy=BF16)
    state = zerojax.init(params, tx)
    rep = zerojax.report(
      zerojax.train_step(toy.loss_fn, tx), state, toy.batches(1)[0]
    )
    plan = zerojax.cost.plan_stage(
      abstract, 3, tx.num_shards, policy=BF16, offload=off
    )
    held = zerojax.diagnostics.memory_bytes(state)["pinned_host"]
    assert plan.host == held == rep.offload["device_to_host_bytes"] > 0
    assert plan.host_traffic == (
      rep.offload["host_to_device_bytes"] + rep.offload["device_to_host_bytes"]
    )
    assert plan.device == pytest.approx(
      plan.total - plan.host + plan.update_transient
    )


def test_planner_names_the_least_fraction_a_device_needs():
  abstract = jax.eval_shape(lambda: toy.init_params(jax.random.key(0)))
  kw = dict(policy=BF16)
  plan = lambda f: zerojax.cost.plan_stage(abstract, 1, 8, offload=f, **kw)
  need = lambda mem: zerojax.cost.offload_fraction_needed(
    abstract, 1, mem, 8, **kw
  )
  none, full = plan(False), plan(True)
  assert full.device < none.device
  assert need(none.working_set) == 0.0
  assert need(full.device - 1) is None
  f = need((none.device + full.device) / 2)
  assert 0.0 < f < 1.0
  # micro-batches change the host traffic, not the device's bytes
  assert (
    zerojax.cost.offload_fraction_needed(
      abstract, 1, (none.device + full.device) / 2, 8, accum_steps=4, **kw
    )
    == f
  )
  assert plan(f).device <= (none.device + full.device) / 2
  # every fraction that offloads fewer bytes does not fit
  smaller = [
    p
    for p in map(plan, (i / 10 for i in range(1, 10)))
    if p.host < plan(f).host
  ]
  assert smaller
  assert all(p.device > (none.device + full.device) / 2 for p in smaller)


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
  # trust ratios, factored moments, sign updates and a branch over the
  # whole state (MultiSteps), each leaf's outputs cut to its own
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
  # each chunk's loads wait for the stored results of the chunk before it
  # or, prefetched, of the one before that: one optimization barrier per
  # chunk, beyond those of the plain step
  batch = toy.batches(1)[0]
  plain_tx = zerojax.zero(opt, stage=3, policy=BF16)
  plain = zerojax.train_step(toy.loss_fn, plain_tx).lower(
    zerojax.init(toy.init_params(jax.random.key(0)), plain_tx), batch
  )
  count = lambda lowered: lowered.as_text().count("optimization_barrier")
  # (none for the first chunk, nor for a second prefetched beside it)
  barriers = count(step.lower(state, batch)) - count(plain)
  assert barriers in (off["chunks"] - 1, off["chunks"] - 2)
  assert 0 < off["prefetched"] < off["chunks"]
  # the step reads each offloaded buffer down at most once (a leaf the
  # update never reads, e.g. Adafactor's placeholder rows, is not moved)
  # and writes every one back once
  master = sum(
    r["bytes_per_device"]
    for r in zerojax.diagnostics.layout_rows(state)
    if r["section"] == "master"
  )
  assert master < off["host_to_device_bytes"]
  assert off["host_to_device_bytes"] <= off["theory_host_to_device_bytes"]
  assert off["device_to_host_bytes"] == off["theory_device_to_host_bytes"]
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
  # XLA CPU has one memory: its schedule holds no host copies to overlap,
  # and none moves while no loop runs
  assert off["host_copies"] == {} and "host copies in the schedule: 0" in str(
    rep
  )
  assert off["outside_loops_s"] is None and "no layer loop" not in str(rep)
  # a GPU's or TPU's schedule: what moves while no loop runs, and its time
  row = dict.fromkeys(
    ("copies", "bytes", "across_loops", "bytes_across_loops"), 0
  )
  loops = {
    "host-to-device": {
      **row,
      "outside_loops": 3,
      "bytes_outside_loops": 300_000_000,
    },
    "device-to-host": {
      **row,
      "outside_loops": 2,
      "bytes_outside_loops": 200_000_000,
    },
  }
  tpu = dataclasses.replace(
    rep, offload={**off, "across_loops": loops, "outside_loops_s": 0.01}
  )
  assert (
    "while no layer loop runs: 300,000,000 down, 200,000,000 back: "
    "10.00 ms at 50 GB/s one way at a time" in str(tpu)
  )
  with pytest.raises(ValueError, match="link_gb_s=0"):
    zerojax.report(step, state, toy.batches(1)[0], link_gb_s=0)


def test_update_coupled_through_the_state_runs_whole_and_says_why():
  # the global norm of Adam's direction: every leaf's update reads every
  # leaf's moments
  coupled = optax.chain(
    optax.scale_by_adam(), optax.clip_by_global_norm(1.0), optax.scale(-1e-2)
  )
  rep, _, _ = _report(coupled)
  assert not rep.offload["streamed"] and rep.offload["chunks"] == 1
  assert "reads other leaves" in rep.offload["reason"]
  assert "whole state at once" in str(rep)


# --- parameters in host memory (stage 3, offload_params=True) ------------
@pytest.mark.parametrize("off", [False, True], ids=["params", "params+state"])
@pytest.mark.parametrize("policy", [None, BF16], ids=["fp32", "bf16+master"])
def test_params_in_host_memory_train_bitwise_equal(off, policy):
  """Stage 3 with the params' shards in host memory: each layer's shard
  is brought down just before its gather; the same bits as on device."""
  plain = _leaves(_train(3, False, policy)[0])
  tx = zerojax.zero(
    optax.adamw(1e-2), stage=3, offload=off, offload_params=True, policy=policy
  )
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  for b in toy.batches(3):
    state, _ = step(state, b)
  chex.assert_trees_all_equal(_leaves(state), plain)
  # every leaf is a layer stack by default: the stack of matrices in host
  # memory; stacks of vectors, the int ids and the replicated scalar (read
  # by the loss as they are) on the device
  kinds = {
    jax.tree_util.keystr(k): x.sharding.memory_kind
    for k, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
  }
  assert kinds.pop("['layers']['w']") == "pinned_host"
  assert set(kinds.values()) == {"device"}
  assert _kinds((state.master, state.opt_state)) == KINDS[off]


@pytest.mark.parametrize(
  "name", sorted(n for n in PARTIAL_OPTIMIZERS if n != "adamw")
)
def test_params_in_host_memory_equal_on_device_for_coupled_updates(name):
  """Global-norm clipping, LAMB's trust ratios and Adafactor's factored
  moments with the params' shards in host memory, and half the state
  too: the bits of the state kept on the device."""
  opt = PARTIAL_OPTIMIZERS[name]
  plain = _leaves(_train(3, False, BF16, optimizer=opt())[0])
  for off in (False, 0.5):
    state, _ = _train(3, off, BF16, optimizer=opt(), offload_params=True)
    assert _kinds(state.params) == {"device", "pinned_host"}
    chex.assert_trees_all_equal(_leaves(state), plain)


def test_params_in_host_memory_scanned_gpt_bitwise_equal(mesh):
  """The reference GPT scans its layers over stacked leaves: the scan
  slices each host-resident stack per layer and brings that layer down."""
  from zerojax.app import data, gpt

  model = gpt.GPTConfig(width=32, depth=2, heads=2, seq_len=32)
  tokens, _ = data.split(data.corpus_bytes())
  loss_fn = functools.partial(gpt.loss, config=model)
  out = []
  for pp in (False, True):
    tx = zerojax.zero(
      optax.adamw(3e-3),
      stage=3,
      mesh=mesh,
      policy=BF16,
      offload_params=pp,
      stacked=gpt.is_layer_stack,
    )
    state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
    step = zerojax.train_step(loss_fn, tx)
    for i in range(3):
      state, m = step(
        state, data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=32)
      )
    held_out = zerojax.eval_step(loss_fn, tx)(
      state, data.batch_at(tokens, seed=1, step=0, batch=16, seq_len=32)
    )
    out.append((_leaves(state), m["loss"], held_out))
    if pp:  # stacks of vectors (biases, norms) stay on the device
      for k, x in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        vectors = "blocks" in jax.tree_util.keystr(k) and x.ndim <= 2
        want = "device" if vectors else "pinned_host"
        assert x.sharding.memory_kind == want, (k, x.shape)
  chex.assert_trees_all_equal(out[1], out[0])


@pytest.mark.parametrize("off", [False, True], ids=["params", "params+state"])
def test_params_in_host_memory_compiled_host_bytes_equal_the_planners(off):
  """The compiled step reads the host state from host memory space; the
  planner's host bytes are what the state holds, and the report's offload
  section gives them each way, with the planner's reads per layer loop
  as theory."""
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(
    optax.adamw(1e-2), stage=3, offload=off, offload_params=True, policy=BF16
  )
  state = zerojax.init(params, tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  hlo = step.lower(state, toy.batches(1)[0]).compile().as_text()
  spaces = zerojax.diagnostics.entry_bytes_by_memory(hlo)
  held = zerojax.diagnostics.memory_bytes(state)["pinned_host"]
  assert spaces["arguments"]["pinned_host"] == held
  assert spaces["outputs"]["pinned_host"] == held
  plan = zerojax.cost.plan_stage(
    jax.eval_shape(lambda: params),
    3,
    tx.num_shards,
    policy=BF16,
    offload=off,
    offload_params=True,
  )
  assert plan.host == held
  assert plan.params_host + plan.host_bytes == held
  assert (plan.host_bytes > 0) == off
  # the toy's stack of matrices is the only param in host memory; it is
  # read per layer in the forward and in the backward
  assert plan.params_host_stacked == plan.params_host > 0
  assert plan.host_to_device == plan.device_to_host + plan.params_host
  rep = zerojax.report(step, state, toy.batches(1)[0]).offload
  assert rep["params_on_host"] and rep["host_fraction"] == float(off)
  # XLA CPU issues no host copies: the entry buffers, once each way
  assert rep["measured_from"] == "entry buffers"
  assert rep["host_to_device_bytes"] == rep["device_to_host_bytes"] == held
  assert rep["theory_host_to_device_bytes"] == plan.host_to_device
  assert rep["theory_device_to_host_bytes"] == plan.device_to_host
  # gathers, the split step and checkpoints see the same params
  plain_tx = zerojax.zero(optax.adamw(1e-2), stage=3, policy=BF16)
  plain = zerojax.init(params, plain_tx)
  same(zerojax.gather_params(state), zerojax.gather_params(plain))
  batch = toy.batches(1)[0]
  grads = [
    zerojax.value_and_grad(toy.loss_fn, s.spec.tx)(s, batch)[1]
    for s in (plain, state)
  ]
  chex.assert_trees_all_equal(grads[1], grads[0])


def test_params_in_host_memory_checkpoint_round_trip(tmp_path):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(
    optax.adamw(1e-2), stage=3, offload_params=True, policy=BF16
  )
  state = zerojax.init(params, tx)
  state, _ = zerojax.train_step(toy.loss_fn, tx)(state, toy.batches(1)[0])
  with checkpoint.Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
    ck.save(state)
    for pp in (False, True):
      other = zerojax.zero(
        optax.adamw(1e-2), stage=3, offload_params=pp, policy=BF16
      )
      restored, _ = ck.restore(params, other)
      want = {"pinned_host", "device"} if pp else {"device"}
      assert _kinds(restored.params) == want
      chex.assert_trees_all_equal(
        zerojax.gather_params(restored), zerojax.gather_params(state)
      )


@pytest.mark.filterwarnings("ignore:zerojax.init. params.*neither floating")
def test_the_planner_plans_a_users_tx_and_its_share_is_the_one_zero_keeps(mesh):
  """``plan_stage(abstract, tx=tx)`` prices the transformation as built
  (its stage, mesh, optimizer, policy); the share
  ``offload_fraction_needed(..., tx=tx)`` names is the one
  ``tx.replace(offload=share)`` keeps on the host, and it fits."""
  abstract = jax.eval_shape(lambda: toy.init_params(jax.random.key(0)))
  opt = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  for stage, policy in ((1, zerojax.Policy()), (3, BF16)):
    tx = zerojax.zero(opt(), stage=stage, mesh=mesh, policy=policy)
    mine = zerojax.cost.plan_stage(abstract, tx=tx)
    spelled = zerojax.cost.plan_stage(
      abstract, stage, 8, optimizer=opt(), policy=policy
    )
    assert dataclasses.asdict(mine) == dataclasses.asdict(spelled)
    full = zerojax.cost.plan_stage(abstract, tx=tx, offload=True)
    memory = (mine.working_set + full.working_set) / 2
    share = zerojax.cost.offload_fraction_needed(
      abstract, memory_bytes=memory, tx=tx
    )
    assert 0.0 < share < 1.0
    kept = tx.replace(offload=share)
    assert zerojax.cost.plan_stage(abstract, tx=kept).working_set <= memory
    state = zerojax.init(toy.init_params(jax.random.key(0)), kept)
    step = zerojax.train_step(toy.loss_fn, kept)
    rep = zerojax.report(step, state, next(iter(toy.batches(1))))
    assert rep.offload["host_fraction"] == pytest.approx(share, abs=1e-12)
  with pytest.raises(ValueError, match="stage=2 but tx is stage 3"):
    zerojax.cost.plan_stage(abstract, 2, tx=tx)
  with pytest.raises(TypeError, match="already sets optimizer, policy"):
    zerojax.cost.plan_stage(
      abstract, tx=tx, optimizer=opt(), policy=zerojax.Policy()
    )
  with pytest.raises(TypeError, match="got GradientTransformationExtraArgs"):
    zerojax.cost.plan_stage(abstract, tx=opt())
  with pytest.raises(TypeError, match="give the stage to plan"):
    zerojax.cost.plan_stage(abstract, n_devices=8)
  with pytest.raises(TypeError, match="give memory_bytes"):
    zerojax.cost.offload_fraction_needed(abstract, tx=tx)
  # with the gradients on the host only the whole state streams
  grads = tx.replace(offload=True, offload_grads=True)
  fits = zerojax.cost.plan_stage(abstract, tx=grads).working_set
  need = lambda m: zerojax.cost.offload_fraction_needed(
    abstract, memory_bytes=m, tx=grads
  )
  assert (need(fits), need(fits - 1)) == (1.0, None)
  with pytest.raises(
    ValueError, match=r"plan_stage\(tx=\.\.\., offload=0\.5\)"
  ):
    zerojax.cost.plan_stage(abstract, tx=grads, offload=0.5)


def test_offload_params_is_validated():
  with pytest.raises(ValueError, match="offload_params=True needs stage=3"):
    zerojax.zero(optax.adam(1e-3), stage=2, offload_params=True)
  with pytest.raises(ValueError, match="ZeRO\\+\\+"):
    zerojax.zero(
      optax.adam(1e-3),
      stage=3,
      offload_params=True,
      zeropp=zerojax.ZeroPP(weight_bits=8),
    )
  with pytest.raises(TypeError, match="offload_params='yes'"):
    zerojax.zero(optax.adam(1e-3), stage=3, offload_params="yes")
