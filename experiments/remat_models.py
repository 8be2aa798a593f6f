"""ZeRO-R on models that are not the reference GPT: ``zerojax.remat`` per choice.

    python experiments/remat_models.py            # writes docs/data/remat_models_jax<version>.json

For the NNX and the Linen MLP-Mixer and the plain-JAX block function of
``tests/mixers.py`` (16 rows, 8 tokens, width 32) at stage 3 on a
data=4 x model=2 mesh of fake CPU devices, for each choice of what a block
keeps (``saves``; for the plain-JAX block also the tensor it tags), Pa
(``partition``) and Pa+cpu (``offload``):

* ``compiled_per_layer``: the compiled step's temp bytes per added layer
  (least-squares slope over depths 2-8; ``temps``: the bytes at each
  depth), less the layer's gradient shard the backward scan stacks too;
* ``report_per_layer``: ``zerojax.report``'s saved activations per layer
  (the layer scan's part, Pa applied), and its ratio to the compiled figure;
* ``host_placements``: the tensors the CUDA lowering (made on CPU) puts in
  ``pinned_host``;
* ``max_rel_err``: the params after two SGD steps against the same model
  with every intermediate kept (``remat=False``), from the same initial
  values.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import mixers  # noqa: E402  (the models tests/test_remat.py checks)

MESH = "data=4,model=2"
# XLA's temp is not exactly linear in depth (JAX 0.10.2 packs depth 2's
# tighter with "dots" and Pa): per layer is the least-squares slope
DEPTHS = (2, 4, 6, 8)
CHOICES = {
  "input": dict(saves="input"),
  "dots": dict(saves="dots"),
  "input + Pa": dict(saves="input", partition="model"),
  "dots + Pa": dict(saves="dots", partition="model"),
  "input + offload": dict(saves="input", offload=True),
  "input + Pa + offload": dict(saves="input", partition="model", offload=True),
  "dots + Pa + offload": dict(saves="dots", partition="model", offload=True),
}
# the plain-JAX block also tags its hidden activation "mix"
NAMED = {
  "names": dict(saves=("mix",)),
  "names + Pa": dict(saves=("mix",), partition="model"),
}


def _step(kind, depth, remat, params=None):
  own, loss = mixers.ALL[kind](depth, remat)
  params = (
    own
    if params is None
    else jax.tree.unflatten(jax.tree.structure(own), jax.tree.leaves(params))
  )
  tx = zerojax.zero(optax.sgd(0.1), stage=3, mesh=zerojax.make_mesh(MESH))
  return zerojax.init(params, tx), zerojax.train_step(loss, tx)


def _per_layer(kind, remat):
  temps, scans = [], []
  for depth in DEPTHS:
    state, step = _step(kind, depth, remat)
    temps.append(
      step.lower(state, mixers.batch())
      .compile()
      .memory_analysis()
      .temp_size_in_bytes
    )
    scans.append(
      zerojax.report(step, state, mixers.batch()).activations["scan"]
    )
  depth = DEPTHS[-1]
  grads = (
    sum(
      x.addressable_shards[0].data.size * x.dtype.itemsize
      for x in jax.tree.leaves(state.params)
      if x.ndim and x.shape[0] == depth
    )
    / depth
  )
  slope = lambda ys: float(np.polyfit(DEPTHS, ys, 1)[0])
  return slope(temps) - grads, slope(scans), temps


def _host_placements(kind, remat):
  state, step = _step(kind, 2, remat)
  text = (
    step.trace(state, mixers.batch())
    .lower(lowering_platforms=("cuda",))
    .as_text()
  )
  return re.findall(
    r"annotate_device_placement[^\n]*_xla_buffer_placement"
    r' = "pinned_host"[^\n]*: \((tensor<[^>]*>)\)',
    text,
  )


def _trained(kind, remat, init):
  state, step = _step(kind, 2, remat, params=init)
  for s in range(2):
    state, _ = step(state, mixers.batch(s))
  return zerojax.gather_params(state)


def measure(kind, name, kw):
  remat = zerojax.remat(**kw)
  compiled, reported, temps = _per_layer(kind, remat)
  init = mixers.ALL[kind](2, remat)[0]
  want = _trained(kind, False, init)
  got = _trained(kind, remat, init)
  err = max(
    float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )
  return {
    "model": kind,
    "choice": name,
    **kw,
    "compiled_per_layer": compiled,
    "report_per_layer": reported,
    "temps": dict(zip(DEPTHS, temps)),
    "report_over_compiled": reported / compiled if compiled else None,
    "host_placements": _host_placements(kind, remat),
    "max_rel_err": err,
    "block_input_bytes": (mixers.B // 4) * mixers.T * mixers.D * 4,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--out",
    default=str(
      ROOT / "docs" / "data" / f"remat_models_jax{jax.__version__}.json"
    ),
  )
  args = parser.parse_args(argv)
  warnings.filterwarnings("ignore", message="zerojax.init: mesh axes")
  rows = []
  for kind in mixers.ALL:
    for name, kw in {**CHOICES, **(NAMED if kind == "jax" else {})}.items():
      row = measure(kind, name, kw)
      rows.append(row)
      print(
        f"{kind:6s} {name:22s} compiled/layer {row['compiled_per_layer']:>9,.0f}"
        f"  report/layer {row['report_per_layer']:>9,.0f}"
        f"  ratio {row['report_over_compiled'] or 0:.3f}"
        f"  host {len(row['host_placements'])}"
        f"  rel err {row['max_rel_err']:.1e}",
        file=sys.stderr,
      )
  out = {
    "argv": sys.argv,
    "jax": jax.__version__,
    "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
    f"{jax.device_count()} fake CPU devices",
    "mesh": MESH,
    "rows": rows,
  }
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  print(args.out)


if __name__ == "__main__":
  main()
