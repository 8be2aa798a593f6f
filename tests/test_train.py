"""The main job and the reference GPT."""

import dataclasses
import functools
import json
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import checkpoint
from zerojax.app import data, gpt

TINY = [
  "--width",
  "32",
  "--depth",
  "2",
  "--heads",
  "2",
  "--seq-len",
  "32",
  "--batch",
  "16",
  "--steps",
  "30",
  "--eval-every",
  "15",
  "--log-every",
  "5",
  "--sample-len",
  "20",
  "--lr",
  "1e-2",
]


def _main_job(out, *flags):
  proc = subprocess.run(
    [sys.executable, "-m", "zerojax.train", *TINY, "--out", str(out), *flags],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


@pytest.fixture(scope="module")
def main_job_run(tmp_path_factory):
  """One run of the main job on TINY, shared by the tests that read it."""
  out = tmp_path_factory.mktemp("main_job") / "run"
  return out, _main_job(out, "--export-dir", str(out / "gpt2"))


def test_main_job_runs_and_writes_its_outputs(main_job_run):
  out, proc = main_job_run
  records = [
    json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()
  ]
  assert records[0] == {
    "step": 0,
    "eval_loss": pytest.approx(np.log(256), rel=0.05),
  }
  logged = [r for r in records if "loss" in r]
  assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30]
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in evals] == [0, 15, 30]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["last_eval_loss"] < summary["first_eval_loss"]
  assert summary["n_devices"] == 8 and summary["stage"] == 3
  assert (out / "loss.png").stat().st_size > 1000
  assert "sample:" in proc.stdout


