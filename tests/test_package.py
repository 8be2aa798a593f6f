"""The package's shape and its one cost model, checked from outside.

The import contract itself is ``lint-imports`` (run by CI); here: no circle
in the module graph (type-only imports included), the library loads
without the application, every public name has one meaning, configurations are
checked however they are built, the cost model's readings agree with
each other and with the arrays ``init`` allocates, and the documents cite
data files that exist at a reader's length.
"""

import math
import subprocess
import sys

import grimp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import cost


def test_module_graph_has_no_circle_type_only_imports_included():
  graph = grimp.build_graph("zerojax", exclude_type_checking_imports=False)
  circles = [
    (a, b)
    for a in sorted(graph.modules)
    for b in graph.find_modules_directly_imported_by(a)
    if graph.find_shortest_chain(importer=b, imported=a)
  ]
  assert circles == []


def _fresh_python(code: str) -> subprocess.CompletedProcess:
  """``code`` run by a new interpreter with nothing imported yet."""
  return subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    check=True,
    env={"JAX_PLATFORMS": "cpu", "PATH": ""},
  )


def test_the_library_loads_without_the_application_or_its_dependencies():
  code = (
    "import sys, zerojax, zerojax.cost, zerojax.checkpoint, zerojax.nnx,"
    " zerojax.linen, zerojax.distributed, zerojax.launch, "
    "zerojax.xla_flags\n"
    "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
    "('tqdm', 'matplotlib') or m.startswith('zerojax.app') or m in "
    "('zerojax.train', 'zerojax.plan'))\n"
    "print(bad)"
  )
  out = _fresh_python(code)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_plain_jax_training_script_does_not_load_flax():
  """init, train_step and a step on a params dict import no Flax module:
  Flax and what it loads (IPython, treescope) would be host memory a
  plain-JAX user never asked for."""
  code = (
    "import os, sys\n"
    "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
    "import jax, jax.numpy as jnp, optax, zerojax\n"
    "mesh = jax.make_mesh((8,), ('data',))\n"
    "params = {'w': jnp.ones((8, 4)), 'b': jnp.zeros((4,))}\n"
    "loss = lambda p, b: jnp.mean((b @ p['w'] + p['b']) ** 2)\n"
    "for stage in (0, 3):\n"
    "  tx = zerojax.zero(optax.adam(1e-3), stage=stage, mesh=mesh)\n"
    "  state = zerojax.init(params, tx, copy=True)\n"
    "  state, m = zerojax.train_step(loss, tx)(state, jnp.ones((16, 8)))\n"
    "  jax.block_until_ready(m)\n"
    "print(sorted({m.split('.')[0] for m in sys.modules} & "
    "{'flax', 'orbax', 'treescope', 'IPython'}))\n"
  )
  out = _fresh_python(code)
  assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


PUBLIC = (
  "zerojax",
  "zerojax.aot",
  "zerojax.checkpoint",
  "zerojax.cost",
  "zerojax.diagnostics",
  "zerojax.distributed",
  "zerojax.errors",
  "zerojax.launch",
  "zerojax.layout",
  "zerojax.linen",
  "zerojax.nnx",
  "zerojax.xla_flags",
  "zerojax.plan",
  "zerojax.train",
)
# the Flax pair: one name per concept, one implementation per Flax API
FLAX_PAIR = {"zerojax.linen", "zerojax.nnx"}


def _public():
  import importlib

  return {m: importlib.import_module(m) for m in PUBLIC}


def test_the_root_namespace_holds_what_a_training_script_calls():
  assert len(zerojax.__all__) <= 25, sorted(zerojax.__all__)
  assert len(set(zerojax.__all__)) == len(zerojax.__all__)
  for name in (
    "zero",
    "init",
    "train_step",
    "gather",
    "remat",
    "make_mesh",
    "report",
    "ZeroState",
  ):
    assert name in zerojax.__all__


def test_every_public_name_has_one_meaning_and_is_not_renamed_at_import():
  """A name listed in two namespaces' ``__all__`` is one object (the Flax
  pair excepted: the same concept for Linen and for NNX); a function or
  class is exported under its own name; every listed name exists."""
  seen, problems = {}, []
  for mod_name, mod in _public().items():
    for name in mod.__all__:
      obj = getattr(mod, name)
      own = getattr(obj, "__name__", name)
      if callable(obj) and own != name:
        problems.append(f"{mod_name}.{name} is {own}")
      for other, other_obj in seen.get(name, []):
        if other_obj is not obj and {other, mod_name} != FLAX_PAIR:
          problems.append(f"{name}: {other} and {mod_name} differ")
      seen.setdefault(name, []).append((mod_name, obj))
  assert problems == []
  linen, nnx = zerojax.linen, zerojax.nnx
  assert sorted(linen.__all__) == sorted(nnx.__all__)


