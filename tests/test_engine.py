"""The engine's parts, tested from inside: the layout rule, ZeRO++'s
quantizer, the traced-program readers, the init programs. Every other
test file reaches zerojax through its public namespaces.
"""

import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import zerojax
import zerojax.checkpoint
from tests import toy
from tests.test_aot import _GPU, _TPU, _TPU_OFFLOAD, _TPU_SLICES
from tests.test_api_edges import D as api_edges_D
from tests.test_api_edges import V as api_edges_V
from tests.test_checkpoint import BF16 as checkpoint_BF16
from tests.test_collectives import (
  BATCH,
  B,
  F,
  all_reduced_shapes,
  plain_loss,
  plain_params,
)
from tests.test_collectives import D as collectives_D
from tests.test_memory import D as memory_D
from tests.test_memory import V as memory_V
from tests.test_offload import BF16 as offload_BF16
from tests.test_offload import _leaves as _offload_leaves
from tests.test_per_layer import (
  _assert_equal,
  _data,
  _params,
  _zero_run,
  checkpointed_scan,
)
from tests.test_real_losses import _host_tanh
from tests.test_safetensors import MAPPING as SAFETENSORS_MAPPING
from tests.test_safetensors import _hf_tensors as hf_tensors
from tests.test_safetensors import _params as safetensors_params
from tests.test_safetensors import _template as safetensors_template
from tests.test_zeropp import _one_sgd_step
from zerojax import checkpoint
from zerojax._src.comm import quantized as _zeropp
from zerojax._src.diagnostics import offload_share, schedule
from zerojax._src.diagnostics.plan_layout import plan_spec
from zerojax._src.jaxpr import cut as _cut
from zerojax._src.jaxpr import deps as _deps
from zerojax._src.jaxpr import rows as _rows
from zerojax._src.records import host_memory as _host_memory
from zerojax._src.records import zeropp as _settings
from zerojax._src.records.layout import plan_leaf
from zerojax._src.step import offload as _offload
from zerojax._src.step import offload_trace as _offload_trace


# --- from test_api_edges.py -------------------------------------------
def test_init_from_builds_leaf_groups_of_an_eighth_of_the_bytes(mesh):
  from zerojax._src.step import state as _state  # the init module, under test

  init_fn = lambda key: {
    f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (16 * (i + 1), 64))
    for i in range(10)
  }
  tx = zerojax.zero(optax.adam(1e-3), stage=3, mesh=mesh)
  spec = zerojax.layout.make_spec(
    jax.eval_shape(init_fn, jax.random.key(0)), tx
  )
  groups = _state.init_groups(spec)
  assert [i for g in groups for i in g] == list(range(10))  # all, in order
  sizes = [r.size * 4 for r in spec.leaves]
  budget = sum(sizes) / 8
  for g in groups:
    assert len(g) == 1 or sum(sizes[i] for i in g) <= budget, (g, budget)
  assert 1 < len(groups) <= 2 * 8
  for a, b in zip(groups, groups[1:]):  # neighbours would not fit one
    assert sum(sizes[i] for i in a + b) > budget
  # built group by group (XLA drops the others' work), the state is the one
  # a single program computing every leaf gives, bit for bit: an init draws
  # and scales each element alone (no sum whose order a program could pick)
  key = jax.random.key(0)
  grouped = zerojax.init_from(init_fn, tx, key)
  whole = zerojax.init(jax.jit(init_fn)(key), tx)
  toy.assert_same_arrays(grouped, whole)


def test_init_from_at_stage0_builds_the_state_in_one_program(mesh):
  """Stage 0 replicates everything, so groups would bound nothing: one
  init program (fewer freed buffers left in the host allocator), with the
  state a program per group gives, bit for bit."""
  from zerojax._src.step import state as _state  # the init module, under test

  init_fn = lambda key: toy.layered_params(4, api_edges_D, api_edges_V, key)
  key = jax.random.key(0)
  programs = []
  real_jit = jax.jit

  def counting_jit(fn, **kw):
    programs.append(fn)
    return real_jit(fn, **kw)

  tx0 = zerojax.zero(optax.adamw(1e-3), stage=0, mesh=mesh)
  try:
    _state.jax.jit = counting_jit
    whole = zerojax.init_from(init_fn, tx0, key)
  finally:
    _state.jax.jit = real_jit
  # the init programs (not the step counter's, jitted on first use)
  assert len([f for f in programs if "init_programs" in f.__qualname__]) == 1
  spec = zerojax.layout.make_spec(jax.eval_shape(init_fn, key), tx0)
  assert len(_state.build_plan(spec)[0]) > 1  # what grouping would have run
  from zerojax._src.step import init_from as _init_from

  plan = _init_from.build_plan
  try:  # the same init, one program per group
    _init_from.build_plan = lambda spec, grouped=True: plan(spec, True)
    by_group = zerojax.init_from(init_fn, tx0, key)
  finally:
    _init_from.build_plan = plan
  toy.assert_same_arrays(whole, by_group)


# --- from test_aot.py -------------------------------------------------
def test_the_schedule_reader_counts_a_tpu_chain_once_with_its_matmul():
  """The chain's three pieces each hold the all-gather: one collective, in
  the schedule and in the byte count."""
  found = zerojax.diagnostics.collectives(_TPU, 4)
  assert sorted(c.kind for c in found) == ["all-gather", "reduce-scatter"]
  assert [c.bytes for c in found if c.kind == "all-gather"] == [256 * 256 * 2]
  got = schedule.issued(_TPU)
  assert sorted((c.kind, c.mode, c.overlapped_matmuls) for c in got) == [
    ("all-gather", "async", 1),
    ("reduce-scatter", "sync", 0),
  ]
  assert schedule.summary(_TPU) == {
    "all-gather": {"sync": 0, "async": 1, "overlapped": 1},
    "reduce-scatter": {"sync": 1, "async": 0, "overlapped": 0},
  }


def test_the_schedule_reader_reads_a_start_done_pair():
  assert [
    (c.kind, c.mode, c.overlapped_matmuls) for c in schedule.issued(_GPU)
  ] == [("all-gather", "async", 2)]


def test_a_transfer_between_slices_is_counted_once_as_its_collective():
  """The send names the collective (an all-reduce of the 256 KiB buffer);
  its done and the matching receive are not counted again."""
  found = zerojax.diagnostics.collectives(_TPU_SLICES, 4)
  assert [(c.kind, c.across_slices, c.bytes, c.count) for c in found] == [
    ("all-reduce", True, 64 * 8 * 128 * 4, 1)
  ]
  from zerojax._src.diagnostics import aot as _aot

  assert _aot._dcn_wire(found[0], 2) == 64 * 8 * 128 * 4  # 2 x 1/2
  assert _aot._dcn_wire(found[0], 4) == 1.5 * 64 * 8 * 128 * 4


def test_host_transfers_are_read_with_their_direction_and_overlap():
  from zerojax._src.diagnostics import hlo_memory

  assert hlo_memory.host_transfers(_TPU_OFFLOAD) == {
    "host-to-device": {"count": 1, "bytes": 64 * 256 * 4},
    "device-to-host": {"count": 1, "bytes": 64 * 256 * 4},
  }
  assert schedule.summary(_TPU_OFFLOAD) == {
    "host-to-device": {
      "sync": 0,
      "async": 1,
      "overlapped": 1,
      "beside_compute": 1,
      "both_ways": 0,
    },
    "device-to-host": {
      "sync": 0,
      "async": 1,
      "overlapped": 0,
      "beside_compute": 0,
      "both_ways": 0,
    },
  }
  assert zerojax.diagnostics.collectives(_TPU_OFFLOAD, 4) == []


# a streamed update's copies: the next chunk comes down while the previous
# one goes back and this one is updated (an elementwise add, no matmul)
_TPU_STREAM = """
HloModule m

ENTRY %main (h: f32[64,256], n: f32[64,256], d: f32[64,256]) -> f32[64,256] {
  %h = f32[64,256]{1,0:T(8,128)S(5)} parameter(0)
  %d = f32[64,256]{1,0:T(8,128)} parameter(2)
  %copy-start = (f32[64,256]{1,0:T(8,128)}, f32[64,256]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) copy-start(%h)
  %copy-start.1 = (f32[64,256]{1,0:T(8,128)S(5)}, f32[64,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%d)
  %add = f32[64,256]{1,0:T(8,128)} add(%d, %d), backend_config={"estimated_cycles":"100"}
  %copy-done.1 = f32[64,256]{1,0:T(8,128)S(5)} copy-done(%copy-start.1)
  %copy-done = f32[64,256]{1,0:T(8,128)} copy-done(%copy-start)
  ROOT %r = f32[64,256]{1,0:T(8,128)} add(%copy-done, %add), backend_config={"estimated_cycles":"50"}
}
"""


def test_host_copies_read_beside_compute_and_both_ways_at_once():
  row = {
    "sync": 0,
    "async": 1,
    "overlapped": 0,
    "beside_compute": 1,
    "both_ways": 1,
  }
  assert schedule.summary(_TPU_STREAM) == {
    "host-to-device": row,
    "device-to-host": row,
  }
  # the compiler's cost model: 100 of the 150 cycles run beside both
  assert schedule.host_copy_cycles(_TPU_STREAM) == {
    "compute": 150,
    "beside_host_to_device": 100,
    "beside_device_to_host": 100,
    "beside_any": 100,
  }
  assert schedule.host_copy_cycles(_TPU_OFFLOAD) == {}  # no estimates


# a layer loop between the copies: the first state leaf comes down while
# the loop runs, the second after it; the write back follows the loop
_TPU_LOOP = """
HloModule m

%body (p: (s32[], f32[64,256])) -> (s32[], f32[64,256]) {
  %p = (s32[], f32[64,256]{1,0:T(8,128)}) parameter(0)
  ROOT %t = (s32[], f32[64,256]{1,0:T(8,128)}) tuple(%p)
}

%cond (p: (s32[], f32[64,256])) -> pred[] {
  %p = (s32[], f32[64,256]{1,0:T(8,128)}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (h: f32[64,256], g: bf16[8,128], x: (s32[], f32[64,256])) -> f32[64,256] {
  %h = f32[64,256]{1,0:T(8,128)S(5)} parameter(0)
  %g = bf16[8,128]{1,0:T(8,128)(2,1)S(5)} parameter(1)
  %x = (s32[], f32[64,256]{1,0:T(8,128)}) parameter(2)
  %copy-start = (f32[64,256]{1,0:T(8,128)}, f32[64,256]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) copy-start(%h)
  %while = (s32[], f32[64,256]{1,0:T(8,128)}) while(%x), condition=%cond, body=%body
  %copy-done = f32[64,256]{1,0:T(8,128)} copy-done(%copy-start)
  %copy-start.1 = (bf16[8,128]{1,0:T(8,128)(2,1)}, bf16[8,128]{1,0:T(8,128)(2,1)S(5)}, u32[]{:S(2)}) copy-start(%g)
  %y = f32[64,256]{1,0:T(8,128)} get-tuple-element(%while), index=1
  %copy-done.1 = bf16[8,128]{1,0:T(8,128)(2,1)} copy-done(%copy-start.1)
  %add = f32[64,256]{1,0:T(8,128)} add(%copy-done, %y)
  %copy-start.2 = (f32[64,256]{1,0:T(8,128)S(5)}, f32[64,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%add)
  %copy-done.2 = f32[64,256]{1,0:T(8,128)S(5)} copy-done(%copy-start.2)
  ROOT %r = f32[64,256]{1,0:T(8,128)} add(%add, %add)
}
"""


