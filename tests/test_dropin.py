"""The layered API: the Optax drop-in, value_and_grad, apply_gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests import toy


def _params():
  k = jax.random.split(jax.random.key(0), 2)
  return {
    "w1": jax.random.normal(k[0], (6, 12)) * 0.5,  # uneven: padded
    "w2": jax.random.normal(k[1], (12, 3)) * 0.5,
    "b": jnp.zeros((3,)),
  }


def loss(p, b):
  h = jnp.tanh(b["x"] @ zerojax.gather(p["w1"]))
  out = h @ zerojax.gather(p["w2"]) + zerojax.gather(p["b"])[None]
  return jnp.mean((out - b["y"]) ** 2)


def _data(n=3):
  rng = np.random.default_rng(0)
  return [
    {
      "x": rng.normal(size=(16, 6)).astype(np.float32),
      "y": rng.normal(size=(16, 3)).astype(np.float32),
    }
    for _ in range(n)
  ]


def existing_loop(tx, data, params=None):
  """An existing Optax loop, as written without zerojax."""
  params = _params() if params is None else params
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for batch in data:
    params, opt_state = step(params, opt_state, batch)
  return params, opt_state


def test_zero_is_a_real_optax_transformation(mesh):
  tx = zerojax.zero(optax.adamw(1e-2), stage=1, mesh=mesh)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  assert tx.stage == 1 and tx.num_shards == 8
  chained = optax.chain(optax.clip_by_global_norm(1.0), optax.scale(1.0))
  assert isinstance(
    zerojax.zero(chained, stage=2, mesh=mesh), optax.GradientTransformation
  )


@pytest.mark.parametrize("opt", ["adamw", "clip_adamw", "adafactor"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_existing_optax_loop_changes_one_line(mesh, stage, opt):
  make = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip_adamw": lambda: optax.chain(
      optax.clip_by_global_norm(0.1), optax.adamw(1e-2)
    ),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
  }[opt]
  data = _data()
  want, want_state = existing_loop(make(), data)
  got, got_state = existing_loop(
    zerojax.zero(make(), stage=stage, mesh=mesh), data
  )
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
  # the optimizer state is the inner one, laid out for the stage
  assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
  sharded = [
    x for x in jax.tree.leaves(got_state) if "data" in str(x.sharding.spec)
  ]
  if stage == 0:
    assert not sharded
  else:
    big = [
      x
      for x in jax.tree.leaves(want_state)
      if x.ndim >= 1 and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert len(sharded) == len(big)
    for x in sharded:  # each device holds 1/8 of the (padded) leaf
      assert x.addressable_shards[0].data.size * 8 == x.size


def test_nnx_optimizer_changes_one_line(mesh):
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(6, 12, rngs=rngs)
      self.l2 = nnx.Linear(12, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  def train(tx):
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
      grads = nnx.grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(
        model
      )
      optimizer.update(model, grads)

    for batch in _data():
      step(model, optimizer, batch)
    return nnx.state(model, nnx.Param), optimizer

  want, _ = train(optax.adamw(1e-2))
  got, optimizer = train(zerojax.zero(optax.adamw(1e-2), stage=1, mesh=mesh))
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  specs = {
    str(x.sharding.spec) for x in jax.tree.leaves(optimizer.opt_state) if x.ndim
  }
  assert any("data" in s for s in specs)
  assert int(optimizer.step[...]) == 3


def test_drop_in_forwards_extra_args(mesh):
  def opt():
    return optax.chain(
      optax.sgd(0.5),
      optax.contrib.reduce_on_plateau(factor=0.5, patience=0, rtol=0.5),
    )

  def run(tx):
    params, state = _params(), tx.init(_params())
    for batch in _data(1) * 4:
      value, grads = jax.value_and_grad(loss)(params, batch)
      updates, state = tx.update(grads, state, params, value=value)
      params = optax.apply_updates(params, updates)
    return params

  want = run(opt())
  with jax.set_mesh(mesh):  # eager JAX ops on Explicit-mesh arrays need it
    got = run(zerojax.zero(opt(), stage=1, mesh=mesh))
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 2])
def test_value_and_grad_in_the_stage_layout_then_tx_update(mesh, stage):
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=mesh)
  grad_fn = zerojax.value_and_grad(loss, tx)
  params, opt_state = _params(), tx.init(_params())
  ref, ref_tx = _params(), optax.adam(1e-2)
  ref_state = ref_tx.init(ref)
  for batch in _data():
    value, grads = grad_fn(params, batch)
    # w1 is (6, 12): its gradient comes back as the padded storage shard
    assert grads["w1"].shape == (6, 16)
    assert "data" in str(grads["w1"].sharding.spec)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    ref_value, g = jax.value_and_grad(loss)(ref, batch)
    u, ref_state = ref_tx.update(g, ref_state, ref)
    ref = optax.apply_updates(ref, u)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  for k in ref:
    np.testing.assert_allclose(params[k], ref[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [0, 3])
def test_train_step_is_value_and_grad_then_apply_gradients(mesh, stage):
  tx = zerojax.zero(
    optax.adamw(1e-2),
    stage=stage,
    mesh=mesh,
    policy=zerojax.Policy(param_dtype=jnp.bfloat16),
  )
  params = toy.init_params(jax.random.key(0))
  grad_fn = zerojax.value_and_grad(toy.loss_fn, tx)
  a = zerojax.init(params, tx)
  b = zerojax.init(params, tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  for batch in toy.batches(2):
    _, grads = grad_fn(a, batch)
    a = zerojax.apply_gradients(a, grads)
    b, _ = step(b, batch)
  # one program against two: equal up to the order of their sums (a
  # gradient adds the batch's 32 rows, over 2 steps)
  toy.assert_same_up_to_summation_order(a, b, terms=32 * 2)


@pytest.mark.parametrize("stage", [0, 3])
def test_value_and_grad_and_apply_gradients_run_inside_the_users_jit(
  any_mesh, stage
):
  """The two halves composed in one jit of the user's own (state donated,
  the batch traced): the train step's numbers."""
  tx = zerojax.zero(optax.adamw(1e-2), stage=stage, mesh=any_mesh)
  params = toy.init_params(jax.random.key(0))
  grad_fn = zerojax.value_and_grad(toy.loss_fn, tx)

  @functools.partial(jax.jit, donate_argnums=0)
  def own_step(state, batch):
    loss, grads = grad_fn(state, batch)
    return zerojax.apply_gradients(state, grads), loss

  a = zerojax.init(params, tx)
  b = zerojax.init(params, tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  for batch in toy.batches(2):
    a, loss = own_step(a, batch)
    b, metrics = step(b, batch)
  toy.assert_same_up_to_summation_order(a, b, terms=32 * 2)
  toy.assert_same_up_to_summation_order(loss, metrics["loss"], terms=32)
  # the train and eval steps compose the same way
  batch = toy.batches(3)[2]
  evaluate = zerojax.eval_step(toy.loss_fn, tx)
  np.testing.assert_array_equal(jax.jit(evaluate)(b, batch), evaluate(b, batch))
  twice = jax.jit(lambda s, x: step(*step(s, x)[:1], x))
  toy.assert_same_up_to_summation_order(
    twice(b, batch), step(step(b, batch)[0], batch), terms=32 * 2
  )


def test_drop_in_refuses_what_it_cannot_do(mesh):
  with pytest.raises(
    ValueError, match="stage 3 .* zerojax.init \\+ zerojax.train_step"
  ):
    zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh).init(_params())
  bf16 = zerojax.zero(
    optax.adam(1e-2),
    stage=1,
    mesh=mesh,
    policy=zerojax.Policy(param_dtype=jnp.bfloat16),
  )
  with pytest.raises(ValueError, match="master copy"):
    bf16.init(_params())
  tx = zerojax.zero(optax.adam(1e-2), stage=1, mesh=mesh)
  state = tx.init(_params())
  with pytest.raises(ValueError, match="needs params in update"):
    tx.update(_params(), state)
  with pytest.raises(ValueError, match=r"gradient\['w1'\] has shape \[6, 5\]"):
    tx.update(dict(_params(), w1=jnp.zeros((6, 5))), state, _params())
  with pytest.raises(ValueError, match="pass the ZeroState"):
    zerojax.value_and_grad(
      loss, zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
    )(_params(), _data(1)[0])


