"""Peak-memory properties of the compiled step (XLA's buffer assignment).

These compare ``compiled.memory_analysis()`` figures of programs compiled
side by side: deterministic properties of the program, not timings. On CPU
the temp figure misses some buffers inside loop bodies, so the tests only
compare stages and depths, never assert an absolute peak.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy

D, V, B = 128, 128, 64


def _compiled(
  layers,
  stage,
  gather="model",
  loss=toy.layered_loss,
  accum_steps=1,
  grad_norm=True,
):
  tx = zerojax.zero(optax.adamw(1e-3), stage=stage)
  state = zerojax.init(toy.layered_params(layers, D, V), tx)
  batch = {"x": np.zeros((B,), np.int32), "y": np.zeros((B,), np.int32)}
  step = zerojax.train_step(
    loss, tx, gather=gather, accum_steps=accum_steps, grad_norm=grad_norm
  )
  return step.lower(state, batch).compile()


def _memory(*args, **kwargs):
  return _compiled(*args, **kwargs).memory_analysis()


@pytest.mark.parametrize("stage,offload", [(1, False), (3, False), (3, True)])
def test_a_step_lowered_from_the_abstract_state_is_the_real_states(
  stage, offload, any_mesh
):
  """``jax.eval_shape`` of ``zerojax.init_from`` gives the state's shapes
  and shardings with nothing allocated; the step lowered from it compiles
  to the program the real state gives (the same memory and collectives):
  how a step's memory is read before anything is built. With offload the
  abstract leaves lose their host memory kind (``jax.eval_shape`` keeps the
  partition only): the step gives the master and optimizer state theirs
  back. On Auto axes ``jax.eval_shape`` drops the shardings (they are not
  in the types), and lowering from that state is refused, naming the
  leaf."""
  import jax

  tx = zerojax.zero(
    optax.adamw(1e-3), stage=stage, mesh=any_mesh, offload=offload
  )
  init = lambda k: toy.layered_params(4, D, V, key=k)
  abstract = jax.eval_shape(
    lambda k: zerojax.init_from(init, tx, k), jax.random.key(0)
  )
  assert not any(isinstance(x, jax.Array) for x in jax.tree.leaves(abstract))
  batch = {"x": np.zeros((B,), np.int32), "y": np.zeros((B,), np.int32)}
  step = zerojax.train_step(toy.layered_loss, tx)
  if any_mesh.axis_types[0] == jax.sharding.AxisType.Auto:
    with pytest.raises(ValueError, match=r"leaf state.*carries no sharding"):
      step.lower(abstract, batch)
    return
  real = zerojax.init_from(init, tx, jax.random.key(0))
  # an abstract batch too, with or without a sharding of its own: typed as
  # the step places a real one, so the lowered program is the same text
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
  elsewhere = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape,
      x.dtype,
      sharding=jax.sharding.NamedSharding(
        any_mesh, jax.sharding.PartitionSpec()
      ),
    ),
    batch,
  )
  want = step.lower(real, batch).as_text()
  for b in (shapes, elsewhere):
    assert step.lower(abstract, b).as_text() == want
  evaluate = zerojax.eval_step(toy.layered_loss, tx)
  assert (
    evaluate.lower(abstract, shapes).as_text()
    == evaluate.lower(real, batch).as_text()
  )
  a, r = (step.lower(s, batch).compile() for s in (abstract, real))
  for field in (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
  ):
    assert getattr(a.memory_analysis(), field) == getattr(
      r.memory_analysis(), field
    ), field
  assert zerojax.diagnostics.collectives(
    a.as_text(), 8
  ) == zerojax.diagnostics.collectives(r.as_text(), 8)


def test_stage2_peak_below_stage1_when_accumulating():
  layers = 8
  full_grad = layers * D * D * 4
  t1 = _memory(layers, 1, accum_steps=2).temp_size_in_bytes
  t2 = _memory(layers, 2, accum_steps=2).temp_size_in_bytes
  # stage 2 never holds the stacked full gradient: (1 - 1/N) of it is saved
  assert t1 - t2 > 0.75 * full_grad * (1 - 1 / 8), (t1, t2)


def test_stage1_with_one_micro_batch_holds_what_stage2_holds():
  """One micro-batch: stage 1 reduce-scatters inside the backward as stage
  2 does, whether the loss gathers its layers or is plain JAX (its scan
  gathered per layer by zerojax), so its step never holds the stacked full
  gradient; with the whole tree gathered (``gather="all"``) it keeps it:
  the stacked gradient is reduced once, after the backward loop. (Its
  temp bytes cannot show it: the update's all-gather of the new params
  needs a buffer of the stacked params' size in every one of these
  programs, and the full gradient fits in it.)"""
  layers = 8
  full_grad = layers * D * D * 4
  t1 = _memory(layers, 1).temp_size_in_bytes
  t2 = _memory(layers, 2).temp_size_in_bytes
  plain = _memory(layers, 1, loss=toy.plain_layered_loss).temp_size_in_bytes
  assert abs(t1 - t2) < 0.05 * full_grad, (t1, t2)
  assert abs(plain - t1) < 0.05 * full_grad, (plain, t1)
  whole = _compiled(layers, 1, gather="all", loss=toy.plain_layered_loss)
  assert toy.reduce_scatter_counts(whole, layers * D * D) == {1}
  assert (
    toy.reduce_scatter_counts(_compiled(layers, 1), layers * D * D) == set()
  )


def test_stage2_with_the_whole_tree_gathered_is_stage1():
  layers = 8
  t1 = _memory(
    layers, 1, gather="all", loss=toy.plain_layered_loss
  ).temp_size_in_bytes
  t2 = _memory(layers, 2, gather="all").temp_size_in_bytes
  assert abs(t1 - t2) < 0.1 * layers * D * D * 4, (t1, t2)


def test_stage3_memory_grows_by_shards_not_full_layers():
  small, big = _memory(4, 3), _memory(16, 3)
  layer = D * D * 4
  growth = big.temp_size_in_bytes - small.temp_size_in_bytes
  # 12 more layers: their gradient shards and saved activations, far less
  # than 12 gathered layers (which a non-remat model would keep).
  assert growth < 0.5 * 12 * layer, growth
  # the arguments (the sharded state) grow by exactly 1/N of 12 layers of
  # params + Adam moments (fp32, no master): 3 * 12 * (D*D + D) * 4 / 8
  assert big.argument_size_in_bytes - small.argument_size_in_bytes == (
    3 * 12 * (D * D + D) * 4 // 8
  )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_stages_take_less_argument_memory(stage):
  assert (
    _memory(8, stage).argument_size_in_bytes
    < _memory(8, 0).argument_size_in_bytes
  )


def _plain_dp_compiled(layers):
  """The loop stage 0 stands for: params and Adam state replicated, the
  batch split over the data axis, one jit (GSPMD reduces the gradient)."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  # Auto axes: GSPMD code, as such loops are written (the toy's embedding
  # lookup is not typed for Explicit axes)
  mesh = zerojax.make_mesh(axis_types=jax.sharding.AxisType.Auto)
  rep = NamedSharding(mesh, P())
  params = jax.device_put(toy.layered_params(layers, D, V), rep)
  opt = optax.adamw(1e-3)
  opt_state = jax.jit(opt.init, out_shardings=rep)(params)
  batch = jax.device_put(
    {"x": np.zeros((B,), np.int32), "y": np.zeros((B,), np.int32)},
    NamedSharding(mesh, P("data")),
  )

  @jax.jit
  def step(params, opt_state, batch):
    # zerojax.gather on plain arrays is the identity: the same loss
    loss, grads = jax.value_and_grad(toy.layered_loss)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
  return step.lower(params, opt_state, batch).compile()


