"""The planner: per-device memory and per-step communication before you rent.

    python -m zerojax.plan --params 7.5e9 --devices 64
    python -m zerojax.plan --params 1e12 --devices 1024 --memory-gb 32
    python -m zerojax.plan --width 4096 --depth 32 --vocab 50257 --devices 256
    python -m zerojax.plan --params 70e9 --mesh replica=4,data=256 --slices 4
    python -m zerojax.plan --params 70e9 --mesh data=64,model=8 --hardware h100

For a GPT-shaped model (from a parameter count, or an explicit config) on N
data-parallel devices, prints for each ZeRO stage the per-device bytes of
params, master weights, optimizer moments and gradients, and the collective
bytes per step; then the largest GPT that fits ``--memory-gb`` per device at
each stage. Everything comes from the layouts zerojax would use -- the same
:func:`zerojax.make_spec` that ``zerojax.init`` runs, on abstract
shapes (``jax.eval_shape``) and an ``AbstractMesh`` of N devices -- so no
array is allocated and 1024 devices or 1T parameters cost nothing. Padding
of dimensions that do not divide N is included.

Model-state memory only, as in the ZeRO paper's Figure 1: activations,
temporary buffers and fragmentation come on top.

With ``--mesh`` (axes ``replica``, ``data``, ``model``) and ``--slices``
(TPU slices or GPU nodes; the outermost axes are split across them, as
:func:`zerojax.make_mesh` lays them out), each stage also gets its
communication per step and mesh axis: bytes each chip sends over the fast
links (ICI / NVLink) and over the slow ones (DCN / InfiniBand), and the
seconds they take at the ``--hardware`` bandwidths. The model: ring
collectives; a group of ``a`` chips moving a full buffer of ``B`` bytes
sends ``(a-1)/a B`` per chip (all-gather, reduce-scatter; twice that for an
all-reduce) over the fast links; a group spanning ``s`` slices also moves
``(s-1)/s B`` into each slice, spread over its ``a/s`` chips' slow links
(hierarchical collectives: the in-slice part moves ``(i-1)/i B`` over the
group's ``i = a/s`` chips per slice); time = fast bytes / fast bandwidth +
slow bytes / slow bandwidth (no overlap with compute). ``--collectives
ring`` instead prices one flat ring per group, whose slow hops each carry
``(a-1)/a B``: what a collective that is not decomposed by slice costs. Tensor-parallel activation
traffic over ``model`` depends on the batch and is not counted.
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

from zerojax import _offload
from zerojax._spec import make_spec
from zerojax._transform import zero
from zerojax._policy import Policy
from zerojax.models import gpt

GB = 1e9

# Bytes per second per chip and direction (stated in the output).
HARDWARE = {
    # TPU v5p: ICI ~1.8e11 B/s per axis; DCN ~6e9 B/s per chip
    "tpu-v5p": {"fast": 1.8e11, "slow": 6e9, "fast_name": "ICI",
                "slow_name": "DCN"},
    # H100 SXM: NVLink 900 GB/s bidirectional; one 400 Gb/s NDR NIC per GPU
    "h100": {"fast": 4.5e11, "slow": 5e10, "fast_name": "NVLink",
             "slow_name": "InfiniBand"},
}


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
  mesh: dict = dataclasses.field(default_factory=dict)
  comm: dict = dataclasses.field(default_factory=dict)   # per axis, see comm_time
  offload: bool = False    # master + optimizer state in host memory
  # offload: the largest streamed chunk's share of master + optimizer
  # (zerojax._offload; 1.0 when the update runs on the whole state)
  chunk_fraction: float = 1.0

  @property
  def total(self) -> float:
    return self.params + self.master + self.optimizer + self.grads

  @property
  def update_transient(self) -> float:
    """Offload: device bytes the streamed update holds at once (two chunks
    of master + optimizer state: one being updated, the next loading)."""
    if not self.offload:
      return 0.0
    return min(2 * self.chunk_fraction, 1.0) * self.host

  @property
  def host_traffic(self) -> float:
    """Offload: host<->device bytes per step per device (the offloaded
    state read down once and written back once)."""
    return 2 * self.host

  @property
  def host(self) -> float:
    """Bytes per device kept in host memory (offload: master + optimizer)."""
    return self.master + self.optimizer if self.offload else 0.0

  @property
  def device(self) -> float:
    """Bytes per device in the accelerator's own memory at its peak (with
    offload: the update's streamed chunks included)."""
    return self.total - self.host + self.update_transient


