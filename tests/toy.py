"""A small model with uneven leaf shapes, its layers in a ``lax.scan``.

Every leaf shape is chosen so that it does not divide 8 devices (padding),
plus a scalar, a bias of 3 and an integer buffer. ``loss_fn`` calls
``zerojax.gather`` per layer inside a checkpointed scan body, so the same
function serves ``gather="model"`` and ``gather="all"``.
"""

import contextlib
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax

VOCAB, WIDTH, LAYERS, CLASSES = 13, 7, 3, 5


def init_params(key, vocab=VOCAB, width=WIDTH, layers=LAYERS, classes=CLASSES):
  k = jax.random.split(key, 4)
  return {
    "embed": jax.random.normal(k[0], (vocab, width)) * 0.5,
    "layers": {
      "w": jax.random.normal(k[1], (layers, width, width)) * 0.5,
      "b": jax.random.normal(k[2], (layers, width)) * 0.1,
    },
    "head": jax.random.normal(k[3], (width, classes)) * 0.5,
    "bias3": jnp.zeros((3,)),
    "scale": jnp.ones(()),
    "ids": jnp.arange(4, dtype=jnp.int32),  # an integer buffer, not trained
  }


def loss_fn(params, batch):
  g = zerojax.gather
  x = g(params["embed"])[batch["x"]]  # (b, W)

  def body(h, layer):
    layer = g(layer)
    return jnp.tanh(h @ layer["w"] + layer["b"][None, :]), None

  h, _ = jax.lax.scan(jax.checkpoint(body), x, params["layers"])
  logits = h @ g(params["head"]) * g(params["scale"])  # (b, C)
  bias = jnp.concatenate([g(params["bias3"]), jnp.zeros((2,), logits.dtype)])
  logits = logits + bias[None, :]
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), batch["y"]
  ).mean()
  return loss + 0.0 * params["ids"].sum()


def batches(n, size=32, seed=0, vocab=VOCAB, classes=CLASSES):
  rng = np.random.default_rng(seed)
  return [
    {
      "x": rng.integers(0, vocab, (size,)).astype(np.int32),
      "y": rng.integers(0, classes, (size,)).astype(np.int32),
    }
    for _ in range(n)
  ]


def _trained(x):
  return jnp.issubdtype(x.dtype, jnp.floating)


def reference(
  params,
  opt,
  data,
  *,
  param_dtype=None,
  reduce_dtype=None,
  devices=1,
  with_state=False,
):
  """Plain Optax on one device, with the same mixed-precision policy.

  With ``devices > 1`` each batch is split in ``devices`` chunks whose
  gradients are computed separately (in the compute dtype, as each device
  does) and summed in ``reduce_dtype`` -- the single-device emulation of
  the policy's arithmetic.
  """
  mask = lambda t: jax.tree.map(
    lambda x, p: x if _trained(p) else optax.MaskedNode(), t, params
  )
  master = mask(params)
  state = opt.init(master)
  frozen = params

  @jax.jit
  def step(master, state, batch):
    cast = lambda m: m.astype(param_dtype) if param_dtype is not None else m
    compute = jax.tree.map(
      lambda m, p: cast(m) if _trained(p) else p,
      master,
      frozen,
      is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
    chunks = jax.tree.map(
      lambda x: x.reshape((devices, -1) + x.shape[1:]), batch
    )
    total = None
    for d in range(devices):
      g = jax.grad(loss_fn, allow_int=True)(
        compute, jax.tree.map(lambda x: x[d], chunks)
      )
      g = jax.tree.map(lambda x: x.astype(reduce_dtype or x.dtype), mask(g))
      total = g if total is None else jax.tree.map(jnp.add, total, g)
    g = jax.tree.map(lambda x, m: (x / devices).astype(m.dtype), total, master)
    updates, state = opt.update(g, state, master)
    return optax.apply_updates(master, updates), state

  for batch in data:
    master, state = step(master, state, batch)
  return (master, state) if with_state else master


_REFERENCES: dict = {}


def shared_reference(name, params, opt, data, **kw):
  """:func:`reference`, run once per process for each ``name`` and policy
  and then shared by every stage and mesh that compares against it (the
  unsharded run does not depend on them). Keyed on the very ``params`` and
  ``data`` objects too (a module-scoped fixture's), so a name reused with
  other inputs runs again."""
  key = (name, tuple(sorted((k, str(v)) for k, v in kw.items())))
  hit = _REFERENCES.get(key)
  if hit is None or hit[0] is not params or hit[1] is not data:
    hit = _REFERENCES[key] = (params, data, reference(params, opt, data, **kw))
  return hit[2]


def rel_err(got, want):
  """Largest per-leaf relative error ||got - want|| / ||want||."""
  errs = []
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    errs.append(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
  return max(errs)


def assert_same_up_to_summation_order(got, want, *, terms: int, ulps: int = 4):
  """``got`` and ``want`` come from two *different* compiled programs of the
  same maths (a rewrite on vs off, a streamed update vs the whole one,
  another axis type or gather form): XLA may add floating-point terms in
  another order there (its fusions, a dot with a transposed operand or a
  transpose and a dot, the CPU's kernels, which differ between
  processors), which moves a float32 result by about one rounding per term.
  So each leaf must agree to ``ulps * terms`` float32 roundings of its
  largest magnitude, plus one rounding of its own dtype when that is
  narrower (a bf16 copy of a float32 value that moved may round the other
  way): ``|got - want| <= (ulps * terms * eps32 + eps_leaf) * max|want|``,
  with ``terms`` the most terms any one result sums over the run (the test
  derives it from its sizes). A wrong value (a lost term, another leaf's
  state) is off by far more. Bitwise equality is for one program run
  twice, or where the design fixes the order; such tests say why."""
  # leaf by leaf: the two programs' trees may carry other static records
  got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
  chex.assert_trees_all_equal_shapes_and_dtypes(got_l, want_l)
  for i, (a, b) in enumerate(zip(got_l, want_l)):
    if not jnp.issubdtype(b.dtype, jnp.inexact):
      np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
      continue
    eps32 = float(jnp.finfo(jnp.float32).eps)
    eps = float(jnp.finfo(b.dtype).eps)
    bound = ulps * terms * eps32 + (eps if eps > eps32 else 0.0)
    a, b = np.asarray(a, np.complex128), np.asarray(b, np.complex128)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    np.testing.assert_allclose(
      a, b, rtol=0, atol=bound * scale, err_msg=f"leaf {i}"
    )


def layered_params(layers, width, vocab, key=None):
  """Divisible shapes: an embedding, ``layers`` stacked blocks, a head."""
  k = jax.random.split(jax.random.key(0) if key is None else key, 3)
  return {
    "embed": jax.random.normal(k[0], (vocab, width)) * 0.1,
    "layers": {
      "w": jax.random.normal(k[1], (layers, width, width)) * 0.1,
      "b": jnp.zeros((layers, width)),
    },
    "head": jax.random.normal(k[2], (width, vocab)) * 0.1,
  }


def layered_loss(params, batch, gather=zerojax.gather):
  """Gathers each block inside a checkpointed scan, the rest at use."""
  g = gather
  x = g(params["embed"])[batch["x"]]

  def body(h, layer):
    layer = g(layer)
    return jnp.tanh(h @ layer["w"] + layer["b"][None, :]), None

  h, _ = jax.lax.scan(jax.checkpoint(body), x, params["layers"])
  logits = h @ g(params["head"])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), batch["y"]
  ).mean()


