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
