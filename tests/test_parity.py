"""Stages 0-3 give the unsharded Optax result, for optimizers of every kind."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy

STEPS = 5

OPTIMIZERS = {
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(0.05), optax.adamw(1e-2)
  ),
  "lamb": lambda: optax.lamb(1e-2),
  # min_dim_size_to_factor=4 so the toy's 7x7 and 13x7 leaves are factored.
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
}

EXTRA = {
  "lars": lambda: optax.lars(1e-2),
  "masked_weight_decay": lambda: optax.adamw(
    1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  ),
  "multi_transform": lambda: optax.multi_transform(
    {"fast": optax.adam(3e-2), "slow": optax.sgd(1e-2)},
    lambda p: {
      k: jax.tree.map(lambda _: "fast" if k == "layers" else "slow", v)
      for k, v in p.items()
    },
  ),
}


def _run(params, tx, data, gather="model", accum_steps=1):
  state = zerojax.init(params, tx)
  step = zerojax.train_step(
    toy.loss_fn, tx, gather=gather, accum_steps=accum_steps
  )
  for batch in data:
    state, metrics = step(state, batch)
  return state, metrics


def _float_leaves(tree):
  return [
    x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)
  ]


@pytest.fixture(scope="module")
def setup():
  return toy.init_params(jax.random.key(0)), toy.batches(STEPS)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_parity(setup, any_mesh, opt_name, stage):
  """On Explicit and on Auto axes."""
  params, data = setup
  want, want_opt = toy.shared_reference(
    opt_name, params, OPTIMIZERS[opt_name](), data, with_state=True
  )
  tx = zerojax.zero(OPTIMIZERS[opt_name](), stage=stage, mesh=any_mesh)
  state, _ = _run(params, tx, data)
  # sharded as the stage says; on an Explicit mesh, in the arrays' types
  explicit = any_mesh.axis_types[0] == jax.sharding.AxisType.Explicit
  for x, o in zip(jax.tree.leaves(state.opt_state), state.spec.opt_leaves):
    if o.layout.sharded:
      assert stage >= 1 and "data" in str(x.sharding.spec)
      assert ("data" in str(jax.typeof(x).sharding.spec)) == explicit
  w = state.params["layers"]["w"]
  assert ("data" in str(w.sharding.spec)) == (stage == 3)
  got = zerojax.gather_params(state)
  assert int(state.step) == STEPS
  assert jax.tree.structure(got) == jax.tree.structure(params)
  err = toy.rel_err(_float_leaves(got), _float_leaves(want))
  assert err < 1e-6, f"{opt_name} stage {stage}: relative error {err:.2e}"
  # the optimizer state too: same structure, same moments and counters
  got_opt = zerojax.gather_opt_state(state)
  assert jax.tree.structure(got_opt) == jax.tree.structure(want_opt)
  for (path, a), b in zip(
    jax.tree_util.tree_flatten_with_path(got_opt)[0], jax.tree.leaves(want_opt)
  ):
    assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
    if jnp.issubdtype(a.dtype, jnp.floating):
      np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path)
      )
    else:
      assert (np.asarray(a) == np.asarray(b)).all(), jax.tree_util.keystr(path)
  # The integer buffer is carried untouched.
  assert (got["ids"] == params["ids"]).all()


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_master_parity(setup, mesh, opt_name, stage):
  """bf16 compute, fp32 master and fp32 reduction, against the same policy
  emulated on one device (per-device bf16 gradients summed in fp32)."""
  params, data = setup
  policy = zerojax.Policy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  want = toy.shared_reference(
    opt_name,
    params,
    OPTIMIZERS[opt_name](),
    data,
    param_dtype=jnp.bfloat16,
    reduce_dtype=jnp.float32,
    devices=8,
  )
  tx = zerojax.zero(
    OPTIMIZERS[opt_name](), stage=stage, mesh=mesh, policy=policy
  )
  state, _ = _run(params, tx, data)
  master = zerojax.gather_params(state, master=True)
  assert all(x.dtype == jnp.float32 for x in _float_leaves(master))
  assert all(x.dtype == jnp.bfloat16 for x in _float_leaves(state.params))
  err = toy.rel_err(_float_leaves(master), _float_leaves(want))
  assert err < 1e-5, f"{opt_name} stage {stage}: relative error {err:.2e}"
  # The compute copy is the master rounded to bf16.
  compute = zerojax.gather_params(state)
  for c, m in zip(_float_leaves(compute), _float_leaves(master)):
    assert (c == m.astype(jnp.bfloat16)).all()


@pytest.mark.parametrize("opt_name", EXTRA)
@pytest.mark.parametrize("stage", [1, 3])
def test_more_optimizers(setup, mesh, opt_name, stage):
  params, data = setup
  want = toy.shared_reference(opt_name, params, EXTRA[opt_name](), data)
  tx = zerojax.zero(EXTRA[opt_name](), stage=stage, mesh=mesh)
  got = zerojax.gather_params(_run(params, tx, data)[0])
  err = toy.rel_err(_float_leaves(got), _float_leaves(want))
  assert err < 1e-6, f"{opt_name} stage {stage}: relative error {err:.2e}"


@pytest.mark.parametrize("stage", [2, 3])
def test_gather_all_equals_gather_model(setup, mesh, stage):
  params, data = setup
  tx = zerojax.zero(optax.adamw(1e-2), stage=stage, mesh=mesh)
  a = zerojax.gather_params(_run(params, tx, data, gather="all")[0])
  b = zerojax.gather_params(_run(params, tx, data, gather="model")[0])
  assert toy.rel_err(_float_leaves(a), _float_leaves(b)) < 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_metric_matches_unsharded(setup, mesh, stage):
  params, data = setup
  tx = zerojax.zero(optax.sgd(0.0), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  _, metrics = zerojax.train_step(toy.loss_fn, tx, gather="model")(
    state, data[0]
  )
  want = toy.loss_fn(params, data[0])
  assert abs(float(metrics["loss"]) - float(want)) < 1e-6
  grads = jax.grad(toy.loss_fn, allow_int=True)(params, data[0])
  want_norm = optax.tree.norm(_float_leaves(grads))
  assert abs(float(metrics["grad_norm"]) - float(want_norm)) < 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_built_without_the_norm_reports_none_and_trains_the_same(
  setup, mesh, stage
):
  """``train_step(..., grad_norm=False)``: the metrics hold the loss only,
  and the new state is the default step's (another program: up to the
  order of its sums, a gradient adding the batch's 32 rows)."""
  params, data = setup
  tx = zerojax.zero(optax.adamw(1e-2), stage=stage, mesh=mesh)
  states, metrics = [], []
  for grad_norm in (True, False):
    step = zerojax.train_step(
      toy.loss_fn, tx, gather="model", grad_norm=grad_norm
    )
    state, m = step(zerojax.init(params, tx), data[0])
    states.append(zerojax.gather_params(state, master=True))
    metrics.append(m)
  assert set(metrics[0]) == {"loss", "grad_norm"}
  assert set(metrics[1]) == {"loss"}
  toy.assert_same_up_to_summation_order(
    (metrics[1]["loss"], _float_leaves(states[1])),
    (metrics[0]["loss"], _float_leaves(states[0])),
    terms=32,
  )


def test_a_grad_norm_switch_that_is_not_a_bool_is_refused(mesh):
  tx = zerojax.zero(optax.sgd(0.1), stage=0, mesh=mesh)
  with pytest.raises(TypeError, match=r"grad_norm='no' must be True"):
    zerojax.train_step(toy.loss_fn, tx, grad_norm="no")
