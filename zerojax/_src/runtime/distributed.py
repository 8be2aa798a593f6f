"""Multi-process start-up on JAX's own distributed runtime.

:func:`initialize` calls ``jax.distributed.initialize`` with, in order of
precedence: the explicit arguments; the ``ZEROJAX_COORDINATOR``,
``ZEROJAX_NUM_PROCESSES`` and ``ZEROJAX_PROCESS_ID`` environment variables
(set by ``python -m zerojax.launch``); JAX's cluster auto-detection when
running under SLURM, Open MPI or on a Cloud TPU pod slice. Otherwise it does
nothing and the run is single-process. After it, ``jax.devices()`` lists the
devices of every process and :func:`zerojax.make_mesh` spans them all.

Failure detection: JAX's coordination service heartbeats every process;
``heartbeat_s`` bounds how long the survivors of a killed process wait before
they are told (a collective with a dead peer may fail sooner, over gloo on
CPU or NCCL on GPU).
"""

from __future__ import annotations

import os
import socket
import sys
import time

import jax

ENV_COORDINATOR = "ZEROJAX_COORDINATOR"
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"

_initialized = False


def _auto_cluster() -> bool:
  slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
  mpi = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
  tpu = (
    "TPU_WORKER_HOSTNAMES" in os.environ
    or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ
  )
  return slurm or mpi or tpu


def initialize(
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  timeout_s: int = 120,
  heartbeat_s: int = 20,
) -> bool:
  """Joins the multi-process run if there is one; True if multi-process.

  Args:
    coordinator: ``host:port`` of process 0's coordinator service.
    num_processes: number of processes in the run.
    process_id: this process's index, ``0 .. num_processes - 1``.
    timeout_s: how long to wait for every process to join.
    heartbeat_s: how long a silent process may go before the run fails.
  """
  global _initialized
  if _initialized:
    return jax.process_count() > 1
  coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
  if num_processes is None and ENV_NUM_PROCESSES in os.environ:
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and ENV_PROCESS_ID in os.environ:
    process_id = int(os.environ[ENV_PROCESS_ID])
  explicit = [coordinator, num_processes, process_id]
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise ValueError(
        f"zerojax.distributed.initialize: give all of coordinator, "
        f"num_processes and process_id (got {explicit}); or none, to use "
        f"JAX's cluster auto-detection."
      )
    if not 0 <= process_id < num_processes:
      raise ValueError(
        f"zerojax.distributed.initialize: process_id={process_id} is outside "
        f"0..{num_processes - 1} for num_processes={num_processes}."
      )
    kwargs = dict(
      coordinator_address=coordinator,
      num_processes=num_processes,
      process_id=process_id,
    )
  elif _auto_cluster():
    kwargs = {}
  else:
    return False
  what = ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "auto-detected"
  advice = (
    "Check that every process uses the same coordinator address and "
    "process count, that the coordinator (process 0) is reachable, "
    "and that each process id is used once."
  )
  if kwargs and process_id != 0:
    _wait_for_coordinator(coordinator, timeout_s, what, advice)
  # JAX's client aborts the process (a fatal XLA error, not an exception)
  # when not every process joins in time; say what to check beforehand.
  print(
    f"zerojax: joining the distributed run ({what}); if this ends in "
    f"DEADLINE_EXCEEDED after {timeout_s}s, not every process joined. "
    f"{advice}",
    file=sys.stderr,
    flush=True,
  )
  try:
    jax.distributed.initialize(
      **kwargs,
      initialization_timeout=timeout_s,
      heartbeat_timeout_seconds=heartbeat_s,
    )
  except Exception as e:  # noqa: BLE001 -- re-raised with what to check
    raise RuntimeError(
      f"zerojax: could not join the distributed run ({what}) within "
      f"{timeout_s}s: {type(e).__name__}: {str(e)[:300]}. {advice}"
    ) from e
  _initialized = True
  return jax.process_count() > 1


def _wait_for_coordinator(
  address: str, timeout_s: float, what: str, advice: str
):
  """Fails with a clear error if nothing listens at ``address`` in time."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection(
        (host or "127.0.0.1", int(port)), timeout=2
      ):
        return
    except OSError as e:
      if time.monotonic() > deadline:
        raise RuntimeError(
          f"zerojax: could not join the distributed run ({what}): no "
          f"coordinator answered at {address} within {timeout_s}s "
          f"({e}). {advice}"
        ) from None
      time.sleep(0.5)


def is_main() -> bool:
  """True on process 0: the one that logs, plots and prints."""
  return jax.process_index() == 0


def local_rows(sharding, n_rows: int) -> slice:
  """The contiguous rows of a ``P(axis)``-sharded batch this process feeds."""
  idx = sharding.addressable_devices_indices_map((n_rows,))
  starts = sorted(
    {(s[0].start or 0, s[0].stop or n_rows) for s in idx.values()}
  )
  lo, hi = starts[0][0], starts[-1][1]
  if sum(b - a for a, b in starts) != hi - lo:
    raise ValueError(
      "zerojax: this process's devices do not hold a contiguous "
      "block of the batch; build the mesh with zerojax.make_mesh()."
    )
  return slice(lo, hi)


_sigterm = {"installed": False, "seen": False}


def _on_sigterm(signum, frame):
  del signum, frame
  _sigterm["seen"] = True


def preemption_point(step: int) -> bool:
  """True at the step every process agrees to save and stop at, after a
  preemption notice (SIGTERM, as spot TPU and GPU VMs get).

  Call it once per step, with the same ``step`` on every process, after the
  step's update; when it returns True, save a checkpoint of that step and
  exit. Multi-process: JAX's preemption sync point
  (``multihost_utils.reached_preemption_sync_point``): a notice to any
  process reaches all, and they agree on the next step every one of them
  reaches, so they all save the same one. Single process: True from the
  first call after this process got SIGTERM (the handler is installed on
  the first call).

  Example::

      for step in range(start + 1, steps + 1):
        state, metrics = train_step(state, next_batch(step))
        if zerojax.distributed.preemption_point(step):
          ckpt.save(state, extra={"data_step": step}, force=True)
          ckpt.wait()
          break
  """
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(int(step)))
  if not _sigterm["installed"]:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm["installed"] = True
  return _sigterm["seen"]
