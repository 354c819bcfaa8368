"""Where the ranks of a multi-process world meet: ``MASTER_ADDR:MASTER_PORT``, read once, and
torch's TCPStore there.

Shared by the torch.distributed backends (whose process group starts from the store) and
``cupy-nccl`` (whose NCCL unique ids travel through it: :func:`share_bytes`). Rank 0 hosts the
store on a socket it binds to ``MASTER_ADDR:MASTER_PORT`` itself (:func:`listen`), so a loopback
address (the launcher's default) is never reachable from another machine. Once every rank has
reached the store (:func:`arrive`), the ranks know that they are all in this session and what
each said about itself. :func:`route_source` is the address of this machine that its route to
``MASTER_ADDR`` leaves from: where a rank's own transport listens (the ``gloo`` backend's
connections), so that the peers on other machines reach it as they reach rank 0. Nothing here
imports torch until a store is opened, and the store's failures leave as unicoll's
:class:`~unicoll.errors.TransportError` kinds.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import time
from datetime import timedelta
from typing import Any, NamedTuple

from unicoll.backends.torch.errors import torch_boundary
from unicoll.errors import TransportError, TransportTimeoutError

_POLL_S = 0.05
"""How often a rank retries connecting to rank 0's store while rank 0 is not listening yet."""

_SESSION_KEY = "unicoll/session"
"""The key under which rank 0 names each store it hosts (its pid and the store's number)."""

_ARRIVED = "unicoll/arrived/"
"""The prefix of the key under which each rank leaves its note in the store (:func:`arrive`)."""

_SESSION_WAIT_S = 1.0
"""How long a rank waits for that name on a store it connected to before it tries again."""

_hosted = itertools.count(1)
"""Rank 0: the number of each store this process hosts."""

_joined: bytes | None = None
"""Another rank: the name of the last store this process joined. After ``finalize()`` and
``init()``, a rank may reach rank 0's store of the session that is ending, with its keys of that
session, before rank 0 has finalized: a store under that name is passed over until rank 0
listens with its new one."""


class Meeting(NamedTuple):
    """An opened rendezvous: the store, the address the ranks meet at and, on rank 0, the
    descriptor of the store's listening socket (None elsewhere)."""

    store: Any  # torch.distributed.TCPStore
    addr: str
    listen_fd: int | None


def master_address(world_size: int) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)``; RuntimeError naming the missing variable."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"unicoll.init: environment variable {missing[0]} is not set; with WORLD_SIZE={world_size} "
            "every rank needs MASTER_ADDR and MASTER_PORT (`unicoll run` and torchrun set them)"
        )
    raw = os.environ["MASTER_PORT"]
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise RuntimeError(f"unicoll.init: $MASTER_PORT: expected a port number from 1 to 65535, got {raw!r}")
    return os.environ["MASTER_ADDR"], int(raw)


def listen(addr: str, port: int) -> socket.socket:
    """A listening socket bound to ``addr:port`` itself, so a loopback address (the launcher's
    default) is never reachable from another machine."""
    return socket.create_server((addr, port))


def stop_listening(fd: int) -> None:
    """Shut rank 0's store socket (``fd``, which the store owns and still holds open) down, so
    the port is free for the next session's store even where something keeps this session's
    store alive: ``torch._dynamo``, first imported while a session runs, keeps torch's default
    group, and with it the store, for good (docs/compile.md). Its connections stay; no rank
    connects to it once the session runs. The store closes the socket itself, if ever."""
    listener = socket.socket(fileno=os.dup(fd))
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError as exc:  # a system that refuses to shut a listening socket down: the port stays bound
        if exc.errno != errno.ENOTCONN:
            raise
    finally:
        listener.close()  # the copy only


def route_source(addr: str) -> str:
    """The address of this machine that the route to ``addr`` (a name or an IP address) leaves
    from, as the kernel chooses it for a UDP socket connected there (which sends nothing):
    ``addr`` itself when it is an address of this machine, a loopback address when ``addr`` is
    one. OSError when ``addr`` does not resolve or no route reaches it."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value), at least a millisecond:
    torch counts milliseconds, and a socket's timeout of 0 would make it non-blocking instead."""
    return max(deadline - time.monotonic(), 1e-3)


