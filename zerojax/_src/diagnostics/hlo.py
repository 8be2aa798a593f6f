"""Collectives in a compiled XLA program, with loop trip counts applied.

Reads the optimized HLO text (``jitted.lower(...).compile().as_text()``):
each collective is counted by the size of its *full* (unsharded) buffer --
an all-gather by its output, a reduce-scatter by its output times the group
size, an all-reduce by its output -- so a reduce-scatter of a leaf and an
all-gather of it each count the leaf's size, the convention of the ZeRO
paper's communication analysis. Collectives inside a ``while`` body (a
``lax.scan``) are multiplied by the loop's known trip count, nested loops by
the product.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

KINDS = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
)

_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}

_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")

INSTR_RE = re.compile(
  r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+"
  r"([a-z][\w\-]*)\((.*)$"
)

SHAPE_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")

_CALLEE_RE = re.compile(
  r"\b(body|condition|to_apply|calls|branch_computations)="
  r"(\{[^}]*\}|%?[\w.\-]+)"
)

_CHAIN_RE = re.compile(r'chain_id="(\d+)"')
# a multi-slice TPU program moves data between slices with host-transfer
# sends the megascale runtime turns into the collective named here; the
# sent buffer is the collective's operand

_DCN_RE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')

_OP_NAME_RE = re.compile(
  r'op_name="[^"]*?(all_gather|reduce_scatter|psum_scatter)"'
)

_ASKED = {
  "all_gather": "all-gather",
  "reduce_scatter": "reduce-scatter",
  "psum_scatter": "reduce-scatter",
}

_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the compiled program."""

  kind: str  # all-reduce, all-gather, reduce-scatter, ...
  dtype: str  # element type communicated (first operand's)
  shape: tuple  # full-buffer shape of the first buffer
  group_size: int  # devices per replica group
  elements: int  # full-buffer elements of one execution (all buffers)
  bytes: int  # full-buffer bytes of one execution (all buffers)
  count: int  # executions per step (loop trip counts applied)
  computation: str  # HLO computation it sits in
  groups: tuple = ()  # device ids of each replica group (partition ids)
  written_for: str = ""  # the collective the program asked for, where the
  # compiler wrote it as another (an all-reduce of a
  # zero-padded buffer for an all-gather): from the
  # instruction's op_name; "" when the same or unknown
  across_slices: bool = False  # over the data-center network between TPU
  # slices (a multi-slice program's megascale
  # transfer), group_size = 0: not in the
  # program's partitions

  @property
  def total_bytes(self) -> int:
    return self.bytes * self.count

  @property
  def total_elements(self) -> int:
    return self.elements * self.count


def dtype_bytes(dtype: str) -> int:
  if dtype in _BYTES:
    return _BYTES[dtype]
  m = re.match(r"f8|s4|u4", dtype)
  if m:
    return 1
  raise ValueError(
    f"zerojax._src.diagnostics.hlo: unknown HLO element type {dtype!r}"
  )


def _iota(dims, perm, n):
  ids = np.arange(n).reshape(dims)
  return ids.transpose(perm) if perm else ids


def replica_groups(rest: str, num_devices: int) -> tuple:
  """The replica groups of one collective, as tuples of device ids.

  Reads the explicit (``{{0,2},{1,3}}``), iota (``[4,2]<=[2,4]T(1,0)``) and
  mesh (``mesh['axis_0'=2,...] device_ids=(...) {'axis_1'}``) forms, and a
  collective-permute's source-target pairs; ``()`` when none is given
  (every device in one group)."""
  m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", rest)
  if m and m.group(1).strip():
    return tuple(
      tuple(int(x) for x in g.split(",") if x.strip())
      for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
    )
  m = re.search(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}", rest)
  if m:
    return tuple(
      tuple(int(x) for x in g.split(","))
      for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
    )
  m = re.search(
    r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest
  )
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else None
    ids = _iota(dims, perm, math.prod(dims)).reshape(shape)
    return tuple(tuple(int(x) for x in g) for g in ids.reshape(shape[0], -1))
  m = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\]"
    r"(?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}",
    rest,
  )
  if m:
    sizes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [n for n, _ in sizes]
    shape = [int(v) for _, v in sizes]
    n = math.prod(shape)
    if m.group(2):
      dims = [int(x) for x in m.group(2).split(",")]
      perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else None
      ids = _iota(dims, perm, n).reshape(shape)
    else:
      ids = np.arange(n).reshape(shape)
    over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
    keep = [i for i in range(len(shape)) if i not in over]
    ids = ids.transpose(keep + over).reshape(
      -1, math.prod(shape[i] for i in over) if over else 1
    )
    return tuple(tuple(int(x) for x in g) for g in ids)
  return ()


