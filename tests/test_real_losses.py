"""Losses as people write them: exact at every stage, or a clear error.

A loss that touches its params other than through ``zerojax.gather`` (an L2
term over the tree, ``optax.tree.norm``, ``ravel_pytree``, ``jax.tree.map``)
must give the unsharded result at stages 0-3 under the default settings.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

import zerojax
from tests import toy


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {
    "w1": jax.random.normal(k[0], (6, 12)) * 0.5,
    "w2": jax.random.normal(k[1], (12, 3)) * 0.5,
    "b": jnp.zeros((3,)),
  }


def _fit(q, b):
  return jnp.mean(
    (jnp.tanh(b["x"] @ q["w1"]) @ q["w2"] + q["b"][None] - b["y"]) ** 2
  )


def l2_over_leaves(params, b):  # the example
  reg = sum(jnp.sum(x**2) for x in jax.tree.leaves(params))
  return _fit(zerojax.gather(params), b) + 1e-2 * reg


def tree_norm(params, b):
  return _fit(zerojax.gather(params), b) + 0.1 * optax.tree.norm(params)


def ravel(params, b):
  flat, _ = ravel_pytree(params)
  return _fit(zerojax.gather(params), b) + 1e-2 * jnp.sum(flat**2)


def tree_map_then_gather(params, b):
  scaled = jax.tree.map(lambda x: 0.5 * x, params)
  return _fit(zerojax.gather(scaled), b)


def never_gathers(params, b):
  return _fit(params, b)


LOSSES = {
  f.__name__: f
  for f in (
    l2_over_leaves,
    tree_norm,
    ravel,
    tree_map_then_gather,
    never_gathers,
  )
}


def _data(n=3):
  rng = np.random.default_rng(0)
  return [
    {
      "x": rng.normal(size=(16, 6)).astype(np.float32),
      "y": rng.normal(size=(16, 3)).astype(np.float32),
    }
    for _ in range(n)
  ]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", LOSSES)
def test_whole_tree_losses_equal_unsharded_optax(mesh, name, stage):
  loss, data = LOSSES[name], _data()
  want, want_losses = toy.optax_run(loss, optax.adam(1e-2), _params(), data)
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=mesh)
  got, losses, notes = toy.zero_run(loss, tx, _params(), data)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  if stage >= 2:  # the whole-tree path, said once, naming a leaf
    assert len(notes) == 1 and "params['w1']" in notes[0], notes
  else:
    assert not notes, notes


def _host_tanh(x):
  """The batch through NumPy on the host, as a preprocessing callback: its
  result is typed the same on every device, though each device's rows
  differ."""
  return jax.pure_callback(
    np.tanh,
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    x,
    vmap_method="broadcast_all",
  )


def callback_never_gathers(params, b):
  return _fit(params, {"x": _host_tanh(b["x"]), "y": b["y"]})


def callback_then_gather(params, b):
  return _fit(zerojax.gather(params), {"x": _host_tanh(b["x"]), "y": b["y"]})


@pytest.mark.parametrize("gather", ["auto", "all"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
  "loss",
  [callback_never_gathers, callback_then_gather],
  ids=lambda f: f.__name__,
)
def test_a_loss_through_a_host_callback_equals_unsharded_optax(
  any_mesh, loss, stage, gather
):
  """On either axis type (a program with a callback lowers on one mesh
  only), and at stage 0 with gradients that reach a leaf only through the
  callback's result (no implicit sum is typed there); the default gather
  and the whole tree."""
  data = _data()
  want, want_losses = toy.optax_run(loss, optax.adam(1e-2), _params(), data)
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=any_mesh)
  got, losses, _ = toy.zero_run(loss, tx, _params(), data, gather=gather)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def _linear_fwd(x, w):
  return x @ w, (x, w)


def _host_matmul(a, b, like):
  return jax.pure_callback(
    lambda a, b: np.asarray(a.T @ b, np.float32),
    jax.ShapeDtypeStruct(like.shape, like.dtype),
    a,
    b,
    vmap_method="broadcast_all",
  )


@jax.custom_vjp
def _linear_host_bwd(x, w):
  return x @ w


def _linear_host_bwd_rule(res, ct):  # the weight gradient on the host
  x, w = res
  return ct @ w.T, _host_matmul(x, ct, w)


@jax.custom_vjp
def _linear_host_bwd_typed(x, w):
  return x @ w


def _linear_host_bwd_typed_rule(res, ct):  # ... typed as the error says
  x, w = res
  g = _host_matmul(x, ct, w)
  g = jax.lax.pcast(
    g,
    tuple(
      jax.typeof(w).manual_axis_type.varying
      - jax.typeof(g).manual_axis_type.varying
    ),
    to="varying",
  )
  return ct @ w.T, g


_linear_host_bwd.defvjp(_linear_fwd, _linear_host_bwd_rule)
_linear_host_bwd_typed.defvjp(_linear_fwd, _linear_host_bwd_typed_rule)


def _custom_vjp_loss(linear):
  def loss(params, b):
    h = jnp.tanh(linear(b["x"], params["w1"]))
    return jnp.mean((linear(h, params["w2"]) + params["b"][None] - b["y"]) ** 2)

  return loss


@pytest.mark.parametrize("accum_steps", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
  "linear",
  [toy.custom_vjp_linear, _linear_host_bwd_typed],
  ids=["custom_vjp", "custom_vjp_host_bwd_typed"],
)
def test_a_loss_through_a_custom_vjp_layer_equals_unsharded_optax(
  any_mesh, linear, stage, accum_steps
):
  """A replicated leaf passed straight into a ``jax.custom_vjp`` (stage 0
  with one micro-batch): the user's backward rule is not autodiff's
  transpose, so it is reduced explicitly -- exact, where the direct path
  would make JAX refuse the rule's per-device gradient."""
  loss, data = _custom_vjp_loss(linear), _data(2)
  want, want_losses = toy.optax_run(loss, optax.adam(1e-2), _params(), data)
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=any_mesh)
  got, losses, _ = toy.zero_run(
    loss, tx, _params(), data, accum_steps=accum_steps
  )
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_custom_vjp_inside_a_layer_scan_equals_unsharded_optax(
  any_mesh, stage
):
  """Each layer's bias through a ``jax.custom_vjp`` inside a checkpointed
  scan: at stage 0 that stacked leaf alone is reduced after the backward,
  the others inside it."""
  rng = np.random.default_rng(5)
  data = [
    {
      "x": rng.integers(0, 16, (16,)).astype(np.int32),
      "y": rng.integers(0, 16, (16,)).astype(np.int32),
    }
    for _ in range(2)
  ]
  params = toy.layered_params(3, 8, 16)
  want, want_losses = toy.optax_run(
    toy.layered_loss_with_custom_vjp_bias, optax.adam(1e-2), params, data
  )
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=any_mesh)
  got, losses, _ = toy.zero_run(
    toy.layered_loss_with_custom_vjp_bias, tx, params, data
  )
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, w), g in zip(
    jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)
  ):
    np.testing.assert_allclose(
      g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
    )
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_custom_vjp_returning_a_host_gradient_raises_and_keeps_the_state(
  any_mesh, stage
):
  """A backward rule whose weight gradient comes from a callback returns a
  per-device value typed the same on every device: never summed, it would
  update with one device's share. zerojax says so, with the fix, before
  the state is touched."""
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=any_mesh)
  state = zerojax.init(_params(), tx)
  before = jax.tree.map(np.asarray, zerojax.gather_params(state))
  step = zerojax.train_step(_custom_vjp_loss(_linear_host_bwd), tx)
  with pytest.raises(
    ValueError,
    match=r"zerojax: a jax.custom_vjp .*typed "
    r"the same on every device for an input that varies.*"
    r"jax.lax.pcast\(g, tuple\(jax.typeof\(x\)",
  ):
    step(state, _data(1)[0])
  after = zerojax.gather_params(state)  # not donated, not updated
  for k in before:
    np.testing.assert_array_equal(after[k], before[k])
  assert int(state.step) == 0


