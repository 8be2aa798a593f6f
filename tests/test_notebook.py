"""The notebooks run top to bottom, so they never rot. Both are committed
with their outputs (so they read on a code host); these tests re-run them."""

import pathlib
import re

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).parents[1] / "notebooks"


def _run(name, tmp_path):
  stored = nbformat.read(NOTEBOOKS / name, as_version=4)
  assert any(c.get("outputs") for c in stored.cells if c.cell_type == "code"), (
    f"{name} is committed without its outputs"
  )
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  NotebookClient(
    nb,
    timeout=600,
    kernel_name="python3",
    resources={"metadata": {"path": str(tmp_path)}},
  ).execute()
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.get("output_type") == "error"
  ]
  assert not errors
  return "".join(
    o.get("text", "")
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
  )


def test_zero_stages_notebook_runs(tmp_path):
  outputs = _run("zero_stages.ipynb", tmp_path)
  assert "stage 3 over 8 devices" in outputs
  assert "7.5e+09 params on 64 devices: stage 0 120.0 GB" in outputs
  # offload: where the state lives, the same params, what the planner says
  assert "offload=0.5: optimizer state in ['device', 'pinned_host']" in outputs
  for name in ("offload=True", "offload=0.5", "offload_params=True"):
    assert f"{name}: the same params as on the device after 3 steps: True" in (
      outputs
    ), outputs
  assert "7B, one 80 GB device: needs offload=" in outputs
  assert re.search(r"the device overflows: .*gradients \d", outputs), outputs


def test_bring_your_model_notebook_runs(tmp_path):
  outputs = _run("bring_your_model.ipynb", tmp_path)
  # the drop-in equals the plain loop; stage 3 equals stage 0
  diff = float(re.search(r"plain loop after 100 steps: (\S+)", outputs)[1])
  assert diff < 1e-5, outputs
  curves = float(re.search(r"stage 0 and stage 3 curves: (\S+)", outputs)[1])
  assert curves < 1e-4, outputs
  assert "P(None, 'data')" in outputs and "reduce-scatter" in outputs
  # safetensors: written in shards with the index, loaded at another stage
  # bitwise, fine-tuned and written again
  assert "model.safetensors.index.json" in outputs, outputs
  assert "blocks.0.linear.weight" in outputs, outputs
  assert "loaded params equal the trained master copy: True" in outputs
  assert re.search(r"stage 1 fine-tune, 20 steps: loss \d", outputs)
  # ZeRO-R: the planner's line per choice; offload (one memory on CPU)
  # trains the numbers of remat=True
  kept = {
    name.strip(): (int(dev.replace(",", "")), int(host.replace(",", "")))
    for name, dev, host in re.findall(
      r"(.+?)saved per device: +([\d,]+) B on device, +([\d,]+) B in host",
      outputs,
    )
  }
  assert len(kept) == 3, outputs
  full, block, offloaded = kept.values()
  assert full[0] > block[0] > offloaded[0] and offloaded[1] > 0, kept
  offload_diff = float(
    re.search(r"remat=True and offload=True: (\S+)", outputs)[1]
  )
  # two programs of the same maths: equal up to the order of their sums
  # (the same bound as the drop-in against the plain loop above)
  assert offload_diff < 1e-5, outputs
