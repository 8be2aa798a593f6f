"""Two models that are not the reference GPT, written as their users write
them: an MLP-Mixer block stack (token mixing across the sequence T, then
channel mixing across the width D) in Flax NNX (blocks built with
``nnx.vmap``, run in ``zerojax.nnx.scan_layers``) and in Flax Linen
(``zerojax.linen.scan_layers``); and a plain-JAX block function in a
``lax.scan`` (a ``jax.jit`` function inside, a tensor tagged with
``checkpoint_name``).
``remat`` is what each block keeps (``zerojax.remat(...)``, ``True`` or
``False``). Used by
``tests/test_remat.py`` and ``experiments/remat_models.py``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import zerojax
import zerojax.linen
import zerojax.nnx

B, T, D, IN, C = 16, 8, 32, 6, 3  # global batch, tokens, width, in, out


def batch(seed=0, rows=B):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(B, T, IN)).astype(np.float32)[:rows],
    "y": rng.normal(size=(B, C)).astype(np.float32)[:rows],
  }


# ----------------------------------------------------------------- NNX
class NNXMixerBlock(nnx.Module):
  """Token mixing across T, then channel mixing across D (MLP-Mixer)."""

  def __init__(self, rngs):
    self.norm1 = nnx.LayerNorm(D, rngs=rngs)
    self.tok1 = nnx.Linear(T, 2 * T, rngs=rngs)
    self.tok2 = nnx.Linear(2 * T, T, rngs=rngs)
    self.norm2 = nnx.LayerNorm(D, rngs=rngs)
    self.ch1 = nnx.Linear(D, 2 * D, rngs=rngs)
    self.ch2 = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x_BxTxD):
    y_BxDxT = self.norm1(x_BxTxD).swapaxes(1, 2)
    x_BxTxD = x_BxTxD + self.tok2(jnp.tanh(self.tok1(y_BxDxT))).swapaxes(1, 2)
    return x_BxTxD + self.ch2(jnp.tanh(self.ch1(self.norm2(x_BxTxD))))


class NNXMixer(nnx.Module):
  def __init__(self, depth, remat, rngs):
    self.inp = nnx.Linear(IN, D, rngs=rngs)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NNXMixerBlock(rngs)

    self.blocks = make(rngs)
    self.out = nnx.Linear(D, C, rngs=rngs)
    self.remat = remat

  def __call__(self, x_BxTxIN):
    x_BxTxD = zerojax.nnx.gathered(self.inp)(x_BxTxIN)
    x_BxTxD = zerojax.nnx.scan_layers(self.blocks, x_BxTxD, remat=self.remat)
    return zerojax.nnx.gathered(self.out)(x_BxTxD.mean(1))


def nnx_model(depth, remat):
  graphdef, params = nnx.split(NNXMixer(depth, remat, nnx.Rngs(0)), nnx.Param)

  def loss(p, b):
    return jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2)

  return params, loss


# --------------------------------------------------------------- Linen
class LinenMixerBlock(nn.Module):
  @nn.compact
  def __call__(self, x_BxTxD, _):
    y_BxDxT = nn.LayerNorm()(x_BxTxD).swapaxes(1, 2)
    y_BxDxT = nn.Dense(T)(jnp.tanh(nn.Dense(2 * T)(y_BxDxT)))
    x_BxTxD = x_BxTxD + y_BxDxT.swapaxes(1, 2)
    y_BxTxD = nn.Dense(D)(jnp.tanh(nn.Dense(2 * D)(nn.LayerNorm()(x_BxTxD))))
    return x_BxTxD + y_BxTxD, None


class LinenMixer(nn.Module):
  depth: int
  remat: object

  @nn.compact
  def __call__(self, x_BxTxIN):
    x_BxTxD = zerojax.linen.gathered(nn.Dense)(D)(x_BxTxIN)
    x_BxTxD, _ = zerojax.linen.scan_layers(
      LinenMixerBlock, self.depth, remat=self.remat
    )()(x_BxTxD, None)
    return zerojax.linen.gathered(nn.Dense)(C)(x_BxTxD.mean(1))


def linen_model(depth, remat):
  model = LinenMixer(depth, remat)
  params = model.init(jax.random.key(0), batch()["x"][:2])["params"]

  def loss(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  return params, loss


MODELS = {"nnx": nnx_model, "linen": linen_model}


# ----------------------------------------------------------- plain JAX
def jax_model(depth, remat):
  """Channel mixing only, as a function of ``(x, layer params)`` scanned
  over stacked params; its hidden activation is tagged ``"mix"``."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[-2])).astype(
    np.float32
  )
  params = {
    "inp": normal(IN, D),
    "out": normal(D, C),
    "blocks": {"a": normal(depth, D, 2 * D), "b": normal(depth, 2 * D, D)},
  }

  @jax.jit
  def up(x_BxTxD, a_DxF):  # a jitted helper inside the block
    return jnp.einsum("btd,df->btf", x_BxTxD, a_DxF)

  def block(x_BxTxD, w):
    w = zerojax.gather(w)
    h_BxTxF = checkpoint_name(jnp.tanh(up(x_BxTxD, w["a"])), "mix")
    return x_BxTxD + h_BxTxF @ w["b"], None

  if remat is True:
    block = zerojax.remat(block)
  elif remat:
    block = remat(block)

  def loss(p, b):
    x_BxTxD = b["x"] @ zerojax.gather(p["inp"])
    x_BxTxD, _ = jax.lax.scan(block, x_BxTxD, p["blocks"])
    return jnp.mean((x_BxTxD.mean(1) @ zerojax.gather(p["out"]) - b["y"]) ** 2)

  return params, loss


ALL = {**MODELS, "jax": jax_model}
