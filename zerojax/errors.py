"""The errors zerojax raises for a user's loss, model or mesh (bad settings
raise ``ValueError`` or ``TypeError``), and the warning for a loss it
cannot check."""

from zerojax._src.comm.gather import (
  UngatheredParamError as UngatheredParamError,
)
from zerojax._src.records.model_axes import ModelSpecError as ModelSpecError
from zerojax._src.remat.remat import RematError as RematError
from zerojax._src.step.loss_call import LossOutputError as LossOutputError
from zerojax._src.step.loss_check import (
  LossNotAMeanError as LossNotAMeanError,
)
from zerojax._src.step.loss_check import (
  LossUnverifiedWarning as LossUnverifiedWarning,
)

__all__ = [
  "LossNotAMeanError",
  "LossOutputError",
  "LossUnverifiedWarning",
  "ModelSpecError",
  "RematError",
  "UngatheredParamError",
]
