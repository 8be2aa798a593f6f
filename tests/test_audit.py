"""The loss audit (``zerojax._src.jaxpr.audit``) on every structured primitive.

A stage-3 loss that gathers one layer at a time inside a ``scan``, a
``jax.checkpoint`` with a policy, a ``cond``, a ``while``, a ``jit`` or a
``custom_vjp`` body must train exactly and lean (no whole-tree fallback, no
warning) on every supported JAX; the same bodies reading a shard without
gathering must be caught. What the audit cannot read is said as zerojax's
limitation, never as the loss's misuse.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
from tests import toy
from zerojax._src.jaxpr import audit as _audit

g = zerojax.gather


def _params():
  k = jax.random.split(jax.random.key(3), 2)
  return {
    "w": jax.random.normal(k[0], (4, 6, 6)) * 0.4,
    "head": jax.random.normal(k[1], (6, 3)) * 0.4,
  }


def _head(params, h, b):
  return jnp.mean((h @ g(params["head"]) - b["y"]) ** 2)


def in_scan(params, b):
  def body(h, w):
    return jnp.tanh(h @ g(w)), None

  h, _ = jax.lax.scan(body, b["x"], params["w"])
  return _head(params, h, b)


def in_checkpoint_with_policy(params, b):
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ g(w)), None), policy=policy)
  h, _ = jax.lax.scan(body, b["x"], params["w"])
  return _head(params, h, b)


def in_cond(params, b):
  def body(h, xs):
    i, w = xs
    return jax.lax.cond(
      i % 2 == 0,
      lambda h, w: jnp.tanh(h @ g(w)),
      lambda h, w: jnp.sin(h @ g(w)),
      h,
      w,
    ), None

  h, _ = jax.lax.scan(body, b["x"], (jnp.arange(4), params["w"]))
  return _head(params, h, b)


def in_while(params, b):
  def body(i, h):
    return jnp.tanh(h @ g(params["w"])[i])

  h = jax.lax.fori_loop(0, 4, body, b["x"])
  return _head(params, h, b)


def in_jit(params, b):
  layer = jax.jit(lambda h, w: jnp.tanh(h @ g(w)))
  h, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), b["x"], params["w"])
  return _head(params, h, b)


@jax.custom_vjp
def _vjp_layer(h, w):
  return jnp.tanh(h @ g(w))


def _vjp_fwd(h, w):
  out, pullback = jax.vjp(lambda h, w: jnp.tanh(h @ g(w)), h, w)
  return out, pullback


_vjp_layer.defvjp(_vjp_fwd, lambda pullback, ct: pullback(ct))


def in_custom_vjp(params, b):
  h, _ = jax.lax.scan(
    lambda h, w: (_vjp_layer(h, w), None), b["x"], params["w"]
  )
  return _head(params, h, b)


LEAN = {
  f.__name__: f
  for f in (
    in_scan,
    in_checkpoint_with_policy,
    in_cond,
    in_while,
    in_jit,
    in_custom_vjp,
  )
}


def _data(n=2):
  rng = np.random.default_rng(4)
  return [
    {
      "x": rng.normal(size=(16, 6)).astype(np.float32),
      "y": rng.normal(size=(16, 3)).astype(np.float32),
    }
    for _ in range(n)
  ]


@pytest.mark.parametrize("name", LEAN)
def test_per_layer_gather_in_structured_body_is_lean_and_exact(mesh, name):
  loss, data = LEAN[name], _data()
  params, want = toy.optax_run(loss, optax.adam(1e-2), _params(), data)
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  # gather="model" raises if the loss is not lean; and not one warning
  full, got, notes = toy.zero_run(loss, tx, _params(), data, gather="model")
  assert not notes, notes
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for k in params:
    np.testing.assert_allclose(full[k], params[k], rtol=1e-5, atol=1e-6)


def _misuse(body_kind):
  """A loss whose structured body reads the stacked shard ungathered."""

  def loss(params, b):
    w = params["w"]
    if body_kind == "scan":
      s, _ = jax.lax.scan(lambda c, x: (c + jnp.sum(x), None), 0.0, w)
    elif body_kind == "checkpoint":
      s = jax.checkpoint(lambda x: jnp.sum(jnp.sin(x)))(w)
    elif body_kind == "cond":
      s = jax.lax.cond(
        b["x"][0, 0] > 0, lambda x: jnp.sum(x), lambda x: -jnp.sum(x), w
      )
    elif body_kind == "while":
      s = jax.lax.fori_loop(0, 2, lambda i, c: c + jnp.sum(w), 0.0)
    elif body_kind == "jit":
      s = jax.jit(lambda x: jnp.sum(x * x))(w)
    elif body_kind == "custom_jvp":
      s = jnp.sum(jax.nn.relu(w))  # relu is a custom_jvp
    q = g(params)
    h = jnp.tanh(b["x"] @ q["w"][0])
    return jnp.mean((h @ q["head"] - b["y"]) ** 2) + 1e-3 * s

  return loss


@pytest.mark.parametrize(
  "kind", ["scan", "checkpoint", "cond", "while", "jit", "custom_jvp"]
)
def test_ungathered_read_inside_structured_body_is_caught(mesh, kind):
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=mesh)
  state = zerojax.init(_params(), tx)
  # (the cond branches on one example: a per-device loss, asked for)
  step = zerojax.train_step(
    _misuse(kind), tx, gather="model", per_device_loss=True
  )
  with pytest.raises(
    zerojax.errors.UngatheredParamError, match=r"params\['w'\]"
  ):
    step(state, _data(1)[0])
  assert int(state.step) == 0


def test_custom_jvp_and_shard_map_bodies_that_gather_are_read_as_lean(mesh):
  """Read through a shard_map and a custom_jvp call: a gather inside is
  proper, arithmetic on the same inputs is not."""

  @jax.custom_jvp
  def f(sink, src):
    return jnp.sum(_audit_gather_stub(sink, src))

  f.defjvp(lambda p, t: (f(*p), jnp.zeros(())))
  spmd = lambda fn: jax.shard_map(
    fn, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
  )
  x = jnp.ones((4,))
  assert _audit.ungathered_uses(spmd(f), (x, x), [0, 0]) == {}
  assert _audit.ungathered_uses(
    spmd(lambda a, b: jnp.sum(a * b)), (x, x), [0, None]
  ) == {0: "mul"}


def _audit_gather_stub(sink, src):
  from zerojax import ShardedParam
  from zerojax._src.comm.gather import GatherSpec

  spec = GatherSpec(
    axis_name="data", dim=-1, size=4, stage=2, reduce_dtype=jnp.float32
  )
  return g(ShardedParam(sink, src, spec))


def test_unreadable_program_is_zerojax_limitation_not_misuse(mesh, monkeypatch):
  """If the walker cannot line up an equation (simulated: jit no longer
  known as call-like), 'auto' gathers the whole tree with a warning naming
  the primitive and the JAX version, and 'model' raises; neither blames
  the loss."""
  monkeypatch.setattr(_audit, "_CALL_LIKE", _audit._CALL_LIKE - {"jit", "pjit"})
  tx = zerojax.zero(optax.adam(1e-2), stage=3, mesh=mesh)
  state = zerojax.init(_params(), tx)
  b = _data(1)[0]
  with pytest.raises(RuntimeError, match="could not read a '(p)?jit' equation"):
    zerojax.train_step(in_jit, tx, gather="model")(state, b)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state, _ = zerojax.train_step(in_jit, tx)(state, b)
  notes = [str(w.message) for w in caught if "zerojax" in str(w.message)]
  assert len(notes) == 1, notes
  assert (
    f"JAX {jax.__version__}" in notes[0]
    and "not a fault in your loss" in notes[0]
  )
  assert "does not only gather" not in notes[0]
  assert int(state.step) == 1


def test_scan_counts_come_from_shapes():
  """Consts, carry and scanned operands are told apart by shape alone (JAX
  0.11 dropped the scan's num_consts / num_carry parameters)."""

  def f(c, xs, w):
    return jax.lax.scan(lambda c, x: (c * w + x.sum(), (c, x)), c, xs)

  jaxpr = jax.make_jaxpr(f)(1.0, jnp.ones((3, 2)), 2.0).jaxpr
  eqn = [e for e in jaxpr.eqns if e.primitive.name == "scan"][0]
  body = _audit._subprograms(eqn.params)[0]
  nconsts, ncarry = _audit.scan_counts(eqn, body)
  assert ncarry == 1 and nconsts == len(eqn.invars) - 2
