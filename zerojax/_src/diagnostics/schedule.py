"""Where a compiled program's collectives run: alone, or beside compute.

Reads a backend's *scheduled* program (``compiled.as_text()``: every
computation lists its instructions in the order they run) and says, for
each collective instruction, how it is issued:

* ``"sync"``: an instruction of its own in a scheduled computation; the
  device waits for it (XLA CPU's collectives are all so).
* ``"async"``: split into a start and a done with other instructions
  scheduled between them. Two spellings: ``all-gather-start`` /
  ``all-gather-done`` (GPU, and XLA's generic form), and the TPU
  compiler's chains: a ``fusion`` whose computation ends in the custom call
  ``AsyncCollectiveStart``, then ``async_collective_fusion`` computations
  that hold the same collective again beside compute (the layer's matmul, a
  ``convolution``: the continuation form), then a ``fusion`` ending in
  ``AsyncCollectiveDone``; every piece carries the chain's
  ``frontend_attributes={chain_id=...}``, so a chain is one collective.

Copies between host memory (``S(5)`` in a layout: offloaded state or
activations) and the device's are read the same way, as the kinds
``host-to-device`` and ``device-to-host`` (``copy-start`` / ``copy-done``).

The overlapped compute of an asynchronous collective is what is scheduled
between its start and its done (the continuations included), counted in
matmuls (``convolution`` or ``dot`` instructions, in fusions too), the
work that hides a collective. Loops are not unrolled: each
instruction is read once where it stands (a ``while`` body's per-layer
collective once), with the computation it sits in.
"""

from __future__ import annotations

import dataclasses
import re

from zerojax._src.diagnostics.hlo import KINDS, dtype_bytes, split_computations
from zerojax._src.diagnostics.hlo_memory import host_move

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_MATMUL = re.compile(r"\s(?:convolution|dot)\(")
_CHAIN = re.compile(r'chain_id="(\d+)"')
_CYCLES = re.compile(r'estimated_cycles":"(\d+)"')
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_LOOP_PARTS = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_CALLEES = re.compile(
  r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)"
  r"|branch_computations=\{([^}]*)\}"
)


@dataclasses.dataclass(frozen=True)
class Issued:
  """How one collective instruction is issued in the schedule."""

  kind: str  # all-gather, reduce-scatter, all-reduce, ...
  mode: str  # "sync" or "async"
  computation: str  # the scheduled computation it runs in
  overlapped_matmuls: int  # matmuls that run while it moves
  # a start/done pair: positions of its start and done in the computation,
  # and the computing instructions scheduled between them
  span: tuple[int, int] | None = None
  overlapped_compute: int = 0


def _matmuls(comps, name, seen=None) -> int:
  """Matmul instructions in computation ``name`` and the fusions it calls."""
  seen = set() if seen is None else seen
  if name in seen or name not in comps:
    return 0
  seen.add(name)
  n = 0
  for line in comps[name]:
    if _MATMUL.search(line):
      n += 1
    for callee in _CALLS.findall(line):
      n += _matmuls(comps, callee, seen)
  return n


def _line_matmuls(comps, line) -> int:
  callee = _CALLS.search(line)
  return (1 if _MATMUL.search(line) else 0) + (
    _matmuls(comps, callee.group(1)) if callee else 0
  )


def _collectives_in(comps, name):
  """``(kind, chain id or None)`` of each collective in a fused computation."""
  out = []
  for line in comps.get(name, ()):
    m = _INSTR.match(line)
    if m and m.group(2) in KINDS:
      chain = _CHAIN.search(line)
      out.append((m.group(2), chain.group(1) if chain else None))
  return out