def _plain_dp_memory(layers):
  return _plain_dp_compiled(layers).memory_analysis()


@pytest.mark.parametrize(
  "loss",
  [toy.layered_loss, toy.plain_layered_loss],
  ids=["gathers_per_layer", "plain_jax"],
)
def test_stage0_holds_no_more_than_plain_data_parallelism(loss):
  """Stage 0's compiled step against the plain loop it stands for, whether
  the loss calls zerojax.gather per layer or is plain JAX: argument + temp
  bytes per device may exceed the loop's by what zerojax adds by design --
  the step counter and the gradient-norm metric (a few scalars) and one
  layer's gradient in flight where the reduction order differs -- never by
  a second copy of the gradient (the unreduced stacked gradient beside its
  all-reduced copy, or a scaled copy after it)."""
  layers = 8
  z, p = _memory(layers, 0, loss=loss), _plain_dp_memory(layers)
  layer_grad = (D * D + D) * 4  # one block's gradient
  stacked_grad = layers * layer_grad
  excess = (z.argument_size_in_bytes + z.temp_size_in_bytes) - (
    p.argument_size_in_bytes + p.temp_size_in_bytes
  )
  assert excess <= layer_grad + 1024, (excess, layer_grad, stacked_grad)


def _head_through_a_custom_vjp(params, batch):
  """:func:`toy.plain_layered_loss` with its head through a hand-written
  ``jax.custom_vjp``."""
  x = params["embed"][batch["x"]]

  def body(h, layer):
    return jnp.tanh(h @ layer["w"] + layer["b"][None, :]), None

  h, _ = jax.lax.scan(jax.checkpoint(body), x, params["layers"])
  logits = toy.custom_vjp_linear(h, params["head"])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), batch["y"]
  ).mean()


