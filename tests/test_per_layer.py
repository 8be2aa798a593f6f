"""A loss written for plain data parallelism, with no ``zerojax.gather``:
its ``lax.scan`` over stacked layers is gathered and reduce-scattered one
layer at a time, exactly (stages 1-3).

The losses here are plain JAX. zerojax reads their traced program and
gathers each layer's slice inside the scan body (``jaxpr/layers.py``);
every other use of a parameter gets the whole leaf, gathered once.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
from tests import toy

L, D, V, B = 4, 16, 24, 16


def _params():
  return toy.layered_params(L, D, V)


def _data(n=2):
  rng = np.random.default_rng(0)
  return [
    {
      "x": rng.integers(0, V, (B,)).astype(np.int32),
      "y": rng.integers(0, V, (B,)).astype(np.int32),
    }
    for _ in range(n)
  ]


def _head(params, h, batch):
  logits = h @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["y"]
  ).mean()


def _block(h, layer):
  return jnp.tanh(h @ layer["w"] + layer["b"][None, :])


def checkpointed_scan(params, batch):
  h, _ = jax.lax.scan(
    jax.checkpoint(lambda h, l: (_block(h, l), None)),
    params["embed"][batch["x"]],
    params["layers"],
  )
  return _head(params, h, batch)


def unchecked_scan(params, batch):
  h, _ = jax.lax.scan(
    lambda h, l: (_block(h, l), None),
    params["embed"][batch["x"]],
    params["layers"],
  )
  return _head(params, h, batch)


def reversed_scan_with_outputs(params, batch):
  h, hs = jax.lax.scan(
    lambda h, l: (_block(h, l), h.mean()),
    params["embed"][batch["x"]],
    params["layers"],
    reverse=True,
  )
  return _head(params, h, batch) + 1e-3 * hs.sum()


@jax.jit
def _jitted_body(params, x):
  h, _ = jax.lax.scan(
    jax.checkpoint(lambda h, l: (_block(h, l), None)), x, params["layers"]
  )
  return h


def scan_inside_jit(params, batch):
  return _head(params, _jitted_body(params, params["embed"][batch["x"]]), batch)


PER_LAYER = {
  f.__name__: f
  for f in (
    checkpointed_scan,
    unchecked_scan,
    reversed_scan_with_outputs,
    scan_inside_jit,
  )
}


def _zero_run(loss, stage, mesh, **kw):
  tx = zerojax.zero(optax.adam(1e-2), stage=stage, mesh=mesh, **kw)
  return toy.zero_run(loss, tx, _params(), _data())


def _assert_equal(got, want, losses, want_losses):
  chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", PER_LAYER)
def test_plain_scan_losses_equal_unsharded_optax_without_a_warning(
  mesh, name, stage
):
  loss = PER_LAYER[name]
  want, want_losses = toy.optax_run(loss, optax.adam(1e-2), _params(), _data())
  got, losses, notes = _zero_run(loss, stage, mesh)
  _assert_equal(got, want, losses, want_losses)
  assert not notes, notes  # per layer: nothing gathered whole to warn of


def _compiled(loss, stage, gather="auto", layers=8, width=64):
  tx = zerojax.zero(optax.adam(1e-3), stage=stage)
  state = zerojax.init(toy.layered_params(layers, width, V), tx)
  batch = {"x": np.zeros((64,), np.int32), "y": np.zeros((64,), np.int32)}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    step = zerojax.train_step(loss, tx, gather=gather)
    return step.lower(state, batch).compile()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_plain_scan_reduce_scatters_each_layer_inside_the_backward_loop(
  stage,
):
  """The stacked weight's gradient is reduce-scattered once per layer
  inside a loop (``layers`` executions of one layer's elements), and at
  stage 3 its all-gather runs per layer too, in the forward loop and again
  in the backward one: what a model that calls zerojax.gather compiles to."""
  layers, width = 8, 64
  hlo = _compiled(
    toy.plain_layered_loss, stage, layers=layers, width=width
  ).as_text()
  colls = zerojax.diagnostics.collectives(hlo, 8)
  layer_w = width * width
  rs = [
    c
    for c in colls
    if c.kind == "reduce-scatter"
    and c.elements >= layer_w
    and c.count == layers
  ]
  assert rs, [(c.kind, c.elements, c.count) for c in colls]
  assert not [
    c
    for c in colls
    if c.kind == "reduce-scatter" and c.elements >= layers * layer_w
  ], "a whole-stack reduction"
  gathers = sum(
    c.count for c in colls if c.kind == "all-gather" and c.elements == layer_w
  )
  assert gathers == (2 * layers if stage == 3 else 0), gathers


def _remat_cse(jaxpr) -> list:
  """``prevent_cse`` of every ``jax.checkpoint`` in a traced program, sub-
  programs included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("remat2", "checkpoint"):
      out.append(eqn.params["prevent_cse"])
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          out += _remat_cse(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          out += _remat_cse(sub)
  return out


@pytest.mark.parametrize("stage", [1, 3])
def test_the_walked_scan_body_drops_its_checkpoints_cse_barrier(stage):
  """A plain scan body under ``jax.checkpoint`` (``prevent_cse=True``, the
  default: an optimization barrier on the checkpoint's inputs, which the
  walk makes the gathered weights) is run with ``prevent_cse=False``
  inside the walked scan, so the barrier no longer holds every all-gather
  back from the block's compute (on TPU: the compiler can then issue them
  asynchronously; docs/design.md). The traced step keeps no checkpoint
  with the barrier (the numbers: the parity tests above)."""
  assert True in _remat_cse(
    jax.make_jaxpr(checkpointed_scan)(_params(), _data(1)[0]).jaxpr
  )  # the loss as written has it
  tx = zerojax.zero(optax.adam(1e-3), stage=stage)
  state = zerojax.init(_params(), tx)
  step = zerojax.train_step(checkpointed_scan, tx)
  cse = _remat_cse(step.trace(state, _data(1)[0]).jaxpr.jaxpr)
  assert cse and True not in cse, cse


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_plain_scan_holds_what_the_gathering_model_holds(stage):
  """Compiled temp bytes per device: the plain loss (no zerojax call) within
  a quarter of one stacked gradient of the model that gathers per layer.
  The whole-tree gather (``gather="all"``) holds more: at stage 3 the full
  weights and the unreduced gradient, by most of the stacked gradient in
  temp bytes; at stages 1-2 the unreduced stacked gradient, reduced once
  after the backward loop (its temp bytes cannot show it: the update's
  all-gather of the new params needs a buffer the stacked params' size in
  each of these programs, and the gradient fits in it)."""
  layers, width = 8, 64
  stacked = layers * width * width * 4
  compiled = lambda loss, gather="auto": _compiled(
    loss, stage, gather, layers, width
  )
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  plain_c = compiled(toy.plain_layered_loss)
  plain, model = temp(plain_c), temp(compiled(toy.layered_loss))
  whole_c = compiled(toy.plain_layered_loss, "all")
  assert abs(plain - model) < 0.25 * stacked, (plain, model, stacked)
  if stage == 3:
    whole = temp(whole_c)
    assert whole - plain > 0.75 * stacked * (1 - 1 / 8), (whole, plain)
    return
  stacked_elements = layers * width * width
  assert toy.reduce_scatter_counts(whole_c, stacked_elements) == {1}
  assert toy.reduce_scatter_counts(plain_c, stacked_elements) == set()


def penalised_scan(params, batch):
  reg = sum(jnp.sum(x**2) for x in jax.tree.leaves(params))
  return checkpointed_scan(params, batch) + 1e-3 * reg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_leaf_used_inside_and_outside_its_scan_is_exact_and_named(
  mesh, stage
):
  """An L2 term over the whole tree uses the stacked weights outside the
  scan too: they are gathered whole as well, the numbers stay exact, and
  stages 2-3 say which leaves are not lean."""
  want, want_losses = toy.optax_run(
    penalised_scan, optax.adam(1e-2), _params(), _data()
  )
  got, losses, notes = _zero_run(penalised_scan, stage, mesh)
  _assert_equal(got, want, losses, want_losses)
  if stage == 1:
    assert not notes, notes
  else:
    assert len(notes) == 1, notes
    assert "params['layers']['w']" in notes[0] and "per layer" in notes[0]


def test_a_stack_sharded_along_its_layers_is_gathered_whole_exactly(mesh):
  """With ``stacked`` saying no leaf is a layer stack, the 8-layer weight
  is sharded along its leading dimension, which a scan slices: zerojax
  gathers it whole before the scan, exact."""
  params = toy.layered_params(8, D, V)
  want, want_losses = toy.optax_run(
    checkpointed_scan, optax.adam(1e-2), params, _data()
  )
  tx = zerojax.zero(
    optax.adam(1e-2), stage=3, mesh=mesh, stacked=lambda path, shape: False
  )
  got, losses, notes = toy.zero_run(checkpointed_scan, tx, params, _data())
  _assert_equal(got, want, losses, want_losses)
  # nothing could be gathered per layer: the whole-tree warning, once
  assert len(notes) == 1 and "gathers the whole parameter tree" in notes[0]


@pytest.mark.parametrize("name", ["checkpointed_scan", "scan_inside_jit"])
def test_the_eval_step_runs_a_plain_scan_per_layer_exactly(mesh, name):
  loss = PER_LAYER[name]
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(_params(), tx)
  batch = _data(1)[0]
  with toy.warnings_as_errors():
    got = zerojax.eval_step(loss, tx)(state, batch)
  np.testing.assert_allclose(got, loss(_params(), batch), rtol=1e-5)


def _check_stage3_per_layer(loss, opt, params, data, mesh):
  """Stage 3: the same numbers as plain Optax with no warning, and the
  ``D x D`` kernel all-gathered per layer twice (forward, backward) and
  reduce-scattered per layer."""
  want, want_losses = toy.optax_run(loss, opt, params, data)
  tx = zerojax.zero(opt, stage=3, mesh=mesh)
  got, losses, notes = toy.zero_run(loss, tx, params, data)
  _assert_equal(got, want, losses, want_losses)
  assert not notes, notes
  state = zerojax.init(params, tx)
  hlo = zerojax.train_step(loss, tx).lower(state, data[0]).compile().as_text()
  per_layer = [
    (c.kind, c.count)
    for c in zerojax.diagnostics.collectives(hlo, 8)
    if c.elements == D * D
  ]
  assert sorted(per_layer) == [
    ("all-gather", L),
    ("all-gather", L),
    ("reduce-scatter", L),
  ], per_layer


def test_a_linen_nn_scan_model_is_gathered_per_layer_exactly(mesh):
  """Flax Linen's ``nn.scan`` over a remat block, parameters stacked on
  axis 0, no zerojax call: at stage 3 the stacked kernel is all-gathered
  per layer (forward and backward) and reduce-scattered per layer, and
  two steps equal plain Optax."""
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(nn.Dense(D)(h)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Embed(V, D)(x)
      stack = nn.scan(
        nn.remat(Block),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=L,
      )
      h, _ = stack()(h, None)
      return nn.Dense(V)(h)

  model = Model()
  data = _data()
  params = model.init(jax.random.key(0), data[0]["x"])["params"]

  def loss(p, batch):
    logits = model.apply({"params": p}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  _check_stage3_per_layer(loss, optax.adam(1e-2), params, data, mesh)


TP_SPECS = {
  "embed": P(None, "model"),
  "layers": {"w": P(None, None, "model"), "b": P(None, "model")},
  "head": P("model", None),
  "bias3": None,
  "scale": None,
  "ids": None,
}


def plain_toy_loss(params, batch):
  """``toy.loss_fn`` with no zerojax call: the same numbers, plain JAX."""
  x = params["embed"][batch["x"]]
  h, _ = jax.lax.scan(
    jax.checkpoint(lambda h, l: (jnp.tanh(h @ l["w"] + l["b"][None, :]), None)),
    x,
    params["layers"],
  )
  logits = h @ params["head"] * params["scale"]
  bias = jnp.concatenate([params["bias3"], jnp.zeros((2,), logits.dtype)])
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits + bias[None, :], batch["y"]
  ).mean()
  return loss + 0.0 * params["ids"].sum()


CONFIGS = {
  "hybrid": dict(mesh="replica=2,data=4"),
  "tensor_parallel": dict(mesh="data=4,model=2", model_specs=TP_SPECS),
  "hybrid_tensor_parallel": dict(
    mesh="replica=2,data=2,model=2", model_specs=TP_SPECS
  ),
  "qgZ": dict(zeropp=zerojax.ZeroPP(grad_bits=8, block_size=4)),
  "qwZ_qgZ_hpZ": dict(
    zeropp=zerojax.ZeroPP(weight_bits=8, grad_bits=8, block_size=4, hpz_size=4)
  ),
  "accumulation": dict(accum_steps=2),
  "offload": dict(offload=True),
}


@pytest.mark.parametrize(
  "config,stage",
  [
    (c, s)
    for c in CONFIGS
    for s in (1, 2, 3)
    if not (c == "qwZ_qgZ_hpZ" and s < 3)
  ],
)
def test_a_plain_loss_trains_as_the_gathering_model_does(config, stage):
  """The plain toy loss against ``toy.loss_fn`` (which calls
  ``zerojax.gather`` per layer and is checked against Optax elsewhere) under
  the same transformation: pod meshes, ZeRO++ (whose quantization blocks
  follow the per-layer slices either way), accumulation, offload. The
  same numbers, and no warning."""
  kw = dict(CONFIGS[config])
  accum = kw.pop("accum_steps", 1)
  mesh = zerojax.make_mesh(kw.pop("mesh", "data=8"))
  params = toy.init_params(jax.random.key(0), width=6)
  data = toy.batches(2)
  runs = []
  for loss in (toy.loss_fn, plain_toy_loss):
    tx = zerojax.zero(optax.adamw(1e-2), stage=stage, mesh=mesh, **kw)
    runs.append(toy.zero_run(loss, tx, params, data, accum_steps=accum))
  (want, want_losses, _), (got, losses, notes) = runs
  _assert_equal(got, want, losses, want_losses)
  assert not notes, notes


def test_an_nnx_scan_model_is_gathered_per_layer_exactly(mesh):
  """Flax NNX's ``nnx.scan`` over vmapped blocks, no zerojax call, the loss
  a ``nnx.merge`` of the params: at stage 3 the stacked kernel is
  all-gathered per layer (forward and backward) and reduce-scattered per
  layer, and two SGD steps equal plain Optax."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.lin(x))

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.inp = nnx.Linear(5, D, rngs=rngs)

      @nnx.split_rngs(splits=L)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(rngs)

      self.blocks = make(rngs)
      self.out = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def forward(x, block):
        return block(x)

      return self.out(forward(self.inp(x), self.blocks))

  graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)

  def loss(p, batch):
    return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

  rng = np.random.default_rng(0)
  data = [
    {
      "x": rng.standard_normal((B, 5)).astype(np.float32),
      "y": rng.standard_normal((B, 1)).astype(np.float32),
    }
    for _ in range(2)
  ]
  _check_stage3_per_layer(loss, optax.sgd(0.1), params, data, mesh)
