"""A loop whose carry starts from a constant and becomes per-example in the
loop -- a Flax RNN's initial carry, ``optax.ctc_loss``'s, a user's
``jnp.zeros((rows, width))`` -- and branches of which one returns a
constant where another returns a per-example value train, evaluate and
differentiate with the numbers of the plain step, at every stage, on
Explicit and Auto axes.

Inside ``jax.shard_map``'s per-device types JAX refuses such a carry (its
type changes in the loop) and such branches (their types differ); the
step then runs the loss with those types off and reduces every gradient
explicitly."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy

# the loss check reads each of these losses as a mean (optax.ctc_loss's
# scatter into a constant and its reshapes included): no warning
pytestmark = pytest.mark.filterwarnings(
  "error::zerojax.errors.LossUnverifiedWarning"
)


class _LSTM(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.RNN(nn.LSTMCell(8))(x)  # its initial carry: jnp.zeros
    return nn.Dense(3)(h)


_model = _LSTM()


def _batch(seed=0, rows=16):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(rows, 6, 4)).astype(np.float32),
    "y": rng.integers(1, 3, (rows, 2)).astype(np.int32),
  }


def lstm_regression(params, b):
  out = _model.apply(params, b["x"])  # (rows, time, 3)
  return jnp.mean((out[:, -1, :2] - b["y"]) ** 2)


def lstm_ctc(params, b):
  logits = _model.apply(params, b["x"])
  paddings = jnp.zeros(logits.shape[:2])
  labels_pad = jnp.zeros(b["y"].shape, jnp.float32)
  return jnp.mean(optax.ctc_loss(logits, paddings, b["y"], labels_pad))


def zero_carry_scan(params, b):  # a user's scan from jnp.zeros
  w = zerojax.gather(params)["params"]["Dense_0"]["kernel"]  # (8, 3)
  xs = jnp.swapaxes(b["x"], 0, 1)  # (time, rows, 4)
  h0 = jnp.zeros((xs.shape[1], 3))

  def cell(h, x):
    h = jnp.tanh(h + x[:, :3] @ w[:3])
    return h, h

  h, _ = jax.lax.scan(cell, h0, xs)
  return jnp.mean((h[:, :2] - b["y"]) ** 2) + lstm_regression(params, b)


def branch_to_a_constant(params, b):  # lax.cond on a param: zeros or rows
  w = params["params"]["Dense_0"]["kernel"]
  h = jnp.tanh(b["x"][:, -1, :3] @ w[:3])
  h = jax.lax.cond(w[0, 0] > -10.0, lambda: h, lambda: jnp.zeros(h.shape))
  return jnp.mean((h[:, :2] - b["y"]) ** 2)


def _params():
  return _model.init(jax.random.key(0), _batch()["x"])


def _close(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def _assert_trains_like_plain(loss, opt, tx, **step_kw):
  batches = [_batch(seed=i) for i in range(2)]
  want, want_losses = toy.optax_run(loss, opt, _params(), batches)
  got, losses, notes = toy.zero_run(loss, tx, _params(), batches, **step_kw)
  assert not [n for n in notes if "mean over the batch" in n], notes
  np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
  _close(got, want)


@pytest.mark.parametrize(
  "loss",
  [lstm_regression, lstm_ctc, zero_carry_scan, branch_to_a_constant],
  ids=lambda f: f.__name__,
)
@pytest.mark.parametrize("stage,accum", [(0, 1), (1, 1), (2, 2), (3, 1)])
def test_a_loop_from_a_constant_carry_trains_like_the_plain_step(
  mesh, loss, stage, accum
):
  opt = optax.sgd(0.5, momentum=0.9)  # not scale-invariant: a sum counts
  tx = zerojax.zero(opt, stage=stage, mesh=mesh)
  _assert_trains_like_plain(loss, opt, tx, accum_steps=accum)


def test_on_auto_axes_in_eval_and_in_the_callers_jit(any_mesh):
  b = _batch()
  opt = optax.sgd(0.5)
  want_params, (want,) = toy.optax_run(lstm_ctc, opt, _params(), [b])
  tx = zerojax.zero(opt, stage=3, mesh=any_mesh)
  state = zerojax.init(_params(), tx)
  ev = zerojax.eval_step(lstm_ctc, tx, gather="all")(state, b)
  np.testing.assert_allclose(float(ev), want, rtol=2e-6)
  vg = jax.jit(zerojax.value_and_grad(lstm_ctc, tx, gather="all"))
  loss, grads = vg(state, zerojax.shard_batch(b, tx, 16))
  np.testing.assert_allclose(float(loss), want, rtol=2e-6)
  _close(
    zerojax.gather_params(zerojax.apply_gradients(state, grads)), want_params
  )


def test_a_loss_that_fails_for_another_reason_still_raises(mesh):
  """Only the carry's refusal is answered by dropping the types: any other
  error inside the loss reaches the user, and the state is kept."""

  def broken(params, b):
    lstm_regression(params, b)
    raise RuntimeError("the model's own bug")

  tx = zerojax.zero(optax.sgd(0.1), stage=2, mesh=mesh)
  state = zerojax.init(_params(), tx)
  with pytest.raises(RuntimeError, match="the model's own bug") as err:
    zerojax.train_step(broken, tx)(state, _batch())
  assert any("check_vma=False" in n for n in err.value.__notes__)
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))


@pytest.mark.parametrize("axes", ["replica=2,data=4", "data=4,model=2"])
def test_on_pod_meshes(axes):
  """Hybrid sharding, and a model axis, whose collectives run in regions
  nested in the per-device program (untyped with it)."""
  opt = optax.sgd(0.5, momentum=0.9)
  tx = zerojax.zero(opt, stage=3, mesh=zerojax.make_mesh(axes))
  _assert_trains_like_plain(zero_carry_scan, opt, tx, gather="all")


def _rule_summing(over_types: bool):
  """A zero-carry scan through a custom-VJP product whose backward rule
  sums the weight's gradient over devices: by the axes its types give
  (zerojax's recipe; a no-op untyped) or over ``'data'`` by name."""

  @jax.custom_vjp
  def product(x, w):
    return x @ w

  def bwd(res, ct):
    x, w = res
    g = x.T @ ct
    axes = (
      tuple(
        jax.typeof(g).manual_axis_type.varying
        - jax.typeof(w).manual_axis_type.varying
      )
      if over_types
      else "data"
    )
    return ct @ w.T, jax.lax.psum(g, axes)

  product.defvjp(lambda x, w: (x @ w, (x, w)), bwd)

  def loss(params, b):
    w = params["params"]["Dense_0"]["kernel"][:3]  # (3, 3)
    xs = jnp.swapaxes(b["x"], 0, 1)[..., :3]

    def cell(h, x):
      return jnp.tanh(h + product(x, w)), None

    h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[1], 3)), xs)
    return jnp.mean((h[:, :2] - b["y"]) ** 2)

  return loss