def init_hint(world_size: int) -> str:
    """What to check when ``init`` fails on a world that meets here: the ranks and the address."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (
        f"check that all {world_size} ranks start and call init() with the same MASTER_ADDR:MASTER_PORT "
        f"({where}), and that rank 0 can be reached there"
    )


@torch_boundary
def open_store(rank: int, world_size: int, timeout: float, deadline: float) -> Meeting:
    """The store every rank of the world meets at, by ``deadline`` (a ``time.monotonic()``
    value); its operations then wait at most ``timeout`` seconds.

    Rank 0 hosts a TCPStore on a socket it binds itself (see the module). It does not wait for
    the other ranks there: what comes next (the process group's creation, the first id) does.
    The other ranks wait for rank 0 to listen before they make their client, whose own retries
    could run past the deadline.
    """
    import torch.distributed as dist

    addr, port = master_address(world_size)
    if rank == 0:
        try:
            listen_fd = listen(addr, port).detach()
        except OSError as exc:
            raise TransportError(f"rendezvous: rank 0 cannot listen on {addr}:{port}: {exc}") from exc
        store = dist.TCPStore(
            addr, port, world_size, True, timedelta(seconds=timeout), master_listen_fd=listen_fd, wait_for_workers=False
        )
        store.set(_SESSION_KEY, f"{os.getpid()}-{next(_hosted)}".encode())
        return Meeting(store, addr, listen_fd)
    return Meeting(_join_new_store(addr, port, world_size, timeout, deadline), addr, None)


def _join_new_store(addr: str, port: int, world_size: int, timeout: float, deadline: float) -> Any:
    """A client of rank 0's store at ``addr:port`` that is not the store this process joined
    last (see :data:`_joined`), connected again every :data:`_POLL_S` until ``deadline``."""
    import torch.distributed as dist

    global _joined
    while True:
        _await_listener(addr, port, deadline)
        store = session = closed = None
        try:
            store = dist.TCPStore(addr, port, world_size, False, timedelta(seconds=remaining(deadline)))
            store.set_timeout(timedelta(seconds=min(_SESSION_WAIT_S, remaining(deadline))))
            session = store.get(_SESSION_KEY)
        except RuntimeError as exc:  # torch's store errors: no name yet, or the store closed under us
            closed = str(exc)  # (rank 0 leaving the session this rank finalized: "Connection reset by peer")
        if session is not None and session != _joined:
            _joined = session
            store.set_timeout(timedelta(seconds=timeout))
            return store
        del store
        if time.monotonic() + _POLL_S >= deadline:
            if session is not None:
                why = "still belongs to the session this rank finalized (rank 0 has not called init() again)"
            else:
                why = "never named its session (is it unicoll's rank 0?)"
                if closed:
                    why += f"; the last attempt ended with: {closed}"
            raise TransportTimeoutError(f"rendezvous: rank 0's store at {addr}:{port} {why}; timed out")
        time.sleep(_POLL_S)


def _await_listener(addr: str, port: int, deadline: float) -> None:
    """Return once something accepts connections at ``addr:port`` (rank 0's store); a
    TransportTimeoutError naming the address at ``deadline``."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=remaining(deadline)).close()
            return
        except OSError:
            if time.monotonic() + _POLL_S >= deadline:
                raise TransportTimeoutError(
                    f"rendezvous: rank 0's store at {addr}:{port} was not listening; timed out"
                ) from None
            time.sleep(_POLL_S)


@torch_boundary
def arrive(store: Any, rank: int, world_size: int, note: str, deadline: float) -> list[str]:
    """Every rank's ``note`` (what it tells the others about itself), in rank order, once every
    rank of the world has left its own in ``store``: then every rank has reached this session's
    store. TransportTimeoutError naming the ranks that had not by ``deadline`` (a
    ``time.monotonic()`` value)."""
    import torch.distributed as dist

    keys = [f"{_ARRIVED}{peer}" for peer in range(world_size)]
    store.set(keys[rank], note.encode())
    try:
        store.wait(keys, timedelta(seconds=remaining(deadline)))
    except dist.DistStoreError:
        missing = [peer for peer, key in enumerate(keys) if not store.check([key])]
        raise TransportTimeoutError(f"rendezvous: rank(s) {missing} did not reach rank 0's store; timed out") from None
    return [value.decode() for value in store.multi_get(keys)]


@torch_boundary
def share_bytes(store: Any, key: str, value: bytes | None) -> bytes:
    """``value``, given by the one rank that has it (None on the others), on every rank that
    calls this with ``key``: set in ``store``, or waited for there (at most the store's timeout).
    The bytes travel as they are: nothing is unpickled."""
    if value is not None:
        store.set(key, value)
        return value
    return store.get(key)