def test_no_public_namespace_shares_a_name_with_the_standard_library():
  names = {m.rsplit(".", 1)[-1] for m in PUBLIC} | {
    p.stem
    for p in __import__("pathlib")
    .Path(zerojax.__file__)
    .parent.glob("_src/*/*.py")
  }
  assert not names & set(sys.stdlib_module_names) - {"__init__"}


# --- following the state through one update ---------------------------------
def _data_path(fn, *args):
  """The zerojax functions the data passes through while ``fn`` traces, in
  the order they are first called: those with an argument that is the
  state, a weight source or a traced array (or a list, tuple or dict of
  them). Nested functions, lambdas and comprehensions count as their
  enclosing function."""
  order = []

  def holds_data(v, depth=0):
    if isinstance(v, (jax.core.Tracer, zerojax.ZeroState)):
      return True
    if depth < 2 and isinstance(v, (list, tuple)):
      return any(holds_data(x, depth + 1) for x in v)
    if depth < 2 and isinstance(v, dict):
      return any(holds_data(x, depth + 1) for x in v.values())
    return type(v).__name__ == "WeightSource"

  def profile(frame, event, arg):
    module = frame.f_globals.get("__name__", "")
    if event != "call" or not module.startswith("zerojax._src."):
      return
    name = frame.f_code.co_qualname.split(".<locals>")[0]
    if "__create_fn__" in name or name.startswith("<"):
      return
    code = frame.f_code
    n_args = code.co_argcount + code.co_kwonlyargcount
    if not any(
      holds_data(frame.f_locals.get(a)) for a in code.co_varnames[:n_args]
    ):
      return
    if (module, name) not in order:
      order.append((module, name))

  sys.setprofile(profile)
  try:
    fn(*args)
  finally:
    sys.setprofile(None)
  return order


def _module_visits(order):
  """The modules the path steps through, in order. A call into the records
  (``records/``: a leaf's layout, a tree's structure) reads data; it is
  not a step of the path, and records call nothing back."""
  visits = []
  for module, _ in order:
    if module.startswith("zerojax._src.records."):
      continue
    if not visits or visits[-1] != module:
      visits.append(module)
  return visits


def _engine_layers():
  """Folder -> rank in the contract's layers inside ``zerojax._src`` (the
  top layer ranks highest), read from ``pyproject.toml``."""
  import pathlib
  import tomllib

  root = pathlib.Path(__file__).resolve().parents[1]
  contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"][
    "importlinter"
  ]["contracts"]
  layers = next(
    c["layers"] for c in contracts if c.get("containers") == ["zerojax._src"]
  )
  return {
    folder.strip(): len(layers) - i
    for i, layer in enumerate(layers)
    for folder in layer.split("|")
  }


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_following_the_state_through_one_update_is_short(mesh, stage):
  """Reading ``update_state`` call by call, following the state's data:
  the modules visited in the order their functions are first called (at
  most 12), the moves back up the contract's layers (to a higher folder:
  at most 3) and, finer, to a module that imports the one just left; the
  records are only read on the way, by their own accessors."""
  from zerojax._src.step import update as _update

  tx = zerojax.zero(optax.adamw(1e-3), stage=stage, mesh=mesh)
  state = zerojax.init(_stack(), tx)
  grads = jax.tree.leaves(
    jax.tree.map(jnp.ones_like, zerojax.gather_params(state))
  )
  order = _data_path(
    lambda: jax.eval_shape(
      lambda s, g: _update.update_state(s, g, {}, "test"), state, grads
    )
  )
  visits = _module_visits(order)
  rank = _engine_layers()
  folder = lambda m: rank[m.split(".")[2]]
  layer_ups = [
    (a, b) for a, b in zip(visits, visits[1:]) if folder(b) > folder(a)
  ]
  graph = grimp.build_graph("zerojax")
  module_ups = [
    (a, b)
    for a, b in zip(visits, visits[1:])
    if graph.chain_exists(importer=b, imported=a)
  ]
  assert order[0] == ("zerojax._src.step.update", "update_state")
  records = [(m, n) for m, n in order if m.startswith("zerojax._src.records.")]
  assert all("." in n for _, n in records), records  # methods: accessors
  assert len(visits) <= 12, visits
  assert len(layer_ups) <= 3, layer_ups
  assert len(module_ups) <= 4, module_ups


