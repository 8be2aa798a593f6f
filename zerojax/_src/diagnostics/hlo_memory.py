"""Memory in compiled HLO: the entry computation's parameters and outputs
by memory space, and the copies between device and host memory."""

from __future__ import annotations

import collections
import math
import re

from zerojax._src.diagnostics.hlo import (
  INSTR_RE,
  SHAPE_RE,
  dtype_bytes,
  multipliers,
  split_computations,
)

_HOST_SPACE = re.compile(r"S\(5\)")

_ENTRY_LAYOUT_RE = re.compile(
  r"entry_computation_layout=\{(.*?)\}(?:,\s*\w+=|\s*$)", re.M
)

_LAYOUT_SHAPE_RE = re.compile(
  r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]"
  r"(?:\{([^}]*)\})?"
)
# XLA's memory-space numbers as they appear in layouts: S(5) is host memory
# (JAX's ``pinned_host``); no annotation is the device's own memory.

_MEMORY_SPACES = {None: "device", "5": "pinned_host"}


def host_transfers(hlo_text: str) -> dict[str, dict]:
  """Copies between device and host memory per step (offloaded state,
  activations): ``{"host-to-device" | "device-to-host": {"count",
  "bytes"}}``, loop trip counts applied. A transfer is a ``copy-start``
  (asynchronous) whose source or destination layout is in host memory
  (``S(5)``; its result is (destination, source, context)), a
  ``dynamic-slice-start`` that reads a slice of a host buffer into device
  memory (one layer of a stack in host memory, inside a layer loop; its
  result is ((operand, indices...), slice, context)), a
  ``dynamic-update-slice-start`` that writes a device slice into a host
  buffer in place (its result is ((buffer, update, indices...), buffer,
  context); the update's bytes move), or a synchronous ``copy`` into host
  memory (a ``copy``'s operand layout is not written beside it, so a
  synchronous load from the host is not seen)."""
  comps, entry = split_computations(hlo_text)
  out: dict = {}
  for name, factor in multipliers(comps, entry).items():
    for line in comps[name]:
      m = INSTR_RE.match(line)
      if not m or m.group(3) not in (
        "copy-start",
        "copy",
        "dynamic-slice-start",
        "dynamic-update-slice-start",
      ):
        continue
      shapes = re.findall(r"\b[a-z]+\d*\[[\d,]*\]\{[^}]*\}", m.group(2))
      moved = None  # the shape whose bytes cross (default: the destination)
      if m.group(3) == "copy-start" and len(shapes) >= 2:
        dst, src = shapes[0], shapes[1]
      elif m.group(3) == "dynamic-slice-start" and len(shapes) >= 3:
        dst, src = shapes[-2], shapes[0]
      elif m.group(3) == "dynamic-update-slice-start" and len(shapes) >= 4:
        dst, src = shapes[-2], shapes[1]
        moved = src  # the update, written into the buffer in place
      elif m.group(3) == "copy" and shapes:
        dst, src = shapes[0], ""  # the operand's layout is not inline
        if not _HOST_SPACE.search(dst):
          continue
      else:
        continue
      to_host, from_host = (
        bool(_HOST_SPACE.search(dst)),
        bool(_HOST_SPACE.search(src)),
      )
      if to_host == from_host:
        continue
      dt, dims = SHAPE_RE.search(moved or dst).groups()
      nbytes = math.prod(int(d) for d in dims.split(",") if d) * dtype_bytes(dt)
      row = out.setdefault(
        "device-to-host" if to_host else "host-to-device",
        {"count": 0, "bytes": 0},
      )
      row["count"] += factor
      row["bytes"] += nbytes * factor
  return out


def entry_bytes_by_memory(hlo_text: str) -> dict[str, dict[str, int]]:
  """Per-device bytes of the compiled program's arguments and outputs, by
  the memory space XLA placed them in (``S(n)`` in the entry layout):
  ``{"arguments": {"device": b, "pinned_host": b}, "outputs": {...}}``.

  On CPU, ``compiled.memory_analysis()`` reports host-space bytes as 0 and
  counts host arguments with the device's; the entry layout is where XLA
  records which buffers are host-resident."""
  m = _ENTRY_LAYOUT_RE.search(hlo_text)
  if not m:
    raise ValueError(
      "entry_bytes_by_memory: no entry_computation_layout in "
      "the HLO text; pass compiled.as_text()."
    )
  args, _, outs = m.group(1).partition("->")
  out = {}
  for name, part in (("arguments", args), ("outputs", outs)):
    sums: dict[str, int] = collections.defaultdict(int)
    for dtype, dims, layout in _LAYOUT_SHAPE_RE.findall(part):
      space = re.search(r"S\((\d+)\)", layout or "")
      kind = _MEMORY_SPACES.get(
        space.group(1) if space else None,
        f"S({space.group(1)})" if space else "device",
      )
      n = math.prod(int(d) for d in dims.split(",") if d)
      sums[kind] += n * dtype_bytes(dtype)
    out[name] = dict(sums)
  return out
