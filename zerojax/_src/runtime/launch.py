"""Run a command as P local processes with D fake CPU devices each.

    python -m zerojax.launch -n 2 -d 4 -- python -m zerojax.train --steps 50
    python -m zerojax.launch -n 2 -d 4 -- python my_script.py

For development and tests of multi-host code on one machine: every process
gets ``ZEROJAX_COORDINATOR=127.0.0.1:<free port>``, ``ZEROJAX_NUM_PROCESSES``,
``ZEROJAX_PROCESS_ID`` and ``XLA_FLAGS`` (the caller's, with ``--xla_force_host_platform_device_count=D``),
which :func:`zerojax.distributed.initialize` (called by the main job) turns
into one JAX run over P x D devices, with gloo as the CPU collectives.
Process 0's output is streamed; the others' goes to ``<log-dir>/process_<i>.log``.
If any process fails, the others are stopped and the launcher exits non-zero,
naming the process and showing the end of its log.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

from zerojax._src.runtime.xla_flags import cpu_device_flags


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(
  command,
  processes: int,
  devices: int,
  *,
  log_dir=None,
  timeout_s: float | None = None,
  grace_s: float = 10.0,
  stream=True,
) -> int:
  """Runs ``command`` as ``processes`` local processes; returns an exit code."""
  log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="zerojax_launch_"))
  log_dir.mkdir(parents=True, exist_ok=True)
  port = free_port()
  procs, logs = [], []
  for i in range(processes):
    env = dict(
      os.environ,
      ZEROJAX_COORDINATOR=f"127.0.0.1:{port}",
      ZEROJAX_NUM_PROCESSES=str(processes),
      ZEROJAX_PROCESS_ID=str(i),
      XLA_FLAGS=cpu_device_flags(devices),
      JAX_PLATFORMS="cpu",
    )
    if i == 0 and stream:
      out = None
    else:
      out = open(log_dir / f"process_{i}.log", "w")
      logs.append(out)
    procs.append(
      subprocess.Popen(
        command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None
      )
    )
  start = time.monotonic()
  failed = None
  try:
    while True:
      codes = [p.poll() for p in procs]
      bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if bad:
        failed = bad[0]
        break
      if all(c == 0 for c in codes):
        return 0
      if timeout_s is not None and time.monotonic() - start > timeout_s:
        failed = (None, 124)
        break
      time.sleep(0.2)
    # one failed: give the others a moment to notice, then stop them
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
      time.sleep(0.2)
    for p in procs:
      if p.poll() is None:
        p.kill()
    i, code = failed
    who = "timed out" if i is None else f"process {i} exited with {code}"
    print(f"zerojax.launch: {who}; stopped the others.", file=sys.stderr)
    if i not in (None, 0):
      tail = (log_dir / f"process_{i}.log").read_text()[-3000:]
      print(
        f"--- end of {log_dir}/process_{i}.log ---\n{tail}", file=sys.stderr
      )
    return code if isinstance(code, int) and code > 0 else 1
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for f in logs:
      f.close()


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m zerojax.launch",
    description="Run a command as P local JAX processes with D fake CPU "
    "devices each (coordinator on 127.0.0.1).",
  )
  p.add_argument("-n", "--processes", type=int, default=2)
  p.add_argument(
    "-d", "--devices", type=int, default=4, help="fake CPU devices per process"
  )
  p.add_argument(
    "--log-dir", default=None, help="where processes 1..P-1 write their logs"
  )
  p.add_argument(
    "--timeout",
    type=float,
    default=None,
    help="stop everything after this many seconds",
  )
  p.add_argument(
    "command", nargs=argparse.REMAINDER, help="the command, after --"
  )
  args = p.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    p.error("give the command to run after --")
  if args.processes < 1 or args.devices < 1:
    p.error("--processes and --devices must be >= 1")
  sys.exit(
    launch(
      command,
      args.processes,
      args.devices,
      log_dir=args.log_dir,
      timeout_s=args.timeout,
    )
  )


if __name__ == "__main__":
  main()
