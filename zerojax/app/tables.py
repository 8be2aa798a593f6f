"""Markdown tables as the planner and the benchmarks print them."""

from __future__ import annotations


def markdown(head, rows) -> str:
  """``head`` and ``rows`` (sequences of strings) as a markdown table,
  each column right-aligned to its widest cell."""
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
  line = lambda cols: (
    "| " + " | ".join(c.rjust(w) for c, w in zip(cols, widths)) + " |"
  )
  return "\n".join(
    [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    + [line(r) for r in rows]
  )