# a layer stack in host memory read one layer per iteration of a 4-layer
# loop (a dynamic-slice-start from host memory into the device's)
_TPU_HOST_SLICE = """
HloModule m

%body (p: (s32[], bf16[4,128,512])) -> (s32[], bf16[4,128,512]) {
  %p = (s32[], bf16[4,128,512]{2,1,0:T(8,128)(2,1)S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[4,128,512]{2,1,0:T(8,128)(2,1)S(5)} get-tuple-element(%p), index=1
  %z = s32[] constant(0)
  %dynamic-slice-start = ((bf16[4,128,512]{2,1,0:T(8,128)(2,1)S(5)}, s32[]{:T(128)}, s32[]{:T(128)}, s32[]{:T(128)}), bf16[1,128,512]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) dynamic-slice-start(%w, %i, %z, %z), dynamic_slice_sizes={1,128,512}
  %dynamic-slice-done = bf16[1,128,512]{2,1,0:T(8,128)(2,1)} dynamic-slice-done(%dynamic-slice-start)
  ROOT %t = (s32[], bf16[4,128,512]{2,1,0:T(8,128)(2,1)S(5)}) tuple(%i, %w)
}

ENTRY %main (x: (s32[], bf16[4,128,512])) -> (s32[], bf16[4,128,512]) {
  %x = (s32[], bf16[4,128,512]{2,1,0:T(8,128)(2,1)S(5)}) parameter(0)
  ROOT %while = (s32[], bf16[4,128,512]{2,1,0:T(8,128)(2,1)S(5)}) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_a_layer_sliced_from_host_memory_counts_as_host_to_device_per_trip():
  from zerojax._src.diagnostics import hlo_memory

  assert hlo_memory.host_transfers(_TPU_HOST_SLICE) == {
    "host-to-device": {"count": 4, "bytes": 4 * 128 * 512 * 2},
  }


# a layer written back into a host buffer in place, one per iteration of an
# 8-layer loop: libtpu's dynamic-update-slice-start into host memory (its
# operands: the host buffer, the device update, the indices)
_TPU_HOST_UPDATE = """
HloModule m

