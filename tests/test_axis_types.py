"""zerojax on the meshes users hold: Explicit axes (``jax.make_mesh``'s
default), Auto axes, and a mix -- the same numbers, the same collectives.

The rest of the suite runs on ``zerojax.make_mesh()`` (Explicit, like
``jax.make_mesh``), the parity zoo on both (``any_mesh``,
``test_parity.py``); here each claim is checked on both axis types side by
side, and the Explicit-only behaviour (sharding in types) is asserted.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests import toy
from zerojax import checkpoint

AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
TYPES = {"auto": AUTO, "explicit": EXPLICIT}


def _mesh(axes=None, types="explicit"):
  return zerojax.make_mesh(axes, axis_types=TYPES[types])


def _data_in_type(x) -> bool:
  """The array's sharding type names the data axis."""
  return "data" in str(jax.typeof(x).sharding.spec)


@pytest.fixture(scope="module")
def setup():
  return toy.init_params(jax.random.key(0)), toy.batches(3)


def test_make_mesh_gives_what_jax_make_mesh_gives():
  assert (
    zerojax.make_mesh().axis_types == jax.make_mesh((8,), ("data",)).axis_types
  )
  assert zerojax.make_mesh("data=4,model=2").axis_types == (EXPLICIT, EXPLICIT)
  mixed = zerojax.make_mesh("data=4,model=2", axis_types=(EXPLICIT, AUTO))
  assert mixed.axis_types == (EXPLICIT, AUTO)
  with pytest.raises(
    ValueError, match="one jax.sharding.AxisType, or a tuple of 2"
  ):
    zerojax.make_mesh("data=4,model=2", axis_types=(AUTO,))


def _loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _dropin_data(n=3):
  rng = np.random.default_rng(0)
  return [
    {
      "x": rng.normal(size=(16, 6)).astype(np.float32),
      "y": rng.normal(size=(16, 3)).astype(np.float32),
    }
    for _ in range(n)
  ]


def _dropin_params():
  k = jax.random.split(jax.random.key(0), 2)
  return {
    "w1": jax.random.normal(k[0], (6, 13)),
    "b1": jnp.zeros((13,)),
    "w2": jax.random.normal(k[1], (13, 3)),
  }  # 13: padded over 8


@pytest.mark.parametrize("types", TYPES)
@pytest.mark.parametrize("context", ["set_mesh", "mesh="])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_dropin_in_a_users_sharding_loop(stage, context, types):
  """JAX's documented loop: params placed replicated, the batch split over
  data, a jitted plain Optax step. The updates come back typed as the
  params are, the state is sharded over data (in its type on an Explicit
  mesh), one trace, Optax's numbers."""
  mesh, opt, data = _mesh(None, types), optax.adamw(1e-2), _dropin_data()
  p, s = _dropin_params(), opt.init(_dropin_params())
  for b in data:
    u, s = opt.update(jax.grad(_loss)(p, b), s, p)
    p = optax.apply_updates(p, u)
  tx = zerojax.zero(opt, stage=stage, mesh=mesh)
  traces = []

  @jax.jit
  def step(params, opt_state, batch):
    traces.append(1)
    grads = jax.grad(_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    for u, q in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
      assert jax.typeof(u).sharding.spec == jax.typeof(q).sharding.spec
    return optax.apply_updates(params, updates), opt_state

  def run():
    params = jax.device_put(_dropin_params(), NamedSharding(mesh, P()))
    opt_state = tx.init(params)
    for b in data:
      params, opt_state = step(
        params, opt_state, jax.device_put(b, NamedSharding(mesh, P("data")))
      )
    return params, opt_state

  if context == "set_mesh":
    with jax.set_mesh(mesh):
      params, opt_state = run()
  else:
    params, opt_state = run()
  assert len(traces) == 1
  assert toy.rel_err(params, p) < 2e-6
  mu = opt_state[0].mu["w1"]  # (6, 13) stored (6, 16)
  assert ("data" in str(mu.sharding.spec)) == (stage >= 1)
  assert _data_in_type(mu) == (stage >= 1 and types == "explicit")


@pytest.mark.parametrize("types", TYPES)
def test_nnx_optimizer_with_the_dropin_under_set_mesh(types):
  mesh = _mesh(None, types)

  def run(tx):
    with jax.set_mesh(mesh):
      model = nnx.Sequential(
        nnx.Linear(6, 13, rngs=nnx.Rngs(0)),
        nnx.relu,
        nnx.Linear(13, 3, rngs=nnx.Rngs(1)),
      )
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

      @nnx.jit
      def step(model, optimizer, batch):
        grads = nnx.grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(
          model
        )
        optimizer.update(model, grads)

      for b in _dropin_data():
        step(model, optimizer, b)
      return nnx.state(model, nnx.Param), optimizer

  want, _ = run(optax.adam(1e-2))
  got, optimizer = run(zerojax.zero(optax.adam(1e-2), stage=2, mesh=mesh))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6),
    jax.tree.leaves(got),
    jax.tree.leaves(want),
  )
  sharded = [
    x
    for x in jax.tree.leaves(nnx.state(optimizer))
    if "data" in str(getattr(x, "sharding", P()).spec)
  ]
  assert sharded
  assert all(_data_in_type(x) == (types == "explicit") for x in sharded)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_equal_on_auto_and_explicit_axes(setup, stage):
  """The compiled step's collectives, kind by kind and axis by axis, are
  the same on both axis types."""
  params, data = setup
  reports = {}
  for types in TYPES:
    tx = zerojax.zero(optax.adamw(1e-2), stage=stage, mesh=_mesh(None, types))
    reports[types] = zerojax.report(
      zerojax.train_step(toy.loss_fn, tx), zerojax.init(params, tx), data[0]
    )
  a, e = reports["auto"], reports["explicit"]
  assert a.collective_elements == e.collective_elements
  assert a.bytes_by_axis == e.bytes_by_axis
  assert a.collective_elements  # not vacuous


