"""The planner for the reference GPT (part of the application)::

    python -m zerojax.plan --params 7.5e9 --devices 64

:mod:`zerojax.cost` (library) prices any params; this namespace adds the
GPT: its saved activations, its working set, the largest one that fits
and what stops a larger one (:mod:`zerojax.app.planner`), and the command
line (:mod:`zerojax.app.plan_cli`).
"""

from zerojax.app.plan_cli import main
from zerojax.app.planner import abstract_gpt as abstract_gpt
from zerojax.app.planner import gpt_activations as gpt_activations
from zerojax.app.planner import largest_fitting as largest_fitting
from zerojax.app.planner import plan_gpt as plan_gpt
from zerojax.app.planner import predicted_peak as predicted_peak
from zerojax.app.planner import what_binds as what_binds
from zerojax.app.planner import working_set as working_set

__all__ = [
  "abstract_gpt",
  "gpt_activations",
  "largest_fitting",
  "plan_gpt",
  "predicted_peak",
  "what_binds",
  "working_set",
]

if __name__ == "__main__":
  main()