%body (p: (s32[], f32[8,128,1024], f32[1,128,1024])) -> (s32[], f32[8,128,1024], f32[1,128,1024]) {
  %p = (s32[], f32[8,128,1024]{2,1,0:T(8,128)S(5)}, f32[1,128,1024]{2,1,0:T(8,128)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[8,128,1024]{2,1,0:T(8,128)S(5)} get-tuple-element(%p), index=1
  %u = f32[1,128,1024]{2,1,0:T(8,128)} get-tuple-element(%p), index=2
  %z = s32[] constant(0)
  %dynamic-update-slice-start = ((f32[8,128,1024]{2,1,0:T(8,128)S(5)}, f32[1,128,1024]{2,1,0:T(8,128)}, s32[]{:T(128)}, s32[]{:T(128)}, s32[]{:T(128)}), f32[8,128,1024]{2,1,0:T(8,128)S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%w, %u, %i, %z, %z)
  %dynamic-update-slice-done = f32[8,128,1024]{2,1,0:T(8,128)S(5)} dynamic-update-slice-done(%dynamic-update-slice-start)
  ROOT %t = (s32[], f32[8,128,1024]{2,1,0:T(8,128)S(5)}, f32[1,128,1024]{2,1,0:T(8,128)}) tuple(%i, %dynamic-update-slice-done, %u)
}

ENTRY %main (x: (s32[], f32[8,128,1024], f32[1,128,1024])) -> (s32[], f32[8,128,1024], f32[1,128,1024]) {
  %x = (s32[], f32[8,128,1024]{2,1,0:T(8,128)S(5)}, f32[1,128,1024]{2,1,0:T(8,128)}) parameter(0)
  ROOT %while = (s32[], f32[8,128,1024]{2,1,0:T(8,128)S(5)}, f32[1,128,1024]{2,1,0:T(8,128)}) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
}
"""


def test_a_layer_written_into_host_memory_counts_its_bytes_per_trip():
  """Only the written slice crosses, not the host buffer it lands in."""
  from zerojax._src.diagnostics import hlo_memory

  assert hlo_memory.host_transfers(_TPU_HOST_UPDATE) == {
    "device-to-host": {"count": 8, "bytes": 8 * 128 * 1024 * 4},
  }


# the GPU compiler's forms of the same moves: a slice read from a host
# buffer and a slice written into it are asynchronous fusions
# (``fusion-start`` of a computation whose root is the slice), and a
# scalar's device shape is written without a layout
_GPU_HOST_ROWS = """
HloModule m

%wrapped_dynamic-slice_computation (a: f32[8,64,192], b: s32[], c: s32[], d: s32[]) -> f32[2,64,192] {
  %a = f32[8,64,192]{2,1,0:S(5)} parameter(0)
  %b = s32[] parameter(1)
  %c = s32[] parameter(2)
  %d = s32[] parameter(3)
  ROOT %dynamic-slice.1 = f32[2,64,192]{2,1,0} dynamic-slice(%a, %b, %c, %d), dynamic_slice_sizes={2,64,192}
}

%wrapped_dynamic-update-slice_computation (a: f32[8,64,192], u: f32[2,64,192], b: s32[], c: s32[], d: s32[]) -> f32[8,64,192] {
  %a = f32[8,64,192]{2,1,0:S(5)} parameter(0)
  %u = f32[2,64,192]{2,1,0} parameter(1)
  %b = s32[] parameter(2)
  %c = s32[] parameter(3)
  %d = s32[] parameter(4)
  ROOT %dynamic-update-slice.1 = f32[8,64,192]{2,1,0:S(5)} dynamic-update-slice(%a, %u, %b, %c, %d)
}

ENTRY %main (m: f32[8,64,192], n: s32[]) -> (f32[8,64,192], s32[]) {
  %m = f32[8,64,192]{2,1,0:S(5)} parameter(0)
  %n = s32[]{:S(5)} parameter(1)
  %z = s32[] constant(0)
  %two = s32[] constant(2)
  %copy-start = (s32[], s32[]{:S(5)}, u32[]) copy-start(%n)
  %copy-done = s32[] copy-done(%copy-start)
  %dynamic-slice-start = ((f32[8,64,192]{2,1,0:S(5)}, s32[], s32[], s32[]), f32[2,64,192]{2,1,0}, u32[]) fusion-start(%m, %two, %z, %z), kind=kLoop, calls=%wrapped_dynamic-slice_computation
  %dynamic-slice-done = f32[2,64,192]{2,1,0} fusion-done(%dynamic-slice-start)
  %add = f32[2,64,192]{2,1,0} add(%dynamic-slice-done, %dynamic-slice-done)
  %dynamic-update-slice-start = ((f32[8,64,192]{2,1,0:S(5)}, f32[2,64,192]{2,1,0}, s32[], s32[], s32[]), f32[8,64,192]{2,1,0:S(5)}, u32[]) fusion-start(%m, %add, %two, %z, %z), kind=kLoop, calls=%wrapped_dynamic-update-slice_computation
  %dynamic-update-slice-done = f32[8,64,192]{2,1,0:S(5)} fusion-done(%dynamic-update-slice-start)
  ROOT %t = (f32[8,64,192]{2,1,0:S(5)}, s32[]) tuple(%dynamic-update-slice-done, %copy-done)
}
"""


def test_the_gpu_compilers_slice_fusions_count_as_host_transfers():
  """Two rows (2 x 64 x 192 floats) each way and the scalar counter down:
  the slices' bytes, not their host buffer's; each an asynchronous host
  copy in the schedule."""
  from zerojax._src.diagnostics import hlo_memory

  rows = 2 * 64 * 192 * 4
  assert hlo_memory.host_transfers(_GPU_HOST_ROWS) == {
    "host-to-device": {"count": 2, "bytes": rows + 4},
    "device-to-host": {"count": 1, "bytes": rows},
  }
  issued = schedule.summary(_GPU_HOST_ROWS)
  assert issued["host-to-device"]["async"] == 2, issued
  assert issued["device-to-host"]["async"] == 1, issued
  moved = schedule.host_copies_across_loops(_GPU_HOST_ROWS)
  assert moved["host-to-device"]["bytes"] == rows + 4, moved
  assert moved["device-to-host"]["bytes"] == rows, moved


def test_host_copies_in_flight_across_a_layer_loop_are_counted_with_bytes():
  """The first leaf comes down across the loop; the second and the write
  back move while no loop runs."""
  assert schedule.host_copies_across_loops(_TPU_LOOP) == {
    "host-to-device": {
      "copies": 2,
      "bytes": 64 * 256 * 4 + 8 * 128 * 2,
      "across_loops": 1,
      "bytes_across_loops": 64 * 256 * 4,
      "outside_loops": 1,
      "bytes_outside_loops": 8 * 128 * 2,
    },
    "device-to-host": {
      "copies": 1,
      "bytes": 64 * 256 * 4,
      "across_loops": 0,
      "bytes_across_loops": 0,
      "outside_loops": 1,
      "bytes_outside_loops": 64 * 256 * 4,
    },
    "loops_crossed": 1,
  }
  assert schedule.host_copies_across_loops(_TPU_STREAM)["loops_crossed"] == 0
  assert schedule.host_copies_across_loops(_GPU) == {}  # no host copies


# a layer's params read from host memory inside the loop's body (called
# from the body through a conditional's branch), the loop's result written
# back after it
_TPU_BODY_READ = """
HloModule m

%branch (q: f32[8,128]) -> f32[8,128] {
  %q = f32[8,128]{1,0:T(8,128)S(5)} parameter(0)
  %copy-start = (f32[8,128]{1,0:T(8,128)}, f32[8,128]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) copy-start(%q)
  %copy-done = f32[8,128]{1,0:T(8,128)} copy-done(%copy-start)
  ROOT %n = f32[8,128]{1,0:T(8,128)} negate(%copy-done)
}

%other (q: f32[8,128]) -> f32[8,128] {
  %q = f32[8,128]{1,0:T(8,128)S(5)} parameter(0)
  ROOT %z = f32[8,128]{1,0:T(8,128)} constant(0)
}

%body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %p = (s32[], f32[8,128]{1,0:T(8,128)S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[8,128]{1,0:T(8,128)S(5)} get-tuple-element(%p), index=1
  %y = f32[8,128]{1,0:T(8,128)} conditional(%i, %w, %w), branch_computations={%branch, %other}
  ROOT %t = (s32[], f32[8,128]{1,0:T(8,128)S(5)}) tuple(%i, %w)
}

%cond (p: (s32[], f32[8,128])) -> pred[] {
  %p = (s32[], f32[8,128]{1,0:T(8,128)S(5)}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: (s32[], f32[8,128]), d: f32[64,256]) -> f32[64,256] {
  %x = (s32[], f32[8,128]{1,0:T(8,128)S(5)}) parameter(0)
  %d = f32[64,256]{1,0:T(8,128)} parameter(1)
  %while = (s32[], f32[8,128]{1,0:T(8,128)S(5)}) while(%x), condition=%cond, body=%body
  %copy-start = (f32[64,256]{1,0:T(8,128)S(5)}, f32[64,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%d)
  %copy-done = f32[64,256]{1,0:T(8,128)S(5)} copy-done(%copy-start)
  ROOT %r = f32[64,256]{1,0:T(8,128)} add(%d, %d)
}
"""


def test_host_copies_inside_a_loop_body_are_not_counted_outside_the_loops():
  moved = schedule.host_copies_across_loops(_TPU_BODY_READ)
  assert moved["host-to-device"]["copies"] == 1, moved
  assert moved["host-to-device"]["outside_loops"] == 0, moved
  assert moved["host-to-device"]["across_loops"] == 0, moved
  assert moved["device-to-host"]["bytes_outside_loops"] == 64 * 256 * 4, moved


def _own_step(tx):
  """``value_and_grad`` + ``apply_gradients`` in one jit of the user's."""
  grad_fn = zerojax.value_and_grad(toy.loss_fn, tx)

  @jax.jit
  def step(state, batch):
    loss, grads = grad_fn(state, batch)
    return zerojax.apply_gradients(state, grads), {"loss": loss}

  return step


@pytest.mark.parametrize("how", ["train_step", "own_jit"])
def test_the_update_starts_after_every_gradient_exists(monkeypatch, how):
  """One barrier over all the reduced gradients between the backward pass
  and the update (a scheduler may not start any leaf's update early), in
  the train step and in a user's jit around the two halves, and the same
  numbers with or without it."""
  from zerojax._src.step import update as _update

  params = toy.init_params(jax.random.key(0))
  batch = toy.batches(1)[0]
  barriers = {}
  results = {}
  for wait in (True, False):
    monkeypatch.setattr(_update, "_GRADS_BEFORE_UPDATE", wait)
    tx = zerojax.zero(optax.adamw(1e-2), stage=3)
    state = zerojax.init(params, tx)
    if how == "train_step":
      step = zerojax.train_step(toy.loss_fn, tx)
    else:
      step = _own_step(tx)
    text = step.lower(state, batch).as_text()
    barriers[wait] = [
      line for line in text.splitlines() if "optimization_barrier" in line
    ]
    state, metrics = step(state, batch)
    results[wait] = jax.tree.map(np.asarray, (state.params, metrics["loss"]))
  assert len(barriers[True]) == len(barriers[False]) + 1
  # its operands: every trained leaf's gradient, none left out
  trained = [x for x in jax.tree.leaves(params) if x.dtype != jnp.int32]
  widest = lambda lines: max(
    (b.split("=", 1)[1].count("%") for b in lines), default=0
  )
  assert widest(barriers[True]) >= len(trained) > widest(barriers[False])
  jax.tree.map(np.testing.assert_array_equal, results[True], results[False])


# --- from test_checkpoint.py ------------------------------------------
def test_export_gathers_one_leaf_at_a_time(monkeypatch):
  params = {f"w{i}": jnp.full((64, 64), float(i)) for i in range(8)}
  tx = zerojax.zero(optax.adam(1e-2), stage=3, policy=checkpoint_BF16)
  state = zerojax.init(params, tx)
  del params
  baseline = sum(x.nbytes for x in jax.live_arrays())
  extra = []
  from zerojax._src.ckpt import export as impl  # where export_params looks

  real = impl.gather_leaf

  def watched(*a, **kw):
    out = real(*a, **kw)
    extra.append(sum(x.nbytes for x in jax.live_arrays()) - baseline)
    return out

  monkeypatch.setattr(impl, "gather_leaf", watched)
  full = checkpoint.export_params(state)
  leaf = 64 * 64 * 4  # one fp32 master leaf, unsharded
  assert len(extra) == 8
  # each gathered leaf is released before the next: live on the devices at
  # most one unsharded leaf (logical bytes), never the 8-leaf model
  assert max(extra) <= leaf, (max(extra), leaf)
  assert all(
    np.array_equal(full[f"w{i}"], np.full((64, 64), float(i))) for i in range(8)
  )


# --- from test_collectives.py -----------------------------------------
def test_stage0_sums_each_weight_gradient_before_autodiffs_transpose(mesh):
  """``x @ W``'s weight gradient is ``transpose(dot)``: the step sums the
  dot's output over the devices, then transposes, as GSPMD's all-reduce
  does (a sum after the transpose has XLA CPU fold it into the dot, which
  then runs on Eigen, not YNNPACK). The all-reduce carries ``W``'s
  gradient in the dot's shape, ``W`` transposed."""
  from zerojax._src.jaxpr import transposes

  tx = zerojax.zero(optax.adamw(1e-3), stage=0, mesh=mesh)
  state = zerojax.init(plain_params(), tx)
  step = zerojax.train_step(plain_loss, tx)
  traced = step.trace(state, BATCH).jaxpr
  assert transposes.count_sums_of_transposes(traced.jaxpr) == 0
  shapes = all_reduced_shapes(step.lower(state, BATCH).compile().as_text())
  assert (F, collectives_D) in shapes and (collectives_D, F) not in shapes

  # the same loss differentiated without the pass sums after the transposes
  # (the weight's, and the embedding's as the head)
  def local(params, batch):
    return jax.grad(lambda p: plain_loss(p, batch) / 8)(params)

  grads = jax.shard_map(
    local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
  )
  put = lambda x, spec: jax.device_put(
    x, jax.sharding.NamedSharding(mesh, spec)
  )
  plain = jax.make_jaxpr(grads)(put(plain_params(), P()), put(BATCH, P("data")))
  assert transposes.count_sums_of_transposes(plain.jaxpr) >= 1


def test_a_sum_moved_before_its_transpose_is_the_same_sum(mesh):
  """The pass moves a sum over devices ahead of the transpose feeding it,
  in scan bodies and checkpoints too, and leaves a transpose that has
  another use where it is; the numbers are the same to the bit, by
  design: a transpose only moves elements, and XLA CPU's all-reduce adds
  each element's 8 values in device order wherever the element sits in
  the buffer (a ring all-reduce on GPUs would not promise that)."""
  from zerojax._src.jaxpr import transposes

  x = jax.device_put(
    jax.random.normal(jax.random.key(2), (8 * 3, 5, 7)),
    jax.sharding.NamedSharding(mesh, P("data")),
  )

  def f(x):
    def body(c, xi):
      t = jax.checkpoint(lambda a: jax.lax.psum(a.T, "data"))(xi)
      return c + t, None

    looped, _ = jax.lax.scan(body, jnp.zeros((7, 5)), x)
    t = x[0].T
    kept = jax.lax.psum(t, "data") + t.sum()  # t has two uses: stays
    return looped, kept

  run = lambda fn: jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))
  )(x)
  want, got = run(f), run(transposes.rewrite_for_dots(f))
  for a, b in zip(want, got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = jax.make_jaxpr(
    jax.shard_map(
      transposes.rewrite_for_dots(f),
      mesh=mesh,
      in_specs=P("data"),
      out_specs=(P(), P("data")),
    )
  )(x)
  assert transposes.count_sums_of_transposes(moved.jaxpr) == 1  # kept's
  plain = jax.make_jaxpr(
    jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))
  )(x)
  assert transposes.count_sums_of_transposes(plain.jaxpr) == 2


@pytest.mark.parametrize("stage", [1, 3])
def test_stages_1_3_keep_autodiffs_transposes_out_of_the_dots(mesh, stage):
  """At stages 1-3 the gradient is reduce-scattered from a layout built out
  of the transposed cotangents; the step puts a barrier between each dot
  and the transpose of its output, so XLA CPU cannot fold them into one
  dot with transposed operands (Eigen's, not a YNNPACK fusion). Checked
  exactly on the traced program: no transposed dot with the barrier, some
  without. The barrier is the identity, but the two are different XLA
  programs (a dot with a transposed operand against a transpose and a
  dot), whose kernels may add a gradient's rows in another order on
  another processor: the steps agree up to that order (each weight
  gradient sums the batch's ``B`` rows)."""
  from zerojax._src.jaxpr import transposes

  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, mesh=mesh)
  step = zerojax.train_step(plain_loss, tx)
  state = zerojax.init(plain_params(), tx, copy=True)
  traced = step.trace(state, BATCH).jaxpr
  assert transposes.count_transposed_dots(traced.jaxpr) == 0
  plain = transposes.rewrite_for_dots
  try:  # the same step without the rewrite has such transposes
    transposes.rewrite_for_dots = lambda fn, **rules: fn
    bare = zerojax.train_step(plain_loss, tx)
    assert (
      transposes.count_transposed_dots(bare.trace(state, BATCH).jaxpr.jaxpr) > 0
    )
    want, _ = bare(zerojax.init(plain_params(), tx, copy=True), BATCH)
  finally:
    transposes.rewrite_for_dots = plain
  got, _ = step(state, BATCH)
  toy.assert_same_up_to_summation_order(
    zerojax.gather_params(got), zerojax.gather_params(want), terms=B
  )


# --- from test_layout.py ----------------------------------------------
@pytest.mark.parametrize(
  "shape,dim,padded",
  [
    ((3,), 0, 8),  # bias of 3: padded
    ((16,), 0, 16),
    ((7, 13), 1, 16),  # neither divides: least padding, last dim
    ((50257, 768), 1, 768),  # GPT-2 embedding: the divisible dim
    ((768, 50257), 1, 50264),  # never dim 0 of a matrix: pad the last
    ((4, 7, 12), 1, 8),  # least padding wins: 7->8 beats 12->16
    ((4, 64, 256), 1, 64),  # a tie: the major dimension
    ((8, 3, 5), 2, 8),  # stacked layers: never the layer axis
  ],
)
def test_plan_leaf(shape, dim, padded):
  layout = plan_leaf(shape, jnp.float32, 8, 0)
  assert (layout.dim, layout.padded) == (dim, padded)


@pytest.mark.parametrize(
  "shape,dtype,reason",
  [
    ((), jnp.float32, "scalar"),
    ((4,), jnp.int32, "not trained"),
    ((10, 10), jnp.float32, "min_shard_size"),
  ],
)
def test_replicated_leaves_say_why(shape, dtype, reason):
  layout = plan_leaf(shape, dtype, 8, 1000)
  assert not layout.sharded and reason in layout.reason


def test_pad_and_slice_round_trip():
  layout = plan_leaf((7, 13), jnp.float32, 8, 0)
  x = jnp.arange(91.0).reshape(7, 13)
  stored = layout.to_storage(x)
  assert stored.shape == (7, 16) and (stored[:, 13:] == 0).all()
  assert (layout.to_logical(stored) == x).all()


def test_init_sends_each_device_only_its_shard(mesh):
  """No device ever receives a full copy of a sharded leaf at init."""
  params = {"w": np.ones((64, 1024), np.float32)}
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  from zerojax._src.step import state as _state  # the init module, under test

  spec = zerojax.layout.make_spec(params, tx)
  placed = _state.place_leaf(params["w"], spec.leaves[0].shard, spec)
  assert {s.data.shape for s in placed.addressable_shards} == {(64, 128)}


# --- from test_memory.py ----------------------------------------------
@pytest.mark.parametrize(
  "stage,policy", [(0, "fp32"), (1, "fp32"), (3, "fp32"), (1, "bf16+master")]
)
def test_init_programs_write_only_what_the_state_keeps(mesh, stage, policy):
  """``zerojax.init_from``'s programs output the state's bytes per device
  and nothing more: a master copy only where the policy keeps one (an fp32
  state has none; a dropped output is a whole replicated params copy at
  stage 0, which a CPU process's allocator then keeps)."""
  import jax
  import jax.numpy as jnp

  from zerojax._src.step import init_from as state_lib

  pol = (
    zerojax.Policy()
    if policy == "fp32"
    else zerojax.Policy(param_dtype=jnp.bfloat16)
  )
  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, mesh=mesh, policy=pol)
  init = lambda k: toy.layered_params(4, memory_D, memory_V, key=k)
  key = jax.random.key(0)
  built = zerojax.init_from(init, tx, key)
  assert (built.master is None) == (policy == "fp32")
  per_device = sum(
    x.addressable_shards[0].data.nbytes
    for x in jax.tree.leaves((built.params, built.master, built.opt_state))
  )
  spec = zerojax.layout.make_spec(jax.eval_shape(init, key), tx)
  written, outputs = 0, 0
  for _, program in state_lib.init_programs(spec, init):
    compiled = program.lower(key).compile()
    written += compiled.memory_analysis().output_size_in_bytes
    outputs += len(jax.tree.leaves(compiled.output_shardings))
  # XLA counts the output tuple's table too: 8 bytes per output
  assert written - 8 * outputs == per_device, (written, outputs, per_device)


