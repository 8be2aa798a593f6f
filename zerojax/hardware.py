"""XLA flags for an accelerator, set before the backend starts."""

from zerojax._src.runtime.xla_flags import (
    combine_threshold_flags as combine_threshold_flags)

__all__ = ["combine_threshold_flags"]
