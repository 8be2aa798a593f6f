"""zerojax: ZeRO stages 0-3 for Optax optimizers on a JAX device mesh.

Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models (arXiv 1910.02054).
"""

from zerojax._src.comm.gather import UngatheredParamError as UngatheredParamError
from zerojax._src.comm.gather import ShardedParam as ShardedParam
from zerojax._src.comm.gather import gather as gather
from zerojax._src.diagnostics.hlo import entry_bytes_by_memory as entry_bytes_by_memory
from zerojax._src.diagnostics.hlo import Collective as Collective
from zerojax._src.diagnostics.hlo import axes_of as collective_axes
from zerojax._src.diagnostics.hlo import bytes_by_axis as bytes_by_axis
from zerojax._src.diagnostics.hlo import collective_bytes as collective_bytes
from zerojax._src.diagnostics.hlo import collectives as collectives
from zerojax._src.diagnostics.hlo import crosses_processes as crosses_processes
from zerojax._src.diagnostics.inspect import layout_rows as layout_rows
from zerojax._src.diagnostics.inspect import layout_table as layout_table
from zerojax._src.diagnostics.inspect import memory_bytes as memory_bytes
from zerojax._src.diagnostics.inspect import state_bytes as state_bytes
from zerojax._src.diagnostics.inspect import theory_bytes as theory_bytes
from zerojax._src.diagnostics.report import Report as Report
from zerojax._src.diagnostics.report import report as report
from zerojax._src.records.config import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from zerojax._src.records.config import ZeroConfig as ZeroConfig
from zerojax._src.records.layout import LeafLayout as LeafLayout
from zerojax._src.records.mesh import make_mesh as make_mesh
from zerojax._src.records.mesh import parse_axes as parse_axes
from zerojax._src.records.model_axes import ModelSpecError as ModelSpecError
from zerojax._src.records.policy import Policy as Policy
from zerojax._src.records.spec import LeafSpec as LeafSpec
from zerojax._src.records.spec import OptLeafSpec as OptLeafSpec
from zerojax._src.records.spec import StateSpec as StateSpec
from zerojax._src.records.spec import ZeroState as ZeroState
from zerojax._src.records.spec import make_spec as make_spec
from zerojax._src.records.zeropp import ZeroPP as ZeroPP
from zerojax._src.remat.remat import Remat as Remat
from zerojax._src.remat.remat import RematError as RematError
from zerojax._src.remat.remat import remat as remat
from zerojax._src.step.batch import batch_sharding as batch_sharding
from zerojax._src.step.batch import shard_batch as shard_batch
from zerojax._src.step.dropin import ZeroTransformation as ZeroTransformation
from zerojax._src.step.grad import LossOutputError as LossOutputError
from zerojax._src.step.grad import value_and_grad as value_and_grad
from zerojax._src.step.state import gather_opt_state as gather_opt_state
from zerojax._src.step.state import gather_params as gather_params
from zerojax._src.step.state import init as init
from zerojax._src.step.state import init_from as init_from
from zerojax._src.step.steps import EvalStep as EvalStep
from zerojax._src.step.steps import TrainStep as TrainStep
from zerojax._src.step.steps import eval_step as eval_step
from zerojax._src.step.steps import train_step as train_step
from zerojax._src.step.transform import zero as zero
from zerojax._src.step.update import apply_gradients as apply_gradients

__version__ = "0.1.0"

__all__ = [
    "Collective", "DEFAULT_BUCKET_BYTES", "EvalStep", "LeafLayout", "LeafSpec", "LossOutputError", "ModelSpecError",
    "OptLeafSpec",
    "Policy", "Remat", "RematError", "Report", "ShardedParam", "StateSpec", "TrainStep",
    "UngatheredParamError", "ZeroConfig", "ZeroPP", "ZeroState", "ZeroTransformation",
    "apply_gradients", "batch_sharding", "bytes_by_axis", "collective_axes", "collective_bytes",
    "crosses_processes", "collectives", "entry_bytes_by_memory", "eval_step",
    "gather", "gather_opt_state", "gather_params", "init", "init_from", "make_spec", "layout_rows",
    "layout_table", "make_mesh", "memory_bytes", "parse_axes", "remat", "report", "shard_batch", "state_bytes",
    "theory_bytes", "train_step", "value_and_grad", "zero",
]
