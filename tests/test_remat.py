"""ZeRO-R on models that are not the reference GPT: ``zerojax.remat`` around
an NNX and a Linen MLP-mixer block stack (``zerojax.nnx.scan_layers``,
``zerojax.linen.scan_layers``) on a data=4 x model=2 mesh.

Claims: the numbers are those of the same model without the call (SGD,
rtol 1e-5); Pa (``partition="model"``) keeps at least 0.45 of one block
input less per layer in the compiled step; ``offload=True`` places exactly
the kept tensors in ``pinned_host`` in the CUDA lowering made on CPU; the
report's and the planner's saved-activation figure per layer is within 5%
of the compiled step's per-layer growth; bad settings raise before any
compile, naming the numbers.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
import zerojax.cost
from tests import mixers

# the model axis carries Pa only here (no tensor-parallel params)
pytestmark = pytest.mark.filterwarnings("ignore:zerojax.init. mesh axes")

B, T, D = mixers.B, mixers.T, mixers.D
MODELS = mixers.MODELS
MESH = "data=4,model=2"
LOCAL_ROWS = B // 4  # one device's batch (data=4)
INPUT_BYTES = LOCAL_ROWS * T * D * 4  # one saved block input, fp32


_batch = mixers.batch


def _step(kind, depth, remat, stage=3, mesh=MESH, params=None):
  own, loss = mixers.ALL[kind](depth, remat)
  # another model's initial values (Linen's init follows module names,
  # and nn.remat renames the scan), in this model's tree
  params = (
    own
    if params is None
    else jax.tree.unflatten(jax.tree.structure(own), jax.tree.leaves(params))
  )
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=zerojax.make_mesh(mesh))
  state = zerojax.init(params, tx)
  return state, zerojax.train_step(loss, tx)


def _trained(kind, remat, steps=2, params=None):
  state, step = _step(kind, 2, remat, params=params)
  for s in range(steps):
    state, _ = step(state, _batch(s))
  return zerojax.gather_params(state)


SETTINGS = {
  "pa": zerojax.remat(partition="model"),
  "dots+pa+offload": zerojax.remat(
    saves="dots", partition="model", offload=True
  ),
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", MODELS)
def test_remat_gives_the_numbers_of_the_model_without_it(kind, setting):
  """Stage 3, SGD, two steps: the params equal those of the same model
  with every intermediate kept (``remat=False``), rtol 1e-5 (Pa's split
  reorders fp32 sums only)."""
  init = MODELS[kind](2, SETTINGS[setting])[0]
  want = _trained(kind, False, params=init)
  got = _trained(kind, SETTINGS[setting], params=init)
  chex.assert_trees_all_close(
    jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-5, atol=1e-7
  )


@pytest.mark.parametrize("saves", ["input", "dots"])
def test_pa_in_a_users_explicit_mesh_loop_through_the_drop_in(saves):
  """The NNX model with Pa in the user's own jitted loop on
  ``jax.make_mesh`` (Explicit axes), the drop-in at stage 1: Optax's
  numbers (the same loop with plain ``optax.sgd``), with ``"dots"`` too
  (each kept matmul output resharded split and back in the block)."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  results = []
  for remat in (False, zerojax.remat(saves=saves, partition="model")):
    params, loss = mixers.nnx_model(2, remat)
    tx = (
      optax.sgd(0.1)
      if remat is False
      else zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
    )
    with jax.set_mesh(mesh):
      params = jax.device_put(
        params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      )
      opt_state = tx.init(params)

      @jax.jit
      def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      for s in range(2):
        b = jax.device_put(
          _batch(s),
          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
        )
        params, opt_state = step(params, opt_state, b)
    results.append(params)
  chex.assert_trees_all_close(
    jax.tree.leaves(results[1]),
    jax.tree.leaves(results[0]),
    rtol=1e-5,
    atol=1e-7,
  )