def plan_stage(abstract_params, stage: int, n_devices: int | None = None, *,
               mesh: dict | None = None, optimizer=None,
               policy: Policy | None = None, model_specs=None,
               offload: bool = False) -> StagePlan:
  """Per-device bytes and collective bytes for one stage, from zerojax's layouts.

  ``offload``: the master copy and optimizer state in host memory
  (``zero(..., offload=True)``); :attr:`StagePlan.device` and
  :attr:`StagePlan.host` split the total.

  ``mesh``: axis sizes (e.g. ``{"replica": 4, "data": 256}``); default a
  1-D data mesh of ``n_devices``. Collective bytes are per data-axis group
  (full-buffer convention), plus ``"all-reduce over replica"`` (the shard,
  hybrid sharding)."""
  mesh = {"data": n_devices} if mesh is None else dict(mesh)
  amesh = AbstractMesh(tuple(mesh.values()), tuple(mesh),
                       axis_types=(AxisType.Auto,) * len(mesh))
  optimizer = optax.adamw(1e-4) if optimizer is None else optimizer
  policy = Policy(param_dtype=jnp.bfloat16) if policy is None else policy
  tp = mesh.get("model", 1) > 1
  if tp and model_specs is None:
    model_specs = gpt.model_specs()
  tx = zero(optimizer, stage=stage, mesh=amesh, policy=policy,
            model_specs=model_specs if tp else None,
            stacked=gpt.is_layer_stack if tp else None)
  spec = make_spec(abstract_params, tx)
  n = tx.num_shards
  msize = lambda layout: layout.model_shards(mesh)
  shard = lambda layout: math.prod(layout.shard_shape(n)) / msize(layout)
  params = master = grads = 0.0
  rs = ag = ar = arr = 0.0
  for leaf in spec.leaves:
    pl, sl = leaf.param, leaf.shard
    c = np.dtype(leaf.compute_dtype).itemsize
    params += shard(pl) * c
    if not leaf.trainable:
      continue
    r = np.dtype(leaf.reduce_dtype).itemsize
    if policy.has_master:
      master += shard(sl) * np.dtype(leaf.master_dtype).itemsize
    grads += (shard(sl) if stage >= 2 else leaf.size / msize(sl)) * r
    full = math.prod(sl.storage_shape) / msize(sl)   # one data group's buffer
    if stage == 0 or not sl.sharded:
      ar += full * r
    else:
      rs += full * r
      ag += full * c * (2 if stage == 3 else 1)
      if tx.replica_axis:
        arr += full / n * r
  optimizer_bytes = sum(shard(o.layout) * o.aval.dtype.itemsize
                        for o in spec.opt_leaves)
  n_params = sum(leaf.size for leaf in spec.leaves)
  colls = {k: v for k, v in (("all-reduce", ar), ("reduce-scatter", rs),
                             ("all-gather", ag),
                             ("all-reduce over replica", arr)) if v}
  chunk = _offload.describe(spec)["largest_chunk_fraction"] if offload else 1.0
  return StagePlan(stage, n_params, n, params, master, optimizer_bytes, grads,
                   colls, mesh, offload=offload, chunk_fraction=chunk)


