"""Compiling for a target this process does not hold (zerojax.aot), on CPU.

The TPU compiler is not part of the test environment; the compiles for
TPU topologies live in ``experiments/tpu_compile.py``. Here: the errors a
user meets without it, the report of a compiled step, and the schedule
reader on the program forms each backend writes.
"""

import importlib.util

import jax
import numpy as np
import optax
import pytest

import zerojax
from tests import toy
from zerojax import aot

D, V, B = 32, 64, 64


def test_a_topology_without_the_tpu_compiler_or_unknown_names_the_fix():
  if importlib.util.find_spec("libtpu") is None:
    with pytest.raises(ValueError, match=r"pip install 'zerojax\[tpu\]'"):
      aot.topology_mesh("v5e:2x2")
  else:
    with pytest.raises(
      ValueError, match=r"does not know TPU topology 'v9z:1x1'.*'v5p:2x2x2'"
    ):
      aot.topology_mesh("v9z:1x1")


def test_compiled_report_reads_the_compiled_step(mesh):
  """Peak = arguments + outputs + temp - aliases; collectives per kind as
  ``zerojax.diagnostics.collectives`` counts them; on XLA CPU every collective is
  issued synchronously."""
  tx = zerojax.zero(optax.adamw(1e-3), stage=3, mesh=mesh)
  state = jax.eval_shape(
    lambda k: zerojax.init_from(
      lambda k: toy.layered_params(4, D, V, key=k), tx, k
    ),
    jax.random.key(0),
  )
  batch = aot.abstract_batch({"x": ((B,), np.int32), "y": ((B,), np.int32)})
  compiled = (
    zerojax.train_step(toy.layered_loss, tx).lower(state, batch).compile()
  )
  rep = aot.compiled_report(compiled, mesh)
  m = compiled.memory_analysis()
  assert (
    rep["memory"]["peak"]
    == (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      + m.temp_size_in_bytes
      - m.alias_size_in_bytes
    )
    > 0
  )
  found = zerojax.diagnostics.collectives(compiled.as_text(), 8)
  assert (
    rep["collectives"]["reduce-scatter"]["count"]
    == sum(c.count for c in found if c.kind == "reduce-scatter")
    > 0
  )
  assert rep["collectives"]["all-gather"]["bytes"] == sum(
    c.total_bytes for c in found if c.kind == "all-gather"
  )
  assert sum(rep["bytes_by_axis"].values()) == sum(c.total_bytes for c in found)
  assert (
    rep["bytes_by_axis"]["reduce-scatter@data"]
    == rep["collectives"]["reduce-scatter"]["bytes"]
  )
  # what a chip sends: 7/8 of each gathered or scattered buffer over 8
  for kind in ("all-gather", "reduce-scatter"):
    assert rep["collectives"][kind]["wire"] == pytest.approx(
      7 / 8 * rep["collectives"][kind]["bytes"]
    )
  issued = rep["issued"]
  assert all(row["async"] == 0 and row["sync"] > 0 for row in issued.values())
  assert issued["all-gather"]["sync"] == sum(
    1 for c in found if c.kind == "all-gather"
  )