def test_stage0_init_draws_each_leaf_split_over_the_data_axis(mesh):
  """Stage 0's state is replicated, but its initialiser runs split over
  the data axis and is all-gathered: per device the init program's
  temporaries stay below one copy of the params (drawn replicated, every
  device holds its whole draw beside the output: 2.5x the params here)."""
  import jax

  from zerojax._src.step import init_from as state_lib

  tx = zerojax.zero(optax.adamw(1e-3), stage=0, mesh=mesh)
  init = lambda k: toy.layered_params(4, memory_D, memory_V, key=k)
  key = jax.random.key(0)
  spec = zerojax.layout.make_spec(jax.eval_shape(init, key), tx)
  [(_, program)] = state_lib.init_programs(spec, init)
  temp = program.lower(key).compile().memory_analysis().temp_size_in_bytes
  params = sum(
    x.size * x.dtype.itemsize
    for x in jax.tree.leaves(jax.eval_shape(init, key))
  )
  assert temp < params, (temp, params)


# --- from test_offload.py ---------------------------------------------
@pytest.mark.parametrize(
  "sizes,leaf_of",
  [
    ([91, 35, 147, 21, 3, 1], [0, 1, 2, 3, 4, 5]),
    ([5, 5, 9, 1, 1, 30], [0, 0, 1, 2, 2, 3]),
    ([64, 64, 48, 48, 16, 16, 1, 1], [0, 0, 1, 1, 2, 2, 3, 3]),
  ],
)
def test_every_share_the_rule_lists_is_reached_by_exactly_that_fraction(
  sizes, leaf_of
):
  """``ShareRule.reached`` (what the planner weighs, what the share
  warning names) lists shares ``ShareRule.chosen`` reaches exactly, and
  every share it reaches for a fine grid of fractions is listed."""
  rule = _host_memory.ShareRule.of(sizes, leaf_of)
  shares = rule.reached()
  held = lambda f: sum(sizes[i] for i in rule.chosen(f)) / sum(sizes)
  for share in shares:
    assert held(float(share)) == pytest.approx(share)
  for f in np.linspace(0.001, 0.999, 500):
    assert np.isclose(shares, held(float(f))).any(), f


def test_init_builds_the_offloaded_state_a_group_at_a_time_in_host_memory():
  from zerojax._src.step import state as _state  # the init module, under test

  init_fn = lambda key: {
    f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (16 * (i + 1), 64))
    for i in range(10)
  }
  tx = zerojax.zero(
    optax.adamw(1e-2), stage=3, offload=True, policy=offload_BF16
  )
  key = jax.random.key(0)
  spec = zerojax.layout.make_spec(jax.eval_shape(init_fn, key), tx)
  groups, owned = _state.build_plan(spec)
  assert len(groups) > 1
  assert sorted(j for o in owned for j in o) == list(
    range(len(spec.opt_leaves))
  )
  state = zerojax.init_from(init_fn, tx, key)
  total = zerojax.diagnostics.memory_bytes(state)
  outs = []
  for group, own in zip(groups, owned):
    stored = [
      jax.ShapeDtypeStruct(
        spec.leaves[i].shard.storage_shape,
        jnp.float32,
        sharding=spec.sharding(spec.leaves[i].shard),
      )
      for i in group
    ]
    hlo = (
      _state._build_jit(spec, tuple(group), tuple(own), (False,) * len(group))
      .lower(stored)
      .compile()
      .as_text()
    )
    outs.append(zerojax.diagnostics.entry_bytes_by_memory(hlo)["outputs"])
  # every program writes the master copy and optimizer state of its group
  # to host memory and only the group's params to the device; together
  # they are the state, and none holds more than an eighth of it plus a leaf
  assert sum(o.get("pinned_host", 0) for o in outs) == total["pinned_host"]
  assert sum(o.get("device", 0) for o in outs) == total["device"]
  biggest = max(r.size for r in spec.leaves) * 16 // 8  # one leaf's state
  for o in outs:
    assert 0 < sum(o.values()) <= sum(total.values()) / 8 + biggest, o
  # and the state is the one zerojax.init builds from the same params
  whole = zerojax.init(jax.jit(init_fn)(key), tx)
  toy.assert_same_arrays(state, whole)


# --- from test_per_layer.py -------------------------------------------
@pytest.mark.parametrize("stage", [1, 3])
def test_a_loss_the_walk_cannot_evaluate_takes_the_whole_tree_exactly(
  mesh, stage, monkeypatch
):
  """Where the per-layer walk fails inside zerojax (here: made to fail on
  every scan), the step takes the whole-tree path: the same numbers, and
  at stage 3 the warning that says it is zerojax's limitation."""
  from zerojax._src.jaxpr import layers

  def fail(self, eqn, sub, ins):
    raise layers.LayersUnreadable("a scan it cannot rebuild")

  monkeypatch.setattr(layers._Walker, "scan", fail)
  want, want_losses = toy.optax_run(
    checkpointed_scan, optax.adam(1e-2), _params(), _data()
  )
  got, losses, notes = _zero_run(checkpointed_scan, stage, mesh)
  _assert_equal(got, want, losses, want_losses)
  if stage == 1:
    assert not notes, notes
  else:
    assert len(notes) == 1 and "a scan it cannot rebuild" in notes[0], notes
    assert "limitation of zerojax" in notes[0]


# --- from test_real_losses.py -----------------------------------------
def test_a_callbacks_result_is_found_typed_the_same_on_every_device(mesh):
  """The check behind stage 0's fallback: a callback on the batch rows
  drops their axis from its result's type; a dot, a psum over the axis and
  a callback on replicated values do not count."""
  from jax.sharding import PartitionSpec as P

  from zerojax._src.jaxpr import varying

  auto = jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  found = {}

  def body(w, x):
    for name, f in {
      "callback": lambda w, x: _host_tanh(x) @ w,
      "plain": lambda w, x: jax.lax.psum(jnp.tanh(x) @ w, "data"),
      "replicated": lambda w, x: x @ _host_tanh(w),
    }.items():
      found[name] = varying.dropped_varying(
        jax.make_jaxpr(f)(w, x).jaxpr, ("data",)
      )
    return x

  jax.jit(
    jax.shard_map(
      body, mesh=auto, in_specs=(P(), P("data")), out_specs=P("data")
    )
  ).lower(jnp.ones((6, 3)), jnp.ones((16, 6)))
  assert found == {"callback": ["pure_callback"], "plain": [], "replicated": []}


# --- from test_zeropp.py ----------------------------------------------
def _bound(x, bits, block):
  """Per-element bound from each element's block absmax (flattened x)."""
  flat = np.asarray(x, np.float64).reshape(-1)
  nb = -(-flat.size // block)
  padded = np.zeros(nb * block)
  padded[: flat.size] = np.abs(flat)
  absmax = padded.reshape(nb, block).max(-1)
  return np.repeat(absmax, block)[: flat.size], _zeropp.qmax(bits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [2, 6, 256])
def test_dequantization_error_is_within_absmax_over_qmax_per_block(bits, block):
  rng = np.random.default_rng(0)
  # 1,001 values whose blocks span 1e-30 .. 1e30, an odd count (padding)
  x = (rng.standard_normal(1001) * 10.0 ** rng.uniform(-30, 30, 1001)).astype(
    np.float32
  )
  q, scale = _zeropp.quantize(jnp.asarray(x), bits, block)
  assert q.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
  assert q.shape[-1] == (block if bits == 8 else block // 2)
  y = np.asarray(_zeropp.dequantize(q, scale, bits, x.size), np.float64)
  absmax, qmax = _bound(x, bits, block)
  err = np.abs(y - x)
  assert np.all(np.isfinite(y))
  assert np.all(err <= absmax / qmax)  # the stated bound
  assert np.all(err <= absmax / (2 * qmax) * (1 + 1e-6) + 1e-45)  # rounding


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_within_one_step(bits):
  """Blocks of one large value and many small ones (below half a step):
  to nearest they all become 0; stochastically their mean survives, each
  within one step; zeros and the absmax stay exact."""
  rng = np.random.default_rng(0)
  step = 1.0 / _zeropp.qmax(bits)  # absmax 1 in every block
  small = (rng.uniform(0.2, 0.3, (64, 255)) * step).astype(np.float32)
  x = np.concatenate(
    [np.ones((64, 1), np.float32), small, np.zeros((64, 256), np.float32)], 1
  )
  near = np.asarray(
    _zeropp.dequantize(
      *_zeropp.quantize(jnp.asarray(x), bits, 256), bits, x.shape[1]
    )
  )
  q = _zeropp.quantize(jnp.asarray(x), bits, 256, stochastic=True)
  sto = np.asarray(_zeropp.dequantize(*q, bits, x.shape[1]))
  assert np.all(near[:, 1:256] == 0)
  assert np.all(np.abs(sto - x) < step)
  np.testing.assert_array_equal(sto[:, 256:], 0.0)
  np.testing.assert_array_equal(sto[:, 0], 1.0)
  # unbiased: the mean of 16,320 values (each rounded to 0 or one step)
  assert abs(sto[:, 1:256].mean() / small.mean() - 1) < 0.05
  # deterministic: the same input rounds the same way
  again = _zeropp.quantize(jnp.asarray(x), bits, 256, stochastic=True)
  assert all(np.array_equal(a, b) for a, b in zip(q, again))


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_and_repeated_blocks_dequantize_exactly(bits):
  x = jnp.concatenate(
    [jnp.zeros(16), jnp.full((16,), -3.7), jnp.full((5,), 1e-30)]
  )
  q, scale = _zeropp.quantize(x, bits, 16)
  y = _zeropp.dequantize(q, scale, bits, x.size)
  np.testing.assert_array_equal(np.asarray(y[:16]), 0.0)
  np.testing.assert_allclose(np.asarray(y[16:32]), -3.7, rtol=1e-7)
  np.testing.assert_allclose(np.asarray(y[32:]), 1e-30, rtol=1e-7)


@pytest.mark.parametrize("shape,dim", [((5, 13, 7), 1), ((3,), 0), ((9, 2), 0)])
def test_quantized_all_gather_equals_gather_within_bound(mesh, shape, dim):
  n = mesh.shape["data"]
  full_shape = list(shape)
  full_shape[dim] *= n
  x = jax.random.normal(jax.random.key(1), full_shape) * 10.0
  spec = P(*([None] * dim + ["data"]))
  f = jax.jit(
    jax.shard_map(
      lambda s: _zeropp.all_gather(s, "data", dim, 8, 6),
      mesh=mesh,
      in_specs=spec,
      out_specs=P(),
      check_vma=False,
    )
  )
  y = np.asarray(f(jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))))
  # the bound per shard block: each device quantized its own shard
  shards = np.split(np.asarray(x), n, axis=dim)
  ys = np.split(y, n, axis=dim)
  for s, t in zip(shards, ys):
    absmax, qmax = _bound(s, 8, _zeropp.block_for(s.size, 6))
    assert np.all(np.abs(t - s).reshape(-1) <= absmax / qmax)


