"""The reference GPT's step compiled by the TPU compiler (libtpu) for a
topology this machine does not hold, read back through ``zerojax.aot``.

Needs the ``tpu`` extra; marked ``tpu_compiler`` and run on its own:
libtpu holds a lock file, so one process loads it unless
``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` is set. CI's newest-JAX leg installs the
extra after the suite and runs ``pytest -m tpu_compiler -n 2`` with it
set (compiling only, no TPU is touched).
"""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from zerojax import aot, plan
from zerojax.app import compiled, gpt, plan_cli, planner

pytestmark = pytest.mark.tpu_compiler

CONFIG = gpt.GPTConfig(vocab=512, seq_len=128, width=256, depth=4, heads=2)
TOPOLOGY, BATCH = "v5e:2x2", 2


@pytest.fixture(scope="module")
def tpu_mesh():
  return aot.topology_mesh(TOPOLOGY)


@pytest.fixture(scope="module")
def stage3(tpu_mesh):
  n = tpu_mesh.size
  p = plan.plan_gpt(plan.abstract_gpt(CONFIG), 3, n)
  return p, compiled.compile_stage(
    CONFIG,
    3,
    tpu_mesh,
    BATCH,
    planner.predicted_peak(p, CONFIG, BATCH, n_devices=n),
  )


def test_the_compiled_stage_3_holds_the_planned_state(tpu_mesh, stage3):
  """The arguments are the sharded state as the planner lays it out (bf16
  params, fp32 master and moments over 4 chips, padding included; the
  gradient shard is the step's own) plus the batch and the step counter,
  within the TPU's tiling of small buffers; the peak is the compiler's own
  sum."""
  p, row = stage3
  m = row["memory"]
  batch_bytes = 2 * BATCH * CONFIG.seq_len * 4  # x and y, per chip
  extra = m["argument"] - (p.params + p.master + p.optimizer) - batch_bytes
  # the TPU lays each buffer out in tiles (8 x 128 elements for the minor
  # dimensions), so small leaves (biases, norms, the counter) take a few KB
  # more than their elements
  state = p.params + p.master + p.optimizer
  assert 0 <= extra <= 0.01 * state, (m, state)
  assert m["peak"] == m["argument"] + m["output"] + m["temp"] - m["alias"]
  assert row["topology"].startswith("TPU v5") and row["chips"] == 4


def test_the_compiled_stage_3_gathers_and_reduces_per_layer(stage3):
  """Per step: every layer gathered in the forward and again in the
  backward pass, its gradient reduce-scattered in the backward loop (the
  loop's iterations read from its condition: the TPU compiler writes no
  trip count), and some of the gathers issued asynchronously beside a
  matmul (the prefetch ZeRO-3 relies on)."""
  _, row = stage3
  c = row["collectives"]
  gathers = c["all-gather"]["count"] + row["written_as"].get(
    "all-gather as all-reduce", {}
  ).get("count", 0)
  assert gathers >= 2 * CONFIG.depth
  assert c["reduce-scatter"]["count"] >= CONFIG.depth
  issued = row["issued"]["all-gather"]
  assert issued["async"] >= 1 and issued["overlapped"] >= 1
  # the layers' gathered bytes: bf16 blocks, forward and backward
  layer = gpt._block_params(CONFIG.width, CONFIG.mlp_ratio) * 2
  assert c["all-gather"]["bytes"] >= 2 * CONFIG.depth * layer * 0.99


