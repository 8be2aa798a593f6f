"""Optax's own test suites, run unchanged through the zerojax drop-in.

``optax/_src/alias_test.py`` and ``optax/contrib/_common_test.py`` ship in
the Optax wheel. Each run here starts pytest on them in a fresh process
with the ``tests.optax_dropin`` plugin: every optimizer they build comes
back as ``zerojax.zero(opt, stage=S, mesh=make_mesh())``, every leaf
sharded (``min_shard_size=0``, the default). Optax's assertions are
unchanged. A run passes when every failure is on :data:`EXCEPTIONS`, each
matched by its message, and at least as many tests pass as
:data:`MIN_PASSED_PER_MODULE` says (so a run that collects nothing cannot
pass).

What runs where (CI time): the default suite runs stage 1 on everything
but the long convergence tests and L-BFGS's, on Auto axes with jaxlib
0.10 (CI's oldest leg, every test) and on an Explicit mesh
(``jax.make_mesh``'s default) with newer jaxlib (its newest leg, the half
of the tests whose ids hash even), so each axis type runs at one end of
the JAX window; Optax's sharding-in-types tests (Explicit axes) run at
stage 1 at both ends. The slow suite (oldest leg) runs stage 0 on the same
half of Optax's contrib suite (but its convergence tests), stage 1's
L-BFGS tests, and the sharding-in-types tests at stage 2.
Stage 2 through the drop-in is stage 1: the same layouts and the same code
(the loop's own ``jax.grad`` makes the gradients, so there is no
reduce-scatter of zerojax's to differ), which
``test_dropin_stage2_is_stage1`` checks leaf by leaf and bit by bit
instead of a second eight-minute run. Optax's convergence tests (``test_optimization``:
10,000 steps per case, ``test_optimizers``: 30,000) are not run: through
8 fake CPU devices they take over an hour per stage. Their numbers are
covered by exact-parity tests here (``test_optax_parity.py``, the Optax
zoo in ``test_parity.py``).
"""

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax
from zerojax.xla_flags import cpu_device_flags

MODULES = ("optax._src.alias_test", "optax.contrib._common_test")
# the convergence tests (``test_optimization<N>``, ``test_optimizers<N>``):
# minutes per case through 8 fake devices. ``-k`` matches substrings, so the
# tests whose names extend ``test_optimizers`` (extra arguments, schedules,
# inject_hyperparams) are named back in.
SELECT = (
  "not test_optimization and not (test_optimizers and not accept "
  "and not inject)"
)
_JAXLIB = tuple(int(v) for v in version("jaxlib").split(".")[:2])

# id regex -> (message regex, why). Each is a known, bounded difference,
# not a wrong answer; see the README's "Optax conformance" section.
EXCEPTIONS = {
  r"LBFGSTest::test_against_plain_implementation\d+": (
    r"Not equal to tolerance rtol=1e-05.*Max relative difference among "
    r"violations: [0-9.]+e-0[5-9]",
    "L-BFGS's dot products over sharded vectors sum in another order; "
    "after its iterations the params differ by < 1e-4 relative "
    "(measured 3.0e-5), above this test's 1e-5",
  ),
}


