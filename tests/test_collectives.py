"""Which collectives XLA compiled per stage, and how many bytes per step."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy

L, D, V, B = 4, 32, 64, 64


def wide_params():
  return toy.layered_params(L, D, V)


wide_loss = toy.layered_loss


PSI_SCAN = L * (D * D + D)
PSI_TOP = 2 * V * D
PSI = PSI_SCAN + PSI_TOP
BATCH = {"x": np.zeros((B,), np.int32), "y": np.zeros((B,), np.int32)}


def compiled(
  stage,
  policy=None,
  accum_steps=1,
  params=None,
  loss=wide_loss,
  batch=BATCH,
  gather="model",
):
  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, policy=policy)
  state = zerojax.init(wide_params() if params is None else params, tx)
  lowered = zerojax.train_step(
    loss, tx, gather=gather, accum_steps=accum_steps
  ).lower(state, batch)
  return lowered, zerojax.diagnostics.collectives(
    lowered.compile().as_text(), 8
  )


def elements(colls, kind):
  return sum(c.total_elements for c in colls if c.kind == kind)


def kinds(colls, big=64):
  """Kinds of the parameter-sized collectives (more than ``big`` elements)."""
  return {c.kind for c in colls if c.elements > big}


def test_stage0_all_reduce_once():
  _, colls = compiled(0)
  assert kinds(colls) == {"all-reduce"}
  assert PSI <= elements(colls, "all-reduce") <= PSI * 1.01


@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_reduce_scatter_and_all_gather(stage):
  _, colls = compiled(stage)
  assert kinds(colls) == {"reduce-scatter", "all-gather"}
  assert elements(colls, "reduce-scatter") == PSI
  assert elements(colls, "all-gather") == PSI
  # nothing parameter-sized is all-reduced
  assert elements(colls, "all-reduce") <= 8  # a few scalars: loss, norms


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_scatters_inside_the_backward_loop(stage):
  """Stage 2, and stage 1 with one micro-batch: each layer's gradient is
  reduce-scattered where the backward loop makes it."""
  _, colls = compiled(stage)
  in_loop = [c for c in colls if c.kind == "reduce-scatter" and c.count == L]
  assert sum(c.total_elements for c in in_loop) == PSI_SCAN


def test_stage1_accumulating_reduces_the_stacked_gradient_after_the_loop():
  """With micro-batches stage 1 keeps the full local gradient and
  reduce-scatters it once per step, after the backward loop."""
  _, colls = compiled(1, accum_steps=2)
  assert all(c.count == 1 for c in colls if c.kind == "reduce-scatter")
  assert elements(colls, "reduce-scatter") == PSI


def test_stage3_gathers_per_layer_in_forward_and_backward():
  _, colls = compiled(3)
  assert kinds(colls) == {"reduce-scatter", "all-gather"}
  assert elements(colls, "reduce-scatter") == PSI
  # Layer weights: gathered in the forward loop and again in the
  # (rematerialised) backward loop. Embedding and head, used outside any
  # loop, are gathered once: XLA merges the recomputed gather into the
  # forward one and keeps the buffer until its backward.
  loop_gathers = [c for c in colls if c.kind == "all-gather" and c.count == L]
  assert sum(c.total_elements for c in loop_gathers) == 2 * PSI_SCAN
  assert elements(colls, "all-gather") == 2 * PSI_SCAN + PSI_TOP
  assert elements(colls, "all-reduce") <= 8  # a few scalars: loss, norms


@pytest.mark.parametrize("stage", [1, 2])
def test_a_layers_gradient_is_reduced_in_one_collective(stage):
  """Stages 1-2, one ``gather`` call on a layer (kernel and bias): the
  backward loop reduce-scatters the layer's gradient in one collective of
  both leaves, not one per leaf."""
  _, colls = compiled(stage)
  in_loop = [c for c in colls if c.count == L and c.kind == "reduce-scatter"]
  assert [c.elements for c in in_loop] == [D * D + D]


def test_a_layers_leaves_move_one_by_one_under_zeropp():
  """Quantized collectives keep one leaf each (their blocks are per leaf):
  the layer's kernel and bias are two all-to-alls (qgZ), not one."""
  tx = zerojax.zero(
    optax.adamw(1e-3), stage=2, zeropp=zerojax.ZeroPP(grad_bits=8)
  )
  state = zerojax.init(wide_params(), tx)
  colls = zerojax.diagnostics.collectives(
    zerojax.train_step(wide_loss, tx, gather="model")
    .lower(state, BATCH)
    .compile()
    .as_text(),
    8,
  )
  assert (
    len(
      [
        c
        for c in colls
        if c.kind == "all-to-all" and c.count == L and c.dtype == "s8"
      ]
    )
    == 2
  )


