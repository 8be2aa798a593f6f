"""Flax linen and NNX models at every stage, gathered per layer at stage 3."""

import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax
import zerojax.linen
import zerojax.nnx
from zerojax.errors import LossNotAMeanError, LossUnverifiedWarning

WIDTH, DEPTH = 16, 4
X = np.random.default_rng(0).normal(size=(32, 5)).astype(np.float32)
BATCH = {"x": X, "y": np.sin(X).sum(-1, keepdims=True)}


# --------------------------------------------------------------- linen
class LinenBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, _):
    kernel_init = nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), ("embed", "mlp")
    )
    return x + jnp.tanh(nn.Dense(self.width, kernel_init=kernel_init)(x)), None


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = zerojax.linen.gathered(nn.Dense)(WIDTH)(x)
    x, _ = zerojax.linen.scan_layers(LinenBlock, DEPTH)(WIDTH)(x, None)
    return zerojax.linen.gathered(nn.Dense)(1)(x)


class PlainLinenModel(nn.Module):
  """A model that knows nothing of zerojax (no gathers, no scan)."""

  @nn.compact
  def __call__(self, x):
    for _ in range(DEPTH):
      x = jnp.tanh(nn.Dense(WIDTH)(x))
    return nn.Dense(1)(x)


def _linen(model_cls):
  model = model_cls()
  params = model.init(jax.random.key(0), X)["params"]
  loss = lambda p, b: jnp.mean(
    (model.apply({"params": p}, b["x"]) - b["y"]) ** 2
  )
  return params, loss


# ----------------------------------------------------------------- NNX
class NNXBlock(nnx.Module):
  def __init__(self, width, rngs):
    kernel_init = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ("embed", "mlp"), eager_sharding=False
    )
    self.dense = nnx.Linear(width, width, kernel_init=kernel_init, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.dense(x))


class NNXModel(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(5, WIDTH, rngs=rngs)

    @nnx.split_rngs(splits=DEPTH)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NNXBlock(WIDTH, rngs)

    self.blocks = make(rngs)
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

  def __call__(self, x):
    x = zerojax.nnx.gathered(self.inp)(x)
    x = zerojax.nnx.scan_layers(self.blocks, x)
    return zerojax.nnx.gathered(self.out)(x)


def _nnx():
  graphdef, params = nnx.split(NNXModel(nnx.Rngs(0)), nnx.Param)
  loss = lambda p, b: jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2)
  return params, loss


MODELS = {"linen": lambda: _linen(LinenModel), "nnx": _nnx}


def _reference(params, loss, steps):
  opt = optax.adam(1e-2)
  state = opt.init(params)
  for _ in range(steps):
    grads = jax.grad(loss)(params, BATCH)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", MODELS)
