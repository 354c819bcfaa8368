"""Starting worlds of processes on this machine: :mod:`~unicoll.launch.local` (``unicoll run``,
one process per rank) and :mod:`~unicoll.launch.mpi` (``unicoll run --mpi``, an MPI job), with
what they share in :mod:`~unicoll.launch.process`. Nothing here imports a framework."""
