"""Stage 3 with offload compiled by XLA's GPU compiler for an H200, ahead
of time on this machine (``experiments/lib/gpu_aot.py``: the CUDA plugin,
no driver or device), read back through ``zerojax.aot``.

Needs the CUDA plugin (``jax-cuda13-plugin`` and ``jax-cuda13-pjrt`` at
jaxlib's version); marked ``gpu_compiler`` and run on its own: CI's
newest-JAX leg installs the plugin after the TPU compiler's tests and runs
``pytest -m gpu_compiler``.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax
from zerojax import aot

sys.path.insert(
  0, str(pathlib.Path(__file__).parent.parent / "experiments" / "lib")
)
import gpu_aot  # noqa: E402

pytestmark = pytest.mark.gpu_compiler

L, V, D, F = 8, 64, 64, 256  # each stack (L x D x F) larger than the embedding


def _init(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "embed": 0.02 * jax.random.normal(k1, (V, D)),
    "up": 0.02 * jax.random.normal(k2, (L, D, F)),
    "down": 0.02 * jax.random.normal(k3, (L, F, D)),
  }


def _loss(params, batch):
  x = params["embed"][batch["x"]]

  def layer(x, w):
    up, down = w
    return x + jax.nn.gelu(x @ up) @ down, None

  x, _ = jax.lax.scan(layer, x, (params["up"], params["down"]))
  logits = x @ params["embed"].T
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["y"]
  ).mean()


def _compiled(**offload):
  mesh = zerojax.make_mesh(devices=jax.devices()[:1])
  opt = optax.adam(1e-3)
  tx = zerojax.zero(opt, stage=3, mesh=mesh, **offload)
  state = zerojax.init_from(_init, tx, jax.random.key(0))
  batch = {k: jnp.zeros((4, 16), jnp.int32) for k in ("x", "y")}
  step = zerojax.train_step(_loss, tx)
  row = aot.compiled_report(
    gpu_aot.compile_for_gpu(step.trace(state, batch)), mesh
  )
  shapes = jax.eval_shape(_init, jax.random.key(0))
  plan = zerojax.cost.plan_stage(
    shapes, 3, mesh={"data": 1}, optimizer=opt, policy=tx.policy, **offload
  )
  stream = zerojax.report(step, state, batch).offload
  return row, plan, stream


def test_the_gpu_compiler_writes_layer_stacks_into_host_memory_in_place():
  """The master-less fp32 state's moments in host memory, each stack
  streamed a few layers per chunk: its rows are read and written in place
  (no host-memory temp, the host outputs the donated inputs), the bytes
  each way are the planner's, and every host copy is asynchronous."""
  row, plan, stream = _compiled(offload=True)
  assert stream["stacks_by_rows"] == 2, stream
  m = row["memory"]
  assert m.get("host_temp", 0) == 0, m
  assert m["host_argument"] == m["host_output"] > 0, m
  moved = row["host_transfers"]
  assert moved["host-to-device"]["bytes"] == plan.host_to_device, (moved, plan)
  assert moved["device-to-host"]["bytes"] == plan.device_to_host, (moved, plan)
  for kind in ("host-to-device", "device-to-host"):
    assert row["issued"][kind]["sync"] == 0, row["issued"]


def test_the_gpu_compiler_reads_host_params_per_layer_and_for_the_update():
  """The params' shards in host memory too (no master copy): each stack
  comes down a layer at a time in the forward and the backward loops and
  once more for the update, which writes it back; the bytes each way are
  the planner's to the byte."""
  row, plan, stream = _compiled(offload=True, offload_params=True)
  assert stream["params_on_host"] and stream["stacks_by_rows"] == 2, stream
  moved = row["host_transfers"]
  assert moved["host-to-device"]["bytes"] == plan.host_to_device, (moved, plan)
  assert moved["device-to-host"]["bytes"] == plan.device_to_host, (moved, plan)
  assert (
    plan.host_to_device == plan.device_to_host + 2 * plan.params_host_stacked
  )
  assert row["memory"].get("host_temp", 0) == 0, row["memory"]
