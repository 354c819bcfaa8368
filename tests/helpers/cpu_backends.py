"""The CPU backends as a test parameter: gloo, and mpi where it can run here (elsewhere skipped
with its probe's reason). Probing imports mpi4py, which starts MPI in the importing process."""

from __future__ import annotations

import pytest

from unicoll.backends.mpi.mpi import MpiFactory

MPI_REASON = MpiFactory().probe()
"""Why mpi cannot run here, or None where it can."""

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(MPI_REASON is not None, reason=f"mpi: {MPI_REASON}"))]
"""``gloo`` and ``mpi`` for ``pytest.mark.parametrize``."""
