"""The GPU bench's steps compiled for an H200 (or H100) from a machine with
no GPU: the GPU compiler's memory plan and schedule of each configuration.

XLA's GPU compiler runs ahead of time here (``lib/gpu_aot.py``: the CUDA
plugin and cuDNN from PyPI, no driver or device). Each configuration of
``gpu_bench.py`` (the same GPT, batch, optimizer and options: ``offload``,
``params``, ``cross``, ``whole``, ``accumN``) is traced with abstract state
and compiled in a fresh process. Per configuration: the compiler's
per-device plan (peak = arguments + outputs + temp - aliases, and the host
memory's arguments and temp), the host copies per step and how the
schedule issues them (``zerojax.aot.compiled_report``), the planner's host
bytes each way, and how the streamed update is chunked. Where an H200 run
of the same size and configuration is committed
(``docs/data/gpu_bench_*_h200_*.json``), its planned and measured peaks
sit beside the compile's (``measured``): the check that a compile here
predicts that machine.

    pip install "jax-cuda13-plugin==$JAXLIB" "jax-cuda13-pjrt==$JAXLIB" \\
        nvidia-cudnn-cu13
    python experiments/gpu_compile.py --sizes 2.7b,7b \\
        --configs plain,3+offload,3+offload+whole

writes ``<out>/gpu_compile_<gpu>[_<tag>]_jax<version>.json``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "lib"))

import gpu_aot  # noqa: E402
import gpu_bench  # noqa: E402

DATA = HERE.parent / "docs" / "data"


def compile_one(size: str, config: str, gpu: str) -> dict:
  """Compiles one configuration in this process; returns its record."""
  gpu_aot.one_cpu_device()
  import jax
  import jax.numpy as jnp

  import zerojax
  from zerojax._src.diagnostics import offload_stream
  from zerojax.app import gpt

  s, opts, model = gpu_bench.configure(size, config, "cuda")
  accum = opts["accum"]
  opt = gpu_bench._optimizer(100)
  loss_fn = lambda p, b: gpt.loss(p, b, model)
  key = jax.random.key(0)
  shapes = jax.eval_shape(lambda: gpt.init(model, key))
  rows = accum * s["batch"]
  batch_shapes = {k: ((rows, s["seq_len"]), jnp.int32) for k in ("x", "y")}
  out = {
    "size": size,
    "config": config,
    "gpu": gpu_aot.GPUS[gpu]["name"],
    "n_params": gpt.num_params(model),
    "jax_version": jax.__version__,
    "attention": model.attention,
    "remat": model.remat,
    "batch": rows,
    "accum_steps": accum,
  }
  mesh = zerojax.make_mesh(devices=jax.devices()[:1])
  t0 = time.perf_counter()
  if opts["stage"] is None:
    batch = {
      k: jax.ShapeDtypeStruct(shape, dtype)
      for k, (shape, dtype) in batch_shapes.items()
    }

    plain_step = gpu_bench.plain_step_fn(loss_fn, opt, accum)
    state = (shapes, jax.eval_shape(opt.init, shapes))
    traced = jax.jit(plain_step, donate_argnums=0).trace(state, batch)
    on_host = False
  else:
    tx = zerojax.zero(
      opt,
      stage=opts["stage"],
      mesh=mesh,
      offload=opts["offload"],
      offload_params=opts["offload_params"],
    )
    state = jax.eval_shape(
      lambda k: zerojax.init_from(lambda k: gpt.init(model, k), tx, k), key
    )
    step = zerojax.train_step(loss_fn, tx, gather="model", accum_steps=accum)
    traced = step.trace(state, zerojax.aot.abstract_batch(batch_shapes))
    on_host = bool(opts["offload"] or opts["offload_params"])
    if on_host:
      plan = zerojax.cost.plan_stage(
        shapes,
        opts["stage"],
        mesh=dict(mesh.shape),
        optimizer=opt,
        policy=zerojax.Policy(),
        offload=opts["offload"],
        offload_params=opts["offload_params"],
      )
      out["planned_host_traffic"] = {
        "host_to_device": plan.host_to_device,
        "device_to_host": plan.device_to_host,
      }
      out["planned_device_state"] = plan.device
      out["offload"] = offload_stream.describe(state.spec)
  t1 = time.perf_counter()
  compiled = gpu_aot.compile_for_gpu(traced, gpu)
  out["trace_s"] = t1 - t0
  out["lower_and_compile_s"] = time.perf_counter() - t1
  report = zerojax.aot.compiled_report(compiled, mesh)
  out["memory"] = report["memory"]
  out["planned_bytes"] = report["memory"]["peak"]
  if on_host:
    keys = ("host_transfers", "issued", "host_copies_across_loops")
    out["host_schedule"] = {k: report[k] for k in keys}
    out["outside_loops_s"] = outside_loops_s(report["host_copies_across_loops"])
  return out


def outside_loops_s(loops: dict) -> dict:
  """The link's seconds for the bytes the schedule moves while no layer
  loop runs, one direction after the other, at the H200's measured link
  (``docs/data/host_update_h200_*.json``): what offload added to the step
  there (docs/results.md, "Offload on the GPU")."""
  path = sorted(DATA.glob("host_update_h200_*.json"))[-1]
  link = json.loads(path.read_text())["link"]
  down = loops["host-to-device"]["bytes_outside_loops"]
  up = loops["device-to-host"]["bytes_outside_loops"]
  return {
    "link_file": path.name,
    "seconds": down / (link["host_to_device_gb_s"] * 1e9)
    + up / (link["device_to_host_gb_s"] * 1e9),
  }


def _key(size: str, config: str, stream_recorded: bool = True) -> tuple:
  """A run's options, whatever their order in its name. A bench record
  with no ``offload_stream`` was taken when layer stacks streamed whole
  (the default then)."""
  opts = gpu_bench.parse_config(config)
  if not stream_recorded and (opts["offload"] or opts["offload_params"]):
    opts["whole"] = True
  return size, tuple(sorted(opts.items()))


def measured_on_h200() -> dict:
  """``{_key: record}`` of the committed H200 bench runs."""
  runs = {}
  for path in sorted(DATA.glob("gpu_bench_*_h200_*.json")):
    records = json.loads(path.read_text())
    for r in records if isinstance(records, list) else []:
      if "error" not in r and r.get("planned_bytes"):
        key = _key(r["size"], r["config"], "offload_stream" in r)
        runs[key] = {
          "file": path.name,
          "config": r["config"],
          "jax_version": r.get("jax_version"),
          "planned_bytes": r["planned_bytes"],
          "peak_bytes_in_use": r.get("peak_bytes_in_use"),
        }
  return runs


def _run_child(size: str, config: str, args) -> dict:
  """One configuration in a fresh process (its own module switches)."""
  cmd = [sys.executable, __file__, "--one", size, config, "--gpu", args.gpu]
  return gpu_bench.child_record(cmd, size, config, args.timeout)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default="2.7b,7b")
  p.add_argument("--configs", default="plain,3+offload,3+offload+whole")
  p.add_argument("--gpu", default="h200", choices=sorted(gpu_aot.GPUS))
  p.add_argument("--out", default="runs/gpu_compile")
  p.add_argument("--tag", default="", help="appended to the file name")
  p.add_argument(
    "--timeout", type=int, default=600, help="seconds per configuration"
  )
  p.add_argument(
    "--one", nargs=2, metavar=("SIZE", "CONFIG"), help=argparse.SUPPRESS
  )
  args = p.parse_args()
  for config in args.configs.split(","):
    gpu_bench.parse_config(config)  # a typo fails here, not after the runs
  if args.one:
    print("RECORD " + json.dumps(compile_one(*args.one, args.gpu)), flush=True)
    return
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  measured = measured_on_h200() if args.gpu == "h200" else {}
  records = []
  path = (
    out / f"gpu_compile_{args.gpu}{'_' + args.tag if args.tag else ''}"
    f"_jax{importlib.metadata.version('jax')}.json"
  )
  for size in args.sizes.split(","):
    for config in args.configs.split(","):
      rec = _run_child(size, config, args)
      run = measured.get(_key(size, config))
      if run and "error" not in rec:
        rec["measured"] = {
          **run,
          "compiled_over_measured_plan": rec["planned_bytes"]
          / run["planned_bytes"],
        }
      print(json.dumps(rec), flush=True)
      records.append(rec)
      path.write_text(json.dumps(records, indent=2))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