@pytest.mark.parametrize(
  "stage,nodes",
  [
    (1, None),
    (2, None),
    (3, None),
    (3, dict(hpz_size=4)),
    (3, dict(hpz_size=2)),
    (1, dict(node_size=4)),
    (2, dict(node_size=2)),
  ],
  ids=[
    "stage1",
    "stage2",
    "stage3",
    "stage3-hpz4",
    "stage3-hpz2",
    "stage1-node4",
    "stage2-node2",
  ],
)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_reduce_scatter_spanning_magnitudes_zeros_and_equal_values(
  stage, nodes, bits
):
  """Flat (one all-to-all) and hierarchical (nodes known from hpZ or
  node_size: in-node, then across)."""
  n = 8
  rng = np.random.default_rng(stage)
  # "span": 256 values, each 16-block 1e-30 .. 1e30 (8 chunks of 32 = 2
  # blocks each); every device's row scaled differently
  mags = np.repeat(10.0 ** np.linspace(-30, 30, 16), 16)
  span = (rng.uniform(-1, 1, 256) * mags).astype(np.float32)
  rows = {
    "span": np.stack([span * (1 + 0.25 * i) for i in range(n)]),
    "zeros": np.zeros((n, 40), np.float32),
    # every device sends +127 for every element: a sum of int8 values
    # would overflow; dequantized first it is exact
    "equal": np.full((n, 24), 3.7, np.float32),
  }
  got = _one_sgd_step(
    stage,
    zerojax.ZeroPP(grad_bits=bits, block_size=16, **(nodes or {})),
    rows,
    tuple(rows),
  )
  exact = {k: v.astype(np.float64).mean(0) for k, v in rows.items()}
  np.testing.assert_array_equal(got["zeros"], 0.0)
  np.testing.assert_allclose(got["equal"], 3.7, rtol=1e-6)
  assert np.all(np.isfinite(got["span"]))
  # error of a mean of n dequantized values <= mean of their block bounds
  # (half of it from rounding once; hierarchical rounds twice: in-node
  # sums are requantized, and their absmax <= the sum of the k absmaxes)
  bound = np.mean([_bound(r, bits, 16)[0] for r in rows["span"]], axis=0)
  err = np.abs(got["span"] - exact["span"])
  assert np.all(err <= bound / _zeropp.qmax(bits) * (1 + 1e-5))
  # and it is a real quantization (not an exact reduce-scatter in disguise)
  assert np.any(err > 0)


def test_node_size_from_the_process_layout():
  """A node is a process: read from the mesh's devices along the data axis;
  unknown (0) when a process's devices are not one consecutive run."""
  import types

  def mesh(procs, names=("data",)):
    devs = np.vectorize(
      lambda p: types.SimpleNamespace(process_index=int(p)), otypes=[object]
    )(np.asarray(procs))
    return types.SimpleNamespace(
      axis_names=names, devices=devs, shape=dict(zip(names, devs.shape))
    )

  assert (
    _settings.process_node_size(mesh([0, 0, 0, 0, 1, 1, 1, 1]), "data") == 4
  )
  assert _settings.process_node_size(mesh([0] * 8), "data") == 8
  assert _settings.process_node_size(mesh([0, 1, 0, 1]), "data") == 0
  assert _settings.process_node_size(mesh([0, 0, 1, 1, 1, 1]), "data") == 0
  # data x model: each data line (per model index) is cut the same way
  dm = mesh([[0, 0], [0, 0], [1, 1], [1, 1]], ("data", "model"))
  assert _settings.process_node_size(dm, "data") == 2
  q = zerojax.ZeroPP(grad_bits=8)
  assert _settings.qgz_node_size(q, mesh([0, 0, 0, 0, 1, 1, 1, 1]), "data") == 4
  assert _settings.qgz_node_size(q, mesh([0] * 8), "data") == 0  # one node
  assert (
    _settings.qgz_node_size(
      zerojax.ZeroPP(grad_bits=8, node_size=2), mesh([0] * 8), "data"
    )
    == 2
  )


# --- from test_safetensors.py --------------------------------------------------
def test_each_process_reads_its_devices_rows_only(mesh, tmp_path, monkeypatch):
  """At stage 3 the files are read block by block, one device's block per
  copy: in all, each tensor's bytes once (the padding is not read), and no
  copy larger than a device's share of the largest leaf; stage 0
  replicates, so every device's block is the whole leaf."""
  from zerojax._src.ckpt import safetensors_io

  params = safetensors_params()
  save_file(hf_tensors(params), tmp_path / "model.safetensors")
  total = sum(v.nbytes for v in hf_tensors(params).values())
  copies = []
  real = safetensors_io._fill

  def fill(reader, m, inside, out):
    real(reader, m, inside, out)
    extent = [s.stop - s.start for s in inside]
    copies.append(int(np.prod(extent, dtype=np.int64)) * out.dtype.itemsize)

  monkeypatch.setattr(safetensors_io, "_fill", fill)
  largest = max(x.nbytes for x in jax.tree.leaves(params))
  for stage, factor in ((3, 1), (0, 8)):
    copies.clear()
    tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
    checkpoint.load_safetensors(
      tmp_path, tx, safetensors_template(), mapping=SAFETENSORS_MAPPING
    )
    # stage 3: the scalar and the int leaf are replicated (read per device)
    small = 8 * (4 + 16)
    assert sum(copies) <= total * factor + small, (stage, copies, total)
    assert sum(copies) >= total * factor, (stage, copies, total)
    if stage == 3:
      assert max(copies) <= -(-largest // 8) + 64, (copies, largest)


# --- from step/offload.py ----------------------------------------------
def test_streamed_chunk_loads_wait_for_the_chunk_the_device_has_room_after():
  """A chunk is loaded during the previous chunk's update (waits for the
  one before that) only if its old state fits beside the previous chunk's
  old and new within twice the largest chunk; else it waits for the
  previous chunk's stores. No chunk waits for new values unstored."""
  after, computed = _offload.default_waits([1, 1, 1, 4, 1])
  assert after == (None, None, 0, 1, 3)
  assert computed == (None,) * 5
  plan = _offload.Plan(((0,),) * 5, ((),) * 5, (), after, computed)
  assert (plan.prefetched, plan.crossing) == (3, 0)
  # equal chunks: a third beside one's old and new exceeds two: serial
  assert _offload.default_waits([1, 1, 1])[0] == (None, 0, 1)
  # on the device at once: a chunk old and new and, prefetched, the next
  # one's old: 2 + 4 before the large chunk, 8 during it (none prefetched)
  assert plan.in_flight([1, 1, 1, 4, 1]) == 8
  sizes = [1, 4, 1, 1]  # the large chunk prefetched after a small one
  ahead = _offload.Plan((), (), (), *_offload.default_waits(sizes))
  assert ahead.after == (None, None, 1, 1)
  assert ahead.in_flight(sizes) == 2 * 4


def test_a_crossing_stream_loads_each_serial_chunk_beside_the_last_ones_write_back():
  """The crossing stream: where the default waits for the previous
  chunk's stores, the loads wait for its new values and for the stores of
  the chunk before it; prefetched chunks are as in the default."""
  after, computed = _offload.crossing_waits([1, 1, 1, 4, 1])
  assert after == (None, None, 0, 1, 2)
  assert computed == (None, None, None, None, 3)
  plan = _offload.Plan(((0,),) * 5, ((),) * 5, (), after, computed)
  assert (plan.prefetched, plan.crossing) == (3, 1)
  # equal chunks: each comes down while the one before goes back, its new
  # state beside the next one's old: two chunks, as during an update
  after, computed = _offload.crossing_waits([1, 1, 1])
  assert (after, computed) == ((None, None, 0), (None, 0, 1))
  assert _offload.Plan((), (), (), after, computed).in_flight([1, 1, 1]) == 2
  # the large chunk's new state beside the next one's old: 4 + 1 < 8
  assert plan.in_flight([1, 1, 1, 4, 1]) == 8


def _row_probe(optimizer):
  """An optimizer's update over a layer stack ``(4, 3, 5)`` and a vector,
  flattened to ``(grads, state, params) -> (updates, new state)``, with
  its jaxpr, inputs and the stack's row inputs and outputs."""
  params = {
    "stack": jax.random.normal(jax.random.key(0), (4, 3, 5)),
    "vec": jnp.arange(3.0),
  }
  grads = jax.tree.map(lambda x: jnp.sin(x) + 0.5, params)
  state = optimizer.init(params)
  for _ in range(2):  # moments that are not zeros
    u, state = optimizer.update(grads, state, params)
  g, s, p = (jax.tree.leaves(t) for t in (grads, state, params))
  s_def = jax.tree.structure(state)

  def flat(*xs):
    gs, ss, ps = xs[:2], xs[2 : 2 + len(s)], xs[2 + len(s) :]
    tree = lambda ls: dict(zip(("stack", "vec"), ls))
    u, new = optimizer.update(
      tree(gs), jax.tree.unflatten(s_def, list(ss)), tree(ps)
    )
    return jax.tree.leaves(u) + jax.tree.leaves(new)

  args = [*g, *s, *p]
  stack_state = [2 + j for j, x in enumerate(s) if np.shape(x) == (4, 3, 5)]
  row_in = {2 + len(s)} | set(stack_state)
  # outputs: the two updates, then the new state in the same order
  row_out = [0] + stack_state
  return jax.make_jaxpr(flat)(*args), args, row_in, row_out, flat


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    lambda: optax.lion(1e-3),
    lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  ],
  ids=["clip+adamw", "lion", "sgd+nesterov"],
)
def test_rows_of_an_update_are_the_rows_of_the_whole_update(make):
  """Rows [a, b) of a stack's update and new state, computed from rows
  [a, b) of its weights and state (the gradients and the other leaves
  whole), have the bits of the same rows computed with all the rows.
  Against the optimizer's own compiled update they agree to an ulp: XLA's
  CPU compiler rewrites Adam's division by the bias correction (a scalar)
  one way or another depending on the program around it, as it does for
  any two programs holding the update (the training tests compare whole
  steps bit for bit)."""
  _assert_rows_are_the_whole_updates(*_row_probe(make()), rtol=2e-7)


def _assert_rows_are_the_whole_updates(
  closed, args, row_in, row_out, flat, *, rtol
):
  """Rows of the stack's outputs by :class:`Rows`: all of them within
  ``rtol`` of ``flat``'s, a few of them bit for bit those. Returns all."""
  program = _rows.Rows(closed, row_in, 4)
  assert _rows.OTHER not in program.roles(row_out)

  def rows(span):
    given = [
      x[span[0] : span[1]] if k in row_in else x for k, x in enumerate(args)
    ]
    return jax.jit(lambda *xs: program.evaluate(xs, span, row_out))(*given)

  every = rows((0, 4))
  whole = jax.jit(flat)(*args)
  for a, o in zip(every, row_out):
    np.testing.assert_allclose(a, whole[o], rtol=rtol, atol=0)
  for span in ((0, 1), (1, 3), (3, 4)):
    for a, b in zip(rows(span), every):
      np.testing.assert_array_equal(a, b[span[0] : span[1]])
  return every


@pytest.mark.parametrize("clip", [True, False], ids=["clip+adamw", "adamw"])
def test_rows_read_a_lazy_gradient_by_rows_where_the_update_does(clip):
  """A stack's gradient handed as a ``Lazy`` (whole, and a function for
  its rows: the streamed update slices before casting) gives the rows of
  the plain evaluation bit for bit, and Adam's moments take the chunk's
  rows from the function, once (clipping's norm reads the whole value)."""
  opt = optax.adamw(1e-2)
  if clip:
    opt = optax.chain(optax.clip_by_global_norm(0.5), opt)
  closed, args, row_in, row_out, _ = _row_probe(opt)
  program = _rows.Rows(closed, row_in, 4)
  k = next(i for i, x in enumerate(args) if np.shape(x) == (4, 3, 5))
  span = (1, 3)
  given = [x[1:3] if i in row_in else x for i, x in enumerate(args)]
  plain = jax.jit(lambda *xs: program.evaluate(xs, span, row_out))(*given)
  spans = []

  def rows(s):
    spans.append(s)
    return jax.lax.slice_in_dim(args[k], *s, axis=0)

  def run(*xs):
    xs = list(xs)
    xs[k] = _rows.Lazy(xs[k], rows)
    return program.evaluate(xs, span, row_out)

  got = jax.jit(run)(*given)
  for a, b in zip(got, plain):
    np.testing.assert_array_equal(a, b)
  assert spans == [span]


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.lamb(1e-2),
    lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
  ],
  ids=["lamb", "adafactor"],
)
def test_rows_refuse_an_update_that_reads_a_stack_whole(make):
  """A trust ratio over the whole stack or factored moments are not rows:
  the roles say so before anything runs, and evaluating raises."""
  closed, args, row_in, row_out, _ = _row_probe(make())
  program = _rows.Rows(closed, row_in, 4)
  assert _rows.OTHER in program.roles(row_out)
  given = [x[:2] if k in row_in else x for k, x in enumerate(args)]
  with pytest.raises(_rows.NotRows):
    program.evaluate(given, (0, 2), row_out)


