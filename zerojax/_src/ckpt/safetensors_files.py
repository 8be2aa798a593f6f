"""Safetensors files on disk: which file holds each tensor (one file, or
shards with their index), each tensor's shape and dtype from the headers
alone, and reads of a block of rows."""

from __future__ import annotations

import json
import pathlib
import struct
import threading

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from zerojax._src.ckpt.layout_json import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def files(path) -> dict[str, pathlib.Path]:
  """Tensor name -> file, from one file, a directory with one
  ``model.safetensors``, or a directory with an index and its shards."""
  path = pathlib.Path(path)
  if path.is_file():
    return {name: path for name in _keys(path)}
  index = path / INDEX
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
      raise CheckpointError(
        f"zerojax safetensors: {index} is not a safetensors index (no "
        f"weight_map: {e}). Write it with zerojax.checkpoint.save_safetensors "
        f"or transformers' save_pretrained."
      ) from e
    lost = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    if lost:
      raise CheckpointError(
        f"zerojax safetensors: {index} lists shard files that do not exist: "
        f"{', '.join(lost)} (holding e.g. "
        f"{next(n for n, f in weight_map.items() if f == lost[0])!r}). Copy "
        f"the missing shards beside the index."
      )
    found = {}
    for f in sorted(set(weight_map.values())):
      for name in _keys(path / f):
        found[name] = path / f
    return found
  single = path / SINGLE
  if single.is_file():
    return {name: single for name in _keys(single)}
  raise CheckpointError(
    f"zerojax safetensors: {path} holds neither {SINGLE} nor {INDEX}; pass "
    f"a .safetensors file or a directory written by save_pretrained."
  )


def _keys(file: pathlib.Path) -> list[str]:
  try:
    with safe_open(file, "numpy") as f:
      return list(f.keys())
  except (SafetensorError, OSError) as e:
    raise CheckpointError(
      f"zerojax safetensors: {file} cannot be read ({e}); the file is "
      f"truncated or not a safetensors file. Copy it again."
    ) from e


class Reader:
  """Each tensor's shape and dtype, and read-only views of its bytes.

  The files were validated by safetensors when they were listed
  (:func:`files`); the data is then read through a ``numpy.memmap`` of
  each file (the format is a JSON header, then each tensor's bytes in C
  order at the offsets the header gives), so a block of any tensor is
  copied once, straight from the page cache into the buffer a device
  gets, with no intermediate copy per read."""

  def __init__(self, files: dict[str, pathlib.Path]):
    self.files = files
    self._maps: dict[pathlib.Path, tuple[np.memmap, int, dict]] = {}
    self._lock = threading.Lock()

  def _file(self, name: str) -> tuple[np.memmap, int, dict]:
    file = self.files[name]
    with self._lock:  # reader threads share the open files
      if file not in self._maps:
        with open(file, "rb") as f:
          (n,) = struct.unpack("<Q", f.read(8))
          header = json.loads(f.read(n))
        data = np.memmap(file, np.uint8, mode="r")
        self._maps[file] = (data, 8 + n, header)
      return self._maps[file]

  def info(self, name: str) -> tuple[tuple, str]:
    entry = self._file(name)[2][name]
    return tuple(entry["shape"]), entry["dtype"]

  def view(self, name: str) -> np.ndarray:
    """The tensor as a read-only array over the mapped file."""
    data, start, header = self._file(name)
    entry = header[name]
    if entry["dtype"] not in DTYPES:
      raise CheckpointError(
        f"zerojax safetensors: tensor {name!r} is {entry['dtype']}, a dtype "
        f"JAX has no array type for."
      )
    begin, end = entry["data_offsets"]
    raw = data[start + begin : start + end]
    return raw.view(np.dtype(DTYPES[entry["dtype"]])).reshape(entry["shape"])

  def close(self):
    self._maps.clear()


# safetensors' dtype names -> the JAX array types they load as
DTYPES = {
  "F64": jnp.float64,
  "F32": jnp.float32,
  "F16": jnp.float16,
  "BF16": jnp.bfloat16,
  "F8_E4M3": jnp.float8_e4m3fn,
  "F8_E5M2": jnp.float8_e5m2,
  "I64": jnp.int64,
  "I32": jnp.int32,
  "I16": jnp.int16,
  "I8": jnp.int8,
  "U64": jnp.uint64,
  "U32": jnp.uint32,
  "U16": jnp.uint16,
  "U8": jnp.uint8,
  "BOOL": jnp.bool_,
}


def safetensors_shapes(path) -> dict[str, jax.ShapeDtypeStruct]:
  """Every tensor in a safetensors checkpoint (a file, or a directory as
  ``save_pretrained`` writes it) with its shape and dtype, read from the
  headers alone: what a mapping for
  :func:`~zerojax.checkpoint.load_safetensors` has to name."""
  reader = Reader(files(path))
  try:
    out = {}
    for name in sorted(reader.files):
      shape, dtype = reader.info(name)
      if dtype not in DTYPES:
        reader.view(name)  # raises, naming the dtype
      out[name] = jax.ShapeDtypeStruct(shape, np.dtype(DTYPES[dtype]))
    return out
  finally:
    reader.close()