@pytest.mark.parametrize("saves", ["input", "dots"])
def test_pa_on_an_explicit_mesh_computes_on_the_whole_input(saves):
  """Attention (both operands split over the sequence would not
  type-check) under Pa in a user's jitted loop on ``jax.make_mesh``
  (Explicit axes): the block sees its input whole along the sequence
  (the split is what the checkpoint saves), and the loss and grads equal
  those of the block without the call (rtol 1e-5)."""
  seen = []

  def attend(x_BxTxD, w_DxD):
    seen.append(jax.typeof(x_BxTxD).sharding.spec)
    q_BxTxD = x_BxTxD @ w_DxD
    a_BxTxT = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q_BxTxD, x_BxTxD), -1)
    return x_BxTxD + jnp.einsum("bts,bsd->btd", a_BxTxT, x_BxTxD), None

  def loss(w, x, block):
    return jnp.mean(jax.lax.scan(block, x, w)[0] ** 2)

  rng = np.random.default_rng(0)
  w = (rng.normal(size=(2, D, D)) / np.sqrt(D)).astype(np.float32)
  x = rng.normal(size=(B, T, D)).astype(np.float32)
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  got = {}
  for name, block in (
    ("plain", attend),
    ("pa", zerojax.remat(attend, saves=saves, partition="model")),
  ):
    with jax.set_mesh(mesh):
      xs = jax.device_put(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
      )
      got[name] = jax.jit(jax.value_and_grad(lambda w, x: loss(w, x, block)))(
        w, xs
      )
  assert seen[-1][1] is None, seen
  chex.assert_trees_all_close(
    jax.tree.leaves(got["pa"]),
    jax.tree.leaves(got["plain"]),
    rtol=1e-5,
    atol=1e-7,
  )


def _growth(kind, remat, depths=(2, 4)):
  """Compiled temp bytes per added layer (between ``depths``), less the
  layer's gradient shard the backward scan stacks too, and the report's
  saved bytes per layer."""
  temps, report = {}, {}
  lo, hi = depths
  for depth in depths:
    state, step = _step(kind, depth, remat)
    temps[depth] = (
      step.lower(state, _batch()).compile().memory_analysis().temp_size_in_bytes
    )
    report[depth] = zerojax.report(step, state, _batch()).activations
  grads = (
    sum(
      x.addressable_shards[0].data.size * 4
      for path, x in jax.tree_util.tree_leaves_with_path(state.params)
      if "blocks" in jax.tree_util.keystr(path)  # NNX
      or "Scan" in jax.tree_util.keystr(path)
    )
    / hi
  )  # Linen
  compiled = (temps[hi] - temps[lo]) / (hi - lo) - grads
  reported = (report[hi]["scan"] - report[lo]["scan"]) / (hi - lo)
  return compiled, reported, report[hi]


@pytest.mark.parametrize("kind", MODELS)
def test_pa_cuts_the_saved_block_input_and_the_report_says_so(kind):
  """With Pa the compiled step grows by at least 0.45 of one block input
  less per layer; the report's per-layer figure (Pa applied) is within 5%
  of the compiled growth, with and without Pa."""
  full_c, full_r, _ = _growth(kind, True)
  pa_c, pa_r, pa_report = _growth(kind, zerojax.remat(partition="model"))
  assert full_c - pa_c >= 0.45 * INPUT_BYTES, (full_c, pa_c, INPUT_BYTES)
  assert full_r == pytest.approx(full_c, rel=0.05), (full_r, full_c)
  assert pa_r == pytest.approx(pa_c, rel=0.05), (pa_r, pa_c)
  assert pa_report["partitioned"] == 4 * INPUT_BYTES // 2, pa_report