# optimizers that choose every leaf's update in one branch over the state
BRANCHED = {
  "apply_if_finite": lambda: optax.apply_if_finite(optax.adamw(1e-2), 3),
  "apply_if_finite(clip+adamw)": lambda: optax.apply_if_finite(
    optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), 3
  ),
  "multisteps": lambda: optax.MultiSteps(optax.adamw(1e-2), 3),
}


@pytest.mark.parametrize(
  "name, finite",
  [
    ("apply_if_finite", True),
    ("apply_if_finite", False),
    ("apply_if_finite(clip+adamw)", True),
    ("multisteps", True),
  ],
)
def test_rows_through_a_branch_over_the_state_are_the_whole_updates_rows(
  name, finite
):
  """``apply_if_finite`` and ``MultiSteps`` choose every leaf's update in
  one ``cond``. A stack's rows of its outputs come from one ``lax.switch``
  over the branches, each computing them from the operands' rows: the
  rows of the evaluation with all the rows bit for bit, the whole update
  to a few ulps (XLA simplifies the two programs' branches apart), and
  through a non-finite step, which skips, the stored rows
  unchanged."""
  closed, args, row_in, row_out, flat = _row_probe(BRANCHED[name]())
  args = list(args)
  if not finite:  # the other leaf's gradient
    args[1] = args[1].at[0].set(jnp.nan)
  every = _assert_rows_are_the_whole_updates(
    closed, args, row_in, row_out, flat, rtol=1e-6
  )
  if not finite:
    np.testing.assert_array_equal(every[0], np.zeros((4, 3, 5)))
    for a, o in zip(every[1:], row_out[1:]):
      np.testing.assert_array_equal(a, args[o])


def _value_read_in_and_after_a_branch(w, g, s):
  """``h``, made from the free inputs, is read by rows inside a branch and
  after it; the second output's branch reads the row input whole."""
  h = g * s
  new = jax.lax.cond(jnp.all(jnp.isfinite(g)), lambda: w - h, lambda: w)
  other = jax.lax.cond(s > 0, lambda: w * jnp.sum(w), lambda: w)
  return new + h, other


def test_a_branch_reads_by_rows_what_was_computed_before_it():
  """What of an operand a branch reads is computed outside the switch and
  shared with the equations after it (under ``jit``: no value of a branch
  escapes it); a branch that reads a row input whole makes its output
  not rows, before anything runs, and evaluating it raises."""
  w = jax.random.normal(jax.random.key(1), (4, 3))
  g, s = jnp.cos(w), jnp.float32(0.5)
  closed = jax.make_jaxpr(_value_read_in_and_after_a_branch)(w, g, s)
  program = _rows.Rows(closed, {0}, 4)
  assert program.roles([0, 1]) == [_rows.ROW, _rows.OTHER]
  want = _value_read_in_and_after_a_branch(w, g, s)[0]
  for span in ((0, 4), (1, 3)):
    run = jax.jit(
      lambda w, g, s, span=span: program.evaluate([w, g, s], span, [0])
    )
    (got,) = run(w[span[0] : span[1]], g, s)
    np.testing.assert_array_equal(got, want[span[0] : span[1]])
  with pytest.raises(_rows.NotRows):
    program.evaluate([w[:2], g, s], (0, 2), [1])


def _branch_over_two_leaves(a, b, c, n):
  """A ``cond`` over every operand, each output reading some of them."""
  ok = jnp.all(jnp.isfinite(a)) & jnp.all(jnp.isfinite(b))
  return jax.lax.cond(
    ok | (n > 3),
    lambda x, y, z: (x * 2, y + z, 1.0),
    lambda x, y, z: (jnp.zeros_like(x), y, 0.0),
    a,
    b,
    c,
  )


def test_a_branch_is_read_per_output_and_cut_to_the_outputs_wanted():
  """Each output of a ``cond`` reads its index (here made from ``a``,
  ``b`` and ``n``) and what it reads in either branch; evaluated alone,
  under ``jit`` too, an output is the whole function's, and an operand it
  does not read need not be given."""
  args = (jnp.ones(3), jnp.arange(4.0), jnp.ones(4), jnp.int32(0))
  closed = jax.make_jaxpr(_branch_over_two_leaves)(*args)
  assert _deps.dependencies(closed) == [
    frozenset({0, 1, 3}),
    frozenset({0, 1, 2, 3}),
    frozenset({0, 1, 3}),
  ]
  flat = _cut.Flat(closed)
  want = _branch_over_two_leaves(*args)
  for k in range(3):
    (got,) = flat.evaluate(list(args), [flat.outs[k]])
    chex.assert_trees_all_equal(got, want[k])
  no_c = [args[0], args[1], None, args[3]]
  (got,) = flat.evaluate(no_c, [flat.outs[0]])
  np.testing.assert_array_equal(got, want[0])
  jitted = jax.jit(lambda *x: flat.evaluate(list(x), [flat.outs[1]]))
  np.testing.assert_array_equal(jitted(*args)[0], want[1])
  with pytest.raises(ValueError, match="input 2 read, not given"):
    flat.evaluate(no_c, [flat.outs[1]])


def _clipped_in_a_branch(a, b, n):
  """Two leaves clipped by their joint norm in the taken branch, which
  is itself in a branch when ``n > 1``."""

  def clip(x, y):
    s = jnp.sqrt(jnp.sum(x * x) + jnp.sum(y * y))
    return x / jnp.maximum(s, 1.0), y / jnp.maximum(s, 1.0)

  def inner(x, y):
    return jax.lax.cond(n > 1, clip, lambda x, y: (x * 2, y * 2), x, y)

  return jax.lax.cond(n > 0, inner, lambda x, y: (x, y), a, b)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_a_norm_in_a_branch_is_hoisted_before_it_and_cut_there(n):
  """A value a branch (here a branch in a branch) makes from both
  groups and both groups' outputs read is computed before the branches:
  the cut of the hoisted function holds it, so each output, given the
  cut's values, reads its own group only; the outputs are the
  function's, on every path."""
  args = (jnp.arange(3.0), jnp.full(4, 2.0), jnp.int32(n))
  closed = jax.make_jaxpr(_clipped_in_a_branch)(*args)
  groups, out_groups = [{0}, {1}], [0, 1]
  plain = _cut.find(_cut.Flat(closed), groups, out_groups)
  assert [_cut.Flat(closed).avals[v].shape for v in plain.values] == []
  hoisted = _cut.hoist(closed, groups, out_groups)
  flat = _cut.Flat(hoisted)
  c = _cut.find(flat, groups, out_groups)
  assert [flat.avals[v].shape for v in c.values] == [()]
  assert all(c.frontier)
  want = _clipped_in_a_branch(*args)
  values = flat.evaluate(list(args), c.values)
  given = dict(zip(c.values, values))
  for k, x in enumerate(args[:2]):
    only = [x if j == k else None for j in range(2)] + [args[2]]
    (got,) = flat.evaluate(only, [flat.outs[k]], given)
    np.testing.assert_allclose(got, want[k], rtol=1e-6)


def _finite_after_a_clip(a, b):
  """Two leaves clipped by their joint norm, then kept where both clipped
  leaves are finite (``chain(clip_by_global_norm, apply_if_finite)``)."""
  s = 1.0 / jnp.maximum(jnp.sqrt(jnp.sum(a * a) + jnp.sum(b * b)), 1.0)
  x, y = a * s, b * s
  ok = jnp.all(jnp.isfinite(x)) & jnp.all(jnp.isfinite(y))
  return jax.lax.cond(ok, lambda: (x, y), lambda: (a * 0, b * 0))


def test_a_cut_made_from_gradient_sized_values_is_computed_in_two_passes(
  monkeypatch,
):
  """The finiteness of clipped leaves reads each leaf times the norm of
  both: the cut found first holds values the size of a leaf. In passes,
  the first computes the norm's scalars from each leaf's sum of squares,
  the second, given them, each clipped leaf's finiteness (one scalar a
  leaf); given both, each output reads its own leaf only and is the
  function's (the index reads no leaf: its values are given)."""
  args = (jnp.arange(300.0).reshape(3, 100), jnp.full((3, 100), 2.0))
  flat = _cut.Flat(jax.make_jaxpr(_finite_after_a_clip)(*args))
  groups, out_groups = [{0}, {1}], [0, 1]
  monkeypatch.setattr(_cut, "LIMIT", 50)  # a leaf's 300 elements are large
  assert _cut.too_large(_cut.find(flat, groups, out_groups))
  first, second = _cut.passes(flat, groups, out_groups)
  assert all(flat.size(v) == 1 for c in (first, second) for v in c.values)
  assert all(
    flat.size(v) == 1 for c in (first, second) for f in c.frontier for v in f
  )
  given = {}
  for c in (first, second):
    for k in range(2):
      only = [x if j == k else None for j, x in enumerate(args)]
      given.update(
        zip(c.frontier[k], flat.evaluate(only, c.frontier[k], given))
      )
    given.update(zip(c.values, flat.evaluate([None, None], c.values, given)))
  want = _finite_after_a_clip(*args)
  for k in range(2):
    only = [x if j == k else None for j, x in enumerate(args)]
    (got,) = flat.evaluate(only, [flat.outs[k]], given)
    np.testing.assert_allclose(got, want[k], rtol=1e-6)


@pytest.mark.parametrize(
  "stage, params_host", [(1, False), (3, False), (3, True)]
)
def test_a_crossing_stream_trains_bitwise_equal_to_the_default(
  monkeypatch, stage, params_host
):
  """The crossing stream runs the same chunk updates behind other waits:
  after three steps of clip + AdamW (bf16 params, fp32 master in host
  memory, at stage 3 the params' shards there too or not) the state has
  the default stream's bits, and the report counts the chunks that
  cross."""
  opt = lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))
  results, reports, barriers = {}, {}, {}
  for name, waits in (
    ("default", _offload.default_waits),
    ("crossing", _offload.crossing_waits),
  ):
    monkeypatch.setattr(_offload, "_waits", waits)
    jax.clear_caches()  # compiled steps are cached by config (see by_rows)
    tx = zerojax.zero(
      opt(),
      stage=stage,
      offload=True,
      offload_params=params_host,
      policy=offload_BF16,
    )
    state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
    step = zerojax.train_step(toy.loss_fn, tx)
    batches = toy.batches(3)
    reports[name] = zerojax.report(step, state, batches[0]).offload
    # the barriers' operands: each crossing chunk's loads also hold the
    # previous chunk's new values
    barriers[name] = sum(
      line.split("=", 1)[1].count("%")
      for line in step.lower(state, batches[0]).as_text().splitlines()
      if "optimization_barrier" in line
    )
    for b in batches:
      state, _ = step(state, b)
    results[name] = [
      np.asarray(x)
      for x in jax.tree.leaves((state.params, state.master, state.opt_state))
    ]
  assert reports["default"]["crossing"] == 0
  assert reports["crossing"]["crossing"] > 0
  assert reports["crossing"]["chunks"] == reports["default"]["chunks"]
  assert barriers["crossing"] > barriers["default"], barriers
  jax.tree.map(
    np.testing.assert_array_equal, results["crossing"], results["default"]
  )
  jax.clear_caches()


# --- layer stacks streamed a few rows per chunk ----------------------------
@pytest.fixture
def by_rows(monkeypatch):
  """The stream with layer stacks split by rows (not the default); yields
  the plans the steps streamed by (the report's among them)."""
  # compiled steps are cached by their config, which the switch is not
  # part of: none compiled before (or with) it is reused across it
  jax.clear_caches()
  monkeypatch.setattr(_offload, "_by_rows", True)
  plans, plan = [], _offload.plan

  def recording(*args, **kw):
    out = plan(*args, **kw)
    plans.append(out[0])
    return out

  monkeypatch.setattr(_offload, "plan", recording)
  yield plans
  jax.clear_caches()


