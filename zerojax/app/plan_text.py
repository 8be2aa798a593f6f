"""The planner's report as text: the per-stage memory and collective
table, saved activations, communication per mesh axis, ZeRO++'s settings
and the largest GPT that fits (``python -m zerojax.plan`` without
``--json``; :mod:`zerojax.app.plan_cli` computes what they show)."""

from __future__ import annotations

from zerojax.app import tables
from zerojax.cost import GB, HARDWARE, ZEROPP_ROWS, zeropp_comm


def host_bytes(args) -> float | None:
  """The host memory bound per device in bytes (None: unbounded)."""
  if args.host_memory_gb is None or not args.offload:
    return None
  return args.host_memory_gb * GB


def _table(plans) -> str:
  offload = any(p.offload for p in plans)
  head = (
    "stage",
    "params GB",
    "master GB",
    "optimizer GB",
    "grads GB",
    "total GB/device",
    *(("device GB", "host GB", "host<->dev GB/step") if offload else ()),
    "AR GB/step",
    "RS GB/step",
    "AG GB/step",
  )
  rows = [
    (
      str(p.stage),
      f"{p.params / GB:.2f}",
      f"{p.master / GB:.2f}",
      f"{p.optimizer / GB:.2f}",
      f"{p.grads / GB:.2f}",
      f"{p.total / GB:.2f}",
      *(
        (
          f"{p.device / GB:.2f}",
          f"{p.host / GB:.2f}",
          f"{p.host_traffic / GB:.2f}",
        )
        if offload
        else ()
      ),
      *(
        f"{p.collectives.get(k, 0) / GB:.1f}"
        for k in ("all-reduce", "reduce-scatter", "all-gather")
      ),
    )
    for p in plans
  ]
  return tables.markdown(head, rows)


def _comm_table(plans, hw) -> str:
  head = (
    "stage",
    "axis",
    f"{hw['fast_name']} GB/chip",
    f"{hw['slow_name']} GB/chip",
    "seconds/step",
  )
  rows = []
  for p in plans:
    for axis, e in p.comm.items():
      rows.append(
        (
          str(p.stage),
          axis,
          f"{e['fast_bytes'] / GB:.3f}",
          f"{e['slow_bytes'] / GB:.3f}",
          f"{e['seconds']:.3f}",
        )
      )
  return tables.markdown(head, rows)


def print_report(args, config, mesh, slices, plans, acts, fitting, bound):
  hw = HARDWARE[args.hardware]
  fast = args.fast_bw or hw["fast"]
  slow = args.slow_bw or hw["slow"]
  print(
    f"GPT {plans[0].n_params:,} params (width {config.width}, depth "
    f"{config.depth}, vocab {config.vocab}) on mesh {mesh} (N = "
    f"{args.devices} data devices); bf16 params/grads, fp32 master + "
    f"AdamW moments; GB = 1e9 bytes"
  )
  print(_table(plans))
  if acts:
    print(
      f"\nsaved activations per device (bf16, {args.batch} sequence(s) "
      f"of {config.seq_len} per data device, model axis "
      f"{mesh.get('model', 1)}; logits and in-layer temporaries not "
      f"included)"
    )
    print("| remat policy | device GB | host GB | one layer GB |")
    print("|---|---|---|---|")
    for name, a in acts.items():
      print(
        f"| {name} | {a['device'] / GB:.3f} | {a['host'] / GB:.3f} | "
        f"{a['per_layer'] / GB:.4f} |"
      )
  if len(mesh) > 1 or slices > 1:
    print(
      f"\ncommunication per step and chip, {slices} slice(s); "
      f"{args.hardware}: {hw['fast_name']} {fast:.3g} B/s, "
      f"{hw['slow_name']} {slow:.3g} B/s per chip ({args.collectives} "
      f"collectives, no overlap; TP activations not counted)"
    )
    print(_comm_table(plans, hw))
  if args.zeropp:
    _print_zeropp(args, slices, plans[0].n_params, hw, fast, slow)
  if fitting:
    host = host_bytes(args)
    on_host = (
      ""
      if host is None
      else f" and {host / GB:g} GB of host memory (at the least offload "
      f"share that fits the device)"
    )
    print(
      f"\nlargest GPT whose model state fits {args.memory_gb:g} GB per "
      f"device{on_host}:"
    )
    for s, n in fitting.items():
      print(
        f"  stage {s}: "
        f"{'nothing fits' if n is None else f'{_count(n)} params'}"
        f"{_binds_text(bound.get(s))}"
      )


def _count(n: float) -> str:
  """A parameter count in billions, or millions below one billion."""
  return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def _binds_text(b: dict | None) -> str:
  """``what_binds``' answer as the tail of a largest-GPT line."""
  if not b or b["memory"] is None:  # the search's cap, not a memory
    return ""
  more = _count(b["n_params"])
  if b["memory"] == "host":
    return f"; at {more} the host memory overflows ({b['host'] / GB:.1f} GB)"
  if not b["device_parts"]:
    return f"; at {more} no offload share fits the device"
  part, size = max(b["device_parts"].items(), key=lambda kv: kv[1])
  total = sum(b["device_parts"].values())
  return (
    f"; at {more} the device overflows ({total / GB:.1f} GB, most of it "
    f"{part}: {size / GB:.1f} GB)"
  )


def _print_zeropp(args, slices, n_params, hw, fast, slow):
  print(
    f"\nstage 3 with ZeRO++ (zerojax.ZeroPP, default blocks), "
    f"{args.devices} chips as {slices} nodes of {args.devices // slices}; "
    f"{args.hardware}: {hw['fast_name']} {fast:.3g} B/s, "
    f"{hw['slow_name']} {slow:.3g} B/s per chip; GB per chip and step"
  )
  print(
    f"| setting | {hw['fast_name']} GB | {hw['slow_name']} GB | "
    f"{hw['slow_name']} vs stage 3 | comm seconds/step |"
  )
  print("|---|---|---|---|---|")
  base = None
  for name, kw in ZEROPP_ROWS:
    e = zeropp_comm(n_params, args.devices, slices, fast=fast, slow=slow, **kw)
    base = base or e["slow_bytes"]
    print(
      f"| {name} | {e['fast_bytes'] / GB:.3f} | {e['slow_bytes'] / GB:.3f} "
      f"| {e['slow_bytes'] / base:.3f} | {e['seconds']:.3f} |"
    )