def _slices_spanned(mesh: dict, axes: tuple, slices: int) -> tuple[int, int]:
  """(chips in one group of ``axes``, slices such a group spans): the
  device order is the mesh's, slices cut it into equal contiguous blocks."""
  names = list(mesh)
  total = math.prod(mesh.values())
  chips = total // slices
  size = math.prod(mesh[a] for a in axes)
  # the group's extent in the flat order: from its innermost axis's stride
  # to its outermost axis's span
  outer = min(names.index(a) for a in axes)
  extent = math.prod(mesh[a] for a in names[outer:])
  return size, max(1, min(slices, extent // chips))


def comm_time(p: StagePlan, slices: int = 1, hardware: str = "tpu-v5p",
              fast: float | None = None, slow: float | None = None,
              algorithm: str = "hierarchical") -> dict:
  """Per mesh axis: bytes per chip over fast and slow links, and seconds.

  See the module docstring for the model; ``algorithm="ring"``: one flat
  ring per group, whose slow hops each carry the whole ring's traffic."""
  hw = dict(HARDWARE[hardware])
  fast = hw["fast"] if fast is None else fast
  slow = hw["slow"] if slow is None else slow
  mesh = p.mesh
  batch_axes = tuple(a for a in ("replica", "data") if a in mesh)
  out = {}

  def add(label, axes, kind_factor, buffer):
    a, s = _slices_spanned(mesh, axes, slices)
    if a <= 1 or not buffer:
      return
    inside = a // s                   # the group's chips in one slice
    if algorithm == "ring" and s > 1:
      sl = kind_factor * (a - 1) / a * buffer
      f = sl if inside > 1 else 0.0     # every hop crosses when inside = 1
    else:
      f = kind_factor * (inside - 1) / inside * buffer
      sl = kind_factor * (s - 1) / s * buffer / inside if s > 1 else 0.0
    e = out.setdefault(label, {"fast_bytes": 0.0, "slow_bytes": 0.0})
    e["fast_bytes"] += f
    e["slow_bytes"] += sl
  c = p.collectives
  if p.stage == 0:
    add("+".join(batch_axes), batch_axes, 2, c.get("all-reduce", 0))
  else:
    add("data", ("data",), 1, c.get("reduce-scatter", 0) + c.get("all-gather", 0))
    add("data", ("data",), 2, c.get("all-reduce", 0))   # replicated leaves
    if "replica" in mesh:
      add("replica", ("replica",), 2, c.get("all-reduce over replica", 0))
  for e in out.values():
    e["seconds"] = e["fast_bytes"] / fast + e["slow_bytes"] / slow
  return out


ZEROPP_ROWS = (
    ("stage 3", {}),
    ("qwZ", dict(weight_bits=8)),
    ("qgZ int8", dict(grad_bits=8)),
    ("qgZ int4", dict(grad_bits=4)),
    ("qgZ int8, flat (nodes unknown)", dict(grad_bits=8, nodes_known=False)),
    ("hpZ", dict(hpz=True)),
    ("qwZ + hpZ + qgZ int8", dict(weight_bits=8, grad_bits=8, hpz=True)),
    ("qwZ + hpZ + qgZ int4", dict(weight_bits=8, grad_bits=4, hpz=True)),
)


def zeropp_comm(n_params: int, n_devices: int, slices: int, *,
                weight_bits=None, grad_bits=None, hpz=False, block=None,
                param_bytes=2, fast=1.8e11, slow=6e9,
                nodes_known=True) -> dict:
  """Stage 3's bytes per chip and step over fast and slow links, with
  ZeRO++ settings (``zerojax.ZeroPP``) on a data axis of ``n_devices``
  spanning ``slices`` nodes of ``k = n_devices / slices`` chips.

  Per collective (Ψ elements, ``w`` bytes per gathered element: the param
  dtype, or 1 + 4/block with qwZ; ``g``: the reduce dtype, or 1 or 0.5 +
  4/block with qgZ), hierarchical like :func:`comm_time`:

  * weight all-gathers, forward and backward: ``2 x`` a gather of Ψw over
    all chips; with hpZ instead one gather of Ψw/k across nodes (the
    secondary) and ``2 x`` in-node gathers of Ψ·param_bytes;
  * gradients: reduce-scatter of Ψg; qgZ the hierarchical all-to-all
    (zerojax knows the node: ``node_size``, ``hpz_size`` or one process
    per node): Ψg inside the node, Ψg/k across; with ``nodes_known=False``
    a flat all-to-all, whose cross-node share ``(n-k)/n`` cannot be
    reduced in the node first.

  Padding to blocks and devices is left out (below 1% at these sizes)."""
  n, s = n_devices, slices
  k = n // s
  # ZeroPP's default block: 256, or 64 with int4 gradients
  block = block or (64 if grad_bits == 4 else 256)
  w = 1 + 4 / block if weight_bits else param_bytes
  g = (grad_bits / 8 + 4 / block) if grad_bits else param_bytes
  f = sl = 0.0

  def hier(buffer, times=1):        # gather / reduce-scatter over all n
    nonlocal f, sl
    f += times * (k - 1) / k * buffer
    sl += times * ((s - 1) / s * buffer / k if s > 1 else 0.0)
  if hpz and s > 1:
    sl += (s - 1) / s * n_params * w / k          # the secondary, once
    f += 2 * (k - 1) / k * n_params * param_bytes  # in-node gathers
  else:
    hier(n_params * w, 2)
  if grad_bits and nodes_known and s > 1:
    f += (k - 1) / k * n_params * g
    sl += (s - 1) / s * n_params * g / k
  elif grad_bits:                                  # flat all-to-all
    f += (k - 1) / n * n_params * g
    sl += (n - k) / n * n_params * g
  else:
    hier(n_params * param_bytes)
  return {"fast_bytes": f, "slow_bytes": sl,
          "seconds": f / fast + sl / slow}


def abstract_gpt(config: gpt.GPTConfig):
  return jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))


