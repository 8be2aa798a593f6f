"""Gradients in host memory (``zero(..., offload_grads=True)``).

Each leaf's reduced gradient shard goes to host memory in the backward
pass, and the streamed update brings each chunk's gradients down beside
its state. The numbers must be the same bits as with the gradients on the
device; the gradients must really be in host memory (as ``value_and_grad``
returns them, and in the compiled step's memory spaces); an update that
reads every gradient other than through small values made from the
gradients alone is refused with the fix. Micro-batches are summed in host
memory, to the same bits.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy

BF16 = zerojax.Policy(param_dtype=jnp.bfloat16)

# updates that read each leaf's gradient for that leaf only, and one that
# reads a global norm of them all
OPTIMIZERS = {
  "adamw": lambda: optax.adamw(1e-2),
  "clip+adamw": lambda: optax.chain(optax.clip(0.05), optax.adamw(1e-2)),
  "global_clip+adamw": lambda: optax.chain(
    optax.clip_by_global_norm(0.05), optax.adamw(1e-2)
  ),
  "lamb": lambda: optax.lamb(1e-2),
  # a branch over the whole state, on a shared counter
  "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}


def _leaves(state):
  return [
    np.asarray(x)
    for x in jax.tree.leaves((state.params, state.master, state.opt_state))
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  ]


def _leaves_per_step(tx, params, loss_fn, batches):
  """The state's leaves after each of ``batches``, the step, and the
  last state."""
  state = zerojax.init(params, tx)
  step = zerojax.train_step(loss_fn, tx)
  seen = []
  for b in batches:
    state, _ = step(state, b)
    seen.append(_leaves(state))
  return seen, step, state


def _train(opt, stage, grads, policy=BF16, steps=3, **kw):
  tx = zerojax.zero(
    opt(), stage=stage, offload=True, offload_grads=grads, policy=policy, **kw
  )
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  step = zerojax.train_step(toy.loss_fn, tx)
  for b in toy.batches(steps):
    state, metrics = step(state, b)
  return _leaves(state), metrics


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_gradients_train_bitwise_equal(stage, name):
  """AdamW, per-leaf or global-norm clipping + AdamW, LAMB, MultiSteps,
  Adafactor at stages 2-3: the same state and loss bits as with the
  gradients on the device; the grad norm, summed as the gradients are
  loaded, to rounding."""
  want, m_want = _train(OPTIMIZERS[name], stage, False)
  got, m_got = _train(OPTIMIZERS[name], stage, True)
  chex.assert_trees_all_equal(got, want)
  _same_metrics(m_got, m_want)


def _same_metrics(got, want):
  assert np.asarray(got["loss"]) == np.asarray(want["loss"])
  np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-6)


@pytest.mark.parametrize("clip", [None, "global"])
def test_the_scanned_gpt_trains_bitwise_equal_with_its_stacks_by_rows(
  mesh, clip
):
  """The reference GPT's layer stacks are updated a few layers per chunk;
  each chunk loads those rows of the stack's offloaded gradient. Clipped
  by the global norm, the norm is computed first, from each gradient
  loaded whole in turn."""
  from zerojax.app import data, gpt

  model = gpt.GPTConfig(width=32, depth=4, heads=2, seq_len=32)
  tokens, _ = data.split(data.corpus_bytes())
  loss_fn = functools.partial(gpt.loss, config=model)
  out = []
  for grads in (False, True):
    opt = optax.adamw(3e-3)
    if clip:
      opt = optax.chain(optax.clip_by_global_norm(0.1), opt)
    tx = zerojax.zero(
      opt,
      stage=3,
      mesh=mesh,
      policy=BF16,
      offload=True,
      offload_params=True,
      offload_grads=grads,
      stacked=gpt.is_layer_stack,
    )
    state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
    step = zerojax.train_step(loss_fn, tx)
    for i in range(2):
      batch = data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=32)
      state, m = step(state, batch)
    out.append((_leaves(state), m))
  offload = zerojax.report(step, state, batch).offload
  assert offload["grads_on_host"] and offload["stacks_by_rows"] >= 2, offload
  chex.assert_trees_all_equal(out[1][0], out[0][0])
  _same_metrics(out[1][1], out[0][1])


def test_value_and_grad_returns_the_gradients_in_host_memory():
  """The gradients come out of the gradient half in host memory, as
  shards; ``apply_gradients`` takes them as they are."""
  kw = dict(stage=3, offload=True, policy=BF16)
  out = []
  for grads in (False, True):
    tx = zerojax.zero(optax.adamw(1e-2), offload_grads=grads, **kw)
    state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
    _, g = zerojax.value_and_grad(toy.loss_fn, tx)(state, toy.batches(1)[0])
    g_arrays = [x for x in jax.tree.leaves(g) if isinstance(x, jax.Array)]
    kinds = {x.sharding.memory_kind for x in g_arrays}
    state = zerojax.apply_gradients(state, g)
    grads = [np.asarray(x) for x in g_arrays]
    out.append((_leaves(state), grads, kinds))
  chex.assert_trees_all_equal(out[1][:2], out[0][:2])
  assert out[0][2] == {"device"}
  assert "pinned_host" in out[1][2]


def _skipped_at_step_2(params, batch):
  """The toy loss, whose gradients are all NaN at the batch marked so (its
  scalar ``w``, shared by every example)."""
  return toy.loss_fn(params, batch) * batch["w"]


@pytest.mark.parametrize(
  "stage, grads, inner",
  [
    (1, False, "adamw"),
    (2, True, "adamw"),
    (3, False, "adamw"),
    (3, True, "adamw"),
    (2, True, "global_clip+adamw"),
    (3, True, "global_clip+adamw"),
  ],
)
def test_apply_if_finite_streams_and_skips_the_nonfinite_step(
  mesh, stage, grads, inner
):
  """``apply_if_finite`` decides every leaf's update in one branch over
  the whole state on whether all gradients are finite. Offloaded, each
  chunk runs that branch cut to its own leaves (the finiteness, from every
  gradient, is computed first with the gradients on the host, and so is
  a global norm the branch clips by): the same state as without offload,
  to a rounding per step, through a step whose gradients are NaN (skipped
  to the bit, counted), and streamed in chunks, the layer stack by rows,
  not whole. Not bitwise: XLA simplifies a branch kept to one leaf's
  outputs apart from the whole one (it divides Adam's moments by the bias
  correction there, or multiplies by its reciprocal)."""
  data = toy.batches(4)
  for t, b in enumerate(data):
    b["w"] = np.float32(np.nan if t == 2 else 1.0)
  out = []
  for off in (False, True):
    tx = zerojax.zero(
      optax.apply_if_finite(OPTIMIZERS[inner](), 3),
      stage=stage,
      mesh=mesh,
      policy=BF16,
      offload=off,
      offload_grads=grads and off,
    )
    seen, step, state = _leaves_per_step(
      tx, toy.init_params(jax.random.key(0)), _skipped_at_step_2, data
    )
    out.append(seen)
  toy.assert_same_up_to_summation_order(out[1], out[0], terms=len(data))
  # the NaN step changed nothing but the count of non-finite steps
  chex.assert_trees_all_equal(
    [x for x in out[1][2] if x.shape], [x for x in out[1][1] if x.shape]
  )
  assert int(state.opt_state.notfinite_count) == 0
  assert int(state.opt_state.total_notfinite) == 1
  off = zerojax.report(step, state, data[0]).offload
  assert off["streamed"] and off["chunks"] > 1 and off["reason"] is None
  assert off["stacks_by_rows"] == 1  # the toy's stack, a few rows a chunk
  assert off["grads_on_host"] == grads
  assert off["norm_first"] == grads


@pytest.mark.parametrize("made_from", ["weights", "state"])
def test_a_norm_made_from_the_weights_too_is_refused_with_the_fix(made_from):
  """Weight decay before the global-norm clip: the norm every leaf reads
  is made from every leaf's weights too, which the pass that computes it
  from the offloaded gradients does not bring down; so is a clip of the
  gradients ``MultiSteps`` accumulates in its state (in a branch).
  Refused while tracing, naming the value and the per-leaf clips; the
  state is kept."""
  clip = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1e-2))
  tx = zerojax.zero(
    optax.chain(optax.add_decayed_weights(1e-2), clip)
    if made_from == "weights"
    else optax.MultiSteps(clip, 2),
    stage=3,
    offload=True,
    offload_grads=True,
  )
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  before = _leaves(state)
  step = zerojax.train_step(toy.loss_fn, tx)
  with pytest.raises(ValueError, match=r"offload_grads=True, but") as e:
    step(state, toy.batches(1)[0])
  assert "is made from the weights or state too" in str(e.value)
  assert "optax.clip_by_block_rms" in str(e.value)
  chex.assert_trees_all_equal(_leaves(state), before)


# the toy's layer stacks; its other matrices then send their gradients to
# the host too (a leaf that may be a stack of vectors keeps its there)
_LAYERS = lambda path, shape: "layers" in path


def _with_aux(params, batch):
  """The toy loss, with a per-example aux leaf and a mean."""
  loss = toy.loss_fn(params, batch)
  rows = jnp.sqrt(batch["x"].astype(jnp.float32))  # per example
  return loss, {"rows": rows, "mean": loss}


@pytest.mark.parametrize(
  "stage, accum, policy, clip",
  [
    # one case of each kind in the default suite, the rest in the slow one
    pytest.param(2, 2, None, False, marks=pytest.mark.slow),
    (3, 2, None, False),
    pytest.param(3, 3, None, False, marks=pytest.mark.slow),
    pytest.param(2, 4, None, False, marks=pytest.mark.slow),
    (2, 3, None, True),
    (2, 2, "bf16", False),
    pytest.param(3, 3, "bf16", False, marks=pytest.mark.slow),
    (3, 4, "bf16", True),
  ],
)
def test_micro_batches_summed_in_host_memory_give_the_same_bits(
  stage, accum, policy, clip
):
  """With accumulation each micro-batch adds its reduced gradient to the
  sum in host memory as the backward pass makes it, and the update scales
  the sums as it loads them: the state, loss and per-example aux have the
  bits of the sums on the device, in fp32 and in bf16, behind a global
  norm too (whose pass loads them first); so do the gradients
  ``value_and_grad`` returns, the summed ones in host memory."""
  out = []
  opt = optax.adamw(1e-2)
  if clip:
    opt = optax.chain(optax.clip_by_global_norm(0.05), opt)
  for grads in (False, True):
    tx = zerojax.zero(
      opt,
      stage=stage,
      offload=True,
      offload_grads=grads,
      policy=BF16 if policy else None,
      stacked=_LAYERS,
    )
    state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
    step = zerojax.train_step(_with_aux, tx, accum_steps=accum)
    for b in toy.batches(2, size=16 * accum):
      state, m = step(state, b)
    _, g = zerojax.value_and_grad(
      _with_aux, tx, has_aux=True, accum_steps=accum
    )(state, b)
    g = [x for x in jax.tree.leaves(g) if isinstance(x, jax.Array)]
    out.append((_leaves(state), m, g))
  (want, m_want, g_want), (got, m_got, g_got) = out
  on_host = [x.sharding.memory_kind == "pinned_host" for x in g_got]
  assert sum(on_host) >= 3, on_host
  chex.assert_trees_all_equal(
    [np.asarray(x) for x in g_got], [np.asarray(x) for x in g_want]
  )
  chex.assert_trees_all_equal(got, want)
  chex.assert_trees_all_equal(m_got["aux"], m_want["aux"])
  _same_metrics(m_got, m_want)


def _tied(params, batch):
  """The toy loss with its head tied to the embedding: gathered twice."""
  g = zerojax.gather
  emb = g(params["embed"])
  h = emb[batch["x"]]
  logits = h @ g(params["embed"])[: toy.CLASSES].T
  return (
    optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    + 0.0 * jnp.sum(g(params["head"]))
    + 0.0 * g(params["scale"])
  )


def _shared_in_the_scan(params, batch):
  """A head gathered inside the layer loop from outside it: one traced
  gather, one call per layer."""
  g = zerojax.gather
  x = g(params["embed"])[batch["x"]]

  def body(h, layer):
    layer = g(layer)
    h = jnp.tanh(h @ layer["w"] + layer["b"][None, :])
    return h, jnp.mean(h @ g(params["head"]))

  h, extra = jax.lax.scan(body, x, params["layers"])
  logits = h @ g(params["head"]) * g(params["scale"])
  return (
    optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    + 1e-3 * extra.sum()
  )


@pytest.mark.parametrize(
  "loss_fn, leaf, how",
  [
    (_tied, "['embed']", "2 times"),
    (_shared_in_the_scan, "['head']", "in a scan's constants"),
  ],
)
def test_summing_in_host_memory_refuses_a_weight_gathered_more_than_once(
  loss_fn, leaf, how
):
  """The sum so far would be added once per call: refused before the step
  runs, naming the leaf and how it is gathered, and the state is kept.
  With the gradients on the device the same losses train."""
  kw = dict(stage=3, offload=True, policy=BF16, stacked=_LAYERS)
  tx = zerojax.zero(optax.adamw(1e-2), offload_grads=True, **kw)
  state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
  before = _leaves(state)
  step = zerojax.train_step(loss_fn, tx, accum_steps=2, gather="model")
  with pytest.raises(ValueError) as e:
    step(state, toy.batches(1)[0])
  msg = str(e.value)
  assert f"params{leaf} is gathered {how}" in msg, msg
  assert "accum_steps=1" in msg and "offload_grads=False" in msg
  chex.assert_trees_all_equal(_leaves(state), before)
  ok = zerojax.zero(optax.adamw(1e-2), **kw)
  state = zerojax.init(toy.init_params(jax.random.key(0)), ok)
  zerojax.train_step(loss_fn, ok, accum_steps=2, gather="model")(
    state, toy.batches(1)[0]
  )


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(stage=1, offload=True), "needs stage 2 or 3"),
    (dict(stage=3), "needs offload=True"),
    (dict(stage=3, offload=0.5), "needs offload=True"),
    (
      dict(stage=3, offload=True, zeropp=zerojax.ZeroPP(weight_bits=8)),
      "zeropp=",
    ),
  ],
)
def test_offload_grads_is_validated(kw, match):
  with pytest.raises(ValueError, match=match):
    zerojax.zero(optax.adam(1e-3), offload_grads=True, **kw)
  with pytest.raises(TypeError, match="offload_grads='yes'"):
    zerojax.zero(optax.adam(1e-3), stage=3, offload=True, offload_grads="yes")


def test_the_planner_counts_the_gradients_on_the_host():
  """The planner moves the gradient shards from the device's bytes to the
  host's, writes them once and reads them once (the update); the report's
  theory is the planner's."""
  params = toy.init_params(jax.random.key(0))
  shapes = jax.eval_shape(lambda: params)
  plans = [
    zerojax.cost.plan_stage(
      shapes, 3, 8, offload=True, offload_grads=g, policy=BF16
    )
    for g in (False, True)
  ]
  base, off = plans
  assert 0 < off.grads_host <= off.grads == base.grads
  assert off.host == base.host + off.grads_host
  assert off.device_to_host == base.device_to_host + off.grads_host
  assert off.host_to_device == base.host_to_device + off.grads_host
  assert off.device < base.device
  o = _report_offload(params, optax.adamw(1e-2), off)
  assert o["grads_on_host"] and o["streamed"]


