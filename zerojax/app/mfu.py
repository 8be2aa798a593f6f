"""What an accelerator can do: peak dense matmul throughput, for MFU.

MFU (model flops utilisation) = model flops per second / the chip's peak.
The peaks are the vendors' dense (not 2:4 sparse) bf16 figures; a device
this table does not know (a CPU, a new chip) has none, and MFU is then
reported as ``None`` rather than guessed.
"""

from __future__ import annotations

# device_kind substring (lower case) -> peak dense bf16 FLOP/s per device
_PEAK_BF16 = (
  ("h200", 989.4e12),
  ("h100", 989.4e12),  # SXM; the PCIe part is lower, see below
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


def mfu(
  tokens_per_s: float | None, flops_per_token: float, devices
) -> float | None:
  """Model flops utilisation over ``devices`` (None where a peak is unknown)."""
  peaks = [peak_flops(d) for d in devices]
  if tokens_per_s is None or not peaks or any(p is None for p in peaks):
    return None
  return tokens_per_s * flops_per_token / sum(p for p in peaks if p)
