"""What a real user hits: eval at stage 3, the context mesh, the two ways
into init, and the layout of leaves that are not layer stacks."""

import functools
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax
import zerojax.checkpoint
from tests import toy

D, V, B = 64, 64, 32


def _eval_memory(layers, gather):
  tx = zerojax.zero(optax.adamw(1e-3), stage=3)
  state = zerojax.init(toy.layered_params(layers, D, V), tx)
  batch = {"x": np.zeros((B,), np.int32), "y": np.zeros((B,), np.int32)}
  evaluate = zerojax.eval_step(toy.layered_loss, tx, gather=gather)
  return evaluate.lower(state, batch).compile()


def test_eval_gathers_per_layer_at_stage3():
  lean = _eval_memory(16, "model")
  whole = _eval_memory(16, "all")
  colls = zerojax.diagnostics.collectives(lean.as_text(), 8)
  # the layer weights are all-gathered inside the loop, once per layer
  loop = [c for c in colls if c.kind == "all-gather" and c.count == 16]
  assert sum(c.total_elements for c in loop) == 16 * (D * D + D)
  # and never all at once: the whole-tree eval holds 16 full layers
  assert (
    whole.memory_analysis().temp_size_in_bytes
    - lean.memory_analysis().temp_size_in_bytes
  ) > 8 * D * D * 4


@pytest.mark.parametrize("stage", [0, 3])
def test_eval_equals_the_unsharded_loss(mesh, stage):
  params = toy.layered_params(4, D, V)
  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.integers(0, V, (B,)).astype(np.int32),
    "y": rng.integers(0, V, (B,)).astype(np.int32),
  }
  with toy.warnings_as_errors():  # the lean path, no fallback
    got = float(zerojax.eval_step(toy.layered_loss, tx)(state, batch))
  np.testing.assert_allclose(
    got, float(toy.layered_loss(params, batch)), rtol=1e-5
  )


def test_eval_of_a_whole_tree_loss_is_exact(mesh):
  params = toy.layered_params(2, D, V)
  tx = zerojax.zero(optax.adamw(1e-3), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)

  def loss(p, b):
    return toy.layered_loss(p, b) + 1e-3 * optax.tree.norm(p)

  batch = {"x": np.zeros((B,), np.int32), "y": np.ones((B,), np.int32)}
  with pytest.warns(UserWarning, match="eval step"):
    got = float(zerojax.eval_step(loss, tx)(state, batch))
  np.testing.assert_allclose(got, float(loss(params, batch)), rtol=1e-5)


def test_zero_takes_the_context_mesh():
  devices = jax.devices()[:4]
  mesh = jax.make_mesh(
    (4,), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,)
  )
  with jax.set_mesh(mesh):
    tx = zerojax.zero(optax.sgd(0.1), stage=1)
  assert tx.mesh == mesh and tx.num_shards == 4
  assert zerojax.zero(optax.sgd(0.1), stage=1).num_shards == 8  # no context


def test_init_rejects_modules_and_functions(mesh):
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  with pytest.raises(
    TypeError, match=r"nnx.Module .* nnx.split\(model, nnx.Param"
  ):
    zerojax.init(model, tx)
  with pytest.raises(TypeError, match="zerojax.init_from"):
    zerojax.init(lambda key: {"w": jnp.ones(3)}, tx)

  class CallablePytree:  # an Equinox-style module
    def __init__(self):
      self.w, self.act = jnp.ones((3,)), jnp.tanh

    def __call__(self, x):
      return self.act(x * self.w)

  jax.tree_util.register_pytree_node(
    CallablePytree,
    lambda m: ((m.w, m.act), None),
    lambda _, c: CallablePytree(),
  )
  with pytest.raises(TypeError, match="not a params tree|not an array"):
    zerojax.init(CallablePytree(), tx)
  with pytest.raises(TypeError, match="init_fn must be callable"):
    zerojax.init_from({"w": jnp.ones(3)}, tx)


