"""ZeRO-R's Pa: the reference GPT's layer-boundary checkpoints split over
the model axis along the sequence (``GPTConfig(seq_shard="model")``).

The saved residual of one layer is ``B_local x T x D`` fp32 per device
without Pa, 1/M of it with Pa (M: the model-axis size). Read from the
compiled step as the growth of XLA's temp bytes per added layer (two
depths, so the rest of the program cancels): Pa must save at least 0.45 of
one residual per layer at M = 2 (the issue's target: <= 0.55x).
"""

import functools

import jax
import numpy as np
import optax
import pytest

import toy
import zerojax
from zerojax.models import gpt

B, T, D, V = 16, 32, 64, 64


def _run(mesh_spec, depth, seq_shard, steps=2):
  cfg = gpt.GPTConfig(vocab=V, seq_len=T, width=D, depth=depth, heads=4,
                      seq_shard=seq_shard)
  mesh = zerojax.make_mesh(mesh_spec)
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh,
                    model_specs=gpt.model_specs(), stacked=gpt.is_layer_stack)
  state = zerojax.init(gpt.init(cfg, jax.random.key(0)), tx)
  step = zerojax.train_step(functools.partial(gpt.loss, config=cfg), tx)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.integers(0, V, (B, T)).astype(np.int32),
              "y": rng.integers(0, V, (B, T)).astype(np.int32)}
             for _ in range(steps)]
  temp = step.lower(state, batches[0]).compile().memory_analysis(
      ).temp_size_in_bytes
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return temp, losses, zerojax.gather_params(state)


@pytest.mark.parametrize("mesh_spec", [
    "data=4,model=2",
    pytest.param("replica=2,data=2,model=2", marks=pytest.mark.slow)])
def test_pa_splits_saved_activations_over_the_model_axis(mesh_spec):
  """Same numbers as without Pa (SGD, so the params compare the gradients:
  rel. error < 5e-6, the pod-mesh parity bound; measured 3e-7, the
  sequence split only reorders fp32 sums -- Adam at lr 1e-2 would amplify
  that reordering on tiny gradients to 1e-4); per added layer the compiled step's temp bytes grow by at least
  0.45 of one residual less than without."""
  batch_shards = 4
  residual = (B // batch_shards) * T * D * 4
  got, want = {}, {}
  for depth in (2, 4):
    got[depth] = _run(mesh_spec, depth, "model")
    want[depth] = _run(mesh_spec, depth, None)
    np.testing.assert_allclose(got[depth][1], want[depth][1], rtol=1e-6)
    err = toy.rel_err(got[depth][2], want[depth][2])
    assert err < 5e-6, err
  per_layer = lambda r: (r[4][0] - r[2][0]) / 2
  saved = per_layer(want) - per_layer(got)
  assert saved >= 0.45 * residual, (per_layer(want), per_layer(got), residual)


def test_pa_is_a_no_op_without_the_axis_and_checks_the_sequence():
  """On a one-device (or model-less) run the constraint is skipped: the
  same loss as without; a sequence the axis does not divide is an error
  naming both numbers."""
  cfg = gpt.GPTConfig(vocab=V, seq_len=T, width=D, depth=2, heads=4)
  params = gpt.init(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  b = {"x": rng.integers(0, V, (2, T)).astype(np.int32),
       "y": rng.integers(0, V, (2, T)).astype(np.int32)}
  pa = gpt.GPTConfig(vocab=V, seq_len=T, width=D, depth=2, heads=4,
                     seq_shard="model")
  assert float(gpt.loss(params, b, pa)) == float(gpt.loss(params, b, cfg))
  mesh = zerojax.make_mesh("data=4,model=2")
  odd = {"x": b["x"][:, :T - 1], "y": b["y"][:, :T - 1]}
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="31 tokens.*divisible by 2"):
      jax.jit(functools.partial(gpt.loss, config=pa))(params, odd)