def plain_layered_loss(params, batch):
  """:func:`layered_loss` as a plain-JAX user writes it: no zerojax call."""
  return layered_loss(params, batch, gather=lambda x: x)


@jax.custom_vjp
def custom_vjp_linear(x, w):
  """``x @ w`` with a hand-written backward rule."""
  return x @ w


custom_vjp_linear.defvjp(
  lambda x, w: (x @ w, (x, w)), lambda res, ct: (ct @ res[1].T, res[0].T @ ct)
)


@jax.custom_vjp
def custom_vjp_add_bias(h, b):
  """``h + b`` (a row bias) with a hand-written backward rule."""
  return h + b[None, :]


custom_vjp_add_bias.defvjp(
  lambda h, b: (h + b[None, :], None), lambda _, ct: (ct, jnp.sum(ct, axis=0))
)


def layered_loss_with_custom_vjp_bias(params, batch):
  """:func:`plain_layered_loss` with each block's bias added by
  :func:`custom_vjp_add_bias` inside the checkpointed scan."""
  x = params["embed"][batch["x"]]

  def body(h, layer):
    return jnp.tanh(custom_vjp_add_bias(h @ layer["w"], layer["b"])), None

  h, _ = jax.lax.scan(jax.checkpoint(body), x, params["layers"])
  return optax.softmax_cross_entropy_with_integer_labels(
    (h @ params["head"]).astype(jnp.float32), batch["y"]
  ).mean()


def optax_run(loss, opt, params, data):
  """Plain Optax over ``data``: ``(final params, per-step losses)``."""
  state, losses = opt.init(params), []
  for b in data:
    value, grads = jax.value_and_grad(loss)(params, b)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(value))
  return params, losses


def zero_run(loss, tx, params, data, **step_kw):
  """``zerojax.train_step`` over ``data``: ``(gathered params, per-step
  losses, zerojax's warnings)``; every warning is recorded."""
  import warnings

  state = zerojax.init(params, tx)
  step = zerojax.train_step(loss, tx, **step_kw)
  losses = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for b in data:
      state, metrics = step(state, b)
      losses.append(float(metrics["loss"]))
  notes = [str(w.message) for w in caught if "zerojax" in str(w.message)]
  return zerojax.gather_params(state), losses, notes


@contextlib.contextmanager
def warnings_as_errors():
  """Every warning raised as an error, but JAX's note that an entry of the
  session's shared compilation cache could not be read (another test
  process was still writing it; JAX then compiles the program itself, so
  the result is the same): that one is about the harness, not the code
  under test (tests/conftest.py)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warnings.filterwarnings(
      "default", message="Error reading persistent compilation cache"
    )
    yield


def assert_same_arrays(got, want):
  """Same tree, and every leaf bitwise equal and laid out the same
  (``sharding``): chex compares the trees, then the shardings."""
  chex.assert_trees_all_equal(got, want)
  chex.assert_trees_all_equal_comparator(
    lambda a, b: a.sharding == b.sharding,
    lambda a, b: f"sharding {a.sharding} != {b.sharding}",
    got,
    want,
  )


def reduce_scatter_counts(compiled, min_elements: int, devices: int = 8) -> set:
  """How many times per step each reduce-scatter of at least
  ``min_elements`` elements runs in a compiled step (1: once, after the
  loops; a loop's trip count: inside it). Empty when there is none."""
  colls = zerojax.diagnostics.collectives(compiled.as_text(), devices)
  return {
    c.count
    for c in colls
    if c.kind == "reduce-scatter" and c.elements >= min_elements
  }
