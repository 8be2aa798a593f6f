"""A step averages the loss computed on each device's rows: the whole
batch's loss only for a mean over examples. A loss that combines examples
is refused before anything runs, naming what combines them; a mean over
examples, however written, trains; ``per_device_loss=True`` averages
per-device losses on purpose."""

import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.errors import (
  AuxNotACountWarning,
  AuxNotAMeanWarning,
  AuxNotPerExampleWarning,
  AuxUnverifiedWarning,
  LossNotAMeanError,
  LossUnverifiedWarning,
)


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {
    "emb": jax.random.normal(k[0], (11, 6)) * 0.5,
    "w": jax.random.normal(k[1], (6, 6)) * 0.5,
    "v": jax.random.normal(k[2], (6, 5)) * 0.5,
  }


def _batch(rows=16, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 8, rows)  # devices hold unequal token counts
  return {
    "tok": rng.integers(0, 11, (rows, 7)).astype(np.int32),
    "y": rng.integers(0, 5, (rows, 7)).astype(np.int32),
    "mask": (np.arange(7)[None] < lengths[:, None]).astype(np.float32),
  }


def _logits(p, b):
  p = zerojax.gather(p)
  h = jnp.tanh(p["emb"][b["tok"]] @ p["w"])
  return h @ p["v"]  # (rows, tokens, classes)


def _ce(p, b):
  return optax.softmax_cross_entropy_with_integer_labels(_logits(p, b), b["y"])


# --- losses that combine examples: per device they are other numbers ----
def token_mean(p, b):  # normalized by the batch's token count
  return jnp.sum(_ce(p, b) * b["mask"]) / jnp.sum(b["mask"])


def token_mean_by_rows(p, b):  # the token count per row, of each piece
  count = jnp.sum(b["mask"]) / b["mask"].shape[0]
  return jnp.mean(jnp.sum(_ce(p, b) * b["mask"], axis=1)) / count


def token_mean_by_mean_mask(p, b):  # the count as a mean over the rows
  count = jnp.sum(b["mask"] / b["mask"].shape[0])
  return jnp.mean(jnp.sum(_ce(p, b) * b["mask"], axis=1)) / count


def _z_loss(p, b):  # each position's squared log-partition
  return jax.nn.logsumexp(_logits(p, b), -1) ** 2


def token_mean_plus_mean(p, b):  # a mean over every position added
  return token_mean(p, b) + 1e-2 * jnp.mean(_z_loss(p, b))


def mean_over_own_loss(p, b):  # a divisor that reads the params
  ce = _ce(p, b)
  return jnp.sum(ce * b["mask"]) / jnp.sum(ce)


def contrastive(p, b):  # every example against every other
  z = _logits(p, b).mean(1)
  sim = z @ z.T
  labels = jnp.arange(sim.shape[0])
  return optax.softmax_cross_entropy_with_integer_labels(sim, labels).mean()


def batch_norm(p, b):  # statistics over the batch inside the loss
  z = _logits(p, b).mean(1)
  z = (z - z.mean(0)[None]) / (z.std(0)[None] + 1e-3)
  return jnp.mean(z**2 * jnp.arange(5.0)[None])


def sum_loss(p, b):  # a sum over examples
  return jnp.sum(_ce(p, b))


def fixed_divisor(p, b):  # the whole batch's size written in
  return jnp.sum(_ce(p, b)) / (16 * 7)


def rmse(p, b):  # a nonlinear function of a mean
  return jnp.sqrt(jnp.mean(_ce(p, b) ** 2))