def saved_activations(config: gpt.GPTConfig, batch_per_device: int, *,
                      model: int = 1, dtype=None,
                      platform: str | None = None) -> dict | None:
  """Per-device bytes the reference GPT's backward pass keeps from its
  forward pass (ZeRO-R's activation checkpoints), by where they live.

  ``config.remat`` picks the policy (``"auto"`` resolved for ``platform``),
  ``model`` is the model-axis size M the tensor-parallel activations are
  split over, and ``config.seq_shard`` (Pa) splits the layer-boundary
  residual over it too. Per layer and token, in the compute dtype
  (``config.compute_dtype``, else ``dtype``, the params' dtype, default
  fp32):

  * ``"full"``: the block input, ``D`` (``D / M`` with Pa);
  * ``"dots"``: also the matmul outputs the backward pass reads: qkv
    ``3D / M``, the attention projection ``D`` (``D / M`` with Pa) and the
    first MLP matmul ``F / M`` (the second MLP matmul only feeds an add);
  * ``"offload"``: the ``"full"`` bytes in host memory (on the device, one
    layer's input while it moves: ``per_layer``, a transient);
  * ``"none"``: not modelled (every intermediate of the block is kept;
    returns ``None``).

  Returns ``{"device", "host", "per_layer"}`` in bytes (``per_layer``: one
  layer's saved bytes wherever they live). Checked against the compiled
  step's per-layer temp growth in ``tests/test_activations.py``.
  """
  config = config.resolved(platform)
  if config.remat == "none":
    return None
  dt = config.compute_dtype or dtype or jnp.float32
  c = np.dtype(dt).itemsize
  d, f = config.width, config.mlp_ratio * config.width
  s = model if config.seq_shard else 1
  per_token = d / s
  if config.remat == "dots":
    per_token += 3 * d / model + d / s + f / model
  per_layer = batch_per_device * config.seq_len * per_token * c
  total = per_layer * config.depth
  if config.remat == "offload":
    return {"device": 0.0, "host": total, "per_layer": per_layer}
  return {"device": total, "host": 0.0, "per_layer": per_layer}


