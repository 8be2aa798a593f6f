"""The planner: per-device memory and per-step communication before you rent.

    python -m zerojax.plan --params 7.5e9 --devices 64
    python -m zerojax.plan --params 1e12 --devices 1024 --memory-gb 32
    python -m zerojax.plan --width 4096 --depth 32 --vocab 50257 --devices 256

For a GPT-shaped model (from a parameter count, or an explicit config) on N
data-parallel devices, prints for each ZeRO stage the per-device bytes of
params, master weights, optimizer moments and gradients, and the collective
bytes per step; then the largest GPT that fits ``--memory-gb`` per device at
each stage. Everything comes from the layouts zerojax would use -- the same
:func:`zerojax._state.make_spec` that ``zerojax.init`` runs, on abstract
shapes (``jax.eval_shape``) and an ``AbstractMesh`` of N devices -- so no
array is allocated and 1024 devices or 1T parameters cost nothing. Padding
of dimensions that do not divide N is included.

Model-state memory only, as in the ZeRO paper's Figure 1: activations,
temporary buffers and fragmentation come on top.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType

from zerojax._state import make_spec
from zerojax._transform import zero
from zerojax._policy import Policy
from zerojax.models import gpt

GB = 1e9


@dataclasses.dataclass(frozen=True)
class StagePlan:
  stage: int
  n_params: int
  n_devices: int
  params: float            # bytes per device, by category
  master: float
  optimizer: float
  grads: float
  collectives: dict        # kind -> bytes per step (full-buffer convention)

  @property
  def total(self) -> float:
    return self.params + self.master + self.optimizer + self.grads


def plan_stage(abstract_params, stage: int, n_devices: int, *,
               optimizer=None, policy: Policy | None = None) -> StagePlan:
  """Per-device bytes and collective bytes for one stage, from zerojax's layouts."""
  mesh = AbstractMesh((n_devices,), ("data",), axis_types=(AxisType.Auto,))
  optimizer = optax.adamw(1e-4) if optimizer is None else optimizer
  policy = Policy(param_dtype=jnp.bfloat16) if policy is None else policy
  spec = make_spec(abstract_params, zero(optimizer, stage=stage, mesh=mesh,
                                         policy=policy))
  n = n_devices
  shard = lambda layout: math.prod(layout.shard_shape(n))
  params = master = grads = 0.0
  rs = ag = ar = 0.0
  for i, a in enumerate(spec.params_avals):
    pl, sl = spec.param_layouts[i], spec.shard_layouts[i]
    c = np.dtype(spec.compute_dtype(i)).itemsize
    params += shard(pl) * c
    if not spec.trainable[i]:
      continue
    r = np.dtype(spec.reduce_dtype(i)).itemsize
    if policy.has_master:
      master += shard(sl) * np.dtype(spec.master_dtype(i)).itemsize
    grads += (shard(sl) if stage >= 2 else math.prod(a.shape)) * r
    full = math.prod(sl.storage_shape)
    if stage == 0 or not sl.sharded:
      ar += full * r
    else:
      rs += full * r
      ag += full * c * (2 if stage == 3 else 1)
  optimizer_bytes = sum(shard(l) * np.dtype(a.dtype).itemsize
                        for l, a in zip(spec.opt_layouts, spec.opt_avals))
  n_params = sum(math.prod(a.shape) for a in spec.params_avals)
  colls = {k: v for k, v in (("all-reduce", ar), ("reduce-scatter", rs),
                             ("all-gather", ag)) if v}
  return StagePlan(stage, n_params, n, params, master, optimizer_bytes, grads,
                   colls)


def abstract_gpt(config: gpt.GPTConfig):
  return jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))


