"""What a ZeRO stage costs before anything is allocated: per-device model
state and collective bytes from zerojax's own layouts, for any params.

    plan = zerojax.cost.plan_stage(jax.eval_shape(init_fn, key), stage=3,
                                   n_devices=64)
    plan.total, plan.collectives, zerojax.cost.comm_time(plan, slices=4)
    mine = zerojax.cost.plan_stage(abstract, tx=tx)  # a transformation as built
    share = zerojax.cost.offload_fraction_needed(abstract, memory_bytes=80e9,
                                                 tx=tx)
    acts = zerojax.cost.saved_activations(loss_fn, params, one_device_batch,
                                          mesh={"data": 8, "model": 2})
"""

from zerojax._src.diagnostics.offload_share import (
  offload_fraction_needed as offload_fraction_needed,
)
from zerojax._src.diagnostics.planner import GB as GB
from zerojax._src.diagnostics.planner import HARDWARE as HARDWARE
from zerojax._src.diagnostics.planner import StagePlan as StagePlan
from zerojax._src.diagnostics.planner import comm_time as comm_time
from zerojax._src.diagnostics.planner import plan_stage as plan_stage
from zerojax._src.diagnostics.planner import (
  saved_activations as saved_activations,
)
from zerojax._src.diagnostics.zeropp_comm import ZEROPP_ROWS as ZEROPP_ROWS
from zerojax._src.diagnostics.zeropp_comm import zeropp_comm as zeropp_comm

__all__ = [
  "GB",
  "HARDWARE",
  "StagePlan",
  "ZEROPP_ROWS",
  "comm_time",
  "offload_fraction_needed",
  "plan_stage",
  "saved_activations",
  "zeropp_comm",
]