# The TPU compiler's chain (start, continuation fused with a matmul, done)
# and XLA's generic start/done pair, in the shapes the compilers write.
_TPU = """
HloModule m

%start_comp (p: bf16[64,256]) -> (bf16[64,256], bf16[256,256]) {
  %p = bf16[64,256]{1,0} parameter(0)
  %all-gather.1 = bf16[256,256]{1,0} all-gather(%p), channel_id=1, replica_groups=mesh['data'=4] {'data'}, dimensions={0}, frontend_attributes={chain_id="0"}
  ROOT %custom-call.1 = (bf16[64,256]{1,0}, bf16[256,256]{1,0}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.7 (q: bf16[64,256], r: bf16[256,256], x: bf16[8,256]) -> (bf16[8,256], bf16[256,256]) {
  %x = bf16[8,256]{1,0} parameter(2)
  %r = bf16[256,256]{1,0} parameter(1)
  %convolution.3 = bf16[8,256]{1,0} convolution(%x, %r), dim_labels=bf_io->bf
  %q = bf16[64,256]{1,0} parameter(0)
  %all-gather.2 = bf16[256,256]{1,0} all-gather(%q), channel_id=1, replica_groups=mesh['data'=4] {'data'}, dimensions={0}, frontend_attributes={chain_id="0"}
  ROOT %tuple.1 = (bf16[8,256]{1,0}, bf16[256,256]{1,0}) tuple(%convolution.3, %all-gather.2)
}

%done_comp (s: bf16[256,256]) -> bf16[256,256] {
  %s = bf16[256,256]{1,0} parameter(0)
  %all-gather.3 = bf16[256,256]{1,0} all-gather(%s), channel_id=1, replica_groups=mesh['data'=4] {'data'}, dimensions={0}, frontend_attributes={chain_id="0"}
  ROOT %custom-call.2 = bf16[256,256]{1,0} custom-call(%all-gather.3), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (a: bf16[64,256], x: bf16[8,256], g: f32[256,256]) -> bf16[256,256] {
  %a = bf16[64,256]{1,0} parameter(0)
  %x = bf16[8,256]{1,0} parameter(1)
  %g = f32[256,256]{1,0} parameter(2)
  %async-collective-start = (bf16[64,256]{1,0}, bf16[256,256]{1,0}) fusion(%a), kind=kCustom, calls=%start_comp
  %get-tuple-element.1 = bf16[64,256]{1,0} get-tuple-element(%async-collective-start), index=0
  %get-tuple-element.2 = bf16[256,256]{1,0} get-tuple-element(%async-collective-start), index=1
  %fusion.7 = (bf16[8,256]{1,0}, bf16[256,256]{1,0}) fusion(%get-tuple-element.1, %get-tuple-element.2, %x), kind=kOutput, calls=%async_collective_fusion.7
  %get-tuple-element.3 = bf16[256,256]{1,0} get-tuple-element(%fusion.7), index=1
  %reduce-scatter.1 = f32[64,256]{1,0} reduce-scatter(%g), channel_id=2, replica_groups=mesh['data'=4] {'data'}, dimensions={0}, to_apply=%add
  ROOT %async-collective-done = bf16[256,256]{1,0} fusion(%get-tuple-element.3), kind=kCustom, calls=%done_comp
}
"""

_GPU = """
HloModule m

ENTRY %main (a: f32[64,256], w: f32[8,8]) -> f32[256,256] {
  %a = f32[64,256]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %all-gather-start = (f32[64,256]{1,0}, f32[256,256]{1,0}) all-gather-start(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %dot.1 = f32[8,8]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dot.2 = f32[8,8]{1,0} dot(%dot.1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %all-gather-done = f32[256,256]{1,0} all-gather-done(%all-gather-start)
}
"""


# The TPU compiler's loop (no known_trip_count: the condition compares the
# counter, tuple element 0, started from a copied constant, with a bound)
# holding an all-gather it wrote as an all-reduce of a zero-padded buffer.
_TPU_LOOP = """
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%cond (p: (s32[], f32[64,256])) -> pred[] {
  %bound = s32[]{:T(128)} constant(7)
  %p = (s32[]{:T(128)}, f32[64,256]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %bound), direction=LT
}

%body (p: (s32[], f32[64,256])) -> (s32[], f32[64,256]) {
  %p = (s32[]{:T(128)}, f32[64,256]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  %x = f32[64,256]{1,0} get-tuple-element(%p), index=1
  %ag = f32[256,256]{1,0} all-gather(%x), channel_id=1, replica_groups=mesh['data'=4] {'data'}, dimensions={0}, metadata={op_name="jit(f)/while/body/all_gather"}
  %ar = f32[256]{0} all-reduce(%x), channel_id=2, replica_groups=mesh['data'=4] {'data'}, to_apply=%add, metadata={op_name="jit(f)/while/body/all_gather"}
  ROOT %t = (s32[]{:T(128)}, f32[64,256]{1,0}) tuple(%next, %x)
}

ENTRY %main (a: f32[64,256]) -> (s32[], f32[64,256]) {
  %a = f32[64,256]{1,0} parameter(0)
  %zero = s32[]{:T(128)} constant(2)
  %start = s32[]{:T(128)} copy(%zero)
  %init = (s32[]{:T(128)}, f32[64,256]{1,0}) tuple(%start, %a)
  ROOT %w = (s32[]{:T(128)}, f32[64,256]{1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_tpu_loop_without_a_known_trip_count_is_counted_from_its_condition():
  """The loop runs from its counter's start (2) to the bound (7): 5 times;
  the all-reduce the op_name says stands for an all-gather is marked so."""
  found = {c.kind: c for c in zerojax.diagnostics.collectives(_TPU_LOOP, 4)}
  assert found["all-gather"].count == 5 == found["all-reduce"].count
  assert found["all-gather"].total_bytes == 5 * 256 * 256 * 4
  assert found["all-reduce"].written_for == "all-gather"
  assert found["all-gather"].written_for == ""
  le = _TPU_LOOP.replace("direction=LT", "direction=LE")
  assert zerojax.diagnostics.collectives(le, 4)[0].count == 6


# A multi-slice TPU program: the compiler writes the program for one slice
# and moves data between slices with host-transfer sends that name the
# collective the megascale runtime runs.
_TPU_SLICES = """
HloModule m

