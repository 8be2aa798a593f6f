"""k micro-batches in one step equal one batch k times larger."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_four_micro_batches_equal_one_4x_batch(mesh, stage):
  params = toy.init_params(jax.random.key(1))
  data = toy.batches(3, size=128, seed=3)
  results = []
  for k in (1, 4):
    tx = zerojax.zero(optax.adamw(1e-2), stage=stage, mesh=mesh)
    state = zerojax.init(params, tx)
    step = zerojax.train_step(toy.loss_fn, tx, gather="model", accum_steps=k)
    losses = []
    for batch in data:
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    results.append((zerojax.gather_params(state), losses))
  (p1, l1), (p4, l4) = results
  floats = lambda t: [x for x in jax.tree.leaves(t)
                      if jnp.issubdtype(x.dtype, jnp.floating)]
  assert toy.rel_err(floats(p4), floats(p1)) < 1e-6
  np.testing.assert_allclose(l4, l1, rtol=1e-6)


def test_accumulation_matches_unsharded_optax(mesh):
  params = toy.init_params(jax.random.key(1))
  data = toy.batches(3, size=64, seed=4)
  want = toy.reference(params, optax.adamw(1e-2), data)
  tx = zerojax.zero(optax.adamw(1e-2), stage=2, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(toy.loss_fn, tx, gather="model", accum_steps=2)
  for batch in data:
    state, _ = step(state, batch)
  got = zerojax.gather_params(state)
  floats = lambda t: [x for x in jax.tree.leaves(t)
                      if jnp.issubdtype(x.dtype, jnp.floating)]
  assert toy.rel_err(floats(got), floats(want)) < 1e-6


def test_aux_floats_are_averaged_and_counts_summed(mesh):
  params = toy.init_params(jax.random.key(1))
  batch = toy.batches(1, size=64)[0]

  def loss_with_aux(p, b):
    loss = toy.loss_fn(p, b)
    return loss, {"twice": 2 * loss, "rows": jnp.asarray(b["x"].shape[0])}

  tx = zerojax.zero(optax.sgd(0.0), stage=1, mesh=mesh)
  step = zerojax.train_step(loss_with_aux, tx, gather="model", accum_steps=2)
  _, metrics = step(zerojax.init(params, tx), batch)
  np.testing.assert_allclose(metrics["aux"]["twice"], 2 * metrics["loss"],
                             rtol=1e-6)
  assert int(metrics["aux"]["rows"]) == 64   # summed over devices and micro-batches


def _regression(rows=64, features=8):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(16, features)), jnp.float32)}
  batch = {"x": rng.normal(size=(rows, 16)).astype(np.float32),
           "y": rng.normal(size=(rows, features)).astype(np.float32)}
  return params, batch


def _loss_with(aux_of):
  def loss(p, b):
    out = b["x"] @ p["w"]
    return jnp.mean((out - b["y"]) ** 2), aux_of(out, b)
  return loss


@pytest.mark.parametrize("accum_steps", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_per_example_aux_raises_before_the_state_is_touched(
    mesh, stage, accum_steps):
  """A per-example aux array would come back as the elementwise mean of
  different devices' rows, not the unsharded (rows,) array: refused, by
  leaf, with the fix, and the state is kept."""
  params, batch = _regression()
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(
      _loss_with(lambda out, b: {"per_example": jnp.mean(out ** 2, axis=1)}),
      tx, accum_steps=accum_steps)
  rows = 64 // (mesh.size * accum_steps)
  with pytest.raises(ValueError, match=(
      rf"zerojax: the loss's aux\['per_example'\] has shape \({rows},\) on "
      rf"each device, and its dimension 0 follows the batch's rows.*Reduce "
      rf"it over the batch inside the loss")):
    step(state, batch)
  np.testing.assert_array_equal(zerojax.gather_params(state)["w"],
                                params["w"])
  assert int(state.step) == 0


@pytest.mark.parametrize("stage", [0, 3])
def test_an_aux_batch_mean_as_long_as_the_rows_is_the_unsharded_mean(
    mesh, stage):
  """An aux vector reduced over the batch keeps its shape whatever the
  batch size, even where its length equals the rows per device (8 here):
  it is no per-example array, and its device mean is the unsharded mean."""
  params, batch = _regression(rows=8 * mesh.size, features=8)
  aux_of = lambda out, b: {"feature_mean": jnp.mean(out, axis=0)}
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
  _, metrics = zerojax.train_step(_loss_with(aux_of), tx)(
      zerojax.init(params, tx), batch)
  _, want = _loss_with(aux_of)(params, batch)
  assert metrics["aux"]["feature_mean"].shape == (8,)
  np.testing.assert_allclose(metrics["aux"]["feature_mean"],
                             want["feature_mean"], rtol=1e-5, atol=1e-6)
