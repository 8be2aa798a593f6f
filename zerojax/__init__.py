"""zerojax: ZeRO stages 0-3 for Optax optimizers on a JAX device mesh.

Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models (arXiv 1910.02054).

The root namespace holds what a training script calls. The rest lives in
namespaces by concern: :mod:`zerojax.diagnostics` (HLO readers, byte
counters, the layout table), :mod:`zerojax.layout` (the per-leaf layout
records), :mod:`zerojax.errors`, :mod:`zerojax.checkpoint`,
:mod:`zerojax.cost` (the planner), :mod:`zerojax.aot` (compiling for
hardware you do not hold), :mod:`zerojax.linen` and :mod:`zerojax.nnx`
(Flax), :mod:`zerojax.distributed`, :mod:`zerojax.launch` and
:mod:`zerojax.xla_flags` (processes and flags).
"""

# the library's namespaces that load nothing beyond JAX and Optax, imported
# with the root; zerojax.checkpoint (Orbax) and zerojax.linen / zerojax.nnx
# (Flax) load on first use (``__getattr__`` below)
from zerojax import aot as aot
from zerojax import cost as cost
from zerojax import diagnostics as diagnostics
from zerojax import distributed as distributed
from zerojax import errors as errors
from zerojax import launch as launch
from zerojax import layout as layout
from zerojax import xla_flags as xla_flags
from zerojax._src.comm.gather import ShardedParam as ShardedParam
from zerojax._src.comm.gather import gather as gather
from zerojax._src.diagnostics.report import Report as Report
from zerojax._src.diagnostics.report import report as report
from zerojax._src.records.config import ZeroConfig as ZeroConfig
from zerojax._src.records.mesh import make_mesh as make_mesh
from zerojax._src.records.policy import Policy as Policy
from zerojax._src.records.spec import ZeroState as ZeroState
from zerojax._src.records.zeropp import ZeroPP as ZeroPP
from zerojax._src.remat.remat import Remat as Remat
from zerojax._src.remat.remat import remat as remat
from zerojax._src.step.batch import batch_sharding as batch_sharding
from zerojax._src.step.batch import shard_batch as shard_batch
from zerojax._src.step.dropin import ZeroTransformation as ZeroTransformation
from zerojax._src.step.eval_step import EvalStep as EvalStep
from zerojax._src.step.eval_step import eval_step as eval_step
from zerojax._src.step.gather_state import gather_opt_state as gather_opt_state
from zerojax._src.step.gather_state import gather_params as gather_params
from zerojax._src.step.grad import value_and_grad as value_and_grad
from zerojax._src.step.init_from import init_from as init_from
from zerojax._src.step.state import init as init
from zerojax._src.step.steps import TrainStep as TrainStep
from zerojax._src.step.steps import train_step as train_step
from zerojax._src.step.transform import zero as zero
from zerojax._src.step.update import apply_gradients as apply_gradients

__version__ = "0.1.0"

__all__ = [
  # the stages and their settings
  "zero",
  "ZeroTransformation",
  "ZeroConfig",
  "Policy",
  "ZeroPP",
  # state
  "init",
  "init_from",
  "ZeroState",
  "gather_params",
  "gather_opt_state",
  # steps
  "train_step",
  "TrainStep",
  "eval_step",
  "EvalStep",
  "value_and_grad",
  "apply_gradients",
  # inside a loss: stage 3's gather, what a block keeps
  "gather",
  "ShardedParam",
  "remat",
  "Remat",
  # mesh and batch
  "make_mesh",
  "shard_batch",
  "batch_sharding",
  # what a step costs, measured
  "report",
  "Report",
]

_ON_FIRST_USE = ("checkpoint", "linen", "nnx")


def __getattr__(name: str):
  """``zerojax.checkpoint``, ``zerojax.linen`` and ``zerojax.nnx`` are
  imported when first used, so a script that never uses them loads neither
  Orbax nor Flax."""
  if name in _ON_FIRST_USE:
    import importlib

    return importlib.import_module(f"zerojax.{name}")
  raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
