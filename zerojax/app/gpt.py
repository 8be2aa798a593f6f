"""A GPT-style decoder whose layers run in a ``lax.scan``.

Token and position embeddings, ``depth`` pre-norm blocks of causal
self-attention and MLP, a final norm and an output head. Written for
zerojax: every parameter is passed through :func:`zerojax.gather` right
before use, and the block runs under ``jax.checkpoint`` inside the scan, so
under ZeRO-3 one layer's full weights exist at a time (gathered in the
forward loop, gathered again in the backward loop). At stages 0-2, and
outside a train step, ``gather`` is the identity.

Tensor names carry their shapes: B batch, T time, D width, H heads,
K head width, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax

import zerojax
from zerojax import gather


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab: int = 256  # byte-level tokens by default
  seq_len: int = 128  # T: context length
  width: int = 128  # D
  depth: int = 4  # L
  heads: int = 4  # H
  mlp_ratio: int = 4  # F = mlp_ratio * D
  scan_unroll: int = 1  # layers per scan iteration (2: XLA may gather
  # layer i+1 while layer i computes)
  dropout: float = 0.0  # residual dropout rate in training (needs a key)
  attention: str = "auto"  # "einsum": the reference (fp32 T x T logits);
  # "xla" / "cudnn": jax.nn.dot_product_attention
  # with that implementation; "auto": cudnn on
  # GPU, einsum elsewhere
  compute_dtype: str | None = None  # e.g. "bfloat16": weights are cast to
  # it right after their gather (params stay in
  # their own dtype, e.g. fp32, as in Flax's dtype
  # vs param_dtype); None: compute in the params'
  remat: str = "auto"  # the block's jax.checkpoint policy: "full"
  # (save only the block input), "dots" (also the
  # matmul outputs), "offload" (ZeRO-R's Pa+cpu:
  # save only the block input, in pinned host
  # memory, brought back layer by layer in the
  # backward pass), "none" (no remat: every
  # layer's activations and, under ZeRO-3, its
  # gathered weights are kept); "auto": dots on
  # GPU, full elsewhere
  seq_shard: str | None = None  # Pa (ZeRO-R's partitioned activations,
  # Megatron's sequence parallelism): a mesh axis
  # the residual stream between blocks is split
  # over along the sequence, so the checkpoints
  # saved per layer shrink by its size (XLA
  # gathers them where a block needs the whole
  # sequence). Usually the tensor-parallel
  # "model" axis; a no-op where the current mesh
  # lacks the axis (a one-device reference)

  def __post_init__(self):
    if self.width % self.heads:
      raise ValueError(
        f"GPTConfig: width={self.width} is not divisible by "
        f"heads={self.heads}; pick heads dividing the width."
      )
    for name in ("vocab", "seq_len", "width", "depth", "heads", "mlp_ratio"):
      if getattr(self, name) < 1:
        raise ValueError(
          f"GPTConfig: {name}={getattr(self, name)} must be >= 1."
        )
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1).")
    if self.attention not in ATTENTION:
      raise ValueError(
        f"GPTConfig: attention={self.attention!r}; use one of {ATTENTION}."
      )
    if self.remat not in REMAT:
      raise ValueError(f"GPTConfig: remat={self.remat!r}; use one of {REMAT}.")

  def resolved(self, platform: str | None = None) -> GPTConfig:
    """``attention`` and ``remat`` with ``"auto"`` replaced by the fast
    choice for ``platform`` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    gpu = platform in ("gpu", "cuda", "rocm")
    return dataclasses.replace(
      self,
      attention=("cudnn" if gpu else "einsum")
      if self.attention == "auto"
      else self.attention,
      remat=("dots" if gpu else "full") if self.remat == "auto" else self.remat,
    )


ATTENTION = ("auto", "einsum", "xla", "cudnn")
REMAT = ("auto", "full", "dots", "offload", "none")

# The name of each block's input in the program (zerojax.remat's), for
# checkpoint policies: ``remat="offload"`` offloads it.
LAYER_INPUT = zerojax.Remat.input_name