def test_flax_model_matches_unsharded_optax(mesh, kind, stage):
  params, loss = MODELS[kind]()
  want = _reference(params, loss, 3)
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(loss, tx, gather="model")
  for _ in range(3):
    state, _ = step(state, BATCH)
  got = zerojax.gather_params(state)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  chex.assert_trees_all_close(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("kind", MODELS)
def test_flax_stage3_gathers_inside_the_layer_loop(mesh, kind):
  params, loss = MODELS[kind]()
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(loss, tx, gather="model")
  colls = zerojax.diagnostics.collectives(
    step.lower(state, BATCH).compile().as_text(), 8
  )
  layer = WIDTH * WIDTH + WIDTH
  loop = lambda kind_: sum(
    c.total_elements for c in colls if c.kind == kind_ and c.count == DEPTH
  )
  assert loop("all-gather") == 2 * DEPTH * layer  # forward + backward
  assert loop("reduce-scatter") == DEPTH * layer


def test_linen_partition_metadata_survives(mesh):
  params, loss = _linen(LinenModel)
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  state, _ = zerojax.train_step(loss, tx, gather="model")(state, BATCH)
  kernel = zerojax.gather_params(state)[
    "ScanCheckpointMap_variablesLinenBlock_0"
  ]["Dense_0"]["kernel"]
  assert isinstance(kernel, nn.LogicallyPartitioned)
  assert kernel.names == ("layers", "embed", "mlp")
  assert kernel.value.shape == (DEPTH, WIDTH, WIDTH)


def test_nnx_partition_metadata_survives(mesh):
  params, loss = _nnx()
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  state, _ = zerojax.train_step(loss, tx, gather="model")(state, BATCH)
  full = zerojax.gather_params(state)
  kernel = full["blocks"]["dense"]["kernel"]
  before = params["blocks"]["dense"]["kernel"].get_metadata()
  assert before["out_sharding"] == ("embed", "mlp")
  assert kernel.get_metadata() == before
  assert kernel.shape == (DEPTH, WIDTH, WIDTH)


def test_plain_linen_model_warns_and_falls_back_at_stage3(mesh):
  params, loss = _linen(PlainLinenModel)
  want = _reference(params, loss, 2)
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(loss, tx)
  with pytest.warns(
    UserWarning, match="gathers the whole parameter tree"
  ) as got:
    state, _ = step(state, BATCH)
  # traced inside the jitted step, it names the line that called the step
  assert {w.filename for w in got if "whole" in str(w.message)} == {__file__}
  state, _ = step(state, BATCH)
  for a, b in zip(
    jax.tree.leaves(zerojax.gather_params(state)), jax.tree.leaves(want)
  ):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_nnx_gathered_and_scan_keep_batch_statistics(mesh):
  """Only Params are gathered: BatchNorm's running averages, written during
  the call, land in the module (in and out of a scan)."""

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
      return self.bn(x)

  bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  zerojax.nnx.gathered(bn)(jnp.full((2, 4), 3.0))
  np.testing.assert_allclose(bn.mean[...], 0.03, rtol=1e-6)  # momentum 0.99

  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(rngs)

  stacked = make(nnx.Rngs(0))
  zerojax.nnx.scan_layers(stacked, jnp.full((2, 4), 3.0))
  # layer 0 saw the input (mean 3), later layers its normalised output
  np.testing.assert_allclose(stacked.bn.mean[...][0], 0.03, rtol=1e-5)
  assert float(jnp.abs(stacked.bn.mean[...][1:]).max()) < 1e-3


@pytest.mark.parametrize("stage", [0, 3])
def test_nnx_batch_norm_statistics_train_as_model_state(mesh, stage):
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(5, WIDTH, use_bias=False, rngs=rngs)
      self.bn = nnx.BatchNorm(WIDTH, rngs=rngs)
      self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
      g = zerojax.nnx.gathered
      return g(self.out)(g(self.bn)(g(self.lin)(x)))

  graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)

  def loss(p, b, *, model_state):
    model = nnx.merge(graphdef, p, model_state)
    out = jnp.mean((model(b["x"]) - b["y"]) ** 2)
    return out, nnx.state(model, nnx.Not(nnx.Param))

  tx = zerojax.zero(optax.sgd(0.0), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx, model_state=rest)
  # BatchNorm in training normalizes by the batch's statistics: per device
  # they are the device's rows', which zerojax refuses unless asked for
  with pytest.raises(LossNotAMeanError, match="sum over the batch"):
    zerojax.train_step(loss, tx)(state, BATCH)
  state, _ = zerojax.train_step(loss, tx, per_device_loss=True)(state, BATCH)
  # sgd(0): weights unchanged, so the statistics are those of lin(x): the
  # mean over devices of each device's batch mean is the global batch mean
  h = np.asarray(BATCH["x"]) @ np.asarray(params["lin"]["kernel"][...])
  np.testing.assert_allclose(
    state.model_state["bn"]["mean"][...], 0.01 * h.mean(0), rtol=1e-4, atol=1e-7
  )


def test_an_nnx_module_passed_to_init_is_refused_with_the_split_to_use(mesh):
  model = NNXModel(nnx.Rngs(0))
  tx = zerojax.zero(optax.adam(1e-3), stage=1, mesh=mesh)
  with pytest.raises(TypeError, match=r"nnx\.Module \(NNXModel\).*nnx\.split"):
    zerojax.init(model, tx)


