"""Subprocess half of the checkpoint tests: train, save, or restore and train.

python -m tests.ckpt_worker first  DIR STAGE K       # K steps, save
python -m tests.ckpt_worker second DIR STAGE N OUT   # restore, to step N
python -m tests.ckpt_worker crash  DIR               # save, then die mid-save
"""

import os
import signal
import sys

from zerojax.xla_flags import cpu_device_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_device_flags(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from tests import toy  # noqa: E402
from zerojax import checkpoint  # noqa: E402

DATA = toy.batches(6, seed=7)


def setup(stage):
  params = toy.init_params(jax.random.key(0))
  tx = zerojax.zero(optax.adamw(1e-2), stage=stage)
  return params, tx, zerojax.train_step(toy.loss_fn, tx)


def main(mode, directory, *rest):
  if mode == "first":
    stage, k = int(rest[0]), int(rest[1])
    params, tx, step = setup(stage)
    state = zerojax.init(params, tx)
    for b in DATA[:k]:
      state, _ = step(state, b)
    with checkpoint.Checkpointer(directory) as ckpt:
      ckpt.save(state, extra={"data_step": k})
  elif mode == "second":
    stage, n, out = int(rest[0]), int(rest[1]), rest[2]
    params, tx, step = setup(stage)
    with checkpoint.Checkpointer(directory) as ckpt:
      state, extra = ckpt.restore(params, tx)
    for b in DATA[extra["data_step"] : n]:
      state, _ = step(state, b)
    full = zerojax.gather_params(state)
    np.savez(out, *[np.asarray(x) for x in jax.tree.leaves(full)])
  elif mode == "crash":
    big = {"w": np.ones((4096, 4096), np.float32)}  # 64 MB: slow enough
    tx = zerojax.zero(optax.adam(1e-3), stage=1)
    state = zerojax.init(big, tx)
    ckpt = checkpoint.Checkpointer(directory, async_save=True)
    ckpt.save(state, force=True)
    ckpt.wait()
    state = state.replace(step=state.step + 1)
    ckpt.save(state, force=True)  # asynchronous: returns early
    os.kill(os.getpid(), signal.SIGKILL)  # die while it is writing


if __name__ == "__main__":
  main(*sys.argv[1:])