def _stack(depth=4, width=64):
  return {
    "blocks": {
      "w": jnp.ones((depth, width, width)),
      "b": jnp.ones((depth, width)),
    }
  }


# --- configurations are checked however they are built ---------------------
def test_replace_refuses_what_zero_refuses(mesh):
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  with pytest.raises(ValueError, match="stage=7 is not a ZeRO stage"):
    tx.replace(stage=7)
  with pytest.raises(ValueError, match="bucket_bytes=0"):
    tx.replace(bucket_bytes=0)
  with pytest.raises(ValueError, match="replica_axis='nope'"):
    tx.replace(replica_axis="nope")
  with pytest.raises(ValueError, match="grad_bits=8.*stage 0"):
    tx.replace(stage=0, zeropp=zerojax.ZeroPP(grad_bits=8))
  assert tx.replace(stage=2).stage == 2


@pytest.mark.parametrize(
  "field, value",
  [
    ("bucket_bytes", 2**20),
    ("stacked", False),
    ("min_shard_size", 10**9),
    ("model_specs", lambda path, shape: jax.sharding.PartitionSpec()),
  ],
)
def test_a_state_from_another_tx_names_the_field_that_differs(
  mesh, field, value
):
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  state = zerojax.init(_stack(), tx)
  step = zerojax.train_step(
    lambda p, b: jnp.mean(p["blocks"]["w"]) * b.sum(),
    tx.replace(**{field: value}),
  )
  with pytest.raises(
    ValueError, match=rf"another ZeroTransformation \({field}"
  ):
    step(state, jnp.ones((8,)))


def test_a_state_from_a_tx_with_another_replica_axis_names_it():
  mesh = zerojax.make_mesh("replica=2,data=4")
  tx = zerojax.zero(optax.sgd(0.1), stage=1, mesh=mesh)
  assert tx.replica_axis == "replica"  # zero()'s default
  state = zerojax.init(_stack(), tx)
  step = zerojax.train_step(
    lambda p, b: jnp.mean(p["blocks"]["w"]) * b.sum(),
    tx.replace(replica_axis=None),
  )
  with pytest.raises(
    ValueError, match="replica_axis: state has 'replica', step has None"
  ):
    step(state, jnp.ones((8,)))


def test_planner_refuses_a_model_axis_that_does_not_divide_the_block(capsys):
  from zerojax.app import plan_cli

  with pytest.raises(SystemExit) as e:
    plan_cli.main(
      ["--width", "1536", "--depth", "2", "--mesh", "data=4,model=5"]
    )
  assert e.value.code == 2
  err = capsys.readouterr().err.splitlines()[-1]
  assert "MLP width 6144" in err and "width 1536" in err
  assert "model=4" in err and "vocab" not in err


def test_model_spec_error_names_the_dimension_not_the_vocabulary(mesh):
  m = zerojax.make_mesh("data=4,model=2")
  P = jax.sharding.PartitionSpec
  tx = zerojax.zero(
    optax.sgd(0.1), stage=1, mesh=m, model_specs={"w": P(None, "model")}
  )
  with pytest.raises(zerojax.errors.ModelSpecError) as e:
    zerojax.layout.make_spec(
      {"w": jax.ShapeDtypeStruct((8, 5), jnp.float32)}, tx
    )
  assert "e.g. 6" in str(e.value) and "vocabulary" not in str(e.value)


# --- one cost model ----------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_planner_report_theory_and_allocated_arrays_agree(mesh, stage):
  """Dimensions that divide the data axis and layer stacks only: the
  planner (as laid out), the report's theory (ideal) and the bytes init
  allocates are the same figures."""
  params = _stack()
  policy = zerojax.Policy(param_dtype=jnp.bfloat16)
  tx = zerojax.zero(optax.adam(1e-3), stage=stage, mesh=mesh, policy=policy)
  state = zerojax.init(params, tx)
  plan = cost.plan_stage(
    jax.eval_shape(lambda: params),
    stage,
    n_devices=8,
    optimizer=optax.adam(1e-3),
    policy=policy,
  )
  measured = zerojax.diagnostics.state_bytes(state)  # from the arrays
  theory = zerojax.diagnostics.theory_bytes(state)
  opt = sum(v for k, v in measured.items() if k.startswith("opt_state."))
  assert plan.params == measured["params"] == theory["params"]
  assert plan.master == measured["master"] == theory["master"]
  # the step count (a replicated scalar) is in the arrays and the plan;
  # the ideal reading also keeps it whole
  assert plan.optimizer == opt
  assert plan.optimizer == pytest.approx(
    sum(v for k, v in theory.items() if k.startswith("opt_state."))
  )
  assert plan.grads == theory["grads"]
  from zerojax._src.diagnostics import report

  ideal = report.theory_collectives(state)
  assert {k: v for k, v in plan.collectives.items()} == {
    k: v[1] for k, v in ideal.items()
  }


