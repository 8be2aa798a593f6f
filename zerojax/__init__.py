"""zerojax: ZeRO stages 0-3 for Optax optimizers on a JAX device mesh.

Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models (arXiv 1910.02054).
"""

from zerojax._gather import ShardedParam as ShardedParam
from zerojax._gather import UngatheredParamError as UngatheredParamError
from zerojax._gather import gather as gather
from zerojax._hlo import Collective as Collective
from zerojax._hlo import axes_of as collective_axes
from zerojax._hlo import bytes_by_axis as bytes_by_axis
from zerojax._hlo import collective_bytes as collective_bytes
from zerojax._hlo import crosses_processes as crosses_processes
from zerojax._hlo import collectives as collectives
from zerojax._hlo import entry_bytes_by_memory as entry_bytes_by_memory
from zerojax._inspect import layout_rows as layout_rows
from zerojax._inspect import layout_table as layout_table
from zerojax._inspect import memory_bytes as memory_bytes
from zerojax._inspect import state_bytes as state_bytes
from zerojax._inspect import theory_bytes as theory_bytes
from zerojax._buckets import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from zerojax._layout import LeafLayout as LeafLayout
from zerojax._model_axes import ModelSpecError as ModelSpecError
from zerojax._mesh import make_mesh as make_mesh
from zerojax._policy import Policy as Policy
from zerojax._zeropp import ZeroPP as ZeroPP
from zerojax._report import Report as Report
from zerojax._report import report as report
from zerojax._grad import LossOutputError as LossOutputError
from zerojax._grad import value_and_grad as value_and_grad
from zerojax._spec import LeafSpec as LeafSpec
from zerojax._spec import OptLeafSpec as OptLeafSpec
from zerojax._spec import StateSpec as StateSpec
from zerojax._spec import ZeroState as ZeroState
from zerojax._spec import make_spec as make_spec
from zerojax._state import gather_opt_state as gather_opt_state
from zerojax._state import gather_params as gather_params
from zerojax._state import init as init
from zerojax._state import init_from as init_from
from zerojax._step import EvalStep as EvalStep
from zerojax._step import TrainStep as TrainStep
from zerojax._step import eval_step as eval_step
from zerojax._batch import batch_sharding as batch_sharding
from zerojax._batch import shard_batch as shard_batch
from zerojax._step import train_step as train_step
from zerojax._config import ZeroConfig as ZeroConfig
from zerojax._dropin import ZeroTransformation as ZeroTransformation
from zerojax._transform import zero as zero
from zerojax._update import apply_gradients as apply_gradients

__version__ = "0.1.0"

__all__ = [
    "Collective", "DEFAULT_BUCKET_BYTES", "EvalStep", "LeafLayout", "LeafSpec", "LossOutputError", "ModelSpecError",
    "OptLeafSpec",
    "Policy", "Report", "ShardedParam", "StateSpec", "TrainStep",
    "UngatheredParamError", "ZeroConfig", "ZeroPP", "ZeroState", "ZeroTransformation",
    "apply_gradients", "batch_sharding", "bytes_by_axis", "collective_axes", "collective_bytes",
    "crosses_processes", "collectives", "entry_bytes_by_memory", "eval_step",
    "gather", "gather_opt_state", "gather_params", "init", "init_from", "make_spec", "layout_rows",
    "layout_table", "make_mesh", "memory_bytes", "report", "shard_batch", "state_bytes",
    "theory_bytes", "train_step", "value_and_grad", "zero",
]