def test_the_planner_counts_the_sums_read_and_written_per_micro_batch():
  """Summed over 3 micro-batches in host memory, the gradients are
  written 3 times and read twice more than with one; the report's theory
  for that step is the planner's."""
  params = toy.init_params(jax.random.key(0))
  shapes = jax.eval_shape(lambda: params)
  kw = dict(offload=True, offload_grads=True, policy=BF16, stacked=_LAYERS)
  one, three = (
    zerojax.cost.plan_stage(shapes, 3, 8, accum_steps=k, **kw) for k in (1, 3)
  )
  assert one.grads_host > 0
  assert three.device_to_host == one.device_to_host + 2 * one.grads_host
  assert three.host_to_device == one.host_to_device + 2 * one.grads_host
  assert three.device == one.device
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, **kw)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(toy.loss_fn, tx, accum_steps=3)
  o = zerojax.report(step, state, toy.batches(1, size=48)[0]).offload
  assert o["theory_host_to_device_bytes"] == three.host_to_device
  assert o["theory_device_to_host_bytes"] == three.device_to_host


def _report_offload(params, opt, planned):
  """``zerojax.report(...).offload`` of the stage-3 step with the state
  and gradients on the host, its theory checked against ``planned``."""
  tx = zerojax.zero(opt, stage=3, offload=True, offload_grads=True, policy=BF16)
  state = zerojax.init(params, tx)
  o = zerojax.report(
    zerojax.train_step(toy.loss_fn, tx), state, toy.batches(1)[0]
  ).offload
  assert o["theory_host_to_device_bytes"] == planned.host_to_device
  assert o["theory_device_to_host_bytes"] == planned.device_to_host
  return o