def largest_fitting(memory_bytes: float, stage: int, n_devices: int,
                    seq_len: int = 2048) -> gpt.GPTConfig | None:
  """The largest GPT (by the count search) whose model state fits."""
  fits = lambda psi: plan_stage(abstract_gpt(gpt.config_for_params(
      psi, seq_len=seq_len)), stage, n_devices).total <= memory_bytes
  lo, hi = 1e7, 1e7
  if not fits(lo):
    return None
  while fits(hi) and hi < 1e16:
    lo, hi = hi, hi * 4
  for _ in range(40):                    # bisect in log space
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if hi / lo < 1.002:
      break
  return gpt.config_for_params(lo, seq_len=seq_len)


def _table(plans) -> str:
  head = ("stage", "params GB", "master GB", "optimizer GB", "grads GB",
          "total GB/device", "AR GB/step", "RS GB/step", "AG GB/step")
  rows = [(str(p.stage), f"{p.params / GB:.2f}", f"{p.master / GB:.2f}",
           f"{p.optimizer / GB:.2f}", f"{p.grads / GB:.2f}",
           f"{p.total / GB:.2f}",
           *(f"{p.collectives.get(k, 0) / GB:.1f}"
             for k in ("all-reduce", "reduce-scatter", "all-gather")))
          for p in plans]
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
  line = lambda cols: "| " + " | ".join(c.rjust(w) for c, w in zip(cols, widths)) + " |"
  return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                   + [line(r) for r in rows])


def main(argv=None):
  p = argparse.ArgumentParser(
      prog="python -m zerojax.plan",
      description="Per-device model-state memory and per-step collective "
                  "bytes of each ZeRO stage, from zerojax's own layouts "
                  "(bf16 params and gradients, fp32 master and AdamW moments).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--params", type=float,
                 help="parameter count of a GPT-shaped model, e.g. 7.5e9")
  p.add_argument("--width", type=int, help="explicit GPT width (with --depth)")
  p.add_argument("--depth", type=int, help="explicit GPT depth")
  p.add_argument("--vocab", type=int, default=50257, help="with --width/--depth")
  p.add_argument("--seq-len", type=int, default=2048, help="context length")
  p.add_argument("--devices", type=int, required=True,
                 help="data-parallel devices N")
  p.add_argument("--memory-gb", type=float, default=None,
                 help="also find the largest GPT whose model state fits this "
                      "many GB (1e9 bytes) per device, at each stage")
  p.add_argument("--json", action="store_true", help="print JSON instead")
  args = p.parse_args(argv)
  if (args.params is None) == (args.width is None):
    p.error("give either --params or --width and --depth")
  if args.width is not None and args.depth is None:
    p.error("--width needs --depth")
  if args.devices < 1:
    p.error(f"--devices={args.devices} must be >= 1")
  if args.params is not None:
    config = gpt.config_for_params(args.params, seq_len=args.seq_len)
  else:
    config = gpt.GPTConfig(vocab=args.vocab, seq_len=args.seq_len,
                           width=args.width, depth=args.depth,
                           heads=max(1, args.width // 128))
  abstract = abstract_gpt(config)
  plans = [plan_stage(abstract, s, args.devices) for s in range(4)]
  fitting = {}
  if args.memory_gb:
    for s in range(4):
      c = largest_fitting(args.memory_gb * GB, s, args.devices, args.seq_len)
      fitting[s] = None if c is None else gpt.num_params(c)
  if args.json:
    print(json.dumps({"config": dataclasses.asdict(config),
                      "plans": [dict(dataclasses.asdict(x), total=x.total)
                                for x in plans],
                      "largest_fitting": fitting}, indent=2))
    return
  print(f"GPT {plans[0].n_params:,} params (width {config.width}, depth "
        f"{config.depth}, vocab {config.vocab}) on N = {args.devices} devices; "
        f"bf16 params/grads, fp32 master + AdamW moments; GB = 1e9 bytes")
  print(_table(plans))
  if fitting:
    print(f"\nlargest GPT whose model state fits {args.memory_gb:g} GB per device:")
    for s, n in fitting.items():
      print(f"  stage {s}: {'nothing fits' if n is None else f'{n / 1e9:,.2f} B params'}")


if __name__ == "__main__":
  main()
