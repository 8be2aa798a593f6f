"""Every parameter Optax trains, every state Optax keeps, every way it is called.

Complex weights trained exactly at stages 0-3 through each entry point;
``jax.jit(tx.init)`` / ``jax.jit(tx.update)`` for every leaf shape; typed
PRNG keys in the optimizer state; extra ``update`` arguments that are not
arrays; one compile for a user's loop; leaves zerojax does not train said
in a warning.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests import toy
from zerojax import checkpoint

TARGET = jnp.array([1.0, -1.0, 1.0], jnp.complex64) * (1 + 1j)


def parabola(p):
  return jnp.sum(optax.tree.norm(p["w"] - TARGET, squared=True))


def rosenbrock(p):
  w = p["w"]
  a = 1.0 + 1j
  return (
    jnp.abs(a - w[0]) ** 2 + 100.0 * jnp.abs(w[1] - w[0] ** 2) ** 2
  ).astype(jnp.float32)


INITS = {
  "parabola": jnp.array([-1.0, 10.0, 1.0], jnp.complex64),
  "rosenbrock": jnp.array([0.0, 0.0], jnp.complex64),
}
OBJECTIVES = {"parabola": parabola, "rosenbrock": rosenbrock}


def _optax(opt, objective, params, steps):
  """Optax's own complex convention: the conjugated gradient."""
  state = opt.init(params)
  for _ in range(steps):
    g = jax.tree.map(jnp.conj, jax.grad(objective)(params))
    updates, state = opt.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("target", ["parabola", "rosenbrock"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_complex_params_train_like_optax_through_train_step(
  mesh, stage, target
):
  objective, params = OBJECTIVES[target], {"w": INITS[target]}
  want = _optax(optax.adam(0.1), objective, params, 5)
  tx = zerojax.zero(optax.adam(0.1), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(
    lambda p, b: objective(zerojax.gather(p)) + 0.0 * b.sum(), tx
  )
  for _ in range(5):
    state, _ = step(state, jnp.zeros((8,)))
  got = zerojax.gather_params(state)["w"]
  assert got.dtype == jnp.complex64
  np.testing.assert_allclose(got, want["w"], rtol=1e-5, atol=1e-6)
  assert state.spec.leaves[0].trainable
  # the moments are complex and sharded at stages 1-3, like the param
  mu = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 1]
  assert mu and all(x.dtype == jnp.complex64 for x in mu)
  assert all(("data" in str(x.sharding.spec)) == (stage >= 1) for x in mu)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_complex_params_through_the_dropin_and_value_and_grad(mesh, stage):
  params = {"w": INITS["parabola"]}
  want = _optax(optax.adam(0.1), parabola, params, 5)
  tx = zerojax.zero(optax.adam(0.1), stage=stage, mesh=mesh)

  @jax.jit
  def step(p, s):
    g = jax.tree.map(jnp.conj, jax.grad(parabola)(p))
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = jax.device_put({"w": INITS["parabola"]}, NamedSharding(mesh, P()))
  s = tx.init(p)
  for _ in range(5):
    p, s = step(p, s)
  np.testing.assert_allclose(p["w"], want["w"], rtol=1e-5, atol=1e-6)
  # value_and_grad returns jax's gradient (as jax.value_and_grad does);
  # apply_gradients conjugates complex leaves, as train_step does
  state = zerojax.init(params, tx)
  grad_fn = zerojax.value_and_grad(
    lambda q, b: parabola(zerojax.gather(q)) + 0.0 * b.sum(), tx
  )
  for _ in range(5):
    _, g = grad_fn(state, jnp.zeros((8,)))
    state = zerojax.apply_gradients(state, g)
  np.testing.assert_allclose(
    zerojax.gather_params(state)["w"], want["w"], rtol=1e-5, atol=1e-6
  )


def test_complex_params_checkpoint_and_plan(mesh, tmp_path):
  params = {"w": jnp.arange(24, dtype=jnp.complex64).reshape(2, 12) * (1 + 2j)}
  tx = zerojax.zero(optax.adam(0.1), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(state, force=True)
    ckpt.wait()
    back, _ = ckpt.restore(
      params, zerojax.zero(optax.adam(0.1), stage=1, mesh=mesh)
    )
  np.testing.assert_array_equal(zerojax.gather_params(back)["w"], params["w"])
  # 8 bytes per complex64 element in the byte counts: (2, 12) is stored
  # (2, 16) over 8 devices: params, and two moments (plus Adam's count)
  got = zerojax.diagnostics.state_bytes(state)
  assert got["params"] == pytest.approx(2 * 16 * 8 / 8)
  assert sum(v for k, v in got.items() if k.startswith("opt")) == pytest.approx(
    2 * 2 * 16 * 8 / 8 + 4, abs=4
  )


def test_complex_params_under_a_bf16_policy_raise_naming_the_leaf(mesh):
  tx = zerojax.zero(
    optax.adam(0.1),
    stage=3,
    mesh=mesh,
    policy=zerojax.Policy(param_dtype=jnp.bfloat16),
  )
  with pytest.raises(
    ValueError,
    match=r"\['spectral'\] is complex64.*"
    r"param_dtype=bfloat16",
  ):
    zerojax.init(
      {"spectral": jnp.ones((4, 8), jnp.complex64), "w": jnp.ones((4, 8))}, tx
    )
  # a complex leaf takes the complex dtype of the policy's precision
  policy = zerojax.Policy(param_dtype=jnp.float32, master_dtype=jnp.float64)
  assert policy.master(np.complex64) == np.complex128
  assert policy.compute(np.complex64) == np.complex64
  assert policy.master(np.float32) == np.float64


def test_leaves_not_trained_are_said_in_a_warning(mesh):
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  with pytest.warns(
    UserWarning, match=r"params\['ids'\] \(int32\).*not trained"
  ):
    zerojax.init({"w": jnp.ones((8,)), "ids": jnp.arange(3)}, tx)
  with pytest.warns(UserWarning, match=r"params\['ids'\] \(int32\)") as got:
    tx.init({"w": jnp.ones((8,)), "ids": jnp.arange(3)})
  # the warning names the caller's line, not one inside zerojax
  assert {w.filename for w in got} == {__file__}, [w.filename for w in got]


@pytest.mark.parametrize("shape", [(2,), (5, 12), (7, 300), (3, 1, 9)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_jit_of_init_and_update_works_for_every_leaf_shape(mesh, stage, shape):
  tx = zerojax.zero(optax.adam(0.1), stage=stage, mesh=mesh)
  ref = optax.adam(0.1)
  p = jnp.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape)
  g = jnp.cos(p)
  s = jax.jit(tx.init)(p)
  u, s2 = jax.jit(tx.update)(g, s, p)
  want_u, _ = ref.update(g, ref.init(p), p)
  np.testing.assert_allclose(u, want_u, rtol=1e-6)
  assert u.sharding.is_fully_replicated  # the params' own (replicated) layout
  for x in jax.tree.leaves(s2):  # the state stays in its stage layout
    assert ("data" in str(x.sharding.spec)) == (stage >= 1 and x.ndim >= 1)


def test_typed_prng_key_in_optimizer_state(mesh, tmp_path):
  """optax.noisy_sgd keeps a typed key in its state: carried replicated,
  checkpointed, never sharded; the numbers are Optax's."""
  opt = lambda: optax.noisy_sgd(0.1, eta=0.01, key=3)
  params = {"w": jnp.linspace(0.0, 1.0, 12)}
  loss = lambda p: jnp.sum(p["w"] ** 2)
  ref, rs = opt(), None
  rs, rp = ref.init(params), params
  for _ in range(3):
    u, rs = ref.update(jax.grad(loss)(rp), rs, rp)
    rp = optax.apply_updates(rp, u)
  tx = zerojax.zero(opt(), stage=2, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(
    lambda p, b: loss(zerojax.gather(p)) + 0 * b.sum(), tx
  )
  for _ in range(3):
    state, _ = step(state, jnp.zeros((8,)))
  np.testing.assert_allclose(
    zerojax.gather_params(state)["w"], rp["w"], rtol=1e-6
  )
  keys = [
    x
    for x in jax.tree.leaves(state.opt_state)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  ]
  assert len(keys) == 1 and keys[0].sharding.spec == P()
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(state, force=True)
    ckpt.wait()
    back, _ = ckpt.restore(params, zerojax.zero(opt(), stage=1, mesh=mesh))
  back_keys = [
    x
    for x in jax.tree.leaves(back.opt_state)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  ]
  np.testing.assert_array_equal(
    jax.random.key_data(back_keys[0]), jax.random.key_data(keys[0])
  )
  # and through the drop-in
  d = zerojax.zero(opt(), stage=1, mesh=mesh)
  ds = d.init(params)
  u, ds = jax.jit(d.update)(jax.grad(loss)(params), ds, params)
  ru, _ = ref.update(jax.grad(loss)(params), ref.init(params), params)
  np.testing.assert_allclose(u["w"], ru["w"], rtol=1e-6)


def test_extra_args_of_any_type_reach_the_inner_optimizer(mesh):
  """A callable extra argument (sophia's obj_fn) and a string pass through
  (the callable, on an Explicit mesh, wrapped to run on the caller's axis
  types); arrays are traced."""
  seen = {}

  def inner_update(
    updates, state, params=None, *, obj_fn=None, tag=None, scale=1.0, **_
  ):
    seen["obj_fn"], seen["tag"] = obj_fn, tag
    return jax.tree.map(lambda g: -scale * g, updates), state

  inner = optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(), inner_update
  )
  fn = lambda p: jnp.sum(p**2)
  params = jnp.arange(8.0)
  for stage in (0, 1, 2):
    tx = zerojax.zero(inner, stage=stage, mesh=mesh)
    s = tx.init(params)
    u, _ = tx.update(
      params, s, params, obj_fn=fn, tag="x", scale=jnp.array(2.0)
    )
    np.testing.assert_allclose(u, -2.0 * params)
    assert getattr(seen["obj_fn"], "__wrapped__", seen["obj_fn"]) is fn
    assert seen["tag"] == "x"
    u, _ = jax.jit(lambda g, s, p: tx.update(g, s, p, obj_fn=fn, tag="y"))(
      params, s, params
    )
    assert seen["tag"] == "y"
  state = zerojax.init({"w": params}, zerojax.zero(inner, stage=2, mesh=mesh))
  step = zerojax.train_step(
    lambda p, b: fn(zerojax.gather(p)["w"]) + 0 * b.sum(), state.spec.tx
  )
  state, _ = step(state, jnp.zeros((8,)), obj_fn=fn, tag="z")
  assert getattr(seen["obj_fn"], "__wrapped__", seen["obj_fn"]) is fn
  assert seen["tag"] == "z"
  state = zerojax.apply_gradients(state, {"w": params}, obj_fn=fn, tag="w")
  assert seen["tag"] == "w"


def _fast_grads(tx):
  """optax.lookahead's update takes the gradients of ``params.fast``."""
  return optax.GradientTransformation(
    tx.init, lambda g, s, p=None: tx.update(g.fast, s, p)
  )


@pytest.mark.parametrize("offload", [False, True])
def test_lookahead_trains_like_optax_behind_an_adapter(mesh, offload):
  """optax.lookahead takes the gradients of the fast params, not of every
  param: through zerojax behind an adapter that selects them it trains
  like Optax (stage 3, the state on the host or not); without one the
  error says what zerojax called the update with and names the adapter."""
  target = jnp.arange(16.0).reshape(4, 4) / 10
  objective = lambda w: jnp.sum((jnp.tanh(w) - target) ** 2)
  la = lambda: optax.lookahead(optax.adam(0.05), 2, 0.5)
  params = optax.LookaheadParams.init_synced({"w": jnp.ones((4, 4))})
  state = la().init(params)
  want = params
  for _ in range(5):
    g = jax.grad(lambda p: objective(p["w"]))(want.fast)
    updates, state = la().update(g, state, want)
    want = optax.apply_updates(want, updates)

  loss = lambda p, b: objective(zerojax.gather(p.fast)["w"]) + 0 * b.sum()
  tx = zerojax.zero(_fast_grads(la()), stage=3, mesh=mesh, offload=offload)
  zstate = zerojax.init(params, tx)
  step = zerojax.train_step(loss, tx)
  for _ in range(5):
    zstate, _ = step(zstate, jnp.zeros((8,)))
  got = zerojax.gather_params(zstate)
  assert not np.allclose(got.slow["w"], got.fast["w"])  # 5 steps: unsynced
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
    got,
    want,
  )

  tx = zerojax.zero(la(), stage=3, mesh=mesh, offload=offload)
  zstate = zerojax.init(params, tx)
  step = zerojax.train_step(loss, tx)
  with pytest.raises(ValueError) as e:
    step(zstate, jnp.zeros((8,)))
  notes = "\n".join(getattr(e.value, "__notes__", []))
  assert "update(grads, opt_state, params)" in notes
  assert "tx.update(g.fast, s, p)" in notes
  # nothing ran: the state is the one given
  np.testing.assert_array_equal(
    zerojax.gather_params(zstate).fast["w"], params.fast["w"]
  )


def _model_params():
  k = jax.random.split(jax.random.key(0), 3)
  return {
    "w": jax.random.normal(k[0], (5, 12)),
    "b": jnp.zeros((2,)),
    "v": jax.random.normal(k[1], (7, 300)),
  }


def _user_step(tx):
  loss = lambda p, x: (
    jnp.sum((x @ p["w"]) ** 2) + jnp.sum(p["v"] ** 2) + jnp.sum(p["b"])
  )

  @jax.jit
  def step(params, opt_state, x):
    grads = jax.grad(loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_users_jitted_loop_compiles_once(mesh, stage):
  """Params created under jax.set_mesh (as the README says) stay in the
  layout the updates come back in: one compile over three steps."""
  tx = zerojax.zero(optax.adamw(1e-2), stage=stage, mesh=mesh)
  with jax.set_mesh(mesh):
    params = _model_params()
  params, compiles = _three_steps(tx, params)
  assert compiles == 1
  assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(params))


def _three_steps(tx, params):
  """tx.init without a warning, then three steps of a user's loop:
  ``(params, compiles)``, the compiles no more than the same loop's with
  plain Optax."""
  with toy.warnings_as_errors():
    opt_state = tx.init(params)
  step, x = _user_step(tx), jnp.ones((4, 5))
  plain, plain_p = _user_step(tx.inner), params
  plain_s = tx.inner.init(params)
  for _ in range(3):
    params, opt_state = step(params, opt_state, x)
    plain_p, plain_s = plain(plain_p, plain_s, x)
  assert step._cache_size() <= plain._cache_size()
  return params, step._cache_size()


def test_params_off_the_mesh_get_told_how_to_place_them(mesh):
  tx = zerojax.zero(optax.adamw(1e-2), stage=1, mesh=mesh)
  params = _model_params()  # one device, uncommitted
  with pytest.warns(UserWarning, match=r"jax.set_mesh\(tx.mesh\).*device_put"):
    tx.init(params)
  # placed with P() (JAX's types write P(None, None)): on an Explicit mesh
  # JAX compiles such a loop twice, plain Optax or not
  _, compiles = _three_steps(
    tx, jax.device_put(params, NamedSharding(mesh, P()))
  )
  assert compiles <= 2


def test_zeropp_with_complex_params_raises_naming_the_leaf(mesh):
  tx = zerojax.zero(
    optax.adam(0.1), stage=3, mesh=mesh, zeropp=zerojax.ZeroPP(grad_bits=8)
  )
  with pytest.raises(ValueError, match=r"\['c'\] is complex64.*ZeRO\+\+"):
    zerojax.init({"c": jnp.ones((8,), jnp.complex64)}, tx)
