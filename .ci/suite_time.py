"""Wall time of the test suite as CI runs it, per test and in total.

    python .ci/suite_time.py                      # the default suite
    python .ci/suite_time.py --marker slow        # the slow suite
    python .ci/suite_time.py --no-cache           # the baseline
    python .ci/suite_time.py --jax-phases         # where it goes

Runs ``python -m pytest -n 2`` (the README's test command; ``-m slow``
with ``--marker slow``) with the Python that runs this script, and writes
one JSON file: the JAX version, the machine (CPU count, platform), the
suite's wall time, its outcome counts, whether the persistent compilation
cache was on (as ``tests/conftest.py`` reports it in pytest's header: on
for jaxlib >= 0.11; ``--no-cache`` turns it off with
``JAX_ENABLE_COMPILATION_CACHE=false``), the XLA flags it printed there, and
every test phase that took at least ``--min-s`` seconds (pytest's
``--durations``), slowest first. With ``--jax-phases`` (the
``.ci/jax_phases.py`` plugin in every test process) also the
seconds JAX spent tracing, lowering and compiling, in total and per test
file, against the tests' own durations.
"""

import argparse
import collections
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

ROOT = pathlib.Path(__file__).resolve().parent.parent
_DURATION = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)$")
_OUTCOME = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected)")


def run(
  marker: str, workers: int, min_s: float, cache: bool, jax_phases: bool = False
) -> dict:
  cmd = [
    sys.executable,
    "-m",
    "pytest",
    "-n",
    str(workers),
    "-p",
    "no:cacheprovider",
    "--durations=0",
    f"--durations-min={min_s}",
  ]
  if marker:
    cmd += ["-m", marker]
  env = dict(os.environ)
  if not cache:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  phases_dir = None
  if jax_phases:
    phases_dir = tempfile.mkdtemp(prefix="zerojax-jax-phases-")
    cmd += ["-p", "jax_phases"]
    env["ZEROJAX_JAX_PHASES_DIR"] = phases_dir
    env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT / ".ci")] + [p for p in [env.get("PYTHONPATH")] if p]
    )
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
  wall = time.perf_counter() - t0
  lines = proc.stdout.splitlines()
  phases = [
    {"seconds": float(m[1]), "phase": m[2], "test": m[3]}
    for m in map(_DURATION.match, lines)
    if m
  ]
  summary = next(
    (l for l in reversed(lines) if " in " in l and _OUTCOME.search(l)), ""
  )
  outcomes = {
    k.rstrip("s") if k.startswith("error") else k: int(n)
    for n, k in _OUTCOME.findall(summary)
  }
  rec = {
    "command": " ".join(["python"] + cmd[1:]),
    # CI's newest-JAX leg keeps a third of each larger matrix (conftest)
    "matrix_cases": os.environ.get("ZEROJAX_MATRIX_CASES", "all"),
    "marker": marker or None,
    "returncode": proc.returncode,
    "wall_s": round(wall, 1),
    "outcomes": outcomes,
    "summary": summary.strip("= "),
    "jax": version("jax"),
    "jaxlib": version("jaxlib"),
    "python": platform.python_version(),
    "cpu_count": os.cpu_count(),
    "machine": platform.platform(),
    "compilation_cache": next(
      (
        l.split("persistent compilation cache ", 1)[1]
        for l in lines
        if l.startswith("zerojax: persistent compilation cache ")
      ),
      None,
    ),
    "xla_flags": next(
      (
        l.split("zerojax: XLA_FLAGS ", 1)[1]
        for l in lines
        if l.startswith("zerojax: XLA_FLAGS ")
      ),
      None,
    ),
    "phases_over_min_s": phases,
    "min_s": min_s,
    "failures": [l for l in lines if l.startswith(("FAILED", "ERROR"))],
  }
  if phases_dir:
    rec["jax_phases"] = _jax_phases(phases_dir, phases)
  return rec


def _jax_phases(phases_dir: str, phases: list) -> dict:
  """The plugin's per-process files summed: seconds per phase in total and
  per test file, beside the tests' durations (all of them when
  ``--min-s 0``)."""
  per_test = collections.defaultdict(collections.Counter)
  for f in pathlib.Path(phases_dir).glob("*.json"):
    for test, rec in json.loads(f.read_text()).items():
      per_test[test].update(rec)
  durations = collections.Counter()
  for p in phases:
    durations[p["test"].split("::")[0]] += p["seconds"]
  files = collections.defaultdict(collections.Counter)
  for test, rec in per_test.items():
    files[test.split("::")[0]].update(rec)
  for name, sec in durations.items():
    files[name]["test_seconds"] = sec
  total = sum(per_test.values(), collections.Counter())
  rnd = lambda c: {k: round(v, 1) for k, v in sorted(c.items())}
  return {
    "total": rnd(total),
    "test_seconds": round(sum(durations.values()), 1),
    "per_file": {
      k: rnd(v)
      for k, v in sorted(files.items(), key=lambda kv: -kv[1]["test_seconds"])
    },
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--marker", default="", help="pytest -m (e.g. slow)")
  ap.add_argument("--workers", type=int, default=2)
  ap.add_argument("--min-s", type=float, default=5.0)
  ap.add_argument(
    "--no-cache",
    action="store_true",
    help="the persistent compilation cache off",
  )
  ap.add_argument(
    "--out",
    default=None,
    help="JSON path (default: "
    "runs/suite_time/suite_<marker>_jax<version>.json)",
  )
  ap.add_argument(
    "--jax-phases",
    action="store_true",
    help="also JAX's trace / lower / compile seconds per test "
    "file (.ci/jax_phases.py)",
  )
  args = ap.parse_args(argv)
  rec = run(
    args.marker, args.workers, args.min_s, not args.no_cache, args.jax_phases
  )
  tag = ("_nocache" if args.no_cache else "") + (
    "_phases" if args.jax_phases else ""
  )
  out = pathlib.Path(
    args.out
    or ROOT
    / "runs"
    / "suite_time"
    / (f"suite_{args.marker or 'default'}{tag}_jax{rec['jax']}.json")
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(rec, indent=1) + "\n")
  print(
    f"{rec['summary']} (wall {rec['wall_s']} s, jax {rec['jax']}, "
    f"cache {rec['compilation_cache']}) -> {out}"
  )
  return 0 if rec["returncode"] == 0 else 1


if __name__ == "__main__":
  sys.exit(main())