def _rule_and_forward_pmean(params, b):  # the rule's psum beside a pmean
  loss = _rule_summing(over_types=False)(params, b)
  return loss + 0.1 * jax.lax.pmean(loss, "data")


def _data_sum(x):  # one helper for the forward pass and a rule
  return jax.lax.psum(x, "data")


def _rule_sharing_a_helper(params, b):
  @jax.custom_vjp
  def scale(w):
    return w

  scale.defvjp(lambda w: (w, None), lambda _, g: (_data_sum(g),))
  loss = _rule_summing(over_types=True)(
    {
      "params": {
        "Dense_0": {"kernel": scale(params["params"]["Dense_0"]["kernel"])}
      }
    },
    b,
  )
  return loss + 0.1 * _data_sum(loss) / 8


class _SyncBN(nn.Module):
  """A zero-carry recurrence, then batch norm over the batch: per device
  with ``axis_name='data'`` (a pmean in the forward pass), or over the
  whole batch with None; ``remat`` replays the norm in the backward."""

  axis_name: str | None
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (7, 3))

    def cell(h, xt):
      return jnp.tanh(jnp.concatenate([h, xt], -1) @ w), None

    h, _ = jax.lax.scan(cell, jnp.zeros((x.shape[0], 3)), jnp.swapaxes(x, 0, 1))
    norm = nn.remat(nn.BatchNorm) if self.remat else nn.BatchNorm
    h = norm(use_running_average=False, axis_name=self.axis_name)(h)
    return nn.Dense(2)(h)


def _norm_loss(model):
  def loss(params, b, model_state):
    out, new = model.apply(
      {"params": params, "batch_stats": model_state},
      b["x"],
      mutable=["batch_stats"],
    )
    return jnp.mean((out - b["y"][:, :2]) ** 2), new["batch_stats"]

  return loss