def issued(hlo_text: str) -> list[Issued]:
  """Every collective of a scheduled program with how it is issued (see
  the module docstring). A TPU collective split into a start, continuation
  fusions and a done (one ``chain_id``) is one collective."""
  comps, _ = split_computations(hlo_text)
  fused = {
    c
    for lines in comps.values()
    for line in lines
    if " fusion(" in line
    for c in _CALLS.findall(line)
  }
  out = []
  for comp, lines in comps.items():
    if comp in fused:
      continue  # read where its fusion is scheduled
    instrs = [
      (m.group(1), m.group(2), line)
      for line in lines
      for m in [_INSTR.match(line)]
      if m
    ]
    position = {name: i for i, (name, _, _) in enumerate(instrs)}
    chains: dict = {}
    for i, (name, op, line) in enumerate(instrs):
      if op == "fusion":
        callee = _CALLS.search(line)
        found = _collectives_in(comps, callee.group(1)) if callee else []
      elif op in KINDS:
        chain = _CHAIN.search(line)
        found = [(op, chain.group(1) if chain else None)]
      elif op.endswith("-start") and (
        op[:-6] in KINDS or _host_copy(line, comps)
      ):
        done = _first_done(instrs, position, name)
        between = instrs[i + 1 : done] if done is not None else []
        out.append(
          Issued(
            _host_copy(line, comps) or op[:-6],
            "async",
            comp,
            sum(_line_matmuls(comps, l) for _, _, l in between),
            None if done is None else (i, done),
            sum(1 for _, o, _ in between if _computes(o)),
          )
        )
        continue
      else:
        continue
      for kind, chain in found:
        if chain is None:
          out.append(Issued(kind, "sync", comp, 0))
        else:
          chains.setdefault(chain, (kind, []))[1].append(i)
    for kind, at in chains.values():
      first, last = min(at), max(at)
      between = sum(
        _line_matmuls(comps, l) for _, _, l in instrs[first + 1 : last]
      )
      out.append(
        Issued(kind, "async" if last > first else "sync", comp, between)
      )
  return out


def _host_copy(line: str, comps: dict) -> str | None:
  """``"host-to-device"`` or ``"device-to-host"`` for an asynchronous move
  between host memory and the device's
  (:func:`~zerojax._src.diagnostics.hlo_memory.host_move`), else ``None``."""
  move = host_move(line, comps)
  if move is None or " copy(" in line:
    return None
  return "device-to-host" if move[0] else "host-to-device"


# instructions that move or name data rather than compute on it
_BOOKKEEPING = frozenset(
  (
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "opt-barrier",
    "copy",
    "while",
    "conditional",
    "call",
    "custom-call",
    "send",
    "recv",
  )
)


def _computes(op: str) -> bool:
  return not (op in _BOOKKEEPING or op.endswith(("-start", "-done", "-update")))


HOST_KINDS = ("host-to-device", "device-to-host")


def _first_done(instrs, position, name):
  """Index of the first ``*-done`` after ``name`` that reads it (through
  ``get-tuple-element``s), or ``None``."""
  users = {name}
  for j in range(position[name] + 1, len(instrs)):
    other, op, line = instrs[j]
    rhs = line.split("=", 1)[1].split(", metadata=")[0]
    if not users & set(_OPERANDS.findall(rhs)):
      continue
    if op.endswith("-done"):
      return j
    if op == "get-tuple-element":
      users.add(other)
  return None


def summary(hlo_text: str) -> dict:
  """Per collective kind: how many are issued synchronously and how many
  asynchronously, and how many of those overlap at least one matmul.
  ``{kind: {"sync": n, "async": n, "overlapped": n}}``; a collective in a
  loop body counts once. Host copies (:data:`HOST_KINDS`) also count
  ``beside_compute`` (any computing instruction scheduled while they move:
  the streamed update's elementwise fusions too) and ``both_ways`` (in
  flight while a copy the other way is: both directions of the link
  busy at once)."""
  out: dict = {}
  found = issued(hlo_text)
  for c in found:
    row = out.setdefault(c.kind, {"sync": 0, "async": 0, "overlapped": 0})
    row[c.mode] += 1
    if c.mode == "async" and c.overlapped_matmuls:
      row["overlapped"] += 1
    if c.kind in HOST_KINDS:
      row["beside_compute"] = row.get("beside_compute", 0) + bool(
        c.overlapped_compute
      )
      row["both_ways"] = row.get("both_ways", 0) + any(
        _concurrent(c, o)
        for o in found
        if o.kind in HOST_KINDS and o.kind != c.kind
      )
  return out


def _concurrent(a: Issued, b: Issued) -> bool:
  """Two start/done pairs in flight at once in one computation."""
  if a.span is None or b.span is None or a.computation != b.computation:
    return False
  return a.span[0] < b.span[1] and b.span[0] < a.span[1]