def _group_size(rest: str, default: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", rest)
  if m:
    return len([x for x in m.group(1).split(",") if x.strip()])
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    names = re.findall(r"'([^']+)'", m.group(2))
    return math.prod(int(sizes[n]) for n in names)
  return default


def split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """``({computation name: its instruction lines}, entry name)`` of an HLO
  module's text."""
  comps: dict[str, list[str]] = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    m = _COMP_RE.match(line)
    if m and not line.startswith(" "):
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is not None:
      if line.startswith("}"):
        current = None
      else:
        comps[current].append(line)
  if entry is None:
    raise ValueError(
      "zerojax._src.diagnostics.hlo: no ENTRY computation in the HLO text."
    )
  return comps, entry


def _defs(lines) -> dict:
  """``{name: (op, operand text)}`` of one computation's instructions."""
  out = {}
  for line in lines:
    m = INSTR_RE.match(line)
    if m:
      out[m.group(1)] = (m.group(3), m.group(4))
  return out


def _constant(defs: dict, name: str, hops: int = 8):
  """The integer constant ``name`` is (through copies and bitcasts)."""
  for _ in range(hops):
    op, rest = defs.get(name, (None, ""))
    if op == "constant":
      value = re.match(r"\s*(-?\d+)\)", rest)
      return int(value.group(1)) if value else None
    if op not in ("copy", "bitcast", "convert"):
      return None
    name = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
  return None


def _trip_count(rest: str, comps: dict, caller: str) -> int:
  """Iterations of the ``while`` whose operand text is ``rest``: the
  compiler's ``known_trip_count`` where it wrote one (XLA CPU and GPU);
  else read from the loop (the TPU compiler writes none): the condition
  compares a tuple element, the counter, with a constant bound (``LT`` or
  ``LE``), and the counter starts at the constant the caller puts in that
  element (0 when it cannot be read). 1 when the loop is not of that form."""
  t = _TRIP_RE.search(rest)
  if t:
    return int(t.group(1))
  cond = re.search(r"\bcondition=%?([\w.\-]+)", rest)
  arg = re.match(r"\s*%?([\w.\-]+)\)", rest)
  if not cond or cond.group(1) not in comps:
    return 1
  defs = _defs(comps[cond.group(1)])
  root = next(
    (line for line in comps[cond.group(1)] if line.lstrip().startswith("ROOT")),
    "",
  )
  m = INSTR_RE.match(root)
  direction = re.search(r"direction=(LT|LE)\b", root)
  if not m or m.group(3) != "compare" or not direction:
    return 1
  a, b = re.findall(r"%([\w.\-]+)", m.group(4).split("),")[0])[:2]
  bound, counter = _constant(defs, b), a
  if bound is None:
    return 1
  index = re.search(r"index=(\d+)", defs.get(counter, ("", ""))[1])
  start = 0
  if arg and index:
    caller_defs = _defs(comps[caller])
    op, operands = caller_defs.get(arg.group(1), (None, ""))
    if op == "tuple":
      names = re.findall(r"%([\w.\-]+)", operands)
      i = int(index.group(1))
      if i < len(names):
        start = _constant(caller_defs, names[i]) or 0
  n = bound - start + (direction.group(1) == "LE")
  return max(n, 1)


def multipliers(comps: dict, entry: str) -> dict[str, int]:
  """How many times each computation runs per step (loop trip counts
  applied, nested loops multiplied)."""
  mult: dict[str, int] = collections.defaultdict(int)

  def visit(name: str, factor: int, depth=0):
    if name not in comps or depth > 64:
      return
    mult[name] += factor
    for line in comps[name]:
      m = INSTR_RE.match(line)
      if not m:
        continue
      op, rest = m.group(3), m.group(4)
      trip = 1
      if op == "while":
        trip = _trip_count(rest, comps, name)
      for key, callee in _CALLEE_RE.findall(rest):
        names = re.findall(r"%?([\w.\-]+)", callee.strip("{}"))
        for c in names:
          visit(
            c, factor * (trip if key in ("body", "condition") else 1), depth + 1
          )

  visit(entry, 1)
  return mult


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """All collectives of an optimized HLO module, with per-step counts."""
  comps, entry = split_computations(hlo_text)
  mult = multipliers(comps, entry)
  out = []
  chains = set()
  for name, factor in mult.items():
    for line in comps[name]:
      m = INSTR_RE.match(line)
      if not m:
        continue
      result, op, rest = m.group(2), m.group(3), m.group(4)
      kind = op[:-5] if op.endswith("-done") else op
      dcn = _DCN_RE.search(rest) if op == "send" else None
      if dcn:
        shapes = [
          (dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in SHAPE_RE.findall(result)[:1]
        ]
        nbytes = sum(math.prod(s) * dtype_bytes(dt) for dt, s in shapes)
        out.append(
          Collective(
            dcn.group(1).lower().replace("_", "-"),
            shapes[0][0],
            shapes[0][1],
            0,
            math.prod(shapes[0][1]),
            nbytes,
            factor,
            name,
            across_slices=True,
          )
        )
        continue
      if kind not in KINDS:
        continue
      # the TPU compiler writes one asynchronous collective as a chain of
      # pieces (start, continuations beside matmuls, done) that each hold
      # it again, sharing a chain id: counted once
      chain = _CHAIN_RE.search(rest)
      if chain:
        if chain.group(1) in chains:
          continue
        chains.add(chain.group(1))
      shapes = [
        (dt, tuple(int(d) for d in dims.split(",") if d))
        for dt, dims in SHAPE_RE.findall(result)
      ]
      if not shapes:
        continue
      groups = replica_groups(rest, num_devices)
      group = (
        len(groups[0])
        if groups and kind != "collective-permute"
        else _group_size(rest, num_devices)
      )
      scale = group if kind == "reduce-scatter" else 1
      nbytes = sum(math.prod(s) * dtype_bytes(dt) for dt, s in shapes) * scale
      nelems = sum(math.prod(s) for _, s in shapes) * scale
      dt0, s0 = shapes[0]
      if kind == "reduce-scatter" and s0:
        s0 = (s0[0] * group,) + s0[
          1:
        ]  # the dimension is unknown; size is right
      asked = _OP_NAME_RE.search(rest)
      asked = _ASKED[asked.group(1)] if asked else ""
      out.append(
        Collective(
          kind,
          dt0,
          s0,
          group,
          nelems,
          nbytes,
          factor,
          name,
          groups,
          asked if asked and asked != kind else "",
        )
      )
  return out


def collective_axes(c: Collective, mesh) -> tuple[str, ...]:
  """The mesh axes a collective spans: those whose coordinate varies inside
  one of its replica groups (device ``i`` is ``mesh.devices.flat[i]``, the
  order of the program's device assignment)."""
  shape = mesh.devices.shape
  if not c.groups:
    return tuple(a for a, s in zip(mesh.axis_names, shape) if s > 1)
  varies = set()
  for g in c.groups:
    coords = np.array(np.unravel_index(np.asarray(g), shape))
    varies |= {i for i in range(len(shape)) if len(set(coords[i])) > 1}
  return tuple(mesh.axis_names[i] for i in sorted(varies))


def crosses_processes(c: Collective, mesh) -> bool:
  """Whether any replica group holds devices of more than one process."""
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices).reshape(-1)
  groups = c.groups or (tuple(range(procs.size)),)
  return any(len({int(procs[i]) for i in g}) > 1 for g in groups)


def bytes_by_axis(hlo_text: str, mesh) -> dict[tuple[str, str], int]:
  """Bytes per step by ``(collective kind, spanned axes)``, the axes joined
  with ``+`` (e.g. ``("all-reduce", "replica")``); full-buffer convention
  over each group. A multi-slice TPU program's transfers between slices
  are ``(kind, "slices")``: the compiler splits the program per slice and
  moves these over the data-center network, outside its partitions."""
  totals: dict[tuple[str, str], int] = collections.defaultdict(int)
  for c in collectives(hlo_text, mesh.devices.size):
    axes = (
      "slices" if c.across_slices else "+".join(collective_axes(c, mesh)) or "-"
    )
    totals[(c.kind, axes)] += c.total_bytes
  return dict(totals)


def collective_bytes(hlo_text: str, num_devices: int) -> dict[str, int]:
  """Bytes per step by collective kind (full-buffer convention)."""
  totals: dict[str, int] = collections.defaultdict(int)
  for c in collectives(hlo_text, num_devices):
    totals[c.kind] += c.total_bytes
  return dict(totals)
