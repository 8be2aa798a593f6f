"""Safetensors checkpoints (the Hugging Face format) in and out of a state.

Loading reads each device's rows straight from the files: every leaf of
the state's params is built with ``jax.make_array_from_callback`` in its
shard layout, and the callback reads only the block a local device holds
(safetensors slices lazily), so a process holds its share of the model,
never all of it; a stacked leaf (the layers a ``lax.scan`` slices) reads
the block from each per-layer tensor. The master copy and the optimizer
state are then built from those leaves, a group of leaves at a time, as
:func:`zerojax.init` builds them. Every tensor is checked against the
mapping before any array is built.

Exporting plans files of at most ``max_shard_bytes`` from the leaves'
shapes, deals them out to the processes, then gathers one leaf at a time;
each process keeps only the tensors of its own file being filled and
writes it under Hugging Face's names, process 0 adding the index.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from zerojax._src.ckpt.layout_json import CheckpointError
from zerojax._src.ckpt.safetensors_files import (
  DTYPES,
  INDEX,
  SINGLE,
  Reader,
  files,
)
from zerojax._src.records.spec import StateSpec, ZeroState, make_spec
from zerojax._src.step.deleted import reject_deleted
from zerojax._src.step.extras import with_extras
from zerojax._src.step.gather_state import gather_leaf
from zerojax._src.step.state import build_from_stored


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """Where one param leaf lives in a safetensors checkpoint.

  Attributes:
    names: the tensor's name, or one name per layer of a stacked leaf (its
      leading dimension, in order: ``h.0.attn.c_attn.weight``,
      ``h.1.attn.c_attn.weight``, ...).
    transpose: the file holds the leaf's last two dimensions swapped
      (PyTorch's ``nn.Linear`` stores ``(out, in)`` where a JAX kernel is
      ``(in, out)``).
  """

  names: tuple[str, ...]
  transpose: bool = False

  def __post_init__(self):
    if isinstance(self.names, str):
      object.__setattr__(self, "names", (self.names,))
    else:
      object.__setattr__(self, "names", tuple(self.names))
    if not self.names or not all(isinstance(n, str) for n in self.names):
      raise TypeError(
        f"zerojax TensorMap: names={self.names!r} must be a tensor name or "
        f"a non-empty sequence of names (one per layer)."
      )

  def file_shape(self, leaf_shape: tuple) -> tuple:
    """One tensor's shape in the file, for a leaf of ``leaf_shape``."""
    shape = tuple(leaf_shape[1:] if len(self.names) > 1 else leaf_shape)
    if self.transpose:
      if len(shape) < 2:
        raise CheckpointError(
          f"zerojax safetensors: {self.names[0]!r} is mapped with "
          f"transpose=True to a leaf of rank {len(shape)}; only rank >= 2 "
          f"tensors can be transposed."
        )
      shape = shape[:-2] + (shape[-1], shape[-2])
    return shape


def _as_map(m) -> TensorMap:
  if isinstance(m, TensorMap):
    return m
  if isinstance(m, str) or isinstance(m, Sequence):
    return TensorMap(m)
  raise TypeError(
    f"zerojax safetensors: the mapping returned {m!r}; return a tensor "
    f"name, a sequence of per-layer names or a zerojax.checkpoint.TensorMap."
  )


def _maps(spec: StateSpec, mapping) -> list[TensorMap]:
  if isinstance(mapping, dict):
    missing = [r.path for r in spec.leaves if r.path not in mapping]
    if missing:
      raise CheckpointError(
        f"zerojax safetensors: the mapping names no tensor for params "
        f"{', '.join(missing)}. Give every param leaf (its keystr path) a "
        f"tensor name."
      )
    return [_as_map(mapping[r.path]) for r in spec.leaves]
  return [_as_map(mapping(r.path, tuple(r.aval.shape))) for r in spec.leaves]