# the toy's tensor-parallel layout (as in test_meshes.py)
SPECS = {
  "embed": P(None, "model"),
  "layers": {"w": P(None, None, "model"), "b": P(None, "model")},
  "head": P("model", None),
  "bias3": None,
  "scale": None,
  "ids": None,
}


@pytest.mark.parametrize(
  "axes, types, extra",
  [
    ("replica=2,data=4", (EXPLICIT, EXPLICIT), {}),
    (
      "replica=2,data=4",
      (EXPLICIT, EXPLICIT),
      {"zeropp": dict(weight_bits=8, grad_bits=8, hpz_size=2)},
    ),
    ("data=8", (EXPLICIT,), {"offload": True}),
    ("data=4,model=2", (EXPLICIT, EXPLICIT), {"model": True}),
    ("data=4,model=2", (EXPLICIT, AUTO), {"model": True}),
  ],
  ids=[
    "replica-data",
    "replica-data-zeropp",
    "offload",
    "data-model",
    "explicit-data-auto-model",
  ],
)
def test_pod_meshes_zeropp_and_offload_equal_the_auto_mesh(
  setup, axes, types, extra
):
  """The same run on Auto axes and on the Explicit (or mixed) mesh gives
  the same params: every technique computes on the same all-Auto view, so
  only the types of the results differ; they are two programs, so up to
  the order of their sums (a gradient adds the batch's 32 rows, over the
  3 steps)."""
  params, data = setup
  kw = {}
  if extra.get("zeropp"):
    kw["zeropp"] = zerojax.ZeroPP(**extra["zeropp"])
  if extra.get("offload"):
    kw["offload"] = True
  if "replica" in axes:
    kw["replica_axis"] = "replica"
  if extra.get("model"):
    kw["model_specs"] = SPECS
    params = toy.init_params(jax.random.key(0), width=6)  # splits over 2
  got = {}
  for name, t in (("auto", (AUTO,) * len(types)), ("typed", types)):
    mesh = zerojax.make_mesh(axes, axis_types=t)
    tx = zerojax.zero(optax.adamw(1e-2), stage=3, mesh=mesh, **kw)
    state = zerojax.init(params, tx)
    step = zerojax.train_step(toy.loss_fn, tx)
    for b in data:
      state, _ = step(state, b)
    got[name] = zerojax.gather_params(state)
    if extra.get("offload"):  # the state stays in host memory
      assert {
        x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)
      } == {"pinned_host"}
  toy.assert_same_up_to_summation_order(got["typed"], got["auto"], terms=32 * 3)


