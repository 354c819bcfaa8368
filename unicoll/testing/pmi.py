"""A PMI-1 server for the MPI ranks that :func:`unicoll.testing.spawn` forks itself.

MPICH's ranks learn their rank, the world's size and each other's addresses from their process
manager through PMI, a line protocol over the socket named by ``PMI_FD`` (MPICH's "simple" PMI,
version 1: ``cmd=init``, ``cmd=put``, ``cmd=barrier_in``, ``cmd=get``, ``cmd=finalize``...). An
MPI launcher (hydra, ``mpiexec``) serves it to processes it starts fresh; :class:`PmiServer`
serves it, from this process, to ranks forked from the warm server, so a world of MPI ranks
starts without a launcher and without a fresh interpreter per rank. Every rank runs on this
host (the process mapping says so, and MPICH then talks through shared memory).
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import subprocess
import threading

_JOBS = itertools.count()
"""Numbers the servers of this process (each job's key-value space gets its own name)."""


class PmiServer:
    """Serve PMI-1 to ``size`` ranks, one socket each (:attr:`rank_sockets`, to be handed to the
    ranks' processes), each on a thread of this process, until :meth:`close`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.kvsname = f"unicoll-{os.getpid()}-{next(_JOBS)}"
        self._values: dict[str, str] = {"PMI_process_mapping": f"(vector,(0,1,{size}))"}
        self._barrier = threading.Condition()
        self._arrived = 0
        self._round = 0
        self._closed = False
        pairs = [socket.socketpair() for _ in range(size)]
        self._ours = [ours for ours, _ in pairs]
        self.rank_sockets = [theirs for _, theirs in pairs]
        self._threads = [
            threading.Thread(target=self._serve, args=(sock,), name=f"unicoll-pmi-rank{rank}", daemon=True)
            for rank, sock in enumerate(self._ours)
        ]
        for thread in self._threads:
            thread.start()

    def rank_env(self, rank: int) -> dict[str, str]:
        """What rank ``rank`` is told as hydra tells it: its rank and the job's size (PMI's), and
        the node's size; the rank adds ``PMI_FD``, its socket's number in its own process."""
        size = str(self.size)
        return {"PMI_RANK": str(rank), "PMI_SIZE": size, "MPI_LOCALNRANKS": size, "MPI_LOCALRANKID": str(rank)}

    def close(self) -> None:
        """Stop serving: wake every thread (a rank waiting in a barrier too) and close the sockets."""
        with self._barrier:
            self._closed = True
            self._barrier.notify_all()
        for sock in [*self._ours, *self.rank_sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already (a rank's socket once handed over), or its peer gone
            sock.close()
        for thread in self._threads:
            thread.join()

    def _serve(self, sock: socket.socket) -> None:
        """Answer one rank's commands until it finalizes, aborts, or its socket closes."""
        with sock.makefile("rb") as lines:
            for line in lines:
                fields = dict(field.split("=", 1) for field in line.decode().split() if "=" in field)
                command = fields.get("cmd", "")
                if command == "abort":
                    return  # the rank exits with its code; spawn sees it and stops the others
                answer = self._answer(command, fields)
                if answer is None:
                    return  # closed while the rank waited in a barrier
                try:
                    sock.sendall(f"{answer}\n".encode())
                except OSError:
                    return
                if command == "finalize":
                    return

    def _answer(self, command: str, fields: dict[str, str]) -> str | None:
        """The reply to one command (None when the server closed before it could be given)."""
        if command == "init":
            return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
        if command == "get_maxes":
            return "cmd=maxes rc=0 kvsname_max=256 keylen_max=256 vallen_max=1024"
        if command == "get_appnum":
            return "cmd=appnum rc=0 appnum=0"
        if command == "get_my_kvsname":
            return f"cmd=my_kvsname rc=0 kvsname={self.kvsname}"
        if command == "get_universe_size":
            return f"cmd=universe_size rc=0 size={self.size}"
        if command == "put":
            with self._barrier:
                self._values[fields.get("key", "")] = fields.get("value", "")
            return "cmd=put_result rc=0"
        if command == "get":
            with self._barrier:
                value = self._values.get(fields.get("key", ""))
            if value is None:
                return "cmd=get_result rc=-1 msg=key_not_found"
            return f"cmd=get_result rc=0 value={value}"
        if command == "barrier_in":
            return "cmd=barrier_out rc=0" if self._wait_for_all() else None
        if command == "finalize":
            return "cmd=finalize_ack rc=0"
        return f"cmd={command}_result rc=-1 msg=unknown_command"

    def _wait_for_all(self) -> bool:
        """Wait until every rank has entered this barrier; False if the server closed first."""
        with self._barrier:
            round_ = self._round
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived, self._round = 0, self._round + 1
                self._barrier.notify_all()
            while self._round == round_ and not self._closed:
                self._barrier.wait()
            return self._round != round_


@functools.cache
def serves_this_mpi() -> bool:
    """Whether the ranks' MPI speaks the PMI that :class:`PmiServer` serves: MPICH's (its
    launcher is hydra, which says so in ``mpiexec --version``); Open MPI's ranks use PMIx."""
    from ..launch.mpi import find_mpiexec

    try:
        shown = subprocess.run([find_mpiexec(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in shown
