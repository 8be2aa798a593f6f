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
  floats = lambda t: [
    x for x in jax.tree.leaves(t) if jnp.issubdtype(x.dtype, jnp.floating)
  ]
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
  floats = lambda t: [
    x for x in jax.tree.leaves(t) if jnp.issubdtype(x.dtype, jnp.floating)
  ]
  assert toy.rel_err(floats(got), floats(want)) < 1e-6


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_aux_floats_are_averaged_and_counts_summed(mesh, accum_steps):
  """A count the loss builds from a shape is a constant (a literal, not a
  traced value, under JAX's autodiff): summed like any count."""
  params = toy.init_params(jax.random.key(1))
  batch = toy.batches(1, size=64)[0]

  def loss_with_aux(p, b):
    loss = toy.loss_fn(p, b)
    return loss, {"twice": 2 * loss, "rows": jnp.asarray(b["x"].shape[0])}

  tx = zerojax.zero(optax.sgd(0.0), stage=1, mesh=mesh)
  step = zerojax.train_step(
    loss_with_aux, tx, gather="model", accum_steps=accum_steps
  )
  _, metrics = step(zerojax.init(params, tx), batch)
  np.testing.assert_allclose(
    metrics["aux"]["twice"], 2 * metrics["loss"], rtol=1e-6
  )
  assert (
    int(metrics["aux"]["rows"]) == 64
  )  # summed over devices and micro-batches


def _regression(rows=64, features=8):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(16, features)), jnp.float32)}
  batch = {
    "x": rng.normal(size=(rows, 16)).astype(np.float32),
    "y": rng.normal(size=(rows, features)).astype(np.float32),
  }
  return params, batch


def _loss_with(aux_of):
  def loss(p, b):
    out = b["x"] @ p["w"]
    return jnp.mean((out - b["y"]) ** 2), aux_of(out, b)

  return loss


def _per_example(out, b):
  """Per-example aux of two layouts (rows first; rows second, as counts)
  beside a batch mean."""
  return {
    "per_example": jnp.mean((out - b["y"]) ** 2, axis=1),
    "positive_by_row": (out > 0).T.astype(jnp.int32),
    "mean": jnp.mean(out),
  }


def _rows_on_each_device(x, dim):
  return {s.data.shape[dim] for s in x.addressable_shards}


@pytest.mark.parametrize("accum_steps", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_per_example_aux_is_every_row_in_batch_order(
  any_mesh, stage, accum_steps
):
  """A per-example aux leaf (rows first, or rows second) comes back as the
  unsharded loss's: all 64 rows in batch order (micro-batches in order on
  each device, devices in the batch's order), sharded by rows; a batch
  mean beside it stays the mean."""
  params, batch = _regression()
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=any_mesh)
  step = zerojax.train_step(
    _loss_with(_per_example), tx, accum_steps=accum_steps
  )
  _, metrics = step(zerojax.init(params, tx), batch)
  _, want = _loss_with(_per_example)(params, batch)
  got = metrics["aux"]
  assert got["per_example"].shape == (64,)
  assert got["positive_by_row"].shape == (8, 64)
  # row-wise values computed per device: the same sums, another program
  np.testing.assert_allclose(
    got["per_example"], want["per_example"], rtol=1e-5, atol=1e-6
  )
  np.testing.assert_array_equal(got["positive_by_row"], want["positive_by_row"])
  np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-5, atol=1e-6)
  assert _rows_on_each_device(got["per_example"], 0) == {8}
  assert _rows_on_each_device(got["positive_by_row"], 1) == {8}


def test_a_per_example_aux_on_a_hybrid_mesh_is_in_batch_order():
  """replica x data: the batch splits over both axes (replica-major), and
  the rows come back in that order."""
  mesh = zerojax.make_mesh("replica=2,data=4")
  params, batch = _regression()
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh, replica_axis="replica")
  _, metrics = zerojax.train_step(_loss_with(_per_example), tx, accum_steps=2)(
    zerojax.init(params, tx), batch
  )
  _, want = _loss_with(_per_example)(params, batch)
  np.testing.assert_allclose(
    metrics["aux"]["per_example"], want["per_example"], rtol=1e-5, atol=1e-6
  )
  np.testing.assert_array_equal(
    metrics["aux"]["positive_by_row"], want["positive_by_row"]
  )


@pytest.mark.parametrize("stage", [0, 3])
def test_value_and_grad_returns_the_per_example_aux(any_mesh, stage):
  params, batch = _regression()
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=any_mesh)
  state = zerojax.init(params, tx)
  (loss, aux), _ = zerojax.value_and_grad(
    _loss_with(_per_example), tx, has_aux=True
  )(state, batch)
  want_loss, want = _loss_with(_per_example)(params, batch)
  np.testing.assert_allclose(
    aux["per_example"], want["per_example"], rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_eval_step_returns_the_per_example_aux(any_mesh, stage):
  """``eval_step(..., has_aux=True)``: the mean loss and the aux as the
  unsharded loss gives them; without ``has_aux`` the loss alone."""
  params, batch = _regression()
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=any_mesh)
  state = zerojax.init(params, tx)
  loss_fn = _loss_with(_per_example)
  loss, aux = zerojax.eval_step(loss_fn, tx, has_aux=True)(state, batch)
  want_loss, want = loss_fn(params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(
    aux["per_example"], want["per_example"], rtol=1e-5, atol=1e-6
  )
  np.testing.assert_array_equal(aux["positive_by_row"], want["positive_by_row"])
  np.testing.assert_allclose(aux["mean"], want["mean"], rtol=1e-5, atol=1e-6)
  assert _rows_on_each_device(aux["per_example"], 0) == {8}
  plain = zerojax.eval_step(loss_fn, tx)(state, batch)
  assert np.shape(plain) == ()
  np.testing.assert_allclose(plain, want_loss, rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 3])
def test_an_aux_that_grows_with_the_rows_otherwise_is_refused_and_the_state_kept(
  mesh, stage
):
  """An aux of rows x rows (a pairwise matrix) follows the batch, but not
  as one dimension of rows: there is no unsharded value to assemble from
  the devices' pieces, so the step refuses it by leaf before the state is
  touched."""
  params, batch = _regression()
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(
    _loss_with(lambda out, b: {"pairs": out @ out.T}), tx
  )
  with pytest.raises(
    ValueError,
    match=(
      r"zerojax: the loss's aux\['pairs'\] has shape \(8, 8\) on each "
      r"device, and \(16, 16\) when the device's rows double"
    ),
  ):
    step(state, batch)
  np.testing.assert_array_equal(zerojax.gather_params(state)["w"], params["w"])
  assert int(state.step) == 0


@pytest.mark.parametrize("stage", [0, 3])
def test_an_aux_batch_mean_as_long_as_the_rows_is_the_unsharded_mean(
  mesh, stage
):
  """An aux vector reduced over the batch keeps its shape whatever the
  batch size, even where its length equals the rows per device (8 here):
  it is no per-example array, and its device mean is the unsharded mean."""
  params, batch = _regression(rows=8 * mesh.size, features=8)
  aux_of = lambda out, b: {"feature_mean": jnp.mean(out, axis=0)}
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
  _, metrics = zerojax.train_step(_loss_with(aux_of), tx)(
    zerojax.init(params, tx), batch
  )
  _, want = _loss_with(aux_of)(params, batch)
  assert metrics["aux"]["feature_mean"].shape == (8,)
  np.testing.assert_allclose(
    metrics["aux"]["feature_mean"], want["feature_mean"], rtol=1e-5, atol=1e-6
  )
