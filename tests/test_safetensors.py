"""Safetensors in and out of a state (``zerojax.checkpoint``): exact round
trips at every stage and across stages, stacked and transposed leaves,
each device's block read from the files, and one error listing every
problem of a bad checkpoint before anything is built."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from safetensors.numpy import save_file

import zerojax
from tests import toy
from zerojax import checkpoint
from zerojax.checkpoint import CheckpointError, TensorMap

L, D, F, V = 3, 16, 24, 13


def _params(key=0):
  k = jax.random.split(jax.random.key(key), 5)
  return {
    "blocks": {
      "w": jax.random.normal(k[0], (L, D, F)),  # per-layer, transposed
      "b": jax.random.normal(k[1], (L, F)),  # per-layer
    },
    "embed": jax.random.normal(k[2], (V, D)),  # V does not divide 8: padded
    "head": jax.random.normal(k[3], (D, V)),  # transposed, one tensor
    "scale": jnp.float32(1.5),
    "ids": jnp.arange(4, dtype=jnp.int32),  # carried, not trained
  }


MAPPING = {
  "['blocks']['b']": [f"h.{i}.mlp.bias" for i in range(L)],
  "['blocks']['w']": TensorMap(
    [f"h.{i}.mlp.weight" for i in range(L)], transpose=True
  ),
  "['embed']": "wte.weight",
  "['head']": TensorMap("lm_head.weight", transpose=True),
  "['ids']": "position_ids",
  "['scale']": "ln_f.scale",
}


def _hf_tensors(params) -> dict:
  """The params as a PyTorch-style checkpoint names and lays them out."""
  p = jax.tree.map(np.asarray, params)
  out = {
    "wte.weight": p["embed"],
    "lm_head.weight": p["head"].T.copy(),
    "ln_f.scale": p["scale"],
    "position_ids": p["ids"],
  }
  for i in range(L):
    out[f"h.{i}.mlp.weight"] = p["blocks"]["w"][i].T.copy()
    out[f"h.{i}.mlp.bias"] = p["blocks"]["b"][i]
  return out


def _template():
  return jax.eval_shape(_params)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_checkpoint_loads_exactly_at_every_stage(mesh, tmp_path, stage):
  """Each leaf, read block by block into its layout (padding, stacks,
  transposes), is bitwise the tensor in the file; master copy and
  optimizer state are what zerojax.init builds from the same values."""
  params = _params()
  save_file(_hf_tensors(params), tmp_path / "model.safetensors")
  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, mesh=mesh)
  state = checkpoint.load_safetensors(
    tmp_path, tx, _template(), mapping=MAPPING
  )
  reference = zerojax.init(params, tx, copy=True)
  toy.assert_same_arrays(state, reference)


def test_safetensors_shapes_reads_every_tensor_from_the_headers(tmp_path):
  tensors = _hf_tensors(_params())
  tensors["wte.weight"] = tensors["wte.weight"].astype(ml_dtypes.bfloat16)
  save_file(tensors, tmp_path / "model.safetensors")
  shapes = checkpoint.safetensors_shapes(tmp_path)
  assert shapes == {
    name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in tensors.items()
  }
  assert shapes["lm_head.weight"].shape == (V, D)
  assert shapes["wte.weight"].dtype == jnp.bfloat16


@pytest.mark.parametrize("stages", [(3, 0), (1, 3), (2, 2)])
def test_export_then_load_is_exact_across_stages(mesh, tmp_path, stages):
  """Trained at one stage, written in shards of at most 1 KiB with an
  index, loaded at another: the params are bitwise the trained master
  copy, and the files hold the names and layouts of a PyTorch checkpoint."""
  tx = zerojax.zero(optax.adamw(1e-2), stage=stages[0], mesh=mesh)
  state = zerojax.init(_params(), tx)
  step = zerojax.train_step(
    lambda p, b: (
      jnp.mean((b @ p["embed"].T) ** 2)
      + jnp.sum(p["blocks"]["w"] ** 2) * p["scale"]
      + jnp.sum(p["blocks"]["b"]) * jnp.sum(p["head"])
    ),
    tx,
  )
  for _ in range(2):
    state, _ = step(state, jnp.ones((8, D)))
  written = checkpoint.save_safetensors(
    state, tmp_path, mapping=MAPPING, max_shard_bytes=1024
  )
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(written) > 2 and set(index["weight_map"]) == set(
    _hf_tensors(_params())
  )
  trained = zerojax.gather_params(state, master=True)
  tx2 = zerojax.zero(optax.adamw(1e-2), stage=stages[1], mesh=mesh)
  back = checkpoint.load_safetensors(
    tmp_path, tx2, _template(), mapping=MAPPING
  )
  toy.assert_same_arrays(
    zerojax.gather_params(back),
    zerojax.gather_params(zerojax.init(trained, tx2)),
  )
  naive = {}
  from safetensors.numpy import load_file

  for f in sorted(tmp_path.glob("model-*.safetensors")):
    naive.update(load_file(f))
  np.testing.assert_array_equal(
    naive["lm_head.weight"], np.asarray(trained["head"]).T
  )


def test_a_bf16_checkpoint_loads_into_an_fp32_master(mesh, tmp_path):
  params = _params()
  tensors = {
    k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v
    for k, v in _hf_tensors(params).items()
  }
  save_file(tensors, tmp_path / "model.safetensors")
  tx = zerojax.zero(
    optax.adamw(1e-3),
    stage=3,
    mesh=mesh,
    policy=zerojax.Policy(param_dtype=jnp.bfloat16),
  )
  state = checkpoint.load_safetensors(
    tmp_path, tx, _template(), mapping=MAPPING
  )
  want = jax.tree.map(
    lambda x: (
      x.astype(jnp.bfloat16).astype(x.dtype) if x.dtype == jnp.float32 else x
    ),
    params,
  )
  toy.assert_same_arrays(state, zerojax.init(want, tx, copy=True))


def test_every_problem_of_a_bad_checkpoint_is_named_at_once(mesh, tmp_path):
  tensors = _hf_tensors(_params())
  del tensors["wte.weight"]  # missing
  tensors["h.1.mlp.bias"] = np.zeros((F + 1,), np.float32)  # misshaped
  tensors["position_ids"] = np.zeros((4,), np.float32)  # wrongly typed
  tensors["attn.masked_bias"] = np.zeros((2,), np.float32)  # unexpected
  save_file(tensors, tmp_path / "model.safetensors")
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  with pytest.raises(CheckpointError) as e:
    checkpoint.load_safetensors(tmp_path, tx, _template(), mapping=MAPPING)
  msg = str(e.value)
  for said in (
    "'wte.weight' is missing",
    "'h.1.mlp.bias' is [25], expected [24]",
    "'position_ids' is F32, the param is int32",
    "'attn.masked_bias'",
    "nothing was built",
  ):
    assert said in msg, msg
  del tensors["attn.masked_bias"]
  tensors["wte.weight"] = np.zeros((V, D), np.float32)
  tensors["h.1.mlp.bias"] = np.zeros((F,), np.float32)
  tensors["position_ids"] = np.zeros((4,), np.int32)
  tensors["attn.masked_bias"] = np.zeros((2,), np.float32)
  save_file(tensors, tmp_path / "model.safetensors")
  state = checkpoint.load_safetensors(
    tmp_path, tx, _template(), mapping=MAPPING, unused="ignore"
  )
  assert zerojax.gather_params(state)["embed"].shape == (V, D)


def test_a_dtype_jax_has_no_type_for_is_named_before_building(mesh, tmp_path):
  """safetensors knows F8_E8M0 (a scale format); JAX has no array type for
  it: the tensor is named with the others, nothing is built."""
  import struct

  header = {"w": {"dtype": "F8_E8M0", "shape": [8], "data_offsets": [0, 8]}}
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  (tmp_path / "model.safetensors").write_bytes(
    struct.pack("<Q", len(raw)) + raw + bytes(8)
  )
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  with pytest.raises(CheckpointError, match="'w' is F8_E8M0, a dtype JAX"):
    checkpoint.load_safetensors(
      tmp_path,
      tx,
      {"w": jax.ShapeDtypeStruct((8,), jnp.float32)},
      mapping={"['w']": "w"},
    )


def test_a_truncated_file_or_a_lost_shard_is_named(mesh, tmp_path):
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  state = zerojax.init(_params(), tx)
  checkpoint.save_safetensors(
    state, tmp_path, mapping=MAPPING, max_shard_bytes=1024
  )
  shards = sorted(tmp_path.glob("model-*.safetensors"))
  data = shards[1].read_bytes()
  shards[1].write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match=f"{shards[1].name}.*truncated"):
    checkpoint.load_safetensors(tmp_path, tx, _template(), mapping=MAPPING)
  shards[1].unlink()
  with pytest.raises(CheckpointError, match=f"do not exist: {shards[1].name}"):
    checkpoint.load_safetensors(tmp_path, tx, _template(), mapping=MAPPING)


def test_export_refuses_two_params_mapped_to_one_tensor(mesh, tmp_path):
  """A tied weight loads into two leaves; written back, one would be lost,
  so export refuses before writing anything."""
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  state = zerojax.init(_params(), tx)
  tied = dict(MAPPING, **{"['head']": TensorMap("wte.weight", transpose=True)})
  with pytest.raises(CheckpointError, match="both map to tensor 'wte.weight'"):
    checkpoint.save_safetensors(state, tmp_path / "out", mapping=tied)
  assert not (tmp_path / "out").exists()


def test_a_checkpoint_loads_on_the_meshes_users_hold(any_mesh, tmp_path):
  """Auto and Explicit axes, and a ``jax.make_mesh`` set with
  ``jax.set_mesh`` (no ``mesh=``): the state zerojax.init builds."""
  params = _params()
  save_file(_hf_tensors(params), tmp_path / "model.safetensors")
  tx = zerojax.zero(optax.adamw(1e-3), stage=3, mesh=any_mesh)
  state = checkpoint.load_safetensors(
    tmp_path, tx, _template(), mapping=MAPPING
  )
  toy.assert_same_arrays(state, zerojax.init(params, tx, copy=True))
  with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    tx = zerojax.zero(optax.adamw(1e-3), stage=2)
    state = checkpoint.load_safetensors(
      tmp_path, tx, _template(), mapping=MAPPING
    )
    toy.assert_same_arrays(state, zerojax.init(params, tx, copy=True))