def _event_scalars(directory) -> dict:
  """``{tag: [(step, value)]}`` from the TensorBoard event files (records:
  length, its CRC, the serialized Event, its CRC)."""
  import struct

  from tensorboardX.proto import event_pb2

  out = {}
  for f in sorted(directory.glob("events.out.tfevents.*")):
    data, at = f.read_bytes(), 0
    while at < len(data):
      (n,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event.FromString(data[at + 12 : at + 12 + n])
      at += 16 + n
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_main_job_writes_tensorboard_events_beside_its_metrics(main_job_run):
  """``tensorboard --logdir runs/`` shows what metrics.jsonl holds."""
  out, _ = main_job_run
  records = [
    json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()
  ]
  scalars = _event_scalars(out)
  for tag in ("loss", "eval_loss", "grad_norm", "lr"):
    want = [(r["step"], r[tag]) for r in records if tag in r]
    got = scalars[tag]
    assert [s for s, _ in got] == [s for s, _ in want], tag
    np.testing.assert_allclose(
      [v for _, v in got], [v for _, v in want], rtol=1e-6
    )


def test_main_job_fine_tunes_from_its_exported_gpt2(tmp_path, main_job_run):
  """--export-dir writes a GPT-2 checkpoint; --init-from it (the model's
  shape left automatic) starts where the exporting run ended: its first
  held-out loss is that run's last."""
  out, proc = main_job_run
  export = out / "gpt2"
  assert "exported a GPT-2 checkpoint" in proc.stdout
  assert json.loads((export / "config.json").read_text())["n_embd"] == 32
  assert checkpoint.safetensors_shapes(export)["lm_head.weight"].shape == (
    256,
    32,
  )
  auto = ["--width", "0", "--depth", "0", "--heads", "0", "--seq-len", "0"]
  tuned = _main_job(
    tmp_path / "ft", *auto, "--init-from", str(export), "--steps", "15"
  )
  assert "initialised from" in tuned.stdout
  first = json.loads((tmp_path / "ft" / "summary.json").read_text())
  before = json.loads((out / "summary.json").read_text())
  assert first["n_params"] == before["n_params"]
  assert first["first_eval_loss"] == pytest.approx(
    before["last_eval_loss"], rel=1e-6
  )


def test_main_job_rejects_a_checkpoint_its_flags_contradict(
  tmp_path, main_job_run
):
  export = main_job_run[0] / "gpt2"
  (tmp_path / "x.safetensors").write_bytes(b"not a checkpoint")
  for flags, message in [
    (["--width", "64"], "--width=64 but --init-from"),
    (["--init-from", str(tmp_path / "x.safetensors")], "cannot be read"),
  ]:
    proc = subprocess.run(
      [sys.executable, "-m", "zerojax.train", "--init-from", str(export)]
      + flags,
      capture_output=True,
      text=True,
      timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_main_job_checks_a_sized_mesh_before_it_knows_the_devices():
  """``--devices`` automatic (0): a ``--mesh`` that sizes every axis is
  checked when the flags are read (its model axis may carry
  ``--seq-shard``); one with a -1 size once the devices are known."""
  from zerojax.app import train_config

  config = lambda **kw: train_config.TrainConfig(**kw)
  assert (
    train_config.check(config(mesh="data=4,model=2", seq_shard="model")) == []
  )
  assert (
    train_config.check(config(mesh="data=-1,model=2", seq_shard="model")) == []
  )
  assert any(
    "--seq-shard=model is not a model axis of the mesh (data)" in p
    for p in train_config.check(config(mesh="data=8", seq_shard="model"))
  )
  assert any(
    "--batch=12 does not split over the 8 replica x data devices" in p
    for p in train_config.check(config(mesh="replica=2,data=4", batch=12))
  )


def test_main_job_samples_from_params_split_over_a_model_axis():
  """The main job's closing sample, from a stage-3 state on data=4,model=2
  (params split over the model axis): it runs (the forward sees the params
  whole, on one device) and writes the sample's bytes."""
  from zerojax.app import train
  from zerojax.app.train_config import TrainConfig

  config = TrainConfig(
    mesh="data=4,model=2",
    seq_shard="model",
    width=32,
    depth=2,
    heads=4,
    seq_len=32,
    sample_len=8,
  )
  model = gpt.GPTConfig(
    width=32, depth=2, heads=4, seq_len=32, seq_shard="model"
  )
  mesh = zerojax.make_mesh("data=4,model=2")
  tx, _ = train._optimizer(config, mesh)
  state = zerojax.init_from(lambda k: gpt.init(model, k), tx, jax.random.key(0))
  text = train._sample(config, model, state)
  assert text.startswith("The ") and len(text.encode("utf-8", "replace")) >= 4


def test_main_job_offload_flag_takes_a_share():
  from zerojax.app import train, train_config

  assert train_config.parse_args([]).offload == 0.0
  assert train_config.parse_args(["--offload"]).offload == 1.0
  assert train_config.parse_args(["--offload", "0.25"]).offload == 0.25
  config = train_config.parse_args(["--offload", "0.25", "--width", "32"])
  tx, _ = train._optimizer(
    dataclasses.replace(config, devices=8), zerojax.make_mesh("data=8")
  )
  assert tx.config.offload == 0.25
  # the params' shards go to the host with any share of the state, or none
  for share in ([], ["--offload", "0.5"]):
    config = train_config.parse_args(
      [*share, "--offload-params", "--width", "32"]
    )
    tx, _ = train._optimizer(
      dataclasses.replace(config, devices=8), zerojax.make_mesh("data=8")
    )
    assert tx.config.offload_params
    assert tx.config.offload == (0.5 if share else 0.0)


# the main job runs at both ends of the JAX window in the tests above; its
# offload flags here in the slow suite (test_offload*.py train them in-process)
@pytest.mark.slow
def test_main_job_with_gradients_and_params_on_the_host_logs_the_same_losses(
  tmp_path,
):
  """Behind the main job's global-norm clip, ``--offload --offload-grads``
  logs the same losses and grad norms as ``--offload``, to the bit. With
  ``--offload-params`` as well the layer stacks are laid out as stacks
  (``stacked=``: their layer axis never sharded), which sums the bf16
  gradients in another order: the same run to bf16 rounding (its bits
  with the same layout: tests/test_offload_grads.py). The flags reach
  ``zero``."""
  from zerojax.app import train, train_config

  config = train_config.parse_args(
    ["--offload", "--offload-params", "--offload-grads", "--width", "32"]
  )
  tx, _ = train._optimizer(
    dataclasses.replace(config, devices=8), zerojax.make_mesh("data=8")
  )
  assert tx.config.offload_params and tx.config.offload_grads
  runs = []
  for flags in (
    [],
    ["--offload-grads"],
    ["--offload-grads", "--offload-params"],
  ):
    out = tmp_path / "-".join(["run", *flags])
    _main_job(out, "--steps", "10", "--offload", *flags)
    rows = [
      json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()
    ]
    runs.append([(r["loss"], r["grad_norm"]) for r in rows if "grad_norm" in r])
  device, grads, params = runs
  assert device and grads == device
  np.testing.assert_allclose(np.asarray(params), np.asarray(device), rtol=1e-3)


BAD_FLAGS = [
  (["--batch", "12"], "--batch=12 does not split over --devices=8"),
  (["--stage", "5"], "invalid choice: 5"),
  (["--heads", "3"], "--heads=3 does not divide --width=128"),
  (["--precision", "fp8"], "invalid choice: 'fp8'"),
  (["--seq-shard", "model"], "--seq-shard=model is not a model axis"),
  (["--bucket-mb", "-1"], "--bucket-mb=-1.0 must be a finite number >= 0"),
  (["--bucket-mb", "inf"], "--bucket-mb=inf must be a finite number >= 0"),
  (["--lr=-1e-3"], "--lr=-0.001 must be a finite number above 0"),
  (
    ["--warmup", "-3", "--weight-decay", "nan"],
    "--weight-decay=nan must be a finite number >= 0; --warmup=-3 must be",
  ),
  (["--offload", "1.5"], "--offload=1.5 must be a share in [0, 1]"),
  (["--offload-grads"], "--offload-grads needs --stage 2 or 3 and --offload"),
  (
    ["--stage", "2", "--offload", "0.5", "--offload-params"],
    "--offload-params needs --stage 3 (got --stage 2)",
  ),
  (
    ["--offload", "0.5", "--offload-grads"],
    "--offload-grads needs --stage 2 or 3 and --offload (all of it)",
  ),
]

# every bad command line through ``python -m zerojax.train``'s own entry
# point, in one process (one JAX import instead of one per case)
_RUN_BAD_FLAGS = """
import contextlib, io, json, runpy, sys
out = []
for flags in json.loads(sys.argv[1]):
  sys.argv = ["zerojax.train", *flags]
  err, code = io.StringIO(), None
  with contextlib.redirect_stderr(err):
    try:
      runpy.run_module("zerojax.train", run_name="__main__", alter_sys=True)
    except SystemExit as e:
      code = e.code
  out.append([code, err.getvalue()])
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def bad_flag_runs():
  proc = subprocess.run(
    [
      sys.executable,
      "-c",
      _RUN_BAD_FLAGS,
      json.dumps([flags for flags, _ in BAD_FLAGS]),
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
  assert line, proc.stderr[-3000:]
  runs = json.loads(line[-1].split(" ", 1)[1])
  return {tuple(flags): tuple(run) for (flags, _), run in zip(BAD_FLAGS, runs)}


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_main_job_rejects_bad_flags_before_work(bad_flag_runs, flags, message):
  code, stderr = bad_flag_runs[tuple(flags)]
  assert code == 2 and message in stderr, stderr


def test_gpt_stage3_tracks_stage0_for_50_steps(mesh):
  """Same seed and data: bf16 loss curves of stage 3 and stage 0 agree."""
  model = gpt.GPTConfig(width=32, depth=2, heads=2, seq_len=32)
  tokens, _ = data.split(data.corpus_bytes())
  loss_fn = functools.partial(gpt.loss, config=model)
  curves = {}
  for stage in (0, 3):
    tx = zerojax.zero(
      optax.adamw(3e-3),
      stage=stage,
      mesh=mesh,
      policy=zerojax.Policy(param_dtype=jnp.bfloat16),
    )
    state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
    step = zerojax.train_step(loss_fn, tx)
    losses = []
    for i in range(50):
      state, metrics = step(
        state, data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=32)
      )
      losses.append(metrics["loss"])
    curves[stage] = np.array([float(l) for l in losses])
  assert curves[0][-1] < 0.8 * curves[0][0]  # it learns
  np.testing.assert_allclose(curves[3], curves[0], rtol=2e-2)


def test_gpt_gathers_per_layer_under_stage3(mesh):
  model = gpt.GPTConfig(width=32, depth=4, heads=2, seq_len=16)
  tx = zerojax.zero(optax.adamw(1e-3), stage=3, mesh=mesh)
  state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
  batch = data.batch_at(
    data.corpus_bytes(), seed=0, step=0, batch=8, seq_len=16
  )
  step = zerojax.train_step(
    functools.partial(gpt.loss, config=model), tx, gather="model"
  )
  colls = zerojax.diagnostics.collectives(
    step.lower(state, batch).compile().as_text(), 8
  )
  blocks = sum(
    np.prod(x.shape)
    for x in jax.tree.leaves(state.spec.params_avals()["blocks"])
  )
  per_loop = {}
  for c in colls:
    if c.kind == "all-gather" and c.count == model.depth:
      per_loop[c.computation] = (
        per_loop.get(c.computation, 0) + c.total_elements
      )
  # two loops gather layer by layer: the forward loop every block weight, the
  # backward loop again all it needs (XLA drops re-gathers of biases whose
  # value the backward pass does not use)
  forward, backward = sorted(per_loop.values(), reverse=True)
  assert forward == blocks
  assert backward >= 0.99 * blocks


def test_eval_step_matches_unsharded_loss(mesh):
  model = gpt.GPTConfig(width=32, depth=2, heads=2, seq_len=16)
  params = gpt.init(model, jax.random.key(0))
  batch = data.batch_at(
    data.corpus_bytes(), seed=0, step=0, batch=8, seq_len=16
  )
  want = float(gpt.loss(params, batch, model))
  for stage in (0, 3):
    tx = zerojax.zero(optax.sgd(0.1), stage=stage, mesh=mesh)
    state = zerojax.init(params, tx)
    got = float(
      zerojax.eval_step(functools.partial(gpt.loss, config=model), tx)(
        state, batch
      )
    )
    assert abs(got - want) < 1e-5


def test_gpt_init_is_one_program_and_init_from_builds_the_same_bits(mesh):
  """``gpt.init`` is one jitted program per config, and the params
  ``zerojax.init_from`` builds from it (tracing it inside its own
  program) are its eager values bit for bit."""
  model = gpt.GPTConfig(width=24, depth=3, heads=2, seq_len=12, vocab=40)
  key = jax.random.key(3)
  compiles = []

  def listen(event, secs, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(secs)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    eager = gpt.init(model, key)  # a config no other test builds
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert len(compiles) == 1, len(compiles)
  tx = zerojax.zero(
    optax.sgd(0.1), stage=3, mesh=mesh, stacked=gpt.is_layer_stack
  )
  built = zerojax.gather_params(
    zerojax.init_from(functools.partial(gpt.init, model), tx, key)
  )
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(built)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_generate_extends_the_prompt():
  model = gpt.GPTConfig(width=16, depth=1, heads=2, seq_len=16)
  params = gpt.init(model, jax.random.key(0))
  out = gpt.generate(params, jnp.array([1, 2, 3]), 5, jax.random.key(1), model)
  assert out.shape == (8,) and (out[:3] == jnp.array([1, 2, 3])).all()


def test_main_job_resumes_exactly(tmp_path, main_job_run):
  """Stopped after step 15 and resumed from its checkpoint, the main job
  ends where the run that never stopped (nor saved) ends: every logged
  loss and eval loss after the resume bitwise (JSON floats)."""
  ckpt = tmp_path / "ckpt"
  _main_job(tmp_path / "b", "--checkpoint-dir", str(ckpt), "--save-every", "15")
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == [
    "15",
    "30",
  ]
  import shutil

  shutil.rmtree(ckpt / "30")  # as if stopped after 15
  out = _main_job(tmp_path / "c", "--checkpoint-dir", str(ckpt), "--resume")
  assert "resumed from" in out.stdout and "at step 15" in out.stdout
  kept = ("step", "loss", "grad_norm", "lr", "eval_loss")  # not timings
  records = lambda d: [
    {k: r[k] for k in kept if k in r}
    for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
  ]
  after = lambda rs: [r for r in rs if r["step"] > 15]
  straight = after(records(main_job_run[0]))
  assert straight and after(records(tmp_path / "c")) == straight
  assert after(records(tmp_path / "b")) == straight  # saving changes nothing


def test_main_job_stops_when_the_loss_diverges_and_saves_nothing_after(
  tmp_path,
):
  """A learning rate of 1e4 sends the loss to NaN within a few steps: the
  job exits 1 naming the step and the flags, every checkpoint is of a step
  read finite and older than it, nothing is exported or sampled, and its
  files stay strict JSON."""
  out, ckpt = tmp_path / "run", tmp_path / "ckpt"
  proc = subprocess.run(
    [sys.executable, "-m", "zerojax.train", *TINY, "--out", str(out)]
    + ["--lr", "1e4", "--warmup", "0", "--clip", "1e9", "--save-every", "1"]
    + ["--checkpoint-dir", str(ckpt), "--export-dir", str(out / "gpt2")],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  strict = lambda text: json.loads(text, parse_constant=pytest.fail)
  summary = strict((out / "summary.json").read_text())
  at = summary["diverged_at"]
  assert 1 <= at <= summary["stopped_at"] < 30
  assert f"the run diverged: loss nan, grad_norm nan at step {at}" in (
    proc.stderr
  )
  assert "Lower --lr (now 10000)" in proc.stderr
  records = [
    strict(l) for l in (out / "metrics.jsonl").read_text().splitlines()
  ]
  assert records[-1]["step"] == at and records[-1]["loss"] is None
  saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  assert saved == list(range(1, at))[-3:]  # keep=3
  assert not (out / "gpt2").exists() and "sample:" not in proc.stdout
  # resumed at a lower rate: trains on, or, if the last step saved already
  # holds the diverging update, stops before running a step
  resumed = subprocess.run(
    [sys.executable, "-m", "zerojax.train", *TINY, "--out", str(out / "r")]
    + ["--checkpoint-dir", str(ckpt), "--resume"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  summary = strict((out / "r" / "summary.json").read_text())
  assert f"at step {saved[-1]}" in resumed.stdout
  if resumed.returncode == 1:
    assert summary["diverged_at"] == summary["stopped_at"] == saved[-1]
    assert f"eval_loss nan at step {saved[-1]}" in resumed.stderr
  else:
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary["diverged_at"] is None and summary["stopped_at"] == 30


def test_unrolled_scan_gathers_the_next_layer_in_the_same_iteration(mesh):
  """scan_unroll=2: the loop runs depth/2 times and gathers two layers per
  iteration, the structure that lets XLA prefetch layer i+1 (docs/flax.md)."""
  model = gpt.GPTConfig(width=32, depth=4, heads=2, seq_len=16, scan_unroll=2)
  tx = zerojax.zero(optax.adamw(1e-3), stage=3, mesh=mesh)
  state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
  batch = data.batch_at(
    data.corpus_bytes(), seed=0, step=0, batch=8, seq_len=16
  )
  step = zerojax.train_step(
    functools.partial(gpt.loss, config=model), tx, gather="model"
  )
  text = step.lower(state, batch).compile().as_text()
  colls = zerojax.diagnostics.collectives(text, 8)
  in_loops = [c for c in colls if c.kind == "all-gather" and c.count > 1]
  assert {c.count for c in in_loops} == {2}  # depth / unroll
  blocks = state.spec.params_avals()["blocks"]
  per_layer = len(jax.tree.leaves(blocks))
  counts = {
    name: sum(1 for c in in_loops if c.computation == name)
    for name in {c.computation for c in in_loops}
  }
  name = max(counts, key=counts.get)  # the forward loop
  assert counts[name] == 2 * per_layer  # two layers' gathers
  # in the compiled schedule both layers' gathers run back to back, ahead
  # of the layers' compute
  start = text.index("%" + name + " ")
  body = text[start : text.index("\n}", start)]
  import re

  ops = [
    o
    for o in re.findall(r"= \S+ ([a-z\-]+)\(", body)
    if o in ("all-gather", "fusion", "dot")
  ]
  first, last = (
    ops.index("all-gather"),
    len(ops) - ops[::-1].index("all-gather"),
  )
  assert ops[first:last] == ["all-gather"] * (2 * per_layer)


def test_gpt_dropout_is_the_same_run_at_stage3_and_stage0(mesh):
  """fp32 GPT with dropout: the keys depend on step, device and micro-batch,
  never on the stage, so stages 0 and 3 train the same model."""
  model = gpt.GPTConfig(width=32, depth=2, heads=2, seq_len=16, dropout=0.2)
  tokens, _ = data.split(data.corpus_bytes())
  loss_fn = functools.partial(gpt.loss, config=model)
  out = {}
  for stage in (0, 3):
    tx = zerojax.zero(optax.adamw(3e-3), stage=stage, mesh=mesh)
    state = zerojax.init(
      gpt.init(model, jax.random.key(0)), tx, key=jax.random.key(5)
    )
    step = zerojax.train_step(loss_fn, tx)
    for i in range(3):
      state, metrics = step(
        state, data.batch_at(tokens, seed=0, step=i, batch=16, seq_len=16)
      )
    out[stage] = (zerojax.gather_params(state), float(metrics["loss"]))
  np.testing.assert_allclose(out[3][1], out[0][1], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(out[3][0]), jax.tree.leaves(out[0][0])):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    # per-leaf relative error; the key bias gets a zero gradient in exact
    # arithmetic (softmax shift invariance), so it is float noise: 1e-4 at
    # stage 3 vs 0 without dropout too. A different mask would be O(1).
    assert np.linalg.norm(a - b) <= 5e-4 * np.linalg.norm(b)
  # and dropout is on: without the key the loss differs
  tx = zerojax.zero(optax.adamw(3e-3), stage=0, mesh=mesh)
  plain = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
  _, m = zerojax.train_step(loss_fn, tx)(
    plain, data.batch_at(tokens, seed=0, step=0, batch=16, seq_len=16)
  )
  assert float(m["loss"]) != pytest.approx(out[0][1], rel=1e-3)


@pytest.mark.slow
def test_main_job_with_dropout(tmp_path):
  out = tmp_path / "run"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "zerojax.train",
      *TINY,
      "--dropout",
      "0.1",
      "--out",
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["config"]["dropout"] == 0.1
  assert summary["last_eval_loss"] < summary["first_eval_loss"]


@pytest.mark.parametrize(
  "dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)]
)
def test_dot_product_attention_matches_the_einsum_reference(dtype, tol):
  """jax.nn.dot_product_attention (XLA's implementation on CPU; cuDNN's on
  GPU) gives the reference attention's numbers."""
  k = jax.random.split(jax.random.key(5), 3)
  q, kk, v = (jax.random.normal(x, (2, 16, 4, 8)).astype(dtype) for x in k)
  want = gpt.attend(q, kk, v, "einsum").astype(jnp.float32)
  got = gpt.attend(q, kk, v, "xla").astype(jnp.float32)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_remat_policies_and_attention_kernels_give_the_same_gradients():
  batch = data.batch_at(
    data.corpus_bytes(), seed=0, step=0, batch=4, seq_len=16
  )
  base = gpt.GPTConfig(
    width=32, depth=2, heads=2, seq_len=16, attention="einsum", remat="full"
  )
  params = gpt.init(base, jax.random.key(0))
  want_l, want_g = jax.value_and_grad(gpt.loss)(params, batch, base)
  for attention, remat in (
    ("einsum", "dots"),
    ("einsum", "none"),
    ("xla", "full"),
    ("xla", "dots"),
  ):
    config = gpt.GPTConfig(
      width=32, depth=2, heads=2, seq_len=16, attention=attention, remat=remat
    )
    l, g = jax.value_and_grad(gpt.loss)(params, batch, config)
    np.testing.assert_allclose(l, want_l, rtol=1e-5)
    chex.assert_trees_all_close(g, want_g, rtol=2e-4, atol=1e-6)
  with pytest.raises(ValueError, match="remat='some'"):
    gpt.GPTConfig(remat="some")
  assert gpt.GPTConfig().resolved("gpu").attention == "cudnn"
  assert gpt.GPTConfig().resolved("gpu").remat == "dots"
  assert gpt.GPTConfig().resolved("cpu").attention == "einsum"


def test_gpt_fast_kernels_stay_lean_and_exact_at_stage3(mesh):
  """dot_product_attention + the dots-saveable policy (the GPU defaults)
  under ZeRO-3: per-layer gathers only (gather='model'), Optax's numbers."""
  model = gpt.GPTConfig(
    width=32, depth=2, heads=2, seq_len=16, attention="xla", remat="dots"
  )
  batches = [
    data.batch_at(data.corpus_bytes(), seed=0, step=i, batch=8, seq_len=16)
    for i in range(2)
  ]
  params, opt = gpt.init(model, jax.random.key(0)), optax.sgd(0.5)
  opt_state = opt.init(params)
  for b in batches:
    g = jax.grad(gpt.loss)(params, b, model)
    u, opt_state = opt.update(g, opt_state, params)
    params = optax.apply_updates(params, u)
  tx = zerojax.zero(optax.sgd(0.5), stage=3, mesh=mesh)
  state = zerojax.init(gpt.init(model, jax.random.key(0)), tx)
  step = zerojax.train_step(
    functools.partial(gpt.loss, config=model), tx, gather="model"
  )
  for b in batches:
    state, _ = step(state, b)
  got = zerojax.gather_params(state)
  chex.assert_trees_all_close(got, params, rtol=1e-4, atol=1e-6)


def test_mfu_from_the_peak_table():
  from zerojax.app import mfu as hardware

  class Dev:
    device_kind = "NVIDIA H100 80GB HBM3"

  assert hardware.peak_flops(Dev()) == pytest.approx(989.4e12)
  assert hardware.mfu(1000.0, 1e9, [Dev()]) == pytest.approx(1e12 / 989.4e12)
  assert hardware.mfu(1000.0, 1e9, jax.devices()[:1]) is None  # a CPU
