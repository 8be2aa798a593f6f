"""Device bytes live over a compiled program, from an XLA dump folder.

``memory_analysis()`` gives a program's temp figure, the size of the heap
the compiler packed its temporaries into; what is live in it at each point
of the schedule is a different number, and the gap between the two is
packing (fragmentation). XLA writes both ingredients with ``--xla_dump_to``
and ``--xla_dump_hlo_as_text``: ``*buffer-assignment.txt`` (each value's
allocation, memory space, size and offset) and ``*live-range.txt`` (each
value's first and last position in the flattened schedule).
:func:`device_live` reads them and sweeps the schedule.
"""

from __future__ import annotations

import collections
import pathlib
import re

_ALLOCATION = re.compile(r"allocation (\d+): size (\d+)(.*)")
_VALUE = re.compile(
  r" value: <\d+ (\S+)(?: \(phi\))? @(\d+)> \(size=(\d+),offset=(\d+)\): (.*)"
)
_RANGE = re.compile(r"(\S+):(\d+)-(\d+)$")
_POSITION = re.compile(r"(\d+):(\S+)$")


def _values(text: str):
  """``{value: (color, bytes, offset, allocation, shape)}`` and the device
  (color 0) preallocated temp allocation's index and bytes."""
  values, allocation, temp = {}, None, (None, 0)
  for line in text.splitlines():
    m = _ALLOCATION.match(line)
    if m:
      allocation = int(m.group(1))
      rest = m.group(3)
      if "preallocated-temp" in rest and "color" not in rest:
        temp = (allocation, int(m.group(2)))
      continue
    m = _VALUE.match(line)
    if m:
      name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
      values[name] = (
        int(m.group(2)),
        int(m.group(3)),
        int(m.group(4)),
        allocation,
        m.group(5).split("{")[0],
      )
  return values, temp


def _ranges(text: str):
  """``({value: (first, last)}, {position: instruction})``."""
  ranges, order, section = {}, {}, None
  for line in text.splitlines():
    s = line.strip()
    if s.startswith("InstructionSequence"):
      section = "order"
    elif s.startswith("BufferLiveRange"):
      section = "ranges"
    elif s.startswith("Live ranges at"):
      break
    elif section == "order" and (m := _POSITION.match(s)):
      order[int(m.group(1))] = m.group(2)
    elif section == "ranges" and (m := _RANGE.match(s)):
      ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
  return ranges, order


def _union(intervals) -> int:
  total, end = 0, None
  for a, b in sorted(intervals):
    if end is None or a >= end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def device_live(buffer_assignment: str, live_range: str, n: int = 8) -> dict:
  """The device memory's live bytes over the schedule.

  Returns ``preallocated_temp`` (the compiler's heap for temporaries),
  ``temp_live_peak`` (the most bytes live in that heap at once),
  ``live_peak`` (the most device bytes live at once, arguments included),
  the instruction at that point and the ``n`` largest values live there.
  Values sharing bytes of one allocation (in-place updates) count once."""
  values, (temp_alloc, temp_bytes) = _values(buffer_assignment)
  ranges, order = _ranges(live_range)
  device = [
    (a, b, values[k])
    for k, (a, b) in ranges.items()
    if k in values and values[k][0] == 0
  ]
  starts = collections.defaultdict(list)
  for item in device:
    starts[item[0]].append(item)
  live, best, best_temp = [], (0, 0, []), 0
  for t in range(max((b for _, b, _ in device), default=-1) + 1):
    live = [x for x in live if x[1] >= t] + starts.get(t, [])
    per_alloc = collections.defaultdict(list)
    for _, _, (_, size, offset, alloc, _) in live:
      per_alloc[alloc].append((offset, offset + size))
    total = sum(_union(v) for v in per_alloc.values())
    best_temp = max(best_temp, _union(per_alloc.get(temp_alloc, [])))
    if total > best[0]:
      best = (total, t, list(live))
  total, t, at_peak = best
  names = {id(v): k for k, v in values.items()}
  largest = sorted(at_peak, key=lambda x: -x[2][1])[:n]
  return {
    "preallocated_temp": temp_bytes,
    "temp_live_peak": best_temp,
    "live_peak": total,
    "live_peak_at": order.get(t, ""),
    "live_peak_largest": [
      {"bytes": v[1], "value": names.get(id(v), ""), "shape": v[4]}
      for _, _, v in largest
    ],
  }


def from_dump(report: pathlib.Path, n: int = 8) -> dict:
  """:func:`device_live` for the module of a ``*memory-usage-report.txt``
  (its buffer-assignment and live-range files beside it); ``{}`` if
  either is missing."""
  stem = report.name.removesuffix("memory-usage-report.txt")
  assignment = report.with_name(stem + "buffer-assignment.txt")
  live = report.with_name(stem + "live-range.txt")
  if not (assignment.exists() and live.exists()):
    return {}
  return device_live(assignment.read_text(), live.read_text(), n)
