"""What mpiexec starts for each rank of a :func:`unicoll.testing.spawn` MPI job whose ranks are
forked from the warm server (:mod:`unicoll.testing.mpi_server`).

Run by its path with ``python -S``, so that it imports nothing of unicoll nor of site-packages:
it hands the server its standard streams and the socket of MPI's process manager (``PMI_FD``,
which hydra opened for this rank), with its environment and working directory, over the
server's Unix socket, then waits for the forked rank's wait status and ends as the rank ended
(the same exit code, or killed by the same signal), so that mpiexec sees the rank end as it
would a fresh interpreter's. If this process is killed first (mpiexec stopping the job), its
connection closes and the server kills the rank.

    python -S mpi_stub.py SERVER_SOCKET JOB_FILE
"""

import os
import pickle
import socket
import sys


def main(server: str, job: str) -> int:
    """Have the server fork this rank; return its exit code (or end by its signal)."""
    fds = [0, 1, 2, int(os.environ["PMI_FD"])]
    request = {"environ": dict(os.environ), "cwd": os.getcwd(), "job": job}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(server)
        socket.send_fds(conn, [pickle.dumps(request)], fds)
        status = b""
        while len(status) < 4:
            chunk = conn.recv(4 - len(status))
            if not chunk:
                print(f"unicoll.testing: the MPI rank server at {server} closed the connection", file=sys.stderr)
                return 1
            status += chunk
    code = os.waitstatus_to_exitcode(int.from_bytes(status, "little"))
    if code < 0:
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
