"""A pytest plugin: per test, the seconds JAX spent tracing, lowering and
compiling, from :mod:`jax.monitoring`'s duration events.

    python -m pytest -p jax_phases ...      # with .ci/ on PYTHONPATH

``.ci/suite_time.py --jax-phases`` loads it. Each test process
(the xdist workers too) writes one JSON file to ``$ZEROJAX_JAX_PHASES_DIR``
at the end of its session: per test id, the seconds and counts of

* ``trace``: Python tracing to a jaxpr (``jaxpr_trace_duration``);
* ``lower``: jaxpr to an MLIR module (``jaxpr_to_mlir_module_duration``);
* ``compile``: XLA compiling it, or reading it from the persistent
  compilation cache (``backend_compile_duration``).

Events outside a test (collection, fixtures of another scope) go under
``"(outside tests)"``. Subprocesses a test starts (notebook kernels,
Optax's suites, the main job) do not load the plugin: their time is in the
test's duration only.
"""

import collections
import json
import os

import jax

_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/core/compile/backend_compile_duration": "compile",
}
_SECONDS: dict = collections.defaultdict(lambda: collections.Counter())


def _listener(event, duration, **kwargs):
  del kwargs
  phase = _EVENTS.get(event)
  if phase is None:
    return
  test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
  rec = _SECONDS[test or "(outside tests)"]
  rec[phase] += duration
  rec[phase + "_n"] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  out = os.environ.get("ZEROJAX_JAX_PHASES_DIR")
  if not out or not _SECONDS:
    return
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
    json.dump({t: dict(c) for t, c in _SECONDS.items()}, f)