def test_collectives_run_in_the_policy_dtypes():
  policy = zerojax.Policy(param_dtype=jnp.bfloat16)  # reduce in bf16 too
  lowered, colls = compiled(3, policy=policy)
  text = lowered.as_text()
  gathers = re.findall(r"stablehlo\.all_gather.*-> tensor<[\dx]*x(\w+)>", text)
  scatters = re.findall(
    r"stablehlo\.reduce_scatter.*\n(?:.*\n)*?.*\}\) : "
    r"\(tensor<[\dx]*x(\w+)>",
    text,
  )
  assert gathers and set(gathers) == {"bf16"}
  assert scatters and set(scatters) == {"bf16"}
  # Element counts do not depend on the dtype.
  assert elements(colls, "reduce-scatter") == PSI
  policy32 = zerojax.Policy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  lowered, _ = compiled(1, policy=policy32)
  text = lowered.as_text()
  assert set(
    re.findall(r"stablehlo\.all_gather.*-> tensor<[\dx]*x(\w+)>", text)
  ) == {"bf16"}


@pytest.mark.parametrize("stage,rs,ag", [(1, 1, 1), (2, 4, 1), (3, 4, None)])
def test_accumulation_reduces_per_stage(stage, rs, ag):
  """k=4 micro-batches: stage 1 reduce-scatters once, stages 2-3 per micro-batch."""
  _, colls = compiled(stage, accum_steps=4)
  assert elements(colls, "reduce-scatter") == rs * PSI
  if ag is not None:
    assert elements(colls, "all-gather") == ag * PSI


def test_uneven_leaves_count_their_padding(mesh):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.adamw(1e-3), stage=1, mesh=mesh)
  spec = zerojax.init(params, tx).spec
  padded = sum(
    math.prod(r.shard.storage_shape)
    for r in spec.leaves
    if r.trainable and r.shard.sharded
  )
  logical = sum(r.size for r in spec.leaves if r.trainable)
  _, colls = compiled(
    1, params=params, loss=toy.loss_fn, batch=toy.batches(1)[0]
  )
  assert elements(colls, "reduce-scatter") == padded
  assert elements(colls, "all-gather") == padded
  assert padded > logical  # the toy's leaves really are padded
  # the replicated scalar's gradient is all-reduced with the loss and norms
  assert elements(colls, "all-reduce") <= 8  # a few scalars: loss, norms


# --------------------------------------------------------------------------
# stage 0: each weight gradient summed before autodiff's transpose
# --------------------------------------------------------------------------
F = 48  # a non-square weight: its transpose has another shape


def plain_params():
  k = jax.random.split(jax.random.key(1), 2)
  return {
    "w": jax.random.normal(k[0], (L, D, F)) * 0.2,
    "embed": jax.random.normal(k[1], (V, D)) * 0.2,
  }


def plain_loss(params, batch):
  """A loss written for plain data parallelism: ``h @ W`` in a
  checkpointed scan, no ``zerojax.gather``."""

  def body(h, w):
    return h + jnp.tanh(h @ w)[:, :D], None

  h = params["embed"][batch["x"]]
  h, _ = jax.lax.scan(jax.checkpoint(body), h, params["w"])
  logits = h @ params["embed"].T
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["y"]
  ).mean()


def all_reduced_shapes(hlo: str) -> set:
  return {
    tuple(int(d) for d in dims.split(",") if d)
    for line in hlo.splitlines()
    if " all-reduce(" in line
    for dims in re.findall(r"f32\[([\d,]*)\]", line.split(" all-reduce(")[0])
  }