@pytest.mark.parametrize("kind", MODELS)
def test_pa_splits_every_kept_matmul_output_and_the_report_says_so(kind):
  """``saves="dots"`` with Pa: each kept tensor (the block input and the
  four matmul outputs) is split over model=2, so the compiled step grows
  per layer by at most 0.55x of what it grows without Pa (XLA's own
  propagation splits only some of them: 0.67x); the report's per-layer
  figure is within 5% of the compiled growth, with and without Pa."""
  full_c, full_r, _ = _growth(kind, zerojax.remat(saves="dots"))
  pa_c, pa_r, pa_report = _growth(
    kind, zerojax.remat(saves="dots", partition="model")
  )
  assert pa_c <= 0.55 * full_c, (pa_c, full_c)
  assert full_r == pytest.approx(full_c, rel=0.05), (full_r, full_c)
  assert pa_r == pytest.approx(pa_c, rel=0.05), (pa_r, pa_c)
  assert pa_report["partitioned"] == 4 * full_r // 2, pa_report


def test_pa_splits_tagged_tensors_and_matmuls_inside_nested_jit():
  """A plain-JAX block function: the tensor it tags (``saves=("mix",)``)
  and the matmul output inside the ``jax.jit`` function it calls
  (``saves="dots"``) are split by Pa, halving the compiled per-layer growth
  (<= 0.55x) with the report within 5%; SGD params equal to the block
  without the call (rtol 1e-5). Depths 4 and 6: on JAX 0.10.2 XLA packs
  depth 2's temp buffers tighter with "dots" and Pa (9,216 B from depth 2
  to 4, 10,240 B per layer from 4 to 8)."""
  for saves in (("mix",), "dots"):
    full_c, full_r, _ = _growth("jax", zerojax.remat(saves=saves), (4, 6))
    pa_c, pa_r, _ = _growth(
      "jax", zerojax.remat(saves=saves, partition="model"), (4, 6)
    )
    assert pa_c <= 0.55 * full_c, (saves, pa_c, full_c)
    assert pa_r == pytest.approx(pa_c, rel=0.05), (saves, pa_r, pa_c)
    assert full_r == pytest.approx(full_c, rel=0.05), (saves, full_r, full_c)
  want = _trained("jax", False)
  got = _trained("jax", zerojax.remat(saves=("mix",), partition="model"))
  chex.assert_trees_all_close(
    jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-5, atol=1e-7
  )


def _placements(step, state, batch):
  text = step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
  return re.findall(
    r"annotate_device_placement[^\n]*_xla_buffer_placement"
    r' = "(\w+)"[^\n]*: \((tensor<[^>]*>)\)',
    text,
  )


def _tensor(shape, itemsize=4):
  return f"tensor<{'x'.join(map(str, shape))}xf{8 * itemsize}>"


@pytest.mark.parametrize("saves", ["input", "dots"])
@pytest.mark.parametrize("kind", MODELS)
def test_offload_places_exactly_the_kept_tensors_in_pinned_host(kind, saves):
  """``offload=True``: the pinned-host placements of the CUDA program are,
  shape for shape, the saved tensors the traced loss keeps per layer
  (read from ``jax.ad_checkpoint.print_saved_residuals`` by the planner),
  one each way per layer inside the scans; none without offload."""
  remat = zerojax.remat(saves=saves, offload=True)
  state, step = _step(kind, 2, remat)
  placed = _placements(step, state, _batch())
  host = sorted(p[1] for p in placed if p[0] == "pinned_host")
  assert all(p[0] in ("pinned_host", "device") for p in placed), placed
  params, loss = MODELS[kind](2, remat)
  acts = zerojax.cost.saved_activations(
    loss, params, jax.tree.map(lambda x: x[:LOCAL_ROWS], _batch())
  )
  # the layer scans keep everything in host memory (outside them, the
  # input and head layers keep their few residuals on the device)
  assert acts["host"] == acts["scan"] > 0, acts
  kept = sorted(
    _tensor(s[1:], i) for s, i, where, scan in acts["lines"] if where == "host"
  )
  assert host == kept, (host, kept)
  if saves == "input":
    assert host == [_tensor((LOCAL_ROWS, T, D))]
  state, step = _step(kind, 2, zerojax.remat(saves=saves))
  assert [
    p for p in _placements(step, state, _batch()) if p[0] == "pinned_host"
  ] == []


