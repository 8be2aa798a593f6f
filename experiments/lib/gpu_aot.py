"""XLA's GPU compiler run ahead of time on a machine with no GPU.

The CUDA plugin (``jax-cuda13-plugin`` and ``jax-cuda13-pjrt`` at jaxlib's
version, plus ``nvidia-cudnn-cu13`` for cuDNN attention; no driver, no
device) compiles for a GPU described by a target config: the program, its
memory plan (arguments, outputs, temp, host memory) and its schedule are
the GPU compiler's own. A deviceless topology's devices list no memories,
so a sharding in ``pinned_host`` memory on them loses its memory kind.
The step is therefore traced on a CPU device, whose memories include
``pinned_host``, lowered for CUDA (``lowering_platforms=("cuda",)``), and
the module handed to the topology's compile-only client. That last call
is JAX's internal compile path (``jax._src.compiler``): this module is a
measuring instrument of the experiments, not part of zerojax.
"""

from __future__ import annotations

import os

# Hopper's published figures (SXM parts); device memory as the CUDA driver
# reports it (nvidia-smi's MiB)
GPUS = {
  "h200": dict(name="NVIDIA H200", memory_mib=143771, bandwidth=4.8e12),
  "h100": dict(
    name="NVIDIA H100 80GB HBM3", memory_mib=81559, bandwidth=3.35e12
  ),
}


def target_config(gpu: str) -> str:
  """The GPU target config (text proto) XLA compiles for."""
  g = GPUS[gpu]
  info = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 48 * 1024,
    "shared_memory_per_core": 228 * 1024,
    "shared_memory_per_block_optin": 227 * 1024,
    "threads_per_core_limit": 2048,
    "core_count": 132,
    "fpus_per_core": 128,
    "block_dim_limit_x": 2**31 - 1,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "memory_bandwidth": int(g["bandwidth"]),
    "l2_cache_size": 50 * 2**20,
    "clock_rate_ghz": 1.98,
    "device_memory_size": g["memory_mib"] * 2**20,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
  }
  body = "\n".join(f"  {k}: {v}" for k, v in info.items())
  return (
    f"gpu_device_info {{\n{body}\n"
    "  cuda_compute_capability { major: 9 minor: 0 }\n}\n"
    'platform_name: "CUDA"\n'
    "dnn_version_info { major: 9 minor: 10 }\n"
    "runtime_version { major: 13 minor: 0 }\n"
    f'device_description_str: "{g["name"]}"\n'
  )


def one_cpu_device():
  """Before JAX starts: one CPU device, the CPU backend only."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = (
    flags + " --xla_force_host_platform_device_count=1"
  ).strip()


class Compiled:
  """The GPU compiler's executable, read like a ``jax.stages.Compiled``
  (``memory_analysis``, ``as_text``), so ``zerojax.aot.compiled_report``
  reads it."""

  def __init__(self, executable):
    self._exe = executable

  def memory_analysis(self):
    return self._exe.get_compiled_memory_stats()

  def as_text(self) -> str:
    return self._exe.hlo_modules()[0].to_string()


def compile_for_gpu(traced, gpu: str = "h200") -> Compiled:
  """``traced`` (a ``jit(...).trace(...)`` on one CPU device) compiled by
  XLA's GPU compiler for ``gpu``."""
  import numpy as np
  from jax._src import compiler
  from jax._src.lib import xla_client
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(
    platform="cuda", target_config=target_config(gpu), topology="1x1x1"
  )
  (device,) = topo.devices
  client = device.client
  lowered = traced.lower(lowering_platforms=("cuda",))
  options = compiler.get_compile_options(
    num_replicas=1,
    num_partitions=1,
    device_assignment=np.array([[device]]),
    backend=client,
  )
  options.executable_build_options.use_spmd_partitioning = True
  return Compiled(
    client.compile(
      lowered.compiler_ir(),
      executable_devices=xla_client.DeviceList((device,)),
      compile_options=options,
    )
  )