@pytest.mark.parametrize("gather", ["all", "model"])
def test_the_gather_modes_and_jax_set_mesh_give_the_same_bits(gather):
  """The whole tree gathered first (``gather="all"``) or per layer, on
  the mesh set with ``jax.set_mesh``: the same bits as with the
  gradients on the device."""
  out = []
  mesh = zerojax.make_mesh()
  for grads in (False, True):
    with jax.set_mesh(mesh):
      tx = zerojax.zero(
        optax.adamw(1e-2), stage=3, offload=True, offload_grads=grads
      )
      state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
      step = zerojax.train_step(toy.loss_fn, tx, gather=gather)
      for b in toy.batches(2):
        state, m = step(state, b)
    out.append((_leaves(state), m))
  chex.assert_trees_all_equal(out[1][0], out[0][0])
  _same_metrics(out[1][1], out[0][1])


def test_a_global_norm_brings_each_gradient_down_twice_one_at_a_time():
  """``clip_by_global_norm`` with the gradients in host memory: the norm is
  computed first, from each gradient loaded whole in turn, then each
  chunk loads its own again. The planner and the report's theory count
  the gradients twice host to device, once back, and the norm pass's
  device bytes (the largest gradient)."""
  params = toy.init_params(jax.random.key(0))
  shapes = jax.eval_shape(lambda: params)
  clip = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))
  kw = dict(offload=True, offload_grads=True, policy=BF16)
  plain, norm = (
    zerojax.cost.plan_stage(shapes, 3, 8, optimizer=o, **kw)
    for o in (optax.adamw(1e-2), clip)
  )
  assert not plain.norm_first and norm.norm_first
  assert norm.host_to_device == plain.host_to_device + norm.grads_host
  assert norm.device_to_host == plain.device_to_host
  sizes = [x.size for x in jax.tree.leaves(params) if x.dtype == jnp.float32]
  largest, trained = max(sizes), sum(sizes)
  assert 0 < norm.norm_first_peak_fraction <= largest / trained + 1e-9
  o = _report_offload(params, clip, norm)
  assert o["norm_first"] and o["streamed"]


