"""The ``mpi`` backend: MPI collectives through mpi4py, CPU arrays of numpy and torch.

The rank and the world size come from MPI itself (``COMM_WORLD``), so the job is started by
an MPI launcher: ``mpiexec``/``mpirun``, ``srun``, or ``unicoll run --mpi``. The ``mpi`` extra
installs mpi4py and the MPICH wheel (``pip install 'unicoll[mpi]'``); mpi4py built against a
system MPI works as well. Nothing here imports mpi4py until the backend is probed or started.
"""

from __future__ import annotations

import os

from ..arrays import DTYPES
from ..spec import OPS
from .base import Backend, Capabilities

CAPABILITIES = Capabilities(
    ops=frozenset(OPS),
    dtypes=frozenset(DTYPES),
    devices=frozenset({"cpu"}),
    libraries=frozenset({"numpy", "torch"}),
)

#: Variables in which launchers state the world size: torchrun and ``unicoll run``, MPICH's
#: and Intel MPI's hydra, Open MPI.
_LAUNCHER_WORLD_SIZES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


class MpiFactory:
    """Registered as ``mpi``: usable wherever mpi4py imports and finds an MPI library.

    Probing imports ``mpi4py.MPI``, which initializes MPI in this process (mpi4py's default;
    a process started without a launcher becomes a world of one, MPI's singleton init).
    """

    capabilities = CAPABILITIES

    def probe(self) -> str | None:
        try:
            from mpi4py import MPI  # noqa: F401
        except Exception as exc:  # ImportError, or RuntimeError when no MPI library loads
            reason = f"{type(exc).__name__}: {exc}"
            return f"mpi4py with an MPI library is not importable ({reason}); pip install 'unicoll[mpi]'"
        return None

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        from mpi4py import MPI

        from .mpi_comm import MpiBackend

        _check_launch(MPI.COMM_WORLD.Get_size())
        return MpiBackend(CAPABILITIES, timeout=timeout)


def _check_launch(mpi_world_size: int) -> None:
    """Refuse a world that MPI does not see: N processes started without an MPI launcher (each
    a singleton world of one), or an mpiexec of another MPI library than mpi4py's."""
    for name in _LAUNCHER_WORLD_SIZES:
        stated = os.environ.get(name, "")
        if stated.isdigit() and int(stated) != mpi_world_size:
            raise RuntimeError(
                f"unicoll.init: backend 'mpi': MPI's COMM_WORLD has {mpi_world_size} rank(s) but ${name} is {stated}; "
                "start the ranks with an MPI launcher (mpiexec, mpirun, srun, or `unicoll run --mpi`) "
                "of the MPI library that mpi4py loads"
            )
