"""What the C heap holds after a state is built: zerojax stage 1 against
the GSPMD ZeRO-1 layout's init, on the bench's plain GPT.

    python experiments/heap_after_init.py --rounds 2

Each configuration runs in its own process: params born replicated on the
mesh by a jitted init (as a script makes them), then ``zerojax.init`` at
stage 1 (with ``runtime/host_heap.py``'s release switched off, to see what
it returns) or the ZeRO-1 peer's layout. At each point: the resident set
(``/proc/self/statm``) and glibc's own count (``mallinfo2``: heap in use,
heap free, mapped); the last point after ``malloc_trim(0)``. Writes
``<out>/heap_after_init.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

CONFIGS = ("1", "zero1")


def _mallinfo() -> dict:
  import ctypes

  fields = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
  )

  class MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in fields]

  libc = ctypes.CDLL(None)
  libc.mallinfo2.restype = MallInfo2
  m = libc.mallinfo2()
  return {
    "heap_bytes": m.arena,
    "in_use_bytes": m.uordblks,
    "free_bytes": m.fordblks,
    "mapped_bytes": m.hblkhd,
  }


def run_one(config: str) -> dict:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import ctypes
  import functools

  import jax
  import optax

  import zerojax
  from zerojax._src.runtime import host_heap

  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  import peers
  import plain_gpt

  host_heap.release_free_heap = lambda: False  # measured here instead
  page = os.sysconf("SC_PAGE_SIZE")
  points = {}

  def mark(name):
    with open("/proc/self/statm") as f:
      rss = int(f.read().split()[1]) * page
    points[name] = {"rss_bytes": rss, **_mallinfo()}

  mesh = zerojax.make_mesh()
  init_fn = functools.partial(
    plain_gpt.init,
    **{
      k: plain_gpt.SIZE_FLAGS[k] for k in ("vocab", "width", "depth", "seq_len")
    },
  )
  params = jax.jit(
    init_fn,
    out_shardings=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()
    ),
  )(jax.random.key(0))
  jax.block_until_ready(params)
  mark("params")
  optimizer = optax.adamw(1e-3)
  if config == "zero1":
    loss = functools.partial(
      plain_gpt.loss, heads=plain_gpt.SIZE_FLAGS["heads"]
    )
    _, p, o = peers.make_peer("zero1", loss, optimizer, params, mesh)
    state = (p, o)
  else:
    state = zerojax.init(
      params, zerojax.zero(optimizer, stage=int(config), mesh=mesh)
    )
  jax.block_until_ready(state)
  mark("state")
  ctypes.CDLL(None).malloc_trim(0)
  mark("state, after malloc_trim")
  return {"config": config, "points": points, "jax_version": jax.__version__}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--out", default="runs/heap_after_init")
  p.add_argument("--one", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.one:
    print("RECORD " + json.dumps(run_one(args.one)), flush=True)
    return
  records = []
  for r in range(args.rounds):
    for config in CONFIGS:
      proc = subprocess.run(
        [sys.executable, __file__, "--one", config],
        capture_output=True,
        text=True,
        check=True,
      )
      rec = json.loads(
        [l for l in proc.stdout.splitlines() if l.startswith("RECORD ")][-1][7:]
      )
      rec["round"] = r
      mib = {
        k: {f: round(v / 2**20, 1) for f, v in pt.items()}
        for k, pt in rec["points"].items()
      }
      print(config, json.dumps(mib), flush=True)
      records.append(rec)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "heap_after_init.json").write_text(
    json.dumps({"machine": "8 fake CPU devices", "records": records}, indent=2)
  )
  print(f"wrote {out / 'heap_after_init.json'}")


if __name__ == "__main__":
  main()