@pytest.mark.parametrize(
  "loss, leaf_grad",
  [
    (_head_through_a_custom_vjp, D * V * 4),
    (toy.layered_loss_with_custom_vjp_bias, 8 * D * 4),
  ],
  ids=["head", "bias_in_scan"],
)
def test_stage0_reduces_only_a_custom_vjp_leaf_after_the_backward(
  loss, leaf_grad
):
  """A replicated leaf passed into a ``jax.custom_vjp`` (after the head, or
  per layer inside a checkpointed scan) is reduced after the backward: the
  rule is the user's. The other leaves keep their sums inside the
  backward, so stage 0 holds at most that leaf's gradient more than the
  plain loop -- not the whole stacked gradient, as summing every leaf
  after the backward does."""
  layers = 8
  z, p = _memory(layers, 0, loss=loss), _plain_dp_memory(layers)
  stacked_grad = layers * (D * D + D) * 4
  excess = (z.argument_size_in_bytes + z.temp_size_in_bytes) - (
    p.argument_size_in_bytes + p.temp_size_in_bytes
  )
  assert leaf_grad + 1024 < stacked_grad / 2
  assert excess <= leaf_grad + 1024, (excess, leaf_grad, stacked_grad)


def _bytes_accessed(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["bytes accessed"])


@pytest.mark.parametrize(
  "loss",
  [toy.layered_loss, toy.plain_layered_loss],
  ids=["gathers_per_layer", "plain_jax"],
)
def test_stage0_moves_no_more_bytes_than_plain_data_parallelism_but_a_norm_slice(
  loss,
):
  """The bytes XLA counts the compiled step reading and writing per device,
  stage 0 against the plain loop: what zerojax adds is the gradient-norm
  metric. The gradient is replicated there, so each device sums only its
  1/N slice of it: read, and where the backend does not fuse the slice into
  the reduction, written and read again -- 3 x 4 bytes x Ψ/N, 1.5 bytes x Ψ
  at N = 8 (XLA CPU may add a transposed copy of a slice). Summing the whole
  gradient on every device reads 4 bytes x Ψ: the bound is half of that."""
  import jax

  layers = 8
  n = jax.device_count()
  assert n >= 8, n  # tests/conftest.py
  psi = sum(
    np.size(x) for x in jax.tree.leaves(toy.layered_params(layers, D, V))
  )
  excess = _bytes_accessed(_compiled(layers, 0, loss=loss)) - _bytes_accessed(
    _plain_dp_compiled(layers)
  )
  assert 3 * 4 * psi / n < 4 * psi / 2
  assert excess <= 4 * psi / 2, (excess, psi, n)


@pytest.mark.parametrize(
  "loss",
  [toy.layered_loss, toy.plain_layered_loss],
  ids=["gathers_per_layer", "plain_jax"],
)
def test_stage0_without_the_norm_moves_no_array_more_than_plain_data_parallelism(
  loss,
):
  """Built with ``grad_norm=False``, the stage-0 step does the plain loop's
  work: XLA's count of the bytes it reads and writes per device exceeds the
  loop's by less than one read of the smallest leaf (scalars at most), and
  its argument + temp bytes by less than that too."""
  import jax

  layers = 8
  smallest = 4 * min(
    np.size(x) for x in jax.tree.leaves(toy.layered_params(layers, D, V))
  )
  compiled = _compiled(layers, 0, loss=loss, grad_norm=False)
  plain = _plain_dp_compiled(layers)
  excess = _bytes_accessed(compiled) - _bytes_accessed(plain)
  assert excess < smallest, (excess, smallest)
  m, pm = compiled.memory_analysis(), plain.memory_analysis()
  held = (m.argument_size_in_bytes + m.temp_size_in_bytes) - (
    pm.argument_size_in_bytes + pm.temp_size_in_bytes
  )
  assert held < smallest, (held, smallest)
