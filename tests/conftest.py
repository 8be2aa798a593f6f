"""Test set-up: 8 fake CPU devices, set before JAX initialises its backend."""

import atexit
import collections
import os
import platform
import shutil
import tempfile
import zlib
from importlib.metadata import version

# LLVM optimisation level 0 compiles the CPU programs ~35% faster (measured on
# tests/test_zeropp.py, 2 cores). It changes only the machine code's speed,
# not XLA's HLO passes: every sharded and unsharded program in a test is
# compiled the same way, and collectives/memory are read from the HLO. A
# level the caller set wins.
_JAXLIB = tuple(int(v) for v in version("jaxlib").split(".")[:2])
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
# jaxlib 0.10's XLA CPU emits fused kernels through its MLIR fusion
# emitters by default; its older emitters compile in about half the time
# (the default suite: 960 s -> 520 s when measured, commit 6f70e73), so 0.10 uses
# them. jaxlib 0.12 has no such emitter flag (an unknown XLA flag aborts the
# process). Unlike the level above, the emitter choice reaches XLA's fusion
# pass: on the toy model at stages 0-3 (8 layers) the same collectives,
# fewer and larger fusions, temp bytes within 0.6%; the tests compare
# programs compiled alike, never a figure across these flags.
# With either emitters, at LLVM level 0, multiply-adds are still contracted
# to FMA instructions in some programs and not in others, so two programs
# of the same math differ in the last bit (0.10's older emitters: stage 3
# against hpZ, offloaded against not; 0.12's: clip + AdamW at stage 2 with
# the gradients summed in host memory against on the device). Capping the
# instruction set at AVX (256-bit vectors, no FMA) turns contraction off on
# every processor; flags the caller set win.
if _JAXLIB < (0, 11) and "xla_cpu_use_fusion_emitters" not in _flags:
  _flags += " --xla_cpu_use_fusion_emitters=false"
if "xla_cpu_max_isa" not in _flags:
  _flags += " --xla_cpu_max_isa=AVX"
# XLA CPU kills the process when a collective's device threads have not all
# arrived after 40 s; on a loaded 2-core machine (CI beside another job) 8
# device threads can be that late without anything being wrong. Subprocesses
# (notebook kernels, multi-process workers) inherit these flags.
if "collective_call_terminate_timeout" not in _flags:
  _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ["XLA_FLAGS"] = _flags + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


# One persistent XLA compilation cache per test session, shared by the
# xdist workers and every subprocess they start (notebook kernels, Optax's
# suites, resumed main jobs): a program built again, in another test,
# worker or subprocess, is read back instead of compiled.
# JAX keys an entry on the HLO, the compile options, the XLA flags, the
# devices and the jaxlib version, so a hit is the executable a compile would
# have produced. No size limit: with one, JAX takes a file lock around
# each read and write and, before every write, scans every entry to choose
# what to evict, so a write costs more the more the session has written
# (experiments/cache_limit.py). Without the lock a process may read an
# entry another is still writing: JAX then warns that it could not read it
# and compiles the program itself (toy.warnings_as_errors lets that
# warning through). Every program is written, however fast it compiled: a
# write is cheap without the lock, and a small program built again in
# another test or process is read back too (the default suite on jaxlib
# 0.12: 598.5 s writing those over 0.1 s, 570.5 s writing all, when
# measured in commit 58a5150). The session's
# creator (the xdist controller, or the only process) removes the
# directory at exit; a directory the caller set is kept. Not on
# jaxlib < 0.11: there a program with bucketed all-gathers read back from
# the cache aborted in XLA CPU's rendezvous when it ran
# (docs/architecture.md, "The test suite").
def _cache_state() -> str:
  """Whether this session's persistent cache is on, and why not."""
  if os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").lower() in (
    "0",
    "false",
  ):
    return "off (JAX_ENABLE_COMPILATION_CACHE)"
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return "on, the caller's " + os.environ["JAX_COMPILATION_CACHE_DIR"]
  if _JAXLIB < (0, 11):
    return "off (jaxlib < 0.11)"
  return "on"


