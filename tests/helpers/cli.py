"""Output of unicoll's command line that several test modules read."""

from __future__ import annotations

import functools
import subprocess
import sys


@functools.cache
def info() -> str:
    """The output of ``python -m unicoll info`` in this process's environment, run once per
    session: it probes every backend (starting MPI for the mpi one), which takes about a second."""
    return subprocess.run([sys.executable, "-m", "unicoll", "info"], capture_output=True, text=True, check=True).stdout