# Logical axis names of every parameter's dimensions (None: never split).
# ``heads``, ``mlp`` and ``vocab`` are the tensor-parallel dimensions of a
# Megatron layout (column-parallel qkv and fc1, row-parallel proj and fc2,
# vocabulary-parallel embedding and head); ``embed`` is the model width.
LOGICAL_AXES = {
  "embed_VxD": ("vocab", "embed"),
  "pos_TxD": (None, "embed"),
  "blocks": {
    "ln1_scale_LxD": ("layers", "embed"),
    "ln1_bias_LxD": ("layers", "embed"),
    "qkv_LxDx3D": ("layers", "embed", "heads"),
    "qkv_bias_Lx3D": ("layers", "heads"),
    "proj_LxDxD": ("layers", "heads", "embed"),
    "proj_bias_LxD": ("layers", "embed"),
    "ln2_scale_LxD": ("layers", "embed"),
    "ln2_bias_LxD": ("layers", "embed"),
    "fc1_LxDxF": ("layers", "embed", "mlp"),
    "fc1_bias_LxF": ("layers", "mlp"),
    "fc2_LxFxD": ("layers", "mlp", "embed"),
    "fc2_bias_LxD": ("layers", "embed"),
  },
  "lnf_scale_D": ("embed",),
  "lnf_bias_D": ("embed",),
  "head_DxV": ("embed", "vocab"),
}

# Logical axis -> mesh axis: Megatron-style tensor parallelism over "model".
TP_RULES = (("heads", "model"), ("mlp", "model"), ("vocab", "model"))


def model_specs(rules=TP_RULES):
  """The params' ``PartitionSpec`` tree for ``rules`` (pairs of logical axis
  and mesh axis, as in Flax's logical partitioning); for
  ``zerojax.zero(..., model_specs=...)``."""
  table = dict(rules)
  to_spec = lambda names: jax.sharding.PartitionSpec(
    *(table.get(n) if n is not None else None for n in names)
  )
  return jax.tree.map(
    to_spec, LOGICAL_AXES, is_leaf=lambda x: isinstance(x, tuple)
  )


def hf_gpt2_mapping(
  config: GPTConfig, prefix: str = "transformer.", tied: bool = True
) -> dict:
  """Where each param lives in a Hugging Face GPT-2 checkpoint (PyTorch
  ``GPT2LMHeadModel.save_pretrained``), for
  ``zerojax.checkpoint.load_safetensors`` and ``save_safetensors``: the
  per-layer tensors ``h.{i}.*`` stacked into the scanned blocks, GPT-2's
  ``Conv1D`` weights stored ``(in, out)`` as this model's are, and the head
  read from the token embedding (``wte``, transposed) when ``tied``, else
  from its own ``lm_head.weight`` (a checkpoint with
  ``tie_word_embeddings=False``). This model trains the head and the
  embedding as two leaves, so export with ``tied=False``: a file holds one
  tensor per name. The config must match the checkpoint's:
  ``width`` = ``n_embd``, ``depth`` = ``n_layer``, ``heads`` = ``n_head``,
  ``seq_len`` = ``n_positions``, ``vocab`` = ``vocab_size``, ``mlp_ratio``
  4 (GPT-2's GELU is the tanh approximation, as ``jax.nn.gelu``'s)."""
  from zerojax.checkpoint import TensorMap

  per_layer = lambda name: [
    f"{prefix}h.{i}.{name}" for i in range(config.depth)
  ]
  blocks = {
    "ln1_scale_LxD": "ln_1.weight",
    "ln1_bias_LxD": "ln_1.bias",
    "qkv_LxDx3D": "attn.c_attn.weight",
    "qkv_bias_Lx3D": "attn.c_attn.bias",
    "proj_LxDxD": "attn.c_proj.weight",
    "proj_bias_LxD": "attn.c_proj.bias",
    "ln2_scale_LxD": "ln_2.weight",
    "ln2_bias_LxD": "ln_2.bias",
    "fc1_LxDxF": "mlp.c_fc.weight",
    "fc1_bias_LxF": "mlp.c_fc.bias",
    "fc2_LxFxD": "mlp.c_proj.weight",
    "fc2_bias_LxD": "mlp.c_proj.bias",
  }
  out: dict[str, object] = {
    "['embed_VxD']": f"{prefix}wte.weight",
    "['pos_TxD']": f"{prefix}wpe.weight",
    "['lnf_scale_D']": f"{prefix}ln_f.weight",
    "['lnf_bias_D']": f"{prefix}ln_f.bias",
    "['head_DxV']": TensorMap(
      f"{prefix}wte.weight" if tied else "lm_head.weight", transpose=True
    ),
  }
  out.update({f"['blocks']['{k}']": per_layer(v) for k, v in blocks.items()})
  return out


