"""The notebook runs top to bottom, so it never rots."""

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).parents[1] / "notebooks" / "zero_stages.ipynb"


def test_notebook_runs(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(nb, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "stage 3 over 8 devices" in outputs
  assert "7.5e+09 params on 64 devices: stage 0 120.0 GB" in outputs
  errors = [o for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