_FLOAT = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _check(spec: StateSpec, maps: list[TensorMap], reader: Reader, unused):
  """Every problem with the checkpoint against the params, in one error."""
  problems, used = [], set()
  for r, m in zip(spec.leaves, maps):
    shape = tuple(r.aval.shape)
    if len(m.names) > 1 and (not shape or shape[0] != len(m.names)):
      problems.append(
        f"params{r.path} {list(shape)}: mapped to {len(m.names)} per-layer "
        f"tensors, but its leading dimension is "
        f"{shape[0] if shape else 'absent'}"
      )
      continue
    want = m.file_shape(shape)
    floating = jnp.issubdtype(r.aval.dtype, jnp.inexact)
    for name in m.names:
      used.add(name)
      if name not in reader.files:
        problems.append(f"params{r.path}: tensor {name!r} is missing")
        continue
      got, dtype = reader.info(name)
      if got != want:
        problems.append(
          f"params{r.path}: tensor {name!r} is {list(got)}, expected "
          f"{list(want)}{' (transposed)' if m.transpose else ''}"
        )
      if dtype not in DTYPES:
        problems.append(
          f"params{r.path}: tensor {name!r} is {dtype}, a dtype JAX has no "
          f"array type for"
        )
      elif (dtype in _FLOAT) != floating:
        problems.append(
          f"params{r.path}: tensor {name!r} is {dtype}, the param is "
          f"{np.dtype(r.aval.dtype).name}"
        )
  extra = sorted(set(reader.files) - used)
  if extra and unused == "raise":
    shown = ", ".join(repr(n) for n in extra[:8])
    more = f" (and {len(extra) - 8} more)" if len(extra) > 8 else ""
    problems.append(
      f"tensors no param is mapped to: {shown}{more} (pass "
      f"unused='ignore' to load without them)"
    )
  if problems:
    raise CheckpointError(
      "zerojax safetensors: the checkpoint does not match the params; "
      "nothing was built:\n  " + "\n  ".join(problems)
    )


# --- load --------------------------------------------------------------------
def _fill(reader: Reader, m: TensorMap, inside: tuple, out: np.ndarray):
  """Copies the leaf's logical block ``inside`` (a tuple of slices) from
  the files into ``out``'s leading corner, converting the dtype."""

  def src(name):
    x = reader.view(name)
    return np.swapaxes(x, -1, -2) if m.transpose else x

  corner = tuple(slice(0, s.stop - s.start) for s in inside)
  if len(m.names) == 1:
    np.copyto(out[corner + (...,)], src(m.names[0])[inside], casting="unsafe")
    return
  for j, k in enumerate(range(inside[0].start, inside[0].stop)):
    np.copyto(
      out[(j,) + corner[1:] + (...,)],
      src(m.names[k])[inside[1:]],
      casting="unsafe",
    )


# threads reading blocks side by side: the host's cores, at most 8
_READERS = max(1, min(8, os.cpu_count() or 1))


def _aligned_empty(shape: tuple, dtype: np.dtype) -> np.ndarray:
  """An uninitialised array whose data starts on a 64-byte boundary: a CPU
  device then takes the buffer as it is, where a misaligned one (malloc's
  16-byte alignment) is copied, doubling the block on the host."""
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  at = -raw.ctypes.data % 64
  return raw[at : at + nbytes].view(dtype).reshape(shape)


def _stored_leaf(
  reader: Reader,
  spec: StateSpec,
  i: int,
  m: TensorMap,
  pool: ThreadPoolExecutor,
):
  """Param leaf ``i`` in its shard layout's storage form: each local
  device's block read from the files (the padding zeros) and put on its
  device, ``pool``'s threads reading blocks side by side (the copies and
  the page faults of fresh buffers release the GIL), so at most one block
  per thread is on the host beyond what the devices hold."""
  r = spec.leaves[i]
  layout = r.shard
  shape, dtype = layout.storage_shape, np.dtype(r.aval.dtype)
  logical = tuple(r.aval.shape)
  sharding = spec.sharding(layout)

  def block(item):
    device, index = item
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    want = tuple(s.stop - s.start for s in index)
    inside = tuple(
      slice(min(s.start, n), min(s.stop, n)) for s, n in zip(index, logical)
    )
    out = _aligned_empty(want, dtype)
    if tuple(s.stop - s.start for s in inside) != want:
      out.fill(0)  # the padding
    if all(s.stop > s.start for s in inside):
      _fill(reader, m, inside, out)
    return jax.device_put(out, device)

  items = sharding.addressable_devices_indices_map(shape).items()
  blocks = list(pool.map(block, items))
  return jax.make_array_from_single_device_arrays(shape, sharding, blocks)


