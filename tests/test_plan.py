"""The planner reproduces the ZeRO paper's figures from zerojax's layouts."""

import json
import subprocess
import sys

import pytest

from zerojax import plan
from zerojax.models import gpt


def test_paper_example_7_5b_on_64_devices():
  """ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12 (mixed-precision Adam)."""
  config = gpt.config_for_params(7.5e9)
  assert abs(gpt.num_params(config) - 7.5e9) < 1e4
  totals = [plan.plan_stage(plan.abstract_gpt(config), s, 64).total / 1e9
            for s in range(4)]
  assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_paper_table1_1t_on_1024_devices():
  config = gpt.config_for_params(1e12)
  p = plan.plan_stage(plan.abstract_gpt(config), 3, 1024)
  assert round(p.total / 1e9, 1) == 15.6
  # communication: stage 3 all-gathers 2Ψ and reduce-scatters Ψ (bf16)
  assert p.collectives["reduce-scatter"] == pytest.approx(2e12, rel=1e-3)
  assert p.collectives["all-gather"] == pytest.approx(4e12, rel=1e-3)


def test_padding_is_counted():
  """A width that does not divide N pads, and the plan says so."""
  odd = gpt.GPTConfig(vocab=1000, seq_len=64, width=96, depth=2, heads=2)
  p = plan.plan_stage(plan.abstract_gpt(odd), 3, 64)
  n = gpt.num_params(odd)
  assert p.total > 16 * n / 64


def test_largest_fitting_model_is_monotone_in_stage():
  sizes = [gpt.num_params(plan.largest_fitting(32e9, s, 64)) for s in range(4)]
  assert sizes == sorted(sizes)
  assert sizes[0] == pytest.approx(2e9, rel=0.01)      # 16 bytes per param
  assert sizes[3] == pytest.approx(128e9, rel=0.01)    # 16/64 bytes per param


def test_cli_json_and_errors():
  out = subprocess.run([sys.executable, "-m", "zerojax.plan", "--params",
                        "7.5e9", "--devices", "64", "--json"],
                       capture_output=True, text=True, check=True)
  data = json.loads(out.stdout)
  assert round(data["plans"][1]["total"] / 1e9, 1) == 31.4
  bad = subprocess.run([sys.executable, "-m", "zerojax.plan", "--devices", "8"],
                       capture_output=True, text=True)
  assert bad.returncode == 2 and "--params or --width" in bad.stderr
