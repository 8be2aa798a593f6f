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
  "bytes"}}``, loop trip counts applied; each move as :func:`host_move`
  reads it."""
  comps, entry = split_computations(hlo_text)
  out: dict = {}
  for name, factor in multipliers(comps, entry).items():
    for line in comps[name]:
      m = INSTR_RE.match(line)
      if not m or m.group(3) not in _MOVES:
        continue
      move = host_move(line, comps)
      if move is None:
        continue
      to_host, moved = move
      dt, dims = SHAPE_RE.search(moved).groups()
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


_MOVES = frozenset(
  (
    "copy-start",
    "copy",
    "dynamic-slice-start",
    "dynamic-update-slice-start",
    "fusion-start",
  )
)
# a shape and its layout (the GPU compiler writes none for a scalar)
_LAYOUT_RE = re.compile(r"\b[a-z]+\d*\[[\d,]*\](?:\{[^}]*\})?")
_CALLS_RE = re.compile(r"calls=%?([\w.\-]+)")


def host_move(line: str, comps: dict) -> tuple[bool, str] | None:
  """``(to_host, moved shape)`` for an instruction that moves data between
  host memory (``S(5)``) and the device's, else ``None``:

  - ``copy-start``: its result is (destination, source, context);
  - ``dynamic-slice-start`` (TPU), or a ``fusion-start`` of a
    ``dynamic-slice`` (GPU): ((operand, indices...), slice, context), a
    slice of a host buffer read into device memory;
  - ``dynamic-update-slice-start`` (TPU), or a ``fusion-start`` of a
    ``dynamic-update-slice`` (GPU): ((buffer, update, indices...), buffer,
    context), the update written into a host buffer in place (its bytes
    move);
  - a synchronous ``copy`` into host memory (its operand's layout is not
    written beside it, so a synchronous load from the host is not seen).

  ``comps``: the module's computations (``split_computations``), where a
  ``fusion-start``'s fused computation is looked up."""
  m = INSTR_RE.match(line)
  if not m:
    return None
  op = m.group(3)
  if op == "fusion-start":
    op = _fused_slice(m.group(4), comps)
  shapes = _LAYOUT_RE.findall(m.group(2))
  if op in ("dynamic-slice-start", "dynamic-update-slice-start"):
    shapes = [x for x in shapes if "[]" not in x]  # not indices, context
  if op == "copy-start" and len(shapes) >= 2:
    dst, src, moved = shapes[0], shapes[1], shapes[0]
  elif op == "dynamic-slice-start" and len(shapes) >= 2:
    src, dst, moved = shapes[0], shapes[1], shapes[1]
  elif op == "dynamic-update-slice-start" and len(shapes) >= 3:
    src, dst, moved = shapes[1], shapes[2], shapes[1]
  elif op == "copy" and shapes:
    dst, src, moved = shapes[0], "", shapes[0]
    if not _HOST_SPACE.search(dst):
      return None
  else:
    return None
  to_host = bool(_HOST_SPACE.search(dst))
  if to_host == bool(_HOST_SPACE.search(src)):
    return None
  return to_host, moved


def _fused_slice(rest: str, comps: dict) -> str | None:
  """``"dynamic-slice-start"`` / ``"dynamic-update-slice-start"`` for an
  asynchronous fusion whose computation's root is that slice, else None."""
  called = _CALLS_RE.search(rest)
  for line in comps.get(called.group(1), ()) if called else ():
    if line.lstrip().startswith("ROOT"):
      root = INSTR_RE.match(line)
      op = root.group(3) if root else None
      if op in ("dynamic-slice", "dynamic-update-slice"):
        return f"{op}-start"
  return None
