"""The planner reproduces the ZeRO paper's figures from zerojax's layouts."""

import json
import re
import subprocess
import sys

import optax
import pytest

from zerojax import cost, plan
from zerojax.app import gpt


def test_paper_example_7_5b_on_64_devices():
  """ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12 (mixed-precision Adam)."""
  config = gpt.config_for_params(7.5e9)
  assert abs(gpt.num_params(config) - 7.5e9) < 1e4
  totals = [
    plan.plan_gpt(plan.abstract_gpt(config), s, 64).total / 1e9
    for s in range(4)
  ]
  assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_paper_table1_1t_on_1024_devices():
  config = gpt.config_for_params(1e12)
  p = plan.plan_gpt(plan.abstract_gpt(config), 3, 1024)
  assert round(p.total / 1e9, 1) == 15.6
  # communication: stage 3 all-gathers 2Ψ and reduce-scatters Ψ (bf16)
  assert p.collectives["reduce-scatter"] == pytest.approx(2e12, rel=1e-3)
  assert p.collectives["all-gather"] == pytest.approx(4e12, rel=1e-3)


def test_padding_is_counted():
  """A width that does not divide N pads, and the plan says so."""
  odd = gpt.GPTConfig(vocab=1000, seq_len=64, width=96, depth=2, heads=2)
  p = plan.plan_gpt(plan.abstract_gpt(odd), 3, 64)
  n = gpt.num_params(odd)
  assert p.total > 16 * n / 64


def test_largest_fitting_model_is_monotone_in_stage():
  sizes = [gpt.num_params(plan.largest_fitting(32e9, s, 64)) for s in range(4)]
  assert sizes == sorted(sizes)
  assert sizes[0] == pytest.approx(2e9, rel=0.01)  # 16 bytes per param
  assert sizes[3] == pytest.approx(128e9, rel=0.01)  # 16/64 bytes per param