def test_zeropp_comm_equals_the_per_leaf_sum_on_one_node(mesh):
  """``zeropp_comm`` (from a parameter count) and the per-leaf cost model
  (every leaf, its blocks and scales) give the same wire bytes when the
  blocks divide the shards: one node, qwZ and qgZ int8."""
  params = {"blocks": {"w": jnp.ones((2, 128, 128))}}  # whole blocks
  n_params = sum(x.size for x in jax.tree.leaves(params))
  tx = zerojax.zero(
    optax.sgd(0.1), stage=3, mesh=mesh, zeropp=zerojax.ZeroPP(weight_bits=8)
  )
  spec = zerojax.layout.make_spec(jax.eval_shape(lambda: params), tx)
  from zerojax._src.diagnostics import cost as cost_model

  laid_out = cost_model.stage_collectives(spec, ideal=False)
  n = 8
  wire = sum(b for _, b in laid_out.values()) * (n - 1) / n
  formula = cost.zeropp_comm(n_params, n, 1, weight_bits=8, param_bytes=4)
  assert formula["slow_bytes"] == 0
  assert formula["fast_bytes"] == pytest.approx(wire, rel=1e-9)
  assert cost_model.wire_bytes_per_element(
    8, zerojax.ZeroPP(weight_bits=8).block
  ) == pytest.approx(1 + 4 / 256)


def test_laid_out_reading_counts_padding_the_ideal_one_does_not(mesh):
  params = {"w": jnp.ones((13, 7))}  # 13 rows over 8 devices: pad 16
  tx = zerojax.zero(optax.adam(1e-3), stage=3, mesh=mesh)
  spec = zerojax.layout.make_spec(jax.eval_shape(lambda: params), tx)
  from zerojax._src.diagnostics import cost as cost_model

  ideal = cost_model.stage_state_bytes(spec, ideal=True)
  laid = cost_model.stage_state_bytes(spec, ideal=False)
  assert ideal["params"] == 13 * 7 * 4 / 8
  layout = spec.leaves[0].param  # 7 padded to 8: (13, 1) a device
  assert layout.pad and laid["params"] == math.prod(layout.shard_shape(8)) * 4
  assert laid["params"] > ideal["params"]
  state = zerojax.init(params, tx)
  assert zerojax.diagnostics.state_bytes(state)["params"] == laid["params"]
  assert np.isclose(
    cost.plan_stage(
      jax.eval_shape(lambda: params),
      3,
      8,
      optimizer=optax.adam(1e-3),
      policy=zerojax.Policy(),
    ).params,
    laid["params"],
  )


def test_init_and_steps_leave_the_process_heap_alone_unless_asked(monkeypatch):
  """``malloc_trim`` acts on the whole process: ``init``, ``init_from`` and
  a step's first call never run it; ``zerojax.launch.release_free_heap``
  does, when the script asks."""
  from zerojax._src.runtime import host_heap

  calls = []
  monkeypatch.setattr(
    host_heap, "_malloc_trim", lambda: lambda n: calls.append(n) or 1
  )
  tx = zerojax.zero(optax.adamw(1e-3), stage=1)
  state = zerojax.init(_stack(), tx)
  zerojax.init_from(lambda k: _stack(), tx, jax.random.key(0))
  step = zerojax.train_step(
    lambda p, b: jnp.mean(p["blocks"]["w"]) * b.mean(), tx
  )
  for _ in range(2):
    state, _ = step(state, jnp.ones((8,)))
  assert calls == []
  assert zerojax.launch.release_free_heap() is True
  assert calls == [0]


def test_at_most_three_test_files_reach_inside_the_engine():
  """The suite tests what users call: only the architecture checks, the
  engine's unit tests and the loss audit's import ``zerojax._src``."""
  import ast
  import pathlib

  inside = []
  for f in sorted(pathlib.Path(__file__).parent.glob("*.py")):
    for n in ast.walk(ast.parse(f.read_text())):
      names = (
        [a.name for a in n.names]
        if isinstance(n, ast.Import)
        else [n.module or ""]
        if isinstance(n, ast.ImportFrom)
        else []
      )
      if any(m.startswith("zerojax._src") for m in names):
        inside.append(f.name)
        break
  assert inside == ["test_audit.py", "test_engine.py", "test_package.py"]


