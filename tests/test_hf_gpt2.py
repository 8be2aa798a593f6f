"""A Hugging Face GPT-2 (PyTorch ``transformers``, a small config made here,
no download), saved sharded with ``save_pretrained``, loads into the
reference GPT at every stage and on pod meshes with PyTorch's logits;
after training steps, the export loads back with ``from_pretrained`` and
gives the JAX model's logits.

Needs the ``hf`` extra (torch CPU and transformers); run alone with
``pytest -m hf``."""

import functools

import jax
import numpy as np
import optax
import pytest

import zerojax
from zerojax.app import gpt, hf

pytestmark = pytest.mark.hf

CFG = gpt.GPTConfig(
  vocab=256,
  seq_len=32,
  width=64,
  depth=2,
  heads=4,
  attention="einsum",
  remat="full",
)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out = tmp_path_factory.mktemp("gpt2")
  torch.manual_seed(0)
  config = transformers.GPT2Config(
    vocab_size=CFG.vocab,
    n_positions=CFG.seq_len,
    n_embd=CFG.width,
    n_layer=CFG.depth,
    n_head=CFG.heads,
    activation_function="gelu_new",
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
  )
  model = transformers.GPT2LMHeadModel(config).eval()
  model.save_pretrained(out, max_shard_size="60KB", safe_serialization=True)
  tokens = torch.arange(2 * CFG.seq_len).reshape(2, CFG.seq_len) % CFG.vocab
  with torch.no_grad():
    logits = model(tokens).logits.numpy()
  return out, config, tokens.numpy(), logits


def _tx(stage, axes):
  tp = axes is not None and "model" in axes
  return zerojax.zero(
    optax.adamw(1e-3),
    stage=stage,
    mesh=zerojax.make_mesh(axes),
    model_specs=gpt.model_specs() if tp else None,
    stacked=gpt.is_layer_stack if tp else None,
  )


def _load(path, tx):
  template = jax.eval_shape(lambda: gpt.init(CFG, jax.random.key(0)))
  return zerojax.checkpoint.load_safetensors(
    path, tx, template, mapping=gpt.hf_gpt2_mapping(CFG)
  )


def _logits(state, tokens):
  params = jax.device_get(zerojax.gather_params(state))
  return np.asarray(
    jax.jit(lambda p, t: gpt.forward(p, t, CFG))(params, tokens)
  )


@pytest.mark.parametrize("axes", [None, "replica=2,data=4", "data=4,model=2"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_hugging_face_gpt2_loads_with_pytorchs_logits(
  hf_checkpoint, stage, axes
):
  path, _, tokens, want = hf_checkpoint
  assert len(list(path.glob("model-*.safetensors"))) > 1  # sharded
  state = _load(path, _tx(stage, axes))
  np.testing.assert_allclose(_logits(state, tokens), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
  "stage, axes", [(3, None), (3, "replica=2,data=4"), (2, "data=4,model=2")]
)
def test_a_trained_gpt2_exports_to_from_pretrained_with_the_same_logits(
  hf_checkpoint, tmp_path, stage, axes
):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  path, config, tokens, before = hf_checkpoint
  tx = _tx(stage, axes)
  state = _load(path, tx)
  step = zerojax.train_step(functools.partial(gpt.loss, config=CFG), tx)
  rng = np.random.default_rng(0)
  for _ in range(3):
    seq = rng.integers(0, CFG.vocab, (8, CFG.seq_len + 1), dtype=np.int32)
    batch = zerojax.shard_batch({"x": seq[:, :-1], "y": seq[:, 1:]}, tx, 8)
    state, _ = step(state, batch)
  want = _logits(state, tokens)
  assert np.abs(want - before).max() > 1e-3  # the steps moved the model

  out = tmp_path / "export"
  written = zerojax.checkpoint.save_safetensors(
    state,
    out,
    mapping=gpt.hf_gpt2_mapping(CFG, tied=False),
    max_shard_bytes=60_000,
  )
  assert (out / "model.safetensors.index.json") in written
  config.tie_word_embeddings = False  # the head was trained on its own
  config.save_pretrained(out)
  model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  with torch.no_grad():
    got = model(torch.from_numpy(tokens)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_the_main_jobs_export_loads_with_from_pretrained(
  hf_checkpoint, tmp_path
):
  """zerojax.app.hf.export writes its own config.json: transformers reads
  it and the weights with no config of ours."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  path, _, tokens, want = hf_checkpoint
  state = _load(path, _tx(3, None))
  hf.export(state, CFG, tmp_path)
  model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
  with torch.no_grad():
    got = model(torch.from_numpy(tokens)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
