"""What a step costs: one cost model (``cost``) read by the planner, the
report and the layout table; compiled-HLO reading (``hlo``)."""