def host_copy_cycles(hlo_text: str) -> dict:
  """The compute the compiler's own cost model puts beside the host
  copies, in the cycles it estimates per instruction (the TPU compiler
  annotates each scheduled fusion with ``estimated_cycles``; other
  backends do not, and get ``{}``). For each computation holding async
  host copies, summed over them: ``compute`` (every instruction's cycles
  in it; a loop instruction carries none, so its body is not counted),
  ``beside_host_to_device`` and
  ``beside_device_to_host`` (cycles scheduled while a copy that way is in
  flight) and ``beside_any``."""
  comps, _ = split_computations(hlo_text)
  copies = [c for c in issued(hlo_text) if c.kind in HOST_KINDS and c.span]
  out = dict.fromkeys(
    ("compute", "beside_host_to_device", "beside_device_to_host", "beside_any"),
    0,
  )
  found = False
  for comp in sorted({c.computation for c in copies}):
    lines = [line for line in comps[comp] if _INSTR.match(line)]
    cycles = [int(m.group(1)) if (m := _CYCLES.search(l)) else 0 for l in lines]
    found |= any(cycles)
    spans = {
      kind: {
        i
        for c in copies
        if c.kind == kind and c.computation == comp
        for i in range(c.span[0] + 1, c.span[1])
      }
      for kind in HOST_KINDS
    }
    out["compute"] += sum(cycles)
    for kind, at in spans.items():
      out["beside_" + kind.replace("-", "_")] += sum(cycles[i] for i in at)
    out["beside_any"] += sum(cycles[i] for i in set().union(*spans.values()))
  return out if found else {}


def _in_loops(comps: dict) -> set[str]:
  """The computations that run inside a ``while``: its bodies and
  conditions and every computation they call, transitively."""
  todo = [
    name
    for lines in comps.values()
    for line in lines
    if " while(" in line
    for name in _LOOP_PARTS.findall(line)
  ]
  seen: set[str] = set()
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      for callee, branches in _CALLEES.findall(line):
        todo += [callee] if callee else _OPERANDS.findall(branches)
  return seen


def host_copies_across_loops(hlo_text: str) -> dict:
  """Host copies in flight while a loop runs, and those that move while
  none does. The layer loops of the forward and backward passes are
  ``while`` instructions; a copy started before one and done after it
  moves while the loop's body computes -- the loops' time, which
  :func:`host_copy_cycles` cannot count -- and so does a copy inside a
  loop's body (a layer's params read from host memory). Per direction:
  the asynchronous copies and their bytes per device (``copies``,
  ``bytes``; a copy in a loop body counted once), those that cross at
  least one loop (``across_loops``, ``bytes_across_loops``), and those
  outside every loop body that cross none (``outside_loops``,
  ``bytes_outside_loops``: with the layers in loops, as in a scanned
  model, no pass's compute runs beside them); and ``loops_crossed``, the
  loops any copy crosses. ``{}`` for a program without asynchronous host
  copies."""
  comps, _ = split_computations(hlo_text)
  copies = [c for c in issued(hlo_text) if c.kind in HOST_KINDS and c.span]
  if not copies:
    return {}
  inside = _in_loops(comps)
  out: dict = {
    kind: dict.fromkeys(
      (
        "copies",
        "bytes",
        "across_loops",
        "bytes_across_loops",
        "outside_loops",
        "bytes_outside_loops",
      ),
      0,
    )
    for kind in HOST_KINDS
  }
  crossed = set()
  for c in copies:
    instrs = [
      (m.group(1), m.group(2), line)
      for line in comps[c.computation]
      for m in [_INSTR.match(line)]
      if m
    ]
    start, done = c.span
    move = host_move(
      instrs[start][2], comps
    )  # a slice's bytes, not its buffer's
    dtype, dims = _SHAPE.search(move[1]).groups()
    nbytes = dtype_bytes(dtype)
    for d in filter(None, dims.split(",")):
      nbytes *= int(d)
    loops = [n for n, op, _ in instrs[start + 1 : done] if op == "while"]
    row = out[c.kind]
    row["copies"] += 1
    row["bytes"] += nbytes
    if loops:
      row["across_loops"] += 1
      row["bytes_across_loops"] += nbytes
      crossed.update((c.computation, n) for n in loops)
    elif c.computation not in inside:
      row["outside_loops"] += 1
      row["bytes_outside_loops"] += nbytes
  out["loops_crossed"] = len(crossed)
  return out