_CACHE = _cache_state()
if _CACHE == "on":
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
    prefix="zerojax-tests-xla-cache-"
  )
  atexit.register(
    shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True
  )
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def mesh():
  """The mesh users hold: ``jax.make_mesh``'s Explicit axes."""
  import zerojax

  assert len(jax.devices()) == 8, "tests need 8 fake CPU devices"
  return zerojax.make_mesh()


@pytest.fixture(scope="session", params=["explicit", "auto"])
def any_mesh(request):
  """Both axis types, for the tests whose claims must hold on each."""
  import zerojax

  return zerojax.make_mesh(
    axis_types={
      "explicit": jax.sharding.AxisType.Explicit,
      "auto": jax.sharding.AxisType.Auto,
    }[request.param]
  )


def _machine() -> str:
  """The processor the suite runs on: XLA CPU's kernels (and so the order
  of some float sums) depend on it."""
  model, flags = platform.processor() or platform.machine(), set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
          break
  except OSError:
    pass
  isa = [
    f
    for f in ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
    if f in flags
  ]
  return f"{model}, {os.cpu_count()} cores" + (
    f", {' '.join(isa)}" if isa else ""
  )


def pytest_report_header(config):
  import jaxlib

  return [
    "zerojax: machine " + _machine(),
    f"zerojax: jax {jax.__version__}, jaxlib {jaxlib.__version__}",
    "zerojax: persistent compilation cache " + _CACHE,
    "zerojax: XLA_FLAGS " + os.environ["XLA_FLAGS"].strip(),
  ]


# In the default suite, the tests that each run for minutes in a
# subprocess (Optax's suites through the drop-in, the notebooks, the main
# job's runs, the planner's command line) go first: xdist hands its first
# tests out one by one in turn, so the two workers start on those and end
# on short tests together. The slow suite keeps file order: its Optax runs
# start two processes each, and four at once made it slower (767.6 s
# against 708.3 s on 2 cores, .ci/data/suite_time_slow_*).
_LONG_FIRST = (
  "test_optax_conformance.py",
  "test_notebook.py",
  "test_train.py",
  "test_plan.py",
)


# CI's newest-JAX leg sets ZEROJAX_MATRIX_CASES=third: of each
# parametrized test with three or more cases it runs about a third, those
# whose node id hashes to 0 mod 3 (the same cases every run, on every
# xdist worker), at least one per test and per mesh axis type where the
# test takes both (the ``any_mesh`` fixture). Every test function runs at
# both ends of the JAX window, on each axis type it takes; every case
# runs at the oldest end, where CI runs the README's command unchanged.
def _third_of_each_matrix(items):
  by_test = collections.defaultdict(list)
  for it in items:
    by_test[(it.path, getattr(it, "originalname", it.name))].append(it)
  dropped = set()
  for cases in by_test.values():
    if len(cases) < 3:
      continue
    by_mesh = collections.defaultdict(list)
    for c in cases:
      spec = getattr(c, "callspec", None)
      by_mesh[spec and spec.params.get("any_mesh")].append(c)
    for group in by_mesh.values():
      kept = [c for c in group if zlib.crc32(c.nodeid.encode()) % 3 == 0]
      dropped.update(id(c) for c in group if c not in (kept or group[:1]))
  return [it for it in items if id(it) not in dropped], [
    it for it in items if id(it) in dropped
  ]


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
  if os.environ.get("ZEROJAX_MATRIX_CASES") == "third":
    items[:], dropped = _third_of_each_matrix(items)
    config.hook.pytest_deselected(items=dropped)
  if any(it.get_closest_marker("slow") for it in items):
    return
  rank = {name: k for k, name in enumerate(_LONG_FIRST)}
  items.sort(key=lambda it: rank.get(it.path.name, len(rank)))
