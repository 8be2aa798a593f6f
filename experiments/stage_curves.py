"""Loss curves of the default main job at several stages, on one plot.

    python experiments/stage_curves.py                 # stages 0 and 3
    python experiments/stage_curves.py --stages 0,1,2,3 --steps 100

Runs ``python -m zerojax.train`` once per stage (same seed, same data), then
plots train and held-out loss and prints the largest relative gap between
the curves. Output: ``<out>/stage_curves.png`` and ``<out>/stage_curves.json``.
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
  p.add_argument("--out", default="runs/stage_curves")
  args, extra = p.parse_known_args()
  out = pathlib.Path(args.out)
  curves = {}
  for stage in [int(s) for s in args.stages.split(",")]:
    run = out / f"stage{stage}"
    subprocess.run([sys.executable, "-m", "zerojax.train", "--stage", str(stage),
                    "--steps", str(args.steps), "--log-every", "1",
                    "--sample-len", "0", "--out", str(run), *extra], check=True)
    curves[stage] = [json.loads(l) for l in
                     (run / "metrics.jsonl").read_text().splitlines()]
  fig, ax = plt.subplots(figsize=(7, 4))
  for stage, recs in curves.items():
    tr = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    ev = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
    ax.plot(*zip(*tr), lw=1, label=f"stage {stage} train")
    ax.plot(*zip(*ev), "o--", label=f"stage {stage} held-out")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/byte)")
  ax.set_title("Main job (bf16 + fp32 master): stages on the same seed and data")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "stage_curves.png", dpi=120)
  base_stage = min(curves)
  base = {r["step"]: r["loss"] for r in curves[base_stage] if "loss" in r}
  gaps = {}
  for stage, recs in curves.items():
    rel = [abs(r["loss"] - base[r["step"]]) / base[r["step"]]
           for r in recs if "loss" in r and r["step"] in base]
    gaps[stage] = {"max_rel_gap_first_50": max(rel[:50]),
                   "max_rel_gap_all": max(rel)}
  (out / "stage_curves.json").write_text(json.dumps(gaps, indent=2))
  print(json.dumps(gaps, indent=2))


if __name__ == "__main__":
  main()
