"""The XLA flags of the suite's processes, for the subprocesses it starts.

``conftest.py`` compiles at LLVM optimisation level 0; a subprocess whose
numbers are compared with this process's must compile the same way (the
level changes float results in the last bit), so it inherits the flags
with only the fake device count replaced.
"""

import os
import re

_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def with_devices(n: int) -> str:
  flags = _COUNT.sub("", os.environ.get("XLA_FLAGS", "")).split()
  return " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
