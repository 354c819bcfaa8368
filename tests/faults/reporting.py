"""How the fault scripts inject.py and mpi_jobs.py report what each rank saw, and how their
tests read it back.

A rank appends one JSON line per report to its own file in the folder ``$FAULT_REPORTS`` (the
tests make one per world), or prints it where the variable is unset (a run by hand). A file, not
the standard output: an MPI job that aborts (``MPI_Abort`` after a rank's uncaught exception) is
torn down by its launcher, which may drop what a rank printed just before; a line written to a
file is there once ``write`` returns, whatever happens to the process next.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

FOLDER = "FAULT_REPORTS"
"""The environment variable that names the folder of the reports."""


def write(rank: int, fields: dict[str, object]) -> None:
    """Report ``fields`` for ``rank`` (see the module's docstring)."""
    line = json.dumps({"rank": rank, **fields}) + "\n"
    folder = os.environ.get(FOLDER)
    if folder is None:
        sys.stdout.write(line)  # one write: mpiexec may interleave writes
        sys.stdout.flush()
        return
    with open(Path(folder) / f"rank{rank}.jsonl", "a") as file:
        file.write(line)


def read(folder: Path, ranks: int = 2) -> dict[int, list[dict]]:
    """Each rank's reports from ``folder``, in order (none for a rank that wrote none)."""
    reports: dict[int, list[dict]] = {}
    for rank in range(ranks):
        path = folder / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        reports[rank] = [json.loads(line) for line in lines]
    return reports
