"""The main job's Hugging Face GPT-2 checkpoints: the model's dimensions
read from a safetensors checkpoint's headers (``--init-from``), the state
loaded from it with each process reading its own rows, and the trained
model written as a checkpoint that ``transformers``'
``GPT2LMHeadModel.from_pretrained`` loads (``--export-dir``)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax

from zerojax import checkpoint
from zerojax.app import gpt

# non-persistent attention masks some GPT-2 checkpoints carry: not weights
_BUFFERS = (".attn.bias", ".attn.masked_bias")


@dataclasses.dataclass(frozen=True)
class GPT2Checkpoint:
  """What a GPT-2 safetensors checkpoint holds, from its headers (and its
  ``config.json``, when there is one beside it)."""

  path: str
  prefix: str  # "transformer." (GPT2LMHeadModel) or "" (GPT2Model)
  tied: bool  # no lm_head.weight: the head is the token embedding
  vocab: int
  width: int
  depth: int
  seq_len: int
  heads: int | None  # config.json's n_head; None without a config.json
  unused: str  # "ignore" when the only unmapped tensors are mask buffers

  def model(self, **options) -> gpt.GPTConfig:
    """The reference GPT of these dimensions (``heads`` from ``options``
    when the checkpoint has no config.json)."""
    dims = dict(
      vocab=self.vocab, width=self.width, depth=self.depth, seq_len=self.seq_len
    )
    return gpt.GPTConfig(**{"heads": self.heads or 1, **dims, **options})


def inspect(path) -> GPT2Checkpoint:
  """Reads the checkpoint's headers; raises ``CheckpointError`` when it is
  not a GPT-2."""
  shapes = checkpoint.safetensors_shapes(path)
  prefix = next(
    (p for p in ("transformer.", "") if f"{p}wte.weight" in shapes), None
  )
  if prefix is None or f"{prefix}wpe.weight" not in shapes:
    raise checkpoint.CheckpointError(
      f"zerojax.train --init-from {path}: the checkpoint holds no GPT-2 "
      f"embeddings (transformer.wte.weight and transformer.wpe.weight, or "
      f"wte.weight and wpe.weight); it holds e.g. "
      f"{', '.join(list(shapes)[:4])}. Pass a GPT-2 checkpoint "
      f"(save_pretrained of GPT2LMHeadModel, or this job's --export-dir)."
    )
  vocab, width = shapes[f"{prefix}wte.weight"].shape
  depth = 0
  while f"{prefix}h.{depth}.ln_1.weight" in shapes:
    depth += 1
  config = pathlib.Path(path)
  config = (config if config.is_dir() else config.parent) / "config.json"
  heads = (
    json.loads(config.read_text()).get("n_head") if config.is_file() else None
  )
  tied = "lm_head.weight" not in shapes
  out = GPT2Checkpoint(
    str(path),
    prefix,
    tied,
    int(vocab),
    int(width),
    depth,
    int(shapes[f"{prefix}wpe.weight"].shape[0]),
    heads,
    "raise",
  )
  mapped = set()
  for m in _mapping(out, out.model()).values():
    mapped.update([m] if isinstance(m, str) else getattr(m, "names", m))
  extra = set(shapes) - mapped
  if extra and all(n.endswith(_BUFFERS) for n in extra):
    out = dataclasses.replace(out, unused="ignore")
  return out


def _mapping(ckpt: GPT2Checkpoint, model: gpt.GPTConfig) -> dict:
  return gpt.hf_gpt2_mapping(model, prefix=ckpt.prefix, tied=ckpt.tied)


def flag_problems(config, ckpt: GPT2Checkpoint) -> tuple[dict, list[str]]:
  """The main job's model flags the checkpoint fixes: ``(fill, problems)``,
  ``fill`` setting each automatic (0) one, ``problems`` naming each flag
  that disagrees with the checkpoint."""
  fill, problems = {}, []
  for field, value in (
    ("width", ckpt.width),
    ("depth", ckpt.depth),
    ("seq_len", ckpt.seq_len),
    ("heads", ckpt.heads),
  ):
    flag = "--" + field.replace("_", "-")
    given = getattr(config, field)
    if value is None:  # heads, without a config.json
      if not given:
        problems.append(
          f"--init-from {ckpt.path} has no config.json giving n_head; "
          f"pass --heads"
        )
    elif given and given != value:
      problems.append(
        f"{flag}={given} but --init-from {ckpt.path} has {value}; pass "
        f"{flag} {value} (or 0: from the checkpoint)"
      )
    else:
      fill[field] = value
  if ckpt.vocab < 256:
    problems.append(
      f"--init-from {ckpt.path} has a vocabulary of {ckpt.vocab}, fewer "
      f"than the 256 byte tokens this job trains on"
    )
  return fill, problems


def load(ckpt: GPT2Checkpoint, model: gpt.GPTConfig, tx, key=None):
  """The ZeRO state of ``tx`` from the checkpoint, each process reading
  its own devices' rows."""
  template = jax.eval_shape(lambda: gpt.init(model, jax.random.key(0)))
  return checkpoint.load_safetensors(
    ckpt.path,
    tx,
    template,
    mapping=_mapping(ckpt, model),
    unused=ckpt.unused,
    key=key,
  )


def export(state, model: gpt.GPTConfig, directory) -> list[pathlib.Path]:
  """Writes the master copy as a GPT-2 checkpoint with an untied head (this
  model trains the head and the token embedding as two leaves) and its
  ``config.json``; every process takes part, the files are dealt out to
  them."""
  directory = pathlib.Path(directory)
  written = checkpoint.save_safetensors(
    state, directory, mapping=gpt.hf_gpt2_mapping(model, tied=False)
  )
  if jax.process_index() == 0:
    config = {
      "architectures": ["GPT2LMHeadModel"],
      "model_type": "gpt2",
      "vocab_size": model.vocab,
      "n_positions": model.seq_len,
      "n_embd": model.width,
      "n_layer": model.depth,
      "n_head": model.heads,
      "n_inner": model.mlp_ratio * model.width,
      "activation_function": "gelu_new",  # jax.nn.gelu's tanh form
      "layer_norm_epsilon": 1e-5,
      "resid_pdrop": model.dropout,
      "embd_pdrop": 0.0,
      "attn_pdrop": 0.0,
      "tie_word_embeddings": False,
      "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    written.append(directory / "config.json")
  return written