def test_gradients_in_another_tree_are_refused_not_misapplied(mesh):
  """Gradients with as many leaves of the same shapes as the params, in a
  tree whose leaves stand at other keys (a renamed key, a list), would
  update the wrong params: both the drop-in and ``apply_gradients`` raise
  naming the two paths; so does the drop-in given an optimizer state
  built for other params. Containers that name the leaves alike pass: an
  ``nnx.State`` of params takes its pure dict's gradients."""
  p = {"a": jnp.ones((16, 4)), "b": jnp.zeros((16, 4))}
  p = jax.device_put(p, NamedSharding(mesh, P()))
  renamed = {"b": jnp.full((16, 4), 3.0), "c": jnp.full((16, 4), 2.0)}
  listed = [jnp.full((16, 4), 2.0), jnp.full((16, 4), 3.0)]
  tx = zerojax.zero(optax.sgd(1.0), stage=1, mesh=mesh)
  opt_state, state = tx.init(p), zerojax.init(p, tx)
  for grads, got in ((renamed, r"\['b'\]"), (listed, r"\[0\]")):
    match = f"gradient {got} stands where the params have \\['a'\\]"
    with pytest.raises(ValueError, match=match):
      tx.update(grads, opt_state, p)
    with pytest.raises(ValueError, match=match):
      zerojax.apply_gradients(state, grads)
  # an optimizer state built for other params: renamed, or reshaped
  adam = zerojax.zero(optax.adam(1e-2), stage=1, mesh=mesh)
  adam_state = adam.init(p)
  other = jax.device_put(renamed, NamedSharding(mesh, P()))
  with pytest.raises(ValueError, match=r"opt_state\[0\]\.mu\['a'\] stands"):
    adam.update(other, adam_state, other)
  wide = dict(p, a=jnp.ones((24, 4)))
  with pytest.raises(
    ValueError, match=r"\.mu\['a'\] has shape \[16, 8\]; .* \[24, 8\]"
  ):
    adam.update(wide, adam_state, wide)
  # the state was kept: the right tree applies
  good = {"a": jnp.full((16, 4), 2.0), "b": jnp.full((16, 4), 3.0)}
  out = zerojax.gather_params(zerojax.apply_gradients(state, good))
  np.testing.assert_array_equal(out["a"], -1.0)
  np.testing.assert_array_equal(out["b"], -3.0)

  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  pure = jax.tree.map(jnp.ones_like, nnx.to_pure_dict(params))
  nnx_state = zerojax.init(params, tx)
  new = zerojax.gather_params(zerojax.apply_gradients(nnx_state, pure))
  want = jax.tree.map(lambda x: x - 1.0, params)
  chex.assert_trees_all_close(new, want)