def test_a_large_value_made_from_every_gradient_is_refused():
  """An update that adds every leaf's gradient into one matrix which each
  leaf then reads has no small value to compute first: refused, naming
  its shape, before anything runs; the state is kept."""

  def mean_of_all():
    def update(g, state, params=None):
      total = sum(jax.tree.leaves(g))
      return jax.tree.map(lambda x: x - total / 2, g), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

  params = {"a": jnp.ones((300, 300)), "b": jnp.full((300, 300), 0.5)}
  loss = lambda p, b: jnp.mean(  # a mean over examples (equal rows)
    jnp.sum((p["a"][None] * b) ** 2 + p["b"][None] * b, axis=(1, 2))
  )
  tx = zerojax.zero(
    optax.chain(mean_of_all(), optax.sgd(1e-3)),
    stage=2,
    offload=True,
    offload_grads=True,
  )
  state = zerojax.init(params, tx)
  before = _leaves(state)
  step = zerojax.train_step(loss, tx)
  with pytest.raises(ValueError, match=r"has shape \(300, 300\)"):
    step(state, jnp.ones((8, 300, 300)))
  chex.assert_trees_all_equal(_leaves(state), before)


def test_a_finiteness_of_clipped_gradients_streams_in_two_passes():
  """``chain(clip_by_global_norm, apply_if_finite(...))`` checks the
  clipped gradients, each made from its gradient and the norm of all of
  them: the norm is computed in a pass over the gradients, then the
  finiteness of each clipped gradient in a second, so each gradient
  comes down three times (the passes' and its chunk's), which the
  planner and the report count. The state is the one without offload,
  to a rounding per step, through a step whose gradients are NaN
  (skipped)."""
  params = {"a": jnp.ones((300, 300)), "b": jnp.full((300, 300), 0.5)}
  loss = lambda p, b: jnp.mean(  # a mean over examples (equal rows)
    jnp.sum((p["a"][None] * b) ** 2 + p["b"][None] * b, axis=(1, 2))
  )
  batches = [jnp.full((8, 300, 300), x) for x in (1.0, np.nan, 0.5)]
  opt = lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.apply_if_finite(optax.adam(1e-3), 3)
  )
  out = []
  for off in (False, True):
    tx = zerojax.zero(
      opt(), stage=2, offload=off, offload_grads=off, stacked=False
    )
    seen, step, state = _leaves_per_step(tx, params, loss, batches)
    out.append(seen)
  toy.assert_same_up_to_summation_order(out[1], out[0], terms=8)
  chex.assert_trees_all_equal(
    [x for x in out[1][1] if x.shape], [x for x in out[1][0] if x.shape]
  )
  assert not np.array_equal(out[1][0][0], np.asarray(params["a"]))
  o = zerojax.report(step, state, batches[0]).offload
  assert o["streamed"] and o["grads_on_host"] and o["norm_passes"] == 2
  shapes = jax.eval_shape(lambda: params)
  plans = [
    zerojax.cost.plan_stage(
      shapes,
      2,
      8,
      optimizer=x,
      policy=zerojax.Policy(),  # fp32, as trained above
      offload=True,
      offload_grads=True,
      stacked=False,
    )
    for x in (optax.adam(1e-3), opt())
  ]
  assert plans[1].norm_passes == 2 and plans[1].grads_host > 0
  # the branch's state (two int32 counters and a bool) rides along
  assert plans[1].host_to_device - plans[0].host_to_device - 9 == (
    2 * plans[1].grads_host
  )
  assert o["theory_host_to_device_bytes"] == plans[1].host_to_device