# ------------------------------------------------- tensor parallel (model axis)
def test_linen_logical_partitioning_runs_tensor_parallel():
  """Linen logical names + rules -> the model's own sharding over 'model';
  zerojax adds 'data' beside it. Same numbers as unsharded Optax."""
  params, loss = _linen(LinenModel)
  want = _reference(params, loss, 3)
  mesh = zerojax.make_mesh("data=4,model=2")
  specs = zerojax.linen.model_specs(
    params, rules=(("mlp", "model"), ("embed", None), ("layers", None))
  )
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh, model_specs=specs)
  state = zerojax.init(params, tx)
  kernel = state.params["ScanCheckpointMap_variablesLinenBlock_0"]["Dense_0"][
    "kernel"
  ].value  # (layers, embed, mlp)
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(
    None, "data", "model"
  )
  step = zerojax.train_step(loss, tx, gather="model")
  for _ in range(3):
    state, _ = step(state, BATCH)
  for a, b in zip(
    jax.tree.leaves(zerojax.gather_params(state)), jax.tree.leaves(want)
  ):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_nnx_params_sharded_at_creation_keep_their_model_axis():
  """An NNX model built under jax.set_mesh with sharding metadata: zerojax
  reads each param's model sharding from the array itself."""
  mesh = zerojax.make_mesh("data=4,model=2")
  with jax.set_mesh(mesh):
    model = nnx.Sequential(
      nnx.Linear(
        5,
        16,
        kernel_init=nnx.with_partitioning(
          nnx.initializers.lecun_normal(), (None, "model")
        ),
        rngs=nnx.Rngs(0),
      ),
      nnx.Linear(
        16,
        1,
        kernel_init=nnx.with_partitioning(
          nnx.initializers.lecun_normal(), ("model", None)
        ),
        rngs=nnx.Rngs(1),
      ),
    )
  graphdef, params = nnx.split(model, nnx.Param)
  loss = lambda p, b: jnp.mean(
    (nnx.merge(graphdef, zerojax.gather(p))(b["x"]) - b["y"]) ** 2
  )
  host = jax.tree.map(lambda x: np.asarray(x), params)
  want = _reference(
    host,
    lambda p, b: jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2),
    3,
  )
  assert zerojax.nnx.model_specs(params)["layers"][0]["kernel"].get_value() == (
    jax.sharding.PartitionSpec(None, "model")
  )
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh, stacked=False)
  state = zerojax.init(params, tx)
  k0 = state.params["layers"][0]["kernel"][...]
  assert k0.sharding.spec == jax.sharding.PartitionSpec("data", "model")
  step = zerojax.train_step(loss, tx, gather="model")
  for _ in range(3):
    state, _ = step(state, BATCH)
  for a, b in zip(
    jax.tree.leaves(zerojax.gather_params(state)), jax.tree.leaves(want)
  ):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_nnx_optimizer_takes_nnx_model_specs_on_an_auto_mesh(stage):
  """Flax's sharding guide: an NNX model built in ``nnx.jit`` with
  ``nnx.with_partitioning`` over an Auto ``model`` axis, trained by
  ``nnx.Optimizer``. The drop-in takes the specs of
  ``zerojax.nnx.model_specs(nnx.state(model, nnx.Param))``, whose paths
  end in ``.value``, for the pure params the optimizer hands it, and
  trains as plain Optax does."""
  mesh = jax.make_mesh(
    (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  init = nnx.initializers.lecun_normal()

  @nnx.jit
  def create():
    model = nnx.Sequential(
      nnx.Linear(
        5,
        16,
        kernel_init=nnx.with_partitioning(init, (None, "model")),
        rngs=nnx.Rngs(0),
      ),
      nnx.gelu,
      nnx.Linear(
        16,
        1,
        kernel_init=nnx.with_partitioning(init, ("model", None)),
        rngs=nnx.Rngs(1),
      ),
    )
    state = nnx.state(model)
    nnx.update(
      model,
      jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)),
    )
    return model

  @nnx.jit
  def train(model, optimizer, batch):
    def loss(model):
      return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    grads = nnx.grad(loss)(model)
    optimizer.update(model, grads)

  def run(make_tx):
    with jax.set_mesh(mesh):
      model = create()
      optimizer = nnx.Optimizer(model, make_tx(model), wrt=nnx.Param)
      for _ in range(3):
        train(model, optimizer, BATCH)
    return nnx.state(model, nnx.Param)

  want = run(lambda _: optax.adam(1e-2))
  got = run(
    lambda model: zerojax.zero(
      optax.adam(1e-2),
      stage=stage,
      mesh=mesh,
      model_specs=zerojax.nnx.model_specs(nnx.state(model, nnx.Param)),
    )
  )
  assert got["layers"][0]["kernel"][
    ...
  ].sharding.spec == jax.sharding.PartitionSpec(None, "model")
  chex.assert_trees_all_close(got, want, rtol=2e-5, atol=1e-6)
  # without the specs the drop-in cannot read Auto axes inside a jit: the
  # error names the call that gives them
  hint = r"zerojax\.nnx\.model_specs\(nnx\.state\(model, nnx\.Param\)\)"
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=hint):
    nnx.Optimizer(
      create(),
      zerojax.zero(optax.adam(1e-2), stage=stage, mesh=mesh),
      wrt=nnx.Param,
    )


