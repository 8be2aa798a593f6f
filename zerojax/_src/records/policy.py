"""Mixed-precision policy: which dtype each copy of the weights lives in."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Policy:
  """Dtypes of parameters, master weights and gradient reduction.

  The dtypes are real; a complex leaf takes the complex dtype of the same
  precision (``float32`` -> ``complex64``), and a policy with no complex
  counterpart (``bfloat16``) raises for it, naming the leaf.

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
    >>> policy.compute(jnp.float32), policy.master(jnp.float32)
    (dtype(bfloat16), dtype('float32'))
  """

  param_dtype: Any = None
  master_dtype: Any = jnp.float32
  reduce_dtype: Any = None

  def compute(self, dtype) -> np.dtype:
    return _like(
      self.param_dtype if self.param_dtype is not None else dtype, dtype
    )

  def master(self, dtype) -> np.dtype:
    return _like(self.master_dtype if self.has_master else dtype, dtype)

  def reduce(self, dtype) -> np.dtype:
    if self.reduce_dtype is not None:
      return _like(self.reduce_dtype, dtype)
    return self.compute(dtype)

  def check_leaf(self, path: str, dtype):
    """Raises, naming the leaf, when the policy has no dtype for it: the
    policy's dtypes are real, and a complex leaf takes the complex dtype of
    the same precision (float32 -> complex64, float64 -> complex128);
    bfloat16 and float16 have none."""
    if not jnp.issubdtype(dtype, jnp.complexfloating):
      return
    for name in ("param_dtype", "master_dtype", "reduce_dtype"):
      dt = getattr(self, name)
      if dt is None or (name == "master_dtype" and not self.has_master):
        continue
      if np.dtype(dt) not in _COMPLEX:
        raise ValueError(
          f"zerojax: param leaf {path} is {np.dtype(dtype).name}, and "
          f"Policy({name}={np.dtype(dt).name}) has no complex counterpart "
          f"(JAX's complex dtypes are complex64 and complex128: float32 "
          f"and float64 parts). Use a float32 or float64 policy for a "
          f"model with complex weights, or keep them in their dtype with "
          f"Policy() (the default)."
        )

  @property
  def has_master(self) -> bool:
    return self.param_dtype is not None and np.dtype(
      self.param_dtype
    ) != np.dtype(self.master_dtype)


# a complex leaf under a real policy dtype: the complex dtype of its precision
_COMPLEX = {
  np.dtype(np.float32): np.dtype(np.complex64),
  np.dtype(np.float64): np.dtype(np.complex128),
}


def _like(policy_dtype, leaf_dtype) -> np.dtype:
  """``policy_dtype`` for a leaf of ``leaf_dtype``: its complex counterpart
  for a complex leaf (see :meth:`Policy.check_leaf`)."""
  dt = np.dtype(policy_dtype)
  if jnp.issubdtype(leaf_dtype, jnp.complexfloating) and not jnp.issubdtype(
    dt, jnp.complexfloating
  ):
    return _COMPLEX.get(dt, dt)
  return dt
