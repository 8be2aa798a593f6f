"""Bad input: a clear error before any compile, and the state survives."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy


@pytest.fixture
def setup(mesh):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  return params, tx, state, step


def _intact(state, step, params=None):
  """The state was not donated or half-updated: its arrays still hold the
  values zerojax.init gave them, and a good step still runs."""
  params = toy.init_params(jax.random.key(0)) if params is None else params
  fresh = zerojax.init(params, state.spec.tx)
  for (path, a), b in zip(
    jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(fresh)
  ):
    assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(
      path
    )
  assert int(state.step) == 0
  new, metrics = step(state, toy.batches(1)[0])
  assert int(new.step) == 1 and np.isfinite(float(metrics["loss"]))


def test_batch_not_divisible(setup):
  _, _, state, step = setup
  bad = toy.batches(1, size=12)[0]
  with pytest.raises(
    ValueError,
    match=re.escape(
      "batch leaf ['x'] has 12 rows, which do not split over 8 devices x 1 "
      "micro-batches (needs a multiple of 8). Use a batch of 16"
    ),
  ):
    step(state, bad)
  _intact(state, step)


def test_batch_not_divisible_by_micro_batches(mesh):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  step = zerojax.train_step(toy.loss_fn, tx, accum_steps=3)
  with pytest.raises(ValueError, match="8 devices x 3 micro-batches .* 24"):
    step(zerojax.init(params, tx), toy.batches(1, size=32)[0])


def test_batch_leaves_disagree(setup):
  _, _, state, step = setup
  bad = {"x": np.zeros((16,), np.int32), "y": np.zeros((8,), np.int32)}
  with pytest.raises(
    ValueError, match=r"\['y'\] has 8 rows but other leaves have 16"
  ):
    step(state, bad)
  _intact(state, step)


def test_mesh_without_data_axis():
  mesh = jax.make_mesh(
    (8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  with pytest.raises(ValueError, match=r"no 'data' axis .* axis_name="):
    zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)


def test_replica_axis_must_be_another_mesh_axis():
  mesh = zerojax.make_mesh("replica=2,data=4")
  with pytest.raises(
    ValueError, match=r"replica_axis='pod' is not a mesh axis"
  ):
    zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh, replica_axis="pod")
  with pytest.raises(ValueError, match=r"replica_axis='data'"):
    zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh, replica_axis="data")


@pytest.mark.parametrize("stage", [-1, 4, "2", True, 1.0])
def test_stage_outside_range(mesh, stage):
  with pytest.raises(ValueError, match=r"is not a ZeRO stage; use 0"):
    zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)


def test_not_an_optax_transformation(mesh):
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    zerojax.zero(lambda g: g, stage=1, mesh=mesh)


def test_params_do_not_match_optimizer_state(setup):
  params, _, state, step = setup
  other = dict(params, head=jnp.zeros((7, 9)))  # a shape changed
  bad = state.replace(params=zerojax.init(other, state.spec.tx).params)
  with pytest.raises(
    ValueError, match=re.escape("state.params['head'] is float32[7, 16]")
  ):
    step(bad, toy.batches(1)[0])
  missing = {k: v for k, v in params.items() if k != "bias3"}  # a leaf gone
  bad = state.replace(params=zerojax.init(missing, state.spec.tx).params)
  with pytest.raises(ValueError, match="tree structure"):
    step(bad, toy.batches(1)[0])
  _intact(state, step)


def test_stage3_state_into_stage1_step(setup, mesh):
  _, _, state, _ = setup
  tx1 = zerojax.zero(optax.adamw(1e-2), stage=1, mesh=mesh)
  step1 = zerojax.train_step(toy.loss_fn, tx1)
  with pytest.raises(ValueError, match="stage: state has 3, step has 1"):
    step1(state, toy.batches(1)[0])
  _intact(state, zerojax.train_step(toy.loss_fn, state.spec.tx))


def test_not_a_state(setup):
  params, _, _, step = setup
  with pytest.raises(TypeError, match="expected a ZeroState"):
    step(params, toy.batches(1)[0])


def test_bad_train_step_options(setup):
  _, tx, _, _ = setup
  with pytest.raises(ValueError, match="accum_steps=0"):
    zerojax.train_step(toy.loss_fn, tx, accum_steps=0)
  with pytest.raises(ValueError, match="gather='layers'"):
    zerojax.train_step(toy.loss_fn, tx, gather="layers")


def test_non_scalar_loss_fails_at_trace_and_keeps_the_state(setup):
  _, tx, state, _ = setup
  step = zerojax.train_step(lambda p, b: jnp.zeros((2,)), tx)
  with pytest.raises(ValueError, match=r"scalar loss .* shape \(2,\)"):
    step(state, toy.batches(1)[0])
  _intact(state, zerojax.train_step(toy.loss_fn, tx))


def test_param_used_without_gather(setup):
  params, tx, state, _ = setup

  def loss_without_gather(p, b):
    return jnp.mean(p["embed"][b["x"]])

  step = zerojax.train_step(loss_without_gather, tx, gather="model")
  with pytest.raises(
    zerojax.errors.UngatheredParamError,
    match=r"params\['embed'\] "
    r"\(shape \(13, 7\)\) was used without being gathered",
  ):
    step(state, toy.batches(1)[0])
  # auto: warn with the cost and the fix, then gather the whole tree
  step = zerojax.train_step(loss_without_gather, tx)
  with pytest.warns(
    UserWarning, match="gathers the whole parameter tree .* MiB"
  ):
    new, _ = step(state, toy.batches(1)[0])
  assert int(new.step) == 1


def test_bad_policy(mesh):
  with pytest.raises(ValueError, match="param_dtype=.*int32.* not a floating"):
    zerojax.zero(
      optax.sgd(0.1),
      stage=1,
      mesh=mesh,
      policy=zerojax.Policy(param_dtype=jnp.int32),
    )
