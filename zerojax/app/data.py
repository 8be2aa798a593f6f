"""The embedded corpus: CPython's ``pydoc_data.topics``, as bytes.

About 470 KB of English shipped with every CPython, so the main job needs no
download. Tokens are bytes (vocabulary 256). The last ``val_fraction`` of the
text is held out.

Batches are a pure function of ``(seed, step)``: any step's batch can be
recomputed after a restart without saving a data-loader state.
"""

from __future__ import annotations

import numpy as np


def corpus_bytes() -> np.ndarray:
  from pydoc_data import topics

  text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def split(tokens: np.ndarray, val_fraction: float = 0.1):
  cut = int(len(tokens) * (1 - val_fraction))
  return tokens[:cut], tokens[cut:]


def batch_at(
  tokens: np.ndarray,
  *,
  seed: int,
  step: int,
  batch: int,
  seq_len: int,
  rows: slice = slice(None),
) -> dict[str, np.ndarray]:
  """The ``step``-th batch: ``batch`` random windows of ``seq_len + 1``.

  ``rows`` selects the rows this process feeds (see
  :func:`zerojax.distributed.local_rows`): every process draws the same
  window starts, and reads only its own windows.
  """
  if len(tokens) <= seq_len + 1:
    raise ValueError(
      f"corpus of {len(tokens)} tokens is shorter than "
      f"seq_len + 1 = {seq_len + 1}."
    )
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)[rows]
  windows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(
    np.int32
  )
  return {"x": windows[:, :-1], "y": windows[:, 1:]}


def decode(tokens) -> str:
  return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode(
    "utf-8", errors="replace"
  )