def is_layer_stack(path: str, shape) -> bool:
  """For ``zerojax.zero(stacked=...)``: only the blocks are layer stacks, so
  the embedding and head may be sharded along any dimension."""
  del shape
  return "blocks" in path


def num_params(config: GPTConfig) -> int:
  """Parameter count, from abstract shapes (allocates nothing)."""
  shapes = jax.eval_shape(lambda: init(config, jax.random.key(0)))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def flops_per_token(config: GPTConfig, n_params: int | None = None) -> float:
  """Model flops per trained token: ``6 N + 12 L T D`` (forward and
  backward of the weights, plus attention's score and value products;
  causal masking not halved, recomputation not counted), the usual MFU
  numerator."""
  n = num_params(config) if n_params is None else n_params
  return 6.0 * n + 12.0 * config.depth * config.seq_len * config.width


@functools.partial(jax.jit, static_argnums=0)
def init(config: GPTConfig, key) -> dict:
  """Parameters, fp32. Blocks are stacked along a leading layer axis L.

  One program per config, the one :func:`zerojax.init_from` traces: called
  eagerly, each draw and each filled leaf would compile a program of its
  own for its shape."""
  d, f, l, v = (
    config.width,
    config.mlp_ratio * config.width,
    config.depth,
    config.vocab,
  )
  k = jax.random.split(key, 7)
  normal = lambda key, shape, std: jax.random.normal(key, shape) * std
  resid_std = 0.02 / math.sqrt(2 * l)  # GPT-2's scaled residual init
  return {
    "embed_VxD": normal(k[0], (v, d), 0.02),
    "pos_TxD": normal(k[1], (config.seq_len, d), 0.01),
    "blocks": {
      "ln1_scale_LxD": jnp.ones((l, d)),
      "ln1_bias_LxD": jnp.zeros((l, d)),
      "qkv_LxDx3D": normal(k[2], (l, d, 3 * d), 0.02),
      "qkv_bias_Lx3D": jnp.zeros((l, 3 * d)),
      "proj_LxDxD": normal(k[3], (l, d, d), resid_std),
      "proj_bias_LxD": jnp.zeros((l, d)),
      "ln2_scale_LxD": jnp.ones((l, d)),
      "ln2_bias_LxD": jnp.zeros((l, d)),
      "fc1_LxDxF": normal(k[4], (l, d, f), 0.02),
      "fc1_bias_LxF": jnp.zeros((l, f)),
      "fc2_LxFxD": normal(k[5], (l, f, d), resid_std),
      "fc2_bias_LxD": jnp.zeros((l, d)),
    },
    "lnf_scale_D": jnp.ones((d,)),
    "lnf_bias_D": jnp.zeros((d,)),
    "head_DxV": normal(k[6], (d, v), 0.02),
  }


def _layer_norm(x_BxTxD, scale_D, bias_D):
  x = x_BxTxD.astype(jnp.float32)
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + 1e-5)
  return (y * scale_D[None, None, :] + bias_D[None, None, :]).astype(
    x_BxTxD.dtype
  )


def _dropout(x, rate, key):
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _block(config: GPTConfig, x_BxTxD, layer, key=None):
  """One pre-norm transformer block; ``layer`` holds one layer's shards.

  With ``key``, residual dropout (rate ``config.dropout``) on the attention
  and MLP outputs."""
  layer = _cast(gather(layer), config)  # ZeRO-3: this layer's weights only
  k_att, k_mlp = jax.random.split(key) if key is not None else (None, None)
  b, t, d = x_BxTxD.shape
  h, k = config.heads, d // config.heads

  y = _layer_norm(x_BxTxD, layer["ln1_scale_LxD"], layer["ln1_bias_LxD"])
  qkv_BxTx3D = y @ layer["qkv_LxDx3D"] + layer["qkv_bias_Lx3D"][None, None, :]
  q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = jnp.split(
    qkv_BxTx3D.reshape(b, t, 3 * h, k), 3, axis=2
  )
  att_BxTxHxK = attend(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, config.attention)
  att_BxTxD = att_BxTxHxK.reshape(b, t, d) @ layer["proj_LxDxD"]
  att_BxTxD = _dropout(
    att_BxTxD + layer["proj_bias_LxD"][None, None, :], config.dropout, k_att
  )
  x_BxTxD = x_BxTxD + att_BxTxD

  y = _layer_norm(x_BxTxD, layer["ln2_scale_LxD"], layer["ln2_bias_LxD"])
  y_BxTxF = jax.nn.gelu(
    y @ layer["fc1_LxDxF"] + layer["fc1_bias_LxF"][None, None, :]
  )
  y_BxTxD = y_BxTxF @ layer["fc2_LxFxD"] + layer["fc2_bias_LxD"][None, None, :]
  return x_BxTxD + _dropout(y_BxTxD, config.dropout, k_mlp), None


