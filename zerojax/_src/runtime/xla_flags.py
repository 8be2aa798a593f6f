"""XLA flags zerojax's settings imply (read when the backend starts)."""

from __future__ import annotations

import os


def combine_threshold_flags(bucket_bytes: int) -> str:
  """XLA GPU flags capping the collectives its combiners build at
  ``bucket_bytes``.

  zerojax's buckets (``zerojax.zero(..., bucket_bytes=...)``) bound each
  collective it issues; XLA's combiner passes then merge independent
  collectives (small leaves, a leaf's rows left over after its last whole
  bucket) up to their own thresholds (30 MiB by default on GPU). Setting
  those to the bucket bounds the merged buffers too. Flags are read when
  the backend starts: put them in ``XLA_FLAGS`` before the first JAX call::

    os.environ["XLA_FLAGS"] += " " + zerojax.xla_flags.combine_threshold_flags(
        8 * 2**20)

  CPU and TPU ignore these flags (the CPU backend has no such threshold).
  """
  if (
    isinstance(bucket_bytes, bool)
    or not isinstance(bucket_bytes, int)
    or (bucket_bytes <= 0)
  ):
    raise ValueError(
      f"combine_threshold_flags: bucket_bytes={bucket_bytes!r} "
      f"must be a positive int (bytes)."
    )
  kinds = ("all_reduce", "all_gather", "reduce_scatter")
  return " ".join(
    f"--xla_gpu_{k}_combine_threshold_bytes={bucket_bytes}" for k in kinds
  )


def cpu_device_flags(devices: int) -> str:
  """The caller's ``XLA_FLAGS`` (e.g. combine thresholds, optimisation
  level) with the fake device count set to ``devices``."""
  flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  return " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
