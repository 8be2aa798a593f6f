"""The planner for the reference GPT (part of the application)::

    python -m zerojax.plan --params 7.5e9 --devices 64

:mod:`zerojax.cost` (library) prices any params; this namespace adds the
GPT: its saved activations, its working set, the largest one that fits,
and the command line. See :mod:`zerojax.app.planner`.
"""

from zerojax.app.planner import GB as GB
from zerojax.app.planner import HARDWARE as HARDWARE
from zerojax.app.planner import StagePlan as StagePlan
from zerojax.app.planner import ZEROPP_ROWS as ZEROPP_ROWS
from zerojax.app.planner import abstract_gpt as abstract_gpt
from zerojax.app.planner import comm_time as comm_time
from zerojax.app.planner import largest_fitting as largest_fitting
from zerojax.app.planner import main as main
from zerojax.app.planner import plan_stage as plan_stage
from zerojax.app.planner import saved_activations as saved_activations
from zerojax.app.planner import working_set as working_set
from zerojax.app.planner import zeropp_comm as zeropp_comm

__all__ = ["GB", "HARDWARE", "StagePlan", "ZEROPP_ROWS", "abstract_gpt", "comm_time",
           "largest_fitting", "main", "plan_stage", "saved_activations",
           "working_set", "zeropp_comm"]

if __name__ == "__main__":
  main()
