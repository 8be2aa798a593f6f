"""A scalar batch leaf (a loss weight, a temperature, a schedule's value) is
the same for every example, as a plain ``jit`` step's argument is: every
stage gives the plain step's numbers, a new value does not retrace, and
the loss sees the scalar in its own dtype and weak type."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy


def weighted(params, batch):
  """toy's loss scaled by the batch's scalar ``w``, plus ``t`` times an L2
  term; returns ``(loss, aux)`` with a per-example leaf and ``t`` as the
  loss saw it (times a bf16 one: bf16 if and only if ``t`` is weak)."""
  base = toy.loss_fn(dict(params, ids=jnp.arange(4)), batch)
  l2 = jnp.sum(zerojax.gather(params["head"]) ** 2)
  loss = batch["w"] * base + batch["t"] * l2
  aux = {
    "rows": batch["x"].astype(jnp.float32) * batch["w"],
    "t": batch["t"] * jnp.ones((), jnp.bfloat16),
  }
  return loss, aux


def _params():
  """toy's params without its integer buffer (plain ``jax.grad`` refuses
  it)."""
  params = toy.init_params(jax.random.key(0))
  del params["ids"]
  return params


def _plain(params, opt, data, values):
  """Plain Optax in one ``jit``, the scalars passed as its arguments."""

  @jax.jit
  def step(p, s, batch, w, t):
    full = dict(batch, w=w, t=t)
    (loss, _), g = jax.value_and_grad(weighted, has_aux=True)(p, full)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  p, s, losses = params, opt.init(params), []
  for batch, (w, t) in zip(data, values):
    p, s, loss = step(p, s, batch, w, t)
    losses.append(float(loss))
  return p, losses


# Python floats, then a NumPy scalar and a 0-d jax.Array: a new value
# each step, a new type (weak or not) every second step
VALUES = [
  (1.0, 0.01),
  (0.5, 0.02),
  (np.float32(2.0), jnp.asarray(0.0)),
  (np.float32(0.25), jnp.asarray(0.03)),
]


@pytest.mark.parametrize(
  "stage,accum", [(0, 1), (1, 2), (2, 1), (3, 1), (3, 2)]
)
def test_scalar_batch_leaves_train_like_a_plain_step(any_mesh, stage, accum):
  params = _params()
  data = toy.batches(4)
  want, want_losses = _plain(params, optax.adamw(1e-2), data, VALUES)
  tx = zerojax.zero(optax.adamw(1e-2), stage=stage, mesh=any_mesh)
  state = zerojax.init(params, tx)
  traced = []

  def loss_fn(p, b):
    traced.append(np.shape(b["w"]))
    return weighted(p, b)

  step = zerojax.train_step(loss_fn, tx, accum_steps=accum)
  losses, traces = [], []
  for batch, (w, t) in zip(data, VALUES):
    state, m = step(state, dict(batch, w=w, t=t))
    losses.append(float(m["loss"]))
    traces.append(len(traced))
  # the loss was handed scalars; a new value of the same type traced
  # nothing new (a new type does, as in a plain jit)
  assert traced and set(traced) == {()}
  assert traces[0] == traces[1] < traces[2] == traces[3]
  np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
  got = zerojax.gather_params(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_scalars_keep_their_weak_type_and_per_example_aux_its_rows(mesh):
  params = _params()
  batch = toy.batches(1)[0]
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  evaluate = zerojax.eval_step(weighted, tx, has_aux=True)
  # a Python float is weak, as a jit argument is: bf16 times it is bf16
  _, aux = evaluate(state, dict(batch, w=0.5, t=3.0))
  assert aux["t"].dtype == jnp.bfloat16
  assert float(aux["t"]) == 3.0
  # a float32 array is not: the product is float32, as in plain JAX
  _, aux = evaluate(state, dict(batch, w=0.5, t=np.float32(3.0)))
  assert aux["t"].dtype == jnp.float32
  # a NumPy bfloat16 (ml_dtypes) is a number too
  _, aux = evaluate(state, dict(batch, w=0.5, t=jnp.bfloat16(3.0)))
  assert aux["t"].dtype == jnp.bfloat16
  # the per-example leaf comes back with every row, in batch order
  np.testing.assert_array_equal(aux["rows"], batch["x"] * 0.5)


def test_scalars_through_value_and_grad_a_users_jit_and_lower(mesh):
  params = _params()
  batch = dict(toy.batches(1)[0], w=0.5, t=0.01)
  want_loss, want_grads = jax.value_and_grad(lambda p: weighted(p, batch)[0])(
    params
  )
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  grad_fn = zerojax.value_and_grad(weighted, tx, has_aux=True)
  (loss, _), grads = grad_fn(state, batch)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  # inside the caller's own jit the scalar is a tracer, broadcast there
  loss_in_jit = jax.jit(lambda s, w: grad_fn(s, dict(batch, w=w))[0][0])
  np.testing.assert_allclose(
    float(loss_in_jit(state, 0.5)), float(want_loss), rtol=1e-6
  )
  full = zerojax.gather_params(state.replace(params=grads))
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # an abstract batch lowers to the program the real one runs
  step = zerojax.train_step(weighted, tx)
  abstract = jax.eval_shape(lambda b: b, batch)  # Python floats: weak
  compiled = step.lower(state, abstract).compile()
  real = step.lower(state, batch).compile()
  assert compiled.as_text() == real.as_text()


def test_a_batch_of_only_scalars_is_refused_before_anything_runs(mesh):
  params = _params()
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(weighted, tx)
  with pytest.raises(ValueError, match="every batch leaf is a scalar"):
    step(state, {"w": 1.0, "t": 0.0})
  batch = dict(toy.batches(1)[0], w=1.0, t=0.0)
  for bad, what in [
    ("linear", "type str"),
    (np.array(["a"] * 32), "type NumPy ndarray of dtype <U1"),
    (object(), "type object"),
  ]:
    with pytest.raises(TypeError, match=rf"batch leaf \['t'\] has {what};"):
      step(state, dict(batch, t=bad))
  assert int(state.step) == 0 and not any(
    x.is_deleted() for x in jax.tree.leaves(state)
  )


def test_shard_batch_passes_scalars_through(mesh):
  tx = zerojax.zero(optax.adamw(1e-2), stage=1, mesh=mesh)
  out = zerojax.shard_batch({"x": np.arange(16.0), "w": 0.5}, tx, 16)
  assert out["w"] == 0.5
  assert out["x"].sharding.is_equivalent_to(zerojax.batch_sharding(tx), 1)