def test_cli_json_and_errors():
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "zerojax.plan",
      "--params",
      "7.5e9",
      "--devices",
      "64",
      "--json",
    ],
    capture_output=True,
    text=True,
    check=True,
  )
  data = json.loads(out.stdout)
  assert round(data["plans"][1]["total"] / 1e9, 1) == 31.4
  bad = subprocess.run(
    [sys.executable, "-m", "zerojax.plan", "--devices", "8"],
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 2 and "--params or --width" in bad.stderr


def test_hsdp_70b_on_4_slices_keeps_state_traffic_off_dcn():
  """70B, 4 slices x 256 chips: flat ZeRO-3 over 1024 against HSDP."""
  config = gpt.config_for_params(70e9)
  abstract = plan.abstract_gpt(config)
  flat = plan.plan_gpt(abstract, 3, mesh={"data": 1024})
  hsdp = plan.plan_gpt(abstract, 3, mesh={"replica": 4, "data": 256})
  psi = gpt.num_params(config)
  # memory: 16Ψ/N with N the data axis
  assert flat.total == pytest.approx(16 * psi / 1024, rel=0.01)
  assert hsdp.total == pytest.approx(16 * psi / 256, rel=0.01)
  # the replica all-reduce is the bf16 shard: 2Ψ/256 bytes
  assert hsdp.collectives["all-reduce over replica"] == pytest.approx(
    2 * psi / 256, rel=1e-3
  )
  f = cost.comm_time(flat, slices=4)
  h = cost.comm_time(hsdp, slices=4)
  # hierarchical: flat moves 3 x 2Ψ x 3/4 / 256 per chip over DCN, HSDP
  # only the all-reduce, 2 x 2Ψ x 3/4 / 256
  assert f["data"]["slow_bytes"] == pytest.approx(
    3 * 2 * psi * 0.75 / 256, rel=1e-3
  )
  assert h["data"]["slow_bytes"] == 0
  assert h["replica"]["slow_bytes"] == pytest.approx(
    2 * 2 * psi * 0.75 / 256, rel=1e-3
  )
  # a flat ring across slices: every byte of the ring crosses DCN
  ring = cost.comm_time(flat, slices=4, algorithm="ring")
  assert ring["data"]["slow_bytes"] == pytest.approx(
    3 * 2 * psi * 1023 / 1024, rel=1e-3
  )
  assert ring["data"]["seconds"] > 20 * h["replica"]["seconds"]


def test_tensor_parallel_mesh_divides_state_by_the_model_axis():
  config = gpt.GPTConfig(vocab=512, seq_len=64, width=256, depth=2, heads=4)
  abstract = plan.abstract_gpt(config)
  dp = plan.plan_gpt(abstract, 3, mesh={"data": 8})
  tp = plan.plan_gpt(abstract, 3, mesh={"data": 8, "model": 4})
  # every GPT leaf but the norms, biases of width D and positions is split
  assert tp.total < dp.total / 3
  assert tp.collectives["all-gather"] < dp.collectives["all-gather"] / 3


def test_cli_mesh_prints_the_communication_table():
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "zerojax.plan",
      "--params",
      "70e9",
      "--mesh",
      "replica=4,data=256",
    ],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  assert "DCN 6e+09 B/s per chip" in out
  assert [l for l in out.splitlines() if "replica |" in l]
  bad = subprocess.run(
    [
      sys.executable,
      "-m",
      "zerojax.plan",
      "--params",
      "1e9",
      "--mesh",
      "model=8",
    ],
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 2 and "no data axis" in bad.stderr


def test_offload_moves_master_and_moments_to_host():
  """ZeRO-Offload's split, 7.5B on 64 devices: device keeps bf16 params and
  gradients (their stage's share) and, during the update, the streamed
  chunks of master + moments; the host 12 Ψ / N (fp32 master + moments)."""
  abstract = plan.abstract_gpt(gpt.config_for_params(7.5e9))
  for s in range(4):
    on = plan.plan_gpt(abstract, s, 64)
    off = plan.plan_gpt(abstract, s, 64, offload=True)
    assert off.total == on.total and on.host == 0 and on.device == on.total
    assert off.host == pytest.approx(on.master + on.optimizer)
    assert off.device == pytest.approx(
      on.params + on.grads + off.update_transient
    )
    # a chunk old and new, and the next one prefetched only within twice
    # the largest chunk: the largest chunk old and new sets the figure
    assert off.update_transient == pytest.approx(
      min(off.in_flight_fraction, 1) * off.host
    )
    assert off.in_flight_fraction == pytest.approx(2 * off.chunk_fraction)
    assert off.host_traffic == 2 * off.host
  s3 = plan.plan_gpt(abstract, 3, 64, offload=True)
  assert s3.host / 1e9 == pytest.approx(12 * 7.5 / 64, rel=1e-3)
  # the update streams chunks of at most 1/16 of the state: the GPT's
  # largest leaves, its layer stacks, a few layers per chunk (whole, the
  # MLP matrix alone would be 4 D^2 of the ~12 D^2 per layer)
  assert 0.05 < s3.chunk_fraction <= 1 / 16
  assert s3.device / 1e9 == pytest.approx(
    (4 + 12 * s3.in_flight_fraction) * 7.5 / 64, rel=1e-3
  )
  # the params' shards on the host too: written back once, and read once
  # per layer loop for a layer stack (forward, backward), once otherwise
  kw = dict(offload=True, stacked=gpt.is_layer_stack)
  st = plan.plan_gpt(abstract, 3, 64, **kw)
  pp = plan.plan_gpt(abstract, 3, 64, offload_params=True, **kw)
  # (the stacks of vectors, biases and norm scales, stay on the device)
  assert 0.999 * st.params < pp.params_host < st.params
  assert pp.host_bytes == st.host
  assert 0.9 * pp.params_host < pp.params_host_stacked < pp.params_host
  assert pp.device_to_host == pp.host == st.host + pp.params_host
  assert pp.host_to_device == pp.device_to_host + pp.params_host_stacked
  # the largest model a device holds grows with offload
  on_big = plan.largest_fitting(32e9, 3, 64)
  big = plan.largest_fitting(32e9, 3, 64, offload=True)
  assert gpt.num_params(big) > 1.3 * gpt.num_params(on_big)


# the planner's CLI runs at both ends of the JAX window in
# test_cli_stages_reports_only_the_stages_asked; these two in the slow suite
@pytest.mark.slow
def test_cli_names_the_least_offload_share_that_fits():
  """``--memory-gb 40 --offload``: a 3B GPT on one device fits only with
  most of its master copy and moments on the host; the share named fits,
  and so does the model at that share through zero()."""
  argv = ["--params", "3e9", "--devices", "1", "--memory-gb", "40"]
  out = subprocess.run(
    [sys.executable, "-m", "zerojax.plan", *argv, "--offload", "--json"],
    capture_output=True,
    text=True,
    check=True,
  )
  data = json.loads(out.stdout)
  needed = {int(k): v for k, v in data["offload_needed"].items()}
  config = gpt.GPTConfig(**data["config"])
  abstract = plan.abstract_gpt(config)
  for s, share in needed.items():
    assert 0 < share < 1, needed
    assert plan.plan_gpt(abstract, s, 1, offload=share).device <= 40e9
    assert plan.plan_gpt(abstract, s, 1).device > 40e9
  text = subprocess.run(
    [sys.executable, "-m", "zerojax.plan", *argv, "--offload", "0.5"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  assert f"stage 3: {needed[3]:.3f}" in text
  bad = subprocess.run(
    [sys.executable, "-m", "zerojax.plan", *argv, "--offload", "2"],
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 2 and "share in [0, 1]" in bad.stderr


def _fits_at_least_share(config, device, host, mesh):
  """The least offload share the device needs for ``config`` (stage 3,
  params on the host), and whether its host part then fits ``host``."""
  share = cost.offload_fraction_needed(
    plan.abstract_gpt(config),
    3,
    device,
    mesh=mesh,
    offload_params=True,
    stacked=gpt.is_layer_stack,
  )
  if share is None:
    return None, False
  x = plan.plan_gpt(
    plan.abstract_gpt(config),
    3,
    mesh=mesh,
    offload=share,
    offload_params=True,
  )
  assert x.device <= device
  return share, x.host <= host


def test_largest_fitting_offloaded_model_is_bounded_by_host_memory_too():
  """With the params on the host at stage 3, 110 GB of pinned host memory
  bounds the model a 141 GB device trains: the largest GPT found fits
  both at the least offload share the device needs, a 2% larger one does
  not, and without the host bound the answer is several times larger."""
  kw = dict(offload=True, offload_params=True)
  device_only = plan.largest_fitting(141e9, 3, 1, **kw)
  both = plan.largest_fitting(141e9, 3, 1, **kw, host_memory_bytes=110e9)
  n = gpt.num_params(both)
  assert gpt.num_params(device_only) > 2 * n
  share, on_host = _fits_at_least_share(both, 141e9, 110e9, {"data": 1})
  assert on_host and 0 < share < 1
  bigger = gpt.config_for_params(1.02 * n, seq_len=both.seq_len)
  assert not _fits_at_least_share(bigger, 141e9, 110e9, {"data": 1})[1]


def test_what_binds_the_largest_offloaded_gpt_is_the_gradients_or_the_host():
  """Stage 3 with the params and state on the host: on one 141 GB device
  with no host bound the GPT just past the largest overflows the device,
  most of it the bf16 gradients the device keeps (2 bytes per param: so
  with them there bf16 params never exceed the device's memory), and its
  device parts
  sum to the plan's device bytes; with 110 GB of host memory it is the
  host that overflows."""
  kw = dict(offload=True, offload_params=True)
  largest = plan.largest_fitting(141e9, 3, 1, **kw)
  b = plan.what_binds(largest, 141e9, 3, 1, **kw)
  assert b["memory"] == "device"
  parts = b["device_parts"]
  assert max(parts, key=parts.get) == "gradients"
  assert parts["gradients"] == pytest.approx(2 * b["n_params"], rel=1e-3)
  assert 2 * gpt.num_params(largest) < 141e9 < sum(parts.values())
  bigger = gpt.config_for_params(b["n_params"], seq_len=largest.seq_len)
  x = plan.plan_gpt(plan.abstract_gpt(bigger), 3, 1, **kw)
  assert sum(parts.values()) == pytest.approx(x.device)
  bounded = plan.largest_fitting(141e9, 3, 1, **kw, host_memory_bytes=110e9)
  h = plan.what_binds(bounded, 141e9, 3, 1, **kw, host_memory_bytes=110e9)
  assert h["memory"] == "host" and h["host"] > 110e9
  assert sum(h["device_parts"].values()) <= 141e9


def test_with_the_gradients_on_the_host_bf16_params_exceed_the_device():
  """Stage 3 with the params, state and gradients on the host: on one
  141 GB device the largest GPT's bf16 params exceed the device's memory
  (twice the largest with the gradients on the device, whose bound they
  were); what stops a larger one is the streamed update's chunks, and the
  host holds 16 bytes per parameter."""
  kw = dict(offload=True, offload_params=True)
  on_device = plan.largest_fitting(141e9, 3, 1, **kw)
  largest = plan.largest_fitting(141e9, 3, 1, **kw, offload_grads=True)
  n = gpt.num_params(largest)
  assert 2 * n > 141e9 and n > 1.9 * gpt.num_params(on_device)
  b = plan.what_binds(largest, 141e9, 3, 1, **kw, offload_grads=True)
  parts = b["device_parts"]
  assert b["memory"] == "device"
  assert max(parts, key=parts.get) == "update chunks"
  assert parts["gradients"] < 1e-3 * parts["update chunks"]
  assert b["host"] == pytest.approx(16 * b["n_params"], rel=1e-3)
  bad = subprocess.run(
    [sys.executable, "-m", "zerojax.plan", "--params", "7e9"]
    + ["--devices", "1", "--offload", "0.5", "--offload-grads"],
    capture_output=True,
    text=True,
  )
  assert bad.returncode != 0 and "--offload-grads" in bad.stderr


def test_the_gpt_planner_plans_the_main_jobs_clip_so_gradients_come_down_twice():
  """``zerojax.plan`` plans the main job's optimizer (global-norm clip, then
  AdamW): with the gradients on the host the norm reads each gradient
  once before the chunks read it again, so the host-to-device bytes count
  them twice, where a plain AdamW (``cost.plan_stage``'s default) reads
  them once. The state and the bytes back are the same."""
  out = subprocess.run(
    [sys.executable, "-m", "zerojax.plan", "--width", "256", "--depth", "2"]
    + ["--vocab", "512", "--devices", "1", "--offload", "--offload-params"]
    + ["--offload-grads", "--json"],
    capture_output=True,
    text=True,
    check=True,
  )
  data = json.loads(out.stdout)
  abstract = plan.abstract_gpt(gpt.GPTConfig(**data["config"]))
  kw = dict(offload=True, offload_params=True, offload_grads=True)
  main_job = plan.plan_gpt(abstract, 3, 1, **kw)
  plain = plan.plan_gpt(abstract, 3, 1, optimizer=optax.adamw(1e-4), **kw)
  library = cost.plan_stage(abstract, 3, 1, stacked=gpt.is_layer_stack, **kw)
  assert main_job.norm_first and not plain.norm_first
  assert library.host_to_device == plain.host_to_device
  assert main_job.grads_host == plain.grads_host > 0
  assert main_job.host_to_device == pytest.approx(
    plain.host_to_device + plain.grads_host, abs=8
  )
  assert main_job.device_to_host == pytest.approx(plain.device_to_host, abs=8)
  s3 = data["plans"][3]
  assert s3["norm_first"] and s3["host_to_device"] == main_job.host_to_device


@pytest.mark.slow
def test_cli_host_memory_bound_names_itself_and_needs_offload():
  argv = ["--params", "7e9", "--devices", "1", "--memory-gb", "141"]
  run = lambda *extra: subprocess.run(
    [sys.executable, "-m", "zerojax.plan", *argv, *extra],
    capture_output=True,
    text=True,
  )
  out = run(
    "--offload", "--offload-params", "--host-memory-gb", "110", "--json"
  )
  assert out.returncode == 0, out.stderr
  record = json.loads(out.stdout)
  largest = int(record["largest_fitting"]["3"])
  assert record["largest_fitting_bound"]["3"]["memory"] == "host"
  config = gpt.config_for_params(largest, seq_len=2048)
  assert _fits_at_least_share(config, 141e9, 110e9, {"data": 1})[1]
  bad = run("--host-memory-gb", "110")
  assert bad.returncode == 2
  assert "give it with --memory-gb and --offload" in bad.stderr


def test_working_set_counts_gathered_layers_only_at_stage_3():
  import jax.numpy as jnp

  from zerojax import Policy

  cfg = gpt.GPTConfig(vocab=256, width=1024, depth=4, heads=8, seq_len=64)
  layer = gpt._block_params(1024)
  logits = 2 * 64 * 256 * 4  # batch 1 per device
  acts = 64 * 1024 * 4 * 4 + logits  # 4 layer inputs, fp32
  fp32 = Policy()
  assert plan.working_set(cfg, 3, 1, fp32) == 12 * layer + acts
  # bf16 params: the layer inputs (the residual stream) are bf16 too
  assert plan.working_set(cfg, 3, 1, Policy(param_dtype=jnp.bfloat16)) == (
    6 * layer + 64 * 1024 * 2 * 4 + logits
  )
  # stages 1-2: the updated weight shard the all-gather reads (4 Psi/N);
  # stage 1 also holds the reduce-scatter's gradient shard (4 Psi/N)
  psi = gpt.num_params(cfg)
  assert plan.working_set(cfg, 2, 1, fp32, n_devices=8) == acts + 4 * psi / 8
  assert plan.working_set(cfg, 1, 1, fp32, n_devices=8) == acts + 8 * psi / 8
  with pytest.raises(ValueError, match="n_devices=N"):
    plan.working_set(cfg, 1, 1, fp32)
  # stage 0: the all-reduce's output is a second full gradient
  assert plan.working_set(cfg, 0, 1, fp32) == acts + 4 * gpt.num_params(cfg)


def test_zeropp_cross_node_bytes_follow_the_paper_accounting():
  """ZeRO++ (arXiv 2306.10209): stage 3's 3M across nodes -> 0.75M with
  qwZ (int8) + hpZ + qgZ (int4); M the model's bf16 bytes. Per chip,
  hierarchical collectives, 64 chips as 8 nodes of 8."""
  psi, n, s = 7_000_000_000, 64, 8
  k = n // s
  slow = lambda **kw: cost.zeropp_comm(psi, n, s, block=256, **kw)["slow_bytes"]
  cross = (s - 1) / s / k  # share of a buffer per chip
  assert slow() == pytest.approx(3 * 2 * psi * cross)
  assert slow(hpz=True) == pytest.approx((2 + 2) * psi * cross)
  assert slow(weight_bits=8) == pytest.approx(
    (2 * (1 + 4 / 256) + 2) * psi * cross
  )
  all3 = slow(weight_bits=8, grad_bits=4, hpz=True)
  assert all3 == pytest.approx(((1 + 4 / 256) + (0.5 + 4 / 256)) * psi * cross)
  assert all3 / slow() == pytest.approx(0.75 / 3, rel=0.03)
  # hierarchical qgZ (the node known): the gradients cross as node sums
  assert slow(grad_bits=8) == pytest.approx(
    (2 * 2 + (1 + 4 / 256)) * psi * cross
  )
  # a flat quantized all-to-all cannot reduce inside the node first: more
  # cross-node bytes than a hierarchical bf16 reduce-scatter
  assert slow(grad_bits=8, nodes_known=False) > slow()


def test_planner_cli_prints_the_zeropp_table(capsys):
  plan.main(["--params", "1e9", "--devices", "16", "--slices", "2", "--zeropp"])
  out = capsys.readouterr().out
  assert "qwZ + hpZ + qgZ int4" in out and "DCN vs stage 3" in out


def test_planner_cli_gives_saved_activations_by_policy_and_pa(capsys):
  """``--batch``: saved activations per device for each remat policy; Pa
  halves the layer inputs at model=2, offload moves them to the host, dots
  keeps the matmul outputs on top (tensor-parallel ones split by M)."""
  import json

  plan.main(
    [
      "--width",
      "1024",
      "--depth",
      "8",
      "--mesh",
      "data=4,model=2",
      "--batch",
      "2",
      "--seq-len",
      "512",
      "--json",
    ]
  )
  acts = json.loads(capsys.readouterr().out)["saved_activations"]
  full = 8 * 2 * 512 * 1024 * 2  # L B T D, bf16
  assert acts["full"]["device"] == full
  assert acts["full + Pa"]["device"] == full / 2
  assert acts["offload"] == {"device": 0.0, "host": full, "per_layer": full / 8}
  # dots: + qkv 3D/2, projection D, fc1 4D/2 per token
  assert acts["dots"]["device"] == full * (1 + 1.5 + 1 + 2)
  assert acts["dots + Pa"]["device"] == full * (0.5 + 1.5 + 0.5 + 2)


def test_compile_stage_reports_the_compiled_step_beside_the_plan(mesh):
  """``zerojax.app.compiled`` (what ``--compile`` runs per stage) on the
  CPU mesh: the reference GPT's step lowered from abstract state and batch,
  its compiled peak beside the planner's model state + working set, and the
  collectives the stage implies (stage 3: per-layer all-gathers and
  reduce-scatters over ``data``)."""
  import numpy as np

  from zerojax.app import compiled, planner

  config = gpt.GPTConfig(vocab=64, seq_len=16, width=32, depth=2, heads=2)
  n = mesh.size
  plans = [plan.plan_gpt(plan.abstract_gpt(config), s, n) for s in range(4)]
  predicted = planner.predicted_peak(plans[3], config, 2, n_devices=n)
  attention = 3 * 2 * config.heads * config.seq_len**2 * 4  # P, dP, dS
  assert (
    predicted
    == plans[3].device
    + plan.working_set(config.resolved("tpu"), 3, 2, n_devices=n)
    + attention
  )
  # stage 1 compiles to stage 2's program: priced as stage 2
  assert planner.predicted_peak(
    plans[1], config, 2, n_devices=n, plan_stage2=plans[2]
  ) == (planner.predicted_peak(plans[2], config, 2, n_devices=n))
  row = compiled.compile_stage(config, 3, mesh, 2, predicted)
  m = row["memory"]
  assert m["peak"] == m["argument"] + m["output"] + m["temp"] - m["alias"] > 0
  assert row["peak_vs_predicted"] == m["peak"] / predicted
  # the sharded state is the arguments' bulk: bf16 params + fp32 master and
  # two moments, 14 bytes per param over n devices (padding aside)
  n_params = gpt.num_params(config)
  assert 14 * n_params / n <= m["argument"] < 14 * n_params / n * 1.5
  assert row["collectives"]["all-gather"]["count"] >= config.depth
  assert row["collectives"]["reduce-scatter"]["count"] >= config.depth
  assert set(row["bytes_by_axis"]) >= {"all-gather@data", "reduce-scatter@data"}
  assert "| 3 |" in compiled.table([row])
  assert np.isfinite(row["compile_s"])


def test_cli_compile_needs_a_topology_and_names_the_tpu_extra():
  run = lambda *a: subprocess.run(
    [sys.executable, "-m", "zerojax.plan", "--params", "1e8", *a],
    capture_output=True,
    text=True,
  )
  bad = run("--devices", "8", "--compile")
  assert bad.returncode == 2 and "--compile needs --topology" in bad.stderr
  import importlib.util

  if importlib.util.find_spec("libtpu") is None:
    bad = run("--topology", "v5e:2x2", "--batch", "1", "--compile")
    assert bad.returncode == 2 and "pip install 'zerojax[tpu]'" in bad.stderr
  else:
    bad = run("--topology", "v5e:2x2", "--devices", "4")
    assert bad.returncode == 2 and "drop --devices" in bad.stderr


def test_cli_stages_reports_only_the_stages_asked(capsys):
  """``--stages 1,3`` prints those stages' rows, largest GPTs and least
  shares only, as text and as JSON; a stage outside 0-3 is refused by name."""
  plan.main(
    ["--params", "7e9", "--devices", "8", "--memory-gb", "40", "--offload"]
    + ["--stages", "1,3"]
  )
  out = capsys.readouterr().out
  rows = [ln.split("|")[1].strip() for ln in out.splitlines() if ln[:2] == "| "]
  assert rows == ["stage", "1", "3"]
  assert [
    ln.split(":")[0].strip() for ln in out.splitlines() if "  stage " in ln
  ] == [
    "stage 1",
    "stage 3",
    "stage 1",
    "stage 3",
  ]
  plan.main(
    ["--params", "7e9", "--devices", "8", "--memory-gb", "40", "--offload"]
    + ["--stages", "1,3", "--json"]
  )
  data = json.loads(capsys.readouterr().out)
  assert [x["stage"] for x in data["plans"]] == [1, 3]
  assert list(data["largest_fitting"]) == list(data["offload_needed"])
  assert list(data["offload_needed"]) == ["1", "3"]
  with pytest.raises(SystemExit):
    plan.main(["--params", "7e9", "--devices", "8", "--stages", "4"])
  assert "--stages 4: stages are 0-3" in capsys.readouterr().err


@pytest.mark.parametrize(
  "args, said",
  [
    (["--params", "-1"], "argument --params: -1: give a finite number above 0"),
    (["--params", "5000"], "--params 5000: config_for_params: 5000 params"),
    (["--memory-gb", "0"], "argument --memory-gb: 0: give a finite number"),
    (["--memory-gb", "inf"], "argument --memory-gb: inf: give a finite"),
    (["--seq-len", "0"], "argument --seq-len: 0: give a finite number"),
    (["--batch", "two"], "argument --batch: 'two' is not an integer"),
  ],
)
def test_cli_refuses_a_size_that_is_not_a_positive_number(args, said, capsys):
  """A size, count or bandwidth at or below zero or not finite, or a GPT
  too small to shape, is refused by name before anything is planned."""
  from zerojax import plan

  argv = ["--params", "7e9", "--devices", "8"] + args
  with pytest.raises(SystemExit) as e:
    plan.main(argv)
  assert e.value.code == 2
  assert said in capsys.readouterr().err


@pytest.mark.parametrize(
  "call, said",
  [
    (dict(n_devices=0), "n_devices=0: axis sizes are whole numbers"),
    (dict(n_devices=-2), "n_devices=-2: axis sizes are whole numbers"),
    (dict(n_devices=3.5), "(got data=3.5)"),
    (dict(mesh={"data": 4, "model": 0}), "(got model=0)"),
    (dict(n_devices=8, accum_steps=0), "accum_steps=0; give the micro"),
    (dict(n_devices=8, memory_bytes=-1), "memory_bytes=-1; give the device"),
    (dict(n_devices=8, memory_bytes=float("nan")), "memory_bytes=nan"),
    (dict(n_devices=8, memory_bytes="80GB"), "memory_bytes='80GB'"),
  ],
)
def test_the_planner_refuses_counts_and_memory_that_are_not_sizes(call, said):
  """Device counts, micro-batches and memory that are not positive whole
  numbers (memory: finite and above 0) are refused by name before any
  plan, and a plan with no device count asks for one."""
  import jax
  import jax.numpy as jnp

  abstract = {"w": jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)}
  kw = dict(call)
  fn = cost.plan_stage
  if "memory_bytes" in kw:
    fn = cost.offload_fraction_needed
  with pytest.raises(ValueError, match=re.escape(said)):
    fn(abstract, 3, **kw)
  with pytest.raises(TypeError, match="give n_devices= .* or mesh="):
    cost.plan_stage(abstract, 3)


def test_cli_compile_without_stages_still_reports_every_stage(
  monkeypatch, capsys
):
  """``--compile`` alone compiles stage 3 and still prints every stage's
  plan; ``--stages`` names both."""
  from zerojax.app import plan_cli

  compiled = []
  monkeypatch.setattr(
    plan_cli,
    "_compile",
    lambda p, args, config, mesh, plans, stages: compiled.append(stages) or [],
  )
  base = ["--params", "1e9", "--devices", "4", "--batch", "1", "--compile"]
  monkeypatch.setattr(
    plan_cli, "_mesh", lambda p, args: ({"data": 4}, 1), raising=True
  )
  plan.main(base)
  out = capsys.readouterr().out
  rows = [ln.split("|")[1].strip() for ln in out.splitlines() if ln[:2] == "| "]
  rows = [r for r in rows if r == "stage" or r.isdigit()]
  assert (rows, compiled) == (["stage", "0", "1", "2", "3"], [[3]])
  plan.main(base + ["--stages", "2,3"])
  out = capsys.readouterr().out
  rows = [ln.split("|")[1].strip() for ln in out.splitlines() if ln[:2] == "| "]
  rows = [r for r in rows if r == "stage" or r.isdigit()]
  assert (rows, compiled[-1]) == (["stage", "2", "3"], [2, 3])
