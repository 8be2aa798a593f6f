"""The errors zerojax raises for a user's loss, model or mesh (bad settings
raise ``ValueError`` or ``TypeError``), and the warnings for a loss it
cannot check and for an aux leaf the step's average or sum changes or
cannot check."""

from zerojax._src.comm.gather import (
  UngatheredParamError as UngatheredParamError,
)
from zerojax._src.records.model_axes import ModelSpecError as ModelSpecError
from zerojax._src.remat.remat import RematError as RematError
from zerojax._src.step.aux_check import (
  AuxNotACountWarning as AuxNotACountWarning,
)
from zerojax._src.step.aux_check import (
  AuxNotAMeanWarning as AuxNotAMeanWarning,
)
from zerojax._src.step.aux_check import (
  AuxNotPerExampleWarning as AuxNotPerExampleWarning,
)
from zerojax._src.step.aux_check import (
  AuxUnverifiedWarning as AuxUnverifiedWarning,
)
from zerojax._src.step.loss_call import LossOutputError as LossOutputError
from zerojax._src.step.loss_check import (
  LossNotAMeanError as LossNotAMeanError,
)
from zerojax._src.step.loss_check import (
  LossUnverifiedWarning as LossUnverifiedWarning,
)
from zerojax._src.step.loss_check import (
  ModelStateUpdateError as ModelStateUpdateError,
)

__all__ = [
  "AuxNotACountWarning",
  "AuxNotAMeanWarning",
  "AuxNotPerExampleWarning",
  "AuxUnverifiedWarning",
  "LossNotAMeanError",
  "LossOutputError",
  "LossUnverifiedWarning",
  "ModelSpecError",
  "ModelStateUpdateError",
  "RematError",
  "UngatheredParamError",
]