_SCALE = np.linspace(0.5, 1.5, 3).astype(np.float32)


def _scaled_loss(summed):
  """A custom_vjp taking an array the loss closes over (the same on every
  device) and returning its gradient, per device or ``summed`` as the
  error says."""

  @jax.custom_vjp
  def scaled(x, w, c):
    return (x @ w) * c[None]

  def fwd(x, w, c):
    return scaled(x, w, c), (x, w, c)

  def bwd(res, ct):
    x, w, c = res
    g = jnp.sum(ct * (x @ w), axis=0)
    if summed:
      g = jax.lax.psum(
        g,
        tuple(
          jax.typeof(g).manual_axis_type.varying
          - jax.typeof(c).manual_axis_type.varying
        ),
      )
    return (ct * c[None]) @ w.T, x.T @ (ct * c[None]), g

  scaled.defvjp(fwd, bwd)
  scale = jnp.asarray(_SCALE)
  return lambda params, b: jnp.mean(
    (scaled(b["x"], params["w1"] @ params["w2"], scale) - b["y"]) ** 2
  )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_custom_vjp_gradient_for_a_closed_over_array_raises_then_sums(
  any_mesh, stage
):
  """The other direction: a per-device gradient for an input every device
  holds the same. JAX refuses it inside the per-device loss; zerojax says
  which way round and the fix, and the fixed rule is exact."""
  data = _data(2)
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=any_mesh)
  step = zerojax.train_step(_scaled_loss(summed=False), tx)
  with pytest.raises(
    ValueError,
    match=r"zerojax: a jax.custom_vjp .*"
    r"per-device gradient for an input every device holds "
    r"the same.*jax.lax.psum\(g, ",
  ):
    step(zerojax.init(_params(), tx), data[0])
  loss = _scaled_loss(summed=True)
  want, want_losses = toy.optax_run(loss, optax.adam(1e-2), _params(), data)
  got, losses, _ = toy.zero_run(loss, tx, _params(), data)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def _pallas_loss(differentiable: bool = True, form: str = "mean"):
  """A loss whose product runs in a Pallas kernel (JAX's interpreter on
  CPU) with an ``out_shape`` that leaves ``manual_axis_type`` out, as a
  library kernel written for one device does; with a custom VJP (how
  kernels ship) or without (not differentiable, unsharded either);
  ``form``: ``"mean"`` over examples, ``"token_mean"`` (a sum over the
  rows the batch's ``mask`` keeps divided by their count) or ``"sum"``
  (divided by a fixed number)."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]

  def mul(x, w):
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=shape, interpret=True)(x, w)

  product = jax.custom_vjp(mul)
  product.defvjp(
    lambda x, w: (mul(x, w), (x, w)), lambda r, g: (mul(g, r[1]), mul(g, r[0]))
  )

  def loss(params, b):
    w = jnp.broadcast_to(params["w1"][:, 0], b["x"].shape)
    h = (product if differentiable else mul)(b["x"], w)
    err = (h @ params["w1"] @ params["w2"] - b["y"]) ** 2
    if form == "token_mean":
      return jnp.sum(err * b["mask"][:, None]) / jnp.sum(b["mask"])
    if form == "sum":
      return jnp.sum(err) / 48.0
    return jnp.mean(err)

  return loss


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_pallas_kernel_whose_out_shape_has_no_device_type_trains(
  any_mesh, stage
):
  """Inside the per-device loss JAX refuses a kernel's ``out_shape`` that
  does not say how it varies over devices; users cannot add that to a
  library's kernel, so the step runs the loss untyped: the plain step's
  numbers (the reading of the loss warns, a kernel being opaque to it)."""
  opt = optax.sgd(0.1, momentum=0.9)
  loss = _pallas_loss()
  want, want_losses = toy.optax_run(loss, opt, _params(), _data(2))
  tx = zerojax.zero(opt, stage=stage, mesh=any_mesh)
  got, losses, _ = toy.zero_run(loss, tx, _params(), _data(2), gather="all")
  np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("form", ["token_mean", "sum"])
def test_a_sum_over_a_pallas_kernel_trains_and_warns(mesh, stage, form):
  """A sum divided by the batch's count, or by a fixed number, over a
  kernel the loss check cannot read: the step takes the kernel as per
  example (its shapes allow it), adds up the devices' losses (run with
  the whole batch's count), and warns that the kernel was not checked;
  rows without a count (a device's and a micro-batch's) add nothing, as
  in the plain step."""
  loss = _pallas_loss(form=form)
  data = _data(2)
  for i, b in enumerate(data):
    b["mask"] = (np.arange(16) % (3 + i) != 0).astype(np.float32)
    b["mask"][:5] = 0.0
  opt = optax.sgd(0.1, momentum=0.9)
  want, want_losses = toy.optax_run(loss, opt, _params(), data)
  tx = zerojax.zero(opt, stage=stage, mesh=mesh)
  got, losses, notes = toy.zero_run(
    loss, tx, _params(), data, gather="all", accum_steps=2
  )
  np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6)
  assert any("pallas_call" in n and "adds up" in n for n in notes), notes


def test_a_kernel_with_no_gradient_raises_jaxs_error_with_the_reason(mesh):
  """Untyped, a loss that still fails raises its own error (here JAX's:
  the kernel has no reverse-mode rule, unsharded too), with a note saying
  why the types were off and how to keep them; the state is kept."""
  loss = _pallas_loss(differentiable=False)
  tx = zerojax.zero(optax.sgd(0.1), stage=2, mesh=mesh)
  state = zerojax.init(_params(), tx)
  ev = zerojax.eval_step(loss, tx, gather="all")(state, _data(1)[0])
  np.testing.assert_allclose(ev, loss(_params(), _data(1)[0]), rtol=1e-6)
  with pytest.raises(ValueError, match="Linearization failed") as e:
    zerojax.train_step(loss, tx, gather="all")(state, _data(1)[0])
  assert any("manual_axis_type" in n for n in e.value.__notes__)
  assert int(state.step) == 0
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def _constrained_loss(constrain):
  """``_fit`` with its hidden activation passed through ``constrain``."""

  def loss(q, b):
    h = constrain(jnp.tanh(b["x"] @ q["w1"]))
    return jnp.mean((h @ q["w2"] + q["b"][None] - b["y"]) ** 2)

  return loss


_BATCH_AXIS_CONSTRAINTS = {
  "with_sharding_constraint": (
    lambda h: jax.lax.with_sharding_constraint(h, P("data", None)),
    r"constrains a value's sharding over a batch axis \(jax.lax."
    r"with_sharding_constraint with P\('data', None\)\).*Put None in "
    r"its place",
  ),
  "reshard": (
    lambda h: jax.sharding.reshard(h, P("data", None)),
    r"calls jax.sharding.reshard with P\('data', None\).*Use "
    r"jax.lax.with_sharding_constraint with None in place of the batch "
    r"axes",
  ),
}


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("call", sorted(_BATCH_AXIS_CONSTRAINTS))
def test_a_sharding_constraint_over_the_batch_axis_raises_the_fix_and_keeps_the_state(
  any_mesh, call, stage
):
  """A loss written for GSPMD may constrain its activations over the batch
  axis; inside zerojax's per-device loss that axis is manual. The error
  names the call, the spec and the fix before the state is touched, and
  the fixed constraint gives the unsharded numbers."""
  constrain, says = _BATCH_AXIS_CONSTRAINTS[call]
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=any_mesh)
  state = zerojax.init(_params(), tx)
  before = jax.tree.map(np.asarray, zerojax.gather_params(state))
  step = zerojax.train_step(_constrained_loss(constrain), tx)
  with pytest.raises(ValueError, match=r"zerojax.train_step: the loss " + says):
    step(state, _data(1)[0])
  after = zerojax.gather_params(state)
  for k in before:
    np.testing.assert_array_equal(after[k], before[k])
  fixed = _constrained_loss(
    lambda h: jax.lax.with_sharding_constraint(h, P(None, None))
  )
  data = _data(2)
  want, want_losses = toy.optax_run(_fit, optax.adam(1e-2), _params(), data)
  got, losses, _ = toy.zero_run(fixed, tx, _params(), data)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_offloaded_state_with_a_host_callback_on_an_explicit_mesh(mesh, stage):
  data = _data(2)
  want, _ = toy.optax_run(
    callback_never_gathers, optax.adam(1e-2), _params(), data
  )
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=mesh, offload=True)
  got, _, _ = toy.zero_run(
    callback_never_gathers, tx, _params(), data, gather="all"
  )
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("stage", [2, 3])
def test_gather_model_rejects_an_ungathered_use_and_keeps_the_state(
  mesh, stage
):
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
  state = zerojax.init(_params(), tx)
  before = jax.tree.map(np.asarray, zerojax.gather_params(state))
  step = zerojax.train_step(l2_over_leaves, tx, gather="model")
  with pytest.raises(
    zerojax.errors.UngatheredParamError,
    match=r"params\['b'\] by .*params\['w1'\] by integer_pow",
  ):
    step(state, _data(1)[0])
  after = zerojax.gather_params(state)  # not donated, not updated
  for k in before:
    np.testing.assert_array_equal(after[k], before[k])
  assert int(state.step) == 0


def test_a_bug_in_the_loss_raises_once_and_unchanged(mesh):
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  state = zerojax.init(_params(), tx)

  def buggy(params, b):
    q = zerojax.gather(params)
    return _fit(q, b) + b["missing_key"].sum()

  step = zerojax.train_step(buggy, tx)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pytest.raises(KeyError) as info:
      step(state, _data(1)[0])
  assert info.value.args == ("missing_key",)
  assert not [w for w in caught if "zerojax" in str(w.message)]
  assert int(state.step) == 0


def test_per_layer_loss_takes_the_lean_path_silently(mesh):
  """A loss that only gathers is not sent down the whole-tree path."""
  from tests import toy

  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  with toy.warnings_as_errors():
    hlo = step.lower(state, toy.batches(1)[0]).compile().as_text()
  loops = [
    c
    for c in zerojax.diagnostics.collectives(hlo, 8)
    if c.kind == "all-gather" and c.count == toy.LAYERS
  ]
  assert loops, "per-layer gathers inside the scan"


def test_slicing_a_leaf_not_marked_stacked_raises(mesh):
  """A leaf declared not a layer stack may be sharded on dim 0; scanning
  over it then raises in gather instead of gathering the wrong axis."""
  params = {"layers": jnp.ones((8, 3))}  # dim 0 pads least -> sharded
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh, stacked=False)
  state = zerojax.init(params, tx)
  assert state.spec.leaves[0].shard.dim == 0

  def loss(p, b):
    def body(h, w):
      return h + zerojax.gather(w).sum(), None

    h, _ = jax.lax.scan(body, 0.0, p["layers"])
    return h * b["x"].mean()

  with pytest.raises(ValueError, match="not marked as a layer stack"):
    zerojax.train_step(loss, tx, gather="model")(state, {"x": np.ones((8,))})


def _layers():
  k = jax.random.split(jax.random.key(2), 2)
  return {
    "w": jax.random.normal(k[0], (4, 6, 6)) * 0.4,
    "head": jax.random.normal(k[1], (6, 3)) * 0.4,
  }


def fori_gathers(params, b):
  """Layers in a fori_loop (a while loop), each gathered where used; a cond
  picks the activation. Lean: every use goes through gather."""
  h = b["x"]

  def step(i, h):
    layer = zerojax.gather(params["w"])[i]
    return jax.lax.cond(i % 2 == 0, jnp.tanh, jnp.sin, h @ layer)

  h = jax.lax.fori_loop(0, 4, step, h)
  return jnp.mean((h @ zerojax.gather(params["head"]) - b["y"]) ** 2)


def while_without_gather(params, b):
  """A while loop that reads the sharded leaves directly (counting positive
  weights: on shards the count would be wrong): not lean, must be exact."""

  def cond(c):
    return c[0] < 2

  def body(c):
    i, count = c
    positive = sum(jnp.sum(x > 0) for x in jax.tree.leaves(params))
    return i + 1, count + positive.astype(jnp.int32)

  # (the initial count is made from the batch so that, inside zerojax's
  # shard_map, the carry is device-varying like the params it adds)
  zero = (0 * jnp.mean(b["x"])).astype(jnp.int32)
  _, count = jax.lax.while_loop(cond, body, (0, zero))
  q = zerojax.gather(params)
  h = jnp.tanh(b["x"] @ q["w"][0])
  return jnp.mean((h @ q["head"] - b["y"]) ** 2) + 1e-3 * count


@pytest.mark.parametrize(
  "loss,lean",
  [(fori_gathers, True), (while_without_gather, False)],
  ids=["fori_cond_gathered", "while_ungathered"],
)
def test_control_flow_is_followed(mesh, loss, lean):
  rng = np.random.default_rng(1)
  data = [
    {
      "x": rng.normal(size=(16, 6)).astype(np.float32),
      "y": rng.normal(size=(16, 3)).astype(np.float32),
    }
    for _ in range(2)
  ]
  params, want_losses = toy.optax_run(loss, optax.adam(1e-2), _layers(), data)
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  got, losses, notes = toy.zero_run(loss, tx, _layers(), data)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for k in params:
    np.testing.assert_allclose(got[k], params[k], rtol=1e-5, atol=1e-6)
  assert (not notes) if lean else ("params['head'] by" in notes[0]), notes
