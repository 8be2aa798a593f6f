"""What a loss's backward pass keeps from its forward pass, by memory space.

ZeRO-R's subject: once the model state is sharded, the saved activations
(the residuals autodiff keeps between forward and backward) bound the
batch and the context. They are read from
:func:`jax.ad_checkpoint.print_saved_residuals`, JAX's public view of them:
one line per residual, its type (``f32[4,32,64]``, ``f32<host>[...]`` for
one a checkpoint policy offloads to host memory) and where it comes from.
The loss's own arguments (params, batch) are live anyway and not counted.

The figures are for the program as traced on one device's batch with the
whole (gathered) params. Splits over a model axis are applied by the
compiler later: Pa's (:class:`zerojax.Remat` ``partition=``) are counted,
from what each block reports splitting while traced (its saved input and
the tensors it keeps are ``1/M`` per device); tensor parallelism's splits
of the block's inside are not (the GPT formula,
``zerojax.plan.saved_activations``, has those).
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import jax
from jax import ad_checkpoint

from zerojax._src.remat import remat as _remat
from zerojax._src.remat.recording import recording

# "f32[2,32,64]", "bf16<host>[3,2,32,64]", "bool[]"
_AVAL = re.compile(r"^(bool|bf16|[fiuc]\d+(?:_\w+)?)(?:<(\w+)>)?\[([\d,]*)\]\s")


def _itemsize(short: str) -> int:
  if short == "bool":
    return 1
  if short == "bf16":
    return 2
  return int(re.match(r"[fiuc](\d+)", short).group(1)) // 8


def parse(text: str) -> dict:
  """Totals of ``print_saved_residuals`` output: bytes on the device and in
  host memory, the part that layer scans stack (``scan``), the count, and
  the lines that could not be read (``unread``, e.g. PRNG keys)."""
  out = {
    "device": 0,
    "host": 0,
    "scan": 0,
    "count": 0,
    "unread": [],
    "lines": [],
  }
  for line in text.splitlines():
    line = line.strip()
    if not line or "from the argument" in line:
      continue
    m = _AVAL.match(line)
    if m is None:
      out["unread"].append(line[:120])
      continue
    short, space, dims = m.groups()
    shape = [int(d) for d in dims.split(",") if d]
    nbytes = math.prod(shape) * _itemsize(short)
    where = "host" if space and "host" in space else "device"
    out[where] += nbytes
    out["count"] += 1
    if "output of scan" in line:
      out["scan"] += nbytes
    out["lines"].append(
      (tuple(shape), _itemsize(short), where, "output of scan" in line)
    )
  return out


def apply_splits(out: dict, splits) -> dict:
  """``out`` (from :func:`parse`) with each Pa-split tensor (block input or
  kept tensor) counted at ``1/shards``: the residual of its shape (stacked
  over a scan's layers, or alone) is found among the lines, each line used
  once."""
  lines = list(out.get("lines", []))
  out["partitioned"] = 0
  for split in splits:
    item = split.dtype.itemsize
    match = next(
      (
        ln
        for ln in lines
        if ln[3] and ln[0][1:] == split.shape and ln[1] == item
      ),
      None,
    ) or next(
      (ln for ln in lines if ln[0] == split.shape and ln[1] == item), None
    )
    if match is None:
      continue
    lines.remove(match)
    layers = match[0][0] if match[0][1:] == split.shape else 1
    cut = int((1 - 1 / split.shards) * math.prod(split.shape) * item * layers)
    out[match[2]] -= cut
    out["scan"] -= cut if match[3] else 0
    out["partitioned"] += cut
  return out


def saved_residuals(fn, *args, axes: dict | None = None) -> dict:
  """``fn(*args)``'s saved residuals (see :func:`parse`; ``partitioned``:
  the bytes Pa takes off), or ``{"error": ...}`` when this JAX version's
  printout cannot be read (a limit of zerojax, not of ``fn``).

  ``axes``: mesh axis sizes (``{"data": 4, "model": 2}``) that
  :class:`zerojax.Remat` blocks split their inputs over; ``fn`` is traced
  with no mesh in context."""
  buf = io.StringIO()
  try:
    with contextlib.redirect_stdout(buf), recording(axes) as splits:
      ad_checkpoint.print_saved_residuals(fn, *args)
  except _remat.RematError:
    raise  # the model's own setting: said as it is
  except Exception as e:  # noqa: BLE001 -- a figure of the report, not the step
    # e.g. a loss that calls collectives over the mesh's axes: it runs
    # inside zerojax's step, not on its own.
    return {
      "error": f"the loss could not be traced on its own for its "
      f"saved activations ({type(e).__name__}: "
      f"{str(e)[:200]})"
    }
  out = parse(buf.getvalue())
  if out["count"] == 0 and out["unread"]:
    return {
      "error": f"zerojax cannot read jax.ad_checkpoint."
      f"print_saved_residuals on JAX {jax.__version__} "
      f"(first line: {out['unread'][0]!r})"
    }
  return apply_splits(out, splits)
