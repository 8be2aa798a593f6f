"""PyTorch FSDP2: the peer most users would otherwise pick, on the bench GPT.

The same GPT as ``zerojax/app/gpt.py`` (same shapes, same initial values,
same batches, GELU-tanh, pre-norm, fp32), AdamW with optax's defaults, each
block wrapped with ``fully_shard`` over a gloo ``init_device_mesh("cpu",
(n,))``, the root module too (embeddings, final norm, head). Run by
``experiments/bench_stages.py --configs fsdp2`` (it needs torch: ``pip
install -e '.[bench]'``), in two phases:

    python experiments/fsdp2_peer.py --export DIR ...     # JAX: init params + batches -> DIR/init.npz
    torchrun --nproc-per-node 8 experiments/fsdp2_peer.py --train-from DIR ...

The first phase runs in its own process so that no rank imports JAX; every
rank loads the same ``init.npz`` (the params zerojax starts from, and the
batches it sees), and rank 0 prints one JSON line with what all ranks
measured.

Each block runs under ``torch.utils.checkpoint`` (``--no-remat`` to save its
activations instead), as zerojax's GPT runs each block under
``jax.checkpoint``. Every rank builds the full model from ``init.npz``
before ``fully_shard`` frees what it does not own (FSDP2's usual
``model = GPT(); fully_shard(...)``); ``init_rss_bytes_per_rank`` records
the RSS after that.

What differs from zerojax's runs, by construction: 8 processes (each its own
Python and torch runtime, one intra-op thread each, as torchrun sets) against
8 fake devices in one process; gloo collectives over loopback against XLA's
in-process ones. Memory is therefore compared net of each runtime: the sum
over ranks of (peak RSS - RSS before the model exists) against zerojax's
(peak RSS - RSS before the model exists). Collective bytes are counted at
the ``torch.distributed`` calls FSDP2 makes (full-buffer convention, as the
HLO tables: an all-gather counts its output, a reduce-scatter its input).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import resource
import sys
import time

import numpy as np

BLOCK_KEYS = (
  "ln1_scale_LxD",
  "ln1_bias_LxD",
  "qkv_LxDx3D",
  "qkv_bias_Lx3D",
  "proj_LxDxD",
  "proj_bias_LxD",
  "ln2_scale_LxD",
  "ln2_bias_LxD",
  "fc1_LxDxF",
  "fc1_bias_LxF",
  "fc2_LxFxD",
  "fc2_bias_LxD",
)


def export(args) -> None:
  """Phase 1 (JAX): the bench's initial params and batches, as numpy."""
  import jax

  from zerojax.app import data, gpt

  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  model = gpt.GPTConfig(
    vocab=args.vocab,
    width=args.width,
    depth=args.depth,
    heads=args.heads,
    seq_len=args.seq_len,
  )
  params = gpt.init(model, jax.random.key(0))
  flat = {
    jax.tree_util.keystr(p): np.asarray(x)
    for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  tokens, _ = data.split(data.corpus_bytes())
  for i in range(args.steps + 1):
    b = data.batch_at(
      tokens, seed=0, step=i, batch=args.batch, seq_len=args.seq_len
    )
    flat[f"batch{i}_x"], flat[f"batch{i}_y"] = b["x"], b["y"]
  out = pathlib.Path(args.export)
  out.mkdir(parents=True, exist_ok=True)
  np.savez(out / "init.npz", **flat)


def run(args) -> None:
  """Phase 2 (torchrun): FSDP2 training, measured on every rank."""
  import torch
  import torch.distributed as dist
  import torch.nn.functional as F
  from torch import nn
  from torch.distributed.device_mesh import init_device_mesh
  from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
  from torch.utils.checkpoint import checkpoint

  torch.set_num_threads(1)
  dist.init_process_group("gloo")
  rank, world = dist.get_rank(), dist.get_world_size()
  mesh = init_device_mesh("cpu", (world,))
  rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  rss_runtime = rss()

  d, h = args.width, args.heads
  k = d // h

  def layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + 1e-5) * scale + bias

  class Block(nn.Module):
    def __init__(self, arrays):
      super().__init__()
      for name, a in arrays.items():
        setattr(self, name, nn.Parameter(torch.from_numpy(np.array(a))))

    def forward(self, x):
      b, t, _ = x.shape
      y = layer_norm(x, self.ln1_scale_LxD, self.ln1_bias_LxD)
      qkv = y @ self.qkv_LxDx3D + self.qkv_bias_Lx3D
      q, kk, v = qkv.reshape(b, t, 3 * h, k).split(h, dim=2)
      logits = torch.einsum("bthk,bshk->bhts", q, kk) / math.sqrt(k)
      causal = torch.ones(t, t, dtype=torch.bool).tril()
      logits = torch.where(causal, logits.float(), -1e30)
      probs = logits.softmax(-1).to(y.dtype)
      att = torch.einsum("bhts,bshk->bthk", probs, v).reshape(b, t, d)
      x = x + att @ self.proj_LxDxD + self.proj_bias_LxD
      y = layer_norm(x, self.ln2_scale_LxD, self.ln2_bias_LxD)
      y = F.gelu(y @ self.fc1_LxDxF + self.fc1_bias_LxF, approximate="tanh")
      return x + y @ self.fc2_LxFxD + self.fc2_bias_LxD

  class GPT(nn.Module):
    def __init__(self, npz):
      super().__init__()
      get = lambda key: torch.from_numpy(np.array(npz[key]))
      self.embed = nn.Parameter(get("['embed_VxD']"))
      self.pos = nn.Parameter(get("['pos_TxD']"))
      self.blocks = nn.ModuleList(
        Block({n: npz[f"['blocks']['{n}']"][i] for n in BLOCK_KEYS})
        for i in range(args.depth)
      )
      self.lnf_scale = nn.Parameter(get("['lnf_scale_D']"))
      self.lnf_bias = nn.Parameter(get("['lnf_bias_D']"))
      self.head = nn.Parameter(get("['head_DxV']"))

    def forward(self, x_BxT):
      x = self.embed[x_BxT] + self.pos[None, : x_BxT.shape[1]]
      for block in self.blocks:
        # as zerojax's GPT (jax.checkpoint around the block): activations
        # inside a block are recomputed in the backward pass, not saved
        x = (
          checkpoint(block, x, use_reentrant=False) if args.remat else block(x)
        )
      x = layer_norm(x, self.lnf_scale, self.lnf_bias)
      return (x @ self.head).float()

  npz = np.load(pathlib.Path(args.train_from) / "init.npz", mmap_mode="r")
  model = GPT(npz)
  n_params = sum(p.numel() for p in model.parameters())
  bf16 = args.precision == "bf16"
  mp = (
    MixedPrecisionPolicy(
      param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
    )
    if bf16
    else MixedPrecisionPolicy()
  )
  for block in model.blocks:  # one all-gather group per block
    fully_shard(block, mesh=mesh, mp_policy=mp)
  fully_shard(model, mesh=mesh, mp_policy=mp)  # embeddings, final norm, head
  rss_init = rss()
  # optax.adamw(1e-3)'s defaults, decoupled decay on every param (no mask)
  opt = torch.optim.AdamW(
    model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4
  )
  rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
  batch = lambda i: (
    torch.from_numpy(np.array(npz[f"batch{i}_x"][rows])).long(),
    torch.from_numpy(np.array(npz[f"batch{i}_y"][rows])).long(),
  )

  counted = {}  # collective bytes, full buffers

  originals = {
    name: getattr(dist, name)
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")
  }

  def counting(kind, name, arg, pos):  # the full buffer: arg at pos
    def wrapped(*a, **kw):
      t = kw[arg] if arg in kw else a[pos]
      counted[kind] = counted.get(kind, 0) + t.numel() * t.element_size()
      return originals[name](*a, **kw)

    setattr(dist, name, wrapped)

  counting("all-gather", "all_gather_single", "output", 0)
  counting("reduce-scatter", "reduce_scatter_single", "input", 1)
  counting("all-reduce", "all_reduce", "tensor", 0)

  def step(i):
    x, y = batch(i)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()  # FSDP2 averages over ranks
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

  step(0)  # warm-up (creates Adam state)
  times, losses = [], []
  for i in range(1, args.steps + 1):
    if i == args.steps:
      counted.clear()  # one steady-state step
    dist.barrier()
    t = time.perf_counter()
    loss = step(i)
    dist.barrier()
    times.append(time.perf_counter() - t)
    losses.append(loss)
  for name, fn in originals.items():  # stop counting
    setattr(dist, name, fn)
  local = lambda x: x.to_local() if hasattr(x, "to_local") else x
  state = {
    "params": sum(
      local(p).numel() * local(p).element_size() for p in model.parameters()
    )
  }
  for s in opt.state.values():
    for name, v in s.items():
      if torch.is_tensor(v):
        key = "opt_state." + {"exp_avg": "mu", "exp_avg_sq": "nu"}.get(
          name, name
        )
        state[key] = (
          state.get(key, 0) + local(v).numel() * local(v).element_size()
        )
  global_loss = torch.stack(losses[-1:])
  dist.all_reduce(global_loss)  # mean over ranks = global mean
  mine = {
    "rss_runtime": rss_runtime,
    "rss_init": rss_init,
    "peak_rss": rss(),
    "state": state,
    "times": times,
  }
  everyone = [None] * world
  dist.all_gather_object(everyone, mine)
  if rank == 0:
    print(
      json.dumps(
        {
          "name": "PyTorch FSDP2 (8 ranks, gloo)",
          "config": "fsdp2",
          "stage": None,
          "n_devices": world,
          "n_params": n_params,
          "precision": args.precision,
          "torch": torch.__version__,
          "step_time_s": float(
            np.median(
              [max(r["times"][i] for r in everyone) for i in range(args.steps)]
            )
          ),
          "compile_s": 0.0,
          "peak_rss_bytes": sum(r["peak_rss"] for r in everyone),
          "runtime_rss_bytes": sum(r["rss_runtime"] for r in everyone),
          "peak_rss_bytes_per_rank": [r["peak_rss"] for r in everyone],
          "runtime_rss_bytes_per_rank": [r["rss_runtime"] for r in everyone],
          "init_rss_bytes_per_rank": [r["rss_init"] for r in everyone],
          "remat": args.remat,
          "state_bytes_per_device": {
            k: max(r["state"][k] for r in everyone)
            for k in everyone[0]["state"]
          },
          "theory_state_bytes_per_device": {
            "params": 4 * n_params / world,
            "opt_state.mu": 4 * n_params / world,
            "opt_state.nu": 4 * n_params / world,
          },
          "collective_bytes": counted,
          "collective_elements": {
            kk: v // (2 if bf16 and kk != "all-reduce" else 4)
            for kk, v in counted.items()
          },
          "theory_collective_elements": {
            "reduce-scatter": n_params,
            "all-gather": 2 * n_params,
          },
          "final_loss": float(global_loss) / world,
          "checkpoint": None,
          "xla_memory": None,
          "argument_bytes_per_device": None,
        }
      ),
      flush=True,
    )
  dist.barrier()  # no rank tears gloo down while another still talks
  dist.destroy_process_group()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--export", help="phase 1: write DIR/init.npz (JAX)")
  p.add_argument(
    "--train-from", help="phase 2, under torchrun: train from DIR/init.npz"
  )
  for name, default in (
    ("width", 256),
    ("vocab", 256),
    ("depth", 8),
    ("heads", 4),
    ("seq-len", 128),
    ("batch", 16),
    ("steps", 5),
  ):
    p.add_argument(f"--{name}", type=int, default=default)
  p.add_argument("--precision", choices=["bf16", "fp32"], default="fp32")
  p.add_argument(
    "--no-remat",
    dest="remat",
    action="store_false",
    help="save every block's activations (FSDP2's default) "
    "instead of recomputing them as zerojax's GPT does",
  )
  args, _ = p.parse_known_args()
  if bool(args.export) == bool(args.train_from):
    p.error("give exactly one of --export DIR or --train-from DIR")
  if args.train_from and int(os.environ.get("WORLD_SIZE", "0")) < 1:
    p.error(
      "--run is for torchrun: torchrun --nproc-per-node 8 "
      "experiments/fsdp2_peer.py --train-from DIR"
    )
  export(args) if args.export else run(args)


if __name__ == "__main__":
  main()
