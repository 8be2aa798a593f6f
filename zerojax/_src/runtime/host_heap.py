"""The C heap's free pages handed back to the OS after one-off work.

Building a state compiles programs that run once (the layout, the master
copy, the optimizer's init), and a step compiles on its first call. XLA's
compiler takes its working memory from ``malloc``, and glibc keeps what is
freed in its arenas: the process holds that memory (its resident set) for
the rest of the run although nothing uses it. glibc's ``malloc_trim(0)``
returns it; other C libraries have no such call, and there this does
nothing. It acts on the whole process, so zerojax never calls it on its
own: a training script calls :func:`zerojax.launch.release_free_heap`
after ``init`` and after a step's first call.
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(None)  # the C library this process runs on
  except OSError:
    return None
  trim = getattr(libc, "malloc_trim", None)
  if trim is not None:
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
  return trim


def release_free_heap() -> bool:
  """Returns the heap's free pages to the OS; whether any were (``False``
  also where the C library has no ``malloc_trim``)."""
  trim = _malloc_trim()
  return bool(trim(0)) if trim is not None else False