@pytest.mark.parametrize(
  "src, dst", [("auto", "explicit"), ("explicit", "auto")]
)
def test_checkpoint_moves_between_axis_types_bitwise(setup, tmp_path, src, dst):
  params, data = setup
  opt = optax.adamw(1e-2)
  tx1 = zerojax.zero(opt, stage=3, mesh=_mesh(None, src))
  tx2 = zerojax.zero(
    opt,
    stage=1,
    mesh=zerojax.make_mesh(devices=jax.devices()[:4], axis_types=TYPES[dst]),
  )  # 8 -> 4 devices
  state = zerojax.init(params, tx1)
  step = zerojax.train_step(toy.loss_fn, tx1)
  for b in data:
    state, _ = step(state, b)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(state)
    ckpt.wait()
    other, _ = ckpt.restore(params, tx2)
  for a, b in zip(
    jax.tree.leaves(zerojax.gather_params(state)),
    jax.tree.leaves(zerojax.gather_params(other)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(
    jax.tree.leaves(zerojax.gather_opt_state(state)),
    jax.tree.leaves(zerojax.gather_opt_state(other)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mu = [
    x
    for x, o in zip(jax.tree.leaves(other.opt_state), other.spec.opt_leaves)
    if o.aval.shape == (3, 7, 7)
  ][0]
  assert _data_in_type(mu) == (dst == "explicit")
  # the restored state trains on its mesh
  other, _ = zerojax.train_step(toy.loss_fn, tx2)(other, data[0])
  assert int(other.step) == len(data) + 1


def test_a_different_mesh_in_jax_set_mesh_is_named(setup):
  params, data = setup
  tx = zerojax.zero(optax.adam(1e-2), stage=1, mesh=_mesh())
  state = zerojax.init(params, tx)
  other = zerojax.make_mesh(devices=jax.devices()[:4])
  step = zerojax.train_step(toy.loss_fn, tx)
  with jax.set_mesh(other):
    with pytest.raises(
      ValueError, match="not the mesh this ZeroTransformation"
    ):
      step(state, data[0])
  state, _ = step(state, data[0])  # nothing was lost
  assert int(state.step) == 1


def test_a_loss_closing_over_an_explicit_array_is_told_the_fix(setup):
  mesh = _mesh()
  with jax.set_mesh(mesh):
    target = jnp.arange(3.0)  # typed on the Explicit mesh
  params = {"w": jnp.ones((4, 3))}
  loss = lambda p, b: jnp.mean(
    (b @ zerojax.gather(p)["w"] - target[None, :]) ** 2
  )
  tx = zerojax.zero(optax.adam(0.1), stage=1, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(loss, tx)
  batch = np.ones((16, 4), np.float32)
  with pytest.raises(
    ValueError,
    match=r"closes over a jax.Array.*f32\[3\].*"
    r"np.asarray",
  ):
    step(state, batch)
  # the state was not donated; the fix the message gives trains
  host = np.asarray(target)
  fixed = zerojax.train_step(
    lambda p, b: jnp.mean((b @ zerojax.gather(p)["w"] - host[None, :]) ** 2), tx
  )
  state, m = fixed(state, batch)
  assert np.isfinite(float(m["loss"]))


def test_gpt_with_seq_shard_on_an_explicit_data_model_mesh():
  """The reference GPT, Pa (seq_shard) included, trains on an all-Explicit
  data x model mesh as on the Auto one: zerojax runs the loss on the
  mesh's Auto view, so the model's own constraints (Pa's) apply there."""
  from zerojax.app import gpt

  cfg = gpt.GPTConfig(
    vocab=64, seq_len=16, width=32, depth=2, heads=4, seq_shard="model"
  )
  params = gpt.init(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.integers(0, 64, (8, 16)).astype(np.int32),
    "y": rng.integers(0, 64, (8, 16)).astype(np.int32),
  }
  losses = {}
  for types in TYPES:
    mesh = _mesh("data=4,model=2", types)
    tx = zerojax.zero(
      optax.adamw(1e-2),
      stage=3,
      mesh=mesh,
      stacked=gpt.is_layer_stack,
      model_specs=gpt.model_specs(),
    )
    state = zerojax.init(params, tx)
    step = zerojax.train_step(
      functools.partial(gpt.loss, config=cfg), tx, gather="model"
    )
    for _ in range(2):
      state, m = step(state, batch)
    losses[types] = float(m["loss"])
  np.testing.assert_allclose(losses["explicit"], losses["auto"], rtol=1e-6)


def test_gpt_loss_in_a_users_explicit_sharding_loop():
  """A drop-in user's own jitted value_and_grad of the reference GPT, on
  params replicated and a batch split over an Explicit data axis (with and
  without jax.set_mesh): its embedding lookup type-checks and the loss is
  the unsharded one."""
  from zerojax.app import gpt

  cfg = gpt.GPTConfig(vocab=64, seq_len=16, width=32, depth=2, heads=4)
  params = gpt.init(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.integers(0, 64, (8, 16)).astype(np.int32),
    "y": rng.integers(0, 64, (8, 16)).astype(np.int32),
  }
  want = float(gpt.loss(params, batch, cfg))
  mesh = _mesh()
  grad_fn = jax.jit(jax.value_and_grad(functools.partial(gpt.loss, config=cfg)))
  placed = lambda: (
    jax.device_put(params, NamedSharding(mesh, P())),
    jax.device_put(batch, NamedSharding(mesh, P("data"))),
  )
  loss, _ = grad_fn(*placed())
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  with jax.set_mesh(mesh):
    loss, _ = grad_fn(*placed())
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_dropin_reads_explicit_model_axes_from_the_params_types():
  """Tensor parallel on an all-Explicit data x model mesh, the drop-in with
  no model_specs: inside the caller's jit the params' types name their
  model axes, zerojax reads them there, adds data beside them, and the
  params keep their types; Optax's numbers."""
  mesh = _mesh("data=4,model=2")
  k = jax.random.split(jax.random.key(0), 2)
  host = {
    "w1": jax.random.normal(k[0], (6, 10)),
    "w2": jax.random.normal(k[1], (10, 3)),
  }
  specs = {"w1": P(None, "model"), "w2": P("model", None)}

  def loss(p, b, typed):
    h = jnp.tanh(b["x"] @ p["w1"])
    y = (
      jnp.matmul(h, p["w2"], out_sharding=P("data", None))
      if typed
      else h @ p["w2"]
    )
    return jnp.mean((y - b["y"]) ** 2)

  opt, data = optax.adam(1e-2), _dropin_data()
  p, s = host, opt.init(host)
  for b in data:
    u, s = opt.update(jax.grad(loss)(p, b, False), s, p)
    p = optax.apply_updates(p, u)
  with jax.set_mesh(mesh):
    params = {
      n: jax.device_put(v, NamedSharding(mesh, specs[n]))
      for n, v in host.items()
    }
    tx = zerojax.zero(opt, stage=1)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
      u, opt_state = tx.update(
        jax.grad(loss)(params, batch, True), opt_state, params
      )
      return optax.apply_updates(params, u), opt_state

    for b in data:
      params, opt_state = step(
        params, opt_state, jax.device_put(b, NamedSharding(mesh, P("data")))
      )
  assert jax.typeof(opt_state[0].mu["w1"]).sharding.spec == P(
    None, ("data", "model")
  )
  assert jax.typeof(opt_state[0].mu["w2"]).sharding.spec == P("model", "data")
  assert {n: jax.typeof(x).sharding.spec for n, x in params.items()} == {
    "w1": P(None, "model"),
    "w2": P("model", None),
  }
  assert toy.rel_err(params, p) < 2e-6


def test_a_batch_on_another_mesh_of_the_same_devices_is_moved(setup):
  """A batch split over replica x data (its rows on the same devices in the
  same order as data=8's) is placed on the step's own mesh, not passed in
  typed on the other one."""
  params, data = setup
  pod = zerojax.zero(
    optax.adam(1e-2),
    stage=1,
    replica_axis="replica",
    mesh=zerojax.make_mesh("replica=2,data=4"),
  )
  batch = zerojax.shard_batch(data[0], pod, 32)
  tx = zerojax.zero(optax.adam(1e-2), stage=1, mesh=_mesh())
  state, m = zerojax.train_step(toy.loss_fn, tx)(
    zerojax.init(params, tx), batch
  )
  assert np.isfinite(float(m["loss"]))


def _stacked_init(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "embed": 0.1 * jax.random.normal(k1, (16, 16)),
    "up": 0.1 * jax.random.normal(k2, (8, 16, 64)),
    "down": 0.1 * jax.random.normal(k3, (8, 64, 16)),
  }


def _stacked_loss(params, batch):
  x = params["embed"][batch["x"]]

  def layer(x, w):
    return x + jnp.tanh(x @ w[0]) @ w[1], None

  x, _ = jax.lax.scan(layer, x, (params["up"], params["down"]))
  logits = x @ params["embed"].T
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["y"]
  ).mean()


def test_offloaded_layer_stacks_by_rows_under_jax_set_mesh_bitwise():
  """``jax.make_mesh`` (Explicit) under ``jax.set_mesh``: stage 3 with the
  state in host memory streams the two layer stacks (each larger than the
  embedding) a few layers per chunk, and three steps of clip + AdamW give
  the params of no offload, bit for bit."""
  mesh = jax.make_mesh((8,), ("data",))
  ids = jnp.arange(64).reshape(8, 8)
  batches = [{"x": ids % 16, "y": (3 * ids + s) % 16} for s in range(3)]
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  got = {}
  with jax.set_mesh(mesh):
    for offload in (False, True):
      tx = zerojax.zero(opt, stage=3, offload=offload)
      state = zerojax.init_from(_stacked_init, tx, jax.random.key(0))
      step = zerojax.train_step(_stacked_loss, tx)
      for b in batches:
        state, _ = step(state, b)
      got[offload] = zerojax.gather_params(state)
      if offload:
        rep = zerojax.report(step, state, batches[0]).offload
        assert rep["stacks_by_rows"] == 2, rep
  for a, b in zip(jax.tree.leaves(got[False]), jax.tree.leaves(got[True])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