def attend(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, how: str = "einsum"):
  """Causal self-attention, ``(B, T, H, K)`` in and out.

  ``"einsum"``: the reference, fp32 ``(B, H, T, T)`` logits materialised;
  ``"xla"`` / ``"cudnn"``: :func:`jax.nn.dot_product_attention` with that
  implementation (cuDNN's fused flash kernel on NVIDIA GPUs: the logits
  never reach memory)."""
  if how in ("xla", "cudnn"):
    return jax.nn.dot_product_attention(
      q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, is_causal=True, implementation=how
    )
  t, k = q_BxTxHxK.shape[1], q_BxTxHxK.shape[-1]
  logits_BxHxTxT = jnp.einsum(
    "bthk,bshk->bhts", q_BxTxHxK, k_BxTxHxK, preferred_element_type=jnp.float32
  ) / math.sqrt(k)
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  logits_BxHxTxT = jnp.where(causal_TxT[None, None], logits_BxHxTxT, -1e30)
  probs_BxHxTxT = jax.nn.softmax(logits_BxHxTxT, axis=-1).astype(
    q_BxTxHxK.dtype
  )
  return jnp.einsum("bhts,bshk->bthk", probs_BxHxTxT, v_BxTxHxK)


def _remat(fn, config: GPTConfig):
  """The scanned block under the config's checkpoint policy, through
  :func:`zerojax.remat` ("full": the block input; "dots": also the matmul
  outputs; "offload": the block input in pinned host memory; ``seq_shard``:
  Pa over that mesh axis). On JAX's CPU backend (one memory) "offload"
  computes the numbers of "full"."""
  if config.remat == "none" and config.seq_shard is None:
    return fn
  saves = {"none": "all", "dots": "dots"}.get(config.remat, "input")
  return zerojax.remat(
    fn,
    saves=saves,
    offload=config.remat == "offload",
    partition=config.seq_shard,
  )


def forward(params, tokens_BxT, config: GPTConfig, key=None):
  """Logits ``(B, T, V)`` in fp32 for integer tokens ``(B, T)``.

  ``key``: training mode with dropout (when ``config.dropout > 0``)."""
  config = config.resolved()
  t = tokens_BxT.shape[1]
  if t > config.seq_len:
    raise ValueError(
      f"gpt.forward: {t} tokens exceed seq_len={config.seq_len}."
    )
  embed_VxD = _cast(gather(params["embed_VxD"]), config)
  pos_TxD = _cast(gather(params["pos_TxD"]), config)
  x_BxTxD = _lookup(embed_VxD, tokens_BxT) + pos_TxD[None, :t, :]
  if key is not None and config.dropout > 0:
    keys_L = jax.random.split(key, config.depth)  # one key per layer
    block = _remat(lambda x, lk: _block(config, x, lk[0], lk[1]), config)
    xs = (params["blocks"], keys_L)
  else:
    block = _remat(lambda x, layer: _block(config, x, layer), config)
    xs = params["blocks"]
  x_BxTxD, _ = jax.lax.scan(block, x_BxTxD, xs, unroll=config.scan_unroll)
  x_BxTxD = _layer_norm(
    x_BxTxD, gather(params["lnf_scale_D"]), gather(params["lnf_bias_D"])
  )
  return jnp.einsum(
    "btd,dv->btv",
    x_BxTxD,
    _cast(gather(params["head_DxV"]), config),
    preferred_element_type=jnp.float32,
  )