def working_set(config: gpt.GPTConfig, stage: int, batch_per_device: int,
                policy: Policy | None = None, model: int = 1,
                n_devices: int | None = None) -> float:
  """Per-device bytes a GPT step needs beyond the model state (zerojax's
  layer-scanned GPT): at stage 3 the forward and the backward layer
  gathered in the compute dtype and the layer's full gradient before its
  reduce-scatter; at stages 1-2 the updated weight shard in the compute
  dtype, which the all-gather reads while it overwrites the old params,
  and at stage 1 also the reduce-scatter's output (a gradient shard) while
  the full gradient is still live; at every stage the saved activations on
  the device (:func:`saved_activations`; fp32 residuals per layer where its
  policy is not modelled) and the logits (fp32, with their gradient); at
  stage 0 a second full gradient, the all-reduce's output (XLA does not
  all-reduce in place: measured, zerojax and a plain-jit DP step alike).
  Temporary buffers inside a layer come on top. ``n_devices``: the
  data-parallel size, needed for the shards of stages 1-2."""
  policy = Policy(param_dtype=jnp.bfloat16) if policy is None else policy
  if stage in (1, 2) and not n_devices:
    raise ValueError(
        f"plan.working_set at stage {stage} needs n_devices (the data-"
        f"parallel size): the step holds shards of 1/n_devices of the "
        f"weights; pass n_devices=N")
  c = np.dtype(policy.compute(jnp.float32)).itemsize
  r = np.dtype(policy.reduce(jnp.float32)).itemsize
  layer = gpt._block_params(config.width, config.mlp_ratio)
  tokens = batch_per_device * config.seq_len
  psi = gpt.num_params(config)
  gathered = (2 * c + r) * layer if stage == 3 else 0
  reduced = r * psi if stage == 0 else 0
  if stage in (1, 2):
    reduced = (c + (r if stage == 1 else 0)) * psi / n_devices
  saved = saved_activations(config, batch_per_device, model=model,
                            dtype=policy.compute(jnp.float32))
  saved = (tokens * config.width * 4 * config.depth if saved is None
           else saved["device"] or saved["per_layer"])
  return float(gathered + reduced + saved + 2 * tokens * config.vocab * 4)


def largest_fitting(memory_bytes: float, stage: int, n_devices: int,
                    seq_len: int = 2048,
                    offload: bool = False) -> gpt.GPTConfig | None:
  """The largest GPT (by the count search) whose model state fits (its
  device-memory part, with ``offload``)."""
  fits = lambda psi: plan_stage(abstract_gpt(gpt.config_for_params(
      psi, seq_len=seq_len)), stage, n_devices,
      offload=offload).device <= memory_bytes
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
  offload = any(p.offload for p in plans)
  head = ("stage", "params GB", "master GB", "optimizer GB", "grads GB",
          "total GB/device",
          *(("device GB", "host GB", "host<->dev GB/step") if offload else ()),
          "AR GB/step", "RS GB/step", "AG GB/step")
  rows = [(str(p.stage), f"{p.params / GB:.2f}", f"{p.master / GB:.2f}",
           f"{p.optimizer / GB:.2f}", f"{p.grads / GB:.2f}",
           f"{p.total / GB:.2f}",
           *((f"{p.device / GB:.2f}", f"{p.host / GB:.2f}",
              f"{p.host_traffic / GB:.2f}") if offload else ()),
           *(f"{p.collectives.get(k, 0) / GB:.1f}"
             for k in ("all-reduce", "reduce-scatter", "all-gather")))
          for p in plans]
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
  line = lambda cols: "| " + " | ".join(c.rjust(w) for c, w in zip(cols, widths)) + " |"
  return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                   + [line(r) for r in rows])