ROW_OPTIMIZERS = {
  "clip+adamw": lambda: optax.chain(
    optax.clip_by_global_norm(0.1), optax.adamw(3e-3)
  ),
  "lion": lambda: optax.lion(1e-3),
  "sgd+momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  # these read a stack whole (trust ratio, factored moments): whole leaves
  "lamb": lambda: optax.lamb(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}


def _gpt_run(
  optimizer, stage, off, mesh=None, policy=offload_BF16, steps=3, **kw
):
  """``steps`` steps of a 16-layer reference GPT (scanned stacks); returns
  the state's leaves, the losses and the offload report."""
  from zerojax.app import data, gpt

  model = gpt.GPTConfig(width=32, depth=16, heads=2, seq_len=32)
  tokens, _ = data.split(data.corpus_bytes())
  loss_fn = functools.partial(gpt.loss, config=model)
  tx = zerojax.zero(
    optimizer,
    stage=stage,
    mesh=mesh,
    policy=policy,
    offload=off,
    stacked=gpt.is_layer_stack,
    **kw,
  )
  state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
  step = zerojax.train_step(loss_fn, tx)
  batch = lambda i: data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=32)
  rep = zerojax.report(step, state, batch(0)) if off else None
  losses = []
  for i in range(steps):
    state, m = step(state, batch(i))
    losses.append(m["loss"])
  return _offload_leaves(state), losses, rep


# The stream by rows is not the default: the default suite (run at both
# ends of the JAX window) streams one case of each kind, rows and whole
# stacks; the slow suite the rest.
_ROWS_IN_DEFAULT = {(3, "clip+adamw"), (1, "adafactor")}


@pytest.mark.parametrize(
  "stage,name",
  [
    pytest.param(
      stage,
      name,
      marks=() if (stage, name) in _ROWS_IN_DEFAULT else pytest.mark.slow,
      id=f"{stage}-{name}",
    )
    for stage in (1, 3)
    for name in sorted(ROW_OPTIMIZERS)
  ],
)
def test_layer_stacks_stream_by_rows_bitwise_equal_to_no_offload(
  stage, name, by_rows
):
  """A stack larger than a chunk is updated a few layers per chunk, its
  rows read from and written back into the host buffers: the same bits as
  no offload. Updates that read a stack whole stream it whole."""
  opt = ROW_OPTIMIZERS[name]
  plain, plain_losses, _ = _gpt_run(opt(), stage, False)
  leaves, losses, rep = _gpt_run(opt(), stage, True)
  plans, by_rows = by_rows, rep.offload["stacks_by_rows"]
  if name in ("lamb", "adafactor"):
    assert by_rows == 0
  else:
    # the MLP and attention stacks each exceed a chunk's sixteenth
    assert by_rows >= 3
    assert rep.offload["chunks"] > 16
    assert rep.offload["largest_chunk_fraction"] < 1 / 8
    assert f"{by_rows} layer stacks a few layers per chunk" in str(rep)
    # some chunk ends one stack and begins the next: each reads only its own
    spans = [
      sum(1 for x in p.rows_of(k) if x)
      for p in plans
      for k in range(len(p.chunks))
    ]
    assert max(spans) >= 2
  chex.assert_trees_all_equal(leaves, plain)
  chex.assert_trees_all_equal(losses, plain_losses)


# more elementwise updates, read from outside the suite's own optimizers:
# by rows they give the same bits as no offload
ROW_OPTIMIZERS_MORE = {
  "adamw-masked": lambda: optax.adamw(
    3e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  ),
  "amsgrad": lambda: optax.amsgrad(1e-3),
  "schedule-free": lambda: optax.contrib.schedule_free_adamw(1e-3),
  "noise+adam": lambda: optax.chain(
    optax.add_noise(0.01, 0.55, 0), optax.adam(1e-3)
  ),
  # fp32 params, no master copy: the update writes the params' rows
  "clip+adamw-fp32": lambda: optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(3e-3)
  ),
  "nadamw": lambda: optax.nadamw(1e-3),
  "adan": lambda: optax.adan(1e-3),
  "adabelief": lambda: optax.adabelief(1e-3),
  "inject-adamw": lambda: optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax.linear_schedule(1e-3, 3e-3, 10)
  ),
}


def _more_run(name, off, steps=3, fp32=False):
  """Stage 3 with the named optimizer; fp32 params without a master copy
  where the name ends in ``-fp32`` or ``fp32`` is set."""
  kw = {"policy": zerojax.Policy()} if fp32 or name.endswith("-fp32") else {}
  return _gpt_run(ROW_OPTIMIZERS_MORE[name](), 3, off, steps=steps, **kw)


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=() if n == "adamw-masked" else pytest.mark.slow)
    for n in sorted(ROW_OPTIMIZERS_MORE)
  ],
)
def test_more_elementwise_optimizers_stream_stacks_by_rows_exactly(
  name, by_rows
):
  """Stage 3: every layer stack streams by rows, and the state after three
  steps is bit for bit no offload's (compiled as the suite compiles: no
  multiply-add contraction, conftest's XLA flags)."""
  plain, plain_losses, _ = _more_run(name, False)
  leaves, losses, rep = _more_run(name, True)
  # the four matrix stacks (qkv, proj, fc1, fc2)
  assert rep.offload["stacks_by_rows"] == 4, rep.offload
  chex.assert_trees_all_equal(leaves, plain)
  chex.assert_trees_all_equal(losses, plain_losses)


# run with XLA's default CPU flags (the suite's are conftest's)
_CONTRACTED = """
import json, sys
import jax, numpy as np
from tests import test_engine as t
from zerojax._src.step import offload
out = {}
for name in sys.argv[1:]:
  run = lambda off, steps=2: t._more_run(name, off, steps=steps, fp32=True)
  plain, plain_losses, _ = run(False)
  rows, losses, rep = run(True)
  start, _, _ = run(True, 0)
  jax.clear_caches()
  offload._by_rows = False
  whole, _, _ = run(True)
  offload._by_rows = True
  jax.clear_caches()
  f = lambda ts: [np.asarray(x, np.float64) for x in ts]
  off = lambda got: max(
    float(np.max(np.abs(x - y), initial=0.0) / max(np.max(np.abs(y - x0),
      initial=0.0), 1e-30))
    for x, y, x0 in zip(f(got), f(plain), f(start))
  )
  out[name] = {
    "by_rows": rep.offload["stacks_by_rows"],
    "rows_bitwise": all(np.array_equal(x, y) for x, y in zip(rows, plain)),
    "whole_bitwise": all(np.array_equal(x, y) for x, y in zip(whole, plain)),
    "rows_off_of_change": off(rows),
    "whole_off_of_change": off(whole),
    "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(
      map(float, losses), map(float, plain_losses))),
  }
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_by_rows_with_multiply_adds_contracted_is_within_rounding():
  """With XLA's default CPU flags (LLVM contracts multiply-adds to FMA
  instructions), the compiler fuses the row program apart from the whole
  update and may round the two differently: on 8 devices, clip + AdamW
  with an fp32 master copy (a global norm, bias corrections and the
  master's cast; the other row optimizers run in the matrices above), by
  rows the state after two steps is within 1e-3 of each leaf's change of no
  offload's (a row computed from another row, or a wrong bias correction,
  is off by the change itself), the losses within 1e-6, and whole stacks
  stay bitwise."""
  import os
  import subprocess
  import sys

  devices = 8
  env = {
    **os.environ,
    "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    "JAX_PLATFORMS": "cpu",
  }
  names = ["clip+adamw-fp32"]
  proc = subprocess.run(
    [sys.executable, "-c", _CONTRACTED, *names],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  result = json.loads(line.split(" ", 1)[1])
  for name in names:
    r = result[name]
    assert r["by_rows"] == 4, r
    assert r["whole_bitwise"], r
    assert r["whole_off_of_change"] <= 1e-3, r
    assert r["rows_off_of_change"] <= 1e-3, r
    assert r["loss_rel"] <= 1e-6, r


@pytest.mark.parametrize(
  "kw",
  [
    {"policy": zerojax.Policy(), "stage": 2},
    {"policy": offload_BF16, "stage": 3, "offload_params": True},
  ],
  ids=["fp32-stage2", "params-on-host"],
)
@pytest.mark.slow
def test_stacks_by_rows_without_master_and_with_params_on_host(kw, by_rows):
  """Without a master copy the rows are the params' (stages 1-2: gathered
  after the update); with the params on the host their rows are written
  back into the host buffers too."""
  kw = dict(kw)
  policy, stage = kw.pop("policy"), kw.pop("stage")
  opt = ROW_OPTIMIZERS["clip+adamw"]
  plain, _, _ = _gpt_run(opt(), stage, False, policy=policy, **kw)
  leaves, _, rep = _gpt_run(opt(), stage, True, policy=policy, **kw)
  assert rep.offload["stacks_by_rows"] >= 3
  chex.assert_trees_all_equal(leaves, plain)


@pytest.mark.slow
def test_stacks_by_rows_on_both_axis_types(any_mesh, by_rows):
  opt = ROW_OPTIMIZERS["clip+adamw"]
  plain, _, _ = _gpt_run(opt(), 3, False, mesh=any_mesh)
  leaves, _, rep = _gpt_run(opt(), 3, True, mesh=any_mesh)
  assert rep.offload["stacks_by_rows"] >= 3
  chex.assert_trees_all_equal(leaves, plain)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["apply_if_finite", "multisteps"])
def test_stacks_under_a_branch_over_the_state_stream_by_rows(name, by_rows):
  """Behind ``apply_if_finite`` or inside ``MultiSteps`` (one branch over
  the whole state) the GPT's four matrix stacks stream a few layers per
  chunk, as under plain AdamW: after four steps (fp32 params, MultiSteps
  updating at the third) every leaf is within 1e-3 of its change of no
  offload's (a row computed from another row is off by the change
  itself), and the losses agree to 1e-6. Not bitwise: the branch cut to
  a stack's rows is simplified apart from the whole one."""
  opt, policy = BRANCHED[name], zerojax.Policy()
  plain, plain_losses, _ = _gpt_run(opt(), 3, False, policy=policy, steps=4)
  start, _, _ = _gpt_run(opt(), 3, False, policy=policy, steps=0)
  leaves, losses, rep = _gpt_run(opt(), 3, True, policy=policy, steps=4)
  assert rep.offload["stacks_by_rows"] == 4, rep.offload
  assert rep.offload["largest_chunk_fraction"] < 1 / 8, rep.offload
  for x, y, x0 in zip(leaves, plain, start):
    x, y, x0 = (np.asarray(t, np.float64) for t in (x, y, x0))
    change = np.max(np.abs(y - x0), initial=0.0)
    assert np.max(np.abs(x - y), initial=0.0) <= 1e-3 * change
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)


def test_a_stack_whose_update_changes_mesh_types_streams_whole(by_rows):
  """An extra argument typed on the caller's Explicit mesh runs on the
  caller's axis types (a change of sharding type in the update's jaxpr):
  no row of the stack is computed across it, so the stack streams whole,
  with the numbers of no offload. The same update without it goes by
  rows."""
  plans = by_rows

  def init(params):
    return optax.EmptyState()

  def update(grads, state, params=None, *, scale_fn, **_):
    return jax.tree.map(lambda g: -0.1 * scale_fn(g), grads), state

  scaled = optax.chain(
    optax.GradientTransformationExtraArgs(init, update), optax.scale_by_adam()
  )
  for inner, split in ((scaled, False), (optax.adam(1e-2), True)):
    outs = []
    for off in (False, True):
      plans.clear()
      tx = zerojax.zero(inner, stage=3, offload=off, policy=offload_BF16)
      state = zerojax.init(toy.init_params(jax.random.key(0)), tx)
      _, grads = zerojax.value_and_grad(toy.loss_fn, tx)(
        state, toy.batches(1)[0]
      )
      extra = {"scale_fn": lambda g: 2 * g} if inner is scaled else {}
      outs.append(zerojax.apply_gradients(state, grads, **extra))
    assert plans and all(p is not None for p in plans)
    by = any(x for p in plans for r in p.rows for x in r)
    assert by == split
    chex.assert_trees_all_equal(
      _offload_leaves(outs[1]), _offload_leaves(outs[0])
    )


