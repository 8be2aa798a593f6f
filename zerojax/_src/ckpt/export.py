"""Params out of a :class:`~zerojax.ZeroState`: consolidated, unsharded,
full precision, written in Orbax's standard format."""

from __future__ import annotations

import pathlib

import numpy as np
import orbax.checkpoint as ocp

from zerojax._src.records.spec import ZeroState
from zerojax._src.step.deleted import reject_deleted
from zerojax._src.step.gather_state import gather_leaf


def export_params(state: ZeroState, path=None):
  """Consolidated, unsharded full-precision params.

  The fp32 master copy where the policy keeps one, else the params, gathered
  to every host as NumPy arrays (zerojax's ``zero_to_fp32``). With ``path``,
  also written in Orbax's standard format, which loads without zerojax::

      params = orbax.checkpoint.StandardCheckpointer().restore(path)

  One leaf at a time: each is gathered, copied to host memory and released
  before the next, so the devices never hold the whole model unsharded
  (only the host's NumPy result does).

  Returns:
    The params pytree (same structure as given to ``zerojax.init``) of NumPy
    arrays.
  """

  reject_deleted(state, "zerojax.checkpoint.export_params")
  full = state.spec.unflatten_params(
    [
      np.asarray(gather_leaf(state, i, master=True))
      for i in range(len(state.spec.leaves))
    ]
  )
  if path is not None:
    path = pathlib.Path(path).absolute()
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(path, full)
      ckptr.wait_until_finished()
  return full