def load_safetensors(
  path,
  tx: optax.GradientTransformationExtraArgs,
  template,
  *,
  mapping,
  unused: str = "raise",
  key=None,
  model_state=None,
) -> ZeroState:
  """A :class:`~zerojax.ZeroState` from safetensors files, each process
  reading only the rows its devices hold.

  Args:
    path: a ``.safetensors`` file, or a directory holding
      ``model.safetensors`` or ``model.safetensors.index.json`` and its
      shards (as ``save_pretrained`` writes them).
    tx: a :class:`~zerojax.ZeroTransformation` (any stage and mesh).
    template: the params tree, as arrays or ``jax.ShapeDtypeStruct``
      (``jax.eval_shape(init_fn, key)``): the leaves' shapes and dtypes.
      Each tensor is converted to its leaf's dtype, then to the stage's
      precision policy.
    mapping: for each param leaf, where it lives in the files: a dict from
      the leaf's path (``jax.tree_util.keystr``) or a function
      ``mapping(path, shape)``, returning a tensor name, a sequence of
      per-layer names (stacked along the leaf's leading dimension) or a
      :class:`TensorMap` (with ``transpose=True`` for PyTorch ``Linear``
      weights).
    unused: ``"raise"`` (default) when the files hold tensors no param is
      mapped to, ``"ignore"`` to load without them.
    key, model_state: as for :func:`zerojax.init`.

  Returns:
    The state, as :func:`zerojax.init` would build it from the same values.

  Raises:
    CheckpointError: listing every missing, unexpected, misshaped or
      wrongly typed tensor, a truncated file or an index naming a missing
      shard, before any array is built.
  """
  if unused not in ("raise", "ignore"):
    raise ValueError(
      f"zerojax.checkpoint.load_safetensors: unused={unused!r}; use "
      f"'raise' or 'ignore'."
    )
  spec = make_spec(jax.eval_shape(lambda: template), tx)
  maps = _maps(spec, mapping)
  reader = Reader(files(path))
  try:
    _check(spec, maps, reader, unused)
    with ThreadPoolExecutor(_READERS) as pool:
      state = build_from_stored(
        spec,
        lambda group: [
          _stored_leaf(reader, spec, i, maps[i], pool) for i in group
        ],
        grouped=True,
        keep_stored=True,
      )
      jax.block_until_ready(state)
  finally:
    reader.close()
  return with_extras(
    state, key, model_state, "zerojax.checkpoint.load_safetensors"
  )


# --- export ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Piece:
  """One tensor of the export: param leaf ``leaf`` (its layer ``layer`` of
  a stacked leaf, or all of it when ``None``) under ``name``."""

  name: str
  leaf: int
  layer: int | None
  nbytes: int


def _plan(spec: StateSpec, maps, dtypes, max_shard_bytes) -> list[list[_Piece]]:
  """The files' contents in leaf order, each at most ``max_shard_bytes``
  (or one tensor), from the leaves' shapes alone: every process derives
  the same plan without reading a value."""
  files: list[list[_Piece]] = [[]]
  size = 0
  for i, (r, m, dtype) in enumerate(zip(spec.leaves, maps, dtypes)):
    shape = tuple(r.aval.shape)
    one = int(np.prod(shape[1:] if len(m.names) > 1 else shape, dtype=np.int64))
    nbytes = one * np.dtype(dtype).itemsize
    for k, name in enumerate(m.names):
      if files[-1] and size + nbytes > max_shard_bytes:
        files.append([])
        size = 0
      files[-1].append(_Piece(name, i, k if len(m.names) > 1 else None, nbytes))
      size += nbytes
  return files


