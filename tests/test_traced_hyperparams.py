"""Optimizers that close over traced values typed on the caller's mesh.

``optax.inject_hyperparams(make)(learning_rate=...)`` with ``make`` returning
the drop-in builds the inner optimizer inside the caller's ``jit``, closed
over a traced learning rate typed on the caller's (Explicit) mesh; so does
a user factory called in a jitted loop. zerojax runs such an optimizer on
the caller's axis types (``StateSpec.inner_update``) and must train as
plain Optax does, on both axis types.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy

OPTIMIZERS = {
  "adamw": lambda learning_rate: optax.adamw(learning_rate),
  # non-elementwise: trust ratios over whole leaves
  "lamb": lambda learning_rate: optax.lamb(learning_rate),
  "clip+sgd": lambda learning_rate: optax.chain(
    optax.clip_by_global_norm(0.05), optax.sgd(learning_rate, 0.9)
  ),
}


def _params():
  # an uneven leaf (5 rows on 8 devices), a divisible one, a scalar
  return {
    "w": jnp.linspace(-1.0, 1.0, 5 * 12).reshape(5, 12),
    "v": jnp.linspace(0.0, 2.0, 16 * 8).reshape(16, 8),
    "s": jnp.asarray(0.5),
  }


def _loss(p):
  return sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree.leaves(p))


def _run(make, params, steps=3):
  """An Optax loop under jit, the learning rate halved after each step
  through the injected hyperparameter."""
  tx = optax.inject_hyperparams(make)(learning_rate=0.05)

  @jax.jit
  def step(p, s):
    updates, s = tx.update(jax.grad(_loss)(p), s, p)
    hp = dict(s.hyperparams, learning_rate=s.hyperparams["learning_rate"] / 2)
    return optax.apply_updates(p, updates), s._replace(hyperparams=hp)

  state = jax.jit(tx.init)(params)
  for _ in range(steps):
    params, state = step(params, state)
  return params, state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_inject_hyperparams_around_the_dropin_trains_like_optax(
  any_mesh, stage, name
):
  make = OPTIMIZERS[name]
  with jax.set_mesh(any_mesh):
    params = _params()
    want_p, want_s = _run(make, params)
    got_p, got_s = _run(
      lambda learning_rate: zerojax.zero(
        make(learning_rate), stage=stage, mesh=any_mesh
      ),
      params,
    )
  # the same operations, in two programs: up to the order of their sums
  # (the largest leaf's norm adds 128 squares)
  toy.assert_same_up_to_summation_order(got_p, want_p, terms=128)
  # the drop-in's state is stored padded (a 5-row leaf to 8 rows)
  logical = jax.tree.map(
    lambda a, b: np.asarray(a)[tuple(slice(0, n) for n in np.shape(b))],
    got_s.inner_state,
    want_s.inner_state,
  )
  toy.assert_same_up_to_summation_order(logical, want_s.inner_state, terms=128)
  # and the optimizer state is laid out as the stage says
  if stage:
    mu = jax.tree.leaves(got_s.inner_state)
    assert any(not x.sharding.is_fully_replicated for x in mu)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_factory_called_in_a_jitted_loop_closes_over_a_traced_scale(
  mesh, stage
):
  """A user's loop that builds the drop-in inside ``jit`` from a traced
  value (a schedule of its own), on ``jax.make_mesh``'s Explicit axes."""
  with jax.set_mesh(mesh):
    params = _params()

    def run(wrap):
      state = jax.jit(wrap(optax.adam(1.0)).init)(params)

      @jax.jit
      def step(p, s, scale):
        tx = wrap(optax.chain(optax.scale_by_adam(), optax.scale(-scale)))
        updates, s = tx.update(jax.grad(_loss)(p), s, p)
        return optax.apply_updates(p, updates), s

      p = params
      for i in range(3):
        p, state = step(p, state, jnp.asarray(0.1 / (i + 1)))
      return p

    want = run(lambda t: t)
    got = run(lambda t: zerojax.zero(t, stage=stage, mesh=mesh))
  toy.assert_same_up_to_summation_order(got, want, terms=128)


def test_train_step_with_injected_hyperparams_changed_between_steps(mesh):
  """``zero(inject_hyperparams(adamw)(...))``: the learning rate lives in
  the sharded state and a loop changes it between steps, as with Optax."""
  params = toy.layered_params(2, 16, 32)
  data = toy.batches(3, vocab=32, classes=32)
  opt = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)
  tx = zerojax.zero(opt, stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(toy.layered_loss, tx)
  ref_p, ref_s = params, opt.init(params)
  grad = jax.jit(jax.grad(toy.plain_layered_loss))
  for i, b in enumerate(data):
    state, _ = step(state, b)
    u, ref_s = opt.update(grad(ref_p, b), ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
    lr = 1e-2 / (i + 2)
    hp = dict(state.opt_state.hyperparams, learning_rate=jnp.asarray(lr))
    state = state.replace(opt_state=state.opt_state._replace(hyperparams=hp))
    ref_s.hyperparams["learning_rate"] = jnp.asarray(lr)
  assert toy.rel_err(zerojax.gather_params(state), ref_p) < 1e-6
  assert float(
    zerojax.gather_opt_state(state).hyperparams["learning_rate"]
  ) == np.float32(1e-2 / 4)
