"""A pytest plugin that runs Optax's own test modules through the drop-in.

Loaded with ``-p tests.optax_dropin`` next to ``--pyargs
optax._src.alias_test optax.contrib._common_test`` (both ship in the
Optax wheel). Every optimizer those tests build from ``alias`` or
``contrib`` comes back as ``zerojax.zero(opt, stage=S, mesh=...,
min_shard_size=M)``; a contrib wrapper (``mechanize``, ``schedule_free``)
wraps the inner Optax optimizer and is then wrapped itself. Optax's
assertions run unchanged, each test under ``jax.set_mesh(mesh)``: how the
README tells drop-in users to create their params, so that they start on
the mesh the updates come back on (one compile).

Optax's sharding-in-types tests (``optax._src.sharding_test``) build their
optimizers at import, from ``optax``'s top level, on a mesh of one
Explicit axis ``x``: with ``ZEROJAX_CONFORMANCE_AXIS=x`` the plugin wraps
those factories before the module is imported (the data axis named ``x``,
the mesh the tests build), and lifts the tests' string comparisons of
``jax.__version__`` (``'0.12.0' < '0.7.2'`` is true, so they would skip on
every JAX zerojax supports) for that module alone.

Environment:
  ZEROJAX_CONFORMANCE_STAGE: 0, 1 or 2; unset runs plain Optax (baseline).
  ZEROJAX_CONFORMANCE_AXIS_TYPES: ``explicit`` (default, as
    ``jax.make_mesh``) or ``auto``: the mesh's axis types.
  ZEROJAX_CONFORMANCE_AXIS: the data axis' name; ``x`` also wraps
    ``optax``'s top-level factories (for ``sharding_test``).
  ZEROJAX_CONFORMANCE_MIN_SHARD_SIZE: ``min_shard_size`` (default 0: every
    non-scalar leaf sharded).
  ZEROJAX_CONFORMANCE_REPORT: a path; each test's outcome is written there
    as JSON lines ``{"id", "outcome", "error"}``.
  ZEROJAX_CONFORMANCE_HALF: ``1`` runs the half of the collected tests
    whose node id hashes even (crc32; the same half every run), as CI's
    newest-JAX leg does with the suite's own matrices.
"""

import functools
import json
import os
import zlib

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import zerojax  # noqa: E402

_STAGE = os.environ.get("ZEROJAX_CONFORMANCE_STAGE")
_MIN_SHARD = int(os.environ.get("ZEROJAX_CONFORMANCE_MIN_SHARD_SIZE", "0"))
_REPORT = os.environ.get("ZEROJAX_CONFORMANCE_REPORT")
_AXIS = os.environ.get("ZEROJAX_CONFORMANCE_AXIS", "data")
_HALF = os.environ.get("ZEROJAX_CONFORMANCE_HALF") == "1"


@functools.cache
def _mesh():
  types = os.environ.get("ZEROJAX_CONFORMANCE_AXIS_TYPES", "explicit")
  return zerojax.make_mesh(
    axis_name=_AXIS,
    axis_types={
      "explicit": jax.sharding.AxisType.Explicit,
      "auto": jax.sharding.AxisType.Auto,
    }[types],
  )


def _unwrap(x):
  return x.inner if isinstance(x, zerojax.ZeroTransformation) else x


def _wrap(x):
  if (
    _STAGE is None
    or not isinstance(x, optax.GradientTransformation)
    or isinstance(x, zerojax.ZeroTransformation)
  ):
    return x
  return zerojax.zero(
    x,
    stage=int(_STAGE),
    mesh=_mesh(),
    axis_name=_AXIS,
    min_shard_size=_MIN_SHARD,
  )


class _Factories:
  """A module whose optimizer factories return zerojax drop-ins."""

  def __init__(self, module):
    self._module = module

  def __getattr__(self, name):
    f = getattr(self._module, name)
    if not callable(f) or isinstance(f, type):
      return f

    @functools.wraps(f)
    def factory(*args, **kwargs):
      args = [_unwrap(a) for a in args]
      kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
      return _wrap(f(*args, **kwargs))

    return factory


class _JaxOfToday:
  """``jax`` as a test module sees it, its version string comparing as
  newer than any version a test guards on."""

  class _Version(str):
    def __lt__(self, other):
      return False

  def __init__(self, module):
    self._module = module
    self.__version__ = self._Version(module.__version__)

  def __getattr__(self, name):
    return getattr(self._module, name)


if _AXIS != "data":
  # sharding_test builds its optimizers at import: wrap optax's top-level
  # factories before it is collected
  for _name in dir(optax):
    _f = getattr(optax, _name)
    if (
      callable(_f)
      and not isinstance(_f, type)
      and _name[0].islower()
      and getattr(_f, "__module__", "").startswith("optax._src.alias")
    ):
      setattr(optax, _name, _Factories(optax).__getattr__(_name))


def pytest_collection_modifyitems(session, config, items):
  del session
  if _HALF:
    dropped = [i for i in items if zlib.crc32(i.nodeid.encode()) % 2]
    items[:] = [i for i in items if not zlib.crc32(i.nodeid.encode()) % 2]
    config.hook.pytest_deselected(items=dropped)
  for module in {item.module for item in items if hasattr(item, "module")}:
    if _AXIS != "data" and getattr(module, "jax", None) is jax:
      module.jax = _JaxOfToday(jax)
    for name in ("alias", "contrib"):
      target = getattr(module, name, None)
      if target is not None and not isinstance(target, _Factories):
        setattr(module, name, _Factories(target))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  del item
  with jax.set_mesh(_mesh()):
    return (yield)


_IS_XDIST_WORKER = False


def pytest_configure(config):
  # an xdist worker's config carries ``workerinput``; the environment
  # variable would also be set when this pytest itself runs inside an
  # outer xdist worker, so it cannot tell the two apart
  global _IS_XDIST_WORKER
  _IS_XDIST_WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
  # under pytest-xdist the controller sees every worker's reports: it
  # alone writes them (once each)
  if _IS_XDIST_WORKER:
    return
  if not _REPORT or (report.when != "call" and report.outcome == "passed"):
    return
  if report.when == "teardown" and report.outcome != "failed":
    return
  error = ""
  if report.failed:
    error = str(
      getattr(report.longrepr, "reprcrash", None)
      and report.longrepr.reprcrash.message
      or report.longrepr
    )[:500]
  with open(_REPORT, "a") as f:
    f.write(
      json.dumps(
        {"id": report.nodeid, "outcome": report.outcome, "error": error}
      )
      + "\n"
    )
