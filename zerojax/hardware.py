"""What an accelerator can do: peak dense matmul throughput, for MFU; the
XLA flags that bound its collective buffers.

MFU (model flops utilisation) = model flops per second / the chip's peak.
The peaks are the vendors' dense (not 2:4 sparse) bf16 figures; a device
this table does not know (a CPU, a new chip) has none, and MFU is then
reported as ``None`` rather than guessed.
"""

from __future__ import annotations

# device_kind substring (lower case) -> peak dense bf16 FLOP/s per device
_PEAK_BF16 = (
    ("h200", 989.4e12),
    ("h100", 989.4e12),     # SXM; the PCIe part is lower, see below
    ("gh200", 989.4e12),
    ("a100", 312e12),
    ("l40s", 362e12),
    ("a10g", 125e12),
    ("tpu v6", 918e12),
    ("tpu v5p", 459e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v4", 275e12),
)
_PCIE = {"h100 pcie": 756e12}


def peak_flops(device) -> float | None:
  """Peak dense bf16 FLOP/s of ``device`` (a ``jax.Device``), or None."""
  kind = getattr(device, "device_kind", "").lower()
  for name, peak in _PCIE.items():
    if name in kind:
      return peak
  for name, peak in _PEAK_BF16:
    if name in kind:
      return peak
  return None


def mfu(tokens_per_s: float | None, flops_per_token: float, devices) -> float | None:
  """Model flops utilisation over ``devices`` (None where a peak is unknown)."""
  peaks = [peak_flops(d) for d in devices]
  if tokens_per_s is None or not peaks or any(p is None for p in peaks):
    return None
  return tokens_per_s * flops_per_token / sum(peaks)


def combine_threshold_flags(bucket_bytes: int) -> str:
  """XLA GPU flags capping the collectives its combiners build at
  ``bucket_bytes``.

  zerojax's buckets (``zerojax.zero(..., bucket_bytes=...)``) bound each
  collective it issues; XLA's combiner passes then merge independent
  collectives (small leaves, a leaf's rows left over after its last whole
  bucket) up to their own thresholds (30 MiB by default on GPU). Setting
  those to the bucket bounds the merged buffers too. Flags are read when
  the backend starts: put them in ``XLA_FLAGS`` before the first JAX call::

    os.environ["XLA_FLAGS"] += " " + zerojax.hardware.combine_threshold_flags(
        8 * 2**20)

  CPU and TPU ignore these flags (the CPU backend has no such threshold).
  """
  if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or (
      bucket_bytes <= 0):
    raise ValueError(f"combine_threshold_flags: bucket_bytes={bucket_bytes!r} "
                     f"must be a positive int (bytes).")
  kinds = ("all_reduce", "all_gather", "reduce_scatter")
  return " ".join(f"--xla_gpu_{k}_combine_threshold_bytes={bucket_bytes}"
                  for k in kinds)
