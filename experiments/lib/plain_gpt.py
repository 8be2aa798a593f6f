"""A GPT as a user writes it in plain JAX: no zerojax inside the model.

Pre-LayerNorm blocks stacked on a leading layer axis and run in a
``lax.scan`` under ``jax.checkpoint``; the loss is the mean next-token
cross-entropy. It never calls :func:`zerojax.gather`, so zerojax sees a loss
that uses its params directly: the case of a researcher who wraps only the
optimizer. ``bench_stages.py --model plain`` trains it beside the peers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def init(key, *, vocab: int, width: int, depth: int, seq_len: int) -> dict:
  k_emb, k_pos, k_blocks, k_head = jax.random.split(key, 4)
  d, f = width, 4 * width
  normal = lambda k, shape, fan_in: (
    jax.random.normal(k, shape) / math.sqrt(fan_in)
  )
  kb = jax.random.split(k_blocks, 4)
  return {
    "embed": normal(k_emb, (vocab, d), 1.0) * 0.02,
    "pos": normal(k_pos, (seq_len, d), 1.0) * 0.02,
    "blocks": {
      "ln1": jnp.ones((depth, d)),
      "ln2": jnp.ones((depth, d)),
      "qkv": normal(kb[0], (depth, d, 3 * d), d),
      "proj": normal(kb[1], (depth, d, d), d),
      "up": normal(kb[2], (depth, d, f), d),
      "down": normal(kb[3], (depth, f, d), f),
    },
    "ln_f": jnp.ones((d,)),
    "head": normal(k_head, (d, vocab), d),
  }


def _norm(x, scale):
  x = x - x.mean(-1, keepdims=True)
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale


def _block(x, p, heads: int):
  b, t, d = x.shape
  q, k, v = jnp.split(_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
  split = lambda y: y.reshape(b, t, heads, d // heads)
  logits = jnp.einsum("bqhk,bshk->bhqs", split(q), split(k)) / math.sqrt(
    d // heads
  )
  causal = jnp.tril(jnp.ones((t, t), bool))
  att = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
  x = (
    x
    + jnp.einsum("bhqs,bshk->bqhk", att, split(v)).reshape(b, t, d) @ p["proj"]
  )
  return x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def loss(params, batch, *, heads: int):
  """Mean cross-entropy of ``batch["y"]`` given ``batch["x"]`` (B x T ids)."""
  tokens = batch["x"]
  x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
  step = jax.checkpoint(lambda x, p: (_block(x, p, heads), None))
  x, _ = jax.lax.scan(step, x, params["blocks"])
  logp = jax.nn.log_softmax(_norm(x, params["ln_f"]) @ params["head"])
  target = jax.nn.one_hot(batch["y"], logp.shape[-1], dtype=logp.dtype)
  return -jnp.mean(jnp.sum(logp * target, -1))


# --------------------------------------------------------------------------
# the experiments' shared set-up: size flags, model functions, batches
# --------------------------------------------------------------------------
SIZE_FLAGS = {
  "width": 256,
  "vocab": 256,
  "depth": 8,
  "heads": 4,
  "seq_len": 128,
  "batch": 16,
}  # bench_stages.py's defaults


def add_size_flags(parser):
  """``--width --vocab --depth --heads --seq-len --batch`` on ``parser``."""
  for name, default in SIZE_FLAGS.items():
    parser.add_argument(
      "--" + name.replace("_", "-"), type=int, default=default
    )


def size_argv(args) -> list:
  """The size flags of ``args`` as command-line arguments (for a worker)."""
  return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SIZE_FLAGS]


def from_flags(args, steps: int):
  """``(init_fn, loss_fn, batches)``: the model of ``args``'s sizes and
  ``steps`` batches of the embedded corpus (``zerojax.app.data``)."""
  import functools

  from zerojax.app import data

  init_fn = functools.partial(
    init,
    vocab=args.vocab,
    width=args.width,
    depth=args.depth,
    seq_len=args.seq_len,
  )
  tokens, _ = data.split(data.corpus_bytes())
  batches = [
    data.batch_at(
      tokens, seed=0, step=i, batch=args.batch, seq_len=args.seq_len
    )
    for i in range(steps)
  ]
  return init_fn, functools.partial(loss, heads=args.heads), batches