def test_init_from_never_holds_a_full_copy(mesh):
  tx = zerojax.zero(optax.adam(1e-3), stage=3, mesh=mesh)
  init_fn = lambda key: {"w": jax.random.normal(key, (64, 1024))}
  state = zerojax.init_from(init_fn, tx, jax.random.key(0))
  for x in jax.tree.leaves(state):
    if x.ndim:
      assert {s.data.shape for s in x.addressable_shards} == {(64, 128)}
  # XLA partitions the initialiser itself: no full (64, 1024) buffer
  compiled = (
    jax.jit(lambda k: zerojax.init_from(init_fn, tx, k).params)
    .lower(jax.random.key(0))
    .compile()
  )
  assert "f32[64,1024]" not in compiled.as_text()


def test_leaves_that_are_not_stacks_shard_their_leading_dim(mesh):
  params = {"head": jnp.zeros((768, 50)), "blocks": jnp.zeros((4, 16, 16))}
  default = zerojax.init(
    params, zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  )
  by_path = zerojax.init(
    params,
    zerojax.zero(
      optax.adam(0.1),
      stage=3,
      mesh=mesh,
      stacked=lambda path, shape: "blocks" in path,
    ),
  )
  d = {r.path: r.shard for r in default.spec.leaves}
  s = {r.path: r.shard for r in by_path.spec.leaves}
  assert d["['head']"].dim == 1 and d["['head']"].pad == 6  # 50 -> 56
  assert s["['head']"].dim == 0 and s["['head']"].pad == 0  # 768 / 8
  assert s["['blocks']"].dim == 1  # layer axis kept
  # the moments follow their param's layout, so the update stays local
  mu = by_path.opt_state[0].mu
  assert mu["head"].sharding.spec == by_path.params["head"].sharding.spec


def test_stacked_must_say_true_or_false(mesh):
  with pytest.raises(TypeError, match="must return True"):
    zerojax.init(
      {"w": jnp.zeros((8, 8))},
      zerojax.zero(
        optax.sgd(0.1), stage=1, mesh=mesh, stacked=lambda path, shape: "yes"
      ),
    )


def _device_params(mesh, where):
  """Params as a user's jitted init makes them: on one device, or (under
  ``jax.set_mesh``) replicated over the mesh."""
  put = (
    jax.sharding.SingleDeviceSharding(jax.devices()[1])
    if where == "one device"
    else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )
  make = functools.partial(
    jax.jit, toy.layered_params, static_argnums=(0, 1, 2)
  )
  return (
    make(out_shardings=put)(2, D, V),
    jax.tree.map(np.asarray, make()(2, D, V)),
  )


def _pointers(x):
  return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


def _one_step(state, tx):
  batch = {
    "x": np.arange(B, dtype=np.int32) % V,
    "y": np.arange(B, dtype=np.int32)[::-1] % V,
  }
  state, _ = zerojax.train_step(toy.layered_loss, tx)(state, batch)
  return jax.block_until_ready(state)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_init_holds_params_already_laid_out_as_stored(mesh, stage):
  """Params replicated on the mesh (a jitted init under ``jax.set_mesh``)
  are what stages 0-2 store: the state holds their very buffers, no copy,
  and equals the state built from host copies. The donated step then
  deletes them, as a data-parallel loop's donated step does, and building
  again from them raises a zerojax error naming the leaf and the fix."""
  params, host = _device_params(mesh, "the mesh, replicated")
  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  reference = zerojax.init(host, tx)
  toy.assert_same_arrays(state, reference)
  shared = jax.tree.map(
    lambda x, y: _pointers(x) == _pointers(y), params, state.params
  )
  assert all(jax.tree.leaves(shared)) == (stage < 3), shared
  state = _one_step(state, tx)
  assert all(x.is_deleted() for x in jax.tree.leaves(params)) == (stage < 3)
  if stage < 3:
    with pytest.raises(
      ValueError,
      match=r"params\['embed'\] float32\[64, "
      r"64\] has been deleted.*gather_params.*copy=True",
    ):
      zerojax.init(params, tx)


