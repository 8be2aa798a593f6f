"""Run a command as P local processes with D fake CPU devices each::

    python -m zerojax.launch -n 2 -d 4 -- python my_script.py

See :mod:`zerojax._src.runtime.launch`."""

from zerojax._src.runtime.launch import free_port as free_port
from zerojax._src.runtime.launch import launch as launch
from zerojax._src.runtime.launch import main as main
from zerojax._src.runtime.launch import xla_flags as xla_flags

__all__ = ["free_port", "launch", "main", "xla_flags"]

if __name__ == "__main__":
  main()