def test_meshes_over_two_slices_put_the_slices_on_the_outer_axis():
  """A replica axis goes across the slices; without one, the outermost
  axis does (slice by slice), so every other axis stays inside a slice."""
  slice_of = lambda mesh: [
    [d.slice_index for d in row] for row in mesh.devices.reshape(2, -1)
  ]
  for axes in ("replica=2,data=4", "data=8", "data=4,model=2"):
    mesh = aot.topology_mesh(TOPOLOGY, axes, num_slices=2)
    assert mesh.size == 8
    assert slice_of(mesh) == [[0] * 4, [1] * 4], axes
  # the data axis goes across even when it is not the outermost
  mesh = aot.topology_mesh(TOPOLOGY, "model=2,data=4", num_slices=2)
  assert all(
    len({d.slice_index for d in col}) == 1 for col in mesh.devices.T
  ), "model axis crosses slices"
  assert all(len({d.slice_index for d in row}) == 2 for row in mesh.devices)
  with pytest.raises(ValueError, match="num_slices=0"):
    aot.topology_devices(TOPOLOGY, num_slices=0)


def test_hsdp_across_two_slices_moves_only_the_gradient_shard_between_them():
  """Stage 3 on replica=2 (across 2 slices) x data=4: the one transfer
  between slices is the all-reduce of the reduce-scattered gradient, its
  bytes the planner's (``all-reduce over replica``). Width 512, so that
  each chip's shard of a (width, vocab) weight has a minor dimension of
  128: the TPU pads a narrower one to its 128 lanes, and those padded
  bytes cross the data-center network too."""
  import dataclasses

  import jax
  import optax

  import zerojax

  wide = dataclasses.replace(CONFIG, width=512, heads=4)
  mesh = aot.topology_mesh(TOPOLOGY, "replica=2,data=4", num_slices=2)
  config = wide.resolved("tpu")
  policy = zerojax.Policy(param_dtype=jnp.bfloat16)
  tx = zerojax.zero(optax.adamw(1e-3), stage=3, mesh=mesh, policy=policy)
  state = jax.eval_shape(
    lambda k: zerojax.init_from(lambda key: gpt.init(config, key), tx, k),
    jax.random.key(0),
  )
  batch = aot.abstract_batch(
    {k: ((16, config.seq_len), jnp.int32) for k in ("x", "y")}
  )
  step = zerojax.train_step(lambda p, b: gpt.loss(p, b, config), tx)
  report = aot.compiled_report(step.lower(state, batch).compile(), mesh)
  across = report["across_slices"]
  p = plan.plan_gpt(plan.abstract_gpt(wide), 3, mesh={"replica": 2, "data": 4})
  want = p.collectives["all-reduce over replica"]
  assert across["all-reduce"]["bytes"] == pytest.approx(want, rel=0.01)
  assert (
    sum(r["bytes"] for k, r in across.items() if k != "all-reduce")
    < 0.01 * want
  )


def test_a_70b_step_on_256_chips_lowers_without_allocating():
  """Stage 3 of a 70B reference GPT on a v5p pod of 256 chips: the state
  is shapes only (``jax.eval_shape``), the step lowers from it and an
  abstract batch, and no array comes to exist in this process."""
  import jax
  import optax

  import zerojax

  mesh = aot.topology_mesh("v5p:8x8x4")
  assert mesh.size == 256
  config = gpt.config_for_params(70e9).resolved("tpu")
  tx = zerojax.zero(
    optax.adamw(3e-4),
    stage=3,
    mesh=mesh,
    policy=zerojax.Policy(param_dtype=jnp.bfloat16),
  )
  before = len(jax.live_arrays())
  state = jax.eval_shape(
    lambda k: zerojax.init_from(lambda key: gpt.init(config, key), tx, k),
    jax.random.key(0),
  )
  assert gpt.num_params(config) > 69e9
  batch = aot.abstract_batch(
    {k: ((256, config.seq_len), jnp.int32) for k in ("x", "y")}
  )
  step = zerojax.train_step(lambda p, b: gpt.loss(p, b, config), tx)
  text = step.lower(state, batch).as_text()
  assert len(jax.live_arrays()) == before
  # the stacked layers arrive as one chip's shard: 1/256 of each
  qkv = state.params["blocks"]["qkv_LxDx3D"]
  per_chip = qkv.sharding.shard_shape(qkv.shape)
  assert qkv.size // 256 <= np.prod(per_chip) < qkv.size // 255
  assert "all_gather" in text or "all-gather" in text


