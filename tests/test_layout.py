"""Which arrays are sharded how, and what each device really holds."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import toy


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_every_leaf_is_where_the_stage_puts_it(mesh, stage, policy):
  pol = (
    zerojax.Policy(param_dtype=jnp.bfloat16)
    if policy == "bf16"
    else zerojax.Policy()
  )
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, mesh=mesh, policy=pol)
  state = zerojax.init(params, tx)
  assert (state.master is not None) == (policy == "bf16")
  rows = zerojax.diagnostics.layout_rows(state)
  for row in rows:
    x_sharded = row["sharded"]
    big = len(row["shape"]) > 0 and row["dtype"] != "int32"
    should_shard = big and (
      (row["section"] == "params" and stage == 3)
      or (row["section"] in ("master", "opt_state") and stage >= 1)
    )
    assert x_sharded == should_shard, row
    elems = math.prod(row["shape"])
    itemsize = np.dtype(row["dtype"]).itemsize
    if x_sharded:
      # ceil(n / N) along the sharded dimension: the padding, no more
      shard = list(row["shape"])
      shard[row["dim"]] = -(-shard[row["dim"]] // 8)
      assert row["bytes_per_device"] == math.prod(shard) * itemsize, row
    else:
      assert row["bytes_per_device"] == elems * itemsize, row


def test_state_arrays_carry_the_named_sharding(mesh):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.adam(1e-3), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  w = state.params["layers"]["w"]
  assert w.shape == (3, 8, 7)  # 7 padded to 8; dim 1 (major) on a tie
  assert _split_as(w, mesh, None, "data")
  assert len({s.data.shape for s in w.addressable_shards}) == 1
  assert w.addressable_shards[0].data.shape == (3, 1, 7)
  mu = state.opt_state[0].mu["embed"]
  assert _split_as(mu, mesh, None, "data")
  assert _split_as(state.step, mesh)


def _split_as(x, mesh, *spec):
  """``x`` is split as ``P(*spec)`` says (however the spec is spelled: on
  an Explicit mesh JAX writes every dimension, ``P(None, "data", None)``)."""
  return x.sharding.is_equivalent_to(
    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)), x.ndim
  )


def test_min_shard_size_keeps_small_leaves_replicated(mesh):
  params = {"big": jnp.ones((64, 64)), "small": jnp.ones((8,))}
  tx = zerojax.zero(optax.adam(1e-3), stage=3, mesh=mesh, min_shard_size=100)
  state = zerojax.init(params, tx)
  assert _split_as(state.params["big"], mesh, None, "data")
  assert _split_as(state.params["small"], mesh)
  table = zerojax.diagnostics.layout_table(state)
  assert "8 < min_shard_size=100" in table


def test_measured_bytes_match_the_zero_formulas(mesh):
  """Divisible shapes, bf16 + fp32 master + Adam: measured == theory."""
  params = {"w": jnp.ones((64, 128)), "v": jnp.ones((4, 32, 64))}
  psi = 64 * 128 + 4 * 32 * 64
  n = 8
  want_total = {
    0: 2 * psi + 12 * psi,
    1: 2 * psi + 12 * psi / n,
    2: 2 * psi + 12 * psi / n,
    3: 16 * psi / n - 2 * psi / n,
  }
  for stage in range(4):
    tx = zerojax.zero(
      optax.adam(1e-3),
      stage=stage,
      mesh=mesh,
      policy=zerojax.Policy(param_dtype=jnp.bfloat16),
    )
    state = zerojax.init(params, tx)
    measured = zerojax.diagnostics.state_bytes(state)
    theory = zerojax.diagnostics.theory_bytes(state)
    for cat in ("params", "master", "opt_state.mu", "opt_state.nu"):
      assert measured[cat] == theory[cat], (stage, cat)
    # persistent state (no gradients): ZeRO's formula without the 2 psi
    # (or 2 psi / N) of gradients; count is one int32 scalar.
    total = sum(v for k, v in measured.items() if k != "opt_state.count")
    assert total == want_total[stage], stage


def test_layout_table_lists_params_and_each_optimizer_field(mesh):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(
    optax.adamw(1e-3),
    stage=1,
    mesh=mesh,
    policy=zerojax.Policy(param_dtype=jnp.bfloat16),
  )
  table = zerojax.diagnostics.layout_table(zerojax.init(params, tx))
  for needle in (
    "params['embed']",
    "master['embed']",
    ".mu['embed']",
    ".nu['layers']['w']",
    "padded 7->8",
    "replicated (scalar)",
    "bytes/device",
  ):
    assert needle in table, needle


@pytest.mark.parametrize("stage", [0, 3])
def test_init_from_a_function_equals_init_from_arrays(mesh, stage):
  tx = zerojax.zero(
    optax.adamw(1e-3),
    stage=stage,
    mesh=mesh,
    policy=zerojax.Policy(param_dtype=jnp.bfloat16),
  )
  a = zerojax.init(toy.init_params(jax.random.key(3)), tx)
  b = zerojax.init_from(toy.init_params, tx, jax.random.key(3))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.sharding == y.sharding and x.shape == y.shape
    # the jitted initializer may round differently from the eager one
    np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-2, atol=1e-6
    )
