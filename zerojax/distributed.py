"""Multi-process runs: joining the cluster, the main process, each host's
rows of a batch, and a preemption point that every process agrees on."""

from zerojax._src.runtime.distributed import ENV_COORDINATOR as ENV_COORDINATOR
from zerojax._src.runtime.distributed import (
  ENV_NUM_PROCESSES as ENV_NUM_PROCESSES,
)
from zerojax._src.runtime.distributed import ENV_PROCESS_ID as ENV_PROCESS_ID
from zerojax._src.runtime.distributed import initialize as initialize
from zerojax._src.runtime.distributed import is_main as is_main
from zerojax._src.runtime.distributed import local_rows as local_rows
from zerojax._src.runtime.distributed import (
  preemption_point as preemption_point,
)

__all__ = [
  "ENV_COORDINATOR",
  "ENV_NUM_PROCESSES",
  "ENV_PROCESS_ID",
  "initialize",
  "is_main",
  "local_rows",
  "preemption_point",
]
