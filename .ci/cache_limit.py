"""What a size limit on JAX's persistent compilation cache costs per write.

    python .ci/cache_limit.py                  # 1,500 programs
    python .ci/cache_limit.py --programs 3000

Compiles ``--programs`` distinct small programs (one CPU device) into a
fresh persistent cache, every compile written (minimum compile time 0),
once with no size limit and once with ``jax_compilation_cache_max_size``
set (16 GiB, never reached). With a limit JAX locks the cache directory
around each read and write and, before each write, scans every entry to
choose what to evict, so a write costs more the more entries there are.
Writes one JSON file: the mean seconds per compile-and-write in each block
of ``--block`` programs, for both runs, with the JAX version and machine.
The test suite's cache (tests/conftest.py) has no limit because of it.
"""

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _child(programs: int, block: int) -> list:
  """In a fresh process (the cache is configured before the first
  compile): seconds per compile, averaged per block."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((4,))
  per_block, t_block = [], time.perf_counter()
  for i in range(1, programs + 1):
    jax.jit(lambda v, i=i: v * i + i).lower(x).compile()
    if i % block == 0:
      now = time.perf_counter()
      per_block.append((now - t_block) / block)
      t_block = now
  return per_block


def run(limit: bool, programs: int, block: int) -> dict:
  cache = tempfile.mkdtemp(prefix="zerojax-cache-limit-")
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    JAX_COMPILATION_CACHE_DIR=cache,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )
  env.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
  if limit:
    env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(16 << 30)
  out = subprocess.run(
    [sys.executable, __file__, "--child", str(programs), "--block", str(block)],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  entries = sum(
    1 for p in pathlib.Path(cache).iterdir() if p.name.endswith("-cache")
  )
  return {
    "size_limit": limit,
    "entries_written": entries,
    "s_per_compile_by_block": json.loads(out.stdout.splitlines()[-1]),
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--programs", type=int, default=1500)
  ap.add_argument("--block", type=int, default=250)
  ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  if args.child is not None:
    print(json.dumps(_child(args.child, args.block)))
    return
  import jax

  runs = [run(limit, args.programs, args.block) for limit in (False, True)]
  rec = {
    "jax": jax.__version__,
    "python": platform.python_version(),
    "cpu_count": os.cpu_count(),
    "machine": platform.platform(),
    "programs": args.programs,
    "block": args.block,
    "runs": runs,
  }
  out = pathlib.Path(
    args.out or ROOT / "runs" / f"cache_limit_jax{jax.__version__}.json"
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(rec, indent=1) + "\n")
  for r in runs:
    print(
      f"size limit {r['size_limit']!s:5}: {r['entries_written']} entries;"
      " ms per compile by block: "
      + ", ".join(f"{1e3 * s:.0f}" for s in r["s_per_compile_by_block"])
    )
  print("->", out)


if __name__ == "__main__":
  main()
