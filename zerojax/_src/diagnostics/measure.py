"""What a state holds per device: the layout table and bytes by category.

Measured figures come from the arrays' addressable shards (what is really
allocated, padding included); theory figures from the ZeRO formulas applied
to the logical (unpadded) sizes.
"""

from __future__ import annotations

import collections

import jax

from zerojax._src.diagnostics import cost
from zerojax._src.records.spec import ZeroState
from zerojax._src.records.trees import leaf_dtype
from zerojax._src.step.deleted import reject_deleted


def _shard_nbytes(x) -> int:
  shards = x.addressable_shards
  return int(shards[0].data.nbytes) if shards else 0


def _memory_kind(x) -> str:
  """Where an array lives: ``device``, or ``pinned_host`` when offloaded."""
  sharding = getattr(x, "sharding", None)
  return getattr(sharding, "memory_kind", None) or "device"


def layout_rows(state: ZeroState) -> list[dict]:
  """One row per state leaf: path, shapes, sharding, bytes per device."""
  reject_deleted(state, "zerojax.diagnostics.layout_rows")
  spec = state.spec
  rows = []
  sections = [
    ("params", [(r.param, "params") for r in spec.leaves]),
    ("master", [(r.shard, "master") for r in spec.leaves if r.trainable]),
    (
      "opt_state",
      [(o.layout, f"opt_state.{o.field}") for o in spec.opt_leaves],
    ),
  ]
  for section, records in sections:
    tree = getattr(state, section)
    if tree is None:
      continue
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, x), (layout, category) in zip(leaves, records):
      if layout.sharded:
        how = f"dim {layout.dim} over {spec.tx.axis_name!r}"
        if layout.pad:
          how += f" (padded {layout.shape[layout.dim]}->{layout.padded})"
      else:
        how = "replicated" + (f" ({layout.reason})" if layout.reason else "")
      model = [
        f"dim {d} over {'+'.join(map(repr, m))}"
        for d, m in enumerate(layout.model)
        if m
      ]
      if model:
        how += "; model: " + ", ".join(model)
      rows.append(
        dict(
          category=category,
          section=section,
          path=section + jax.tree_util.keystr(path),
          shape=tuple(layout.shape),
          dtype=str(leaf_dtype(x.dtype)),
          storage_shape=tuple(x.shape),
          sharded=layout.sharded,
          how=how,
          dim=layout.dim,
          placement=str(layout.spec(spec.tx.axis_name)),
          memory=_memory_kind(x),
          bytes_per_device=_shard_nbytes(x)
          if hasattr(x, "addressable_shards")
          else int(
            cost.layout_bytes(
              layout, spec.tx.num_shards, spec.tx.model_axes, x.dtype.itemsize
            )
          ),
        )
      )
  return rows


def layout_table(state: ZeroState) -> str:
  """A printable table of :func:`layout_rows`, with totals per category."""
  reject_deleted(state, "zerojax.diagnostics.layout_table")
  rows = layout_rows(state)
  head = ("path", "shape", "dtype", "sharding", "bytes/device")
  body = [
    (
      r["path"],
      "x".join(map(str, r["shape"])) or "()",
      r["dtype"],
      r["how"],
      f"{r['bytes_per_device']:,}",
    )
    for r in rows
  ]
  widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
  fmt = lambda cols: "  ".join(
    c.ljust(w) if i < 4 else c.rjust(w)
    for i, (c, w) in enumerate(zip(cols, widths))
  )
  tx = state.spec.tx
  where = f"devices ({tx.axis_name!r})"
  if len(tx.mesh.axis_names) > 1:
    where += f" of mesh {dict(tx.mesh.shape)}" + (
      f", replicated over {tx.replica_axis!r}" if tx.replica_axis else ""
    )
  lines = [
    f"zerojax stage {state.spec.stage} over {tx.num_shards} {where}",
    fmt(head),
    fmt(["-" * w for w in widths]),
  ]
  lines += [fmt(b) for b in body]
  lines.append("")
  for cat, nbytes in state_bytes(state).items():
    lines.append(f"{cat:<28} {nbytes:>14,} bytes/device")
  by_memory = memory_bytes(state)
  if set(by_memory) != {"device"}:
    lines.append("")
    for kind, nbytes in by_memory.items():
      lines.append(f"{'in ' + kind + ' memory':<28} {nbytes:>14,} bytes/device")
  return "\n".join(lines)


def memory_bytes(state: ZeroState) -> dict[str, int]:
  """Persistent state bytes per device by memory kind (``device``, and
  ``pinned_host`` for the master copy and optimizer state with
  ``zero(..., offload=True)``), from the arrays themselves."""
  out: dict[str, int] = collections.defaultdict(int)
  for r in layout_rows(state):
    out[r["memory"]] += r["bytes_per_device"]
  return dict(out)


def state_bytes(state: ZeroState) -> dict[str, int]:
  """Measured persistent bytes per device, by category."""
  out: dict[str, int] = collections.defaultdict(int)
  for r in layout_rows(state):
    out[r["category"]] += r["bytes_per_device"]
  return dict(out)


def theory_bytes(state: ZeroState) -> dict[str, float]:
  """ZeRO's per-device bytes for this state's stage, by category
  (:func:`zerojax._src.diagnostics.cost.stage_state_bytes`, ideal reading).

  Logical (unpadded) bytes, divided by N where the stage shards the
  category: params at stage 3; master and optimizer state at stages 1-3.
  Also ``grads``: the gradient buffer in ``reduce_dtype``, transient within
  a step (full at stages 0-1, 1/N at 2-3).
  """
  return cost.stage_state_bytes(state.spec, ideal=True)
