"""What a state and a compiled step hold, measured: the layout table, the
state's bytes per device, and the collectives read from compiled HLO.

    print(zerojax.diagnostics.layout_table(state))
    hlo = step.lower(state, batch).compile().as_text()
    zerojax.diagnostics.bytes_by_axis(hlo, mesh)

:func:`zerojax.report` puts these together for one step.
"""

from zerojax._src.diagnostics.hlo import Collective as Collective
from zerojax._src.diagnostics.hlo import bytes_by_axis as bytes_by_axis
from zerojax._src.diagnostics.hlo import collective_axes as collective_axes
from zerojax._src.diagnostics.hlo import collective_bytes as collective_bytes
from zerojax._src.diagnostics.hlo import collectives as collectives
from zerojax._src.diagnostics.hlo import crosses_processes as crosses_processes
from zerojax._src.diagnostics.hlo_memory import (
  entry_bytes_by_memory as entry_bytes_by_memory,
)
from zerojax._src.diagnostics.hlo_memory import host_transfers as host_transfers
from zerojax._src.diagnostics.measure import layout_rows as layout_rows
from zerojax._src.diagnostics.measure import layout_table as layout_table
from zerojax._src.diagnostics.measure import memory_bytes as memory_bytes
from zerojax._src.diagnostics.measure import state_bytes as state_bytes
from zerojax._src.diagnostics.measure import theory_bytes as theory_bytes

__all__ = [
  "Collective",
  "bytes_by_axis",
  "collective_axes",
  "collective_bytes",
  "collectives",
  "crosses_processes",
  "entry_bytes_by_memory",
  "host_transfers",
  "layout_rows",
  "layout_table",
  "memory_bytes",
  "state_bytes",
  "theory_bytes",
]