ENTRY %main (g: f32[64,8,128]) -> f32[64,8,128] {
  %g = f32[64,8,128]{2,1,0:T(8,128)} parameter(0)
  %after-all.1 = token[] after-all()
  %send.1 = (f32[64,8,128]{2,1,0:T(8,128)}, u32[]{:S(2)}, token[]) send(%g, %after-all.1), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="psum_invariant.83_0",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %send-done.1 = token[] send-done(%send.1), channel_id=4, is_host_transfer=true
  %recv.1 = (f32[64,8,128]{2,1,0:T(8,128)}, u32[]{:S(2)}, token[]) recv(%after-all.1), channel_id=5, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv-done.1 = (f32[64,8,128]{2,1,0:T(8,128)}, token[]) recv-done(%recv.1), channel_id=5, is_host_transfer=true
  ROOT %r = f32[64,8,128]{2,1,0:T(8,128)} get-tuple-element(%recv-done.1), index=0
}
"""


# Offloaded state as the TPU compiler moves it: an asynchronous copy from
# host memory (S(5)) beside a matmul, and one back after it.
_TPU_OFFLOAD = """
HloModule m

ENTRY %main (h: f32[64,256], w: f32[8,8]) -> f32[64,256] {
  %h = f32[64,256]{1,0:T(8,128)S(5)} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %copy-start = (f32[64,256]{1,0:T(8,128)}, f32[64,256]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) copy-start(%h)
  %dot.1 = f32[8,8]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %copy-done = f32[64,256]{1,0:T(8,128)} copy-done(%copy-start)
  %add = f32[64,256]{1,0:T(8,128)} add(%copy-done, %copy-done)
  %copy-start.1 = (f32[64,256]{1,0:T(8,128)S(5)}, f32[64,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%add)
  ROOT %copy-done.1 = f32[64,256]{1,0:T(8,128)S(5)} copy-done(%copy-start.1)
}
"""


def test_tpu_compile_reads_the_largest_allocations_of_the_tpu_programs_report(
  tmp_path,
):
  """``experiments/tpu_compile.py --buffers``: of an XLA dump folder, the
  report of the program with the most bytes that is not a CPU module,
  its first table (device memory) sorted by allocation size."""
  import pathlib

  path = pathlib.Path(__file__).parents[1] / "experiments" / "tpu_compile.py"
  spec = importlib.util.spec_from_file_location("tpu_compile", path)
  tpu_compile = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tpu_compile)
  header = (
    "  cumulative_size;       size;       offset; used_by_n_values; "
    "shapes_list\n  ----------\n"
  )
  (
    tmp_path / "m0.jit_fn.cl_1.after_optimizations-memory-usage-report.txt"
  ).write_text(
    "Memory Space: default (color=0)\nTotal bytes: 300 (300B)\n"
    + header
    + "   4.00MiB( 30%);    4.00MiB;    0;   1; f32[1024,1024]\n"
    + "  20.00MiB( 90%);   16.00MiB;   64;   2; bf16[4,2048,1024], pred[]\n"
    + "  20.00MiB(100%);      512B;   96;   1; (f32[], f32[])\n"
    + "\n"
    + header
    + "  64.00MiB(100%);   64.00MiB;    0;   1; f32[4,2048,2048]\n"
  )
  (
    tmp_path / "m1.jit_fn.cpu_after_optimizations-memory-usage-report.txt"
  ).write_text(
    "Memory Space: default (color=0)\nTotal bytes: 900 (900B)\n"
    + header
    + "   1.00GiB(100%);    1.00GiB;    0;   1; f32[16384,16384]\n"
  )
  got = tpu_compile.largest_buffers(str(tmp_path), 2)
  assert got["total_bytes"] == 300
  assert got["report"].startswith("m0.")
  assert got["allocations"] == [
    {"bytes": 16 * 2**20, "shapes": "bf16[4,2048,1024], pred[]"},
    {"bytes": 4 * 2**20, "shapes": "f32[1024,1024]"},
  ]
