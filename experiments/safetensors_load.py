"""Loading a safetensors checkpoint into a ZeRO-3 state: peak host memory
per process and load time, against a naive load and against reading the
same bytes with safetensors alone.

    python experiments/safetensors_load.py             # a 2.2 GB checkpoint
    python experiments/safetensors_load.py --layers 22 # about 4.5 GB

The checkpoint is a GPT-2 of the reference GPT's shape (width ``--width``,
``--layers`` blocks, context 1024, byte vocabulary, untied head) in
Hugging Face's names, written once as 1 GiB shards plus the index. Each
measurement runs in fresh processes on 8 fake CPU devices (1 process x 8,
or 2 processes x 4 through ``zerojax.launch``), after one read that puts
the files in the page cache:

- ``safetensors``: every tensor read with ``safe_open(...).get_tensor``,
  nothing kept: the read alone (one process, all of them); freed buffers
  are reused, so the process never faults in the model's worth of fresh
  memory.
- ``safetensors_kept``: ``safetensors.numpy.load_file`` of every shard,
  all kept: the same bytes landing in fresh host memory, as a loaded
  state must (on CPU devices, host memory is the devices' memory).
- ``zerojax``: ``zerojax.checkpoint.load_safetensors`` at stage 3 (fp32,
  SGD: the state is the params), each device's rows read from the files.
- ``naive``: ``safetensors.numpy.load_file`` of every shard, the per-layer
  tensors stacked, then ``zerojax.init``: the whole model on every host
  before it is sharded.

Memory is the process's anonymous resident set (``RssAnon``, sampled every
5 ms): safetensors maps the files, and the mapped pages it touches (page
cache, reclaimable) are counted apart as ``RssFile``. Per process:
``baseline`` (JAX up, devices made, before the load), ``peak``, and
``share``: the bytes of the state's shards on its devices (host memory,
for CPU devices). The target: ``peak - baseline - share`` at most the
largest tensor, plus a fixed overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WIDTH, CONTEXT, VOCAB = 2048, 1024, 256
SHARD_BYTES = 2**30


def _model(args):
  from zerojax.app import gpt

  return gpt.GPTConfig(
    vocab=VOCAB,
    seq_len=CONTEXT,
    width=args.width,
    depth=args.layers,
    heads=args.width // 128,
    attention="einsum",
  )


def _tensors(model):
  """``[(name, shape)]`` of the checkpoint, in the order it is written."""
  import jax

  from zerojax.app import gpt

  mapping = gpt.hf_gpt2_mapping(model, tied=False)
  shapes = jax.eval_shape(lambda: gpt.init(model, jax.random.key(0)))
  flat = {
    jax.tree_util.keystr(p): x.shape
    for p, x in jax.tree_util.tree_flatten_with_path(shapes)[0]
  }
  out = []
  for path, m in mapping.items():
    names = [m] if isinstance(m, str) else list(getattr(m, "names", m))
    shape = flat[path] if len(names) == 1 else flat[path][1:]
    if getattr(m, "transpose", False):
      shape = shape[:-2] + (shape[-1], shape[-2])
    out += [(n, tuple(shape)) for n in names]
  return out


def write_checkpoint(directory: pathlib.Path, model) -> dict:
  """Random float32 tensors in 1 GiB shards plus the index (skipped when
  the index is already there)."""
  import numpy as np
  from safetensors.numpy import save_file

  index = directory / "model.safetensors.index.json"
  tensors = _tensors(model)
  total = sum(4 * int(np.prod(s)) for _, s in tensors)
  if index.is_file():
    if json.loads(index.read_text())["metadata"]["total_size"] == total:
      return json.loads(index.read_text())
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  shards, current, size = [], [], 0
  for name, shape in tensors:
    nbytes = 4 * int(np.prod(shape))
    if current and size + nbytes > SHARD_BYTES:
      shards.append(current)
      current, size = [], 0
    current.append((name, shape))
    size += nbytes
  shards.append(current)
  weight_map = {}
  for k, shard in enumerate(shards):
    file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    data = {
      n: rng.standard_normal(s, dtype=np.float32) * 0.02 for n, s in shard
    }
    save_file(data, directory / file, metadata={"format": "pt"})
    weight_map.update({n: file for n in data})
    del data
  out = {"metadata": {"total_size": total}, "weight_map": weight_map}
  index.write_text(json.dumps(out, indent=2))
  return out


class _Memory:
  """Peak ``RssAnon`` and ``RssFile`` of this process, sampled."""

  def __init__(self):
    self.peak = {"RssAnon": 0, "RssFile": 0}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  @staticmethod
  def now() -> dict:
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
      key, _, value = line.partition(":")
      if key in ("RssAnon", "RssFile"):
        out[key] = int(value.split()[0]) * 1024
    return out

  def _run(self):
    while not self._stop.is_set():
      for k, v in self.now().items():
        self.peak[k] = max(self.peak[k], v)
      time.sleep(0.005)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    for k, v in self.now().items():
      self.peak[k] = max(self.peak[k], v)


def _files(directory: pathlib.Path) -> list[pathlib.Path]:
  return sorted(directory.glob("model-*.safetensors"))


def worker(args):
  """One measurement in this process; its record goes to ``args.record``."""
  from zerojax import distributed

  distributed.initialize()
  import jax
  import numpy as np
  import optax

  import zerojax
  from zerojax import checkpoint
  from zerojax.app import gpt

  model = _model(args)
  directory = pathlib.Path(args.checkpoint)
  tx = zerojax.zero(optax.sgd(1e-3), stage=3)
  template = jax.eval_shape(lambda: gpt.init(model, jax.random.key(0)))
  mapping = gpt.hf_gpt2_mapping(model, tied=False)
  jax.block_until_ready(jax.device_put(np.zeros(8)))  # the runtime is up
  baseline = _Memory.now()
  state, share = None, 0
  start = time.perf_counter()
  with _Memory() as memory:
    if args.worker == "safetensors":
      from safetensors import safe_open

      for file in _files(directory):
        with safe_open(file, "numpy") as f:
          for name in f.keys():
            f.get_tensor(name)
    elif args.worker == "safetensors_kept":
      from safetensors.numpy import load_file

      kept = [load_file(file) for file in _files(directory)]
      share = sum(x.nbytes for d in kept for x in d.values())
    elif args.worker == "zerojax":
      state = checkpoint.load_safetensors(
        directory, tx, template, mapping=mapping
      )
    else:  # naive: everything on the host, then shard
      from safetensors.numpy import load_file

      tensors = {}
      for file in _files(directory):
        tensors.update(load_file(file))
      leaves = {}
      for path, m in mapping.items():
        names = [m] if isinstance(m, str) else list(getattr(m, "names", m))
        x = [tensors[n] for n in names]
        x = x[0] if len(names) == 1 else np.stack(x)
        leaves[path] = x.T if getattr(m, "transpose", False) else x
      params = jax.tree_util.tree_map_with_path(
        lambda p, _: leaves[jax.tree_util.keystr(p)], template
      )
      state = zerojax.init(params, tx)
      jax.block_until_ready(state)
  seconds = time.perf_counter() - start
  if state is not None:
    share = sum(
      s.data.nbytes
      for x in jax.tree.leaves(state.params)
      for s in x.addressable_shards
    )
  record = {
    "mode": args.worker,
    "process": jax.process_index(),
    "processes": jax.process_count(),
    "local_devices": jax.local_device_count(),
    "seconds": seconds,
    "baseline_anon_bytes": baseline["RssAnon"],
    "peak_anon_bytes": memory.peak["RssAnon"],
    "peak_file_bytes": memory.peak["RssFile"],
    "share_bytes": share,
    "excess_bytes": memory.peak["RssAnon"] - baseline["RssAnon"] - share,
  }
  out = pathlib.Path(args.record)
  out = out.with_name(f"{out.stem}.{jax.process_index()}.json")
  out.write_text(json.dumps(record))


def _run(args, mode: str, processes: int) -> list[dict]:
  from zerojax import launch, xla_flags

  records = pathlib.Path(tempfile.mkdtemp(prefix="st_bench_")) / "r.json"
  command = [
    sys.executable,
    __file__,
    "--worker",
    mode,
    "--record",
    str(records),
    "--checkpoint",
    args.checkpoint,
    "--width",
    str(args.width),
    "--layers",
    str(args.layers),
  ]
  if processes == 1:
    env = dict(
      os.environ, XLA_FLAGS=xla_flags.cpu_device_flags(8), JAX_PLATFORMS="cpu"
    )
    subprocess.run(command, env=env, check=True)
  else:
    code = launch.launch(command, processes, 8 // processes, stream=False)
    if code:
      raise SystemExit(f"{mode} x {processes} processes failed ({code})")
  return [
    json.loads(records.with_name(f"r.{i}.json").read_text())
    for i in range(processes)
  ]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=WIDTH)
  parser.add_argument("--layers", type=int, default=11)
  parser.add_argument("--repeat", type=int, default=3)
  parser.add_argument(
    "--modes",
    default="safetensors,safetensors_kept,zerojax,naive",
    help="comma-separated measurements (each x1 and, but safetensors, x2)",
  )
  parser.add_argument(
    "--checkpoint",
    default=os.path.join(tempfile.gettempdir(), "zerojax_safetensors_bench"),
  )
  parser.add_argument("--out", default="docs/data/safetensors_load.json")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--record", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    return worker(args)

  import jax
  import numpy as np

  model = _model(args)
  index = write_checkpoint(pathlib.Path(args.checkpoint), model)
  shapes = _tensors(model)
  largest = max(4 * int(np.prod(s)) for _, s in shapes)
  total = index["metadata"]["total_size"]
  print(f"checkpoint: {total / 2**30:.2f} GiB, {len(shapes)} tensors")
  _run(args, "safetensors", 1)  # the files into the page cache
  rounds = {}
  for r in range(args.repeat):  # interleaved, so drift hits every mode
    modes = args.modes.split(",")
    for mode, processes in [(m, 1) for m in modes] + [
      (m, 2) for m in modes if not m.startswith("safetensors")
    ]:
      got = _run(args, mode, processes)
      rounds.setdefault(f"{mode} x{processes}", []).append(got)
      print(
        f"round {r} {mode:11s} x{processes}: "
        f"{max(g['seconds'] for g in got):6.2f} s, peak anon "
        + ", ".join(f"{g['peak_anon_bytes'] / 2**30:.2f}" for g in got)
        + " GiB, excess "
        + ", ".join(f"{g['excess_bytes'] / 2**20:.0f}" for g in got)
        + " MiB",
        flush=True,
      )
  summary = {}
  for name, runs in rounds.items():
    per_process = [
      {
        k: statistics.median(run[i][k] for run in runs)
        for k in runs[0][0]
        if isinstance(runs[0][0][k], (int, float))
      }
      for i in range(len(runs[0]))
    ]
    summary[name] = {
      "seconds": statistics.median(
        max(p["seconds"] for p in run) for run in runs
      ),
      "per_process": per_process,
    }

  def ratio(name, baseline):
    if name in summary and baseline in summary:
      return summary[name]["seconds"] / summary[baseline]["seconds"]
    return None  # not measured in this run (--modes)

  result = {
    "device": "cpu",
    "jax_version": jax.__version__,
    "argv": sys.argv,
    "cpu_count": os.cpu_count(),
    "checkpoint_bytes": total,
    "tensors": len(shapes),
    "largest_tensor_bytes": largest,
    "model": {"width": args.width, "layers": args.layers, "context": CONTEXT},
    "repeat": args.repeat,
    "summary": summary,
    "load_time_ratio_vs_safetensors": ratio("zerojax x1", "safetensors x1"),
    "load_time_ratio_vs_safetensors_kept": ratio(
      "zerojax x1", "safetensors_kept x1"
    ),
    "naive_time_ratio_vs_safetensors": ratio("naive x1", "safetensors x1"),
    "rounds": rounds,
  }
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2))
  for name, s in summary.items():
    p = s["per_process"]
    print(
      f"{name:15s} {s['seconds']:6.2f} s  excess per process "
      + ", ".join(f"{q['excess_bytes'] / 2**20:.0f}" for q in p)
      + f" MiB (largest tensor {largest / 2**20:.0f} MiB)"
    )
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