def _offloaded_step(tpu_mesh, clip=False, accum=1, **offload):
  """The reference GPT's stage-3 step (bf16 params, fp32 master copy,
  AdamW, behind ``clip_by_global_norm`` with ``clip``, over ``accum``
  micro-batches) with ``offload`` as ``zerojax.zero`` takes it, compiled
  for the topology:
  ``(compiled_report row, planner's StagePlan)``."""
  import jax
  import optax

  import zerojax
  from zerojax import cost

  config = CONFIG.resolved("tpu")
  policy = zerojax.Policy(param_dtype=jnp.bfloat16)
  opt = optax.adamw(3e-4)
  if clip:
    opt = optax.chain(optax.clip_by_global_norm(1.0), opt)
  kw = dict(policy=policy, stacked=gpt.is_layer_stack, **offload)
  tx = zerojax.zero(opt, stage=3, mesh=tpu_mesh, **kw)
  init = lambda key: gpt.init(config, key)
  state = jax.eval_shape(
    lambda k: zerojax.init_from(init, tx, k), jax.random.key(0)
  )
  rows = BATCH * tpu_mesh.size * accum
  batch = aot.abstract_batch(
    {k: ((rows, config.seq_len), jnp.int32) for k in ("x", "y")}
  )
  step = zerojax.train_step(
    lambda p, b: gpt.loss(p, b, config), tx, accum_steps=accum
  )
  compiled = step.lower(state, batch).compile()
  row = aot.compiled_report(compiled, tpu_mesh)
  row["hlo"] = compiled.as_text()
  shapes = jax.eval_shape(init, jax.random.key(0))
  planned = cost.plan_stage(
    shapes, 3, mesh=dict(tpu_mesh.shape), optimizer=opt, accum_steps=accum, **kw
  )
  return row, planned


