"""Notice that a peer process is gone, where gloo does not say so.

A process that dies closes its sockets, and gloo fails at once every transfer posted after
that. Not the one it is in the middle of: gloo's TCP pair fails the buffers that are posted or
pending when its connection breaks, but not the one it is reading into or writing from at that
moment (``Pair::signalException`` in gloo/transport/tcp/pair.cc), whose wait then runs until
the timeout. A large all-to-all spends most of its time in that state, so a peer killed during
one left its survivors waiting the whole timeout: in 2 of 4 runs of 64 MiB all-to-alls on 2
ranks, and in every run when the survivor was writing to the peer as it died.

:class:`PeerWatch` adds one TCP connection from each rank to rank 0, on which nothing is sent
after a short greeting: its end says that the process at the other end is gone. Rank 0 watches
its connections from a thread and tells every other rank which rank it lost; the other ranks
read their one connection only when asked (:meth:`PeerWatch.lost`), which the gloo backend does
when a transfer has waited longer than a slice, so calls that complete within one never touch it.
"""

from __future__ import annotations

import os
import secrets
import selectors
import socket
import struct
import threading
import weakref
from collections.abc import Callable, Iterable

from unicoll.backends.rendezvous import listen, remaining
from unicoll.errors import TransportError, TransportPeerLostError, TransportTimeoutError

_GREETING = struct.Struct(">qi")
"""What a rank sends rank 0 once connected: the token rank 0 shared over gloo, and its rank."""

_NOTICE = struct.Struct(">i")
"""What rank 0 sends the other ranks when it loses one: that rank's number."""

_open: weakref.WeakSet[PeerWatch] = weakref.WeakSet()
"""Every watch not yet closed, so a forked child can let go of their sockets."""


class PeerWatch:
    """This rank's connections to the watch: rank 0's to every other rank (read by a thread),
    or another rank's one connection to rank 0. Made by :func:`start_watch`."""

    def __init__(self, rank: int, peers: dict[int, socket.socket]) -> None:
        self._rank = rank
        self._peers = peers
        self._lost: set[int] = set()
        self._unread = b""
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        if rank == 0:
            self._wake = os.pipe()
            self._thread = threading.Thread(target=self._watch, name="unicoll-peer-watch", daemon=True)
            self._thread.start()
        else:
            peers[0].setblocking(False)
        _open.add(self)

    def lost(self, ranks: Iterable[int]) -> int | None:
        """The first of the world ``ranks`` known to be gone (its connection closed), or None."""
        if self._rank != 0:
            self._read_notices()
        return next((rank for rank in ranks if rank in self._lost), None)

    def _read_notices(self) -> None:
        """Take in what rank 0 sent: lost ranks, or the end of the connection (rank 0 is gone)."""
        while self._peers and 0 not in self._lost:
            try:
                data = self._peers[0].recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost.add(0)
                return
            self._unread += data
            whole = len(self._unread) - len(self._unread) % _NOTICE.size
            self._lost.update(rank for (rank,) in _NOTICE.iter_unpack(self._unread[:whole]))
            self._unread = self._unread[whole:]

    def _watch(self) -> None:
        """Rank 0's thread: wait for a connection to end, record its rank, tell the others."""
        assert self._wake is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake[0], selectors.EVENT_READ, None)
            for rank, conn in self._peers.items():
                selector.register(conn, selectors.EVENT_READ, rank)
            while True:
                for key, _ in selector.select():
                    if key.data is None:  # close()
                        return
                    selector.unregister(key.fileobj)
                    self._lost.add(key.data)
                    self._tell_others(key.data)

    def _tell_others(self, gone: int) -> None:
        """Send every rank still connected the number of the rank that is gone."""
        for rank, conn in list(self._peers.items()):
            if rank not in self._lost:
                try:
                    conn.sendall(_NOTICE.pack(gone))
                except OSError:
                    pass  # that one is gone too; its own end of file says so

    def close(self) -> None:
        """Stop watching and close the connections (the peers then see this rank as gone)."""
        if self._thread is not None and self._wake is not None:
            os.write(self._wake[1], b"x")
            self._thread.join()
        self._release()

    def _release(self) -> None:
        """Close this process's copies of the sockets and the thread's pipe, telling no one."""
        for conn in self._peers.values():
            conn.close()
        self._peers = {}
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        _open.discard(self)


