"""ZeRO-3 peak memory against depth at a fixed width, one process per depth.

    python experiments/depth_scaling.py            # L = 4, 8, 16 at width 512

Per-layer gathering means peak memory should grow with depth by the sharded
state (params, master/moments, gradient shards) and the saved activations of
the extra layers, not by their full weights. The table prints, per depth,
process peak RSS (8 fake devices: the sum over devices plus the runtime),
the state bytes per device, XLA's temp bytes per device, and per added layer
the RSS growth next to what one full layer would cost on all 8 devices.
"""

import argparse
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--depths", default="4,8,16")
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--stage", type=int, default=3)
  p.add_argument("--precision", default="fp32")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--out", default="runs/depth_scaling")
  args = p.parse_args()
  runs = []
  for depth in [int(d) for d in args.depths.split(",")]:
    cmd = [
      sys.executable,
      str(HERE / "bench_stages.py"),
      "--worker",
      "--config",
      str(args.stage),
      "--depth",
      str(depth),
      "--width",
      str(args.width),
      "--heads",
      "8",
      "--seq-len",
      "128",
      "--batch",
      "16",
      "--steps",
      str(args.steps),
      "--precision",
      args.precision,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    run["depth"] = depth
    runs.append(run)
    print(f"depth {depth}: done", file=sys.stderr, flush=True)
  outdir = pathlib.Path(args.out)
  outdir.mkdir(parents=True, exist_ok=True)
  (outdir / "depth_scaling.json").write_text(
    json.dumps({"runs": runs}, indent=2)
  )
  layer_params = 12 * args.width**2 + 13 * args.width  # one GPT block
  itemsize = 2 if args.precision == "bf16" else 4
  full_layer_all_devices = layer_params * itemsize * 8
  mib = lambda x: f"{x / 2**20:,.1f}"
  print(
    f"ZeRO-{args.stage}, GPT width {args.width}, {args.precision}, 8 fake "
    f"CPU devices; one full block = {mib(layer_params * itemsize)} MiB, "
    f"{mib(full_layer_all_devices)} MiB on all 8 devices"
  )
  print(
    "| depth | params | peak RSS MiB | state MiB/dev | XLA temp MiB/dev |"
    " RSS growth per added layer MiB |"
  )
  print("|---|---|---|---|---|---|")
  prev = None
  for r in runs:
    state = sum(r["state_bytes_per_device"].values())
    growth = ""
    if prev is not None:
      growth = mib(
        (r["peak_rss_bytes"] - prev["peak_rss_bytes"])
        / (r["depth"] - prev["depth"])
      )
    print(
      f"| {r['depth']} | {r['n_params']:,} | {mib(r['peak_rss_bytes'])} | "
      f"{mib(state)} | {mib(r['xla_memory']['temp'])} | {growth} |"
    )
    prev = r


if __name__ == "__main__":
  main()
