"""A Pallas kernel inside the loss, at every stage, on the device JAX sees.

    python experiments/pallas_in_loss.py --out runs/pallas_in_loss.json

The loss multiplies its input by a parameter vector in a Pallas kernel
(wrapped in a ``jax.custom_vjp`` whose backward rule calls the kernel too,
as flash-attention kernels are). Per stage 0-3, on a mesh over every
device (``jax.make_mesh``: Explicit axes):

* the kernel's ``out_shape`` without ``manual_axis_type``: the step must
  raise zerojax's error (naming the fix) and keep the state;
* with ``manual_axis_type=jax.typeof(x).manual_axis_type``: one SGD step
  must give the unsharded numbers (the same loss in ``jax.numpy``).

Pallas lowers for GPU (Triton) and TPU (Mosaic). On CPU the kernel runs in
JAX's interpreter, which fails under ``jax.shard_map`` on its own (not in
zerojax), so there only the first check is meaningful. Writes a JSON
record per stage with the device and JAX version.
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import pallas as pl

import zerojax


def _mul_kernel(x_ref, w_ref, o_ref):
  o_ref[...] = x_ref[...] * w_ref[...]


def make_loss(typed: bool):
  interpret = jax.default_backend() == "cpu"

  def kernel_mul(x, w):
    kw = {"manual_axis_type": jax.typeof(x).manual_axis_type} if typed else {}
    return pl.pallas_call(
      _mul_kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype, **kw),
      interpret=interpret,
    )(x, w)

  @jax.custom_vjp
  def mul(x, w):
    return kernel_mul(x, w)

  mul.defvjp(
    lambda x, w: (kernel_mul(x, w), (x, w)),
    lambda res, ct: (kernel_mul(ct, res[1]), kernel_mul(ct, res[0])),
  )

  def loss(p, b):
    h = mul(b["x"], jnp.broadcast_to(p["w"], b["x"].shape))
    return jnp.mean((h @ p["v"] - b["y"]) ** 2)

  return loss


def reference_loss(p, b):
  return jnp.mean((b["x"] * p["w"] @ p["v"] - b["y"]) ** 2)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="runs/pallas_in_loss.json")
  args = ap.parse_args()
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",))
  rng = np.random.default_rng(0)
  params = {
    "w": rng.normal(size=(16,)).astype(np.float32),
    "v": rng.normal(size=(16, 16)).astype(np.float32),
  }
  batch = {
    "x": rng.normal(size=(32 * n, 16)).astype(np.float32),
    "y": rng.normal(size=(32 * n, 16)).astype(np.float32),
  }
  opt = optax.sgd(0.1)
  grads = jax.grad(reference_loss)(params, batch)
  want = optax.apply_updates(params, opt.update(grads, opt.init(params))[0])
  records = []
  for stage in range(4):
    rec = {"stage": stage}
    with jax.set_mesh(mesh):
      tx = zerojax.zero(opt, stage=stage, mesh=mesh)
      state = zerojax.init(params, tx)
      try:
        zerojax.train_step(make_loss(False), tx)(state, batch)
        rec["untyped"] = "ran"
      except ValueError as e:
        rec["untyped"] = (
          "zerojax error" if str(e).startswith("zerojax") else "other error"
        )
        rec["untyped_message"] = str(e)[:400]
      rec["state_kept"] = not any(
        x.is_deleted() for x in jax.tree.leaves(state.params)
      )
      try:
        state, m = zerojax.train_step(make_loss(True), tx)(state, batch)
        got = zerojax.gather_params(state)
        rec["typed_max_abs_err"] = max(
          float(jnp.max(jnp.abs(got[k] - want[k]))) for k in want
        )
        rec["typed_loss"] = float(m["loss"])
      except Exception as e:  # noqa: BLE001 -- the record says what failed
        rec["typed_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(rec), flush=True)
    records.append(rec)
  d = jax.devices()[0]
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(
    json.dumps(
      {
        "device_kind": d.device_kind,
        "platform": d.platform,
        "n_devices": n,
        "jax_version": jax.__version__,
        "reference_loss": float(reference_loss(params, batch)),
        "records": records,
      },
      indent=1,
    )
  )


if __name__ == "__main__":
  main()
