"""The ``mpi`` backend: MPI collectives through mpi4py."""
