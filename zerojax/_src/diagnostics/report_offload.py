""":class:`~zerojax._src.diagnostics.report.Report`'s text for what it
measured of offload: bytes each way, the link time, where the host copies
sit in the schedule."""

from __future__ import annotations


def offload_lines(o: dict) -> list[str]:
  """The report's offload section from its ``offload`` dict (see
  ``report._offload_traffic``)."""
  how = (
    "on the device (master + optimizer state)"
    if not o["host_fraction"]
    else f"streamed in {o['chunks']} chunks (largest "
    f"{o['largest_chunk_fraction']:.1%} of the offloaded state; "
    f"{o['prefetched']} loaded during the previous one's update, "
    f"{o['crossing']} while its results go back"
    + (
      f", {o['stacks_by_rows']} layer stacks a few layers per chunk"
      if o["stacks_by_rows"]
      else ""
    )
    + "); "
    f"{o['host_fraction']:.1%} of master + optimizer state on the host"
    + (
      f" (offload={o['asked_fraction']:g} asked; whole arrays)"
      if 0 < o["asked_fraction"] < 1
      else ""
    )
    if o["streamed"]
    else f"whole state at once ({o['reason']})"
  )
  if o["params_on_host"]:
    how += "; the params' shards on the host"
  copies = sum(r["sync"] + r["async"] for r in o["host_copies"].values())
  rows = o["host_copies"].values()
  behind = sum(r["overlapped"] for r in rows)
  beside = sum(r.get("beside_compute", 0) for r in rows)
  both = sum(r.get("both_ways", 0) for r in rows)
  lines = [
    "",
    f"offload: update {how}",
    f"  host->device bytes/step per device   "
    f"{o['host_to_device_bytes']:>14,}  theory "
    f"{o['theory_host_to_device_bytes']:>14,}",
    f"  device->host bytes/step per device   "
    f"{o['device_to_host_bytes']:>14,}  theory "
    f"{o['theory_device_to_host_bytes']:>14,}",
    f"  (measured from the program's {o['measured_from']}"
    + (
      "; reads per layer loop are not seen)"
      if o["measured_from"] == "entry buffers"
      else ")"
    ),
    f"  (ZeRO-Offload's host-side update would move "
    f"{o['theory_host_compute_bytes']:,}: compute-dtype "
    f"gradients down, params up)",
    f"  at {o['link_gb_s']:g} GB/s each way: "
    f"{1e3 * o['host_to_device_s']:.2f} ms down, "
    f"{1e3 * o['device_to_host_s']:.2f} ms up per step",
    f"  host copies in the schedule: {copies}, beside a matmul: "
    f"{behind}, beside any compute: {beside}, while a copy the "
    f"other way moves: {both}"
    + (
      ""
      if copies
      else " (this backend moves host buffers without copy-start/copy-done)"
    ),
  ]
  loops = o.get("across_loops") or {}
  for kind, way in (("host-to-device", "down"), ("device-to-host", "back")):
    row = loops.get(kind)
    if row and row["bytes"]:
      lines.append(
        f"  {way} while a layer loop runs: {row['bytes_across_loops']:,} "
        f"of {row['bytes']:,} bytes "
        f"({row['bytes_across_loops'] / row['bytes']:.0%})"
      )
  if o.get("outside_loops_s") is not None:
    down, up = (
      loops[k]["bytes_outside_loops"]
      for k in ("host-to-device", "device-to-host")
    )
    lines.append(
      f"  while no layer loop runs: {down:,} down, {up:,} back: "
      f"{1e3 * o['outside_loops_s']:.2f} ms at {o['link_gb_s']:g} GB/s "
      f"one way at a time (no pass's compute hides it)"
    )
  return lines