def _file_names(n: int) -> list[str]:
  if n == 1:
    return [SINGLE]
  return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def save_safetensors(
  state: ZeroState,
  directory,
  *,
  mapping,
  master: bool = True,
  max_shard_bytes: int = 5 * 2**30,
) -> list[pathlib.Path]:
  """Writes the params (the master copy by default) as safetensors with
  the names ``mapping`` gives (the same mapping :func:`load_safetensors`
  reads), in files of at most ``max_shard_bytes`` plus
  ``model.safetensors.index.json`` when there are several, as
  ``save_pretrained`` does.

  The files are planned from the leaves' shapes, then dealt out to the
  processes in turn (file ``k`` to process ``k mod P``), so with several
  hosts the writes run in parallel. Every process takes part in each
  leaf's gather, one leaf at a time, and keeps only the tensors of its own
  file being filled: a host holds one leaf plus at most one file's tensors.
  Process 0 writes the index.

  Returns:
    The files this process wrote (and the index, on process 0).
  """
  reject_deleted(state, "zerojax.checkpoint.save_safetensors")
  if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
    raise ValueError(
      f"zerojax.checkpoint.save_safetensors: max_shard_bytes="
      f"{max_shard_bytes!r} must be a positive int."
    )
  spec = state.spec
  maps = _maps(spec, mapping)
  _reject_shared_names(spec, maps)
  masters = spec.masters(state.master if master else None)
  dtypes = [
    (m if m is not None else p).dtype
    for m, p in zip(masters, jax.tree.leaves(state.params))
  ]
  plan = _plan(spec, maps, dtypes, max_shard_bytes)
  names = _file_names(len(plan))
  me, procs = jax.process_index(), jax.process_count()
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  file_of = {(q.leaf, q.layer): k for k, f in enumerate(plan) for q in f}
  written, current = [], {}
  for i, m in enumerate(maps):
    full = np.asarray(gather_leaf(state, i, master=master))
    for q_layer in range(len(m.names)) if len(m.names) > 1 else [None]:
      k = file_of[(i, q_layer)]
      if k % procs != me:
        continue
      x = full if q_layer is None else full[q_layer]
      x = np.swapaxes(x, -1, -2) if m.transpose else x
      current[m.names[q_layer or 0]] = np.asarray(x, order="C")
      if len(current) == len(plan[k]):  # the file is complete
        written.append(_write(directory, names[k], current))
        current = {}
    del full
  if me == 0 and len(plan) > 1:
    weight_map = {q.name: names[k] for k, f in enumerate(plan) for q in f}
    total = sum(q.nbytes for f in plan for q in f)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2))
    written.append(directory / INDEX)
  if procs > 1:  # every process may read what the others wrote
    multihost_utils.sync_global_devices("zerojax.save_safetensors")
  return written


def _write(directory: pathlib.Path, name: str, tensors: dict) -> pathlib.Path:
  """One file, written beside its final name and renamed into place, so a
  reader never sees half a file."""
  part = directory / f".{name}.part"
  save_file(tensors, part, metadata={"format": "pt"})
  os.replace(part, directory / name)
  return directory / name


def _reject_shared_names(spec: StateSpec, maps) -> None:
  owner: dict[str, str] = {}
  for r, m in zip(spec.leaves, maps):
    for name in m.names:
      if name in owner:
        raise CheckpointError(
          f"zerojax.checkpoint.save_safetensors: params{owner[name]} and "
          f"params{r.path} both map to tensor {name!r}, and a file holds "
          f"one tensor per name (a weight tied in the checkpoint but "
          f"trained as two leaves). Map one of them to another name, e.g. "
          f"the head to 'lm_head.weight'."
        )
      owner[name] = r.path