def test_a_step_on_deleted_buffers_names_the_leaf_and_the_fixes(mesh):
  """A state already donated to a step, or one sharing its params' buffers
  with a state a step took, is refused by the train and eval steps with a
  zerojax error naming the leaf; ``copy=True`` gives the second state
  buffers of its own."""
  params, _ = _device_params(mesh, "the mesh, replicated")
  tx = zerojax.zero(optax.adamw(1e-3), stage=0, mesh=mesh)
  first = zerojax.init(params, tx)
  second = zerojax.init(params, tx)
  own = zerojax.init(params, tx, copy=True)
  after = _one_step(first, tx)
  evaluate = zerojax.eval_step(toy.layered_loss, tx)
  batch = {
    "x": np.arange(B, dtype=np.int32) % V,
    "y": np.arange(B, dtype=np.int32)[::-1] % V,
  }
  for stale, leaf in (
    (first, r"step int32\[\]"),
    (second, r"params\['embed'\] float32\[64, 64\]"),
  ):
    for where, run in (
      ("train_step", lambda s: _one_step(s, tx)),
      ("eval_step", lambda s: evaluate(s, batch)),
    ):
      with pytest.raises(
        ValueError,
        match=rf"zerojax\.{where}: state\."
        rf"{leaf} has been deleted.*the state it returns.*"
        r"copy=True",
      ):
        run(stale)
  chex.assert_trees_all_equal(_one_step(own, tx), after)


def test_the_state_functions_name_a_deleted_leaf_of_a_donated_state(mesh):
  """A state already given to the donating train step, passed again to the
  step or to the functions that read a state (or its deleted params to
  value_and_grad), is refused before anything runs, with a zerojax error
  naming the leaf and the fix."""
  params, _ = _device_params(mesh, "the mesh, replicated")
  tx = zerojax.zero(optax.adamw(1e-3), stage=1, mesh=mesh)
  stale = zerojax.init(params, tx)
  fresh = _one_step(stale, tx)
  batch = {
    "x": np.arange(B, dtype=np.int32) % V,
    "y": np.arange(B, dtype=np.int32)[::-1] % V,
  }
  grad_fn = zerojax.value_and_grad(toy.layered_loss, tx)
  _, grads = grad_fn(fresh, batch)
  step = zerojax.train_step(toy.layered_loss, tx)
  state_said = r"state\.step int32\[\] has been deleted.*the state it returns"
  for where, run in (
    ("apply_gradients", lambda: zerojax.apply_gradients(stale, grads)),
    ("value_and_grad", lambda: grad_fn(stale, batch)),
    ("gather_params", lambda: zerojax.gather_params(stale)),
    ("gather_opt_state", lambda: zerojax.gather_opt_state(stale)),
    (
      "diagnostics.layout_table",
      lambda: zerojax.diagnostics.layout_table(stale),
    ),
    ("report", lambda: zerojax.report(step, stale, batch)),
    (
      "checkpoint.export_params",
      lambda: zerojax.checkpoint.export_params(stale),
    ),
  ):
    with pytest.raises(ValueError, match=rf"zerojax\.{where}: {state_said}"):
      run()
  with pytest.raises(
    ValueError,
    match=r"zerojax\.value_and_grad: "
    r"params\['embed'\] float32\[64, 64\] has been "
    r"deleted.*copy=True",
  ):
    grad_fn(params, batch)
  # the same step object, its program compiled and called before: refused
  # too (JAX 0.10's fast path would run a deleted buffer and crash)
  newer, _ = step(fresh, batch)
  newest, _ = step(newer, batch)
  with pytest.raises(ValueError, match=rf"zerojax\.train_step: {state_said}"):
    step(newer, batch)
  fresh = newest
  with tempfile.TemporaryDirectory() as where:
    with zerojax.checkpoint.Checkpointer(where) as ckpt:
      with pytest.raises(
        ValueError, match=rf"Checkpointer\.save: {state_said}"
      ):
        ckpt.save(stale)
      assert ckpt.save(fresh)
  # the live state still works with every one of them
  zerojax.apply_gradients(fresh, grads)
  zerojax.gather_params(fresh)
  zerojax.gather_opt_state(fresh)
  assert "params['embed']" in zerojax.diagnostics.layout_table(fresh)