def _loop_bodies(hlo: str) -> dict:
  """Each while loop's body computation, by name, as text."""
  names = set(re.findall(r"while\(.*?body=%([\w.\-]+)", hlo))
  out, name, lines = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^%([\w.\-]+) .*\{$", line)
    if head:
      name, lines = head.group(1), []
    elif line.startswith("}") and name:
      if name in names:
        out[name] = "\n".join(lines)
      name = None
    elif name:
      lines.append(line)
  return out


def test_the_tpu_compiler_brings_offloaded_state_down_while_layers_run(
  tpu_mesh,
):
  """Stage 3 with the master copy and moments in host memory: the host
  bytes the compiled step reads and writes are the planner's, every host
  copy is asynchronous, and some of the state comes down while the
  forward or backward layer loop runs (the copy started before the loop,
  done after it): the transfer behind the passes' compute. The rest of it,
  and every write back (the new state exists once every gradient does),
  moves while no loop runs."""
  row, planned = _offloaded_step(tpu_mesh, offload=True)
  moved = row["host_transfers"]
  assert moved["host-to-device"]["bytes"] == moved["device-to-host"]["bytes"]
  assert moved["host-to-device"]["bytes"] == planned.host_to_device
  assert moved["device-to-host"]["bytes"] == planned.device_to_host
  for kind in ("host-to-device", "device-to-host"):
    assert row["issued"][kind]["sync"] == 0, row["issued"]
  loops = row["host_copies_across_loops"]
  assert loops["loops_crossed"] >= 1, loops
  assert 0 < loops["host-to-device"]["bytes_across_loops"], loops
  down, up = loops["host-to-device"], loops["device-to-host"]
  assert down["bytes_across_loops"] + down["bytes_outside_loops"] == (
    planned.host_to_device
  ), loops
  assert up["bytes_outside_loops"] == planned.device_to_host, loops


def test_the_tpu_compiler_reads_host_layer_stacks_once_per_pass(tpu_mesh):
  """Stage 3 with the params' shards in host memory as well: each layer
  stack comes down one layer at a time in the forward loop and again in
  the backward's, the embedding and head once; every shard is written
  back once. The bytes each way are the planner's to the byte."""
  row, planned = _offloaded_step(tpu_mesh, offload=True, offload_params=True)
  moved = row["host_transfers"]
  stacks = planned.params_host_stacked
  assert 0 < stacks < planned.params_host
  assert moved["host-to-device"]["bytes"] == planned.host_to_device
  assert moved["device-to-host"]["bytes"] == planned.device_to_host
  assert planned.host_to_device == planned.device_to_host + stacks


def test_the_tpu_compiler_writes_each_layers_gradient_to_host_memory(
  tpu_mesh,
):
  """Stage 3 with the state, the params' shards and the gradients in host
  memory: the backward loop writes each layer's gradient shard into a
  host buffer (``dynamic-update-slice-start`` into memory space 5), and
  the update brings each down once. The bytes each way are the
  planner's to the byte: the gradients' more, once each way."""
  kw = dict(offload=True, offload_params=True)
  row, planned = _offloaded_step(tpu_mesh, offload_grads=True, **kw)
  base_row, base = _offloaded_step(tpu_mesh, **kw)
  moved = row["host_transfers"]
  assert 0 < planned.grads_host <= planned.grads
  assert moved["host-to-device"]["bytes"] == planned.host_to_device
  assert moved["device-to-host"]["bytes"] == planned.device_to_host
  assert planned.host_to_device == base.host_to_device + planned.grads_host
  assert planned.device_to_host == base.device_to_host + planned.grads_host
  into_host = re.compile(
    r"= \(?\(?\w+\[[\d,]*\]\{[^}]*S\(5\)\}.* dynamic-update-slice-start\("
  )
  count = lambda bodies: sum(len(into_host.findall(b)) for b in bodies.values())
  # the stacks' gradients: written per layer in a loop (not there
  # without offload_grads)
  assert count(_loop_bodies(row["hlo"])) >= 4, row["memory"]
  assert count(_loop_bodies(base_row["hlo"])) == 0


def test_the_tpu_compiler_sums_the_micro_batches_gradients_in_host_memory(
  tpu_mesh,
):
  """Three micro-batches with the state and gradients in host memory:
  each backward loop after the first micro-batch's reads a layer's sum
  so far from host memory and writes the new one there, so the host
  bytes each way are the planner's to the byte: the gradients 3 times
  up and 3 times down, 2 more each way than with one micro-batch."""
  kw = dict(offload=True, offload_grads=True)
  row, planned = _offloaded_step(tpu_mesh, accum=3, **kw)
  moved = row["host_transfers"]
  assert moved["host-to-device"]["bytes"] == planned.host_to_device
  assert moved["device-to-host"]["bytes"] == planned.device_to_host
  one = _offloaded_step(tpu_mesh, **kw)[1]
  assert planned.device_to_host == one.device_to_host + 2 * one.grads_host
  assert planned.host_to_device == one.host_to_device + 2 * one.grads_host


def test_each_micro_batch_reads_the_host_params_again(tpu_mesh):
  """Three micro-batches with the params' shards in host memory: each
  micro-batch's layer loops bring the stacks down again and its gathers
  the other params, so the bytes down are the planner's to the byte,
  2 x (params + stacks) more than with one. With the gradients on the
  host too, the first micro-batch (traced apart) and the scan over the
  rest may share a read: at most the planner's, at least the state's and
  gradients'."""
  kw = dict(offload=True, offload_params=True)
  row, planned = _offloaded_step(tpu_mesh, accum=3, **kw)
  one = _offloaded_step(tpu_mesh, **kw)[1]
  moved = row["host_transfers"]
  assert moved["host-to-device"]["bytes"] == planned.host_to_device
  assert moved["device-to-host"]["bytes"] == planned.device_to_host
  per_micro_batch = one.params_host + one.params_host_stacked
  assert planned.host_to_device == one.host_to_device + 2 * per_micro_batch
  row, planned = _offloaded_step(tpu_mesh, accum=3, offload_grads=True, **kw)
  moved = row["host_transfers"]
  least = one.host_to_device + 2 * planned.grads_host + planned.grads_host
  assert least <= moved["host-to-device"]["bytes"] <= planned.host_to_device
  assert moved["device-to-host"]["bytes"] == planned.device_to_host


def test_behind_a_global_norm_the_tpu_compiler_reads_each_gradient_at_most_twice(
  tpu_mesh,
):
  """``clip_by_global_norm`` with the state, params' shards and gradients
  in host memory: the norm is computed first, each gradient brought down
  whole in turn, then each chunk brings its own down again. The planner
  counts the stream as written (the gradients twice down, once up); the
  compiler may keep a gradient the norm pass brought down for its chunk
  (it does, for every one, at this size), so the compiled step reads at
  least the unclipped step's bytes and at most the planner's, writes the
  same bytes, and its peak exceeds the unclipped step's by at most the
  norm pass's largest gradient."""
  kw = dict(offload=True, offload_params=True, offload_grads=True)
  row, planned = _offloaded_step(tpu_mesh, clip=True, **kw)
  base_row, base = _offloaded_step(tpu_mesh, **kw)
  assert planned.norm_first and not base.norm_first
  assert planned.host_to_device == base.host_to_device + planned.grads_host
  assert planned.device_to_host == base.device_to_host
  moved = row["host_transfers"]
  down = moved["host-to-device"]["bytes"]
  assert base.host_to_device <= down <= planned.host_to_device
  assert moved["device-to-host"]["bytes"] == planned.device_to_host
  pass_peak = planned.norm_first_peak_fraction * planned.grads_host
  assert 0 < pass_peak < planned.grads_host
  assert row["memory"]["peak"] <= base_row["memory"]["peak"] + pass_peak


def test_the_tpu_compiler_moves_offloaded_block_inputs_as_planned(tpu_mesh):
  """Activation checkpoints in host memory (``remat="offload"``): the
  compiled step writes each layer's saved block input into a host buffer
  in the forward loop (``dynamic-update-slice-start`` into host memory)
  and reads it back in the backward's; both ways, the bytes the planner
  puts on the host."""
  import jax
  import optax

  import zerojax
  from zerojax import cost

  config = dataclasses.replace(CONFIG, remat="offload").resolved("tpu")
  tx = zerojax.zero(optax.adamw(3e-4), stage=3, mesh=tpu_mesh)
  init = lambda key: gpt.init(config, key)
  state = jax.eval_shape(
    lambda k: zerojax.init_from(init, tx, k), jax.random.key(0)
  )
  loss_fn = lambda p, b: gpt.loss(p, b, config)
  rows = BATCH * tpu_mesh.size
  batch = aot.abstract_batch(
    {k: ((rows, config.seq_len), jnp.int32) for k in ("x", "y")}
  )
  step = zerojax.train_step(loss_fn, tx)
  moved = aot.compiled_report(step.lower(state, batch).compile(), tpu_mesh)[
    "host_transfers"
  ]
  one_chip = {
    k: jax.ShapeDtypeStruct((BATCH, config.seq_len), jnp.int32)
    for k in ("x", "y")
  }
  saved = cost.saved_activations(
    loss_fn,
    jax.eval_shape(init, jax.random.key(0)),
    one_chip,
    mesh=dict(tpu_mesh.shape),
  )
  assert saved["host"] > 0
  assert moved["device-to-host"]["bytes"] == saved["host"]
  assert moved["host-to-device"]["bytes"] == saved["host"]


def test_the_planners_compile_builds_the_step_it_plans(capsys):
  """``python -m zerojax.plan --compile`` with the state, the params'
  shards and the gradients in host memory compiles the step the plan
  prices: offloaded as planned (the bytes written to the host are the
  plan's to the byte) and behind the main job's global-norm clip, whose
  pass brings each gradient down a second time, which the planner counts
  (the compiler may keep a gradient the pass brought down for its chunk,
  so the bytes brought down lie between the plan's less one trip of the
  gradients, the unclipped step's, and the plan's)."""
  import json

  plan_cli.main(
    [
      *("--topology", TOPOLOGY, "--batch", str(BATCH), "--stages", "3"),
      *("--width", str(CONFIG.width), "--depth", str(CONFIG.depth)),
      *("--vocab", str(CONFIG.vocab), "--seq-len", str(CONFIG.seq_len)),
      *("--compile", "--offload", "--offload-params", "--offload-grads"),
      "--json",
    ]
  )
  out = json.loads(capsys.readouterr().out)
  (row,) = out["compiled"]
  (planned,) = out["plans"]  # --stages 3 only
  assert planned["stage"] == 3
  assert (
    row["offload"] == 1.0 and row["offload_params"] and row["offload_grads"]
  )
  assert planned["norm_first"] and planned["grads_host"] > 0
  moved = row["host_transfers"]
  assert moved["device-to-host"]["bytes"] == planned["device_to_host"]
  assert (
    planned["host_to_device"] - planned["grads_host"]
    <= moved["host-to-device"]["bytes"]
    <= planned["host_to_device"]
  )


def test_a_state_deferred_to_the_next_step_costs_the_device_its_residency():
  """Why zerojax does not defer the last writes to the next step's forward
  pass (docs/design.md): ``experiments/studies/deferred_writes.py``'s step, compiled
  for one v5e chip. A tail of the moments handed from one step to the
  next in device memory is an argument of the next step's program, so the
  device holds it for the whole step: the deferred variants plan at least
  the peak of keeping the tail resident, and move the tail's bytes each
  way, which the resident tail does not. Written one layer per forward
  iteration, the writes run inside the loop, asynchronously beside the
  layer's matmul; issued by the step itself, no write crosses a loop."""
  import importlib.util
  import pathlib

  path = (
    pathlib.Path(__file__).parents[1]
    / "experiments"
    / "studies"
    / "deferred_writes.py"
  )
  spec = importlib.util.spec_from_file_location("deferred_writes", path)
  dw = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(dw)
  import jax

  mesh = aot.topology_mesh("v5e:1x1", axis_types=(jax.sharding.AxisType.Auto,))
  size = dict(layers=8, width=1024, batch=512, groups=4, tail=1)
  rows = {v: dw.measure(v, mesh, **size) for v in dw.VARIANTS}
  tail = 2 * 4 * size["layers"] * size["width"] ** 2 // size["groups"]
  peak = {v: r["peak_bytes"] for v, r in rows.items()}
  moved = {
    v: {k: t["bytes"] for k, t in r["host_transfers"].items()}
    for v, r in rows.items()
  }
  for v in ("deferred", "deferred_in_loop"):
    assert peak[v] >= peak["resident"] >= peak["offloaded"]
    assert moved[v] == moved["offloaded"]
    for way in ("host-to-device", "device-to-host"):
      assert moved[v][way] == moved["resident"][way] + tail
    assert rows[v]["schedule"]["device-to-host"]["bytes_across_loops"] == 0
  started = rows["deferred"]["whole_copies_started"]["device-to-host"]
  assert started == {"after_loops": 2}
  in_loop = rows["deferred_in_loop"]["loop_body_copies"]
  assert [c["kind"] for c in in_loop] == ["device-to-host"] * 2
  assert all(c["mode"] == "async" and c["matmuls_beside"] >= 1 for c in in_loop)
