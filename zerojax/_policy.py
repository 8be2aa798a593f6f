"""Mixed-precision policy: which dtype each copy of the weights lives in."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Policy:
  """Dtypes of parameters, master weights and gradient reduction.

  Attributes:
    param_dtype: dtype params are stored, all-gathered and computed in (e.g.
      ``jnp.bfloat16``). ``None`` keeps each leaf's own dtype and keeps no
      master copy: the optimizer updates the params directly.
    master_dtype: dtype of the master copy the optimizer updates, held in the
      sharded optimizer state (ZeRO's "fp32 master weights"). Only kept when
      it differs from ``param_dtype``.
    reduce_dtype: dtype gradients are reduce-scattered (or all-reduced) and
      accumulated in. ``None`` means ``param_dtype`` (what DeepSpeed
      communicates by default, and what the ZeRO memory formulas assume).

  Example:
    >>> policy = zerojax.Policy(param_dtype=jnp.bfloat16)   # bf16 + fp32 master
  """

  param_dtype: Any = None
  master_dtype: Any = jnp.float32
  reduce_dtype: Any = None

  def compute(self, dtype) -> np.dtype:
    return np.dtype(self.param_dtype if self.param_dtype is not None else dtype)

  def master(self, dtype) -> np.dtype:
    return np.dtype(self.master_dtype if self.has_master else dtype)

  def reduce(self, dtype) -> np.dtype:
    if self.reduce_dtype is not None:
      return np.dtype(self.reduce_dtype)
    return self.compute(dtype)

  @property
  def has_master(self) -> bool:
    return (self.param_dtype is not None
            and np.dtype(self.param_dtype) != np.dtype(self.master_dtype))
