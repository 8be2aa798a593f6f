"""Every ``>>>`` example in a public docstring runs, as written, against a
small model on the suite's 8 CPU devices (``doctest``)."""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests.test_package import PUBLIC


def _examples():
  finder = doctest.DocTestFinder(exclude_empty=True)
  seen, found = set(), []
  for mod_name in PUBLIC:
    mod = importlib.import_module(mod_name)
    for name in mod.__all__:
      obj = getattr(mod, name)
      if id(obj) in seen or not callable(obj):
        continue
      seen.add(id(obj))
      for test in finder.find(obj, f"{mod_name}.{name}", globs={}):
        if test.examples:
          found.append(test)
  return sorted(found, key=lambda t: t.name)


EXAMPLES = _examples()


def _namespace(tmp_path):
  """What the examples' prose assumes: a stacked two-layer model, its loss,
  a batch and a stage-1 transformation with its optimizer state."""
  tx = zerojax.zero(optax.adamw(1e-3), stage=1)
  replicated = jax.sharding.NamedSharding(tx.mesh, jax.sharding.PartitionSpec())
  params = jax.device_put(
    {
      "layers": {"kernel": jnp.full((4, 8, 8), 0.1)},
      "head": {"kernel": jnp.full((8, 2), 0.1)},
    },
    replicated,
  )

  def loss_fn(params, batch):
    def body(h, layer):
      return jnp.tanh(h @ layer["kernel"]), None

    h, _ = jax.lax.scan(body, batch["x"], params["layers"])
    return jnp.mean((h @ params["head"]["kernel"] - batch["y"]) ** 2)

  return {
    "zerojax": zerojax,
    "jax": jax,
    "jnp": jnp,
    "np": np,
    "optax": optax,
    "params": params,
    "params_template": jax.eval_shape(lambda: params),
    "loss_fn": loss_fn,
    "batch": {"x": jnp.ones((16, 8)), "y": jnp.zeros((16, 2))},
    "x": jnp.ones((16, 8)),
    "tx": tx,
    "opt_state": tx.init(params),
    "state": zerojax.init(params, tx),
  }


def test_the_public_docstrings_carry_examples():
  assert len(EXAMPLES) >= 10, [t.name for t in EXAMPLES]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda t: t.name)
def test_docstring_example_runs(example, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  example.globs = _namespace(tmp_path)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  result = runner.run(example, out=lambda s: pytest.fail(s, pytrace=False))
  assert result.attempted > 0 and result.failed == 0