class LinenAttention(nn.Module):
  """Positions broadcast over the rows and looked up in a table, with
  Linen's causal, segment and padding masks, as Flax's language models
  write them."""

  @nn.compact
  def __call__(self, ids, seg):
    rows, tokens = ids.shape
    pos = jnp.broadcast_to(jnp.arange(tokens)[None, :], (rows, tokens))
    x = nn.Embed(32, 16)(ids) + nn.Embed(tokens, 16)(pos)
    mask = nn.combine_masks(
      nn.make_causal_mask(ids),
      nn.make_attention_mask(seg, seg, jnp.equal),
      nn.make_attention_mask(ids > 0, ids > 0),
    )
    x = x + nn.MultiHeadDotProductAttention(num_heads=2)(x, mask=mask)
    return nn.Dense(32)(nn.LayerNorm()(x))


def _assert_read_and_like_sgd(mesh, stage, loss, params, batch):
  """One step of ``loss`` with no loss-check warning equals one step of
  unsharded SGD."""
  want = jax.tree.map(
    lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, batch)
  )
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossUnverifiedWarning)
    state, _ = zerojax.train_step(loss, tx, gather="all")(state, batch)
  chex.assert_trees_all_close(
    zerojax.gather_params(state), want, rtol=1e-5, atol=1e-6
  )


class LinenConvNet(nn.Module):
  """Convolutions (strided, grouped), GroupNorm, max and average pooling,
  and a patch embedding by a strided convolution, as Flax's image models
  write them."""

  @nn.compact
  def __call__(self, img):
    x = nn.Conv(8, (3, 3), strides=2)(img)
    x = nn.relu(nn.GroupNorm(num_groups=4)(x))
    x = nn.Conv(8, (3, 3), feature_group_count=8)(x)
    x = nn.max_pool(x, (2, 2), strides=(2, 2)) + nn.avg_pool(x, (2, 2), (2, 2))
    patches = nn.Conv(8, (2, 2), strides=2, padding="VALID")(img)
    x = x.reshape(len(x), -1, 8) + patches.reshape(len(x), -1, 8)[:, :4]
    return nn.Dense(10)(x.mean(1))


@pytest.mark.parametrize("stage", [0, 3])
def test_linen_conv_net_trains_like_optax_with_its_loss_read(mesh, stage):
  """A convolution runs on each example alone: the loss check reads the
  model as per example (no warning), and the step equals unsharded Optax."""
  model = LinenConvNet()
  rng = np.random.default_rng(0)
  batch = {
    "img": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
    "y": rng.integers(0, 10, 16),
  }
  params = model.init(jax.random.key(0), batch["img"])["params"]

  def loss(p, b):
    logits = model.apply({"params": p}, b["img"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, b["y"]
    ).mean()

  _assert_read_and_like_sgd(mesh, stage, loss, params, batch)


@pytest.mark.parametrize("stage", [0, 3])
def test_linen_positions_broadcast_over_the_rows_train_like_optax(mesh, stage):
  """The position table's lookup is read as the same for every example
  (no warning), and the step equals unsharded Optax."""
  model = LinenAttention()
  rng = np.random.default_rng(0)
  batch = {
    "ids": rng.integers(1, 32, (16, 8)),
    "seg": np.repeat(np.array([[1] * 4 + [2] * 4]), 16, 0),
    "y": rng.integers(0, 32, (16, 8)),
  }
  params = model.init(jax.random.key(0), batch["ids"], batch["seg"])["params"]

  def loss(p, b):
    logits = model.apply({"params": p}, b["ids"], b["seg"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
    return jnp.mean(jnp.sum(ce * (b["ids"] > 0), 1) / 8.0)

  _assert_read_and_like_sgd(mesh, stage, loss, params, batch)
