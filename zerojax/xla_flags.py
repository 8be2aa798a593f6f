"""XLA flags, set in ``XLA_FLAGS`` before the backend starts: collective
combine thresholds for zerojax's buckets, and fake CPU devices."""

from zerojax._src.runtime.xla_flags import (
  combine_threshold_flags as combine_threshold_flags,
)
from zerojax._src.runtime.xla_flags import cpu_device_flags as cpu_device_flags

__all__ = ["combine_threshold_flags", "cpu_device_flags"]