def _lookup(table_VxD, tokens_BxT):
  """``table[tokens]``. On a mesh with Explicit axes (a loop written for
  sharding in types) the rows come out split as the tokens are."""
  mesh = _explicit_mesh(tokens_BxT)
  if mesh is None:
    return table_VxD[tokens_BxT]
  spec = jax.typeof(tokens_BxT).sharding.spec
  return table_VxD.at[tokens_BxT].get(
    out_sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*spec, None)
    )
  )


def _explicit_mesh(x):
  """The mesh ``x`` is typed on when it has Explicit axes, else ``None``."""
  mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  if (
    mesh is None
    or mesh.empty
    or not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  ):
    return None
  return mesh


def _cast(tree, config: GPTConfig):
  if config.compute_dtype is None:
    return tree
  return jax.tree.map(lambda x: x.astype(config.compute_dtype), tree)


def loss(params, batch, config: GPTConfig, key=None):
  """Mean next-token cross-entropy; ``batch = {"x": (B,T), "y": (B,T)}``.

  With ``key`` (zerojax passes one when the state has a key) and
  ``config.dropout > 0``, trains with dropout."""
  logits_BxTxV = forward(params, batch["x"], config, key)
  if _explicit_mesh(batch["y"]) is None:
    return optax.softmax_cross_entropy_with_integer_labels(
      logits_BxTxV, batch["y"]
    ).mean()
  # labels typed on an Explicit mesh: JAX 0.12 cannot type the scatter that
  # transposes the label gather, so pick the label's log-probability with a
  # one-hot product (the same loss up to rounding, no gather; one more
  # (B, T, V) buffer)
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV)
  onehot_BxTxV = jax.nn.one_hot(
    batch["y"], logits_BxTxV.shape[-1], dtype=logp_BxTxV.dtype
  )
  return -jnp.sum(logp_BxTxV * onehot_BxTxV, axis=-1).mean()


def generate(
  params, prompt_T, steps: int, key, config: GPTConfig, temperature: float = 0.8
):
  """Samples ``steps`` tokens after ``prompt_T`` (full params, one sequence)."""
  t0 = prompt_T.shape[0]
  total = min(config.seq_len, t0 + steps)
  buf_T = jnp.zeros((config.seq_len,), jnp.int32).at[:t0].set(prompt_T)

  def step(i, carry):
    buf_T, key = carry
    logits_TxV = forward(params, buf_T[None], config)[0]
    key, sub = jax.random.split(key)
    nxt = jax.random.categorical(sub, logits_TxV[i - 1] / temperature)
    return buf_T.at[i].set(nxt.astype(jnp.int32)), key

  buf_T, _ = jax.lax.fori_loop(t0, total, step, (buf_T, key))
  return buf_T[:total]


def config_for_params(
  n_params: float, *, seq_len: int = 2048, align: int = 1024
) -> GPTConfig:
  """A GPT-shaped config with exactly ``n_params`` parameters (to ±2·width).

  Width grows as the cube root of the count (depth ~ width / 128, the GPT-3
  family's aspect ratio), rounded to a multiple of ``align`` so that every
  dimension divides large device counts; depth is then the most blocks that
  fit, and the vocabulary takes up the remainder.
  """
  n_params = int(n_params)
  if n_params < 10_000:
    raise ValueError(
      f"config_for_params: {n_params} params is too small for "
      f"a GPT shape; use at least 10,000."
    )
  width = (n_params * 128 / 12) ** (1 / 3)
  width = (
    max(align, int(round(width / align)) * align)
    if width >= align
    else max(64, int(round(width / 64)) * 64)
  )
  while width > 64:
    heads = width // 128 if width % 128 == 0 else width // 64
    per_block = _block_params(width)
    fixed = seq_len * width + 2 * width  # positions, final norm
    depth = max(1, (n_params - fixed - 2 * width * 1024) // per_block)
    vocab = (n_params - fixed - depth * per_block) // (2 * width)
    if vocab >= 256:
      return GPTConfig(
        vocab=int(vocab),
        seq_len=seq_len,
        width=width,
        depth=int(depth),
        heads=heads,
      )
    width //= 2
  raise ValueError(f"config_for_params: no GPT shape for {n_params} params.")


def _block_params(width: int, mlp_ratio: int = 4) -> int:
  d, f = width, mlp_ratio * width
  return 4 * d + 3 * d * d + 3 * d + d * d + d + d * f + f + f * d + d