@pytest.mark.parametrize("stage", [0, 2])
def test_a_custom_vjp_rule_summing_over_its_typed_axes_trains_like_the_plain_step(
  mesh, stage
):
  opt = optax.sgd(0.5, momentum=0.9)
  tx = zerojax.zero(opt, stage=stage, mesh=mesh)
  _assert_trains_like_plain(_rule_summing(over_types=True), opt, tx)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_synchronized_batch_norm_beside_such_a_loop_trains_like_the_plain_step(
  mesh, stage, remat
):
  """A forward collective over the batch axis (a synchronized batch norm's
  pmean, replayed under remat) is differentiated exactly untyped: the same
  params and batch statistics as the plain step's norm over the batch."""
  opt = optax.sgd(0.5, momentum=0.9)
  batches = [_batch(seed=i) for i in range(2)]
  init = _SyncBN(None, remat).init(jax.random.key(0), batches[0]["x"])
  plain_loss = _norm_loss(_SyncBN(None, remat))

  @jax.jit
  def plain(p, s, ms, b):
    (value, ms), g = jax.value_and_grad(plain_loss, has_aux=True)(p, b, ms)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, ms, value

  p, s, ms = init["params"], opt.init(init["params"]), init["batch_stats"]
  want = []
  for b in batches:
    p, s, ms, value = plain(p, s, ms, b)
    want.append(float(value))
  tx = zerojax.zero(opt, stage=stage, mesh=mesh)
  state = zerojax.init(init["params"], tx, model_state=init["batch_stats"])
  step = zerojax.train_step(
    _norm_loss(_SyncBN("data", remat)), tx, per_device_loss=True
  )
  got = []
  for b in batches:
    state, m = step(state, b)
    got.append(float(m["loss"]))
  np.testing.assert_allclose(got, want, rtol=2e-6)
  _close(zerojax.gather_params(state), p)
  _close(state.model_state, ms)


@pytest.mark.parametrize(
  "loss",
  [
    _rule_summing(over_types=False),
    _rule_and_forward_pmean,
    _rule_sharing_a_helper,
  ],
  ids=[
    "psum_in_a_custom_vjp_rule",
    "beside_a_pmean_in_the_forward_pass",
    "through_a_helper_the_forward_pass_calls_too",
  ],
)
@pytest.mark.parametrize("stage", [0, 3])
def test_a_custom_vjp_rules_own_collective_in_such_a_loss_raises_and_keeps_the_state(
  any_mesh, loss, stage
):
  """Untyped, a psum a custom VJP rule runs over the batch axis sums a
  gradient zerojax sums again: refused, naming it and the rule's line,
  before anything runs -- also beside a forward pmean, whose own
  transpose is exact."""
  tx = zerojax.zero(optax.sgd(0.5), stage=stage, mesh=any_mesh)
  state = zerojax.init(_params(), tx)
  with pytest.raises(
    ValueError,
    match=r"zerojax: the loss's backward pass runs psum over \('data',\) "
    r"at .*test_loop_carries.py:\d+, which is no forward collective's "
    r"transpose.*types off.*jnp.zeros_like\(x\[:, 0\]\)",
  ):
    zerojax.train_step(loss, tx, gather="all", per_device_loss=True)(
      state, _batch()
    )
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))


@pytest.mark.parametrize("stage", [0, 2])
def test_the_report_says_the_loss_ran_untyped_and_what_stage_0_holds(
  mesh, stage
):
  """The compiled program names the untyped per-device program; the report
  says so and, at stage 0 with one micro-batch, how much unreduced
  gradient each device may hold (a leaf the loss uses without
  zerojax.gather is all-reduced after the backward, not where used)."""
  tx = zerojax.zero(optax.sgd(0.5), stage=stage, mesh=mesh)
  state = zerojax.init(_params(), tx)
  got = zerojax.report(zerojax.train_step(lstm_ctc, tx), state, _batch())
  assert not got.per_device_types
  grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(_params()))
  assert got.unreduced_grad_bytes == (grad_bytes if stage == 0 else 0)
  assert "per-device types off" in str(got)
  assert (f"up to {grad_bytes:,} bytes of unreduced" in str(got)) == (
    stage == 0
  )
  typed = zerojax.report(
    zerojax.train_step(_forward_typed, tx), state, _batch()
  )
  assert typed.per_device_types and typed.unreduced_grad_bytes == 0
  assert "per-device types off" not in str(typed)


def _forward_typed(params, b):  # the same model, no loop from a constant
  w = params["params"]["Dense_0"]["kernel"]
  return jnp.mean((jnp.tanh(b["x"][:, -1, :3] @ w[:3])[:, :2] - b["y"]) ** 2)
