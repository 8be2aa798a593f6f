"""The errors zerojax raises for a user's loss, model or mesh (bad settings
raise ``ValueError`` or ``TypeError``)."""

from zerojax._src.comm.gather import (
  UngatheredParamError as UngatheredParamError,
)
from zerojax._src.records.model_axes import ModelSpecError as ModelSpecError
from zerojax._src.remat.remat import RematError as RematError
from zerojax._src.step.loss_call import LossOutputError as LossOutputError

__all__ = [
  "LossOutputError",
  "ModelSpecError",
  "RematError",
  "UngatheredParamError",
]
