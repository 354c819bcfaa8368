"""The ``mpi`` backend: MPI collectives through mpi4py, CPU arrays of numpy and torch.

The rank and the world size come from MPI itself (``COMM_WORLD``), so the job is started by
an MPI launcher: ``mpiexec``/``mpirun``, ``srun``, or ``unicoll run --mpi``. The ``mpi`` extra
installs mpi4py and the MPICH wheel (``pip install 'unicoll[mpi]'``); mpi4py built against a
system MPI works as well. Nothing here imports mpi4py until the backend is probed or started.
"""

from __future__ import annotations

import os
import sys

from unicoll.arrays import DTYPES
from unicoll.backends.base import Backend, Capabilities, reductions
from unicoll.libraries import carried_by

CAPABILITIES = Capabilities(
    ops=None,  # every operator the base class composes
    dtypes=frozenset(DTYPES),
    devices=frozenset({"cpu"}),
    libraries=carried_by(frozenset({"numpy", "torch"})),
    reductions=reductions(frozenset(DTYPES)),
)

#: Variables in which launchers state the world size: torchrun and ``unicoll run``, MPICH's
#: and Intel MPI's hydra, Open MPI.
_LAUNCHER_WORLD_SIZES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")

#: Variables in which MPICH's hydra and Open MPI state how many ranks run on this node and in the job.
_NODE_AND_JOB_SIZES = (("MPI_LOCALNRANKS", "PMI_SIZE"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"))


class MpiFactory:
    """Registered as ``mpi``: usable wherever mpi4py imports and finds an MPI library.

    Probing imports ``mpi4py.MPI``, which initializes MPI in this process (mpi4py's default;
    a process started without a launcher becomes a world of one, MPI's singleton init).
    """

    capabilities = CAPABILITIES

    def probe(self) -> str | None:
        _loopback_when_single_node()
        try:
            from mpi4py import MPI  # noqa: F401
        except Exception as exc:  # ImportError, or RuntimeError when no MPI library loads
            reason = f"{type(exc).__name__}: {exc}"
            return f"mpi4py with an MPI library is not importable ({reason}); pip install 'unicoll[mpi]'"
        return None

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        """Start the backend; from then on this process aborts the MPI job when it exits failing
        (:mod:`unicoll.backends.mpi.abort`), so its peers do not wait for it until the timeout."""
        _loopback_when_single_node()
        from mpi4py import MPI

        from unicoll.backends.mpi.abort import abort_on_failure
        from unicoll.backends.mpi.transport import MpiBackend
        from unicoll.errors import TransportError, init_error

        world = MPI.COMM_WORLD
        _check_launch(world.Get_size())
        abort_on_failure()
        try:
            return MpiBackend(CAPABILITIES, timeout=timeout)
        except TransportError as exc:
            hint = "check that every rank of the MPI job calls init()"
            raise init_error(exc, "mpi", world.Get_rank(), world.Get_size(), timeout, hint) from exc


def _loopback_when_single_node() -> None:
    """Keep UCX, the network layer of MPICH's ch4 (the MPICH wheel's default), on the loopback
    interface when the launcher says that every rank of the job runs on this node and
    ``UCX_NET_DEVICES`` is unset: the ranks then listen on 127.0.0.1 instead of on every
    interface. Takes effect only before MPI starts (the first import of ``mpi4py.MPI``)."""
    if not sys.platform.startswith("linux"):
        return  # "lo" is Linux's name for the loopback interface
    for here, everywhere in _NODE_AND_JOB_SIZES:
        local = os.environ.get(here)
        if local and local == os.environ.get(everywhere):
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
            return


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