def _comm_table(plans, hw) -> str:
  head = ("stage", "axis", f"{hw['fast_name']} GB/chip",
          f"{hw['slow_name']} GB/chip", "seconds/step")
  rows = []
  for p in plans:
    for axis, e in p.comm.items():
      rows.append((str(p.stage), axis, f"{e['fast_bytes'] / GB:.3f}",
                   f"{e['slow_bytes'] / GB:.3f}", f"{e['seconds']:.3f}"))
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
  p.add_argument("--devices", type=int, default=None,
                 help="data-parallel devices N (a 1-D mesh)")
  p.add_argument("--mesh", default=None,
                 help="mesh axes instead of --devices, e.g. "
                      "replica=4,data=256 or data=64,model=8")
  p.add_argument("--slices", type=int, default=None,
                 help="TPU slices / GPU nodes the devices span (default: the "
                      "replica axis size, else 1)")
  p.add_argument("--hardware", choices=sorted(HARDWARE), default="tpu-v5p",
                 help="link bandwidth defaults")
  p.add_argument("--fast-bw", type=float, default=None,
                 help="in-slice bytes/s per chip (overrides --hardware)")
  p.add_argument("--slow-bw", type=float, default=None,
                 help="cross-slice bytes/s per chip (overrides --hardware)")
  p.add_argument("--collectives", choices=["hierarchical", "ring"],
                 default="hierarchical",
                 help="how a collective spanning slices is priced")
  p.add_argument("--memory-gb", type=float, default=None,
                 help="also find the largest GPT whose model state fits this "
                      "many GB (1e9 bytes) per device, at each stage")
  p.add_argument("--offload", action="store_true",
                 help="master copy and optimizer state in host memory "
                      "(zero(..., offload=True)): device and host GB apart; "
                      "--memory-gb then bounds device memory")
  p.add_argument("--zeropp", action="store_true",
                 help="also stage 3's communication per step with ZeRO++ "
                      "(qwZ, qgZ, hpZ with nodes = --slices) on a 1-D data "
                      "mesh of --devices")
  p.add_argument("--batch", type=int, default=None,
                 help="also the saved activations per device (ZeRO-R) for "
                      "this many sequences per data-parallel device, by "
                      "remat policy, with and without Pa on a model axis")
  p.add_argument("--json", action="store_true", help="print JSON instead")
  args = p.parse_args(argv)
  if (args.params is None) == (args.width is None):
    p.error("give either --params or --width and --depth")
  if args.width is not None and args.depth is None:
    p.error("--width needs --depth")
  if (args.devices is None) == (args.mesh is None):
    p.error("give either --devices or --mesh")
  if args.mesh is not None:
    from zerojax._mesh import parse_axes
    try:
      mesh = parse_axes(args.mesh, None)
    except ValueError as e:
      p.error(f"--mesh {args.mesh}: {e}")
    if "data" not in mesh:
      p.error(f"--mesh {args.mesh} has no data axis")
  else:
    if args.devices < 1:
      p.error(f"--devices={args.devices} must be >= 1")
    mesh = {"data": args.devices}
  args.devices = mesh["data"]
  slices = args.slices or mesh.get("replica", 1)
  if math.prod(mesh.values()) % slices:
    p.error(f"--slices={slices} does not divide the "
            f"{math.prod(mesh.values())} devices")
  if args.params is not None:
    config = gpt.config_for_params(args.params, seq_len=args.seq_len)
  else:
    config = gpt.GPTConfig(vocab=args.vocab, seq_len=args.seq_len,
                           width=args.width, depth=args.depth,
                           heads=max(1, args.width // 128))
  if mesh.get("model", 1) > 1:
    bad = [n for n, d in (("heads", config.width), ("mlp", 4 * config.width),
                          ("vocab", config.vocab)) if d % mesh["model"]]
    if bad:
      config = dataclasses.replace(
          config, vocab=-(-config.vocab // mesh["model"]) * mesh["model"])
  abstract = abstract_gpt(config)
  plans = [plan_stage(abstract, s, mesh=mesh, offload=args.offload)
           for s in range(4)]
  for x in plans:
    x.comm.update(comm_time(x, slices, args.hardware, args.fast_bw,
                            args.slow_bw, args.collectives))
  hw = HARDWARE[args.hardware]
  fast = args.fast_bw or hw["fast"]
  slow = args.slow_bw or hw["slow"]
  fitting = {}
  if args.memory_gb:
    for s in range(4):
      c = largest_fitting(args.memory_gb * GB, s, args.devices, args.seq_len,
                          offload=args.offload)
      fitting[s] = None if c is None else gpt.num_params(c)
  acts = {}
  if args.batch:
    if args.batch < 1:
      p.error(f"--batch={args.batch} must be >= 1")
    m = mesh.get("model", 1)
    for remat in ("full", "dots", "offload"):
      for pa in ((False, True) if m > 1 else (False,)):
        c = dataclasses.replace(config, remat=remat,
                                seq_shard="model" if pa else None)
        acts[f"{remat}{' + Pa' if pa else ''}"] = saved_activations(
            c, args.batch, model=m, dtype=jnp.bfloat16)
  if args.json:
    print(json.dumps({"config": dataclasses.asdict(config),
                      "saved_activations": acts,
                      "plans": [dict(dataclasses.asdict(x), total=x.total,
                                     device=x.device, host=x.host)
                                for x in plans],
                      "largest_fitting": fitting}, indent=2))
    return
  print(f"GPT {plans[0].n_params:,} params (width {config.width}, depth "
        f"{config.depth}, vocab {config.vocab}) on mesh {mesh} (N = "
        f"{args.devices} data devices); bf16 params/grads, fp32 master + "
        f"AdamW moments; GB = 1e9 bytes")
  print(_table(plans))
  if acts:
    print(f"\nsaved activations per device (bf16, {args.batch} sequence(s) "
          f"of {config.seq_len} per data device, model axis "
          f"{mesh.get('model', 1)}; logits and in-layer temporaries not "
          f"included)")
    print("| remat policy | device GB | host GB | one layer GB |")
    print("|---|---|---|---|")
    for name, a in acts.items():
      print(f"| {name} | {a['device'] / GB:.3f} | {a['host'] / GB:.3f} | "
            f"{a['per_layer'] / GB:.4f} |")
  if len(mesh) > 1 or slices > 1:
    print(f"\ncommunication per step and chip, {slices} slice(s); "
          f"{args.hardware}: {hw['fast_name']} {fast:.3g} B/s, "
          f"{hw['slow_name']} {slow:.3g} B/s per chip ({args.collectives} "
          f"collectives, no overlap; TP activations not counted)")
    print(_comm_table(plans, hw))
  if args.zeropp:
    if len(mesh) > 1 or slices < 2:
      p.error("--zeropp: give --devices N and --slices S >= 2 (nodes)")
    print(f"\nstage 3 with ZeRO++ (zerojax.ZeroPP, default blocks), {args.devices} "
          f"chips as {slices} nodes of {args.devices // slices}; "
          f"{args.hardware}: {hw['fast_name']} {fast:.3g} B/s, "
          f"{hw['slow_name']} {slow:.3g} B/s per chip; GB per chip and step")
    print(f"| setting | {hw['fast_name']} GB | {hw['slow_name']} GB | "
          f"{hw['slow_name']} vs stage 3 | comm seconds/step |")
    print("|---|---|---|---|---|")
    base = None
    for name, kw in ZEROPP_ROWS:
      e = zeropp_comm(plans[3].n_params, args.devices, slices, fast=fast,
                      slow=slow, **kw)
      base = base or e["slow_bytes"]
      print(f"| {name} | {e['fast_bytes'] / GB:.3f} | {e['slow_bytes'] / GB:.3f} "
            f"| {e['slow_bytes'] / base:.3f} | {e['seconds']:.3f} |")
  if fitting:
    print(f"\nlargest GPT whose model state fits {args.memory_gb:g} GB per device:")
    for s, n in fitting.items():
      print(f"  stage {s}: {'nothing fits' if n is None else f'{n / 1e9:,.2f} B params'}")


if __name__ == "__main__":
  main()