def test_planner_traces_a_users_model_and_adds_it_to_the_working_set():
  """``zerojax.cost.saved_activations`` on abstract shapes: the NNX model
  with Pa keeps ``depth`` block inputs split over model=2; the planner's
  working set adds it to the model state."""
  depth = 4
  params, loss = mixers.nnx_model(depth, zerojax.remat(partition="model"))
  shapes = jax.eval_shape(lambda: params)
  batch = jax.eval_shape(
    lambda: jax.tree.map(lambda x: x[:LOCAL_ROWS], _batch())
  )
  acts = zerojax.cost.saved_activations(
    loss, shapes, batch, mesh={"data": 4, "model": 2}
  )
  assert acts["scan"] == depth * INPUT_BYTES // 2, acts
  plan = zerojax.cost.plan_stage(
    shapes,
    3,
    mesh={"data": 4, "model": 2},
    model_specs=jax.tree.map(lambda _: jax.sharding.PartitionSpec(), shapes),
    activations=acts,
  )
  assert plan.working_set == plan.device + acts["device"]


def test_gpt_figure_from_the_traced_loss_matches_the_gpt_formula():
  """The planner's GPT formula and the traced figure for the same GPT
  agree (full remat with Pa, model=2)."""
  from zerojax import plan
  from zerojax.app import gpt

  cfg = gpt.GPTConfig(
    vocab=64,
    seq_len=32,
    width=64,
    depth=3,
    heads=4,
    remat="full",
    seq_shard="model",
  )
  params = jax.eval_shape(lambda: gpt.init(cfg, jax.random.key(0)))
  batch = {
    "x": jax.ShapeDtypeStruct((4, 32), jnp.int32),
    "y": jax.ShapeDtypeStruct((4, 32), jnp.int32),
  }
  acts = zerojax.cost.saved_activations(
    lambda p, b: gpt.loss(p, b, cfg),
    params,
    batch,
    mesh={"data": 4, "model": 2},
  )
  formula = plan.gpt_activations(cfg, 4, model=2)
  assert acts["scan"] == formula["device"], (acts, formula)


def test_remat_refuses_what_it_cannot_honour():
  """Settings are checked when built; a mesh without the axis, a
  dimension the axis does not divide and a manual axis are refused at
  trace time, before anything compiles, each naming the numbers."""
  with pytest.raises(zerojax.errors.RematError, match="saves='some'"):
    zerojax.remat(saves="some")
  with pytest.raises(zerojax.errors.RematError, match="offload=True"):
    zerojax.remat(saves="all", offload=True)
  with pytest.raises(zerojax.errors.RematError, match="partition=3"):
    zerojax.remat(partition=3)
  state, step = _step("nnx", 2, zerojax.remat(partition="model"), mesh="data=8")
  with pytest.raises(
    zerojax.errors.RematError,
    match=r"partition='model' names no axis.*'data': 8",
  ):
    step.lower(state, _batch())
  params, loss = mixers.nnx_model(2, zerojax.remat(partition="model"))
  with pytest.raises(zerojax.errors.RematError, match="names no axis"):
    zerojax.cost.saved_activations(loss, params, _batch(), mesh={"data": 8})
  block = zerojax.remat(lambda x, w: (x @ w, None), partition="model", dim=1)
  mesh = jax.make_mesh(
    (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  with jax.set_mesh(mesh):
    with pytest.raises(
      zerojax.errors.RematError,
      match=r"has 7 along dimension 1.*divisible by 2",
    ):
      jax.jit(lambda x, w: jax.lax.scan(block, x, w)[0]).lower(
        jnp.ones((4, 7, 8)), jnp.ones((2, 8, 8))
      )
  manual = zerojax.remat(lambda x: x * 2, partition="data")
  with pytest.raises(zerojax.errors.RematError, match="manual axis"):
    jax.jit(
      jax.shard_map(
        manual,
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec("data"),
        out_specs=jax.sharding.PartitionSpec("data"),
        axis_names={"data"},
      )
    ).lower(jnp.ones((8, 4, 2)))