def hardest_half(p, b):  # examples ranked over the batch
  per_example = _ce(p, b).mean(1)
  return jnp.mean(jax.lax.top_k(per_example, per_example.shape[0] // 2)[0])


def batch_baseline(p, b):  # REINFORCE with the batch's mean as baseline
  r = jax.lax.stop_gradient(_ce(p, b).mean(1))
  logp = jax.nn.log_softmax(_logits(p, b))[:, 0, 0]
  return -jnp.mean((r - jnp.mean(r)) * logp)


def _chunked_sum(p, b, chunk=2):
  """Cross-entropy summed chunk by chunk of the sequence in a scan (the
  logits of one chunk live at a time)."""
  q = zerojax.gather(p)
  h = jnp.tanh(q["emb"][b["tok"][:, :6]] @ q["w"])  # (rows, 6, width)
  rows = h.shape[0]
  hs = jnp.moveaxis(h.reshape(rows, 6 // chunk, chunk, -1), 1, 0)
  ys = jnp.moveaxis(b["y"][:, :6].reshape(rows, 6 // chunk, chunk), 1, 0)

  def body(total, xs):
    hc, yc = xs
    ce = optax.softmax_cross_entropy_with_integer_labels(hc @ q["v"], yc)
    return total + jnp.sum(ce), None

  total, _ = jax.lax.scan(body, 0.0, (hs, ys))
  return total


def chunked_sum(p, b):  # the chunks' sum, never divided by the rows
  return _chunked_sum(p, b) / 6


def regularizer_by_rows(p, b):  # a penalty on params over the batch size
  l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(zerojax.gather(p)))
  return jnp.mean(_ce(p, b)) + l2 / b["tok"].shape[0]


def _scanned_penalty(p, divisor):
  """A penalty on the params accumulated in a scan over their leaves."""
  q = zerojax.gather(p)
  sq = jnp.stack([jnp.sum(q["w"] ** 2), jnp.sum(q["v"] ** 2)])
  total, _ = jax.lax.scan(lambda acc, x: (acc + x / divisor, None), 0.0, sq)
  return total


def scanned_penalty_by_rows(p, b):  # the same, inside a loop
  return jnp.mean(_ce(p, b)) + _scanned_penalty(p, b["tok"].shape[0])


def log_batch_size_added(p, b):  # a constant of the batch size added
  return jnp.mean(_ce(p, b)) + jnp.log(b["tok"].shape[0])


def weighted_by_rows(p, b):  # a mean and a sum, stacked, weighted alike
  terms = jnp.stack([jnp.mean(_ce(p, b)), jnp.mean(_ce(p, b) ** 2)])
  return jnp.sum(terms * jnp.array([1.0, b["tok"].shape[0]]))


def label_match(p, b):  # every example's label against every other's
  z = _logits(p, b).mean(1)[:, 0]
  same = b["y"][:, 0][:, None] == b["y"][:, 0][None, :]
  return jnp.mean(jnp.where(same, z[:, None], 0.0))


def first_example(p, b):  # one example, unstacked from the batch
  return jnp.unstack(_ce(p, b).mean(1))[0]


def neighbours_pooled(p, b):  # each example averaged with the next one
  per = _ce(p, b).mean(1)
  return jnp.mean(
    jax.lax.reduce_window(per, 0.0, jax.lax.add, (2,), (1,), "VALID")
  )


def batch_spectrum(p, b):  # an FFT over the examples
  return jnp.mean(jnp.abs(jnp.fft.fft(_ce(p, b).mean(1))))


def bins_by_rows(p, b):  # bins as many as the rows: each piece its own
  ce = _ce(p, b)
  bins = jnp.linspace(0.0, 3.0, ce.shape[0])
  return jnp.mean(ce * jnp.searchsorted(bins, ce))


def token_by_rows(p, b):  # a token picked by the row count
  ce = _ce(p, b)
  return jnp.mean(ce[:, ce.shape[0] // 2])


def token_window_by_rows(p, b):  # a window placed by the row count
  ce = _ce(p, b)
  return jnp.mean(jax.lax.dynamic_slice_in_dim(ce, ce.shape[0] // 2, 2, 1))


def sum_plus_penalty(p, b):  # a sum, plus a penalty each device adds
  return jnp.sum(_ce(p, b)) + 1e-2 * jnp.sum(zerojax.gather(p)["v"] ** 2)


def sum_plus_mean(p, b):  # a sum over examples plus a mean over them
  return jnp.sum(_ce(p, b)) + jnp.mean(_ce(p, b))


# a piece holds 2 rows (16 over 8 devices); the check reads a loss at 2
# and 4 rows first, where these two agree with a sum or a mean
def sum_over_at_least_8(p, b):  # a sum at 2 and 4 rows; not at 16
  return jnp.sum(_ce(p, b)) / max(b["tok"].shape[0], 8)


def mean_over_at_most_4(p, b):  # a mean at 2 and 4 rows; not at 16
  return jnp.sum(_ce(p, b)) / min(b["tok"].shape[0], 4)


NOT_MEANS = {
  token_mean_by_rows: "a value computed from the batch's row count",
  token_mean_by_mean_mask: "a sum over the batch scaled by a number that",
  mean_over_own_loss: "a division by a sum over the batch",
  token_mean_plus_mean: "a mean added to a sum or to a ratio over the",
  contrastive: "a product of every example with every other",
  batch_norm: "combines each example with a sum over the batch",
  sum_plus_penalty: "a sum over the examples plus a term that is not one",
  sum_plus_mean: "sums over the examples weighed apart",
  rmse: "sqrt of a sum over the batch",
  hardest_half: "top_k along the batch's rows",
  batch_baseline: "combines each example with a sum over the batch",
  regularizer_by_rows: "a value computed from the batch's row count",
  scanned_penalty_by_rows: "a value computed from the batch's row count",
  log_batch_size_added: "a value computed from the batch's row count",
  weighted_by_rows: "a value computed from the batch's row count",
  bins_by_rows: "a value computed from the batch's row count",
  token_by_rows: "a value computed from the batch's row count",
  token_window_by_rows: "a value computed from the batch's row count",
  first_example: "an unstack of the batch's rows",
  label_match: "eq of every example with every other",
  neighbours_pooled: "reduce_window_sum with a window over the batch's rows",
  batch_spectrum: "an FFT over the batch's rows",
  sum_over_at_least_8: "0.125 x the sums at 2 rows, 0.0625 x at 16",
  mean_over_at_most_4: "0.5 x the sums at 2 rows, 0.25 x at 16",
}


@pytest.mark.parametrize("loss", list(NOT_MEANS), ids=lambda f: f.__name__)
def test_a_loss_that_combines_examples_is_refused_before_anything_runs(
  mesh, loss
):
  params, batch = _params(), _batch()
  # first: per device these losses are in fact other numbers
  whole = float(loss(params, batch))
  pieces = [
    float(loss(params, jax.tree.map(lambda x: x[i : i + 2], batch)))
    for i in range(0, 16, 2)
  ]
  assert not np.isclose(np.mean(pieces), whole, rtol=1e-4)
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(params, tx)
  step = zerojax.train_step(loss, tx)
  with pytest.raises(LossNotAMeanError, match=re.escape(NOT_MEANS[loss])) as e:
    step(state, batch)
  # the message names the user's line and the ways out
  assert "test_loss_check.py:" in str(e.value)
  assert "per_device_loss=True" in str(e.value)
  assert "jnp.sum(mask)" in str(e.value)
  if loss is token_mean_plus_mean:  # the fix token_mean_plus_z_loss takes
    assert "(jnp.sum(z) / batch['n'])" in str(e.value)
  assert int(state.step) == 0
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  with pytest.raises(LossNotAMeanError):
    zerojax.eval_step(loss, tx)(state, batch)
  with pytest.raises(LossNotAMeanError):
    zerojax.value_and_grad(loss, tx)(state, batch)


# --- means over examples, as people write them -------------------------
def token_mean_exact(p, b):
  """The whole batch's mean over tokens, written as a mean over examples:
  the whole batch's tokens per row comes in as a scalar batch leaf."""
  per_row = jnp.sum(_ce(p, b) * b["mask"], axis=1)
  return jnp.mean(per_row) / b["tokens_per_row"]


def flat_tokens(p, b):  # rows flattened with their tokens
  logits = _logits(p, b).reshape(-1, 5)
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, b["y"].reshape(-1)
  ).mean()


def indexed(p, b):  # logits[arange, labels] per token
  lp = jax.nn.log_softmax(_logits(p, b)[:, 0])
  return -lp[jnp.arange(lp.shape[0]), b["y"][:, 0]].mean()


def mean_plus_terms(p, b):  # a mean, a second mean, a penalty on params
  aux = jnp.mean(_logits(p, b) ** 2)
  l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(p))
  return jnp.mean(_ce(p, b)) + 0.1 * aux + 1e-3 * l2


def sum_over_rows_divided(p, b):  # the division written per example
  return jnp.sum(_ce(p, b).mean(1) / b["tok"].shape[0])


def recurrent(p, b, zeros=jnp.zeros_like):
  """A scan over the tokens from a zero state per example."""
  p = zerojax.gather(p)
  xs = jnp.swapaxes(p["emb"][b["tok"]], 0, 1)  # (tokens, rows, width)
  h0 = zeros(xs[0])
  _, hs = jax.lax.scan(lambda h, x: (jnp.tanh(h @ p["w"] + x),) * 2, h0, xs)
  return jnp.mean((hs @ p["v"]) ** 2)


def per_example_vmap(p, b):  # the loss of one example, vmapped
  one = lambda t, y: optax.softmax_cross_entropy_with_integer_labels(
    _logits(p, {"tok": t[None]})[0], y
  ).mean()
  return jax.vmap(one)(b["tok"], b["y"]).mean()


def ones_like_divisor(p, b):  # the count as a sum of ones
  ce = _ce(p, b)
  ones = jnp.ones(ce.shape + (10,))  # more elements than are folded
  return jnp.sum(ce) / (jnp.sum(ones) / 10)


def chunked_mean(p, b):  # the chunks' sum over the batch's tokens
  return _chunked_sum(p, b) / (b["tok"].shape[0] * 6)


def rotary(p, b):  # a rotation per position, written with jnp.stack
  h = jnp.tanh(_logits(p, b)[..., :4])  # (rows, tokens, 4)
  x1, x2 = h[..., ::2], h[..., 1::2]
  t = jnp.arange(h.shape[1])[None, :, None] * 0.3
  cos, sin = jnp.cos(t), jnp.sin(t)
  h = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
  return jnp.mean(jnp.sum(h.reshape(h.shape[0], -1) ** 2, 1))


def unstacked_halves(p, b):  # jnp.unstack along a feature axis
  lo, hi = jnp.unstack(_logits(p, b)[..., :4].reshape(-1, 7, 2, 2), axis=2)
  return jnp.mean(jnp.sum(lo * hi, (1, 2)))


def scanned_penalty(p, b):  # a penalty summed in a scan, fixed divisor
  return jnp.mean(_ce(p, b)) + _scanned_penalty(p, 1000.0)


def stacked_terms(p, b):  # means side by side, weighted
  terms = jnp.stack([jnp.mean(_ce(p, b)), jnp.mean(_logits(p, b) ** 2)])
  return jnp.sum(terms * jnp.array([1.0, 0.1]))


def convolved(p, b):  # a convolution and pooling along the tokens
  q = zerojax.gather(p)
  kernel = jnp.stack([q["w"], q["w"].T, q["w"]])  # (width, in, out)
  h = jax.lax.conv_general_dilated(
    q["emb"][b["tok"]],
    kernel,
    (1,),
    "SAME",
    dimension_numbers=("NWC", "WIO", "NWC"),
  )
  window = ((1, 2, 1), (1, 1, 1), "VALID")
  h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, *window) + 0.5 * (
    jax.lax.reduce_window(h, 0.0, jax.lax.add, *window)
  )
  logits = jnp.tanh(h) @ q["v"]  # (rows, tokens - 1, classes)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"][:, 1:])
  return jnp.mean(ce * b["mask"][:, 1:])


def spectral(p, b):  # an FFT along the tokens
  logits = jnp.fft.irfft(jnp.fft.rfft(_logits(p, b), axis=1) * 0.5, n=7, axis=1)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
  return jnp.mean(ce * b["mask"])


def scattered(p, b):  # segment sums and scatters within each example
  ce = _ce(p, b)  # (rows, tokens)
  fixed = jax.vmap(lambda c: jax.ops.segment_sum(c, jnp.arange(7) // 2, 4))
  by_token = jax.vmap(lambda c, t: jax.ops.segment_sum(c, t % 3, 3))
  bumped = ce.at[:, jnp.array([1, 3])].add(ce[:, :2] * b["mask"][:, :2])
  return (
    jnp.mean(fixed(ce)) + jnp.mean(by_token(ce, b["tok"])) + jnp.mean(bumped)
  )


def interpolated(p, b):  # jnp.interp and jnp.digitize over fixed bins
  bins = jnp.linspace(0.0, 3.0, 7)
  ce = _ce(p, b)
  weight = jnp.interp(ce, bins, jnp.sqrt(bins)) + jnp.digitize(ce, bins)
  return jnp.mean(ce * weight * b["mask"])


MEANS = [token_mean_exact, flat_tokens, indexed, mean_plus_terms, chunked_mean]
MEANS += [rotary, unstacked_halves, stacked_terms, scanned_penalty]
MEANS += [ones_like_divisor]
MEANS += [sum_over_rows_divided, recurrent, per_example_vmap, convolved]
MEANS += [spectral, scattered, interpolated]


def _with_count(batch):
  return dict(
    batch,
    tokens_per_row=float(batch["mask"].sum() / len(batch["mask"])),
    tokens=float(batch["mask"].sum()),
    positions=float(batch["mask"].size),
  )


def _plain_losses(loss, params, batches, opt):
  @jax.jit
  def step(p, s, b):
    value, g = jax.value_and_grad(loss)(p, b)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, value

  s, out = opt.init(params), []
  for b in batches:
    params, s, value = step(params, s, b)
    out.append(float(value))
  return params, out


def _assert_trains_like_plain(
  mesh, loss, opt, stage, accum=1, rows=16, batches=None
):
  """Two steps of ``loss`` equal the plain step's, with no warning that
  the loss could not be read."""
  if batches is None:
    batches = [_with_count(_batch(rows=rows, seed=i)) for i in range(2)]
  want, want_losses = _plain_losses(loss, _params(), batches, opt)
  tx = zerojax.zero(opt, stage=stage, mesh=mesh)
  state = zerojax.init(_params(), tx)
  step = zerojax.train_step(loss, tx, accum_steps=accum)
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossUnverifiedWarning)
    losses = []
    for b in batches:
      state, m = step(state, b)
      losses.append(float(m["loss"]))
  np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
  for a, b in zip(
    jax.tree.leaves(zerojax.gather_params(state)), jax.tree.leaves(want)
  ):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("loss", MEANS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("stage,accum", [(0, 1), (3, 2)])
def test_a_mean_over_examples_trains_like_the_plain_step(
  mesh, loss, stage, accum
):
  _assert_trains_like_plain(mesh, loss, optax.adamw(1e-2), stage, accum)


def token_sum_over_count(p, b):
  """The whole batch's mean over tokens as LM trainers write it: a sum
  over the tokens divided by the whole batch's token count (a scalar
  batch leaf)."""
  return jnp.sum(_ce(p, b) * b["mask"]) / b["tokens"]


SUMS = [sum_loss, fixed_divisor, chunked_sum, token_sum_over_count]


def _assert_evaluates_and_differentiates_like_plain(
  mesh, loss, params, batch, stage, accum
):
  """The eval step's loss and value_and_grad's loss and SGD step equal
  the plain ones."""
  tx = zerojax.zero(optax.sgd(1e-3), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  evaluated = zerojax.eval_step(loss, tx)(state, batch)
  np.testing.assert_allclose(evaluated, loss(params, batch), rtol=1e-5)
  value, grads = zerojax.value_and_grad(loss, tx, accum_steps=accum)(
    state, batch
  )
  np.testing.assert_allclose(value, loss(params, batch), rtol=1e-5)
  want = jax.grad(loss)(params, batch)
  got = zerojax.gather_params(zerojax.apply_gradients(state, grads))
  for a, p, g in zip(
    jax.tree.leaves(got), jax.tree.leaves(params), jax.tree.leaves(want)
  ):
    np.testing.assert_allclose(a, p - 1e-3 * g, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("loss", SUMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("stage,accum", [(0, 2), (1, 1), (3, 2)])
def test_a_sum_over_examples_trains_like_the_plain_step(
  mesh, loss, stage, accum
):
  """A sum over examples (at a factor that does not change with the rows,
  nothing else added) is added up over devices and micro-batches, not
  averaged: the same loss and gradient as the unsharded step, where an
  average would be 1 / (devices x micro-batches) of them."""
  params, batch = _params(), _with_count(_batch())
  rows = lambda i: jax.tree.map(
    lambda x: x[i : i + 2] if np.ndim(x) else x, batch
  )
  pieces = [float(loss(params, rows(i))) for i in range(0, 16, 2)]
  np.testing.assert_allclose(np.sum(pieces), loss(params, batch), rtol=1e-5)
  _assert_trains_like_plain(mesh, loss, optax.sgd(1e-3), stage, accum)
  _assert_evaluates_and_differentiates_like_plain(
    mesh, loss, params, batch, stage, accum
  )


# --- sums over examples divided by counts the loss takes of its batch ---
def token_mean_where(p, b):  # jnp.mean's where=
  return jnp.mean(_ce(p, b), where=b["mask"] > 0)


def token_mean_at_least_one(p, b):  # a divisor kept from zero
  count = jnp.maximum(jnp.sum(b["mask"]), 1.0)
  return jnp.sum(_ce(p, b) * b["mask"]) / count


def token_mean_plus_eps(p, b):  # a divisor kept from zero, another way
  return jnp.sum(_ce(p, b) * b["mask"]) / (jnp.sum(b["mask"]) + 1e-8)


def token_mean_guarded(p, b):  # no division where there is no token
  count = jnp.sum(b["mask"])
  total = jnp.sum(_ce(p, b) * b["mask"])
  return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


def first_token_weighed(p, b):  # two counts: every token, the first ones
  ce, mask = _ce(p, b), b["mask"]
  first = jnp.sum(ce[:, 0] * mask[:, 0]) / jnp.sum(mask[:, 0])
  return jnp.sum(ce * mask) / jnp.sum(mask) + 0.5 * first


@jax.jit
def _masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.sum(mask)


def jitted_masked_mean(p, b):  # the count taken inside a jitted helper
  return _masked_mean(_ce(p, b), b["mask"])


def token_mean_plus_z_loss(p, b):  # token_mean_plus_mean, as its fix says
  return token_mean(p, b) + 1e-2 * jnp.sum(_z_loss(p, b)) / b["positions"]


RATIOS = [token_mean, token_mean_where, token_mean_at_least_one]
RATIOS += [token_mean_plus_eps, token_mean_guarded, first_token_weighed]
RATIOS += [jitted_masked_mean, token_mean_plus_z_loss]


# every form at stage 3 with micro-batches; the first at stages 0 and 1 too
RATIO_CASES = [(f, 3, 2) for f in RATIOS] + [(RATIOS[0], 0, 2)]
RATIO_CASES += [(RATIOS[0], 1, 1)]


@pytest.mark.parametrize(
  "loss,stage,accum",
  RATIO_CASES,
  ids=lambda x: x.__name__ if callable(x) else str(x),
)
def test_a_sum_divided_by_counts_over_the_batch_trains_like_the_plain_step(
  mesh, loss, stage, accum
):
  """A sum over tokens divided by the batch's token count: each device's
  (and micro-batch's) own count would be another divisor; the step
  computes the whole batch's count first and gives it to every piece,
  whose losses then add up to the unsharded loss."""
  params, batch = _params(), _with_count(_batch())
  rows = lambda i: jax.tree.map(
    lambda x: x[i : i + 2] if np.ndim(x) else x, batch
  )
  pieces = [float(loss(params, rows(i))) for i in range(0, 16, 2)]
  assert not np.isclose(np.mean(pieces), loss(params, batch), rtol=1e-4)
  _assert_trains_like_plain(mesh, loss, optax.adamw(1e-2), stage, accum)
  _assert_evaluates_and_differentiates_like_plain(
    mesh, loss, params, batch, stage, accum
  )


def test_a_piece_of_the_batch_without_tokens_trains_like_the_plain_step(
  any_mesh,
):
  """Devices and micro-batches whose rows have no token: their own count
  is 0 and their own loss 0 / 0, where the whole batch's is finite. Their
  aux counts are this piece's, summed by the step."""

  def loss(p, b):
    count = jnp.sum(b["mask"])
    return jnp.sum(_ce(p, b) * b["mask"]) / count, {
      "tokens": count.astype(jnp.int32)
    }

  batches = [_batch(seed=i) for i in range(2)]
  for b in batches:
    b["mask"][:6] = 0.0  # devices 0-2: no tokens
  _assert_trains_like_plain(
    any_mesh,
    lambda p, b: loss(p, b)[0],
    optax.adamw(1e-2),
    3,
    2,
    batches=batches,
  )
  tx = zerojax.zero(optax.adamw(1e-2), stage=3, mesh=any_mesh)
  state = zerojax.init(_params(), tx)
  state, m = zerojax.train_step(loss, tx, accum_steps=2)(state, batches[0])
  assert int(m["aux"]["tokens"]) == int(batches[0]["mask"].sum())
  assert np.isfinite(float(m["loss"]))
  for x in jax.tree.leaves(zerojax.gather_params(state)):
    assert np.all(np.isfinite(x))


def _masked_metrics(p, b):
  logits, mask = _logits(p, b), b["mask"]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
  count = jnp.sum(mask)
  right = (jnp.argmax(logits, -1) == b["y"]) * mask
  token_mean = jnp.sum(ce * mask) / count
  return token_mean, {
    "loss": token_mean,
    "accuracy": jnp.sum(right) / count,
    "tokens": count.astype(jnp.int32),
    "mean": jnp.mean(ce),
  }


@pytest.mark.parametrize("of_mean", [False, True], ids=["token_mean", "mean"])
def test_a_ratio_over_the_batch_s_count_in_the_aux_is_the_unsharded_value(
  mesh, of_mean
):
  """A masked accuracy and the token mean itself in the aux, of a loss
  that is a token mean or a plain mean: each is computed with the whole
  batch's count and added up, in training, evaluation and
  value_and_grad, with no warning."""

  def loss(p, b):
    value, aux = _masked_metrics(p, b)
    return (aux["mean"] if of_mean else value), aux

  params, batch = _params(), _batch()
  batch["mask"][:3] = 0.0
  want = loss(params, batch)[1]
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  state = zerojax.init(params, tx, copy=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step = zerojax.train_step(loss, tx, accum_steps=2, gather="all")
    trained = step(state, batch)[1]["aux"]
    state = zerojax.init(params, tx)
    (_, from_grad), _ = zerojax.value_and_grad(
      loss, tx, has_aux=True, accum_steps=2, gather="all"
    )(state, batch)
    evaluated = zerojax.eval_step(loss, tx, has_aux=True, gather="all")(
      state, batch
    )[1]
  for got in (trained, from_grad, evaluated):
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=2e-6)


def test_per_device_loss_averages_per_device_losses_on_purpose(mesh):
  params, batch = _params(), _batch()
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  state = zerojax.init(params, tx)
  loss, _ = zerojax.value_and_grad(token_mean, tx, per_device_loss=True)(
    state, batch
  )
  pieces = [
    float(token_mean(params, jax.tree.map(lambda x: x[i : i + 2], batch)))
    for i in range(0, 16, 2)
  ]
  np.testing.assert_allclose(float(loss), np.mean(pieces), rtol=1e-6)
  ev = zerojax.eval_step(token_mean, tx, per_device_loss=True)(state, batch)
  np.testing.assert_allclose(float(ev), np.mean(pieces), rtol=1e-6)
  with pytest.raises(TypeError, match="per_device_loss='yes' must be True"):
    zerojax.train_step(token_mean, tx, per_device_loss="yes")


def test_a_loss_the_reading_cannot_follow_warns_once(mesh):
  def callback_loss(p, b):  # a host callback: opaque to the reading
    h = _ce(p, b).mean(1)
    seen = jax.pure_callback(
      np.asarray,
      jax.ShapeDtypeStruct(h.shape, h.dtype),
      jax.lax.stop_gradient(h),
    )
    return jnp.mean(h) + 0.0 * jnp.mean(seen)

  tx = zerojax.zero(optax.sgd(0.1), stage=0, mesh=mesh)
  state = zerojax.init(_params(), tx)
  step = zerojax.train_step(callback_loss, tx)
  with pytest.warns(LossUnverifiedWarning, match="pure_callback") as rec:
    state, _ = step(state, _batch())
  assert any("test_loss_check.py" in w.filename for w in rec)
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossUnverifiedWarning)
    step(state, _batch(seed=1))  # the same batch shapes: checked once


def test_a_loop_carry_started_from_a_constant_trains_like_the_plain_step(mesh):
  """A carry from jnp.zeros(shape) becomes per-device in the loop, which
  JAX's per-device types refuse; the step runs it untyped, with the plain
  step's numbers (tests/test_loop_carries.py has library losses so)."""
  loss = lambda p, b: recurrent(p, b, zeros=lambda x: jnp.zeros(x.shape))
  _assert_trains_like_plain(mesh, loss, optax.sgd(0.1, momentum=0.9), 3)


def _per_example(p, b):
  return _ce(p, b).mean(1)


def _weighted(mesh, weigh):
  """A mean of the per-example losses weighed by ``weigh(rows, losses)``,
  with a stage-1 transformation and its state."""

  def weighted(p, b):
    return jnp.mean(weigh(b["tok"].shape[0], _per_example(p, b)))

  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  return weighted, tx, zerojax.init(_params(), tx)


@pytest.mark.parametrize(
  "weigh",
  [
    lambda r, x: jnp.arange(r) * x,
    lambda r, x: jnp.where(jnp.arange(r) < 5, x, 0.0),  # "the valid rows"
    lambda r, x: jax.nn.one_hot(0, r) * x,
    lambda r, x: jnp.concatenate([x, jnp.zeros(3)]),  # padded rows
    lambda r, x: jnp.take(x, jnp.array([0, 1, 2])),  # fixed examples
    lambda r, x: x[jnp.array([2, 0])],
    lambda r, x: jnp.take(x, jnp.arange(r // 2)),  # the first half
    lambda r, x: x.at[0].set(0.0),  # the first example dropped
    lambda r, x: x.at[jnp.array([1, 2])].add(1.0),
  ],
  ids=[
    "iota",
    "where_iota",
    "one_hot",
    "pad_rows",
    "take",
    "index",
    "half",
    "set_first",
    "add_fixed",
  ],
)
def test_a_loss_that_weighs_examples_by_their_position_is_refused(mesh, weigh):
  """A device counts its own rows from 0, so a loss whose terms depend on
  an example's position in the batch (an iota over the rows, rows padded
  in) is not the unsharded loss: refused by name, before anything runs."""

  weighted, tx, state = _weighted(mesh, weigh)
  with pytest.raises(LossNotAMeanError, match="position|no example"):
    zerojax.train_step(weighted, tx)(state, _batch())
  with pytest.raises(LossNotAMeanError):
    zerojax.eval_step(weighted, tx)(state, _batch())


BUILT_WEIGHTS = {
  "scatter": lambda r, x: jnp.zeros(r).at[0].set(1.0) * x,  # the first only
  "concatenate": lambda r, x: (
    jnp.concatenate([jnp.ones(r // 2), jnp.zeros(r - r // 2)]) * x
  ),
  "reshape": lambda r, x: jnp.reshape(jnp.arange(r), (r, 1))[:, 0] * x,
  "rev": lambda r, x: jnp.arange(r)[::-1] * x,
  "weighted_sum": lambda r, x: jnp.arange(r)[::-1] @ x / r,
}


@pytest.mark.parametrize(
  "weigh", BUILT_WEIGHTS.values(), ids=BUILT_WEIGHTS.keys()
)
def test_a_weight_built_to_differ_over_the_rows_is_refused_where_known(
  mesh, weigh
):
  """A constant weight over the rows built by scatters, concatenations,
  reshapes or reversals, whose value the reading knows (up to 64
  elements), weighs examples by their position: refused by name."""
  weighted, tx, state = _weighted(mesh, weigh)
  with pytest.raises(LossNotAMeanError, match="differs from row to row"):
    zerojax.train_step(weighted, tx)(state, _batch())


@pytest.mark.parametrize(
  "weigh", BUILT_WEIGHTS.values(), ids=BUILT_WEIGHTS.keys()
)
def test_a_large_weight_that_differs_over_the_rows_is_not_read_as_a_mean(
  mesh, weigh
):
  """Over more rows (70 per device) the reading keeps only which axes
  such a constant is the same along; one that differs along the rows is
  not followed (the reading may have lost track of one that is the same
  for every example): a warning, never a silent step."""
  weighted, tx, state = _weighted(mesh, weigh)
  with pytest.warns(LossUnverifiedWarning, match="varies over rows"):
    zerojax.eval_step(weighted, tx)(state, _batch(rows=8 * 70))


POSITIONS = {
  "broadcast_index": lambda t, r, tokens: t[
    jnp.broadcast_to(jnp.arange(tokens)[None], (r, tokens))
  ],
  "tile_take": lambda t, r, tokens: jnp.take(
    t, jnp.tile(jnp.arange(tokens), (r, 1)), axis=0
  ),
  "one_hot": lambda t, r, tokens: (
    jax.nn.one_hot(
      jnp.broadcast_to(jnp.arange(tokens), (r, tokens)), t.shape[0]
    )
    @ t
  ),
}


@pytest.mark.parametrize("lookup", POSITIONS.values(), ids=POSITIONS.keys())
def test_positions_looked_up_in_a_table_train_like_the_plain_step(mesh, lookup):
  """Token positions broadcast or tiled over the rows and looked up in a
  table are the same for every example: read as such (no warning), and the
  step equals the plain one."""

  def loss(p, b):
    q = zerojax.gather(p)
    rows, tokens = b["tok"].shape
    x = q["emb"][b["tok"]] + lookup(q["emb"], rows, tokens)
    logits = jnp.tanh(x @ q["w"]) @ q["v"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
    return jnp.mean(ce * b["mask"])

  _assert_trains_like_plain(mesh, loss, optax.adamw(1e-2), 2)


def test_examples_scattered_across_the_rows_are_not_read_as_a_mean(mesh):
  """Per-class sums of the examples (a scatter of the rows into places read
  from the labels) combine examples the reading does not follow: a
  warning, never a silent step."""

  def per_class(p, b):
    return jnp.mean(jnp.zeros(5).at[b["y"][:, 0]].add(_ce(p, b).mean(1)))

  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  state = zerojax.init(_params(), tx)
  with pytest.warns(LossUnverifiedWarning, match="scatter-add of the examples"):
    zerojax.eval_step(per_class, tx)(state, _batch())


def test_a_weight_per_token_position_over_flattened_rows_trains(mesh):
  """Over rows flattened with their tokens, a constant that varies along
  the flattened axis may be the same for every example (a weight per token
  position, tiled): it is not refused, it warns that the loss could not be
  read, and it trains like the plain step."""

  def tiled(p, b):
    ce = _ce(p, b)  # (rows, tokens)
    w = jnp.tile(jnp.linspace(0.5, 1.5, ce.shape[1]), ce.shape[0])
    return jnp.mean(ce.reshape(-1) * w)

  opt = optax.sgd(0.1)
  batches = [_batch(seed=i) for i in range(2)]
  want, want_losses = _plain_losses(tiled, _params(), batches, opt)
  tx = zerojax.zero(opt, stage=1, mesh=mesh)
  state = zerojax.init(_params(), tx)
  step = zerojax.train_step(tiled, tx)
  with pytest.warns(LossUnverifiedWarning, match="varies over rows"):
    state, m = step(state, batches[0])
  state, m = step(state, batches[1])
  np.testing.assert_allclose(float(m["loss"]), want_losses[1], rtol=2e-6)
  chex.assert_trees_all_close(
    zerojax.gather_params(state), want, rtol=2e-5, atol=2e-6
  )


def test_a_constant_the_same_along_the_rows_is_read_through_its_layout(mesh):
  def weighted(p, b):
    rows = b["tok"].shape[0]
    w = jnp.full((rows + 3, 2), 3.0).at[:, 1].set(0.5)[:rows]
    w = jnp.concatenate([w, w], axis=1).reshape(rows, 1, 4)[:, 0, 1]
    return jnp.mean(w * _per_example(p, b))

  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  state = zerojax.init(_params(), tx)
  with warnings.catch_warnings():
    warnings.simplefilter("error", LossUnverifiedWarning)
    got = zerojax.eval_step(weighted, tx)(state, _batch())
  np.testing.assert_allclose(got, weighted(_params(), _batch()), rtol=1e-6)


def _with_aux(p, b):
  per = _ce(p, b).mean(1)
  tokens = b["mask"].sum(1)
  return jnp.mean(per), {
    "token_weighted": jnp.sum(per * tokens) / jnp.sum(tokens),  # a ratio
    "worst": jnp.max(per),  # over the batch
    "worst_bf16": jnp.max(per).astype(jnp.bfloat16),  # a float too
    "mean": jnp.mean(per),
    # a mean at a device's 2 rows and at 4, not at the whole batch's 16
    "mean_of_at_most_4": jnp.sum(per) / min(b["tok"].shape[0], 4),
    "per_example": per,
    "tokens": jnp.sum(tokens).astype(jnp.int32),  # a count: summed
  }


def _aux_step(mesh, loss, stage, warned, accum=1):
  """One step of ``loss`` that warns ``warned`` (a category or a tuple):
  ``(leaves named by category, the step's aux, the plain loss's aux,
  (tx, state, batch), the warnings)``."""
  params, batch = _params(), _batch()
  want = loss(params, batch)[1]
  tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
  state = zerojax.init(params, tx)
  with pytest.warns(warned) as rec:
    state, m = zerojax.train_step(loss, tx, accum_steps=accum)(state, batch)

  def named(category):
    return {
      re.search(r"aux\['(\w+)'\]", str(w.message)).group(1): str(w.message)
      for w in rec
      if w.category is category
    }

  return named, m["aux"], want, (tx, state, batch), rec


def test_an_aux_leaf_the_step_would_average_wrongly_is_warned_about(mesh):
  """The step averages a floating aux leaf over devices: exact for a mean
  over examples, another number for a maximum, which is named; a ratio
  whose divisor reads the batch alone is added up with the whole batch's
  divisor; per-example leaves and counts are exact and pass. A divisor
  that follows the rows up to 4 and no further is named too: the check
  reads it at the whole batch's rows."""
  found, got, want, (tx, state, batch), rec = _aux_step(
    mesh, _with_aux, 2, AuxNotAMeanWarning
  )
  named = sorted(found(AuxNotAMeanWarning))
  assert named == ["mean_of_at_most_4", "worst", "worst_bf16"]
  assert all("test_loss_check.py" in w.filename for w in rec)
  for k in ("mean", "per_example", "tokens", "token_weighted"):
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
  for k in named:  # what the warning is about: per-device averages
    assert not np.isclose(float(got[k]), float(want[k]), rtol=1e-4)
  with warnings.catch_warnings():
    warnings.simplefilter("error", AuxNotAMeanWarning)
    zerojax.train_step(_with_aux, tx, per_device_loss=True)(state, batch)


def _with_int_aux(p, b):
  tokens = b["mask"].sum(1).astype(jnp.int32)
  right = jnp.argmax(_logits(p, b), -1) == b["y"]
  return jnp.mean(_ce(p, b)), {
    "tokens": jnp.sum(tokens),  # counts: summed
    "right": jnp.sum(right),
    "rows": jnp.asarray(b["tok"].shape[0]),  # a count from a shape
    "rows_up_to_4": jnp.asarray(min(b["tok"].shape[0], 4)),  # not at 16
    "none": jnp.zeros((), jnp.int32),
    "per_example": tokens,
    "version": jnp.int32(3),  # the same on every device
    "longest": jnp.max(tokens),  # over the batch
    "first": tokens[0],  # one example's
    "all_long": jnp.all(tokens > 0),  # a bool over the batch
  }


@pytest.mark.parametrize("accum", [1, 2])
def test_an_int_or_bool_aux_leaf_the_step_would_sum_wrongly_is_warned_about(
  mesh, accum
):
  """The step sums an integer or bool aux leaf over devices and
  micro-batches: exact for a count, another number for a constant, a
  maximum, one example's value or a bool, which are named; counts (a row
  count from a shape too), zero and per-example leaves are exact and
  pass."""
  found, got, want, _, rec = _aux_step(
    mesh, _with_int_aux, 2, AuxNotACountWarning, accum
  )
  named = sorted(found(AuxNotACountWarning))
  assert named == ["all_long", "first", "longest", "rows_up_to_4", "version"]
  assert not [w for w in rec if w.category is AuxNotAMeanWarning]
  for k in ("tokens", "right", "rows", "none", "per_example"):
    np.testing.assert_array_equal(got[k], want[k])
  for k in named:  # what the warning is about: sums over devices
    assert int(got[k]) != int(want[k]), k


def _with_unread_aux(p, b):
  per = _ce(p, b).mean(1)
  tokens = b["mask"].sum(1).astype(jnp.int32)
  return jnp.mean(per), {
    "tokens_per_3": jnp.sum(tokens) // 3,  # floor of a count: not a count
    "host_max": jax.pure_callback(  # opaque to the reading
      lambda v: np.asarray(np.max(v), np.float32),
      jax.ShapeDtypeStruct((), jnp.float32),
      jax.lax.stop_gradient(per),
    ),
    "mean": jnp.mean(per),
    "tokens": jnp.sum(tokens),
  }


def test_an_aux_leaf_the_reading_cannot_follow_is_warned_about(mesh):
  """An aux leaf the reading cannot follow (a host callback, an integer
  floor division) may be another number once combined over devices: it is
  named, float or integer, and read leaves are not."""
  found, got, want, _, rec = _aux_step(
    mesh, _with_unread_aux, 1, AuxUnverifiedWarning
  )
  named = found(AuxUnverifiedWarning)
  assert sorted(named) == ["host_max", "tokens_per_3"]
  assert "pure_callback" in named["host_max"]
  assert "(int32)" in named["tokens_per_3"]
  assert all("test_loss_check.py" in w.filename for w in rec)
  assert not [w for w in rec if w.category is not AuxUnverifiedWarning]
  np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-6)
  np.testing.assert_array_equal(got["tokens"], want["tokens"])
  for k in named:  # what the warning is about: combined per device
    assert not np.isclose(float(got[k]), float(want[k]), rtol=1e-4), k


def _with_row_aux(p, b):
  per = _ce(p, b).mean(1)
  return jnp.mean(per), {
    # each row its own example's: joined row by row, exact
    "per_token": _ce(p, b).T,  # rows on the second axis
    "flat": _ce(p, b).reshape(-1),
    "pred": jnp.argmax(_logits(p, b), -1),
    "same": jnp.zeros_like(per) + jnp.sum(zerojax.gather(p)["w"]),
    # rows computed from other rows: each device's piece differs
    "cumulative": jnp.cumsum(per),
    "share": per / jnp.sum(per),
    "ranked": jnp.sort(per),
    "position": jnp.arange(per.shape[0]),
    "batch_total": jnp.broadcast_to(jnp.sum(per), per.shape),
    "by_rows": per / per.shape[0],
    "first_zeroed": per.at[0].set(0.0),  # a write by position
    # examples scattered across the rows by their labels: not read
    "by_label": jnp.zeros_like(per)
    .at[b["y"][:, 0] % 2]
    .add(per, wrap_negative_indices=False),
  }


@pytest.mark.parametrize("accum", [1, 2])
def test_an_aux_leaf_with_the_rows_not_computed_row_by_row_is_warned_about(
  mesh, accum
):
  """The step joins an aux leaf whose shape follows the rows from the
  devices' and micro-batches' rows: exact when each row is its own
  example's value, each device's piece otherwise (a cumulative sum, a
  normalization over the rows, a sort, a position, a sum spread over the
  rows, a factor of the row count, a write by position), which are named;
  a scatter of examples across the rows is named as unchecked."""
  found, got, want, (tx, state, batch), rec = _aux_step(
    mesh,
    _with_row_aux,
    2,
    (AuxNotPerExampleWarning, AuxUnverifiedWarning),
    accum,
  )

  def named(category):
    return sorted(found(category))

  assert named(AuxNotPerExampleWarning) == [
    "batch_total",
    "by_rows",
    "cumulative",
    "first_zeroed",
    "position",
    "ranked",
    "share",
  ]
  assert named(AuxUnverifiedWarning) == ["by_label"]
  assert len(rec) == 8
  for k in ("per_token", "flat", "pred", "same"):
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
  for k in named(AuxNotPerExampleWarning) + ["by_label"]:
    assert not np.allclose(got[k], want[k], rtol=1e-4), k
  # an eval step reports the aux only with has_aux=True: warned only then
  with warnings.catch_warnings():
    for category in (AuxNotPerExampleWarning, AuxUnverifiedWarning):
      warnings.simplefilter("error", category)
    zerojax.eval_step(_with_row_aux, tx)(state, batch)
  with pytest.warns((AuxNotPerExampleWarning, AuxUnverifiedWarning)) as rec:
    zerojax.eval_step(_with_row_aux, tx, has_aux=True)(state, batch)
  assert len(rec) == 8


def _over_chunks(split: str, combine: str = "sum"):
  """Cross-entropy accumulated in a scan over chunks of the batch: of the
  flattened tokens within each example (``"tokens"``: 6 per row, chunks of
  3) or of whole rows (``"rows"``: 2 rows per chunk); ``combine`` says how
  the carry takes each chunk's cross-entropy."""

  def loss(p, b):
    q = zerojax.gather(p)
    h = jnp.tanh(q["emb"][b["tok"][:, :6]] @ q["w"])  # (rows, 6, width)
    if split == "tokens":
      hs = h.reshape(-1, h.shape[-1]).reshape(-1, 3, h.shape[-1])
      ys = b["y"][:, :6].reshape(-1).reshape(-1, 3)
    else:
      hs, ys = h.reshape(-1, 2, 6, h.shape[-1]), b["y"][:, :6].reshape(-1, 2, 6)

    def body(acc, xs):
      ce = optax.softmax_cross_entropy_with_integer_labels(
        xs[0] @ q["v"], xs[1]
      )
      if combine == "max":  # over a chunk's rows
        return acc + jnp.max(jnp.sum(ce, axis=-1)), None
      if combine == "decay":  # later chunks weigh more
        return 0.5 * acc + jnp.sum(ce), None
      return acc + jnp.sum(ce), None

    total, _ = jax.lax.scan(body, 0.0, (hs, ys))
    return total if combine == "undivided" else total / ys.size

  return loss


@pytest.mark.parametrize("combine", ["sum", "undivided"])
@pytest.mark.parametrize("split", ["tokens", "rows"])
@pytest.mark.parametrize("stage,accum", [(0, 1), (3, 2)])
def test_a_loss_summed_over_chunks_of_rows_or_tokens_trains_like_the_plain_step(
  mesh, split, combine, stage, accum
):
  """A scan over the rows' chunks whose carry is a running sum is read as
  the batched sum it is, with no warning: a mean once divided, a sum over
  examples left undivided."""
  _assert_trains_like_plain(
    mesh,
    _over_chunks(split, combine),
    optax.adamw(1e-2),
    stage,
    accum,
    rows=64,
  )


@pytest.mark.parametrize(
  "split,combine,verdict",
  [
    ("rows", "max", "reduce_max over the batch's rows"),
    ("rows", "decay", None),
    ("tokens", "decay", None),
  ],
)
def test_chunks_combined_otherwise_than_summed_are_not_taken_for_a_mean(
  mesh, split, combine, verdict
):
  """A carry that decays (weighing the chunks apart) differs per device
  from the whole batch's loss: it is not read (a warning). A maximum over
  a chunk's rows combines examples and is refused (here each device's
  rows hold whole chunks, so only the reading can tell)."""
  loss, batch = _over_chunks(split, combine), _batch(rows=64)
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  state = zerojax.init(_params(), tx)
  pieces = [
    float(loss(_params(), jax.tree.map(lambda x: x[i : i + 8], batch)))
    for i in range(0, 64, 8)
  ]
  whole = float(loss(_params(), batch))
  assert np.isclose(np.mean(pieces), whole) == (combine == "max")
  if verdict is None:
    with pytest.warns(LossUnverifiedWarning, match="running sum"):
      zerojax.eval_step(loss, tx)(state, batch)
  else:
    with pytest.raises(LossNotAMeanError, match=verdict):
      zerojax.eval_step(loss, tx)(state, batch)


def test_the_check_leaves_a_jit_in_the_loss_to_trace_afresh_at_a_devices_rows(
  mesh,
):
  """The check traces the loss at a device's own rows; a ``jax.jit``
  function inside it keeps that trace apart, so the user's own trace at
  those rows (as the report's, which records the Remat blocks it meets)
  runs the function's Python again."""
  traced = []

  @jax.jit
  def mean_of(ce):
    traced.append(ce.shape)
    return jnp.mean(ce)

  def loss(p, b):
    return mean_of(_ce(p, b))

  params, batch = _params(), _batch()
  tx = zerojax.zero(optax.sgd(1e-2), stage=2, mesh=mesh)
  zerojax.train_step(loss, tx)(zerojax.init(params, tx), batch)
  assert (2, 7) in traced, traced  # read at a device's rows
  before = len(traced)
  local = jax.tree.map(lambda x: x[:2], batch)
  jax.make_jaxpr(loss)(params, local)
  assert traced[before:] == [(2, 7)], traced


def test_a_divisor_a_sum_at_a_pieces_rows_and_a_mean_at_the_batchs_is_refused(
  mesh,
):
  """``/ 8`` below 8 rows and ``/ (4 * rows)`` above reads as a sum at a
  piece's 2 rows and at 4, where the step would add the pieces' losses up
  (8x the unsharded loss of the 16 rows): refused, naming the factors."""

  def loss(p, b):
    rows = b["tok"].shape[0]
    return jnp.sum(_ce(p, b)) / (8 if rows < 8 else 4 * rows)

  params, batch = _params(), _batch()
  tx = zerojax.zero(optax.sgd(1e-2), stage=2, mesh=mesh)
  state = zerojax.init(params, tx)
  with pytest.raises(LossNotAMeanError, match="other than as a sum's") as e:
    zerojax.train_step(loss, tx)(state, batch)
  assert "0.125 x the sums at 2 rows, 0.01562 x at 16" in str(e.value)
  assert int(state.step) == 0
