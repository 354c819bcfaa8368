"""Helpers for testing code that uses unicoll: :func:`spawn` runs a function on every rank of a
small world of new processes (forked from a preloaded server; an MPI job on the ``mpi``
backend) and raises the first rank's error here. Imported on first use (``uc.testing``), so
``import unicoll`` starts no machinery for processes."""

from __future__ import annotations

from .report import SpawnError, SpawnTimeout
from .spawn import spawn

__all__ = ["SpawnError", "SpawnTimeout", "spawn"]