@pytest.mark.parametrize("where", ["one device", "the mesh, replicated"])
def test_init_with_copy_leaves_the_callers_params_alive(mesh, where):
  """``copy=True``, or params laid out otherwise than the state stores
  them: the state owns buffers of its own, so neither init nor the donated
  train step deletes the caller's arrays."""
  params, host = _device_params(mesh, where)
  tx = zerojax.zero(optax.adamw(1e-3), stage=0, mesh=mesh)
  state = zerojax.init(params, tx, copy=where != "one device")
  reference = zerojax.init(host, tx)
  toy.assert_same_arrays(state, reference)
  _one_step(state, tx)
  for x, h in zip(jax.tree.leaves(params), jax.tree.leaves(host)):
    assert not x.is_deleted() and np.array_equal(x, h)


@pytest.mark.parametrize("stage", [1, 3])
def test_gather_params_compiles_once_per_params_layout(mesh, stage):
  """Two states of the same params under different optimizers share
  gather_params' program (it reads the params alone), and both give the
  params back exactly."""
  params = {
    "w": np.arange(40 * 24, dtype=np.float32).reshape(40, 24) / 7,
    "b": np.arange(40, dtype=np.float32),
  }
  states = [
    zerojax.init(params, zerojax.zero(opt, stage=stage, mesh=mesh))
    for opt in (optax.adamw(1e-3), optax.lion(1e-4))
  ]
  compiles = []

  def listen(event, secs, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(secs)

  full = [zerojax.gather_params(states[0])]
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    full.append(zerojax.gather_params(states[1]))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiles == []
  for got in full:
    jax.tree.map(np.testing.assert_array_equal, got, params)


@pytest.mark.parametrize("stage,accum_steps", [(0, 2), (3, 1)])
def test_a_float64_model_keeps_its_float64_loss(mesh, stage, accum_steps):
  """Under ``jax.enable_x64``, float64 params and a float64 loss: the
  step's params, its reported loss and grad norm, and the eval step's loss
  and aux are float64 and equal plain Optax's to float64 rounding (a
  float32 loss would be off by about 1e-7 of its value)."""

  def loss(p, b):
    p = zerojax.gather(p)
    err = b["x"] @ p["w"] + p["b"][None] - b["y"]
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, 16)), "y": rng.normal(size=(16, 8))}
  with jax.enable_x64(True):
    make = lambda: {
      "w": jnp.asarray(np.random.default_rng(1).normal(size=(16, 8))),
      "b": jnp.zeros((8,), jnp.float64),
    }
    opt = optax.adamw(1e-3)
    params, opt_state = make(), opt.init(make())
    for _ in range(3):
      (want_loss, want_aux), g = jax.value_and_grad(loss, has_aux=True)(
        params, batch
      )
      updates, opt_state = opt.update(g, opt_state, params)
      params = optax.apply_updates(params, updates)
    tx = zerojax.zero(opt, stage=stage, mesh=mesh)
    state = zerojax.init(make(), tx)
    step = zerojax.train_step(loss, tx, accum_steps=accum_steps)
    for _ in range(3):
      state, metrics = step(state, batch)
    got_loss, got_aux = zerojax.eval_step(loss, tx, has_aux=True)(state, batch)
    want_eval = loss(params, batch)[0]
  assert metrics["loss"].dtype == metrics["grad_norm"].dtype == jnp.float64
  assert got_loss.dtype == got_aux["mae"].dtype == jnp.float64
  np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-13)
  assert metrics["aux"]["mae"].dtype == jnp.float64
  np.testing.assert_allclose(metrics["aux"]["mae"], want_aux["mae"], rtol=1e-13)
  np.testing.assert_allclose(got_loss, want_eval, rtol=1e-13)
  chex.assert_trees_all_close(
    zerojax.gather_params(state), params, rtol=1e-13, atol=1e-15
  )