def run_suite(
  stage, tmp_path, select=SELECT, workers=0, modules=MODULES, **env_extra
):
  """Optax's suites at ``stage`` in a fresh process (``workers``: pytest-
  xdist processes inside it, for the serial slow suite)."""
  report = tmp_path / f"stage{stage}.jsonl"
  env = dict(
    os.environ,
    ZEROJAX_CONFORMANCE_REPORT=str(report),
    ZEROJAX_CONFORMANCE_MIN_SHARD_SIZE="0",
    XLA_FLAGS=cpu_device_flags(8),
    **env_extra,
  )
  # run from an outer xdist worker, the inner pytest must not think it is one
  env = {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST")}
  if stage is not None:
    env["ZEROJAX_CONFORMANCE_STAGE"] = str(stage)
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-p",
      "tests.optax_dropin",
      "--noconftest",
      "-o",
      "addopts=",
      "-p",
      "no:cacheprovider",
      "-q",
      *(["-n", str(workers)] if workers else []),
      "-k",
      select,
      "--pyargs",
      *modules,
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=3600,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  if not report.exists():
    pytest.fail(
      f"the Optax suite did not run:\n{proc.stdout[-3000:]}"
      f"\n{proc.stderr[-3000:]}"
    )
  return [json.loads(l) for l in report.read_text().splitlines()], proc


def _unexpected(records):
  bad = []
  for r in records:
    if r["outcome"] != "failed":
      continue
    known = [
      msg for pat, (msg, _) in EXCEPTIONS.items() if re.search(pat, r["id"])
    ]
    if not known or not re.search(known[0], r["error"], re.S):
      bad.append(f"{r['id']}: {r['error'][:300]}")
  return bad


def _check(records, proc, min_passed):
  passed = sum(r["outcome"] == "passed" for r in records)
  bad = _unexpected(records)
  assert not bad, "\n".join(bad)
  assert passed >= min_passed, (passed, proc.stdout[-2000:])


# per module, so that the two halves run on two workers side by side
# (passed reports: a test's subtests report too)
MIN_PASSED_PER_MODULE = {
  "optax._src.alias_test": 560,
  "optax.contrib._common_test": 400,
}
# CI's newest-JAX leg (ZEROJAX_MATRIX_CASES=third, tests/conftest.py) runs
# the default suite's stage-1 run on the half of Optax's tests whose ids
# hash even (tests/optax_dropin.py): 220 of alias_test's 444 tests, 197 of
# the contrib suite's 385 (Optax 0.2.8: 370 and 398 passed reports on
# JAX 0.10.2); the oldest leg runs them all
HALF = os.environ.get("ZEROJAX_MATRIX_CASES") == "third"
MIN_PASSED_IN_HALF = {
  "optax._src.alias_test": 300,
  "optax.contrib._common_test": 320,
}


# Auto axes on jaxlib 0.10 (CI's oldest leg), an Explicit mesh on newer
# jaxlib (its newest): each axis type runs once in CI
AXIS_TYPES = "auto" if _JAXLIB < (0, 11) else "explicit"


@pytest.mark.parametrize("module", MODULES)
def test_optax_suites_through_the_dropin_stage1(tmp_path, module):
  # L-BFGS's tests (a third of the time) run at stage 1 in the slow suite
  _check(
    *run_suite(
      1,
      tmp_path,
      f"{SELECT} and not LBFGSTest",
      modules=(module,),
      ZEROJAX_CONFORMANCE_AXIS_TYPES=AXIS_TYPES,
      ZEROJAX_CONFORMANCE_HALF="1" if HALF else "0",
    ),
    (MIN_PASSED_IN_HALF if HALF else MIN_PASSED_PER_MODULE)[module],
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "stage,select,min_passed,types,modules,half",
  [
    (
      0,
      SELECT,
      MIN_PASSED_IN_HALF["optax.contrib._common_test"],
      "explicit",
      ("optax.contrib._common_test",),
      "1",
    ),
    (1, f"{SELECT} and LBFGSTest", 30, "explicit", MODULES, "0"),
  ],
  ids=["stage0-contrib-half", "stage1-lbfgs"],
)
def test_optax_suites_through_the_dropin(
  tmp_path, stage, select, min_passed, types, modules, half
):
  """The default suite's stage-1 run leaves out stage 0 and L-BFGS's
  tests at stage 1: here they run, stage 0 on the half of Optax's contrib
  suite whose ids hash even (for CI time: ``alias_test`` and the whole
  contrib suite run at stage 1 in the default suite)."""
  _check(
    *run_suite(
      stage,
      tmp_path,
      select,
      workers=2,
      modules=modules,
      ZEROJAX_CONFORMANCE_AXIS_TYPES=types,
      ZEROJAX_CONFORMANCE_HALF=half,
    ),
    min_passed,
  )


def _plain_sharding_failures(tmp_path, failed_ids):
  """Which of ``failed_ids`` (Optax's sharding-in-types tests) fail with
  plain Optax on this JAX too: those tests alone, run without the drop-in
  (a name matching more tests only runs more)."""
  names = sorted({i.rsplit("::", 1)[-1].split("[")[0] for i in failed_ids})
  (tmp_path / "plain").mkdir()
  records, proc = run_suite(
    None,
    tmp_path / "plain",
    " or ".join(names),
    modules=("optax._src.sharding_test",),
    ZEROJAX_CONFORMANCE_AXIS="x",
  )
  ran = {r["id"] for r in records}
  assert set(failed_ids) <= ran, (
    sorted(set(failed_ids) - ran),
    proc.stdout[-2000:],
  )
  return {r["id"] for r in records if r["outcome"] == "failed"}


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_optax_sharding_in_types_suite_through_the_dropin(tmp_path, stage):
  """``optax/_src/sharding_test.py`` (an Explicit mesh, params
  ``P(None, 'x')``, the state's ``jax.typeof`` equal after init and update,
  eager and jitted), its version guards lifted, every optimizer wrapped at
  ``stage``: nothing fails that fails not with plain Optax (the tests that
  fail through the drop-in are run again plain). Stage 2 runs in the slow
  suite: through the drop-in it lays out and types every leaf as stage 1
  does (``test_dropin_stage2_is_stage1``)."""
  records, proc = run_suite(
    stage,
    tmp_path,
    "",
    modules=("optax._src.sharding_test",),
    ZEROJAX_CONFORMANCE_AXIS="x",
  )
  passed = sum(r["outcome"] == "passed" for r in records)
  assert passed >= 77 and len(records) >= 80, proc.stdout[-2000:]
  failed = {r["id"] for r in records if r["outcome"] == "failed"}
  if failed:
    plain = _plain_sharding_failures(tmp_path, failed)
    assert failed <= plain, [
      (r["id"], r["error"][:300]) for r in records if r["id"] in failed - plain
    ]


def test_an_unlisted_failure_fails_the_conformance_check():
  """The exception list matches by id and message, nothing broader."""
  lbfgs = "x.py::LBFGSTest::test_against_plain_implementation3"
  ok = (
    "Not equal to tolerance rtol=1e-05\n Max relative difference among "
    "violations: 3.01e-05"
  )
  assert not _unexpected([{"id": lbfgs, "outcome": "failed", "error": ok}])
  assert _unexpected(
    [
      {
        "id": lbfgs,
        "outcome": "failed",
        "error": ok.replace("3.01e-05", "2.0e-01"),
      }
    ]
  )
  assert _unexpected(
    [
      {
        "id": "x.py::AliasTest::test_preserve_dtype1",
        "outcome": "failed",
        "error": ok,
      }
    ]
  )


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.adamw(1e-2, weight_decay=0.1),
    lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.lion(1e-2)),
    lambda: optax.adafactor(1e-2),
    lambda: optax.lbfgs(),
  ],
  ids=["adamw", "clip-lion", "adafactor", "lbfgs"],
)
def test_dropin_stage2_is_stage1(make):
  """Why Optax's suites run through the drop-in at stage 1 only (stage 0 in
  the slow suite): at stage 2 the drop-in lays out every leaf as at stage
  1 and lowers to the same program (checked on its StableHLO), so it
  returns the same bits and a stage-2 run repeats the stage-1 one."""
  mesh = zerojax.make_mesh()
  with jax.set_mesh(mesh):
    params = {
      "w": jnp.linspace(-1, 1, 5 * 12).reshape(5, 12),  # padded
      "v": jnp.linspace(0, 2, 7 * 300).reshape(7, 300),
      "b": jnp.ones((2,)),
      "c": jnp.ones((3, 1, 9)),
    }
    loss = lambda p: sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree.leaves(p))
    runs, programs = [], []
    for stage in (1, 2):
      tx = zerojax.zero(make(), stage=stage, mesh=mesh)
      p, s = params, tx.init(params)
      step = jax.jit(lambda p, s, tx=tx: _dropin_step(tx, loss, p, s))
      # the lowered module: XLA compiles equal modules alike (and JAX's
      # compilation cache serves the second from the first)
      programs.append(step.lower(p, s).as_text())
      for _ in range(3):
        p, s = step(p, s)
      runs.append((p, s, tx.init(params)))
  assert programs[0] == programs[1]
  (p1, s1, i1), (p2, s2, i2) = runs
  for a, b in zip(jax.tree.leaves((p1, s1, i1)), jax.tree.leaves((p2, s2, i2))):
    assert a.sharding == b.sharding and a.shape == b.shape
    assert (
      (jax.random.key_data(a) == jax.random.key_data(b)).all()
      if (jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key))
      else (a.tobytes() == b.tobytes())
    )
  # and stage 2 shards what it should (the check is not vacuous)
  assert any(
    len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
    for x in jax.tree.leaves(s2)
  )


def _dropin_step(tx, loss, params, state):
  """An Optax loop's step; L-BFGS's line search takes the extra args."""
  value, grads = jax.value_and_grad(loss)(params)
  updates, state = tx.update(
    grads, state, params, value=value, grad=grads, value_fn=loss
  )
  return optax.apply_updates(params, updates), state