def test_the_dropin_streams_stacks_by_rows_as_whole_leaves(monkeypatch):
  """Through the Optax drop-in (updates out, no stored params to write
  into) a stack's rows are concatenated: the same updates and state as the
  whole-leaf stream, bit for bit."""
  params = toy.init_params(jax.random.key(0))
  grads = jax.grad(toy.loss_fn, allow_int=True)(params, toy.batches(1)[0])
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
  outs, plans, plan = [], [], _offload.plan

  def recording(*args, **kw):
    out = plan(*args, **kw)
    plans.append(out[0])
    return out

  monkeypatch.setattr(_offload, "plan", recording)
  for rows in (False, True):
    monkeypatch.setattr(_offload, "_by_rows", rows)
    jax.clear_caches()  # compiled updates are cached by config (see by_rows)
    plans.clear()
    tx = zerojax.zero(inner, stage=1, offload=True)
    opt = tx.init(params)
    for _ in range(2):
      updates, opt = tx.update(grads, opt, params)
    outs.append((updates, opt))
    assert plans and all(p is not None for p in plans)
    assert any(x for p in plans for r in p.rows for x in r) == rows
  chex.assert_trees_all_equal(outs[1], outs[0])


# --- the least host share a device needs (diagnostics/offload_share.py) --
def _share_by_loop(sizes, trainable, fraction):
  """``offload=fraction``'s rule written as a loop: the largest trained
  leaves while below the share, then the smallest that reaches it."""
  target = fraction * sum(sizes) * (1 - 1e-12)
  order = sorted(
    (i for i, t in enumerate(trainable) if t), key=lambda i: (-sizes[i], i)
  )
  held, k = 0, 0
  while k < len(order) and held + sizes[order[k]] < target:
    held += sizes[order[k]]
    k += 1
  rest = [i for i in order[k:] if held + sizes[i] >= target]
  if not rest:
    return set(order)
  return {*order[:k], min(rest, key=lambda i: (sizes[i], i))}


def test_the_share_rule_for_many_shares_at_once_is_the_rule_for_one():
  """The planner weighs many shares at once with zero's rule; on leaves of
  tied, zero and frozen sizes, at random shares and at each share a
  prefix of the leaves reaches exactly, it picks the leaves the rule does."""
  rng = np.random.default_rng(0)
  checked = 0
  for _ in range(400):
    n = int(rng.integers(1, 12))
    sizes = [int(x) for x in rng.choice([0, 1, 2, 3, 5, 8, 100, 10**6], n)]
    trainable = [bool(x) for x in rng.random(n) < 0.8]
    total = sum(sizes)
    if not total:
      continue
    fractions = [*rng.random(4), *(sum(sizes[:j]) / total for j in range(n))]
    for f in (f for f in fractions if 0 < f < 1):
      got = _host_memory.ShareChoice.of(sizes, trainable).pick(f)
      assert got == _share_by_loop(sizes, trainable, f), (sizes, trainable, f)
      checked += 1
  assert checked > 1000


def test_a_share_is_met_with_the_fewer_bytes_of_arrays_and_whole_leaves():
  """zero's rule over arrays grouped in leaves picks whichever of the rule
  over the arrays and over whole leaves keeps fewer bytes on the host
  (whole leaves on a tie): never more than either alone. Two equal
  moments per leaf: a 0.05 share of fp32 AdamW's moments on the GPU
  bench's GPT (per layer 1, 3, 4 and 4 width-squared matrices, so 24
  arrays of 1 to 4) is the smallest leaf's two moments (2/24), not the
  next leaf's first moment (3/24)."""
  rng = np.random.default_rng(1)
  checked = 0
  for _ in range(300):
    n = int(rng.integers(1, 8))
    per = [int(rng.integers(1, 4)) for _ in range(n)]
    leaf_of = [i for i, k in enumerate(per) for _ in range(k)]
    sizes = [int(x) for x in rng.choice([0, 1, 2, 3, 5, 8, 100], len(leaf_of))]
    total = sum(sizes)
    if not total:
      continue
    whole = [sum(s for s, g in zip(sizes, leaf_of) if g == i) for i in range(n)]
    rule = _host_memory.ShareRule.of(sizes, leaf_of)
    for f in (f for f in rng.random(6) if 0 < f < 1):
      by_array = _share_by_loop(sizes, [True] * len(sizes), f)
      by_leaf = _share_by_loop(whole, [True] * n, f)
      by_leaf = {i for i, g in enumerate(leaf_of) if g in by_leaf}
      bytes_of = lambda chosen: sum(sizes[i] for i in chosen)
      want = by_leaf if bytes_of(by_leaf) <= bytes_of(by_array) else by_array
      assert rule.chosen(f) == want, (sizes, leaf_of, f)
      checked += 1
  assert checked > 1000
  bench = _host_memory.ShareRule.of(
    [1, 1, 3, 3, 4, 4, 4, 4], [0, 0, 1, 1, 2, 2, 3, 3]
  )
  assert _rule_share(bench, 0.05) == pytest.approx(2 / 24)
  assert _rule_share(
    _host_memory.ShareRule.of(bench.sizes, range(8)), 0.05
  ) == (pytest.approx(3 / 24))


def _rule_share(rule, f):
  return sum(rule.sizes[i] for i in rule.chosen(f)) / sum(rule.sizes)


def _unscanned(layers, width=64):
  """An unscanned transformer's abstract params: per layer four matrices
  and two vectors, and an embedding."""
  a = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  w = width
  return {
    f"layer{i}": {
      "qkv": a(w, 3 * w),
      "proj": a(w, w),
      "fc1": a(w, 4 * w),
      "fc2": a(4 * w, w),
      "ln": a(w),
      "bias": a(4 * w),
    }
    for i in range(layers)
  } | {"embed": a(1000, w)}


@pytest.mark.parametrize("stage", [1, 3])
def test_the_planners_bound_of_each_share_is_below_its_working_set(stage):
  """Each share zero reaches gets a lower bound of its device working set
  before it is planned: at most the plan's, and at least what stays on the
  device (the plan's less the streamed update's transient)."""
  abstract = _unscanned(3)
  shares, least = offload_share.share_candidates(
    abstract, stage, 8, policy=offload_BF16
  )
  assert len(shares) > 10 and shares[-1] == 1.0
  for f, bound in zip(shares, least):
    p = zerojax.cost.plan_stage(
      abstract, stage, 8, offload=float(f), policy=offload_BF16
    )
    slack = 1e-9 * p.total
    assert p.working_set - p.update_transient - slack <= bound, f
    assert bound <= p.working_set + slack, f


def test_the_planners_bound_of_a_share_met_with_whole_leaves_is_below_its_working_set():
  """Without a master copy (two equal moments per leaf) some shares are
  met with whole leaves, not arrays; the bound the planner gives each of
  those is priced from whole leaves: between the plan's resident part and
  its working set."""
  abstract = _unscanned(2)
  shares, least = offload_share.share_candidates(abstract, 3, 8)
  spec = plan_spec(abstract, 3, 8, offload=True)
  units = _host_memory.share_units(spec.leaves, spec.opt_leaves, False)
  rule = _host_memory.ShareRule.of(
    [u.size for u in units], [u.leaf for u in units]
  )
  by_arrays = rule.arrays.reached()
  leaves = [
    (f, b)
    for f, b in zip(shares, least)
    if f < 1 and not np.isclose(by_arrays, f).any()
  ]
  assert len(leaves) >= 3, shares
  for f, bound in leaves[:6]:
    p = zerojax.cost.plan_stage(abstract, 3, 8, offload=float(f))
    slack = 1e-9 * p.total
    assert p.working_set - p.update_transient - slack <= bound, f
    assert bound <= p.working_set + slack, f


def test_the_least_share_of_a_model_of_many_leaves_takes_a_few_plans(
  monkeypatch,
):
  """An unscanned model has many leaves and so many shares; the planner
  plans only those whose bound fits, and names the least share that fits
  (the one planning every share from the least names)."""
  abstract = _unscanned(4)
  plan = lambda f: zerojax.cost.plan_stage(abstract, 3, 8, offload=f)
  none, full = plan(False), plan(True)
  memory = (none.working_set + full.working_set) / 2
  shares, _ = offload_share.share_candidates(abstract, 3, 8)
  every = next(float(f) for f in shares if plan(float(f)).working_set <= memory)
  planned = []
  real = offload_share.plan_stage

  def counted(*args, **kw):
    planned.append(kw.get("offload"))
    return real(*args, **kw)

  monkeypatch.setattr(offload_share, "plan_stage", counted)
  assert zerojax.cost.offload_fraction_needed(abstract, 3, memory, 8) == every
  assert len(shares) > 40
  # no offload, everything offloaded (the bound's prices), then the shares
  assert len(planned) <= 5, planned


# --- from test_offload.py: the planner keeps the update's trace --------
def test_the_planner_traces_a_models_update_once_for_every_share(
  mesh, monkeypatch
):
  """Weighing shares of one model (``offload_fraction_needed``) traces its
  update once: within ``traces_kept`` each share's plan equals the plan
  traced afresh, and a spec that differs in more than placements (another
  optimizer object with the same state, another stage or model) is
  traced anew, not handed a trace of another program."""
  traced = []
  real = _deps.trace
  monkeypatch.setattr(_deps, "trace", lambda *a: traced.append(1) or real(*a))
  abstract = jax.eval_shape(
    lambda: toy.init_params(jax.random.key(0), width=32, layers=6)
  )
  adam = optax.adam(1e-2)

  def coupled_update(g, s, p=None):
    # each leaf's update reads every leaf's state: not streamed by chunks
    u, s = adam.update(g, s, p)
    total = sum(jnp.sum(x) for x in jax.tree.leaves(s[0].mu))
    return jax.tree.map(lambda x: x + 0 * total, u), s

  coupled = optax.GradientTransformation(adam.init, coupled_update)
  shares = (0.06, 0.3, 0.5, 0.8, True)
  txs = [
    zerojax.zero(opt, stage=stage, mesh=mesh, policy=offload_BF16)
    for opt in (adam, coupled)
    for stage in (1, 3)
  ]
  plan = lambda tx, s: zerojax.cost.plan_stage(abstract, tx=tx, offload=s)
  fresh = [[plan(tx, s) for s in shares] for tx in txs]
  assert len(traced) >= len(txs) * len(shares)
  assert fresh[0][-1].update_transient < fresh[2][-1].update_transient
  del traced[:]
  with _offload_trace.traces_kept():
    kept = [[plan(tx, s) for s in shares] for tx in txs]
    assert len(traced) == len(txs)
    # another model of the same tree
    other = jax.eval_shape(
      lambda: toy.init_params(jax.random.key(0), width=16, layers=6)
    )
    assert zerojax.cost.plan_stage(
      other, tx=txs[0], offload=0.5
    ) == zerojax.cost.plan_stage(other, tx=txs[0], offload=0.5)
    assert len(traced) == len(txs) + 1
  assert kept == fresh
  # the planner's search keeps them: one trace per model and stage
  del traced[:]
  full = plan(txs[1], True)
  memory = (plan(txs[1], False).working_set + full.working_set) / 2
  n = len(traced)
  share = zerojax.cost.offload_fraction_needed(
    abstract, memory_bytes=memory, tx=txs[1]
  )
  assert 0.0 < share < 1.0 and len(traced) - n == 1
