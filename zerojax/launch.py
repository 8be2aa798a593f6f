"""Processes: run a command as P local processes with D fake CPU devices
each, and hand this process's free C heap back to the OS::

    python -m zerojax.launch -n 2 -d 4 -- python my_script.py
"""

from zerojax._src.runtime.host_heap import (
  release_free_heap as release_free_heap,
)
from zerojax._src.runtime.launch import free_port as free_port
from zerojax._src.runtime.launch import launch as launch
from zerojax._src.runtime.launch import main

__all__ = ["free_port", "launch", "release_free_heap"]

if __name__ == "__main__":
  main()
