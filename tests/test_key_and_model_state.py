"""Dropout keys, model state and optimizer arguments in the train step."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import checkpoint

WIDTH, ROWS = 8, 32


def _params():
  k = jax.random.split(jax.random.key(1), 2)
  return {
    "w": jax.random.normal(k[0], (WIDTH, WIDTH)) * 0.3,
    "head": jax.random.normal(k[1], (WIDTH, 3)) * 0.3,
  }


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
    "y": rng.normal(size=(ROWS, 3)).astype(np.float32),
  }


def dropout_loss(params, batch, *, key):
  q = zerojax.gather(params)
  h = jnp.tanh(batch["x"] @ q["w"])
  keep = jax.random.bernoulli(key, 0.5, h.shape)
  h = jnp.where(keep, h / 0.5, 0.0)
  return jnp.mean((h @ q["head"] - batch["y"]) ** 2)


def _emulated_step(params, batch, root, step, opt, opt_state, n=8, accum=1):
  """One step on one device with the documented keys:
  fold_in(fold_in(fold_in(root, step), device), micro_batch)."""
  rows = ROWS // (n * accum)
  grads, losses = [], []
  for d in range(n):
    for m in range(accum):
      key = jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(root, step), d), m
      )
      lo = (d * accum + m) * rows
      mb = jax.tree.map(lambda x: x[lo : lo + rows], batch)
      loss, g = jax.value_and_grad(dropout_loss)(params, mb, key=key)
      grads.append(g)
      losses.append(loss)
  g = jax.tree.map(lambda *xs: sum(xs) / len(xs), *grads)
  updates, opt_state = opt.update(g, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, np.mean(losses)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dropout_equals_the_documented_per_device_keys(mesh, stage, accum):
  root = jax.random.key(42)
  opt = optax.sgd(0.1)
  want, opt_state = _params(), opt.init(_params())
  tx = zerojax.zero(opt, stage=stage, mesh=mesh)
  state = zerojax.init(_params(), tx, key=root)
  step = zerojax.train_step(dropout_loss, tx, accum_steps=accum)
  for i in range(2):
    want, opt_state, want_loss = _emulated_step(
      want, _batch(i), root, i, opt, opt_state, accum=accum
    )
    state, metrics = step(state, _batch(i))
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
  got = zerojax.gather_params(state)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_masks_differ_across_devices_steps_and_micro_batches(mesh):
  seen = []

  def loss(params, batch, *, key):
    jax.debug.callback(
      lambda k: seen.append(bytes(np.asarray(k))), jax.random.key_data(key)
    )
    return jnp.mean(zerojax.gather(params)["w"]) * batch["x"].mean()

  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  state = zerojax.init(_params(), tx, key=jax.random.key(0))
  step = zerojax.train_step(loss, tx, accum_steps=2)
  for i in range(2):
    state, _ = step(state, _batch(i))
  jax.block_until_ready(state)
  # 2 steps x 8 devices x 2 micro-batches, every key different
  assert len(seen) == 32 and len(set(seen)) == 32


@pytest.mark.parametrize(
  "make_key",
  [lambda: jax.random.key(7), lambda: jax.random.PRNGKey(7), lambda: 7],
  ids=["typed", "raw", "int"],
)
def test_same_seed_same_run(mesh, make_key):
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)

  def run(key):
    state = zerojax.init(_params(), tx, key=key)
    step = zerojax.train_step(dropout_loss, tx)
    for i in range(3):
      state, _ = step(state, _batch(i))
    return zerojax.gather_params(state)

  a, b = run(make_key()), run(make_key())
  c = run(jax.random.key(8))
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["w"], c["w"])


def test_resumed_dropout_run_is_bitwise_the_straight_run(mesh, tmp_path):
  """Bitwise: both runs call the same compiled step on the same values
  (the restored state is the saved one, bit for bit)."""
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  step = zerojax.train_step(dropout_loss, tx)
  state = zerojax.init(_params(), tx, key=jax.random.key(3))
  for i in range(2):
    state, _ = step(state, _batch(i))
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(state)
  straight = state
  for i in range(2, 4):
    straight, _ = step(straight, _batch(i))
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    resumed, _ = ckpt.restore(_params(), tx)
  assert resumed.key.dtype == straight.key.dtype
  for i in range(2, 4):
    resumed, _ = step(resumed, _batch(i))
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------- model state
def bn_loss(params, batch, *, model_state):
  """A running mean of the hidden units and a call counter."""
  q = zerojax.gather(params)
  h = jnp.tanh(batch["x"] @ q["w"])
  new = {
    "mean": 0.9 * model_state["mean"] + 0.1 * h.mean(0),
    "calls": model_state["calls"] + 1,
  }
  return jnp.mean((h @ q["head"] - batch["y"]) ** 2), new


def _bn_state():
  return {"mean": jnp.zeros((WIDTH,)), "calls": jnp.zeros((), jnp.int32)}


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_model_state_is_averaged_over_devices_and_threaded(mesh, stage, accum):
  tx = zerojax.zero(optax.sgd(0.0), stage=stage, mesh=mesh)
  state = zerojax.init(_params(), tx, model_state=_bn_state())
  step = zerojax.train_step(bn_loss, tx, accum_steps=accum)
  batch = _batch()
  state, _ = step(state, batch)
  # Reference: each device runs its micro-batches in order, the floating
  # statistics are then averaged over devices; counters follow device 0.
  h = np.tanh(batch["x"] @ np.asarray(_params()["w"]))
  rows = ROWS // (8 * accum)
  means = []
  for d in range(8):
    m = np.zeros(WIDTH)
    for k in range(accum):
      lo = (d * accum + k) * rows
      m = 0.9 * m + 0.1 * h[lo : lo + rows].mean(0)
    means.append(m)
  np.testing.assert_allclose(
    state.model_state["mean"], np.mean(means, 0), rtol=1e-5, atol=1e-7
  )
  assert int(state.model_state["calls"]) == accum
  assert state.model_state["mean"].sharding.is_fully_replicated


def test_model_state_of_the_wrong_shape_is_a_clear_error(mesh):
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  state = zerojax.init(_params(), tx, model_state=_bn_state())

  def bad(params, batch, *, model_state):
    loss, new = bn_loss(params, batch, model_state=model_state)
    return loss, dict(new, mean=new["mean"][:3])

  with pytest.raises(
    zerojax.errors.LossOutputError,
    match=r"model_state\['mean'\] went from float32\[8\] to "
    r"float32\[3\]",
  ):
    zerojax.train_step(bad, tx)(state, _batch())
  with pytest.raises(zerojax.errors.LossOutputError, match="new_model_state"):
    zerojax.train_step(
      lambda p, b, model_state: bn_loss(p, b, model_state=model_state)[0], tx
    )(state, _batch())


def _tracked(update):
  """A loss whose model state leaf ``"t"`` takes ``update(old, h, batch)``
  (``h``: the hidden units, rows by width)."""

  def loss(params, batch, *, model_state):
    q = zerojax.gather(params)
    h = jnp.tanh(batch["x"] @ q["w"])
    new = {"t": update(model_state["t"], h, batch)}
    return jnp.mean((h @ q["head"] - batch["y"]) ** 2), new

  return loss


SPLIT_CHANGES = {  # per device, another state than the unsharded step's
  "running_max": (
    lambda t, h, b: jnp.maximum(t, jnp.max(h)),
    0.0,
    "reduce_max over the batch's rows",
  ),
  "running_sum": (
    lambda t, h, b: t + jnp.sum(h),
    0.0,
    "a sum over the examples not divided by their number",
  ),
  "running_var": (
    lambda t, h, b: 0.9 * t + 0.1 * jnp.var(h),
    0.0,
    "combines each example with a sum over the batch",
  ),
  # a mean at a device's 4 rows and at 8, not at the whole batch's 32
  "running_mean_of_at_most_8": (
    lambda t, h, b: 0.9 * t + 0.1 * jnp.sum(h) / min(h.shape[0], 8),
    0.0,
    "0.025 x the sums at 4 rows, 0.0125 x at 32",
  ),
  "examples_seen": (
    lambda t, h, b: t + h.shape[0],
    0,
    "a value computed from the batch's row count",
  ),
  "positives_seen": (
    lambda t, h, b: t + jnp.sum(h[:, 0] > 0),
    0,
    "device 0's counts only its rows",
  ),
}


@pytest.mark.parametrize("name", list(SPLIT_CHANGES))
def test_a_model_state_update_the_split_changes_is_refused_and_the_state_kept(
  mesh, name
):
  update, start, why = SPLIT_CHANGES[name]
  loss, batch = _tracked(update), _batch()
  t0 = jnp.asarray(
    start, jnp.float32 if isinstance(start, float) else jnp.int32
  )
  want = loss(_params(), batch, model_state={"t": t0})[1]["t"]
  tx = zerojax.zero(optax.sgd(0.1), stage=2, mesh=mesh)
  # per device (data parallelism's state, asked for) it is another number
  dp = zerojax.init(_params(), tx, model_state={"t": t0})
  dp, _ = zerojax.train_step(loss, tx, per_device_loss=True)(dp, batch)
  assert not np.isclose(float(dp.model_state["t"]), float(want), rtol=1e-4)
  state = zerojax.init(_params(), tx, model_state={"t": t0})
  with pytest.raises(zerojax.errors.ModelStateUpdateError) as e:
    zerojax.train_step(loss, tx)(state, batch)
  assert "model_state['t']" in str(e.value) and why in str(e.value)
  assert "per_device_loss=True" in str(e.value)
  assert int(state.step) == 0 and float(state.model_state["t"]) == start


def test_a_model_state_update_the_split_keeps_trains_with_no_warning(mesh):
  """A running mean over examples, a step counter, and a count of the
  examples seen from a scalar batch leaf (the whole batch's size) are the
  unsharded step's state."""

  def loss(params, batch, *, model_state):
    q = zerojax.gather(params)
    h = jnp.tanh(batch["x"] @ q["w"])
    ms = model_state
    new = {
      "mean": 0.9 * ms["mean"] + 0.1 * h.mean(0),
      "calls": ms["calls"] + 1,
      "seen": ms["seen"] + batch["rows"],
    }
    return jnp.mean((h @ q["head"] - batch["y"]) ** 2), new

  start = dict(_bn_state(), seen=jnp.zeros((), jnp.int32))
  batch = dict(_batch(), rows=np.int32(ROWS))
  want = loss(_params(), batch, model_state=start)[1]
  tx = zerojax.zero(optax.sgd(0.0), stage=3, mesh=mesh)
  state = zerojax.init(_params(), tx, model_state=start)
  with warnings.catch_warnings():
    warnings.simplefilter("error", zerojax.errors.LossUnverifiedWarning)
    state, _ = zerojax.train_step(loss, tx)(state, batch)
  np.testing.assert_allclose(
    state.model_state["mean"], want["mean"], rtol=1e-5, atol=1e-7
  )
  assert int(state.model_state["calls"]) == 1
  assert int(state.model_state["seen"]) == ROWS


def test_model_state_is_checkpointed(mesh, tmp_path):
  tx = zerojax.zero(optax.sgd(0.1), stage=2, mesh=mesh)
  state = zerojax.init(_params(), tx, model_state=_bn_state())
  state, _ = zerojax.train_step(bn_loss, tx)(state, _batch())
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(state)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(
      checkpoint.CheckpointError, match="model_state_template"
    ):
      ckpt.restore(_params(), tx)
    back, _ = ckpt.restore(_params(), tx, model_state_template=_bn_state())
  np.testing.assert_array_equal(
    back.model_state["mean"], state.model_state["mean"]
  )
  assert int(back.model_state["calls"]) == 1


# ------------------------------------------------------ optimizer arguments
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduce_on_plateau_gets_the_loss(mesh, stage):
  def opt():
    return optax.chain(
      optax.sgd(0.5),
      optax.contrib.reduce_on_plateau(
        factor=0.5, patience=0, accumulation_size=1, rtol=0.5, atol=0.0
      ),
    )

  def loss(params, batch):
    return dropout_free(zerojax.gather(params), batch)

  data = [_batch(0)] * 6  # the same batch: the loss plateaus
  ref, params = opt(), _params()
  ref_state = ref.init(params)
  for b in data:
    value, g = jax.value_and_grad(dropout_free)(params, b)
    updates, ref_state = ref.update(g, ref_state, params, value=value)
    params = optax.apply_updates(params, updates)
  tx = zerojax.zero(opt(), stage=stage, mesh=mesh)
  state = zerojax.init(_params(), tx)
  step = zerojax.train_step(loss, tx)
  for b in data:
    state, _ = step(state, b)
  got = zerojax.gather_params(state)
  for k in params:
    np.testing.assert_allclose(got[k], params[k], rtol=1e-5, atol=1e-6)
  scale = float(zerojax.gather_opt_state(state)[1].scale)
  assert scale == float(ref_state[1].scale) and scale < 1.0  # it did reduce


def dropout_free(q, batch):
  h = jnp.tanh(batch["x"] @ q["w"])
  return jnp.mean((h @ q["head"] - batch["y"]) ** 2)


def test_extra_update_arguments_are_forwarded(mesh):
  seen = {}

  def init(params):
    return optax.EmptyState()

  def update(updates, state, params=None, *, epoch=None, **_):
    seen["epoch"] = epoch
    return jax.tree.map(lambda g: -0.1 * g * epoch, updates), state

  opt = optax.GradientTransformationExtraArgs(init, update)
  tx = zerojax.zero(opt, stage=1, mesh=mesh)
  state = zerojax.init(_params(), tx)
  new, _ = zerojax.train_step(
    lambda p, b: dropout_free(p, b), tx, donate=False
  )(state, _batch(), epoch=2.0)
  g = jax.grad(dropout_free)(_params(), _batch())
  np.testing.assert_allclose(
    zerojax.gather_params(new)["w"],
    _params()["w"] - 0.2 * g["w"],
    rtol=1e-5,
    atol=1e-6,
  )
