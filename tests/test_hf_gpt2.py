"""A Hugging Face GPT-2 (PyTorch ``transformers``, a small config made here,
no download), saved sharded with ``save_pretrained``, loads into the
reference GPT at every stage and on pod meshes with PyTorch's logits.

Needs the ``hf`` extra (torch CPU and transformers); run alone with
``pytest -m hf``."""

import jax
import numpy as np
import optax
import pytest

import zerojax
from zerojax.app import gpt

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
  return out, tokens.numpy(), logits


@pytest.mark.parametrize("axes", [None, "replica=2,data=4", "data=4,model=2"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_hugging_face_gpt2_loads_with_pytorchs_logits(
  hf_checkpoint, stage, axes
):
  path, tokens, want = hf_checkpoint
  assert len(list(path.glob("model-*.safetensors"))) > 1  # sharded
  tp = axes is not None and "model" in axes
  tx = zerojax.zero(
    optax.adamw(1e-3),
    stage=stage,
    mesh=zerojax.make_mesh(axes),
    model_specs=gpt.model_specs() if tp else None,
    stacked=gpt.is_layer_stack if tp else None,
  )
  template = jax.eval_shape(lambda: gpt.init(CFG, jax.random.key(0)))
  state = zerojax.checkpoint.load_safetensors(
    path, tx, template, mapping=gpt.hf_gpt2_mapping(CFG)
  )
  params = jax.device_get(zerojax.gather_params(state))
  got = jax.jit(lambda p, t: gpt.forward(p, t, CFG))(params, tokens)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