def test_the_engine_stays_readable():
  """No engine module over 500 lines, no function with more than 6
  positional parameters, and the records move no array and run no
  optimizer (``records/`` holds data; ``step/`` acts on it)."""
  import ast
  import pathlib

  src = pathlib.Path(zerojax.__file__).parent / "_src"
  long, wide, acting = [], [], []
  for f in sorted(src.rglob("*.py")):
    text = f.read_text()
    if len(text.splitlines()) > 500:
      long.append(f.name)
    for n in ast.walk(ast.parse(text)):
      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = n.args.posonlyargs + n.args.args
        k = len(args) - (args[:1] != [] and args[0].arg in ("self", "cls"))
        if k > 6:
          wide.append(f"{f.name}:{n.name}")
    if f.parent.name == "records":
      acting += [
        f"{f.name}: {w}"
        for w in ("device_put(", "apply_updates(", "zerojax._src.step")
        if w in text
      ]
  assert (long, wide, acting) == ([], [], [])


def test_flax_and_orbax_namespaces_load_on_first_use():
  code = (
    "import sys, zerojax\n"
    "before = {m.split('.')[0] for m in sys.modules} & {'flax', 'orbax'}\n"
    "zerojax.checkpoint.Checkpointer, zerojax.nnx.scan_layers\n"
    "after = {m.split('.')[0] for m in sys.modules} & {'flax', 'orbax'}\n"
    "print(sorted(before), sorted(after))"
  )
  out = _fresh_python(code)
  assert out.stdout.split("\n")[-2] == "[] ['flax', 'orbax']", out.stdout


def _repo_docs():
  """The documents a reader opens: the README, docs/, the experiments'
  table and the notebooks."""
  import pathlib

  root = pathlib.Path(__file__).parent.parent
  return root, [
    root / "README.md",
    *sorted((root / "docs").glob("*.md")),
    root / "experiments" / "README.md",
    *sorted((root / "notebooks").glob("*.ipynb")),
  ]


def _expand_braces(pattern: str) -> list[str]:
  """``a_{x,y}_b`` -> ``["a_x_b", "a_y_b"]``, nested left to right."""
  import re

  m = re.search(r"\{([^{}]*)\}", pattern)
  if m is None:
    return [pattern]
  head, tail = pattern[: m.start()], pattern[m.end() :]
  return [
    q
    for alt in m.group(1).split(",")
    for q in _expand_braces(head + alt + tail)
  ]


def test_every_data_file_cited_exists_and_every_data_file_is_cited():
  """Each ``docs/data/...`` a document names (a file, or a pattern with
  ``*`` and ``{a,b}``) matches a file there, and each file there is
  named by some document: a figure's source can be opened, and no data
  file outlives the text that used it."""
  import fnmatch
  import re

  root, docs = _repo_docs()
  files = sorted(p.name for p in (root / "docs" / "data").iterdir())
  cited, dangling = set(), []
  for doc in docs:
    for ref in re.findall(r"docs/data/[\w.*{},+-]+", doc.read_text()):
      ref = ref.rstrip(".,")[len("docs/data/") :]
      hits = {
        f
        for alt in _expand_braces(ref)
        for f in files
        if fnmatch.fnmatchcase(f, alt)
      }
      if not hits:
        dangling.append(f"{doc.name}: {ref}")
      cited |= hits
  assert dangling == []
  assert [f for f in files if f not in cited] == []


def test_every_script_a_document_names_exists():
  """Each ``experiments/...`` or ``tests/...`` file a document names is
  there to run."""
  import re

  root, docs = _repo_docs()
  missing = [
    f"{doc.name}: {ref}"
    for doc in docs
    for ref in re.findall(
      r"(?:experiments|tests)/[\w/]+\.(?:py|sh)", doc.read_text()
    )
    if not (root / ref).is_file()
  ]
  assert missing == []


def test_the_readme_results_and_benchmarks_stay_within_their_lengths():
  """The README at most 250 lines; docs/results.md at most 400 (current
  figures; the history of each is in git); at most 10 maintained
  benchmarks in experiments/ (one-off studies in experiments/studies/)."""
  root, _ = _repo_docs()
  lines = lambda name: len((root / name).read_text().splitlines())
  assert lines("README.md") <= 250
  assert lines("docs/results.md") <= 400
  assert len(list((root / "experiments").glob("*.py"))) <= 10
