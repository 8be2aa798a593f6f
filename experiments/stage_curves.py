"""Loss curves of the default main job at several stages, on one plot.

    python experiments/stage_curves.py                 # stages 0 and 3
    python experiments/stage_curves.py --stages 0,1,2,3 --steps 100
    python experiments/stage_curves.py --out runs/zeropp_curves --runs \
      "stage 3=;qwZ + qgZ int8=--weight-bits 8 --grad-bits 8;qwZ + qgZ int4=--weight-bits 8 --grad-bits 4"

Runs ``python -m zerojax.train`` once per stage (same seed, same data), or
once per ``label=flags`` of ``--runs``, then plots train and held-out loss
and prints the largest relative gap of each curve to the first, and the
final held-out losses. ``--reuse`` keeps a run whose ``metrics.jsonl`` is
already there. Output: ``<out>/stage_curves.png`` and
``<out>/stage_curves.json``.
"""

import argparse
import json
import pathlib
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--stages", default="0,3")
  p.add_argument("--steps", type=int, default=400)
  p.add_argument(
    "--runs",
    default=None,
    help="';'-separated label=main-job flags, instead of --stages",
  )
  p.add_argument(
    "--reuse", action="store_true", help="keep runs whose metrics.jsonl exists"
  )
  p.add_argument(
    "--title",
    default="Main job (bf16 + fp32 master): stages on the same seed and data",
  )
  p.add_argument("--out", default="runs/stage_curves")
  args, extra = p.parse_known_args()
  out = pathlib.Path(args.out)
  if args.runs:
    runs = dict(r.split("=", 1) for r in args.runs.split(";"))
    runs = {label: flags.split() for label, flags in runs.items()}
  else:
    runs = {f"stage {s}": ["--stage", s] for s in args.stages.split(",")}
  curves = {}
  for label, flags in runs.items():
    run = out / label.replace(" ", "_").replace("+", "")
    if not (args.reuse and (run / "metrics.jsonl").exists()):
      subprocess.run(
        [
          sys.executable,
          "-m",
          "zerojax.train",
          *flags,
          "--steps",
          str(args.steps),
          "--log-every",
          "1",
          "--sample-len",
          "0",
          "--out",
          str(run),
          *extra,
        ],
        check=True,
      )
    curves[label] = [
      json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()
    ]
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, recs in curves.items():
    tr = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    ev = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
    ax.plot(*zip(*tr), lw=1, label=f"{label} train")
    ax.plot(*zip(*ev), "o--", label=f"{label} held-out")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/byte)")
  ax.set_title(args.title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "stage_curves.png", dpi=120)
  first = next(iter(curves))
  base = {r["step"]: r["loss"] for r in curves[first] if "loss" in r}
  base_eval = [r["eval_loss"] for r in curves[first] if "eval_loss" in r][-1]
  gaps = {}
  for label, recs in curves.items():
    rel = [
      abs(r["loss"] - base[r["step"]]) / base[r["step"]]
      for r in recs
      if "loss" in r and r["step"] in base
    ]
    last = [r["eval_loss"] for r in recs if "eval_loss" in r][-1]
    gaps[label] = {
      "max_rel_gap_first_50": max(rel[:50]),
      "max_rel_gap_all": max(rel),
      "final_eval_loss": last,
      "final_eval_gap": last / base_eval - 1,
    }
  import os
  import platform

  import jax

  (out / "stage_curves.json").write_text(
    json.dumps(
      {
        "command": sys.argv,
        "jax_version": jax.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, 8 fake CPU "
        f"devices",
        "gaps": gaps,
        "curves": curves,
      },
      indent=1,
    )
  )
  print(json.dumps(gaps, indent=2))


if __name__ == "__main__":
  main()