def test_optax_lookahead_goes_around_the_drop_in(mesh):
  """``optax.lookahead`` takes gradients of ``params.fast`` and updates
  ``LookaheadParams``: wrapped around the drop-in it equals plain Optax;
  the drop-in wrapped around it refuses those gradients with that fix."""
  w = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 16)), jnp.float32)
  grad = jax.grad(lambda p: jnp.mean(jnp.sin(x @ p["w"]) ** 2))

  def run(opt, params):
    state = opt.init(params)

    @jax.jit
    def step(params, state):
      updates, state = opt.update(grad(params.fast), state, params)
      return optax.apply_updates(params, updates), state

    for _ in range(3):  # a sync at step 2
      params, state = step(params, state)
    return params

  look = functools.partial(optax.lookahead, sync_period=2, slow_step_size=0.5)
  start = optax.LookaheadParams.init_synced({"w": w})
  want = run(look(optax.adam(1e-2)), start)
  with jax.set_mesh(mesh):
    for stage in (1, 2):
      tx = look(zerojax.zero(optax.adam(1e-2), stage=stage, mesh=mesh))
      chex.assert_trees_all_close(run(tx, start), want, atol=1e-6)
    inside = zerojax.zero(look(optax.adam(1e-2)), stage=1, mesh=mesh)
    with pytest.raises(
      ValueError, match=r"params\.fast's: .*optax\.lookahead\(zerojax\.zero"
    ):
      run(inside, start)


def test_drop_in_names_a_leaf_a_donating_step_deleted(mesh):
  """An optimizer state or params donated to a jitted step, then passed to
  the drop-in's eager init or update (three times: JAX 0.10's compiled
  fast path would run the deleted buffer and crash), is refused with a
  zerojax error naming the leaf; the arrays the step returned work."""
  tx = zerojax.zero(optax.adam(1e-2), stage=1, mesh=mesh)
  params = jax.device_put(
    _params(), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )
  grads = jax.tree.map(jnp.ones_like, params)
  _, opt_state = tx.update(grads, tx.init(params), params)
  donate = jax.jit(lambda t: jax.tree.map(lambda x: x + 0, t), donate_argnums=0)
  fresh = donate(opt_state)
  for _ in range(3):
    with pytest.raises(
      ValueError,
      match=r"ZeroTransformation\.update: "
      r"opt_state\[0\]\.count int32\[\] has been deleted"
      r".*donate_argnums",
    ):
      tx.update(grads, opt_state, params)
  tx.update(grads, fresh, params)
  kept = donate(params)
  with pytest.raises(
    ValueError,
    match=r"ZeroTransformation\.init: "
    r"params\['b'\] float32\[3\] has been deleted",
  ):
    tx.init(params)
  tx.init(kept)


def test_sharded_gradients_stay_sharded_in_tx_update(mesh):
  """Gradients from value_and_grad (stage 2) enter tx.update sharded: the
  update all-gathers only the updates (one Ψ), never the gradients."""
  params = {"w": jnp.ones((8, 16)), "v": jnp.ones((16,))}
  tx = zerojax.zero(optax.adam(1e-2), stage=2, mesh=mesh)
  opt_state = tx.init(params)
  batch = {"x": np.ones((16, 8), np.float32)}
  loss = lambda p, b: jnp.mean(
    jnp.tanh(b["x"] @ zerojax.gather(p["w"])) * zerojax.gather(p["v"])[None]
  )
  _, grads = zerojax.value_and_grad(loss, tx)(params, batch)
  assert all("data" in str(g.sharding.spec) for g in jax.tree.leaves(grads))
  hlo = jax.jit(tx.update).lower(grads, opt_state, params).compile().as_text()
  gathered = sum(
    c.total_elements
    for c in zerojax.diagnostics.collectives(hlo, 8)
    if c.kind == "all-gather"
  )
  assert gathered == 8 * 16 + 16