def _release_in_child() -> None:
    """In a forked child: drop the inherited copies, so that a parent that dies still closes
    its connections (a socket stays open while any process holds it)."""
    for watch in list(_open):
        watch._thread = None
        watch._release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_release_in_child)


def start_watch(
    rank: int, world_size: int, addr: str, deadline: float, share: Callable[[list[int]], list[int]]
) -> PeerWatch | None:
    """Connect this rank to the watch: rank 0 listens on ``addr`` (``MASTER_ADDR``), and
    ``share`` (a broadcast from rank 0 over the process group) hands its port and a random
    token to the others, which connect and greet it. Every rank must call this. None, on every
    rank, when rank 0 cannot listen on ``addr``. TransportTimeoutError when the ranks have not
    all connected by ``deadline`` (a ``time.monotonic()`` value); a rank that cannot connect
    raises the TransportError of its socket's failure (:func:`_connect_failure`)."""
    listener = _listener(addr) if rank == 0 else None
    mine = [listener.getsockname()[1], secrets.randbits(63)] if listener is not None else [0, 0]
    port, token = share(mine)
    if not port:
        return None
    if listener is not None:
        return PeerWatch(rank, _accept_peers(listener, world_size, token, deadline))
    try:
        conn = socket.create_connection((addr, port), timeout=remaining(deadline))
        conn.sendall(_GREETING.pack(token, rank))
    except OSError as exc:
        kind = _connect_failure(exc)
        raise kind(f"peer watch: rank {rank} cannot connect to rank 0 at {addr}:{port}: {exc}") from exc
    return PeerWatch(rank, {0: conn})


def _connect_failure(exc: OSError) -> type[TransportError]:
    """The kind of a failure to reach rank 0, by the socket's exception: rank 0 timed out, or
    refused or dropped the connection (it is gone), or something else failed."""
    if isinstance(exc, TimeoutError):
        return TransportTimeoutError
    if isinstance(exc, ConnectionError):
        return TransportPeerLostError
    return TransportError


def _listener(addr: str) -> socket.socket | None:
    """A socket listening on ``addr``, on a port of the system's choosing; None when ``addr`` is
    not an address of this machine (then no rank watches)."""
    try:
        return listen(addr, 0)
    except OSError:
        return None


def _accept_peers(listener: socket.socket, world_size: int, token: int, deadline: float) -> dict[int, socket.socket]:
    """Rank 0: accept a connection from every other rank, each greeting with ``token`` and its
    rank; connections that do not are closed. TransportTimeoutError at ``deadline``."""
    peers: dict[int, socket.socket] = {}
    with listener:
        while len(peers) < world_size - 1:
            try:
                listener.settimeout(remaining(deadline))
                conn, _ = listener.accept()
                conn.settimeout(remaining(deadline))
                greeting = _read_greeting(conn)
            except TimeoutError:
                missing = sorted(set(range(1, world_size)) - set(peers))
                raise TransportTimeoutError(
                    f"peer watch: rank(s) {missing} did not connect to rank 0 at {listener.getsockname()}; timed out"
                ) from None
            if greeting is None or greeting[0] != token or not 0 < greeting[1] < world_size or greeting[1] in peers:
                conn.close()
                continue
            conn.settimeout(None)
            peers[greeting[1]] = conn
    return peers


def _read_greeting(conn: socket.socket) -> tuple[int, int] | None:
    """The token and rank ``conn`` sends first; None when it closes before sending them."""
    data = b""
    while len(data) < _GREETING.size:
        try:
            chunk = conn.recv(_GREETING.size - len(data))
        except ConnectionError:
            return None
        if not chunk:
            return None
        data += chunk
    return _GREETING.unpack(data)
